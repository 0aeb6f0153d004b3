//! `pdkv`: the command-line entry point.
//!
//! Subcommands:
//! - `demo`: launch the embedded cluster as local processes over 102 prompt lengths, P/D against
//!   direct.
//! - `sweep`: the same for any cluster.toml and any prompt lengths.
//! - `certs init`: write a cluster CA and a certificate per node for mutual TLS.
//! - `gpus`: list AMD GPUs and their telemetry (amdgpu sysfs).
//! - `plan`: pair two legs' block lists from a JSON scenario and print the READ pairs.
//! - `sim`: the leg protocol's deterministic simulation over many seeds.
//! - `node`, `router`, `launch`: run a cluster as processes; `load`: drive load through it.
//! - `chaos`: launch a cluster behind fault-injecting relays and check every answer.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use pdkv::{
    certs_cmd, chaos, errors, gpus_cmd, launch_cmd, load_cmd, node_cmd, plan_cmd, sim_cmd, sweep_cmd,
};

/// pdkv: a runtime for prefill/decode disaggregated LLM serving.
#[derive(Debug, Parser)]
#[command(name = "pdkv", version, about)]
struct Cli {
    /// Log line format on standard error (`RUST_LOG` filters, default `warn`).
    #[arg(long, global = true, value_enum, default_value_t = LogFormatArg::Text)]
    log_format: LogFormatArg,
    #[command(subcommand)]
    command: Command,
}

/// `--log-format` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LogFormatArg {
    /// Human-readable lines.
    Text,
    /// One JSON object per line, with the current spans (a completion's `request_id`).
    Json,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Launch the shipped cluster (1 prefill + 1 decode leg and the router, as local processes;
    /// `--in-process` for one process) over 102 prompt lengths and compare P/D output with
    /// one-leg output.
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
    /// Run one leg of a cluster.toml in this process.
    Node(node_cmd::NodeArgs),
    /// Run the router of a cluster.toml behind its OpenAI-compatible HTTP API.
    Router(node_cmd::RouterArgs),
    /// Start every node of a cluster.toml and the router as local processes and supervise them.
    Launch(launch_cmd::LaunchArgs),
    /// Drive load through a router's HTTP API and report throughput and latency.
    Load(load_cmd::LoadArgs),
    /// Launch a cluster with a fault-injecting relay on every link, drive load, inject seeded
    /// faults and check every answer against the direct output.
    Chaos(chaos::ChaosArgs),
}

/// mimalloc, not glibc's malloc: every message on a request's path allocates (frames, bodies,
/// futures), and malloc/free were 7-10% of a launched node's CPU per request. Alternating
/// launched clusters on one machine, mimalloc cut serial p50 by 5-7% (README, Benchmarks).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing(cli.log_format);
    let result = match cli.command {
        Command::Plan(args) => plan_cmd::run(args),
        Command::Certs(command) => certs_cmd::run(command),
        Command::Gpus(args) => gpus_cmd::run(args),
        Command::Demo(args) => sweep_cmd::run(args, Some(pdkv_actors::sweep::demo_lengths())),
        Command::Sweep(args) => sweep_cmd::run(args, None),
        Command::Sim(args) => sim_cmd::run(args),
        Command::Node(args) => node_cmd::run_node(args),
        Command::Router(args) => node_cmd::run_router(args),
        Command::Launch(args) => launch_cmd::run(args),
        Command::Load(args) => load_cmd::run(args),
        Command::Chaos(args) => chaos::run(args),
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
fn init_tracing(format: LogFormatArg) {
    use std::io::IsTerminal;
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::builder()
        .with_default_directive(tracing_subscriber::filter::LevelFilter::WARN.into())
        .from_env_lossy();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormatArg::Text => builder.with_ansi(std::io::stderr().is_terminal()).try_init(),
        LogFormatArg::Json => builder
            .json()
            .with_current_span(true)
            .with_span_list(false)
            .try_init(),
    };
}
