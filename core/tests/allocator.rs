//! The allocator under random operation sequences: a block is never handed to a new owner while
//! a request or a pin holds it (except shared prefix-cache hits), generations only grow and are
//! bumped whenever a block goes back to the pool, and once every request finishes and every pin
//! is dropped each group's free count is back at its capacity.

use std::collections::{HashMap, HashSet};

use pdkv_core::allocator::{AllocError, Allocator};
use pdkv_core::block::{BlockId, NULL_BLOCK};
use pdkv_core::layout::{GroupKind, GroupSpec, KvLayout};
use pdkv_core::wire::RequestId;
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Allocate {
        prompt_len: usize,
        lookahead: u64,
        decode_side: bool,
        prefix: u8,
    },
    Extend {
        pick: prop::sample::Index,
        extra: u64,
    },
    ReleaseWindow {
        pick: prop::sample::Index,
        advance: u64,
    },
    Pin {
        pick: prop::sample::Index,
    },
    Unpin {
        pick: prop::sample::Index,
    },
    Finish {
        pick: prop::sample::Index,
        cache: bool,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (1usize..120, 0u64..10, any::<bool>(), 0u8..3).prop_map(
            |(prompt_len, lookahead, decode_side, prefix)| {
                Op::Allocate {
                    prompt_len,
                    lookahead,
                    decode_side,
                    prefix,
                }
            }
        ),
        (any::<prop::sample::Index>(), 1u64..40).prop_map(|(pick, extra)| Op::Extend { pick, extra }),
        (any::<prop::sample::Index>(), 0u64..60)
            .prop_map(|(pick, advance)| Op::ReleaseWindow { pick, advance }),
        any::<prop::sample::Index>().prop_map(|pick| Op::Pin { pick }),
        any::<prop::sample::Index>().prop_map(|pick| Op::Unpin { pick }),
        (any::<prop::sample::Index>(), any::<bool>()).prop_map(|(pick, cache)| Op::Finish { pick, cache }),
    ]
}

fn layout() -> KvLayout {
    KvLayout::one_layer_per_group(vec![
        GroupSpec::full(8, 1).unwrap(),
        GroupSpec::sliding_window(8, 20, 1).unwrap(),
        GroupSpec::mamba(),
    ])
    .unwrap()
}

struct Live {
    id: RequestId,
    prompt: Vec<u32>,
    slots: u64,
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn random_operation_sequences_keep_the_allocator_sound(ops in proptest::collection::vec(op(), 1..80)) {
        let layout = layout();
        let capacity = [40u32, 40, 8];
        let mut allocator = Allocator::new(&layout, &capacity, true).unwrap();
        let mut live: Vec<Live> = Vec::new();
        let mut pins: Vec<Vec<Vec<BlockId>>> = Vec::new();
        let mut generations: HashMap<(usize, BlockId), u32> = HashMap::new();
        let mut next = 1u64;
        for op in ops {
            match op {
                Op::Allocate { prompt_len, lookahead, decode_side, prefix } => {
                    // Prompts share a prefix family so prefix hits happen.
                    let prompt: Vec<u32> = (0..prompt_len as u32).map(|t| if t < 40 { u32::from(prefix) * 1000 + t } else { t * 7 + next as u32 }).collect();
                    let slots = prompt_len as u64 + lookahead;
                    let attending = decode_side.then(|| prompt_len as u64 - 1);
                    let id = RequestId(next);
                    next += 1;
                    match allocator.allocate(id, &prompt, slots, attending) {
                        Ok(allocation) => {
                            for (group, list) in allocation.blocks.iter().enumerate() {
                                let expected = layout.groups()[group].blocks_for_tokens(slots) as usize;
                                prop_assert_eq!(list.len(), expected);
                                prop_assert!(list[allocation.cached_blocks[group] as usize..].iter().all(|&b| b as usize <= capacity[group] as usize));
                            }
                            live.push(Live { id, prompt, slots });
                        }
                        Err(AllocError::OutOfBlocks { .. } | AllocError::NeverFits { .. }) => {}
                        Err(error) => prop_assert!(false, "unexpected refusal: {}", error),
                    }
                }
                Op::Extend { pick, extra } if !live.is_empty() => {
                    let index = pick.index(live.len());
                    let request = &mut live[index];
                    if allocator.extend(request.id, request.slots + extra).is_ok() {
                        request.slots += extra;
                    }
                }
                Op::ReleaseWindow { pick, advance } if !live.is_empty() => {
                    let request = &live[pick.index(live.len())];
                    let token = (request.prompt.len() as u64 - 1 + advance).min(request.slots.saturating_sub(1));
                    allocator.release_window(request.id, token).unwrap();
                }
                Op::Pin { pick } if !live.is_empty() => {
                    let request = &live[pick.index(live.len())];
                    let lists = allocator.blocks(request.id).unwrap().to_vec();
                    allocator.pin(&lists).unwrap();
                    pins.push(lists);
                }
                Op::Unpin { pick } if !pins.is_empty() => {
                    let lists = pins.remove(pick.index(pins.len()));
                    allocator.unpin(&lists).unwrap();
                }
                Op::Finish { pick, cache } if !live.is_empty() => {
                    let request = live.remove(pick.index(live.len()));
                    allocator.finish(request.id, cache.then_some(request.prompt.as_slice())).unwrap();
                }
                _ => {}
            }
            for freed in allocator.poll_freed() {
                let previous = generations.insert((freed.group, freed.block), freed.generation).unwrap_or(0);
                prop_assert!(freed.generation > previous, "generation of {:?} went {} -> {}", (freed.group, freed.block), previous, freed.generation);
            }
            // Held or pinned blocks belong to exactly the holders the model knows about: outside
            // the prefix cache's shared full-group blocks, no block has two holders.
            for group in 0..layout.groups().len() {
                let mut held: HashSet<BlockId> = HashSet::new();
                let shareable = layout.groups()[group].kind() == GroupKind::Full;
                for request in &live {
                    for &block in &allocator.blocks(request.id).unwrap()[group] {
                        if block != NULL_BLOCK {
                            prop_assert!(held.insert(block) || shareable, "group {} block {} held twice", group, block);
                        }
                    }
                }
                let pinned: HashSet<BlockId> = pins.iter().flat_map(|lists| lists[group].iter().copied()).filter(|&b| b != NULL_BLOCK).collect();
                let holders = held.union(&pinned).count();
                prop_assert!(allocator.free_blocks(group) + holders <= capacity[group] as usize, "group {}: free + held exceeds capacity", group);
            }
        }
        for request in live {
            allocator.finish(request.id, None).unwrap();
        }
        for lists in pins {
            allocator.unpin(&lists).unwrap();
        }
        prop_assert!(allocator.is_idle(), "blocks leaked: free {:?}", (0..3).map(|g| allocator.free_blocks(g)).collect::<Vec<_>>());
    }
}
