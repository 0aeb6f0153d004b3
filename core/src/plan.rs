//! Transfer plans: block pairs turned into per-layer byte ranges for a READ engine.
//!
//! Each leg registers its KV memory as regions. A [`RegionLayout`] says, per layer, which region
//! holds the layer's blocks, where they start and how many bytes one block takes. [`plan`] maps
//! every [`BlockPair`] of a [`Pairing`] to a `(local offset, remote offset, length)` run per layer
//! of the pair's group, and merges pairs whose remote and local ids both run on into one run, so a
//! READ engine posts as few descriptors as the allocation allows (descriptor count, not bytes, is
//! what limits real P/D transfers).
//!
//! Pairs whose prefill block is the null block carry no data and are left out.

use serde::{Deserialize, Serialize};

use crate::block::{BlockId, NULL_BLOCK};
use crate::exchange::{BlockPair, Pairing};
use crate::heads::{HeadError, HeadMap, HeadOrder, KvShards, RankBlock, shard_slices};
use crate::layout::{GroupKind, KvLayout};
use crate::wire::Role;

/// Where one layer's blocks live inside a leg's registered memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerRegion {
    /// Index of the registered memory region holding the layer.
    pub region: u32,
    /// Byte offset of block 0 of this layer within the region.
    pub base_offset: u64,
    /// Bytes one block of this layer takes.
    pub bytes_per_block: u64,
    /// Blocks the layer holds; a pair naming a higher id is refused.
    pub num_blocks: u32,
}

/// Where a leg's KV blocks and generation tables sit in its registered regions: the one
/// definition of region ids, sent to peers in the handshake so a reader plans against the
/// placement the holder really uses.
///
/// A leg sharding its KV heads over `ranks` tensor-parallel ranks places every layer once per
/// rank, rank-major; all ranks share one block table, so block ids and generation tables are
/// the leg's, not a rank's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionLayout {
    /// `layers[r * L + l]` places layer `l` of rank `r` (`L` layers, `ranks` ranks).
    pub layers: Vec<LayerRegion>,
    /// `generations[g]` is the region id of group `g`'s generation table (one `u32` per block
    /// id, bumped whenever the block is freed).
    pub generations: Vec<u32>,
    /// Tensor-parallel ranks the layers are placed for (1: an unsharded leg).
    pub ranks: u32,
    /// How many consecutive ranks split each block's tokens (decode context parallelism; 1:
    /// every rank holds every token of its heads).
    pub dcp: u32,
}

impl Default for RegionLayout {
    fn default() -> Self {
        RegionLayout {
            layers: Vec::new(),
            generations: Vec::new(),
            ranks: 1,
            dcp: 1,
        }
    }
}

impl RegionLayout {
    /// Every layer in its own region (ids `0..L`), `num_blocks` blocks of `bytes_per_block[l]`
    /// bytes at offset 0; no generation tables.
    pub fn region_per_layer(bytes_per_block: &[u64], num_blocks: u32) -> Self {
        RegionLayout {
            layers: bytes_per_block
                .iter()
                .enumerate()
                .map(|(layer, &bytes)| LayerRegion {
                    region: layer as u32,
                    base_offset: 0,
                    bytes_per_block: bytes,
                    num_blocks,
                })
                .collect(),
            generations: Vec::new(),
            ranks: 1,
            dcp: 1,
        }
    }

    /// The placement of rank `rank` alone (its layers, the leg's generation tables), or `None`
    /// beyond the ranks or when the layers do not split evenly over them.
    pub fn rank(&self, rank: u32) -> Option<RegionLayout> {
        let per_rank = self.layers_per_rank()?;
        let first = (rank as usize).checked_mul(per_rank)?;
        (rank < self.ranks).then(|| RegionLayout {
            layers: self.layers[first..first + per_rank].to_vec(),
            generations: self.generations.clone(),
            ranks: 1,
            dcp: 1,
        })
    }

    /// Layers placed per rank, or `None` when the layers do not split evenly over the ranks.
    pub fn layers_per_rank(&self) -> Option<usize> {
        let ranks = self.ranks as usize;
        (ranks > 0 && self.layers.len().is_multiple_of(ranks)).then(|| self.layers.len() / ranks)
    }

    /// The model layer region `region` holds, with its placement.
    pub fn placement(&self, region: u32) -> Option<(usize, &LayerRegion)> {
        let per_rank = self.layers_per_rank()?;
        self.layers
            .iter()
            .enumerate()
            .find(|(_, placement)| placement.region == region)
            .map(|(index, placement)| (index % per_rank, placement))
    }

    /// The same with one generation table per group, in the ids after the last layer region.
    pub fn with_generation_tables(mut self, groups: usize) -> Self {
        let first = self
            .layers
            .iter()
            .map(|layer| layer.region + 1)
            .max()
            .unwrap_or(0);
        self.generations = (0..groups as u32).map(|group| first + group).collect();
        self
    }

    /// Region id of group `group`'s generation table.
    pub fn generation_region(&self, group: usize) -> Option<u32> {
        self.generations.get(group).copied()
    }

    /// The group whose generation table region `region` is.
    pub fn generation_group(&self, region: u32) -> Option<usize> {
        self.generations.iter().position(|&id| id == region)
    }
}

/// One contiguous READ: `len_bytes` from the remote region at `remote_offset` into the local
/// region at `local_offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadRun {
    /// Destination offset within the local (decode) region.
    pub local_offset: u64,
    /// Source offset within the remote (prefill) region.
    pub remote_offset: u64,
    /// Bytes to copy.
    pub len_bytes: u64,
}

/// Part of a block to READ: `len` bytes at `remote_offset` within a prefill block, into
/// `local_offset` within the paired decode block. A whole block is one slice; legs sharding heads
/// over different tensor-parallel sizes read some heads of each block ([`crate::heads`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockSlice {
    /// Offset within the prefill block.
    pub remote_offset: u64,
    /// Offset within the decode block.
    pub local_offset: u64,
    /// Bytes.
    pub len: u64,
}

/// The runs of one layer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerPlan {
    /// Layer index.
    pub layer: u32,
    /// Local (decode) region the runs write into.
    pub local_region: u32,
    /// Remote (prefill) region the runs read from.
    pub remote_region: u32,
    /// Coalesced runs in ascending position order.
    pub runs: Vec<ReadRun>,
}

/// Every READ of one request.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct TransferPlan {
    /// One entry per layer that has something to read.
    pub layers: Vec<LayerPlan>,
}

impl TransferPlan {
    /// Number of contiguous ranges (READ descriptors) the plan holds.
    pub fn num_ranges(&self) -> usize {
        self.layers.iter().map(|layer| layer.runs.len()).sum()
    }

    /// Bytes the plan moves.
    pub fn total_bytes(&self) -> u64 {
        self.layers
            .iter()
            .flat_map(|layer| &layer.runs)
            .map(|run| run.len_bytes)
            .sum()
    }
}

/// A run of consecutive block pairs, in block units.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct BlockRun {
    remote: BlockId,
    local: BlockId,
    count: u32,
}

/// Merges pairs whose remote and local ids both run on into runs; null-sourced pairs are dropped.
fn coalesce(pairs: &[BlockPair]) -> Vec<BlockRun> {
    let mut runs: Vec<BlockRun> = Vec::new();
    for pair in pairs.iter().filter(|pair| pair.remote != NULL_BLOCK) {
        if let Some(last) = runs.last_mut() {
            let next_remote = last.remote.checked_add(last.count);
            let next_local = last.local.checked_add(last.count);
            if next_remote == Some(pair.remote) && next_local == Some(pair.local) {
                last.count += 1;
                continue;
            }
        }
        runs.push(BlockRun {
            remote: pair.remote,
            local: pair.local,
            count: 1,
        });
    }
    runs
}

/// Turns a pairing into per-layer byte ranges, each paired block read whole.
///
/// Both legs must place the same number of layers with the same bytes per block; every block id
/// must lie inside its layer's region.
pub fn plan(
    layout: &KvLayout,
    pairing: &Pairing,
    local: &RegionLayout,
    remote: &RegionLayout,
) -> Result<TransferPlan, PlanError> {
    check_shapes(layout, pairing, local, remote)?;
    let mut slices = Vec::with_capacity(local.layers.len());
    for (layer, (local_layer, remote_layer)) in local.layers.iter().zip(&remote.layers).enumerate() {
        if local_layer.bytes_per_block != remote_layer.bytes_per_block {
            return Err(PlanError::BlockBytesMismatch {
                layer,
                local: local_layer.bytes_per_block,
                remote: remote_layer.bytes_per_block,
            });
        }
        slices.push(vec![BlockSlice {
            remote_offset: 0,
            local_offset: 0,
            len: local_layer.bytes_per_block,
        }]);
    }
    plan_slices(layout, pairing, local, remote, &slices)
}

/// Turns a pairing into per-layer byte ranges reading `slices[l]` of every paired block of layer
/// `l` (blocks may differ in size between the legs, as when they shard heads differently).
/// Consecutive blocks merge into one run only where a layer's slice is the whole block on both
/// legs.
pub fn plan_slices(
    layout: &KvLayout,
    pairing: &Pairing,
    local: &RegionLayout,
    remote: &RegionLayout,
    slices: &[Vec<BlockSlice>],
) -> Result<TransferPlan, PlanError> {
    check_shapes(layout, pairing, local, remote)?;
    let layers = layout.num_layers();
    if slices.len() != layers {
        return Err(PlanError::SliceCountMismatch {
            given: slices.len(),
            layers,
        });
    }
    let group_runs: Vec<Vec<BlockRun>> = pairing.groups.iter().map(|pairs| coalesce(pairs)).collect();
    let mut plan = TransferPlan {
        layers: Vec::with_capacity(layers),
    };
    for (layer, &group) in layout.layer_groups().iter().enumerate() {
        let runs = &group_runs[group];
        let layer_slices = &slices[layer];
        if runs.is_empty() || layer_slices.is_empty() {
            continue;
        }
        let (local_layer, remote_layer) = (local.layers[layer], remote.layers[layer]);
        for slice in layer_slices {
            let fits = |offset: u64, block: u64| {
                slice.len > 0 && offset.checked_add(slice.len).is_some_and(|end| end <= block)
            };
            if !fits(slice.local_offset, local_layer.bytes_per_block)
                || !fits(slice.remote_offset, remote_layer.bytes_per_block)
            {
                return Err(PlanError::SliceOutsideBlock {
                    layer,
                    slice: *slice,
                    local: local_layer.bytes_per_block,
                    remote: remote_layer.bytes_per_block,
                });
            }
        }
        let whole = matches!(layer_slices.as_slice(), [only]
            if only.len == local_layer.bytes_per_block && only.len == remote_layer.bytes_per_block);
        let mut layer_runs = Vec::with_capacity(runs.len() * layer_slices.len());
        for run in runs {
            let local_offset = byte_offset(Role::Decode, layer, &local_layer, run.local, run.count)?;
            let remote_offset = byte_offset(Role::Prefill, layer, &remote_layer, run.remote, run.count)?;
            if whole {
                layer_runs.push(ReadRun {
                    local_offset,
                    remote_offset,
                    // byte_offset proved `(id + count) * bytes` fits in u64.
                    len_bytes: u64::from(run.count) * local_layer.bytes_per_block,
                });
                continue;
            }
            for index in 0..u64::from(run.count) {
                let local_block = local_offset + index * local_layer.bytes_per_block;
                let remote_block = remote_offset + index * remote_layer.bytes_per_block;
                for slice in layer_slices {
                    // Inside the block, which byte_offset proved addressable.
                    layer_runs.push(ReadRun {
                        local_offset: local_block + slice.local_offset,
                        remote_offset: remote_block + slice.remote_offset,
                        len_bytes: slice.len,
                    });
                }
            }
        }
        plan.layers.push(LayerPlan {
            layer: layer as u32,
            local_region: local_layer.region,
            remote_region: remote_layer.region,
            runs: layer_runs,
        });
    }
    Ok(plan)
}

/// How a model's attention KV sits in a rank's blocks: the KV heads per layer the ranks shard,
/// and the order of heads and tokens inside a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeadLayout {
    /// KV heads per attention layer of the model (1 for MLA's latent).
    pub kv_heads: u32,
    /// Heads outside tokens (`[H, N, C]`) or inside them (`[N, H, C]`).
    pub order: HeadOrder,
}

/// Turns a pairing into the READs of every decode rank, for legs whose KV may be split over
/// different tensor-parallel and DCP sizes ([`RegionLayout::ranks`], [`RegionLayout::dcp`]).
///
/// Legs split alike copy rank `r`'s blocks whole into rank `r`. Otherwise each decode rank
/// reads exactly the heads and tokens it holds, each once, from a prefill rank holding them
/// ([`HeadMap`] over the head groups, [`shard_slices`] within each block; `rotation` spreads
/// reads of replicated heads over their replicas, so give each request its own). A recurrent
/// state is neither heads nor tokens, so a layout with one is refused across different splits.
pub fn plan_sharded(
    layout: &KvLayout,
    pairing: &Pairing,
    local: &RegionLayout,
    remote: &RegionLayout,
    heads: HeadLayout,
    rotation: u64,
) -> Result<TransferPlan, PlanError> {
    let (prefill, decode) = check_sharding(
        layout,
        heads,
        (remote.ranks, remote.dcp),
        (local.ranks, local.dcp),
    )?;
    let rank = |side: Role, regions: &RegionLayout, rank: u32| {
        regions
            .rank(rank)
            .filter(|placed| placed.layers.len() == layout.num_layers())
            .ok_or(PlanError::LayerCountMismatch {
                side,
                given: regions.layers.len(),
                layers: layout.num_layers() * regions.ranks as usize,
            })
    };
    let mut sharded = TransferPlan::default();
    if prefill.tp() == decode.tp() && prefill.dcp() == decode.dcp() {
        for r in 0..decode.tp() {
            let (local_rank, remote_rank) = (rank(Role::Decode, local, r)?, rank(Role::Prefill, remote, r)?);
            sharded
                .layers
                .extend(plan(layout, pairing, &local_rank, &remote_rank)?.layers);
        }
        return Ok(sharded);
    }
    let map = HeadMap::new(prefill.heads(), decode.heads(), rotation)?;
    let (remote_heads, local_heads) = (prefill.heads().heads_per_rank(), decode.heads().heads_per_rank());
    for d in 0..decode.tp() {
        let local_rank = rank(Role::Decode, local, d)?;
        for read in map.reads(decode.group(d))? {
            for share in 0..prefill.dcp() {
                let p = prefill.rank(read.prefill_rank, share);
                let remote_rank = rank(Role::Prefill, remote, p)?;
                let mut slices = Vec::with_capacity(layout.num_layers());
                for (layer, &group) in layout.layer_groups().iter().enumerate() {
                    // A layout's effective block size is checked to fit in u32 when it is built.
                    let tokens =
                        u32::try_from(layout.groups()[group].effective_block_size()).map_err(|_| {
                            PlanError::OffsetOverflow {
                                side: Role::Decode,
                                layer,
                            }
                        })?;
                    slices.push(shard_slices(
                        read,
                        heads.order,
                        tokens,
                        RankBlock {
                            heads: remote_heads,
                            tokens: prefill.tokens(p),
                            block_bytes: remote_rank.layers[layer].bytes_per_block,
                        },
                        RankBlock {
                            heads: local_heads,
                            tokens: decode.tokens(d),
                            block_bytes: local_rank.layers[layer].bytes_per_block,
                        },
                    )?);
                }
                sharded
                    .layers
                    .extend(plan_slices(layout, pairing, &local_rank, &remote_rank, &slices)?.layers);
            }
        }
    }
    Ok(sharded)
}

/// Whether a decode leg of `decode = (tp, dcp)` can read a prefill leg of `prefill = (tp,
/// dcp)`, and how each splits the model's KV. Legs split alike always can; different splits
/// need every group to be attention KV (checked when two legs first meet, so a pair that cannot
/// work is refused before any request).
pub fn check_sharding(
    layout: &KvLayout,
    heads: HeadLayout,
    prefill: (u32, u32),
    decode: (u32, u32),
) -> Result<(KvShards, KvShards), PlanError> {
    let shards = (
        KvShards::new(heads.kv_heads, prefill.0, prefill.1)?,
        KvShards::new(heads.kv_heads, decode.0, decode.1)?,
    );
    if prefill == decode {
        return Ok(shards);
    }
    if let Some(group) = layout
        .groups()
        .iter()
        .position(|spec| matches!(spec.kind(), GroupKind::Mamba | GroupKind::MambaAlign))
    {
        return Err(PlanError::StateAcrossRanks {
            group,
            prefill_tp: prefill.0,
            prefill_dcp: prefill.1,
            decode_tp: decode.0,
            decode_dcp: decode.1,
        });
    }
    HeadMap::new(shards.0.heads(), shards.1.heads(), 0)?;
    Ok(shards)
}

/// Checks that the pairing and both legs' placements describe the layout.
fn check_shapes(
    layout: &KvLayout,
    pairing: &Pairing,
    local: &RegionLayout,
    remote: &RegionLayout,
) -> Result<(), PlanError> {
    let layers = layout.num_layers();
    if pairing.groups.len() != layout.groups().len() {
        return Err(PlanError::GroupCountMismatch {
            given: pairing.groups.len(),
            groups: layout.groups().len(),
        });
    }
    for (side, regions) in [(Role::Decode, local), (Role::Prefill, remote)] {
        if regions.layers.len() != layers {
            return Err(PlanError::LayerCountMismatch {
                side,
                given: regions.layers.len(),
                layers,
            });
        }
    }
    Ok(())
}

/// Offset of block `first` in `region`, checking that blocks `first .. first + count` fit.
fn byte_offset(
    side: Role,
    layer: usize,
    region: &LayerRegion,
    first: BlockId,
    count: u32,
) -> Result<u64, PlanError> {
    let end = u64::from(first) + u64::from(count);
    if end > u64::from(region.num_blocks) {
        return Err(PlanError::BlockOutOfRange {
            side,
            layer,
            block: first + count - 1,
            num_blocks: region.num_blocks,
        });
    }
    end.checked_mul(region.bytes_per_block)
        .and_then(|end_bytes| end_bytes.checked_add(region.base_offset))
        .ok_or(PlanError::OffsetOverflow { side, layer })?;
    Ok(region.base_offset + u64::from(first) * region.bytes_per_block)
}

/// Why a plan could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum PlanError {
    /// The pairing has a different number of groups than the layout.
    #[error("pairing has {given} groups, the layout has {groups}")]
    GroupCountMismatch {
        /// Groups in the pairing.
        given: usize,
        /// Groups in the layout.
        groups: usize,
    },
    /// A leg's region layout places a different number of layers.
    #[error("{side} region layout places {given} layers, the model has {layers}")]
    LayerCountMismatch {
        /// Leg at fault.
        side: Role,
        /// Layers placed.
        given: usize,
        /// Layers in the model.
        layers: usize,
    },
    /// The legs disagree on the size of one layer's block.
    #[error("layer {layer}: decode block is {local} bytes, prefill block is {remote} bytes")]
    BlockBytesMismatch {
        /// Layer index.
        layer: usize,
        /// Local bytes per block.
        local: u64,
        /// Remote bytes per block.
        remote: u64,
    },
    /// The slices name a different number of layers than the layout has.
    #[error("slices for {given} layers, the model has {layers}")]
    SliceCountMismatch {
        /// Layers given slices.
        given: usize,
        /// Layers in the model.
        layers: usize,
    },
    /// A slice is empty or reaches past a block on either leg.
    #[error(
        "layer {layer}: slice {slice:?} does not fit a decode block of {local} bytes and a prefill block of {remote} bytes"
    )]
    SliceOutsideBlock {
        /// Layer index.
        layer: usize,
        /// The slice.
        slice: BlockSlice,
        /// Decode bytes per block.
        local: u64,
        /// Prefill bytes per block.
        remote: u64,
    },
    /// A pair names a block beyond the layer's region.
    #[error("layer {layer}: {side} block {block} is beyond the region's {num_blocks} blocks")]
    BlockOutOfRange {
        /// Leg at fault.
        side: Role,
        /// Layer index.
        layer: usize,
        /// Block id.
        block: BlockId,
        /// Blocks in the region.
        num_blocks: u32,
    },
    /// The legs' KV heads cannot be mapped onto each other's ranks.
    #[error(transparent)]
    Heads(#[from] HeadError),
    /// A recurrent state is split over ranks by its own rule, not by KV heads: legs of
    /// different tensor-parallel sizes cannot reshard it.
    #[error(
        "group {group} is a recurrent state: a prefill leg of tp {prefill_tp} dcp {prefill_dcp} and a decode leg of tp {decode_tp} dcp {decode_dcp} cannot reshard it (the sizes must be equal)"
    )]
    StateAcrossRanks {
        /// The state group.
        group: usize,
        /// Prefill leg's TP size.
        prefill_tp: u32,
        /// Prefill leg's DCP size.
        prefill_dcp: u32,
        /// Decode leg's TP size.
        decode_tp: u32,
        /// Decode leg's DCP size.
        decode_dcp: u32,
    },
    /// Offsets do not fit in 64 bits.
    #[error("layer {layer}: {side} byte offset overflows")]
    OffsetOverflow {
        /// Leg at fault.
        side: Role,
        /// Layer index.
        layer: usize,
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::GroupSpec;

    fn pairs(ids: &[(BlockId, BlockId)]) -> Vec<BlockPair> {
        ids.iter()
            .enumerate()
            .map(|(position, &(remote, local))| BlockPair {
                remote_position: position as u64,
                local_position: position as u64,
                remote,
                local,
            })
            .collect()
    }

    #[test]
    fn runs_merge_only_when_both_sides_run_on() {
        let runs = coalesce(&pairs(&[
            (10, 100),
            (11, 101),
            (12, 103),
            (13, 104),
            (20, 105),
            (0, 106),
        ]));
        assert_eq!(
            runs,
            vec![
                BlockRun {
                    remote: 10,
                    local: 100,
                    count: 2
                },
                BlockRun {
                    remote: 12,
                    local: 103,
                    count: 2
                },
                BlockRun {
                    remote: 20,
                    local: 105,
                    count: 1
                },
            ]
        );
    }

    #[test]
    fn plan_places_each_layer_of_each_group() {
        let layout = KvLayout::new(
            vec![
                GroupSpec::full(4, 1).unwrap(),
                GroupSpec::sliding_window(4, 8, 1).unwrap(),
            ],
            vec![0, 1, 0],
        )
        .unwrap();
        let pairing = Pairing {
            groups: vec![pairs(&[(1, 5), (2, 6)]), pairs(&[(3, 9)])],
        };
        let local = RegionLayout::region_per_layer(&[16, 32, 16], 10);
        let remote = RegionLayout::region_per_layer(&[16, 32, 16], 10);
        let plan = plan(&layout, &pairing, &local, &remote).unwrap();
        assert_eq!(plan.num_ranges(), 3);
        assert_eq!(
            plan.layers[0].runs,
            vec![ReadRun {
                local_offset: 80,
                remote_offset: 16,
                len_bytes: 32
            }]
        );
        assert_eq!(
            plan.layers[1].runs,
            vec![ReadRun {
                local_offset: 288,
                remote_offset: 96,
                len_bytes: 32
            }]
        );
        assert_eq!(plan.layers[2].layer, 2);
        assert_eq!(plan.total_bytes(), 32 + 32 + 32);
    }

    #[test]
    fn plan_refuses_blocks_beyond_the_region_and_mismatched_block_bytes() {
        let layout = KvLayout::one_layer_per_group(vec![GroupSpec::full(4, 1).unwrap()]).unwrap();
        let pairing = Pairing {
            groups: vec![pairs(&[(1, 9), (2, 10)])],
        };
        let small = RegionLayout::region_per_layer(&[16], 10);
        let error = plan(&layout, &pairing, &small, &small).unwrap_err();
        assert_eq!(
            error.to_string(),
            "layer 0: decode block 10 is beyond the region's 10 blocks"
        );
        // Ids 1..=10 exist in a region of 10 blocks (id 0 is the null block's slot): 10 is past it.
        let last = Pairing {
            groups: vec![pairs(&[(1, 9)])],
        };
        assert!(plan(&layout, &last, &small, &small).is_ok());
        let past = Pairing {
            groups: vec![pairs(&[(1, 10)])],
        };
        assert_eq!(
            plan(&layout, &past, &small, &small).unwrap_err().to_string(),
            "layer 0: decode block 10 is beyond the region's 10 blocks"
        );
        let other = RegionLayout::region_per_layer(&[8], 20);
        let big = RegionLayout::region_per_layer(&[16], 20);
        let error = plan(&layout, &pairing, &big, &other).unwrap_err();
        assert_eq!(
            error.to_string(),
            "layer 0: decode block is 16 bytes, prefill block is 8 bytes"
        );
    }
}
