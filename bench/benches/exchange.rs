//! Exchange and plan cost per request for a DSv4-like layout (full + window group, B=64, W=128,
//! 61 layers) at 1k, 8k and 32k prompt tokens, decode lookahead 9.
//!
//! `plan_sharded`: the same pairing planned for every rank of legs split over different TP and
//! DCP sizes (8 KV heads for GQA, 1 for MLA-like), beside the equal-split copy as baseline.
//!
//! Run: `cargo bench -p pdkv-bench --bench exchange`

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use pdkv_bench::{contiguous_lists, dsv4_layout, regions};
use pdkv_core::exchange::{self};
use pdkv_core::heads::{HeadOrder, KvShards};
use pdkv_core::layout::KvLayout;
use pdkv_core::plan::{self, HeadLayout, LayerRegion, RegionLayout};

fn exchange_and_plan(c: &mut Criterion) {
    let layout = dsv4_layout();
    let mut group = c.benchmark_group("exchange");
    for tokens in [1_024u64, 8_192, 32_768] {
        let prefill = contiguous_lists(&layout, tokens, 0, 1);
        let decode = contiguous_lists(&layout, tokens, 9, 1);
        let local = regions(&layout, 4096, 1024);
        let remote = regions(&layout, 4096, 1024);
        group.bench_with_input(BenchmarkId::new("offer_need_pair", tokens), &tokens, |b, &n| {
            b.iter(|| {
                let offer = exchange::offer(&layout, n, black_box(&prefill)).unwrap();
                let need = exchange::need(&layout, n, black_box(&decode), &[]).unwrap();
                exchange::pair(&layout, &offer, &need).unwrap()
            })
        });
        let offer = exchange::offer(&layout, tokens, &prefill).unwrap();
        let need = exchange::need(&layout, tokens, &decode, &[]).unwrap();
        let pairing = exchange::pair(&layout, &offer, &need).unwrap();
        group.bench_with_input(
            BenchmarkId::new("plan_61_layers", tokens),
            &pairing,
            |b, pairing| b.iter(|| plan::plan(&layout, black_box(pairing), &local, &remote).unwrap()),
        );
        // Worst case for coalescing: every other id, so no two pairs merge.
        let scattered: Vec<Vec<u32>> = prefill
            .iter()
            .map(|list| list.iter().map(|&id| if id == 0 { 0 } else { id * 2 }).collect())
            .collect();
        let offer = exchange::offer(&layout, tokens, &scattered).unwrap();
        let pairing = exchange::pair(&layout, &offer, &need).unwrap();
        let remote = regions(&layout, 4096, 2048);
        group.bench_with_input(
            BenchmarkId::new("plan_61_layers_scattered", tokens),
            &pairing,
            |b, pairing| b.iter(|| plan::plan(&layout, black_box(pairing), &local, &remote).unwrap()),
        );
    }
    group.finish();
}

/// A leg's placement split as `(tp, dcp)` over `kv_heads` heads of 512 bytes per token.
fn split_regions(layout: &KvLayout, kv_heads: u32, (tp, dcp): (u32, u32), num_blocks: u32) -> RegionLayout {
    let shards = KvShards::new(kv_heads, tp, dcp).unwrap();
    let layers = (0..tp)
        .flat_map(|_| layout.layer_groups().iter())
        .enumerate()
        .map(|(index, &group)| LayerRegion {
            region: index as u32,
            base_offset: 0,
            bytes_per_block: u64::from(shards.heads().heads_per_rank())
                * (layout.groups()[group].effective_block_size() / u64::from(dcp))
                * 512,
            num_blocks,
        })
        .collect();
    RegionLayout {
        layers,
        generations: Vec::new(),
        ranks: tp,
        dcp,
    }
}

fn sharded_plans(c: &mut Criterion) {
    let layout = dsv4_layout();
    let tokens = 8_192u64;
    let prefill = contiguous_lists(&layout, tokens, 0, 1);
    let decode = contiguous_lists(&layout, tokens, 9, 1);
    let offer = exchange::offer(&layout, tokens, &prefill).unwrap();
    let need = exchange::need(&layout, tokens, &decode, &[]).unwrap();
    let pairing = exchange::pair(&layout, &offer, &need).unwrap();
    let mut group = c.benchmark_group("plan_sharded_8k");
    for (name, kv_heads, prefill_split, decode_split) in [
        ("equal_tp8", 8, (8, 1), (8, 1)),
        ("gqa_tp8_to_tp4", 8, (8, 1), (4, 1)),
        ("gqa_tp4_to_tp8", 8, (4, 1), (8, 1)),
        ("mla_tp8_to_tp4", 1, (8, 1), (4, 1)),
        ("mla_dcp1_to_dcp2", 1, (1, 1), (2, 2)),
    ] {
        let heads = HeadLayout {
            kv_heads,
            order: HeadOrder::HeadsOuter,
        };
        let remote = split_regions(&layout, kv_heads, prefill_split, 1024);
        let local = split_regions(&layout, kv_heads, decode_split, 1024);
        group.bench_function(name, |b| {
            b.iter(|| plan::plan_sharded(&layout, black_box(&pairing), &local, &remote, heads, 0).unwrap())
        });
    }
    group.finish();
}

criterion_group!(benches, exchange_and_plan, sharded_plans);
criterion_main!(benches);
