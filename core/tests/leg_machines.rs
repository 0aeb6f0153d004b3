//! The leg machines step by step: what each asks of its shell, in order, on the happy path and
//! on every failure path the protocol names (a lost reply, a READ failing half way, an abort
//! while a READ is in flight, a deadline passing at each stage, a stale incarnation).

use pdkv_core::allocator::{AllocError, Allocation};
use pdkv_core::block::BlockId;
use pdkv_core::exchange::PairingMode;
use pdkv_core::grant::GrantError;
use pdkv_core::layout::{GroupKind, GroupSpec, KvLayout};
use pdkv_core::leg::{
    DecodeCommand, DecodeMachine, IssuedGrant, LegConfig, PrefillCommand, PrefillMachine, PrefillTokens,
    ReadDone, RequestOutcome, RouterCommand, RouterMachine,
};
use pdkv_core::sampling::{Finish, Sampling};
use pdkv_core::wire::{
    Body, DecodeOutput, Failure, GrantId, Incarnation, KvParams, NodeId, RequestId, Stage,
};

const LEASE_MS: u64 = 30;
const PREFILL_INCARNATION: Incarnation = Incarnation(0xAAAA);

fn node(name: &str) -> NodeId {
    NodeId(name.into())
}

/// Full group B=4 and a window group B=4, W=6.
fn config(name: &str, lookahead: u64, prefill_tokens: PrefillTokens) -> LegConfig {
    LegConfig {
        node: node(name),
        incarnation: if name == "p" {
            PREFILL_INCARNATION
        } else {
            Incarnation(0xDDDD)
        },
        layout: KvLayout::one_layer_per_group(vec![
            GroupSpec::full(4, 1).unwrap(),
            GroupSpec::sliding_window(4, 6, 1).unwrap(),
        ])
        .unwrap(),
        lookahead_tokens: lookahead,
        prefill_tokens,
        pairing: PairingMode::Anchored,
        max_decode_tail_blocks: 1,
        alloc_wait_ms: 100,
    }
}

fn drain_prefill(machine: &mut PrefillMachine) -> Vec<PrefillCommand> {
    std::iter::from_fn(|| machine.poll_command()).collect()
}

fn drain_decode(machine: &mut DecodeMachine) -> Vec<DecodeCommand> {
    std::iter::from_fn(|| machine.poll_command()).collect()
}

fn drain_router(machine: &mut RouterMachine) -> Vec<RouterCommand> {
    std::iter::from_fn(|| machine.poll_command()).collect()
}

fn out_of_blocks() -> AllocError {
    AllocError::OutOfBlocks {
        group: 0,
        kind: GroupKind::Full,
        needed: 3,
        free: 0,
    }
}

/// A 10-token prompt (tokens 0..=8 read: blocks 0..=2; window tokens 4..=8: blocks 1..=2).
fn prompt() -> Vec<u32> {
    (0..10).collect()
}

/// Runs a prefill machine to its grant; returns the commands after the grant and the params.
fn prefill_to_grant(
    prefill_tokens: PrefillTokens,
    grant_at_ms: u64,
) -> (PrefillMachine, Vec<PrefillCommand>) {
    let mut machine = PrefillMachine::new(
        config("p", 2, prefill_tokens),
        RequestId(1),
        node("router"),
        prompt(),
        node("d"),
        1_000,
        0,
    );
    let computed = prefill_tokens.computed(10);
    assert_eq!(
        drain_prefill(&mut machine),
        vec![PrefillCommand::Allocate { slots: computed + 2 }]
    );
    machine.handle_allocated(Ok(()), 1);
    assert_eq!(
        drain_prefill(&mut machine),
        vec![PrefillCommand::Compute { tokens: computed }]
    );
    machine.handle_computed(Ok(()), 2);
    assert_eq!(
        drain_prefill(&mut machine),
        vec![PrefillCommand::ReleaseWindow { attending_token: 9 }]
    );
    // The leg's lists: 3 blocks each (12 slots), window position 0 freed (tokens 0..=3 < 4).
    machine.handle_window_released(Ok(vec![vec![11, 12, 13], vec![0, 22, 23]]));
    assert_eq!(
        drain_prefill(&mut machine),
        vec![PrefillCommand::Grant {
            lists: vec![vec![11, 12, 13], vec![22, 23]],
            peer: node("d"),
        }]
    );
    let issued = IssuedGrant {
        grant: GrantId(5),
        generations: vec![vec![1, 1, 1], vec![2, 2]],
        lease_ms: LEASE_MS,
    };
    machine.handle_granted(Ok(issued), grant_at_ms);
    let commands = drain_prefill(&mut machine);
    (machine, commands)
}

#[test]
fn a_prefill_grants_the_blocks_holding_tokens_up_to_n_minus_2_and_answers_the_router() {
    for prefill_tokens in [PrefillTokens::All, PrefillTokens::AllButLast] {
        let (machine, commands) = prefill_to_grant(prefill_tokens, 3);
        assert_eq!(commands.len(), 2, "{commands:?}");
        assert_eq!(commands[0], PrefillCommand::Finish, "the request's own hold ends");
        let PrefillCommand::Send {
            to,
            body: Body::KvReady(params),
        } = &commands[1]
        else {
            panic!("expected KvReady, got {:?}", commands[1]);
        };
        assert_eq!(to, &node("router"));
        assert_eq!(params.grant, GrantId(5));
        assert_eq!(params.prefill_incarnation, PREFILL_INCARNATION);
        assert_eq!(params.offer.groups[1].first_position, 1);
        assert!(machine.is_done());
    }
}

/// A grant that comes back after the deadline is revoked at once; the router gets a failure,
/// never parameters nobody will read.
#[test]
fn a_grant_after_the_deadline_is_revoked_not_handed_out() {
    let (_, commands) = prefill_to_grant(PrefillTokens::All, 1_000);
    assert_eq!(commands[0], PrefillCommand::Revoke { grant: GrantId(5) });
    assert_eq!(commands[1], PrefillCommand::Finish);
    assert!(matches!(
        &commands[2],
        PrefillCommand::Send { body: Body::Failed { stage: Stage::Prefill, reason }, .. } if *reason == Failure::DeadlinePassed
    ));
    assert_eq!(commands.len(), 3);
}

/// Out of blocks, a prefill waits until blocks are freed (retrying then) or its wait bound; it
/// holds nothing meanwhile, so failing frees nothing.
#[test]
fn a_prefill_waits_for_blocks_within_its_bound() {
    let mut machine = PrefillMachine::new(
        config("p", 0, PrefillTokens::All),
        RequestId(2),
        node("router"),
        prompt(),
        node("d"),
        1_000,
        0,
    );
    drain_prefill(&mut machine);
    machine.handle_allocated(Err(out_of_blocks()), 0);
    assert_eq!(drain_prefill(&mut machine), vec![]);
    assert_eq!(machine.poll_timeout(), Some(100), "alloc_wait_ms");
    machine.handle_blocks_freed();
    assert_eq!(
        drain_prefill(&mut machine),
        vec![PrefillCommand::Allocate { slots: 10 }]
    );
    machine.handle_allocated(Err(out_of_blocks()), 50);
    machine.handle_timeout(99);
    assert_eq!(drain_prefill(&mut machine), vec![]);
    machine.handle_timeout(100);
    let commands = drain_prefill(&mut machine);
    assert!(
        matches!(
            commands.as_slice(),
            [PrefillCommand::Send { body: Body::Failed { stage: Stage::Prefill, reason }, .. }]
                if *reason == Failure::NoFreeBlocks { waited_ms: 100, last: out_of_blocks() }
        ),
        "{commands:?}"
    );
    assert!(machine.is_done());
}

/// An abort while the engine computes lets the computation end, then frees the blocks and sends
/// nothing.
#[test]
fn an_abort_during_compute_frees_the_blocks_quietly() {
    let mut machine = PrefillMachine::new(
        config("p", 0, PrefillTokens::All),
        RequestId(3),
        node("router"),
        prompt(),
        node("d"),
        1_000,
        0,
    );
    drain_prefill(&mut machine);
    machine.handle_allocated(Ok(()), 0);
    drain_prefill(&mut machine);
    machine.handle_abort();
    assert!(!machine.is_done(), "the computation is still running");
    machine.handle_computed(Ok(()), 5);
    assert_eq!(drain_prefill(&mut machine), vec![PrefillCommand::Finish]);
    assert!(machine.is_done());
}

fn params() -> KvParams {
    let (_, commands) = prefill_to_grant(PrefillTokens::All, 3);
    match commands.into_iter().nth(1) {
        Some(PrefillCommand::Send {
            body: Body::KvReady(params),
            ..
        }) => params,
        other => panic!("{other:?}"),
    }
}

fn allocation(lists: Vec<Vec<BlockId>>) -> Allocation {
    Allocation {
        cached_blocks: vec![0; lists.len()],
        blocks: lists,
    }
}

/// Runs a decode machine to its READ.
fn decode_to_read(now_ms: u64) -> DecodeMachine {
    let mut machine = DecodeMachine::new(
        config("d", 3, PrefillTokens::All),
        node("router"),
        params(),
        prompt().len() as u64,
        2,
        500,
        0,
    );
    assert_eq!(
        drain_decode(&mut machine),
        vec![DecodeCommand::Allocate {
            slots: 13,
            attending_token: 9
        }]
    );
    machine.handle_allocated(
        Ok(allocation(vec![vec![41, 42, 43, 44], vec![0, 52, 53, 54]])),
        now_ms,
    );
    let commands = drain_decode(&mut machine);
    let [DecodeCommand::Read { pairing, checks }] = commands.as_slice() else {
        panic!("{commands:?}");
    };
    let pairs: Vec<Vec<(BlockId, BlockId)>> = pairing
        .groups
        .iter()
        .map(|pairs| pairs.iter().map(|pair| (pair.remote, pair.local)).collect())
        .collect();
    assert_eq!(
        pairs,
        vec![vec![(11, 41), (12, 42), (13, 43)], vec![(22, 52), (23, 53)]]
    );
    assert_eq!(checks.len(), 5);
    machine
}

/// While it waits, a decode leg renews the grant every third of the lease, naming the issuing
/// incarnation.
#[test]
fn a_decode_renews_every_third_of_the_lease_while_it_waits() {
    let mut machine = DecodeMachine::new(
        config("d", 3, PrefillTokens::All),
        node("router"),
        params(),
        prompt().len() as u64,
        2,
        500,
        0,
    );
    drain_decode(&mut machine);
    machine.handle_allocated(Err(out_of_blocks()), 0);
    assert_eq!(machine.poll_timeout(), Some(LEASE_MS / 3));
    machine.handle_timeout(LEASE_MS / 3);
    assert_eq!(
        drain_decode(&mut machine),
        vec![DecodeCommand::Send {
            to: node("p"),
            body: Body::Renew {
                grant: GrantId(5),
                issuer: PREFILL_INCARNATION
            }
        }]
    );
    assert_eq!(machine.poll_timeout(), Some(2 * (LEASE_MS / 3)));
}

/// A READ that fails half way fails the request closed: the grant is released, the blocks are
/// freed without caching, the router learns the stage.
#[test]
fn a_read_failing_half_way_releases_frees_and_reports_the_read_stage() {
    let mut machine = decode_to_read(1);
    machine.handle_read_done(Err(Failure::Read("injected fault after 4096 bytes".into())), 5);
    let commands = drain_decode(&mut machine);
    assert_eq!(
        commands[..2],
        [
            DecodeCommand::Send {
                to: node("p"),
                body: Body::Release {
                    grant: GrantId(5),
                    issuer: PREFILL_INCARNATION
                }
            },
            DecodeCommand::Finish { cache_prompt: false },
        ]
    );
    assert!(matches!(
        &commands[2],
        DecodeCommand::Send { to, body: Body::Failed { stage: Stage::Read, reason } }
            if *to == node("router") && reason.to_string() == "read failed: injected fault after 4096 bytes"
    ));
    assert!(machine.is_done());
}

/// An abort while the READ is in flight waits for it: its bytes may still be landing in this
/// request's blocks, which must not be handed to another request before it ends.
#[test]
fn an_abort_during_a_read_waits_for_it_then_frees() {
    let mut machine = decode_to_read(1);
    machine.handle_abort();
    assert_eq!(
        drain_decode(&mut machine),
        vec![],
        "nothing freed under a READ in flight"
    );
    machine.handle_read_done(Ok(ReadDone { bytes: 1, runs: 1 }), 5);
    let commands = drain_decode(&mut machine);
    assert_eq!(commands.len(), 2, "{commands:?}");
    assert!(matches!(
        commands[0],
        DecodeCommand::Send {
            body: Body::Release { .. },
            ..
        }
    ));
    assert_eq!(commands[1], DecodeCommand::Finish { cache_prompt: false });
    assert!(machine.is_done());
}

/// A READ that completes after the deadline is not decoded: release, free, fail.
#[test]
fn a_read_ending_past_the_deadline_is_not_decoded() {
    let mut machine = decode_to_read(1);
    machine.handle_read_done(Ok(ReadDone { bytes: 1, runs: 1 }), 500);
    let commands = drain_decode(&mut machine);
    assert!(
        matches!(
            commands.last(),
            Some(DecodeCommand::Send { body: Body::Failed { stage: Stage::Read, reason }, .. }) if *reason == Failure::DeadlinePassed
        ),
        "{commands:?}"
    );
    assert!(
        !commands
            .iter()
            .any(|command| matches!(command, DecodeCommand::Generate { .. }))
    );
}

/// The happy path ends with the blocks cached and the output sent; the grant was released as
/// soon as the READ ended, before decoding.
#[test]
fn a_decode_releases_before_it_decodes_and_answers_once() {
    let mut machine = decode_to_read(1);
    machine.handle_read_done(Ok(ReadDone { bytes: 640, runs: 3 }), 5);
    let commands = drain_decode(&mut machine);
    assert!(matches!(
        commands[0],
        DecodeCommand::Send {
            body: Body::Release { .. },
            ..
        }
    ));
    assert_eq!(
        commands[1],
        DecodeCommand::Generate {
            slots: 13,
            max_tokens: 2,
            deadline_ms: 500,
            sampling: Sampling::default(),
        }
    );
    machine.handle_generated(Ok((vec![7, 8], 99).into()));
    let commands = drain_decode(&mut machine);
    assert_eq!(commands[0], DecodeCommand::Finish { cache_prompt: true });
    let DecodeCommand::Send {
        body: Body::Output(output),
        ..
    } = &commands[1]
    else {
        panic!("{commands:?}");
    };
    assert_eq!(
        (output.read_bytes, output.read_runs, output.logits_digest),
        (640, 3, 99)
    );
    machine.handle_generated(Ok((vec![7, 8], 99).into()));
    assert_eq!(
        drain_decode(&mut machine),
        vec![],
        "a duplicate completion is ignored"
    );
}

fn router() -> RouterMachine {
    RouterMachine::new(
        RequestId(1),
        prompt(),
        2,
        (node("p"), PREFILL_INCARNATION),
        (node("d"), Incarnation(0xDDDD)),
        100,
        0,
    )
}

/// A prefill reply that never comes: at the deadline both legs are told to abort and the client
/// gets a failure naming the prefill stage; the reply, arriving late, gets an abort back.
#[test]
fn a_lost_prefill_reply_ends_the_request_at_its_deadline() {
    let mut machine = router();
    assert!(matches!(
        drain_router(&mut machine).as_slice(),
        [RouterCommand::Send {
            body: Body::Prefill { .. },
            ..
        }]
    ));
    machine.handle_timeout(99);
    assert_eq!(drain_router(&mut machine), vec![]);
    machine.handle_timeout(100);
    let commands = drain_router(&mut machine);
    assert_eq!(
        commands,
        vec![
            RouterCommand::Send {
                to: node("p"),
                body: Body::Abort
            },
            RouterCommand::Send {
                to: node("d"),
                body: Body::Abort
            },
            RouterCommand::Complete(RequestOutcome::Failed {
                stage: Stage::Prefill,
                reason: Failure::DeadlinePassed
            }),
        ]
    );
    machine.handle_message(&node("p"), PREFILL_INCARNATION, Body::KvReady(params()));
    assert_eq!(
        drain_router(&mut machine),
        vec![RouterCommand::Send {
            to: node("p"),
            body: Body::Abort
        }]
    );
}

/// Parameters from another incarnation of the prefill leg (it restarted) are never forwarded to
/// the decode leg; the sender is told to abort.
#[test]
fn parameters_from_a_stale_incarnation_are_refused() {
    let mut machine = router();
    drain_router(&mut machine);
    machine.handle_message(&node("p"), Incarnation(1), Body::KvReady(params()));
    assert_eq!(
        drain_router(&mut machine),
        vec![RouterCommand::Send {
            to: node("p"),
            body: Body::Abort
        }]
    );
    machine.handle_message(&node("p"), PREFILL_INCARNATION, Body::KvReady(params()));
    assert!(matches!(
        drain_router(&mut machine).as_slice(),
        [RouterCommand::Send { to, body: Body::Decode { max_tokens: 2, .. } }] if *to == node("d")
    ));
}

/// A duplicated answer completes the request once.
#[test]
fn a_duplicated_output_completes_once() {
    let mut machine = router();
    drain_router(&mut machine);
    machine.handle_message(&node("p"), PREFILL_INCARNATION, Body::KvReady(params()));
    drain_router(&mut machine);
    let output = DecodeOutput {
        tokens: vec![1],
        logits_digest: 2,
        read_bytes: 3,
        read_runs: 1,
        cached_blocks: 0,
        finish: Finish::Length,
        logprobs: Vec::new(),
    };
    for _ in 0..2 {
        machine.handle_message(&node("d"), Incarnation(0xDDDD), Body::Output(output.clone()));
    }
    assert_eq!(
        drain_router(&mut machine),
        vec![RouterCommand::Complete(RequestOutcome::Output(output))]
    );
    assert!(machine.is_done());
}

/// A client that goes away ends the request at once: both legs are told to free what they hold.
#[test]
fn a_cancelled_request_aborts_both_legs() {
    let mut machine = router();
    drain_router(&mut machine);
    machine.handle_cancel();
    assert_eq!(
        drain_router(&mut machine),
        vec![
            RouterCommand::Send {
                to: node("p"),
                body: Body::Abort
            },
            RouterCommand::Send {
                to: node("d"),
                body: Body::Abort
            },
            RouterCommand::Complete(RequestOutcome::Failed {
                stage: Stage::Router,
                reason: Failure::Cancelled
            }),
        ]
    );
    machine.handle_cancel();
    assert_eq!(drain_router(&mut machine), vec![], "cancelled once");
}

/// The allocation paths, decided at the bounds: wait while `now < now0 + alloc_wait_ms` (and
/// before the deadline); at the bound fail naming the wait and the last refusal; at the deadline
/// fail naming the deadline; any other refusal fails at once; after an abort, quietly.
mod allocation_bounds {
    use super::*;

    const ALLOC_WAIT_MS: u64 = 100;

    fn prefill(deadline_ms: u64) -> PrefillMachine {
        let mut machine = PrefillMachine::new(
            config("p", 2, PrefillTokens::All),
            RequestId(1),
            node("router"),
            prompt(),
            node("d"),
            deadline_ms,
            0,
        );
        drain_prefill(&mut machine);
        machine
    }

    fn decode(deadline_ms: u64) -> DecodeMachine {
        let mut machine = DecodeMachine::new(
            config("d", 3, PrefillTokens::All),
            node("router"),
            params(),
            prompt().len() as u64,
            2,
            deadline_ms,
            0,
        );
        drain_decode(&mut machine);
        machine
    }

    fn prefill_failure(commands: &[PrefillCommand]) -> Option<Failure> {
        commands.iter().find_map(|command| match command {
            PrefillCommand::Send {
                body:
                    Body::Failed {
                        stage: Stage::Prefill,
                        reason,
                    },
                ..
            } => Some(reason.clone()),
            _ => None,
        })
    }

    fn decode_failure(commands: &[DecodeCommand]) -> Option<(Stage, Failure)> {
        commands.iter().find_map(|command| match command {
            DecodeCommand::Send {
                body: Body::Failed { stage, reason },
                ..
            } => Some((*stage, reason.clone())),
            _ => None,
        })
    }

    fn never_fits() -> AllocError {
        AllocError::NeverFits {
            group: 0,
            kind: GroupKind::Full,
            needed: 9,
            capacity: 4,
        }
    }

    #[test]
    fn a_prefill_waits_until_its_wait_bound_and_not_at_it() {
        let mut machine = prefill(1_000);
        assert!(!machine.is_waiting_for_blocks());
        machine.handle_allocated(Err(out_of_blocks()), ALLOC_WAIT_MS - 1);
        assert!(machine.is_waiting_for_blocks());
        assert_eq!(machine.poll_timeout(), Some(ALLOC_WAIT_MS));
        assert!(drain_prefill(&mut machine).is_empty());

        let mut machine = prefill(1_000);
        machine.handle_allocated(Err(out_of_blocks()), ALLOC_WAIT_MS);
        assert!(!machine.is_waiting_for_blocks());
        assert_eq!(
            prefill_failure(&drain_prefill(&mut machine)),
            Some(Failure::NoFreeBlocks {
                waited_ms: ALLOC_WAIT_MS,
                last: out_of_blocks()
            })
        );
        assert!(machine.is_done());
    }

    #[test]
    fn a_prefill_out_of_blocks_at_its_deadline_fails_naming_the_deadline() {
        // The deadline comes before the wait bound, so it bounds the wait.
        let mut machine = prefill(50);
        machine.handle_allocated(Err(out_of_blocks()), 50);
        assert_eq!(
            prefill_failure(&drain_prefill(&mut machine)),
            Some(Failure::DeadlinePassed)
        );
        let mut machine = prefill(50);
        machine.handle_allocated(Err(out_of_blocks()), 49);
        assert_eq!(machine.poll_timeout(), Some(50));
    }

    #[test]
    fn a_prefill_refused_for_good_fails_at_once_and_an_aborted_one_quietly() {
        let mut machine = prefill(1_000);
        machine.handle_allocated(Err(never_fits()), 0);
        assert_eq!(
            prefill_failure(&drain_prefill(&mut machine)),
            Some(Failure::Alloc(never_fits()))
        );
        for error in [out_of_blocks(), never_fits()] {
            let mut machine = prefill(1_000);
            machine.handle_abort();
            machine.handle_allocated(Err(error), 0);
            assert_eq!(
                drain_prefill(&mut machine),
                vec![],
                "nothing held, nothing to say"
            );
            assert!(machine.is_done());
        }
    }

    #[test]
    fn a_full_wait_queue_fails_only_a_waiting_prefill() {
        let mut machine = prefill(1_000);
        machine.handle_queue_full(4);
        assert!(drain_prefill(&mut machine).is_empty(), "not waiting: no effect");
        machine.handle_allocated(Err(out_of_blocks()), 0);
        machine.handle_queue_full(4);
        assert_eq!(
            prefill_failure(&drain_prefill(&mut machine)),
            Some(Failure::QueueFull {
                leg: node("p"),
                capacity: 4
            })
        );
        assert!(machine.is_done());
    }

    #[test]
    fn a_prefill_computed_past_its_deadline_frees_and_fails() {
        let mut machine = prefill(1_000);
        machine.handle_allocated(Ok(()), 0);
        drain_prefill(&mut machine);
        machine.handle_computed(Ok(()), 1_000);
        let commands = drain_prefill(&mut machine);
        assert_eq!(commands[0], PrefillCommand::Finish);
        assert_eq!(prefill_failure(&commands), Some(Failure::DeadlinePassed));
    }

    #[test]
    fn a_refused_grant_fails_the_prefill_unless_it_was_aborted() {
        for aborted in [false, true] {
            let mut machine = prefill(1_000);
            machine.handle_allocated(Ok(()), 0);
            machine.handle_computed(Ok(()), 1);
            machine.handle_window_released(Ok(vec![vec![11, 12, 13], vec![0, 22, 23]]));
            drain_prefill(&mut machine);
            if aborted {
                machine.handle_abort();
            }
            let refusal = Failure::Grant(GrantError::TableFull { max_grants: 1 });
            machine.handle_granted(Err(refusal.clone()), 2);
            let commands = drain_prefill(&mut machine);
            assert_eq!(commands[0], PrefillCommand::Finish);
            let expected = (!aborted).then_some(refusal);
            assert_eq!(prefill_failure(&commands), expected, "aborted: {aborted}");
            assert!(machine.is_done());
        }
    }

    #[test]
    fn a_decode_waits_until_its_wait_bound_and_times_out_exactly_there() {
        let mut machine = decode(1_000);
        machine.handle_allocated(Err(out_of_blocks()), ALLOC_WAIT_MS - 1);
        assert!(machine.is_waiting_for_blocks());
        // The renewal (every lease/3) comes first; the wait bound is next in line.
        machine.handle_timeout(ALLOC_WAIT_MS - 1);
        drain_decode(&mut machine);
        assert_eq!(machine.poll_timeout(), Some(ALLOC_WAIT_MS));
        machine.handle_timeout(ALLOC_WAIT_MS - 1);
        assert!(machine.is_waiting_for_blocks(), "not yet");
        machine.handle_timeout(ALLOC_WAIT_MS);
        assert!(!machine.is_waiting_for_blocks());
        let commands = drain_decode(&mut machine);
        assert_eq!(
            decode_failure(&commands),
            Some((
                Stage::Decode,
                Failure::NoFreeBlocks {
                    waited_ms: ALLOC_WAIT_MS,
                    last: out_of_blocks()
                }
            ))
        );
        assert!(
            commands.iter().any(|command| matches!(
                command,
                DecodeCommand::Send {
                    body: Body::Release { .. },
                    ..
                }
            )),
            "the grant is released: {commands:?}"
        );
        assert!(machine.is_done());
    }

    #[test]
    fn a_decode_out_of_blocks_is_decided_by_its_bounds() {
        let mut machine = decode(1_000);
        machine.handle_allocated(Err(out_of_blocks()), ALLOC_WAIT_MS);
        assert_eq!(
            decode_failure(&drain_decode(&mut machine)).map(|(_, failure)| failure),
            Some(Failure::NoFreeBlocks {
                waited_ms: ALLOC_WAIT_MS,
                last: out_of_blocks()
            })
        );
        let mut machine = decode(60);
        machine.handle_allocated(Err(out_of_blocks()), 60);
        assert_eq!(
            decode_failure(&drain_decode(&mut machine)),
            Some((Stage::Decode, Failure::DeadlinePassed))
        );
        let mut machine = decode(60);
        machine.handle_allocated(Err(out_of_blocks()), 59);
        assert!(machine.is_waiting_for_blocks());
        let mut machine = decode(1_000);
        machine.handle_allocated(Err(never_fits()), 0);
        assert_eq!(
            decode_failure(&drain_decode(&mut machine)),
            Some((Stage::Decode, Failure::Alloc(never_fits())))
        );
        for error in [out_of_blocks(), never_fits()] {
            let mut machine = decode(1_000);
            machine.handle_abort();
            machine.handle_allocated(Err(error), 0);
            let commands = drain_decode(&mut machine);
            assert_eq!(decode_failure(&commands), None, "aborted: quiet {commands:?}");
            assert!(machine.is_done());
        }
    }

    #[test]
    fn a_full_wait_queue_fails_only_a_waiting_decode() {
        let mut machine = decode(1_000);
        machine.handle_queue_full(2);
        assert!(drain_decode(&mut machine).is_empty(), "not waiting: no effect");
        machine.handle_allocated(Err(out_of_blocks()), 0);
        machine.handle_queue_full(2);
        assert_eq!(
            decode_failure(&drain_decode(&mut machine)),
            Some((
                Stage::Decode,
                Failure::QueueFull {
                    leg: node("d"),
                    capacity: 2
                }
            ))
        );
    }

    /// A decode machine aborted while it generates: it has asked its generation to stop.
    fn aborted_while_generating() -> DecodeMachine {
        let mut machine = decode_to_read(5);
        machine.handle_read_done(Ok(ReadDone { bytes: 1, runs: 1 }), 6);
        drain_decode(&mut machine);
        machine.handle_abort();
        assert_eq!(drain_decode(&mut machine), vec![DecodeCommand::StopGenerating]);
        machine
    }

    #[test]
    fn an_aborted_decode_answers_nothing_after_generating() {
        let mut machine = aborted_while_generating();
        machine.handle_generated(Ok((vec![1], 7).into()));
        let commands = drain_decode(&mut machine);
        assert_eq!(commands, vec![DecodeCommand::Finish { cache_prompt: false }]);
        assert!(machine.is_done());
    }

    /// An abort while the decode leg generates stops the generation at its next token instead
    /// of decoding to the end for nobody; the blocks stay held until the generation has
    /// stopped (it still writes into them), then are freed without caching and without an
    /// answer. A second abort asks nothing more.
    #[test]
    fn an_abort_stops_a_generation_and_frees_its_blocks_once_it_has_stopped() {
        let mut machine = aborted_while_generating();
        assert!(!machine.is_done(), "the generation still runs in the blocks");
        machine.handle_abort();
        assert_eq!(drain_decode(&mut machine), vec![], "a second abort");
        machine.handle_generated(Err(Failure::Cancelled));
        assert_eq!(
            drain_decode(&mut machine),
            vec![DecodeCommand::Finish { cache_prompt: false }]
        );
        assert!(machine.is_done());
    }

    /// An abort before the generation starts asks no stop: there is nothing to stop yet.
    #[test]
    fn an_abort_during_the_read_asks_no_stop() {
        let mut machine = decode_to_read(5);
        machine.handle_abort();
        assert_eq!(drain_decode(&mut machine), vec![]);
        machine.handle_read_done(Ok(ReadDone { bytes: 1, runs: 1 }), 6);
        let commands = drain_decode(&mut machine);
        assert!(
            !commands.iter().any(|command| matches!(
                command,
                DecodeCommand::Generate { .. } | DecodeCommand::StopGenerating
            )),
            "{commands:?}"
        );
        assert!(commands.contains(&DecodeCommand::Finish { cache_prompt: false }));
        assert!(machine.is_done());
    }
}

/// A paired position one past the offered list is refused, not read out of bounds.
#[test]
fn generation_checks_refuse_a_position_past_the_offer() {
    use pdkv_core::exchange::{BlockPair, Pairing};
    use pdkv_core::leg::{GenerationCheckError, generation_checks};
    let params = params();
    let list = &params.offer.groups[0];
    let past = list.first_position + list.blocks.len() as u64;
    let pairing = Pairing {
        groups: vec![
            vec![BlockPair {
                remote: 99,
                local: 1,
                remote_position: past,
                local_position: past,
            }],
            vec![],
        ],
    };
    assert_eq!(
        generation_checks(&params, &pairing),
        Err(GenerationCheckError::PositionOutsideOffer {
            group: 0,
            position: past
        })
    );
    assert_eq!(
        generation_checks(&params, &pairing).unwrap_err().to_string(),
        format!("group 0: paired position {past} outside the offer")
    );
}

/// Each answer counts only from the leg it is expected from: KV parameters from the decode leg,
/// or an output from the prefill leg, change nothing.
#[test]
fn answers_from_the_wrong_leg_are_ignored() {
    let mut machine = router();
    drain_router(&mut machine);
    machine.handle_message(&node("d"), Incarnation(0xDDDD), Body::KvReady(params()));
    assert_eq!(
        drain_router(&mut machine),
        vec![],
        "the decode leg cannot prefill"
    );
    machine.handle_message(&node("p"), PREFILL_INCARNATION, Body::KvReady(params()));
    assert!(matches!(
        drain_router(&mut machine).as_slice(),
        [RouterCommand::Send {
            body: Body::Decode { .. },
            ..
        }]
    ));
    let output = DecodeOutput {
        tokens: vec![7],
        logits_digest: 1,
        read_bytes: 0,
        read_runs: 0,
        cached_blocks: 0,
        finish: Finish::Length,
        logprobs: Vec::new(),
    };
    machine.handle_message(&node("p"), PREFILL_INCARNATION, Body::Output(output.clone()));
    assert_eq!(
        drain_router(&mut machine),
        vec![],
        "the prefill leg cannot answer"
    );
    assert!(!machine.is_done());
    machine.handle_message(&node("d"), Incarnation(0xDDDD), Body::Output(output.clone()));
    assert_eq!(
        drain_router(&mut machine),
        vec![RouterCommand::Complete(RequestOutcome::Output(output))]
    );
}

/// A message the router cannot deliver fails the request at once, naming the stage and the
/// unreachable leg, and tells the other leg to abort.
#[test]
fn an_undeliverable_message_fails_the_request_at_once() {
    let mut machine = router();
    drain_router(&mut machine);
    machine.handle_send_failed(&node("p"), pdkv_core::wire::LinkFault::Full);
    assert_eq!(
        drain_router(&mut machine),
        vec![
            RouterCommand::Send {
                to: node("d"),
                body: Body::Abort
            },
            RouterCommand::Complete(RequestOutcome::Failed {
                stage: Stage::Prefill,
                reason: Failure::Unreachable {
                    to: node("p"),
                    fault: pdkv_core::wire::LinkFault::Full
                }
            }),
        ]
    );
    assert!(machine.is_done());
    machine.handle_send_failed(&node("d"), pdkv_core::wire::LinkFault::Closed);
    assert_eq!(
        drain_router(&mut machine),
        vec![],
        "a finished request stays finished"
    );
}

/// A lost leg fails the requests it serves (naming the stage and the leg) and only the other
/// leg is told to abort; a lost leg the request does not use changes nothing.
#[test]
fn a_lost_leg_fails_its_requests_and_aborts_the_other_leg() {
    let mut machine = router();
    drain_router(&mut machine);
    machine.handle_peer_lost(&node("elsewhere"));
    assert_eq!(drain_router(&mut machine), vec![]);
    assert!(!machine.is_done());
    machine.handle_peer_lost(&node("p"));
    assert_eq!(
        drain_router(&mut machine),
        vec![
            RouterCommand::Send {
                to: node("d"),
                body: Body::Abort
            },
            RouterCommand::Complete(RequestOutcome::Failed {
                stage: Stage::Prefill,
                reason: Failure::LegLost(node("p"))
            }),
        ]
    );
    let mut machine = router();
    drain_router(&mut machine);
    machine.handle_message(&node("p"), PREFILL_INCARNATION, Body::KvReady(params()));
    drain_router(&mut machine);
    machine.handle_peer_lost(&node("d"));
    assert_eq!(
        drain_router(&mut machine),
        vec![
            RouterCommand::Send {
                to: node("p"),
                body: Body::Abort
            },
            RouterCommand::Complete(RequestOutcome::Failed {
                stage: Stage::Decode,
                reason: Failure::LegLost(node("d"))
            }),
        ]
    );
    machine.handle_peer_lost(&node("p"));
    assert_eq!(drain_router(&mut machine), vec![], "already over");
}

/// A failure reported while decoding also aborts the prefill leg (its grant is freed even if the
/// decode leg's release is lost); one reported while prefilling aborts nobody: the prefill leg
/// failed itself and the decode leg never heard of the request.
#[test]
fn a_failure_aborts_the_prefill_leg_only_once_it_granted() {
    let failure = Failure::Read("injected".into());
    let mut machine = router();
    drain_router(&mut machine);
    machine.handle_message(
        &node("p"),
        PREFILL_INCARNATION,
        Body::Failed {
            stage: Stage::Prefill,
            reason: failure.clone(),
        },
    );
    assert_eq!(
        drain_router(&mut machine),
        vec![RouterCommand::Complete(RequestOutcome::Failed {
            stage: Stage::Prefill,
            reason: failure.clone()
        })]
    );
    let mut machine = router();
    drain_router(&mut machine);
    machine.handle_message(&node("p"), PREFILL_INCARNATION, Body::KvReady(params()));
    drain_router(&mut machine);
    machine.handle_message(
        &node("d"),
        Incarnation(0xDDDD),
        Body::Failed {
            stage: Stage::Read,
            reason: failure.clone(),
        },
    );
    assert_eq!(
        drain_router(&mut machine),
        vec![
            RouterCommand::Send {
                to: node("p"),
                body: Body::Abort
            },
            RouterCommand::Complete(RequestOutcome::Failed {
                stage: Stage::Read,
                reason: failure
            }),
        ]
    );
}

/// A renewal answer restarts the cadence from the lease the prefill leg granted: a shorter
/// lease than the parameters said means earlier renewals.
#[test]
fn a_renewal_answer_sets_the_next_renewal_from_the_granted_lease() {
    let mut machine = DecodeMachine::new(
        config("d", 3, PrefillTokens::All),
        node("router"),
        params(),
        prompt().len() as u64,
        2,
        500,
        0,
    );
    drain_decode(&mut machine);
    machine.handle_allocated(Err(out_of_blocks()), 0);
    assert_eq!(machine.poll_timeout(), Some(LEASE_MS / 3));
    machine.handle_renewed(9, 4);
    assert_eq!(machine.poll_timeout(), Some(4 + 9 / 3));
}

/// A streaming request asks the decode leg for its tokens as they come; a plain one does not.
/// Streamed tokens are no part of the protocol's decisions: the router machine ignores them.
#[test]
fn a_streaming_request_asks_the_decode_leg_to_stream() {
    for stream in [false, true] {
        let mut machine = router().with_streaming(stream);
        drain_router(&mut machine);
        machine.handle_message(&node("p"), PREFILL_INCARNATION, Body::KvReady(params()));
        let commands = drain_router(&mut machine);
        assert!(
            matches!(
                commands.as_slice(),
                [RouterCommand::Send { body: Body::Decode { stream: asked, .. }, .. }] if *asked == stream
            ),
            "{commands:?}"
        );
        machine.handle_message(&node("d"), Incarnation(0xDDDD), Body::Tokens { tokens: vec![7] });
        assert_eq!(drain_router(&mut machine), vec![]);
        assert!(!machine.is_done());
    }
}

/// Only a prefill leg that was lost, unreachable or refused the request, before it handed out KV
/// parameters, is worth another try elsewhere; nothing else is retried.
#[test]
fn only_a_lost_or_refusing_prefill_leg_is_retried_and_only_before_it_commits() {
    use pdkv_core::leg::may_retry_prefill;
    use pdkv_core::wire::{Failure, Stage};
    let (p, d) = (node("p"), node("d"));
    let unreachable = |to: &NodeId| Failure::Unreachable {
        to: to.clone(),
        fault: pdkv_core::wire::LinkFault::Closed,
    };
    let refused = |by: &NodeId| Failure::Refused {
        node: by.clone(),
        reason: pdkv_core::wire::RefusalReason::Draining,
    };
    for reason in [Failure::LegLost(p.clone()), unreachable(&p), refused(&p)] {
        assert!(may_retry_prefill(Stage::Prefill, &reason, &p), "{reason}");
        // After the prefill committed, the stage is the decode's: never retried here.
        assert!(!may_retry_prefill(Stage::Decode, &reason, &p), "{reason}");
        assert!(!may_retry_prefill(Stage::Read, &reason, &p), "{reason}");
    }
    // The decode leg lost while the prefill computes: not the prefill leg's fault.
    for reason in [Failure::LegLost(d.clone()), unreachable(&d), refused(&d)] {
        assert!(!may_retry_prefill(Stage::Prefill, &reason, &p), "{reason}");
    }
    for reason in [
        Failure::DeadlinePassed,
        Failure::EmptyPrompt,
        Failure::NoFreeBlocks {
            waited_ms: 5,
            last: out_of_blocks(),
        },
        Failure::Cancelled,
    ] {
        assert!(!may_retry_prefill(Stage::Prefill, &reason, &p), "{reason}");
    }
}

/// A request starts over without its decode leg when that leg was lost, unreachable or refused
/// it, at any stage; without its prefill leg only as `may_retry_prefill` allows; else not at all.
#[test]
fn a_request_starts_over_without_the_leg_that_failed_it() {
    use pdkv_core::leg::leg_to_retry_without;
    use pdkv_core::wire::{Failure, Stage};
    let (p, d) = (node("p"), node("d"));
    for stage in [Stage::Prefill, Stage::Read, Stage::Decode] {
        for reason in [
            Failure::LegLost(d.clone()),
            Failure::Unreachable {
                to: d.clone(),
                fault: pdkv_core::wire::LinkFault::NoLink,
            },
            Failure::Refused {
                node: d.clone(),
                reason: pdkv_core::wire::RefusalReason::Draining,
            },
        ] {
            assert_eq!(
                leg_to_retry_without(stage, &reason, &p, &d),
                Some(&d),
                "{stage:?} {reason}"
            );
        }
    }
    assert_eq!(
        leg_to_retry_without(Stage::Prefill, &Failure::LegLost(p.clone()), &p, &d),
        Some(&p)
    );
    // After the prefill committed, its loss is the decode's READ failing: not retried here.
    assert_eq!(
        leg_to_retry_without(Stage::Decode, &Failure::LegLost(p.clone()), &p, &d),
        None
    );
    for reason in [
        Failure::DeadlinePassed,
        Failure::Cancelled,
        Failure::Read("short".into()),
    ] {
        assert_eq!(
            leg_to_retry_without(Stage::Decode, &reason, &p, &d),
            None,
            "{reason}"
        );
    }
}
