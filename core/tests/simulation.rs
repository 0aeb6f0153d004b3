//! The leg protocol under a deterministic simulation: many seeded scenarios, with and without
//! faults, each checked against docs/ARCHITECTURE.md's invariants after every step. A failing seed is named
//! in the violation and replays with `pdkv sim --seed S`.

use pdkv_core::testing::{SimConfig, simulate};

/// What a run of many scenarios did, summed.
#[derive(Default)]
struct Summary {
    ok: u32,
    failed: u32,
    retried: u32,
    streamed: u32,
    largest: u32,
    violations: Vec<String>,
}

fn run(seeds: std::ops::Range<u64>, faults: bool) -> (u32, u32, Vec<String>) {
    let summary = summarize(seeds, faults);
    (summary.ok, summary.failed, summary.violations)
}

fn summarize(seeds: std::ops::Range<u64>, faults: bool) -> Summary {
    let mut summary = Summary::default();
    for seed in seeds {
        let report = simulate(SimConfig {
            seed,
            requests: 8,
            faults,
            ..SimConfig::default()
        });
        summary.ok += report.ok;
        summary.failed += report.failed;
        summary.retried += report.retried;
        summary.streamed += report.streamed;
        let legs = report.topology.prefills + report.topology.decodes;
        summary.largest = summary.largest.max(legs);
        summary.violations.extend(report.violations);
    }
    summary
}

/// Without faults every request is answered correctly: nothing fails, nothing leaks.
#[test]
fn without_faults_every_request_is_answered_correctly() {
    let (ok, failed, violations) = run(0..2_000, false);
    assert!(
        violations.is_empty(),
        "{} violations, first: {:?}",
        violations.len(),
        &violations[..violations.len().min(5)]
    );
    assert_eq!(failed, 0, "no request may fail without a fault");
    assert_eq!(ok, 2_000 * 8);
}

/// With faults (lost, duplicated and delayed messages, frozen legs, lapsed leases, failed READs,
/// restarted legs) no request is answered from wrong KV, every request ends by its deadline, and
/// nothing leaks.
#[test]
fn under_faults_no_request_is_wrong_hung_or_leaked() {
    let (ok, failed, violations) = run(10_000..20_000, true);
    assert!(
        violations.is_empty(),
        "{} violations, first: {:?}",
        violations.len(),
        &violations[..violations.len().min(5)]
    );
    assert!(ok > 0 && failed > 0, "ok {ok}, failed {failed}");
}

/// The scenarios exercise what the invariants are about: topologies up to 8P8D, streamed
/// requests, and requests retried on other legs (a streamed retry among them), so a sound run
/// means something.
#[test]
fn scenarios_span_topologies_streams_and_retries() {
    let summary = summarize(20_000..21_000, true);
    assert!(
        summary.violations.is_empty(),
        "{:?}",
        &summary.violations[..summary.violations.len().min(5)]
    );
    assert_eq!(summary.largest, 16, "an 8x8 topology ran");
    assert!(summary.streamed > 1_000, "streamed {}", summary.streamed);
    assert!(summary.retried > 100, "retried {}", summary.retried);
}

/// Targeted scenarios: one request, one scripted fault, over many seeds (so over many layouts,
/// prompt lengths and engines). Each checks the invariants (the report's violations) and how
/// the request ended.
mod targeted {
    use pdkv_core::leg::RequestOutcome;
    use pdkv_core::testing::{
        BUDGET_MS, LEASE_MS, ScriptAction, Scripted, SimConfig, SimReport, Topology, simulate,
    };
    use pdkv_core::wire::{Failure, RequestId, Stage};

    const SEEDS: std::ops::Range<u64> = 0..200;

    fn run(seed: u64, script: &[Scripted]) -> SimReport {
        let report = simulate(SimConfig {
            seed,
            requests: 1,
            faults: false,
            script: script.to_vec(),
            topology: Some(Topology {
                prefills: 1,
                decodes: 1,
            }),
            max_retries: Some(0),
            ..SimConfig::default()
        });
        assert!(report.violations.is_empty(), "{:?}", report.violations);
        report
    }

    fn at(kind: &'static str, nth: u32, action: ScriptAction) -> Scripted {
        Scripted { kind, nth, action }
    }

    fn outcome(report: &SimReport) -> &RequestOutcome {
        report.outcomes.get(&RequestId(1)).expect("the request ended")
    }

    fn refused(report: &SimReport, why: &str) -> u32 {
        report.refused.get(why).copied().unwrap_or(0)
    }

    #[test]
    fn a_lost_prefill_reply_ends_the_request_at_its_deadline_and_the_lease_frees_the_grant() {
        for seed in SEEDS {
            let report = run(seed, &[at("kv_ready", 0, ScriptAction::Drop)]);
            assert_eq!(
                outcome(&report),
                &RequestOutcome::Failed {
                    stage: Stage::Prefill,
                    reason: Failure::DeadlinePassed
                },
                "seed {seed}"
            );
        }
    }

    #[test]
    fn a_duplicated_release_is_refused_and_changes_nothing() {
        for seed in SEEDS {
            let report = run(seed, &[at("release", 0, ScriptAction::Duplicate)]);
            assert!(
                matches!(outcome(&report), RequestOutcome::Output(_)),
                "seed {seed}"
            );
            assert_eq!(report.ok, 1);
            assert_eq!(refused(&report, "release_refused"), 1, "seed {seed}");
        }
    }

    /// A READ three leases long keeps its grant through renewals: the request is answered and
    /// no lease lapses.
    #[test]
    fn a_slow_read_keeps_its_grant_through_renewals() {
        let script = [at(
            "decode",
            0,
            ScriptAction::SlowNextRead { by_ms: 3 * LEASE_MS },
        )];
        for seed in SEEDS {
            let report = run(seed, &script);
            assert!(
                matches!(outcome(&report), RequestOutcome::Output(_)),
                "seed {seed}: {:?}",
                outcome(&report)
            );
            assert_eq!(report.expired_leases, 0, "seed {seed}");
        }
    }

    #[test]
    fn a_renew_arriving_after_expiry_is_refused_and_the_read_fails_closed() {
        // The READ takes three leases; the first renewal arrives two leases late and the rest
        // are lost, so the lease lapses under the READ.
        let mut script = vec![
            at("decode", 0, ScriptAction::SlowNextRead { by_ms: 3 * LEASE_MS }),
            at("renew", 0, ScriptAction::Delay { by_ms: 2 * LEASE_MS }),
        ];
        script.extend((1..20).map(|nth| at("renew", nth, ScriptAction::Drop)));
        for seed in SEEDS {
            let report = run(seed, &script);
            assert!(
                refused(&report, "renew_refused") >= 1,
                "seed {seed}: {:?}",
                report.refused
            );
            match outcome(&report) {
                RequestOutcome::Failed {
                    stage: Stage::Read,
                    reason: Failure::StaleBlock { .. } | Failure::Read(_),
                } => {}
                // A prompt whose decode leg needs no remote block reads nothing that can go stale.
                RequestOutcome::Output(output) if output.read_bytes == 0 => {}
                other => panic!("seed {seed}: {other:?}"),
            }
        }
    }

    /// The decode leg releases the grant of a READ that failed itself: with the router's abort
    /// (the other path that frees it) lost, nothing may wait for the lease to lapse (a run
    /// without random faults checks that at quiesce).
    #[test]
    fn a_failed_read_releases_its_grant_without_the_routers_abort() {
        for seed in SEEDS {
            let script = [
                at("decode", 0, ScriptAction::FailNextRead),
                at("abort", 0, ScriptAction::Drop),
            ];
            let report = run(seed, &script);
            assert!(
                matches!(
                    outcome(&report),
                    RequestOutcome::Failed {
                        stage: Stage::Read,
                        ..
                    }
                ),
                "seed {seed}: {:?}",
                outcome(&report)
            );
            assert_eq!(
                report.expired_leases, 0,
                "seed {seed}: the grant waited for its lease"
            );
        }
    }

    #[test]
    fn a_read_failing_half_way_fails_the_request_in_the_read_stage() {
        for seed in SEEDS {
            let report = run(seed, &[at("decode", 0, ScriptAction::FailNextRead)]);
            match outcome(&report) {
                RequestOutcome::Failed {
                    stage: Stage::Read,
                    reason: Failure::Read(detail),
                } => assert!(detail.starts_with("injected fault after"), "{detail}"),
                other => panic!("seed {seed}: {other:?}"),
            }
        }
    }

    #[test]
    fn a_prefill_leg_restarted_mid_request_is_never_served_from() {
        let mut stale = 0;
        for seed in SEEDS {
            let report = run(seed, &[at("kv_ready", 0, ScriptAction::RestartSender)]);
            assert!(
                matches!(outcome(&report), RequestOutcome::Failed { .. }),
                "seed {seed}: {:?}",
                outcome(&report)
            );
            stale += refused(&report, "stale_incarnation");
        }
        assert!(stale > 0, "the old incarnation's grant was refused at least once");
    }

    #[test]
    fn a_decode_request_reordered_past_its_deadline_and_abort_is_not_started() {
        for seed in SEEDS {
            let report = run(
                seed,
                &[at(
                    "decode",
                    0,
                    ScriptAction::Delay {
                        by_ms: BUDGET_MS + 10,
                    },
                )],
            );
            assert_eq!(
                outcome(&report),
                &RequestOutcome::Failed {
                    stage: Stage::Decode,
                    reason: Failure::DeadlinePassed
                },
                "seed {seed}"
            );
            assert_eq!(
                refused(&report, "after_abort"),
                1,
                "seed {seed}: {:?}",
                report.refused
            );
        }
    }
}

/// A seed replays: the same scenario run twice does the same, step for step (`pdkv sim --seed
/// S` reproduces a violation only if nothing depends on a hash map's order or the clock).
#[test]
fn a_seed_replays_exactly() {
    for seed in 30_000..30_500 {
        let config = || SimConfig {
            seed,
            requests: 8,
            faults: true,
            ..SimConfig::default()
        };
        let (first, again) = (simulate(config()), simulate(config()));
        assert_eq!(first, again, "seed {seed}");
    }
}
