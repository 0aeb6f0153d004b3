//! `pdkv`: the command-line entry point.
//!
//! Subcommands:
//! - `plan`: pair two legs' block lists from a JSON scenario and print the READ pairs.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod plan_cmd;

/// pdkv: a runtime for prefill/decode disaggregated LLM serving.
#[derive(Debug, Parser)]
#[command(name = "pdkv", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Pair a prefill leg's and a decode leg's block lists from a JSON scenario.
    Plan(plan_cmd::PlanArgs),
}

fn main() -> ExitCode {
    init_tracing();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Plan(args) => plan_cmd::run(args),
    };
    match result {
        Ok(code) => code,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// Logs to stderr, filtered by `RUST_LOG` (default `warn`).
fn init_tracing() {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::builder()
        .with_default_directive(tracing_subscriber::filter::LevelFilter::WARN.into())
        .from_env_lossy();
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}
