//! Whole legs of several tensor-parallel (and DCP) ranks: every rank of a prefill leg fills its
//! blocks of every layer with cells tagged by (layer, global head, token, byte, block);
//! `plan_sharded` plans the READs of every decode rank at once against rank-major region
//! layouts, the runs are applied byte by byte, and each decode rank must end with exactly the
//! heads and tokens vLLM's sharding gives it (written out here, not taken from `KvShards`),
//! every byte written once.

mod common;

use common::vllm_heads;
use std::collections::HashMap;

use pdkv_core::exchange::{BlockPair, Pairing};
use pdkv_core::heads::{HeadError, HeadOrder};
use pdkv_core::layout::{GroupSpec, KvLayout};
use pdkv_core::plan::{HeadLayout, LayerRegion, PlanError, RegionLayout, check_sharding, plan_sharded};
use proptest::prelude::*;

const CELL: u64 = 2; // bytes per (head, token)
const BLOCKS: u32 = 3; // paired blocks; prefill block b pairs with decode block b + 1

/// A leg's split: TP size and DCP size (DCP ranks are consecutive: rank r is head group
/// r / dcp, token share r % dcp).
#[derive(Debug, Clone, Copy)]
struct Split {
    tp: u32,
    dcp: u32,
}

impl Split {
    fn groups(&self) -> u32 {
        self.tp / self.dcp
    }
}

fn layout() -> KvLayout {
    // Blocks of 4 and 8 tokens: slices differ per layer.
    KvLayout::new(
        vec![
            GroupSpec::full(4, 1).unwrap(),
            GroupSpec::sliding_window(8, 6, 1).unwrap(),
        ],
        vec![0, 1, 0],
    )
    .unwrap()
}

fn tokens(layout: &KvLayout, layer: usize) -> u32 {
    layout.groups()[layout.layer_groups()[layer]].effective_block_size() as u32
}

fn value(layer: usize, head: u32, token: u32, byte: u64, block: u32) -> u8 {
    (layer as u32 * 59 + head * 37 + token * 11 + byte as u32 * 3 + block * 101 + 1) as u8
}

/// Block `block` of `layer` on a rank holding `heads` (global ids) and the tokens `t` with
/// `t % dcp == share`, in slot `t / dcp`.
fn fill(
    layout: &KvLayout,
    order: HeadOrder,
    layer: usize,
    heads: &[u32],
    (share, dcp): (u32, u32),
    block: u32,
) -> Vec<u8> {
    let (n, slots) = (heads.len() as u32, tokens(layout, layer) / dcp);
    let mut bytes = vec![0u8; (u64::from(n * slots) * CELL) as usize];
    for (local, &head) in heads.iter().enumerate() {
        for slot in 0..slots {
            let cell = match order {
                HeadOrder::HeadsOuter => local as u32 * slots + slot,
                HeadOrder::TokensOuter => slot * n + local as u32,
            };
            let token = slot * dcp + share;
            for byte in 0..CELL {
                bytes[(u64::from(cell) * CELL + byte) as usize] = value(layer, head, token, byte, block);
            }
        }
    }
    bytes
}

/// A leg's placement: `split.tp` ranks, rank-major, region ids from `first_region`.
fn regions(layout: &KvLayout, total: u32, split: Split, blocks: u32, first_region: u32) -> RegionLayout {
    let held = vllm_heads(total, split.groups(), 0).len() as u64;
    let layers = (0..split.tp)
        .flat_map(|_| 0..layout.num_layers())
        .enumerate()
        .map(|(index, layer)| LayerRegion {
            region: first_region + index as u32,
            base_offset: 0,
            bytes_per_block: held * u64::from(tokens(layout, layer) / split.dcp) * CELL,
            num_blocks: blocks,
        })
        .collect();
    RegionLayout {
        layers,
        generations: Vec::new(),
        ranks: split.tp,
        dcp: split.dcp,
    }
}

fn pairing(layout: &KvLayout) -> Pairing {
    Pairing {
        groups: (0..layout.groups().len())
            .map(|_| {
                (1..=BLOCKS)
                    .map(|b| BlockPair {
                        remote_position: u64::from(b - 1),
                        local_position: u64::from(b - 1),
                        remote: b,
                        local: b + 1,
                    })
                    .collect()
            })
            .collect(),
    }
}

fn check(total: u32, prefill: Split, decode: Split, rotation: u64, order: HeadOrder) {
    let layout = layout();
    let layers = layout.num_layers();
    let remote = regions(&layout, total, prefill, BLOCKS + 1, 100);
    let local = regions(&layout, total, decode, BLOCKS + 2, 0);
    let heads = HeadLayout {
        kv_heads: total,
        order,
    };
    let plan = plan_sharded(&layout, &pairing(&layout), &local, &remote, heads, rotation).unwrap();
    let context = format!("H={total} P{prefill:?}->D{decode:?} rotation {rotation} {order:?}");
    // Prefill memory by region id; decode memory (and write counts) by region id.
    let mut source: HashMap<u32, Vec<u8>> = HashMap::new();
    for p in 0..prefill.tp {
        let held = vllm_heads(total, prefill.groups(), p / prefill.dcp);
        for layer in 0..layers {
            let bytes: Vec<u8> = (0..=BLOCKS)
                .flat_map(|b| fill(&layout, order, layer, &held, (p % prefill.dcp, prefill.dcp), b))
                .collect();
            source.insert(remote.layers[p as usize * layers + layer].region, bytes);
        }
    }
    let mut target: HashMap<u32, (Vec<u8>, Vec<u32>)> = local
        .layers
        .iter()
        .map(|placed| {
            let len = (placed.bytes_per_block * u64::from(placed.num_blocks)) as usize;
            (placed.region, (vec![0u8; len], vec![0u32; len]))
        })
        .collect();
    for layer_plan in &plan.layers {
        let from_region = &source[&layer_plan.remote_region];
        let (memory, written) = target.get_mut(&layer_plan.local_region).expect("a decode region");
        for run in &layer_plan.runs {
            let (from, to, len) = (
                run.remote_offset as usize,
                run.local_offset as usize,
                run.len_bytes as usize,
            );
            memory[to..to + len].copy_from_slice(&from_region[from..from + len]);
            for count in &mut written[to..to + len] {
                *count += 1;
            }
        }
    }
    for d in 0..decode.tp {
        let held = vllm_heads(total, decode.groups(), d / decode.dcp);
        for layer in 0..layers {
            let placed = local.layers[d as usize * layers + layer];
            let (memory, written) = &target[&placed.region];
            let size = placed.bytes_per_block as usize;
            for block in 0..placed.num_blocks {
                let range = block as usize * size..(block as usize + 1) * size;
                if (2..=BLOCKS + 1).contains(&block) {
                    assert_eq!(
                        &memory[range.clone()],
                        fill(
                            &layout,
                            order,
                            layer,
                            &held,
                            (d % decode.dcp, decode.dcp),
                            block - 1
                        )
                        .as_slice(),
                        "{context}: decode rank {d} layer {layer} block {block}"
                    );
                    assert!(
                        written[range].iter().all(|&count| count == 1),
                        "{context}: every byte of a paired block written exactly once"
                    );
                } else {
                    assert!(
                        written[range].iter().all(|&count| count == 0),
                        "{context}: nothing outside the paired blocks"
                    );
                }
            }
        }
    }
}

fn splits() -> impl Strategy<Value = (u32, Split, Split)> {
    let sizes = [1u32, 2, 4, 8];
    let dcps = [1u32, 2, 4];
    (
        prop::sample::select(vec![1u32, 2, 4, 8]),
        (0..4usize, 0..3usize),
        (0..4usize, 0..3usize),
    )
        .prop_map(move |(total, (pg, pd), (dg, dd))| {
            let split = |groups: usize, dcp: usize| Split {
                tp: sizes[groups] * dcps[dcp],
                dcp: dcps[dcp],
            };
            (total, split(pg, pd), split(dg, dd))
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn every_decode_rank_of_a_leg_ends_with_exactly_its_heads_and_tokens(
        (total, prefill, decode) in splits(),
        rotation in 0..16u64,
        tokens_outer in any::<bool>(),
    ) {
        let order = if tokens_outer { HeadOrder::TokensOuter } else { HeadOrder::HeadsOuter };
        check(total, prefill, decode, rotation, order);
    }
}

#[test]
fn the_pairings_the_issue_names() {
    let tp = |tp: u32| Split { tp, dcp: 1 };
    let dcp = |tp: u32, dcp: u32| Split { tp, dcp };
    // GQA 1->2, 2->1, 4->2; MLA-like replicated KV 1->4, 4->2, 2->1; equal sizes; DCP 1->2,
    // 2->1 (MLA-like and GQA), and DCP with TP on both sides.
    for (total, prefill, decode) in [
        (4, tp(1), tp(2)),
        (4, tp(2), tp(1)),
        (4, tp(4), tp(2)),
        (8, tp(4), tp(2)),
        (1, tp(1), tp(4)),
        (1, tp(4), tp(2)),
        (1, tp(2), tp(1)),
        (2, tp(2), tp(2)),
        (1, tp(4), tp(4)),
        (1, tp(1), dcp(2, 2)),
        (1, dcp(2, 2), tp(1)),
        (1, dcp(2, 2), tp(2)),
        (2, dcp(2, 2), tp(2)),
        (2, tp(2), dcp(4, 2)),
        (4, dcp(8, 4), dcp(4, 2)),
        (2, dcp(2, 2), dcp(2, 2)),
    ] {
        for order in [HeadOrder::HeadsOuter, HeadOrder::TokensOuter] {
            for rotation in 0..4 {
                check(total, prefill, decode, rotation, order);
            }
        }
    }
}

#[test]
fn replicated_kv_is_read_from_every_replica_across_requests() {
    // MLA-like 1 head on 4 prefill ranks read by 1 decode rank: four requests use four ranks.
    let layout = layout();
    let remote = regions(&layout, 1, Split { tp: 4, dcp: 1 }, BLOCKS + 1, 100);
    let local = regions(&layout, 1, Split { tp: 1, dcp: 1 }, BLOCKS + 2, 0);
    let heads = HeadLayout {
        kv_heads: 1,
        order: HeadOrder::HeadsOuter,
    };
    let sources: Vec<u32> = (0..4)
        .map(|rotation| {
            let plan = plan_sharded(&layout, &pairing(&layout), &local, &remote, heads, rotation).unwrap();
            let region = plan.layers[0].remote_region;
            // Region ids 100.. rank-major: the rank is (id - 100) / layers.
            (region - 100) / layout.num_layers() as u32
        })
        .collect();
    let mut sorted = sources.clone();
    sorted.sort();
    assert_eq!(sorted, vec![0, 1, 2, 3], "sources per request: {sources:?}");
}

#[test]
fn a_state_or_indivisible_heads_across_sizes_is_refused_by_kind() {
    let with_state = KvLayout::new(
        vec![GroupSpec::full(4, 1).unwrap(), GroupSpec::mamba()],
        vec![0, 1],
    )
    .unwrap();
    let heads = HeadLayout {
        kv_heads: 4,
        order: HeadOrder::HeadsOuter,
    };
    assert_eq!(
        check_sharding(&with_state, heads, (2, 1), (1, 1)),
        Err(PlanError::StateAcrossRanks {
            group: 1,
            prefill_tp: 2,
            prefill_dcp: 1,
            decode_tp: 1,
            decode_dcp: 1
        })
    );
    assert!(matches!(
        check_sharding(&with_state, heads, (2, 2), (2, 1)),
        Err(PlanError::StateAcrossRanks {
            prefill_dcp: 2,
            decode_dcp: 1,
            ..
        })
    ));
    assert!(check_sharding(&with_state, heads, (2, 1), (2, 1)).is_ok());
    assert_eq!(
        check_sharding(&layout(), HeadLayout { kv_heads: 6, ..heads }, (4, 1), (2, 1)),
        Err(PlanError::Heads(HeadError::Indivisible { heads: 6, tp: 4 }))
    );
    assert_eq!(
        check_sharding(&layout(), heads, (0, 1), (2, 1)),
        Err(PlanError::Heads(HeadError::NoRanks))
    );
    assert_eq!(
        check_sharding(&layout(), heads, (4, 3), (2, 1)),
        Err(PlanError::Heads(HeadError::DcpNotInTp { tp: 4, dcp: 3 }))
    );
    // A block that does not split over the DCP ranks is refused when planned.
    let odd = KvLayout::one_layer_per_group(vec![GroupSpec::full(6, 1).unwrap()]).unwrap();
    let remote = regions(&odd, 4, Split { tp: 4, dcp: 4 }, 4, 100);
    let local = regions(&odd, 4, Split { tp: 1, dcp: 1 }, 5, 0);
    assert!(matches!(
        plan_sharded(&odd, &pairing(&odd), &local, &remote, heads, 0),
        Err(PlanError::Heads(HeadError::TokensNotSplit {
            tokens: 6,
            dcp: 4,
            interleave: 1
        }))
    ));
    // plan_sharded refuses a state before planning anything.
    let remote = regions(&with_state, 4, Split { tp: 2, dcp: 1 }, 4, 100);
    let local = regions(&with_state, 4, Split { tp: 1, dcp: 1 }, 5, 0);
    assert!(matches!(
        plan_sharded(&with_state, &pairing(&with_state), &local, &remote, heads, 0),
        Err(PlanError::StateAcrossRanks { .. })
    ));
}

#[test]
fn a_placement_that_does_not_split_over_its_ranks_is_refused_naming_the_leg() {
    let layout = layout();
    let heads = HeadLayout {
        kv_heads: 2,
        order: HeadOrder::HeadsOuter,
    };
    let mut remote = regions(&layout, 2, Split { tp: 2, dcp: 1 }, BLOCKS + 1, 100);
    remote.layers.pop();
    let local = regions(&layout, 2, Split { tp: 1, dcp: 1 }, BLOCKS + 2, 0);
    assert_eq!(
        plan_sharded(&layout, &pairing(&layout), &local, &remote, heads, 0),
        Err(PlanError::LayerCountMismatch {
            side: pdkv_core::wire::Role::Prefill,
            given: 5,
            layers: 6
        })
    );
}
