//! Exchange behaviour: the seed's four tail combinations, fixed edge cases, property tests over
//! layouts and prompts, and refusals that name what is wrong.
//!
//! Expected positions never come from `needed_positions` (the code under test): they come from
//! [`positions_by_definition`], which walks the tokens docs/ARCHITECTURE.md's exchange section says the
//! decode leg reads and maps each to its block.

use std::collections::{BTreeSet, HashMap};

use pdkv_core::block::{BlockId, NULL_BLOCK};
use pdkv_core::exchange::{self, BlockPair, ExchangeError, Pairing, needed_positions};
use pdkv_core::layout::GroupKind::{ChunkedLocal, Full, Mamba, MambaAlign, SlidingWindow};
use pdkv_core::layout::{GroupSpec, KvLayout};
use proptest::prelude::*;

const B: u32 = 64;
const W: u32 = 128;
const N: u64 = 440;
const LOOKAHEAD: u64 = 9;

fn seed_layout() -> KvLayout {
    KvLayout::one_layer_per_group(vec![
        GroupSpec::full(B, 1).unwrap(),
        GroupSpec::sliding_window(B, W, 1).unwrap(),
    ])
    .unwrap()
}

/// docs/ARCHITECTURE.md, "The exchange", step 2: the decode leg recomputes token `N - 1`, so it reads the KV
/// of tokens `0 ..= N - 2` (full groups), `max(0, N - W) ..= N - 2` (window groups) or, for
/// chunked local groups, the tokens of `N - 1`'s own chunk before it (Llama 4: a token attends
/// within its chunk of `C` tokens), each in block `token / (B * dcp)`; a mamba group reads its
/// state (position 0). Token by token, no shortcut.
fn positions_by_definition(spec: &GroupSpec, num_prompt_tokens: u64) -> Vec<u64> {
    let block_tokens = u64::from(spec.block_size()) * u64::from(spec.dcp());
    let first_token = match spec.kind() {
        Mamba => return vec![0],
        // vLLM's align mode keeps the running state after `t` tokens in block `(t - 1) / B`
        // (`preprocess_mamba`: `(num_computed_tokens - 1) // block_size`); the decoder starts
        // from the state after the N - 1 tokens it does not recompute, or from nothing.
        MambaAlign if num_prompt_tokens < 2 => return vec![],
        MambaAlign => return vec![(num_prompt_tokens - 2) / block_tokens],
        Full => 0i128,
        SlidingWindow { window } => (num_prompt_tokens as i128 - i128::from(window)).max(0),
        // The chunk of the last prompt token starts where its index leaves no remainder.
        ChunkedLocal { chunk } => {
            let last = num_prompt_tokens.saturating_sub(1);
            (last - last % u64::from(chunk)) as i128
        }
    };
    let last_token = num_prompt_tokens as i128 - 2;
    let mut positions = BTreeSet::new();
    let mut token = first_token;
    while token <= last_token {
        positions.insert(token as u64 / block_tokens);
        token += 1;
    }
    positions.into_iter().collect()
}

/// The oldest position a window or chunked group keeps for the last prompt token (below it the
/// allocator puts the null block): the block of token `max(0, N - W)`, or of the first token of
/// token `N - 1`'s chunk.
fn window_null_end(spec: &GroupSpec, num_prompt_tokens: u64) -> u64 {
    match spec.kind() {
        SlidingWindow { window } => {
            num_prompt_tokens.saturating_sub(u64::from(window)) / spec.effective_block_size()
        }
        ChunkedLocal { chunk } => {
            let last = num_prompt_tokens.saturating_sub(1);
            (last - last % u64::from(chunk)) / spec.effective_block_size()
        }
        _ => 0,
    }
}

/// A leg's lists as vLLM builds them: `cdiv(N + k, B)` blocks, ids `base + position`, the window
/// group's positions below the last token's window replaced by the null block.
fn seed_lists(base: BlockId, lookahead: u64) -> Vec<Vec<BlockId>> {
    let len = (N + lookahead).div_ceil(u64::from(B)) as u32;
    let full: Vec<BlockId> = (0..len).map(|p| base + p).collect();
    let nulls = ((N - u64::from(W)) / u64::from(B)) as u32;
    let window = (0..len)
        .map(|p| if p < nulls { NULL_BLOCK } else { base + p })
        .collect();
    vec![full, window]
}

/// Each group's pairs as (prefill block, decode block).
fn block_ids(pairing: &Pairing) -> Vec<Vec<(BlockId, BlockId)>> {
    pairing
        .groups
        .iter()
        .map(|pairs| pairs.iter().map(|pair| (pair.remote, pair.local)).collect())
        .collect()
}

/// Whether a pairing reads every needed position into the same position and nothing shifted.
fn joins_needed_positions(layout: &KvLayout, pairing: &Pairing) -> bool {
    layout.groups().iter().zip(&pairing.groups).all(|(spec, pairs)| {
        let shifted = pairs
            .iter()
            .any(|pair| pair.remote_position != pair.local_position);
        let covered = positions_by_definition(spec, N).into_iter().all(|p| {
            pairs
                .iter()
                .any(|pair| pair.local_position == p && pair.remote_position == p)
        });
        !shifted && covered
    })
}

#[test]
fn four_tail_combinations_anchored_pairs_every_needed_position() {
    let layout = seed_layout();
    for (prefill_tail, decode_tail) in [(0, 0), (0, LOOKAHEAD), (LOOKAHEAD, 0), (LOOKAHEAD, LOOKAHEAD)] {
        let prefill = seed_lists(10, prefill_tail);
        let decode = seed_lists(100, decode_tail);
        let offer = exchange::offer(&layout, N, &prefill).unwrap();
        let need = exchange::need(&layout, N, &decode, &[]).unwrap();
        let pairing = exchange::pair(&layout, &offer, &need).unwrap();
        let ids = block_ids(&pairing);
        assert_eq!(
            ids,
            vec![
                (0..7).map(|p| (10 + p, 100 + p)).collect::<Vec<_>>(),
                vec![(14, 104), (15, 105), (16, 106)],
            ],
            "prefill tail {prefill_tail}, decode tail {decode_tail}"
        );
        assert!(joins_needed_positions(&layout, &pairing));
    }
}

#[test]
fn four_tail_combinations_legacy_is_wrong_in_exactly_three() {
    let layout = seed_layout();
    let cases = [
        // (prefill tail, decode tail, legacy window pairs, legacy pairs needed positions right)
        (0, 0, vec![(14, 104), (15, 105), (16, 106)], true),
        (0, LOOKAHEAD, vec![(14, 105), (15, 106), (16, 107)], false),
        (LOOKAHEAD, 0, vec![(15, 104), (16, 105), (17, 106)], false),
        (LOOKAHEAD, LOOKAHEAD, vec![(15, 105), (16, 106), (17, 107)], false),
    ];
    for (prefill_tail, decode_tail, window_pairs, right) in cases {
        let pairing = exchange::legacy_pair(
            &layout,
            &seed_lists(10, prefill_tail),
            &seed_lists(100, decode_tail),
            1,
        )
        .unwrap();
        let window: Vec<_> = pairing.groups[1]
            .iter()
            .map(|pair| (pair.remote, pair.local))
            .collect();
        assert_eq!(
            window, window_pairs,
            "prefill tail {prefill_tail}, decode tail {decode_tail}"
        );
        assert_eq!(joins_needed_positions(&layout, &pairing), right);
    }
    // Only a prefill-side tail also breaks the full-attention group: remote suffix P1..P7 -> D0..D6.
    let pairing = exchange::legacy_pair(&layout, &seed_lists(10, LOOKAHEAD), &seed_lists(100, 0), 1).unwrap();
    assert_eq!(pairing.groups[0][0].remote, 11);
    assert_eq!(pairing.groups[0][0].local, 100);
}

#[test]
fn missing_position_fails_instead_of_shifting() {
    let layout = seed_layout();
    let offer = exchange::offer(&layout, N, &seed_lists(10, 0)).unwrap();
    let mut shortened = offer.clone();
    shortened.groups[1].blocks.remove(0);
    shortened.groups[1].first_position = 5;
    let need = exchange::need(&layout, N, &seed_lists(100, LOOKAHEAD), &[]).unwrap();
    let error = exchange::pair(&layout, &shortened, &need).unwrap_err();
    assert_eq!(
        error.to_string(),
        "group 1 (sliding_window): decode needs position 4, offer covers 5..7"
    );
}

#[test]
fn refusals_name_group_leg_and_position() {
    let layout = seed_layout();
    let mut prefill = seed_lists(10, 0);
    prefill[1][5] = NULL_BLOCK;
    let cases: Vec<(Result<(), ExchangeError>, &str)> = vec![
        (
            exchange::offer(&layout, N, &prefill).map(drop),
            "group 1 (sliding_window): prefill leg holds the null block at needed position 5",
        ),
        (
            exchange::offer(&layout, N, &[vec![1, 2]]).map(drop),
            "prefill leg gave 1 group lists, the layout has 2",
        ),
        (
            exchange::offer(&layout, N, &[vec![1, 2], vec![3]]).map(drop),
            "group 0 (full): prefill leg holds 2 blocks, the exchange needs 7",
        ),
        (
            exchange::offer(&layout, 0, &seed_lists(10, 0)).map(drop),
            "num_prompt_tokens must be at least 1, got 0",
        ),
        (
            exchange::need(&layout, N, &seed_lists(100, 0), &[9, 0]).map(drop),
            "group 0: cached_blocks 9 exceeds the decode list's 7 blocks",
        ),
        (
            exchange::need(&layout, N, &seed_lists(100, 0), &[1]).map(drop),
            "cached_blocks has 1 entries, the layout has 2 groups",
        ),
        (
            exchange::legacy_pair(&layout, &seed_lists(10, 0), &seed_lists(100, 200), 1).map(drop),
            "group 0: legacy pairing found a decode tail of 3 blocks, allowed local tail is 1",
        ),
    ];
    for (result, expected) in cases {
        assert_eq!(result.unwrap_err().to_string(), expected);
    }
}

#[test]
fn mismatched_layouts_between_legs_are_refused() {
    let layout = seed_layout();
    let mut offer = exchange::offer(&layout, N, &seed_lists(10, 0)).unwrap();
    offer.groups[1].spec = GroupSpec::sliding_window(B, 256, 1).unwrap();
    let need = exchange::need(&layout, N, &seed_lists(100, 0), &[]).unwrap();
    assert_eq!(
        exchange::pair(&layout, &offer, &need).unwrap_err().to_string(),
        "group 1: prefill leg's spec differs from the layout: window 128 vs 256"
    );
    for (spec, detail) in [
        (
            GroupSpec::sliding_window(32, W, 1).unwrap(),
            "scheduler block of 64 tokens (block_size 64 x dcp 1) vs 32 (block_size 32 x dcp 1)",
        ),
        (GroupSpec::full(B, 1).unwrap(), "kind sliding_window vs full"),
    ] {
        let mut other = offer.clone();
        other.groups[1].spec = spec;
        assert_eq!(
            exchange::pair(&layout, &other, &need).unwrap_err().to_string(),
            format!("group 1: prefill leg's spec differs from the layout: {detail}")
        );
    }
    // A leg splitting the same scheduler blocks over DCP ranks pairs block for block; one whose
    // scheduler blocks hold other tokens does not.
    let whole = exchange::offer(&layout, N, &seed_lists(10, 0)).unwrap();
    let mut split = whole.clone();
    split.groups[0].spec = GroupSpec::full(B / 4, 4).unwrap();
    assert_eq!(
        exchange::pair(&layout, &split, &need).unwrap(),
        exchange::pair(&layout, &whole, &need).unwrap()
    );
    // A leg whose scheduler blocks hold twice the layout's tokens, named from either side.
    let wider = |leg: &str| {
        format!(
            "group 0: {leg} leg's spec differs from the layout: scheduler block of {B} tokens \
             (block_size {B} x dcp 1) vs {} (block_size {B} x dcp 2)",
            2 * B
        )
    };
    split.groups[0].spec = GroupSpec::full(B, 2).unwrap();
    assert_eq!(
        exchange::pair(&layout, &split, &need).unwrap_err().to_string(),
        wider("prefill")
    );
    let hybrid =
        KvLayout::one_layer_per_group(vec![GroupSpec::full(B, 1).unwrap(), GroupSpec::mamba()]).unwrap();
    assert_eq!(
        exchange::need(&hybrid, 100, &[vec![1, 2], vec![3]], &[1, 1]).unwrap_err(),
        ExchangeError::CachedMamba { group: 1, cached: 1 }
    );
    let mut sharded = need.clone();
    sharded.groups[0].spec = GroupSpec::full(B, 2).unwrap();
    assert_eq!(
        exchange::pair(&layout, &offer, &sharded).unwrap_err().to_string(),
        wider("decode")
    );
    let mut short = offer.clone();
    short.groups.pop();
    assert!(matches!(
        exchange::pair(&layout, &short, &need),
        Err(ExchangeError::GroupCountMismatch { .. })
    ));
    let mut longer = need.clone();
    longer.num_prompt_tokens = N + 1;
    let offer = exchange::offer(&layout, N, &seed_lists(10, 0)).unwrap();
    assert_eq!(
        exchange::pair(&layout, &offer, &longer).unwrap_err().to_string(),
        "prefill offer is for 440 prompt tokens, decode need for 441"
    );
}

#[test]
fn prefix_hits_leave_out_held_positions() {
    let layout = seed_layout();
    let offer = exchange::offer(&layout, N, &seed_lists(10, 0)).unwrap();
    let need = exchange::need(&layout, N, &seed_lists(100, LOOKAHEAD), &[5, 0]).unwrap();
    let pairing = exchange::pair(&layout, &offer, &need).unwrap();
    let full: Vec<_> = pairing.groups[0]
        .iter()
        .map(|pair| (pair.remote, pair.local))
        .collect();
    assert_eq!(full, vec![(15, 105), (16, 106)]);
    assert_eq!(pairing.groups[1].len(), 3);
}

#[test]
fn mamba_groups_pair_their_running_state() {
    let layout =
        KvLayout::one_layer_per_group(vec![GroupSpec::full(16, 1).unwrap(), GroupSpec::mamba()]).unwrap();
    let offer = exchange::offer(&layout, 20, &[vec![1, 2], vec![7]]).unwrap();
    let need = exchange::need(&layout, 20, &[vec![3, 4, 5], vec![9, 10]], &[]).unwrap();
    let pairing = exchange::pair(&layout, &offer, &need).unwrap();
    assert_eq!((pairing.groups[1][0].remote, pairing.groups[1][0].local), (7, 9));
    assert_eq!(pairing.groups[1].len(), 1);
}

/// One leg's generated lists plus a map from each real block id to its position.
struct Lists {
    blocks: Vec<Vec<BlockId>>,
    positions: Vec<HashMap<BlockId, u64>>,
}

/// Lists for `layout` covering `held_tokens` token slots (prompt tokens the leg computed plus its
/// lookahead tail); real ids are distinct, drawn from `ids`; window positions below the last
/// prompt token's window are null, as the allocator leaves them.
fn make_lists(
    layout: &KvLayout,
    num_prompt_tokens: u64,
    held_tokens: u64,
    mamba_slots: usize,
    ids: &mut impl Iterator<Item = BlockId>,
) -> Lists {
    let mut blocks = Vec::new();
    let mut positions = Vec::new();
    for spec in layout.groups() {
        let len = match spec.kind() {
            Mamba => mamba_slots as u64,
            _ => held_tokens.div_ceil(spec.effective_block_size()),
        };
        let nulls = window_null_end(spec, num_prompt_tokens);
        let mut list = Vec::new();
        let mut map = HashMap::new();
        for position in 0..len {
            if position < nulls {
                list.push(NULL_BLOCK);
            } else {
                let id = ids.next().unwrap();
                map.insert(id, position);
                list.push(id);
            }
        }
        blocks.push(list);
        positions.push(map);
    }
    Lists { blocks, positions }
}

/// One fixed case: a group, a prompt length and the positions the definition gives, worked out
/// by hand.
fn check_needed(spec: GroupSpec, num_prompt_tokens: u64, expected: &[u64]) {
    assert_eq!(
        positions_by_definition(&spec, num_prompt_tokens),
        expected,
        "the hand-worked case disagrees with the definition: {spec:?}, N = {num_prompt_tokens}"
    );
    let range = needed_positions(&spec, num_prompt_tokens);
    assert_eq!(
        range.collect::<Vec<_>>(),
        expected,
        "{spec:?}, N = {num_prompt_tokens}"
    );
}

#[test]
fn needed_positions_at_the_edges() {
    let full = |b, dcp| GroupSpec::full(b, dcp).unwrap();
    let window = |b, w| GroupSpec::sliding_window(b, w, 1).unwrap();
    let chunked = |b, c| GroupSpec::chunked_local(b, c, 1).unwrap();
    let cases: Vec<(GroupSpec, u64, Vec<u64>)> = vec![
        // N = 1: the decode leg recomputes the only token and reads nothing.
        (full(64, 1), 1, vec![]),
        (window(64, 128), 1, vec![]),
        (full(64, 1), 2, vec![0]),
        // (N - 1) % B == 0: the last block holds only the recomputed token.
        (full(64, 1), 65, vec![0]),
        (full(64, 1), 66, vec![0, 1]),
        (full(64, 1), 129, vec![0, 1]),
        // DCP: blocks of B * dcp tokens.
        (full(16, 2), 33, vec![0]),
        (full(16, 2), 34, vec![0, 1]),
        (full(16, 4), 65, vec![0]),
        (full(16, 4), 200, vec![0, 1, 2, 3]),
        // N <= W: the window reaches back to token 0.
        (window(64, 128), 128, vec![0, 1]),
        (window(64, 128), 129, vec![0, 1]),
        // N - W = 64 = 0 (mod B): the window starts on a block boundary.
        (window(64, 128), 192, vec![1, 2]),
        // N - W = 63 = B - 1 (mod B): the window starts on a block's last token.
        (window(64, 128), 191, vec![0, 1, 2]),
        // Both: N - W = 65 and N - 1 = 192 = 0 (mod B).
        (window(64, 128), 193, vec![1, 2]),
        (window(64, 128), 440, vec![4, 5, 6]),
        // W = 1: a token attends only to itself, which the decode leg recomputes.
        (window(64, 1), 500, vec![]),
        (window(64, 2), 500, vec![7]),
        (window(64, 2), 1, vec![]),
        (window(64, 64), 65, vec![0]),
        (window(64, 64), 66, vec![0, 1]),
        (window(1, 3), 10, vec![7, 8]),
        (full(1, 1), 3, vec![0, 1]),
        (GroupSpec::mamba(), 1, vec![0]),
        (GroupSpec::mamba(), 1000, vec![0]),
        // Chunks of 64 tokens in blocks of 32: token N - 1 attends within its own chunk.
        (chunked(32, 64), 1, vec![]),
        (chunked(32, 64), 64, vec![0, 1]),
        // N - 1 = 64 opens the second chunk: nothing before it in its chunk.
        (chunked(32, 64), 65, vec![]),
        (chunked(32, 64), 66, vec![2]),
        (chunked(32, 64), 97, vec![2]),
        (chunked(32, 64), 98, vec![2, 3]),
        (chunked(32, 64), 200, vec![6]),
        // A chunk that is not a whole number of blocks: chunk 2 (tokens 40 ..= 59) starts inside
        // block 3 (tokens 36 ..= 47), whose first tokens are never read.
        (chunked(12, 20), 60, vec![3, 4]),
        (chunked(12, 20), 50, vec![3, 4]),
        (chunked(12, 20), 48, vec![3]),
        (chunked(12, 20), 41, vec![]),
        (chunked(5, 7), 16, vec![2]),
        (chunked(5, 7), 17, vec![2, 3]),
    ];
    for (spec, num_prompt_tokens, expected) in cases {
        check_needed(spec, num_prompt_tokens, &expected);
    }
}

#[test]
fn a_one_token_prompt_reads_only_mamba_state() {
    let layout = KvLayout::one_layer_per_group(vec![
        GroupSpec::full(4, 1).unwrap(),
        GroupSpec::sliding_window(4, 8, 1).unwrap(),
        GroupSpec::mamba(),
    ])
    .unwrap();
    // A prefill leg that stopped at N - 1 = 0 tokens holds no attention block at all.
    let offer = exchange::offer(&layout, 1, &[vec![], vec![], vec![5]]).unwrap();
    let need = exchange::need(&layout, 1, &[vec![1], vec![1], vec![2]], &[]).unwrap();
    let pairing = exchange::pair(&layout, &offer, &need).unwrap();
    let pairs: Vec<usize> = pairing.groups.iter().map(Vec::len).collect();
    assert_eq!(pairs, vec![0, 0, 1]);
}

#[test]
fn a_prefill_that_stopped_at_n_minus_1_pairs_like_one_that_computed_n() {
    let layout = seed_layout();
    // N = 449: (N - 1) % 64 == 0, so computing N - 1 tokens leaves the prefill leg a block short.
    let n = 449;
    let all: Vec<Vec<BlockId>> = vec![(1..=8).collect(), vec![0, 0, 0, 0, 0, 6, 7, 8]];
    let all_but_last: Vec<Vec<BlockId>> = vec![(1..=7).collect(), vec![0, 0, 0, 0, 0, 6, 7]];
    let decode: Vec<Vec<BlockId>> = vec![(101..=108).collect(), vec![0, 0, 0, 0, 0, 106, 107, 108]];
    let need = exchange::need(&layout, n, &decode, &[]).unwrap();
    let from_all = exchange::pair(&layout, &exchange::offer(&layout, n, &all).unwrap(), &need).unwrap();
    let from_n_minus_1 = exchange::pair(
        &layout,
        &exchange::offer(&layout, n, &all_but_last).unwrap(),
        &need,
    )
    .unwrap();
    assert_eq!(from_all, from_n_minus_1);
    let ids = block_ids(&from_all);
    // Tokens 0..=447 are read: blocks 0..=6; window 321..=447: blocks 5..=6.
    assert_eq!(
        ids,
        vec![
            (1..=7).map(|p| (p, 100 + p)).collect::<Vec<_>>(),
            vec![(6, 106), (7, 107)],
        ]
    );
}

#[test]
fn a_prefix_hit_on_every_needed_block_reads_nothing() {
    let layout = seed_layout();
    // N = 129: the decode leg reads tokens 0..=127 (blocks 0 and 1), both prefix hits in the full
    // group; the window group (tokens 1..=127, not prefix cached) still reads blocks 0 and 1.
    let need = exchange::need(&layout, 129, &[vec![1, 2, 3], vec![4, 5, 6]], &[2, 0]).unwrap();
    assert!(need.groups[0].blocks.is_empty());
    let offer = exchange::offer(&layout, 129, &[vec![7, 8, 9], vec![10, 11, 12]]).unwrap();
    let pairing = exchange::pair(&layout, &offer, &need).unwrap();
    assert!(pairing.groups[0].is_empty());
    let window: Vec<_> = pairing.groups[1]
        .iter()
        .map(|pair| (pair.remote, pair.local))
        .collect();
    assert_eq!(window, vec![(10, 4), (11, 5)]);
}

#[test]
fn a_block_held_twice_is_refused_on_either_leg() {
    let layout = seed_layout();
    let decode = vec![
        (101..=108).collect::<Vec<_>>(),
        vec![0, 0, 0, 0, 105, 106, 107, 108],
    ];
    let error = exchange::offer(
        &layout,
        N,
        &[vec![10, 11, 12, 13, 14, 15, 16], vec![0, 0, 0, 0, 6, 7, 7]],
    )
    .unwrap_err();
    assert_eq!(
        error,
        ExchangeError::DuplicateBlock {
            group: 1,
            kind: pdkv_core::layout::GroupKind::SlidingWindow { window: W },
            leg: pdkv_core::wire::Role::Prefill,
            block: 7,
            first: 5,
            second: 6,
        }
    );
    assert_eq!(
        error.to_string(),
        "group 1 (sliding_window): prefill leg holds block 7 at both position 5 and 6"
    );
    let mut twice = decode.clone();
    twice[0][6] = 101;
    assert!(matches!(
        exchange::need(&layout, N, &twice, &[]),
        Err(ExchangeError::DuplicateBlock {
            group: 0,
            leg: pdkv_core::wire::Role::Decode,
            block: 101,
            first: 0,
            second: 6,
            ..
        })
    ));
    // Out of order but distinct is fine: the allocator may hand out any free ids.
    let mut shuffled = decode;
    shuffled[0].swap(0, 3);
    assert!(exchange::need(&layout, N, &shuffled, &[]).is_ok());
}

fn layout_strategy() -> impl Strategy<Value = KvLayout> {
    (
        prop_oneof![Just(1u32), 1u32..=8, 1u32..=96],
        prop_oneof![Just(1u32), 1u32..=8, 1u32..=400],
        prop::sample::select(vec![1u32, 2, 4]),
        prop_oneof![Just(1u32), 1u32..=8, 1u32..=96],
        (
            prop_oneof![Just(1u32), 1u32..=8, 1u32..=64],
            prop_oneof![Just(1u32), 1u32..=8, 1u32..=300],
        ),
    )
        .prop_map(
            |(block_size, window, dcp, window_block_size, (chunk_block_size, chunk))| {
                KvLayout::one_layer_per_group(vec![
                    GroupSpec::full(block_size, dcp).unwrap(),
                    GroupSpec::sliding_window(window_block_size, window, 1).unwrap(),
                    GroupSpec::mamba(),
                    GroupSpec::chunked_local(chunk_block_size, chunk, 1).unwrap(),
                ])
                .unwrap()
            },
        )
}

/// Prompt lengths weighted toward the edges of `layout`: N = 1, N within one block, block
/// boundaries of the full group (`N = q * B_eff + r` for r in 0..=2, so `(N - 1) % B_eff == 0`
/// occurs), N <= W, the window's start on a block boundary or a block's last token
/// (`N - W = 0, 1, B - 1 mod B`), the last prompt token opening a chunk or one past it
/// (`N - 1 = 0, 1 mod C`), and anything up to 9000.
fn prompt_strategy(layout: &KvLayout) -> BoxedStrategy<u64> {
    let full_block = layout.groups()[0].effective_block_size();
    let window_spec = layout.groups()[1];
    let window_block = window_spec.effective_block_size();
    let window = u64::from(window_spec.kind().window().unwrap_or(1));
    let chunk = u64::from(layout.groups()[3].kind().chunk().unwrap_or(1));
    prop_oneof![
        (0u64..=40, 0u64..=2).prop_map(move |(q, r)| q * chunk + r + 1),
        Just(1u64),
        1..=full_block,
        (0u64..=60, 0u64..=2).prop_map(move |(q, r)| (q * full_block + r).max(1)),
        1..=window,
        (0u64..=20, prop::sample::select(vec![0, 1, window_block - 1]))
            .prop_map(move |(q, r)| window + q * window_block + r),
        1u64..=9000,
    ]
    .boxed()
}

/// A tail of zero on a leg is a case of its own, not a 1-in-200 draw.
fn tail_strategy() -> impl Strategy<Value = u64> {
    prop_oneof![Just(0u64), 1u64..=200]
}

/// A layout with a prompt length drawn for it.
fn layout_and_prompt() -> impl Strategy<Value = (KvLayout, u64)> {
    layout_strategy().prop_flat_map(|layout| {
        let prompt = prompt_strategy(&layout);
        (Just(layout), prompt)
    })
}

/// Fractions of a group's blocks that are prefix hits, none and all included.
fn hit_fraction() -> impl Strategy<Value = f64> {
    prop_oneof![Just(0.0f64), Just(1.0f64), 0.0f64..=1.0]
}

/// Distinct shuffled ids, so a pairing that joined by index could not pass by luck.
fn id_stream(seed: u64) -> impl Iterator<Item = BlockId> {
    let mut ids: Vec<BlockId> = (1..200_000).collect();
    let mut state = seed | 1;
    for i in (1..ids.len()).rev() {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        ids.swap(i, (state % (i as u64 + 1)) as usize);
    }
    ids.into_iter()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Anchored pairing joins the same absolute position on both legs, covers exactly the
    /// positions the definition gives minus prefix hits, and never pairs a null block, whatever
    /// the tails, and whether the prefill leg computed N tokens or stopped at N - 1.
    #[test]
    fn anchored_pairs_join_equal_positions_and_cover_exactly_the_need(
        (layout, num_prompt_tokens) in layout_and_prompt(),
        prefill_tail in tail_strategy(),
        decode_tail in tail_strategy(),
        prefill_stops_before_last in any::<bool>(),
        full_hits in hit_fraction(),
        window_hits in hit_fraction(),
        mamba_slots in 1usize..=3,
        seed in any::<u64>(),
    ) {
        let mut ids = id_stream(seed);
        let computed = num_prompt_tokens - u64::from(prefill_stops_before_last);
        let prefill = make_lists(&layout, num_prompt_tokens, computed + prefill_tail, mamba_slots, &mut ids);
        let decode = make_lists(&layout, num_prompt_tokens, num_prompt_tokens + decode_tail, mamba_slots, &mut ids);
        let hits = |group: usize, fraction: f64| {
            (decode.blocks[group].len() as f64 * fraction) as u64
        };
        let cached = vec![hits(0, full_hits), hits(1, window_hits), 0, hits(3, window_hits)];
        let offer = exchange::offer(&layout, num_prompt_tokens, &prefill.blocks).unwrap();
        let need = exchange::need(&layout, num_prompt_tokens, &decode.blocks, &cached).unwrap();
        let pairing = exchange::pair(&layout, &offer, &need).unwrap();
        for (group, (spec, pairs)) in layout.groups().iter().zip(&pairing.groups).enumerate() {
            let expected: Vec<u64> = positions_by_definition(spec, num_prompt_tokens)
                .into_iter()
                .filter(|&position| position >= cached[group])
                .collect();
            let mut joined = Vec::new();
            for pair in pairs {
                prop_assert_ne!(pair.remote, NULL_BLOCK);
                prop_assert_ne!(pair.local, NULL_BLOCK);
                let remote = prefill.positions[group][&pair.remote];
                let local = decode.positions[group][&pair.local];
                prop_assert_eq!(remote, local, "group {} joined different positions", group);
                prop_assert_eq!(remote, pair.remote_position);
                joined.push(local);
            }
            prop_assert_eq!(joined, expected, "group {}", group);
        }
    }

    /// A needed block lost to the null block, on either attention group, is refused, never
    /// paired around.
    #[test]
    fn a_needed_null_is_refused(
        (layout, num_prompt_tokens) in layout_and_prompt(),
        group in prop::sample::select(vec![0usize, 1, 3]),
        pick in any::<prop::sample::Index>(),
        seed in any::<u64>(),
    ) {
        let positions = positions_by_definition(&layout.groups()[group], num_prompt_tokens);
        prop_assume!(!positions.is_empty());
        let mut ids = id_stream(seed);
        let mut prefill = make_lists(&layout, num_prompt_tokens, num_prompt_tokens, 1, &mut ids);
        let position = positions[pick.index(positions.len())];
        prefill.blocks[group][position as usize] = NULL_BLOCK;
        let error = exchange::offer(&layout, num_prompt_tokens, &prefill.blocks).unwrap_err();
        prop_assert!(matches!(error, ExchangeError::NullAtNeededPosition { group: g, position: p, .. } if p == position && g == group), "{}", error);
    }

    /// A prefill leg that holds one block fewer than the last needed position is refused.
    #[test]
    fn a_prefill_list_ending_before_the_need_is_refused(
        (layout, num_prompt_tokens) in layout_and_prompt(),
        seed in any::<u64>(),
    ) {
        let positions = positions_by_definition(&layout.groups()[0], num_prompt_tokens);
        prop_assume!(!positions.is_empty());
        let mut ids = id_stream(seed);
        let mut prefill = make_lists(&layout, num_prompt_tokens, num_prompt_tokens, 1, &mut ids);
        let end = positions.last().unwrap() + 1;
        prefill.blocks[0].truncate(end as usize - 1);
        let error = exchange::offer(&layout, num_prompt_tokens, &prefill.blocks).unwrap_err();
        prop_assert!(matches!(error, ExchangeError::ListTooShort { group: 0, needed, .. } if needed == end), "{}", error);
    }

    /// With no tail on either leg and no prefix hit, legacy pairing equals anchored pairing on
    /// every position the decode leg uses ("no change when both legs hold the same number of
    /// blocks"); beyond them legacy reads only null-to-null pairs and the last prompt block, which
    /// the decode leg recomputes.
    #[test]
    fn legacy_equals_anchored_without_tails(
        (layout, num_prompt_tokens) in layout_and_prompt(),
        seed in any::<u64>(),
    ) {
        let mut ids = id_stream(seed);
        let prefill = make_lists(&layout, num_prompt_tokens, num_prompt_tokens, 1, &mut ids);
        let decode = make_lists(&layout, num_prompt_tokens, num_prompt_tokens, 1, &mut ids);
        let offer = exchange::offer(&layout, num_prompt_tokens, &prefill.blocks).unwrap();
        let need = exchange::need(&layout, num_prompt_tokens, &decode.blocks, &[]).unwrap();
        let anchored = exchange::pair(&layout, &offer, &need).unwrap();
        let legacy = exchange::legacy_pair(&layout, &prefill.blocks, &decode.blocks, 1).unwrap();
        for (group, (spec, (anchored, legacy))) in layout.groups().iter().zip(anchored.groups.iter().zip(&legacy.groups)).enumerate() {
            let used = positions_by_definition(spec, num_prompt_tokens);
            let last_prompt_block = (num_prompt_tokens - 1) / spec.effective_block_size();
            for pair in legacy.iter().filter(|pair| pair.remote == NULL_BLOCK || pair.local == NULL_BLOCK) {
                prop_assert!(pair.remote == pair.local, "group {}: legacy paired null with a real block", group);
            }
            let (legacy_used, legacy_rest): (Vec<&BlockPair>, Vec<&BlockPair>) = legacy
                .iter()
                .filter(|pair| pair.remote != NULL_BLOCK)
                .partition(|pair| used.contains(&pair.local_position));
            prop_assert_eq!(legacy_used.len(), anchored.len(), "group {}", group);
            for (legacy, anchored) in legacy_used.iter().zip(anchored) {
                prop_assert_eq!(**legacy, *anchored, "group {}", group);
            }
            for pair in legacy_rest {
                prop_assert_eq!(pair.local_position, last_prompt_block, "group {}", group);
            }
        }
    }
}

/// A leg's aligned-mamba list as vLLM's align mode leaves it after `computed` tokens with `k`
/// speculative scratch blocks: position-indexed, the running state at `(computed - 1) / B`,
/// cached checkpoints (real blocks) at the positions in `checkpoints`, the null block elsewhere
/// below the state, then `k` scratch blocks. Returns the list and the state's block id.
fn aligned_mamba_list(
    block_size: u64,
    computed: u64,
    k: u64,
    checkpoints: &[u64],
    ids: &mut impl Iterator<Item = BlockId>,
) -> (Vec<BlockId>, BlockId) {
    let state = (computed - 1) / block_size;
    let mut list: Vec<BlockId> = (0..state)
        .map(|position| {
            if checkpoints.contains(&position) {
                ids.next().unwrap()
            } else {
                NULL_BLOCK
            }
        })
        .collect();
    let state_block = ids.next().unwrap();
    list.push(state_block);
    list.extend((0..k).map(|_| ids.next().unwrap()));
    (list, state_block)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// vLLM's mamba prefix caching (align mode): the decoder reads exactly the prefill's
    /// running state after N - 1 tokens into its own state slot for N - 1 tokens, whatever the
    /// speculative scratch blocks, cached checkpoints and lookahead on either leg, and reads no
    /// state for a one-token prompt.
    #[test]
    fn aligned_mamba_pairs_the_state_after_n_minus_1_tokens(
        block_size in prop_oneof![Just(1u64), 1u64..=8, 16u64..=64],
        num_prompt_tokens in prop_oneof![1u64..=3, 1u64..=600],
        prefill_k in 0u64..=3,
        decode_k in 0u64..=3,
        decode_tail in tail_strategy(),
        checkpoint_every in 1u64..=4,
        seed in any::<u64>(),
    ) {
        let layout = KvLayout::one_layer_per_group(vec![
            GroupSpec::full(16, 1).unwrap(),
            GroupSpec::new(MambaAlign, Some(block_size as u32), 1).unwrap(),
        ])
        .unwrap();
        let mut ids = id_stream(seed);
        let computed = num_prompt_tokens - 1;
        let full = |tokens: u64, ids: &mut dyn Iterator<Item = BlockId>| -> Vec<BlockId> {
            (0..tokens.div_ceil(16).max(1)).map(|_| ids.next().unwrap()).collect()
        };
        let checkpoints: Vec<u64> = (0..600).filter(|p| p % checkpoint_every == 0).collect();
        let (prefill_mamba, prefill_state) = if computed == 0 {
            (vec![ids.next().unwrap()], NULL_BLOCK)
        } else {
            aligned_mamba_list(block_size, computed, prefill_k, &checkpoints, &mut ids)
        };
        let decode_tokens = (computed + decode_tail).max(1);
        let (decode_mamba, decode_state) =
            aligned_mamba_list(block_size, computed.max(1), decode_k, &[], &mut ids);
        let prefill = vec![full(num_prompt_tokens, &mut ids), prefill_mamba];
        let decode = vec![full(decode_tokens + 1, &mut ids), decode_mamba];
        let offer = exchange::offer(&layout, num_prompt_tokens, &prefill).unwrap();
        let need = exchange::need(&layout, num_prompt_tokens, &decode, &[]).unwrap();
        let pairing = exchange::pair(&layout, &offer, &need).unwrap();
        let states: Vec<(BlockId, BlockId)> =
            pairing.groups[1].iter().map(|pair| (pair.remote, pair.local)).collect();
        if num_prompt_tokens < 2 {
            prop_assert!(states.is_empty(), "{:?}", states);
        } else {
            prop_assert_eq!(states, vec![(prefill_state, decode_state)]);
        }
    }
}

#[test]
fn aligned_mamba_by_hand() {
    let group = GroupSpec::new(MambaAlign, Some(16), 1).unwrap();
    check_needed(group, 1, &[]);
    check_needed(group, 2, &[0]);
    check_needed(group, 17, &[0]);
    check_needed(group, 18, &[1]);
    check_needed(group, 33, &[1]);
    check_needed(group, 34, &[2]);
    assert!(
        GroupSpec::new(MambaAlign, None, 1).is_err(),
        "aligned mamba needs its block size"
    );
    assert!(
        GroupSpec::new(MambaAlign, Some(16), 2).is_err(),
        "vLLM runs mamba without DCP"
    );
}
