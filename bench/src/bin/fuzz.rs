//! The fuzz harness at scale: millions of inputs over every parser that takes outside bytes
//! (`pdkv::fuzz`; CI runs 100,000 per target in `tests/fuzz.rs`).
//!
//! Run: `cargo run --release -p pdkv-bench --bin fuzz -- [INPUTS_PER_TARGET] [--seed S]
//! [--target NAME]...` (default 1,000,000 per target, seed 1, every target). Prints one line per
//! target and exits non-zero if any input panicked or broke a property.

use std::process::ExitCode;

use pdkv::fuzz::{Target, run};

fn main() -> ExitCode {
    let mut inputs: u64 = 1_000_000;
    let mut seed: u64 = 1;
    let mut targets: Vec<Target> = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--seed" => match args.next().and_then(|value| value.parse().ok()) {
                Some(value) => seed = value,
                None => return usage("--seed takes a number"),
            },
            "--target" => {
                let name = args.next().unwrap_or_default();
                match Target::ALL.iter().find(|target| target.name() == name) {
                    Some(target) => targets.push(*target),
                    None => {
                        let names: Vec<&str> = Target::ALL.iter().map(|target| target.name()).collect();
                        return usage(&format!("--target {name:?}: one of {}", names.join(", ")));
                    }
                }
            }
            number => match number.parse() {
                Ok(value) => inputs = value,
                Err(_) => return usage(&format!("{number:?} is not a number of inputs")),
            },
        }
    }
    if targets.is_empty() {
        targets = Target::ALL.to_vec();
    }
    println!(
        "{:<14} {:>10} {:>10} {:>7} {:>10} {:>12} {:>12} {:>10}",
        "target", "inputs", "accepted", "panics", "violations", "inputs/s", "slowest µs", "peak MiB"
    );
    let (mut total, mut failures) = (0u64, 0u64);
    for target in targets {
        let report = run(target, inputs, seed);
        println!(
            "{:<14} {:>10} {:>10} {:>7} {:>10} {:>12.0} {:>12} {:>10.1}",
            target.name(),
            report.inputs,
            report.accepted,
            report.panics,
            report.violations,
            report.inputs as f64 / report.elapsed_s.max(1e-9),
            report.slowest_us,
            report.peak_rss_kib as f64 / 1024.0,
        );
        if let Some(failure) = &report.first_failure {
            println!("  first failure: {failure}");
        }
        total += report.inputs;
        failures += report.panics + report.violations;
    }
    println!("{total} inputs, seed {seed}: {failures} panics or violations");
    if failures == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn usage(error: &str) -> ExitCode {
    eprintln!("error: {error}\nusage: fuzz [INPUTS_PER_TARGET] [--seed S] [--target NAME]...");
    ExitCode::FAILURE
}
