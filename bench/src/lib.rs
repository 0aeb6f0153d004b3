//! Shared fixtures for pdkv benchmarks.
//!
//! Benchmarks live here, apart from the tests: tests never time anything, and `.ci/run` only
//! compiles the benches (`cargo bench --no-run`).

use pdkv_core::block::{BlockId, NULL_BLOCK};
use pdkv_core::layout::{GroupSpec, KvLayout};
use pdkv_core::plan::RegionLayout;

/// Layers in the DSv4-like layout.
pub const DSV4_LAYERS: usize = 61;

/// A DeepSeek-V4-like layout: one full and one sliding-window group (B=64, W=128), 61 layers
/// alternating between them.
pub fn dsv4_layout() -> KvLayout {
    let groups = vec![
        GroupSpec::full(64, 1).expect("valid full group"),
        GroupSpec::sliding_window(64, 128, 1).expect("valid window group"),
    ];
    let layers = (0..DSV4_LAYERS).map(|layer| layer % 2).collect();
    KvLayout::new(groups, layers).expect("valid layout")
}

/// A leg's lists for `num_prompt_tokens` plus `lookahead` tail tokens, contiguous ids from
/// `first_id`, window positions below the last prompt token's window null (as the allocator
/// leaves them).
pub fn contiguous_lists(
    layout: &KvLayout,
    num_prompt_tokens: u64,
    lookahead: u64,
    first_id: BlockId,
) -> Vec<Vec<BlockId>> {
    layout
        .groups()
        .iter()
        .map(|spec| {
            let len = spec.blocks_for_tokens(num_prompt_tokens + lookahead) as BlockId;
            let nulls = match spec.kind().attended_floor(num_prompt_tokens.saturating_sub(1)) {
                Some(floor) => (floor / spec.effective_block_size()) as BlockId,
                None => 0,
            };
            (0..len)
                .map(|p| if p < nulls { NULL_BLOCK } else { first_id + p })
                .collect()
        })
        .collect()
}

/// Region layout with one region per layer, `num_blocks` blocks of `bytes_per_block`.
pub fn regions(layout: &KvLayout, bytes_per_block: u64, num_blocks: u32) -> RegionLayout {
    RegionLayout::region_per_layer(&vec![bytes_per_block; layout.num_layers()], num_blocks)
}
