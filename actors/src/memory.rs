//! One leg's KV memory: a region per layer and tensor-parallel rank (blocks `bytes_per_block`
//! apart, block 0 the null block's slot) and a generation table per group, in heap, shared or GPU
//! memory, with the placement the exchange plans READs against.
//!
//! A leg of TP size `T` keeps each layer once per rank, as `T` GPUs would: rank `r`'s region of
//! an attention layer holds the KV heads and block tokens [`KvShards`] gives it, a mamba layer's
//! region a contiguous share of the state. All ranks share the leg's block table.

use std::sync::Arc;

use pdkv_core::heads::KvShards;
use pdkv_core::plan::{LayerRegion, RegionLayout};
use pdkv_transport::region::{Region, RegionError};

use crate::engine::Model;

/// One leg's KV memory: a region per layer and rank, and a generation table per group.
#[derive(Debug)]
pub struct LegMemory {
    /// `layers[r * L + l]` holds layer `l`'s blocks on rank `r` ([`Self::layer`]).
    pub layers: Vec<Arc<Region>>,
    /// How the leg's ranks split the model's KV (heads, and tokens under DCP).
    pub shards: KvShards,
    /// `generations[g]` holds one `u32` per block id of group `g`.
    pub generations: Vec<Arc<Region>>,
    /// Placement of every layer and generation table (region ids, block stride, block count).
    pub regions: RegionLayout,
}

impl LegMemory {
    /// Heap memory for `capacity[g]` blocks per group (plus the null block, id 0) on the ranks
    /// of `shards`.
    pub fn heap(model: &Model, shards: KvShards, capacity: &[u32]) -> Self {
        Self::allocate(model, shards, capacity, |_, len| Ok(Region::heap(len)))
            .expect("heap regions cannot fail to allocate")
    }

    /// Shared memory (memfd) for `capacity[g]` blocks per group, so a peer on this host can map
    /// the regions; `leg` names the memfds.
    pub fn shared(model: &Model, shards: KvShards, capacity: &[u32], leg: &str) -> Result<Self, RegionError> {
        Self::allocate(model, shards, capacity, |name, len| {
            Region::shared(&format!("pdkv-{leg}-{name}"), len)
        })
    }

    /// KV blocks in the memory of AMD GPU `device` (HIP), generation tables in host memory
    /// (small, and written by the allocator through atomics).
    pub fn gpu(model: &Model, shards: KvShards, capacity: &[u32], device: u32) -> Result<Self, RegionError> {
        Self::allocate(model, shards, capacity, |name, len| {
            if name.starts_with("generations") {
                Ok(Region::heap(len))
            } else {
                Region::gpu(device, len)
            }
        })
    }

    fn allocate(
        model: &Model,
        shards: KvShards,
        capacity: &[u32],
        mut region: impl FnMut(&str, usize) -> Result<Region, RegionError>,
    ) -> Result<Self, RegionError> {
        let layout = model.layout();
        let count = layout.num_layers() * shards.tp() as usize;
        let mut layers = Vec::with_capacity(count);
        let mut placements = Vec::with_capacity(count);
        for rank in 0..shards.tp() {
            for (layer, &group) in layout.layer_groups().iter().enumerate() {
                let num_blocks = capacity[group] + 1;
                let bytes_per_block = model.bytes_per_block(layer, shards);
                let len = (u64::from(num_blocks) * bytes_per_block) as usize;
                let name = if shards.tp() == 1 {
                    format!("layer{layer}")
                } else {
                    format!("rank{rank}-layer{layer}")
                };
                layers.push(Arc::new(region(&name, len)?));
                placements.push(LayerRegion {
                    region: placements.len() as u32,
                    base_offset: 0,
                    bytes_per_block,
                    num_blocks,
                });
            }
        }
        let mut generations = Vec::with_capacity(capacity.len());
        for (group, &blocks) in capacity.iter().enumerate() {
            generations.push(Arc::new(region(
                &format!("generations{group}"),
                (blocks as usize + 1) * 4,
            )?));
        }
        Ok(LegMemory {
            layers,
            shards,
            generations,
            regions: RegionLayout {
                layers: placements,
                generations: Vec::new(),
                ranks: shards.tp(),
                dcp: shards.dcp(),
            }
            .with_generation_tables(capacity.len()),
        })
    }

    /// Layer `layer`'s region on rank `rank`.
    pub fn layer(&self, rank: u32, layer: usize) -> &Arc<Region> {
        &self.layers[rank as usize * (self.layers.len() / self.shards.tp() as usize) + layer]
    }

    /// Every region with the id [`Self::regions`] gives it: layers, then generation tables.
    pub fn registered_regions(&self) -> impl Iterator<Item = (u32, &Arc<Region>)> {
        let layers = self
            .regions
            .layers
            .iter()
            .map(|placement| placement.region)
            .zip(&self.layers);
        let tables = self.regions.generations.iter().copied().zip(&self.generations);
        layers.chain(tables)
    }

    /// Total bytes of KV memory.
    pub fn kv_bytes(&self) -> u64 {
        self.layers.iter().map(|region| region.len() as u64).sum()
    }
}
