//! Heterogeneous tensor parallelism end to end over bytes: prefill ranks fill their blocks with
//! each (head, token) cell tagged by its global head, a decode rank reads through the plan its
//! `HeadMap` and `head_slices` give, and must end with exactly the cells of the heads it holds,
//! by the definition of vLLM's sharding (not by `HeadSharding`).

mod common;

use common::vllm_heads;
use pdkv_core::exchange::{BlockPair, Pairing};
use pdkv_core::heads::{HeadMap, HeadOrder, HeadSharding, head_slices};
use pdkv_core::layout::{GroupSpec, KvLayout};
use pdkv_core::plan::{RegionLayout, plan_slices};
use proptest::prelude::*;

const TOKENS: u32 = 4;
const CELL: u64 = 2; // bytes per (head, token)

fn offset(order: HeadOrder, heads: u32, head: u32, token: u32) -> usize {
    let cell = match order {
        HeadOrder::HeadsOuter => head * TOKENS + token,
        HeadOrder::TokensOuter => token * heads + head,
    };
    (u64::from(cell) * CELL) as usize
}

fn value(head: u32, token: u32, byte: u64, block: u32) -> u8 {
    (head * 37 + token * 11 + byte as u32 * 3 + block * 101 + 1) as u8
}

/// One block of `block` id for a rank holding `heads` (global ids), in `order`.
fn fill(order: HeadOrder, heads: &[u32], block: u32) -> Vec<u8> {
    let n = heads.len() as u32;
    let mut bytes = vec![0u8; (u64::from(n * TOKENS) * CELL) as usize];
    for (local, &head) in heads.iter().enumerate() {
        for token in 0..TOKENS {
            let at = offset(order, n, local as u32, token);
            for byte in 0..CELL {
                bytes[at + byte as usize] = value(head, token, byte, block);
            }
        }
    }
    bytes
}

fn check(total: u32, tp_p: u32, tp_d: u32, rotation: u64, order: HeadOrder) {
    let map = HeadMap::new(
        HeadSharding::new(total, tp_p).unwrap(),
        HeadSharding::new(total, tp_d).unwrap(),
        rotation,
    )
    .unwrap();
    let layout = KvLayout::one_layer_per_group(vec![GroupSpec::full(TOKENS, 1).unwrap()]).unwrap();
    let blocks = 3u32;
    // Prefill block b (1..=blocks) pairs with decode block b + 1.
    let pairing = Pairing {
        groups: vec![
            (1..=blocks)
                .map(|b| BlockPair {
                    remote_position: u64::from(b - 1),
                    local_position: u64::from(b - 1),
                    remote: b,
                    local: b + 1,
                })
                .collect(),
        ],
    };
    let heads_p = vllm_heads(total, tp_p, 0).len() as u32;
    let heads_d = vllm_heads(total, tp_d, 0).len() as u32;
    let bytes_p = u64::from(heads_p * TOKENS) * CELL;
    let bytes_d = u64::from(heads_d * TOKENS) * CELL;
    let prefill: Vec<Vec<u8>> = (0..tp_p)
        .map(|p| {
            (0..=blocks)
                .flat_map(|b| fill(order, &vllm_heads(total, tp_p, p), b))
                .collect()
        })
        .collect();
    let mut readers = vec![0u32; tp_p as usize];
    for d in 0..tp_d {
        let mut memory = vec![0u8; (bytes_d * u64::from(blocks + 2)) as usize];
        let mut written = vec![0u32; memory.len()];
        let reads = map.reads(d).unwrap();
        let mut sources: Vec<u32> = reads.iter().map(|read| read.prefill_rank).collect();
        sources.dedup();
        for &p in &sources {
            readers[p as usize] += 1;
        }
        for read in reads {
            let holder = vllm_heads(total, tp_p, read.prefill_rank);
            let wanted = vllm_heads(total, tp_d, d)[read.local_first as usize];
            assert!(
                holder.contains(&wanted),
                "prefill rank {} does not hold head {wanted}",
                read.prefill_rank
            );
            let slices = head_slices(read, order, TOKENS, (heads_p, bytes_p), (heads_d, bytes_d)).unwrap();
            let plan = plan_slices(
                &layout,
                &pairing,
                &RegionLayout::region_per_layer(&[bytes_d], blocks + 2),
                &RegionLayout::region_per_layer(&[bytes_p], blocks + 1),
                &[slices],
            )
            .unwrap();
            for run in plan.layers.iter().flat_map(|layer| &layer.runs) {
                let (from, to, len) = (
                    run.remote_offset as usize,
                    run.local_offset as usize,
                    run.len_bytes as usize,
                );
                memory[to..to + len].copy_from_slice(&prefill[read.prefill_rank as usize][from..from + len]);
                for count in &mut written[to..to + len] {
                    *count += 1;
                }
            }
        }
        for b in 1..=blocks {
            let start = ((b + 1) as u64 * bytes_d) as usize;
            let block = &memory[start..start + bytes_d as usize];
            assert_eq!(
                block,
                fill(order, &vllm_heads(total, tp_d, d), b).as_slice(),
                "H={total} P{tp_p}->D{tp_d} rotation {rotation} {order:?}: decode rank {d} block {b}"
            );
            assert!(
                written[start..start + bytes_d as usize]
                    .iter()
                    .all(|&count| count == 1),
                "every byte of a paired block is written exactly once"
            );
        }
        let outside = (0..memory.len()).filter(|&i| {
            let block = i as u64 / bytes_d;
            !(2..=u64::from(blocks + 1)).contains(&block)
        });
        assert!(
            outside.into_iter().all(|i| written[i] == 0),
            "nothing outside the paired blocks"
        );
    }
    for p in 0..tp_p {
        assert_eq!(
            map.readers(p).unwrap(),
            readers[p as usize],
            "readers of prefill rank {p}"
        );
        if readers[p as usize] == 0 {
            let releaser = p % tp_d;
            assert!(map.releases(releaser).unwrap().contains(&p));
        }
    }
    let released: usize = (0..tp_d).map(|d| map.releases(d).unwrap().len()).sum();
    assert_eq!(
        released,
        readers.iter().filter(|&&r| r == 0).count(),
        "each unread rank given back once"
    );
}

fn shardings() -> impl Strategy<Value = (u32, u32, u32)> {
    // Heads 1 (MLA-like), 2, 4, 8; TP sizes 1..=8 that divide or are divided by the heads.
    (prop::sample::select(vec![1u32, 2, 4, 8]), 0..4u32, 0..4u32).prop_map(|(total, p, d)| {
        let sizes = [1u32, 2, 4, 8];
        (total, sizes[p as usize], sizes[d as usize])
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn every_decode_rank_ends_with_exactly_its_heads((total, tp_p, tp_d) in shardings(), rotation in 0..16u64, tokens_outer in any::<bool>()) {
        let order = if tokens_outer { HeadOrder::TokensOuter } else { HeadOrder::HeadsOuter };
        check(total, tp_p, tp_d, rotation, order);
    }
}

#[test]
fn the_pairings_the_issue_names() {
    for (total, tp_p, tp_d) in [
        (4, 1, 2),
        (4, 2, 1),
        (4, 4, 2),
        (8, 4, 2),
        (1, 2, 1),
        (1, 1, 2),
        (2, 4, 2),
    ] {
        for order in [HeadOrder::HeadsOuter, HeadOrder::TokensOuter] {
            for rotation in 0..4 {
                check(total, tp_p, tp_d, rotation, order);
            }
        }
    }
}

#[test]
fn replicated_heads_spread_over_requests() {
    // MLA from 4 prefill ranks into 1 decode rank: 4 consecutive requests use each prefill rank once.
    let used: Vec<u32> = (0..4)
        .map(|rotation| {
            let map = HeadMap::new(
                HeadSharding::new(1, 4).unwrap(),
                HeadSharding::new(1, 1).unwrap(),
                rotation,
            )
            .unwrap();
            map.reads(0).unwrap()[0].prefill_rank
        })
        .collect();
    let mut sorted = used.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, vec![0, 1, 2, 3], "used {used:?}");
}
