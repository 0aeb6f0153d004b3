//! The leg protocol under a deterministic simulation: many seeded scenarios, with and without
//! faults, each checked against DESIGN.md's invariants after every step. A failing seed is named
//! in the violation and replays with `pdkv sim --seed S`.

use pdkv_core::testing::{SimConfig, simulate};

fn run(seeds: std::ops::Range<u64>, faults: bool) -> (u32, u32, Vec<String>) {
    let (mut ok, mut failed, mut violations) = (0, 0, Vec::new());
    for seed in seeds {
        let report = simulate(SimConfig {
            seed,
            requests: 8,
            faults,
        });
        ok += report.ok;
        failed += report.failed;
        violations.extend(report.violations);
    }
    (ok, failed, violations)
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
