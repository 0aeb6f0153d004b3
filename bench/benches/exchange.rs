//! Exchange and plan cost per request for a DSv4-like layout (full + window group, B=64, W=128,
//! 61 layers) at 1k, 8k and 32k prompt tokens, decode lookahead 9.
//!
//! Run: `cargo bench -p pdkv-bench --bench exchange`

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use pdkv_bench::{contiguous_lists, dsv4_layout, regions};
use pdkv_core::exchange::{self};
use pdkv_core::plan;

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

criterion_group!(benches, exchange_and_plan);
criterion_main!(benches);
