//! One leg's KV memory: a region per layer (blocks `bytes_per_block` apart, block 0 the null
//! block's slot) and a generation table per group, in heap, shared or GPU memory, with the placement
//! the exchange plans READs against.

use std::sync::Arc;

use pdkv_core::plan::{LayerRegion, RegionLayout};
use pdkv_transport::region::{Region, RegionError};

use crate::engine::Model;

/// One leg's KV memory: a region per layer and a generation table per group.
#[derive(Debug)]
pub struct LegMemory {
    /// `layers[l]` holds layer `l`'s blocks.
    pub layers: Vec<Arc<Region>>,
    /// `generations[g]` holds one `u32` per block id of group `g`.
    pub generations: Vec<Arc<Region>>,
    /// Placement of every layer and generation table (region ids, block stride, block count).
    pub regions: RegionLayout,
}

impl LegMemory {
    /// Heap memory for `capacity[g]` blocks per group (plus the null block, id 0).
    pub fn heap(model: &Model, capacity: &[u32]) -> Self {
        Self::allocate(model, capacity, |_, len| Ok(Region::heap(len)))
            .expect("heap regions cannot fail to allocate")
    }

    /// Shared memory (memfd) for `capacity[g]` blocks per group, so a peer on this host can map
    /// the regions; `leg` names the memfds.
    pub fn shared(model: &Model, capacity: &[u32], leg: &str) -> Result<Self, RegionError> {
        Self::allocate(model, capacity, |name, len| {
            Region::shared(&format!("pdkv-{leg}-{name}"), len)
        })
    }

    /// KV blocks in the memory of AMD GPU `device` (HIP), generation tables in host memory
    /// (small, and written by the allocator through atomics).
    pub fn gpu(model: &Model, capacity: &[u32], device: u32) -> Result<Self, RegionError> {
        Self::allocate(model, capacity, |name, len| {
            if name.starts_with("generations") {
                Ok(Region::heap(len))
            } else {
                Region::gpu(device, len)
            }
        })
    }

    fn allocate(
        model: &Model,
        capacity: &[u32],
        mut region: impl FnMut(&str, usize) -> Result<Region, RegionError>,
    ) -> Result<Self, RegionError> {
        let layout = model.layout();
        let mut layers = Vec::with_capacity(layout.num_layers());
        let mut placements = Vec::with_capacity(layout.num_layers());
        for (layer, &group) in layout.layer_groups().iter().enumerate() {
            let num_blocks = capacity[group] + 1;
            let bytes_per_block = model.bytes_per_block(layer);
            let len = (u64::from(num_blocks) * bytes_per_block) as usize;
            layers.push(Arc::new(region(&format!("layer{layer}"), len)?));
            placements.push(LayerRegion {
                region: layer as u32,
                base_offset: 0,
                bytes_per_block,
                num_blocks,
            });
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
            generations,
            regions: RegionLayout {
                layers: placements,
                generations: Vec::new(),
            }
            .with_generation_tables(capacity.len()),
        })
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
