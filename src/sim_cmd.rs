//! `pdkv sim`: the leg protocol's deterministic simulation over many seeds, with a summary.

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::time::Instant;

use clap::Args;
use pdkv_core::testing::{Fault, SimConfig, Topology, simulate};
use serde_json::json;

/// Arguments of `pdkv sim`.
#[derive(Debug, Args)]
pub struct SimArgs {
    /// Scenarios to run (seeds `first-seed .. first-seed + seeds`).
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..=100_000_000))]
    pub seeds: u64,
    /// First seed.
    #[arg(long, default_value_t = 0)]
    pub first_seed: u64,
    /// Run exactly this seed (replays a failing one).
    #[arg(long, conflicts_with_all = ["seeds", "first_seed"])]
    pub seed: Option<u64>,
    /// Requests per scenario.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub requests: u32,
    /// Legs per scenario as PxD (`2x3`: two prefill legs, three decode legs, each 1..=16);
    /// default: chosen per seed, from 1x1 up to 8x8.
    #[arg(long, value_parser = Topology::parse)]
    pub topology: Option<Topology>,
    /// Times a request may start over on other legs; default: chosen per seed (0..=2 with
    /// faults, 0 without).
    #[arg(long, value_parser = clap::value_parser!(u32).range(0..=16))]
    pub max_retries: Option<u32>,
    /// Run without injected faults.
    #[arg(long)]
    pub no_faults: bool,
    /// Print the summary as one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// Most violations printed; the rest are counted.
const SHOWN_VIOLATIONS: usize = 20;

/// Runs the scenarios and prints a summary; exits 1 on any violation.
pub fn run(args: SimArgs) -> anyhow::Result<ExitCode> {
    let seeds = match args.seed {
        Some(seed) => seed..=seed,
        None => {
            // `seeds` is at least 1 (clap checks the range).
            let last = args.first_seed.checked_add(args.seeds - 1).ok_or_else(|| {
                anyhow::anyhow!(
                    "--first-seed {} with --seeds {} runs past the last seed, {}",
                    args.first_seed,
                    args.seeds,
                    u64::MAX
                )
            })?;
            args.first_seed..=last
        }
    };
    let started = Instant::now();
    let (mut scenarios, mut requests, mut ok, mut failed, mut steps) = (0u64, 0u64, 0u64, 0u64, 0u64);
    let (mut retried, mut streamed) = (0u64, 0u64);
    let mut refused: BTreeMap<&'static str, u64> = BTreeMap::new();
    let mut failures: BTreeMap<&'static str, u64> = BTreeMap::new();
    let mut topologies: BTreeMap<String, u64> = BTreeMap::new();
    let mut faults: BTreeMap<Fault, u64> = BTreeMap::new();
    let mut violations = Vec::new();
    for seed in seeds {
        let report = simulate(SimConfig {
            seed,
            requests: args.requests,
            faults: !args.no_faults,
            topology: args.topology,
            max_retries: args.max_retries,
            ..SimConfig::default()
        });
        scenarios += 1;
        requests += u64::from(report.requests);
        ok += u64::from(report.ok);
        failed += u64::from(report.failed);
        steps += report.steps;
        retried += u64::from(report.retried);
        streamed += u64::from(report.streamed);
        *topologies.entry(report.topology.to_string()).or_default() += 1;
        for (kind, count) in report.failures {
            *failures.entry(kind).or_default() += u64::from(count);
        }
        for (why, count) in report.refused {
            *refused.entry(why).or_default() += u64::from(count);
        }
        for (fault, count) in report.faults {
            *faults.entry(fault).or_default() += u64::from(count);
        }
        violations.extend(report.violations);
    }
    let elapsed = started.elapsed().as_secs_f64();
    let per_second = scenarios as f64 / elapsed.max(1e-9);
    if args.json {
        let faults: BTreeMap<&str, u64> = faults
            .iter()
            .map(|(fault, count)| (fault.name(), *count))
            .collect();
        crate::outln!(
            "{}",
            json!({
                "scenarios": scenarios,
                "requests": requests,
                "ok": ok,
                "failed_cleanly": failed,
                "retried": retried,
                "streamed": streamed,
                "failed_by_kind": failures,
                "refused": refused,
                "topologies": topologies,
                "faults": faults,
                "violations": violations.len(),
                "first_violations": &violations[..violations.len().min(SHOWN_VIOLATIONS)],
                "steps": steps,
                "elapsed_s": elapsed,
                "scenarios_per_s": per_second,
            })
        );
    } else {
        crate::outln!(
            "{scenarios} scenarios, {requests} requests: {ok} ok, {failed} failed cleanly, {retried} retried, {streamed} streamed"
        );
        let shapes: Vec<String> = topologies
            .iter()
            .map(|(shape, count)| format!("{shape} {count}"))
            .collect();
        crate::outln!("topologies: {}", shapes.join(", "));
        let kinds: Vec<String> = failures
            .iter()
            .map(|(kind, count)| format!("{kind} {count}"))
            .collect();
        crate::outln!("failed by kind: {}", kinds.join(", "));
        let refusals: Vec<String> = refused
            .iter()
            .map(|(why, count)| format!("{why} {count}"))
            .collect();
        crate::outln!("refused by type: {}", refusals.join(", "));
        let injected: Vec<String> = Fault::ALL
            .iter()
            .map(|fault| format!("{} {}", fault.name(), faults.get(fault).copied().unwrap_or(0)))
            .collect();
        crate::outln!("faults injected: {}", injected.join(", "));
        for violation in violations.iter().take(SHOWN_VIOLATIONS) {
            crate::outln!("VIOLATION {violation}");
        }
        if violations.len() > SHOWN_VIOLATIONS {
            crate::outln!("... and {} more violations", violations.len() - SHOWN_VIOLATIONS);
        }
        crate::outln!(
            "{} violations ({steps} steps, {elapsed:.2} s, {per_second:.0} scenarios/s)",
            violations.len()
        );
    }
    Ok(if violations.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
