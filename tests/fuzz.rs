//! The fuzz harness in CI: 100,000 structured random inputs per parser that takes outside bytes
//! (`pdkv::fuzz`), each asserting 0 panics, 0 broken properties, no input slower than a second
//! (no hang) and bounded memory. `cargo run --release -p pdkv-bench --bin fuzz` runs millions.

use pdkv::fuzz::{Target, run};

const INPUTS: u64 = 100_000;

/// Peak resident memory the whole test process may reach (all targets, in parallel).
const MAX_PEAK_RSS_KIB: u64 = 512 * 1024;

fn fuzz(target: Target) {
    let report = run(target, INPUTS, 0x00F0_22ED);
    assert_eq!(report.inputs, INPUTS);
    assert_eq!(report.panics, 0, "{}: {:?}", target.name(), report.first_failure);
    assert_eq!(
        report.violations,
        0,
        "{}: {:?}",
        target.name(),
        report.first_failure
    );
    assert!(report.accepted > 0, "{}: no input was accepted", target.name());
    assert!(
        report.accepted < INPUTS,
        "{}: every input was accepted: the mutations do nothing",
        target.name()
    );
    assert!(
        report.slowest_us < 1_000_000,
        "{}: an input took {} µs",
        target.name(),
        report.slowest_us
    );
    assert!(
        report.peak_rss_kib < MAX_PEAK_RSS_KIB,
        "{}: peak memory {} KiB",
        target.name(),
        report.peak_rss_kib
    );
}

#[test]
fn fuzz_frames() {
    fuzz(Target::Frames);
}

#[test]
fn fuzz_hello() {
    fuzz(Target::Hello);
}

#[test]
fn fuzz_wire() {
    fuzz(Target::Wire);
}

#[test]
fn fuzz_data_hello() {
    fuzz(Target::DataHello);
}

#[test]
fn fuzz_data_request() {
    fuzz(Target::DataRequest);
}

#[test]
fn fuzz_cluster_toml() {
    fuzz(Target::ClusterToml);
}

#[test]
fn fuzz_scenario() {
    fuzz(Target::Scenario);
}

#[test]
fn fuzz_http_body() {
    fuzz(Target::HttpBody);
}
