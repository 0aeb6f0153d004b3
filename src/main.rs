//! `pdkv`: the command-line entry point.
//!
//! Subcommands:
//! - `demo`: run the embedded cluster in one process over 102 prompt lengths, P/D against direct.
//! - `sweep`: the same for any cluster.toml and any prompt lengths.
//! - `certs init`: write a cluster CA and a certificate per node for mutual TLS.
//! - `gpus`: list AMD GPUs and their telemetry (amdgpu sysfs).
//! - `plan`: pair two legs' block lists from a JSON scenario and print the READ pairs.
//! - `sim`: the leg protocol's deterministic simulation over many seeds.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod certs_cmd;
mod errors;
mod gpus_cmd;
mod lengths;
mod plan_cmd;
mod sim_cmd;
mod sweep_cmd;

/// pdkv: a runtime for prefill/decode disaggregated LLM serving.
#[derive(Debug, Parser)]
#[command(name = "pdkv", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the shipped cluster (1 prefill + 1 decode leg, in one process) over 102 prompt
    /// lengths and compare P/D output with one-leg output.
    Demo(sweep_cmd::SweepArgs),
    /// Compare P/D with one-leg output for any cluster.toml and prompt lengths.
    Sweep(sweep_cmd::SweepArgs),
    /// Manage the cluster's mutual-TLS certificates.
    #[command(subcommand)]
    Certs(certs_cmd::CertsCommand),
    /// List AMD GPUs and their telemetry (read from amdgpu sysfs).
    Gpus(gpus_cmd::GpusArgs),
    /// Pair a prefill leg's and a decode leg's block lists from a JSON scenario.
    Plan(plan_cmd::PlanArgs),
    /// Run the leg protocol's deterministic simulation over many seeds (faults included) and
    /// check its invariants.
    Sim(sim_cmd::SimArgs),
}

fn main() -> ExitCode {
    init_tracing();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Plan(args) => plan_cmd::run(args),
        Command::Certs(command) => certs_cmd::run(command),
        Command::Gpus(args) => gpus_cmd::run(args),
        Command::Demo(args) => sweep_cmd::run(args, Some(pdkv_actors::sweep::demo_lengths())),
        Command::Sweep(args) => sweep_cmd::run(args, None),
        Command::Sim(args) => sim_cmd::run(args),
    };
    match result {
        Ok(code) => code,
        Err(error) => {
            eprintln!("error: {}", errors::render(&error));
            ExitCode::FAILURE
        }
    }
}

/// Logs to stderr, filtered by `RUST_LOG` (default `warn`); colours only when stderr is a
/// terminal, so log files and pipes get plain text.
fn init_tracing() {
    use std::io::IsTerminal;
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::builder()
        .with_default_directive(tracing_subscriber::filter::LevelFilter::WARN.into())
        .from_env_lossy();
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
}
