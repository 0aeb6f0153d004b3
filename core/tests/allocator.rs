//! The allocator under random operation sequences: a block is never handed to a new owner while
//! a request or a pin holds it, except as a prefix-cache hit (a leading full block of a full
//! group, at the same position in every holder); `extend` grows exactly to the slots asked for or
//! changes nothing; generations only grow and are bumped whenever a block goes back to the pool;
//! free blocks plus held blocks always equal the capacity; and once every request finishes and
//! every pin is dropped each group's free count is back at its capacity.

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
    /// Leading positions per group that were prefix-cache hits at allocation.
    cached: Vec<u64>,
}

/// A pin and the request whose lists it pinned.
struct Pin {
    owner: RequestId,
    lists: Vec<Vec<BlockId>>,
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn random_operation_sequences_keep_the_allocator_sound(ops in proptest::collection::vec(op(), 1..80)) {
        let layout = layout();
        let capacity = [40u32, 40, 8];
        let mut allocator = Allocator::new(&layout, &capacity, true).unwrap();
        let mut live: Vec<Live> = Vec::new();
        let mut pins: Vec<Pin> = Vec::new();
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
                            live.push(Live { id, prompt, slots, cached: allocation.cached_blocks.clone() });
                        }
                        Err(AllocError::OutOfBlocks { .. } | AllocError::NeverFits { .. }) => {}
                        Err(error) => prop_assert!(false, "unexpected refusal: {}", error),
                    }
                }
                Op::Extend { pick, extra } if !live.is_empty() => {
                    let index = pick.index(live.len());
                    let request = &mut live[index];
                    let before = allocator.blocks(request.id).unwrap().to_vec();
                    let wanted = request.slots + extra;
                    match allocator.extend(request.id, wanted) {
                        Ok(lists) => {
                            for (group, (list, old)) in lists.iter().zip(&before).enumerate() {
                                let expected = (layout.groups()[group].blocks_for_tokens(wanted) as usize).max(old.len());
                                prop_assert_eq!(list.len(), expected, "group {} after extend", group);
                                prop_assert_eq!(&list[..old.len()], &old[..], "group {}: extend moved held blocks", group);
                                prop_assert!(list[old.len()..].iter().all(|&b| b != NULL_BLOCK), "group {}: extend handed out the null block", group);
                            }
                            request.slots = wanted;
                        }
                        Err(AllocError::OutOfBlocks { .. }) => {
                            prop_assert_eq!(allocator.blocks(request.id).unwrap(), &before[..], "a refused extend changed the lists");
                        }
                        Err(error) => prop_assert!(false, "unexpected refusal: {}", error),
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
                    pins.push(Pin { owner: request.id, lists });
                }
                Op::Unpin { pick } if !pins.is_empty() => {
                    let pin = pins.remove(pick.index(pins.len()));
                    allocator.unpin(&pin.lists).unwrap();
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
            // A block with more than one holder (live requests and pins of other requests) is a
            // prefix-cache hit in every live holder: a full group, a leading cached position, the
            // same position everywhere. And free + held == capacity: every block is one or the other.
            for (group, &group_capacity) in capacity.iter().enumerate() {
                // block -> (position, request) for every live holder
                let mut holders: HashMap<BlockId, Vec<(usize, RequestId)>> = HashMap::new();
                for request in &live {
                    for (position, &block) in allocator.blocks(request.id).unwrap()[group].iter().enumerate() {
                        if block != NULL_BLOCK {
                            holders.entry(block).or_default().push((position, request.id));
                        }
                    }
                }
                let mut pinned_by: HashMap<BlockId, HashSet<RequestId>> = HashMap::new();
                for pin in &pins {
                    for &block in pin.lists[group].iter().filter(|&&b| b != NULL_BLOCK) {
                        pinned_by.entry(block).or_default().insert(pin.owner);
                    }
                }
                for (&block, holding) in &holders {
                    let foreign_pin = pinned_by.get(&block).is_some_and(|owners| owners.iter().any(|owner| holding.iter().all(|(_, id)| id != owner)));
                    if holding.len() < 2 && !foreign_pin {
                        continue;
                    }
                    prop_assert_eq!(layout.groups()[group].kind(), GroupKind::Full, "group {} block {} has several holders", group, block);
                    for &(position, id) in holding {
                        let cached = live.iter().find(|request| request.id == id).unwrap().cached[group];
                        prop_assert!((position as u64) < cached, "group {} block {} is shared but not a prefix hit of {} (position {}, {} hits)", group, block, id, position, cached);
                        prop_assert_eq!(position, holding[0].0, "group {} block {} shared at different positions", group, block);
                    }
                }
                let held: HashSet<BlockId> = holders.keys().copied().chain(pinned_by.keys().copied()).collect();
                prop_assert_eq!(allocator.free_blocks(group) + held.len(), group_capacity as usize, "group {}: free + held != capacity", group);
            }
        }
        for request in live {
            allocator.finish(request.id, None).unwrap();
        }
        for pin in pins {
            allocator.unpin(&pin.lists).unwrap();
        }
        prop_assert!(allocator.is_idle(), "blocks leaked: free {:?}", (0..3).map(|g| allocator.free_blocks(g)).collect::<Vec<_>>());
    }
}
