//! A leg's node rules (`core::node::LegNode`) driven by hand: which message a leg takes from
//! whom, tombstones, draining, grants renewed, released and expired, the wait queue's bound,
//! and blocks freed published before anything after them. The simulation checks the same
//! object under faults; these name each rule once.

use std::sync::{Arc, Mutex};

use pdkv_core::allocator::Allocator;
use pdkv_core::exchange::PairingMode;
use pdkv_core::grant::GrantTable;
use pdkv_core::layout::{GroupSpec, KvLayout};
use pdkv_core::leg::GenerationCheckError;
use pdkv_core::leg::{LegConfig, PrefillTokens};
use pdkv_core::node::{LegNode, NodeConfig, NodeOutput, Refusal};
use pdkv_core::sampling::{Sampling, SamplingError};
use pdkv_core::wire::{
    Body, Envelope, Failure, GrantId, Incarnation, KvParams, NodeId, ParamsError, RequestId, Role, Stage,
};

const LEASE_MS: u64 = 50;
const ME: Incarnation = Incarnation(7);

fn node(name: &str) -> NodeId {
    NodeId(name.into())
}

/// One full-attention group of 4-token blocks, 8 blocks.
fn leg(role: Role, wait_queue: usize) -> LegNode {
    let layout = KvLayout::one_layer_per_group(vec![GroupSpec::full(4, 1).unwrap()]).unwrap();
    let name = match role {
        Role::Prefill => "prefill-0",
        _ => "decode-0",
    };
    let config = NodeConfig {
        leg: LegConfig {
            node: node(name),
            incarnation: ME,
            layout: layout.clone(),
            lookahead_tokens: 0,
            prefill_tokens: PrefillTokens::All,
            pairing: PairingMode::Anchored,
            max_decode_tail_blocks: 1,
            alloc_wait_ms: 100,
        },
        role,
        lease_ms: LEASE_MS,
        wait_queue,
    };
    let allocator = Allocator::new(&layout, &[8], false).unwrap();
    LegNode::new(config, allocator, Arc::new(Mutex::new(GrantTable::new(4))))
}

fn envelope(request: u64, from: &str, body: Body) -> Envelope {
    Envelope {
        request: RequestId(request),
        from: node(from),
        incarnation: Incarnation(1),
        budget_ms: 1_000,
        body,
    }
}

fn prefill(request: u64, tokens: u32) -> Envelope {
    let body = Body::Prefill {
        prompt: (0..tokens).collect(),
        decode: node("decode-0"),
    };
    envelope(request, "router", body)
}

fn outputs(leg: &mut LegNode) -> Vec<NodeOutput> {
    std::iter::from_fn(|| leg.poll_output()).collect()
}

/// Runs a prefill to its grant: the KV parameters it sent the router.
fn granted(leg: &mut LegNode, request: u64, tokens: u32, now_ms: u64) -> KvParams {
    leg.handle_envelope(Role::Router, prefill(request, tokens), now_ms)
        .unwrap();
    assert!(matches!(outputs(leg).as_slice(), [NodeOutput::Compute { .. }]));
    leg.handle_computed(RequestId(request), Ok(()), now_ms);
    outputs(leg)
        .into_iter()
        .find_map(|output| match output {
            NodeOutput::Send(out) => match out.body {
                Body::KvReady(params) => Some(params),
                _ => None,
            },
            _ => None,
        })
        .expect("kv ready sent")
}

#[test]
fn a_leg_takes_each_message_only_from_the_role_that_sends_it_and_only_at_its_own_role() {
    let mut prefill_leg = leg(Role::Prefill, 4);
    // A decode leg may not ask for a prefill.
    let refused = prefill_leg.handle_envelope(Role::Decode, prefill(1, 5), 0);
    assert_eq!(
        refused,
        Err(Refusal::WrongSender {
            node: node("router"),
            body: "prefill",
            expected: Role::Router
        })
    );
    // A renewal's answer belongs at a decode leg, not at a prefill leg.
    let renewed = envelope(
        2,
        "prefill-1",
        Body::Renewed {
            grant: GrantId(1),
            lease_ms: 5,
        },
    );
    assert!(matches!(
        prefill_leg.handle_envelope(Role::Prefill, renewed, 0),
        Err(Refusal::Misrouted { body: "renewed", .. })
    ));
    // Answers go to the router, never to a leg.
    let answer = envelope(
        3,
        "router",
        Body::Failed {
            stage: Stage::Decode,
            reason: Failure::Cancelled,
        },
    );
    assert!(matches!(
        prefill_leg.handle_envelope(Role::Router, answer, 0),
        Err(Refusal::Misrouted { body: "failed", .. })
    ));
    assert!(prefill_leg.is_idle(), "nothing refused started anything");
}

#[test]
fn a_request_starts_once_and_never_after_its_abort() {
    let mut prefill_leg = leg(Role::Prefill, 4);
    prefill_leg
        .handle_envelope(Role::Router, prefill(1, 5), 0)
        .unwrap();
    assert_eq!(
        prefill_leg.handle_envelope(Role::Router, prefill(1, 5), 1),
        Err(Refusal::Duplicate {
            node: node("prefill-0"),
            request: RequestId(1)
        })
    );
    // Aborted after it started, a copy is still a duplicate, not "aborted".
    prefill_leg
        .handle_envelope(Role::Router, envelope(1, "router", Body::Abort), 1)
        .unwrap();
    assert!(matches!(
        prefill_leg.handle_envelope(Role::Router, prefill(1, 5), 1),
        Err(Refusal::Duplicate { .. })
    ));
    // An abort that overtook its request leaves a tombstone.
    prefill_leg
        .handle_envelope(Role::Router, envelope(2, "router", Body::Abort), 1)
        .unwrap();
    assert_eq!(
        prefill_leg.handle_envelope(Role::Router, prefill(2, 5), 2),
        Err(Refusal::Aborted {
            node: node("prefill-0"),
            request: RequestId(2)
        })
    );
}

#[test]
fn a_draining_leg_refuses_new_requests_and_tells_the_router_why() {
    let mut prefill_leg = leg(Role::Prefill, 4);
    prefill_leg.drain();
    let refused = prefill_leg.handle_envelope(Role::Router, prefill(1, 5), 0);
    assert!(matches!(refused, Err(Refusal::Busy { .. })), "{refused:?}");
    let told = outputs(&mut prefill_leg);
    match told.as_slice() {
        [NodeOutput::Send(out)] => {
            assert_eq!(out.to, node("router"));
            assert!(matches!(
                &out.body,
                Body::Failed { stage: Stage::Prefill, reason: Failure::Refused { node: leg, .. } } if *leg == node("prefill-0")
            ));
        }
        other => panic!("{other:?}"),
    }
    assert!(prefill_leg.is_idle());
}

/// KV parameters a decode leg cannot use are refused with the typed reason the router is told,
/// before any block is allocated.
#[test]
fn a_decode_leg_names_what_is_wrong_with_the_kv_params_it_was_sent() {
    let mut prefill_leg = leg(Role::Prefill, 4);
    let params = granted(&mut prefill_leg, 1, 9, 0);
    let decode = |request: u64, prompt: u32, params: &KvParams, temperature: f32| {
        let body = Body::Decode {
            prompt: (0..prompt).collect(),
            params: params.clone(),
            max_tokens: 1,
            stream: false,
            sampling: Sampling {
                temperature,
                ..Sampling::default()
            },
        };
        envelope(request, "router", body)
    };
    let told = |leg: &mut LegNode| -> Vec<Failure> {
        outputs(leg)
            .into_iter()
            .filter_map(|output| match output {
                NodeOutput::Send(out) => match out.body {
                    Body::Failed { reason, .. } => Some(reason),
                    _ => None,
                },
                _ => None,
            })
            .collect()
    };
    let mut decode_leg = leg(Role::Decode, 4);
    let refused = decode_leg.handle_envelope(Role::Router, decode(2, 9, &params, 0.0), 0);
    assert!(matches!(refused, Err(Refusal::BadMessage { .. })), "{refused:?}");
    assert_eq!(
        told(&mut decode_leg),
        [Failure::BadParams(ParamsError::ForAnotherRequest {
            params: RequestId(1),
            message: RequestId(2),
        })]
    );
    let refused = decode_leg.handle_envelope(Role::Router, decode(1, 9, &params, -1.0), 0);
    assert!(matches!(refused, Err(Refusal::BadMessage { .. })), "{refused:?}");
    assert_eq!(
        told(&mut decode_leg),
        [Failure::BadParams(ParamsError::Sampling(
            SamplingError::Temperature("-1".into())
        ))]
    );
    // The offer covers 9 tokens; a prompt of 8 sent with it is not the prompt it was made for.
    decode_leg
        .handle_envelope(Role::Router, decode(1, 8, &params, 0.0), 0)
        .unwrap();
    assert_eq!(
        told(&mut decode_leg),
        [Failure::BadParams(ParamsError::PromptLength {
            offer: 9,
            prompt: 8
        })]
    );
    // Generations that do not match the offered blocks one to one.
    let mut short = params.clone();
    short.generations[0].pop();
    decode_leg
        .handle_envelope(
            Role::Router,
            decode(
                3,
                9,
                &KvParams {
                    request: RequestId(3),
                    ..short
                },
                0.0,
            ),
            0,
        )
        .unwrap();
    let failures = told(&mut decode_leg);
    assert!(
        matches!(
            failures.as_slice(),
            [Failure::BadParams(ParamsError::Checks(
                GenerationCheckError::GenerationCount { group: 0, .. }
            ))]
        ),
        "{failures:?}"
    );
}

#[test]
fn a_grant_is_renewed_and_released_only_by_its_reader_and_only_at_this_incarnation() {
    let mut prefill_leg = leg(Role::Prefill, 4);
    let params = granted(&mut prefill_leg, 1, 9, 0);
    assert_eq!(params.lease_ms, LEASE_MS);
    let renew = |issuer| {
        envelope(
            1,
            "decode-0",
            Body::Renew {
                grant: params.grant,
                issuer,
            },
        )
    };
    assert_eq!(
        prefill_leg.handle_envelope(Role::Decode, renew(Incarnation(99)), 10),
        Err(Refusal::ForeignGrant {
            node: node("prefill-0"),
            issuer: Incarnation(99),
            mine: ME
        })
    );
    prefill_leg.handle_envelope(Role::Decode, renew(ME), 10).unwrap();
    match outputs(&mut prefill_leg).as_slice() {
        [NodeOutput::Send(out)] => assert_eq!(
            out.body,
            Body::Renewed {
                grant: params.grant,
                lease_ms: LEASE_MS
            }
        ),
        other => panic!("{other:?}"),
    }
    // Renewed at 10: the lease now ends at 60, not 50.
    assert_eq!(prefill_leg.poll_timeout(), Some(10 + LEASE_MS));
    // Another decode leg may not release it.
    let release = |from| {
        envelope(
            1,
            from,
            Body::Release {
                grant: params.grant,
                issuer: ME,
            },
        )
    };
    assert!(matches!(
        prefill_leg.handle_envelope(Role::Decode, release("decode-1"), 20),
        Err(Refusal::Grant { .. })
    ));
    assert!(!prefill_leg.is_idle());
    prefill_leg
        .handle_envelope(Role::Decode, release("decode-0"), 20)
        .unwrap();
    // The grant's blocks are freed, and published as such.
    assert!(
        outputs(&mut prefill_leg)
            .iter()
            .any(|output| matches!(output, NodeOutput::Freed(blocks) if !blocks.is_empty()))
    );
    assert!(prefill_leg.is_idle());
    assert_eq!(prefill_leg.poll_timeout(), None);
}

#[test]
fn an_unreleased_grant_lapses_at_its_lease_and_its_blocks_come_back() {
    let mut prefill_leg = leg(Role::Prefill, 4);
    let params = granted(&mut prefill_leg, 1, 9, 0);
    assert_eq!(prefill_leg.poll_timeout(), Some(LEASE_MS));
    prefill_leg.handle_timeout(LEASE_MS - 1);
    assert!(!prefill_leg.is_idle(), "not before the lease ends");
    prefill_leg.handle_timeout(LEASE_MS);
    let expired: Vec<GrantId> = outputs(&mut prefill_leg)
        .into_iter()
        .filter_map(|output| match output {
            NodeOutput::LeaseExpired { grant, .. } => Some(grant),
            _ => None,
        })
        .collect();
    assert_eq!(expired, vec![params.grant]);
    assert!(prefill_leg.is_idle());
}

#[test]
fn a_kv_ready_that_cannot_be_sent_revokes_its_grant_at_once() {
    let mut prefill_leg = leg(Role::Prefill, 4);
    granted(&mut prefill_leg, 1, 9, 0);
    assert!(!prefill_leg.is_idle());
    prefill_leg.handle_kv_ready_undeliverable(RequestId(1), 1);
    assert!(prefill_leg.is_idle(), "freed now, not at lease end");
}

#[test]
fn requests_past_the_wait_queue_bound_fail_at_once_naming_the_queue() {
    // 8 blocks of 4 tokens: 32 slots. One request takes 32; the next two must wait, and a
    // queue of 1 lets one of them.
    let mut prefill_leg = leg(Role::Prefill, 1);
    prefill_leg
        .handle_envelope(Role::Router, prefill(1, 32), 0)
        .unwrap();
    prefill_leg
        .handle_envelope(Role::Router, prefill(2, 4), 0)
        .unwrap();
    prefill_leg
        .handle_envelope(Role::Router, prefill(3, 4), 0)
        .unwrap();
    let failures: Vec<(RequestId, Failure)> = outputs(&mut prefill_leg)
        .into_iter()
        .filter_map(|output| match output {
            NodeOutput::Send(out) => match out.body {
                Body::Failed { reason, .. } => Some((out.request, reason)),
                _ => None,
            },
            _ => None,
        })
        .collect();
    assert_eq!(
        failures,
        vec![(
            RequestId(3),
            Failure::QueueFull {
                leg: node("prefill-0"),
                capacity: 1
            }
        )]
    );
    // The one that waits starts when the first one's blocks come back.
    prefill_leg.handle_computed(RequestId(1), Err(Failure::Engine("gone".into())), 5);
    let after = outputs(&mut prefill_leg);
    let freed_at = after
        .iter()
        .position(|output| matches!(output, NodeOutput::Freed(_)));
    let computed_at = after
        .iter()
        .position(|output| matches!(output, NodeOutput::Compute { request, .. } if *request == RequestId(2)));
    assert!(
        freed_at.is_some() && freed_at < computed_at,
        "frees are published before the woken request's work: {after:?}"
    );
}

/// A lost reader's grants are revoked at once (not at lease end); a lost router's requests are
/// aborted; a request whose other leg is lost runs on (its router decides); a stranger's loss
/// touches nothing.
#[test]
fn a_lost_peer_loses_its_grants_and_a_lost_router_its_requests() {
    let mut prefill_leg = leg(Role::Prefill, 4);
    granted(&mut prefill_leg, 1, 9, 0);
    // A second request, computing for decode-0, asked by the router.
    prefill_leg
        .handle_envelope(Role::Router, prefill(2, 5), 0)
        .unwrap();
    assert!(matches!(
        outputs(&mut prefill_leg).as_slice(),
        [NodeOutput::Compute { .. }]
    ));
    prefill_leg.handle_peer_lost(&node("decode-9"), 1);
    assert!(
        outputs(&mut prefill_leg).is_empty(),
        "a stranger's loss changes nothing"
    );
    assert_eq!(prefill_leg.load().grants, 1);

    prefill_leg.handle_peer_lost(&node("decode-0"), 2);
    let freed = outputs(&mut prefill_leg);
    assert!(
        freed
            .iter()
            .any(|output| matches!(output, NodeOutput::Freed(blocks) if !blocks.is_empty())),
        "the grant's blocks come back before its lease ends: {freed:?}"
    );
    assert_eq!(prefill_leg.load().grants, 0);
    assert_eq!(prefill_leg.num_jobs(), 1, "request 2 runs on: its router decides");

    prefill_leg.handle_peer_lost(&node("router"), 3);
    prefill_leg.handle_computed(RequestId(2), Ok(()), 4);
    let after = outputs(&mut prefill_leg);
    assert!(
        !after
            .iter()
            .any(|output| matches!(output, NodeOutput::Send(out) if matches!(out.body, Body::KvReady(_)))),
        "an aborted prefill grants nothing: {after:?}"
    );
    assert_eq!(prefill_leg.load().grants, 0);
    assert!(prefill_leg.is_idle());
    assert_eq!(prefill_leg.poll_timeout(), None);
}
