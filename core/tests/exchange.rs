//! Exchange behaviour: the seed's four tail combinations, property tests over layouts and
//! prompts, and refusals that name what is wrong.

use std::collections::HashMap;

use pdkv_core::block::{BlockId, NULL_BLOCK};
use pdkv_core::exchange::{self, ExchangeError, Pairing, needed_positions};
use pdkv_core::layout::{GroupKind, GroupSpec, KvLayout};
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

/// Whether a pairing reads every needed position into the same position and nothing shifted.
fn joins_needed_positions(layout: &KvLayout, pairing: &Pairing) -> bool {
    layout.groups().iter().zip(&pairing.groups).all(|(spec, pairs)| {
        let shifted = pairs
            .iter()
            .any(|pair| pair.remote_position != pair.local_position);
        let covered = needed_positions(spec, N).all(|p| {
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
        let ids: Vec<Vec<(BlockId, BlockId)>> = pairing
            .groups
            .iter()
            .map(|pairs| pairs.iter().map(|pair| (pair.remote, pair.local)).collect())
            .collect();
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
            "group 0 (full): prefill leg holds 2 blocks, the prompt needs 7",
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

/// Lists for `layout` with `lookahead` tail tokens; real ids are distinct, drawn from `ids`,
/// positions below the window's first needed block are null.
fn make_lists(
    layout: &KvLayout,
    num_prompt_tokens: u64,
    lookahead: u64,
    mamba_slots: usize,
    ids: &mut impl Iterator<Item = BlockId>,
) -> Lists {
    let mut blocks = Vec::new();
    let mut positions = Vec::new();
    for spec in layout.groups() {
        let (len, nulls) = match spec.kind() {
            GroupKind::Mamba => (mamba_slots as u64, 0),
            GroupKind::Full => (spec.blocks_for_tokens(num_prompt_tokens + lookahead), 0),
            GroupKind::SlidingWindow { .. } => (
                spec.blocks_for_tokens(num_prompt_tokens + lookahead),
                needed_positions(spec, num_prompt_tokens).start,
            ),
        };
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

fn layout_strategy() -> impl Strategy<Value = KvLayout> {
    (
        1u32..=96,
        1u32..=400,
        prop::sample::select(vec![1u32, 2, 4]),
        1u32..=96,
    )
        .prop_map(|(block_size, window, dcp, window_block_size)| {
            KvLayout::one_layer_per_group(vec![
                GroupSpec::full(block_size, dcp).unwrap(),
                GroupSpec::sliding_window(window_block_size, window, 1).unwrap(),
                GroupSpec::mamba(),
            ])
            .unwrap()
        })
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
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Anchored pairing joins the same absolute position on both legs, covers exactly the needed
    /// positions minus prefix hits, and never pairs a null block, whatever the tails.
    #[test]
    fn anchored_pairs_join_equal_positions_and_cover_exactly_the_need(
        layout in layout_strategy(),
        num_prompt_tokens in 1u64..=9000,
        prefill_tail in 0u64..=200,
        decode_tail in 0u64..=200,
        cached_fraction in 0.0f64..=1.0,
        mamba_slots in 1usize..=3,
        seed in any::<u64>(),
    ) {
        let mut ids = id_stream(seed);
        let prefill = make_lists(&layout, num_prompt_tokens, prefill_tail, mamba_slots, &mut ids);
        let decode = make_lists(&layout, num_prompt_tokens, decode_tail, mamba_slots, &mut ids);
        let full_blocks = layout.groups()[0].blocks_for_tokens(num_prompt_tokens);
        let cached = vec![(full_blocks as f64 * cached_fraction) as u64, 0, 0];
        let offer = exchange::offer(&layout, num_prompt_tokens, &prefill.blocks).unwrap();
        let need = exchange::need(&layout, num_prompt_tokens, &decode.blocks, &cached).unwrap();
        let pairing = exchange::pair(&layout, &offer, &need).unwrap();
        for (group, (spec, pairs)) in layout.groups().iter().zip(&pairing.groups).enumerate() {
            let range = needed_positions(spec, num_prompt_tokens);
            let expected: Vec<u64> = (range.start.max(cached[group])..range.end).collect();
            let mut joined = Vec::new();
            for pair in pairs {
                prop_assert_ne!(pair.remote, NULL_BLOCK);
                prop_assert_ne!(pair.local, NULL_BLOCK);
                let remote = prefill.positions[group][&pair.remote];
                let local = decode.positions[group][&pair.local];
                prop_assert_eq!(remote, local, "group {} joined different positions", group);
                joined.push(local);
            }
            prop_assert_eq!(joined, expected, "group {}", group);
        }
    }

    /// A needed prefill block lost to the null block is refused, never paired around.
    #[test]
    fn a_needed_null_is_refused(
        layout in layout_strategy(),
        num_prompt_tokens in 1u64..=9000,
        pick in any::<prop::sample::Index>(),
        seed in any::<u64>(),
    ) {
        let mut ids = id_stream(seed);
        let mut prefill = make_lists(&layout, num_prompt_tokens, 0, 1, &mut ids);
        let range = needed_positions(&layout.groups()[1], num_prompt_tokens);
        let position = range.start + pick.index((range.end - range.start) as usize) as u64;
        prefill.blocks[1][position as usize] = NULL_BLOCK;
        let error = exchange::offer(&layout, num_prompt_tokens, &prefill.blocks).unwrap_err();
        prop_assert!(matches!(error, ExchangeError::NullAtNeededPosition { group: 1, position: p, .. } if p == position), "{}", error);
    }

    /// With no tail on either leg and no prefix hit, legacy pairing equals anchored pairing apart
    /// from null-to-null pairs below the window ("no change when both legs hold the same number
    /// of blocks").
    #[test]
    fn legacy_equals_anchored_without_tails(
        layout in layout_strategy(),
        num_prompt_tokens in 1u64..=9000,
        seed in any::<u64>(),
    ) {
        let mut ids = id_stream(seed);
        let prefill = make_lists(&layout, num_prompt_tokens, 0, 1, &mut ids);
        let decode = make_lists(&layout, num_prompt_tokens, 0, 1, &mut ids);
        let offer = exchange::offer(&layout, num_prompt_tokens, &prefill.blocks).unwrap();
        let need = exchange::need(&layout, num_prompt_tokens, &decode.blocks, &[]).unwrap();
        let anchored = exchange::pair(&layout, &offer, &need).unwrap();
        let legacy = exchange::legacy_pair(&layout, &prefill.blocks, &decode.blocks, 1).unwrap();
        for (group, (anchored, legacy)) in anchored.groups.iter().zip(&legacy.groups).enumerate() {
            let legacy_real: Vec<_> = legacy
                .iter()
                .filter(|pair| !(pair.remote == NULL_BLOCK && pair.local == NULL_BLOCK))
                .collect();
            for pair in legacy.iter().filter(|pair| pair.remote == NULL_BLOCK || pair.local == NULL_BLOCK) {
                prop_assert!(pair.remote == pair.local, "group {}: legacy paired null with a real block", group);
            }
            prop_assert_eq!(legacy_real.len(), anchored.len(), "group {}", group);
            for (legacy, anchored) in legacy_real.iter().zip(anchored) {
                prop_assert_eq!(**legacy, *anchored, "group {}", group);
            }
        }
    }
}
