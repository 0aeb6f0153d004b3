//! `pdkv demo` and `pdkv sweep`: P/D against direct over many prompt lengths, in one process.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use pdkv_actors::cluster::LocalCluster;
use pdkv_actors::config::{ClusterConfig, LinkKind};
use pdkv_actors::sweep::{self, Comparison};
use pdkv_core::exchange::PairingMode;
use serde_json::json;

use crate::plan_cmd::PairingModeArg;

/// Arguments shared by `demo` and `sweep`.
#[derive(Debug, Args)]
pub struct SweepArgs {
    /// cluster.toml to run (default: the embedded copy of the shipped cluster.toml).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Prompt lengths: `251,377,440`, `1..1100` (end excluded) or `1..=1100`; `sweep` only.
    #[arg(long)]
    pub lengths: Option<String>,
    /// Override `[exchange] pairing` (`anchored` or `legacy`).
    #[arg(long)]
    pub pairing: Option<PairingModeArg>,
    /// Tokens to generate per request (1..=4096).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub max_tokens: u32,
    /// One JSON line per length, then a summary line.
    #[arg(long)]
    pub json: bool,
    /// Override `[transport] links`: `local` (actor mailboxes) or `quic` (QUIC with mutual TLS on
    /// loopback).
    #[arg(long, value_enum)]
    pub links: Option<LinksArg>,
}

/// `--links` values.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum LinksArg {
    /// Actor mailboxes in one process.
    Local,
    /// QUIC with mutual TLS on loopback.
    Quic,
}

impl From<LinksArg> for LinkKind {
    fn from(links: LinksArg) -> Self {
        match links {
            LinksArg::Local => LinkKind::Local,
            LinksArg::Quic => LinkKind::Quic,
        }
    }
}

/// Runs the sweep; `demo` passes the demo's 102 lengths.
pub fn run(args: SweepArgs, default_lengths: Option<Vec<u64>>) -> anyhow::Result<ExitCode> {
    let mut config = match &args.config {
        Some(path) => ClusterConfig::from_file(path)?,
        None => ClusterConfig::embedded_default(),
    };
    if let Some(PairingModeArg(mode)) = args.pairing {
        config.exchange.pairing = mode;
    }
    if let Some(links) = args.links {
        config.transport.links = links.into();
    }
    let lengths = match (&args.lengths, default_lengths) {
        (Some(spec), _) => {
            crate::lengths::parse_lengths(spec).map_err(|error| anyhow::anyhow!("--lengths: {error}"))?
        }
        (None, Some(lengths)) => lengths,
        (None, None) => {
            anyhow::bail!("--lengths is required, e.g. --lengths 1..1100 or --lengths 251,377,440")
        }
    };
    // Refuse before starting the cluster or building a prompt: no length may outgrow the legs.
    if let Some(&longest) = lengths.iter().max() {
        config
            .check_prompt_tokens(longest)
            .map_err(|error| anyhow::anyhow!("--lengths: {error}"))?;
    }
    let system = actix::System::new();
    system.block_on(async move { sweep_cluster(config, &lengths, &args).await })
}

async fn sweep_cluster(config: ClusterConfig, lengths: &[u64], args: &SweepArgs) -> anyhow::Result<ExitCode> {
    let mode = match config.exchange.pairing {
        PairingMode::Anchored => "anchored",
        PairingMode::Legacy => "legacy",
    };
    let links = config.transport.links;
    let cluster = LocalCluster::start(config)
        .await
        .context("cannot start the cluster")?;
    let started = Instant::now();
    let progress = if args.json {
        indicatif::ProgressBar::hidden()
    } else {
        indicatif::ProgressBar::new(lengths.len() as u64)
    };
    if !args.json {
        println!("{:>8} {:>10} {:>6}  result", "prompt", "read KiB", "runs");
    }
    let mut results: Vec<Comparison> = Vec::with_capacity(lengths.len());
    for &length in lengths {
        let result = sweep::compare(&cluster, length, args.max_tokens).await;
        if args.json {
            println!(
                "{}",
                json!({
                    "prompt_tokens": result.prompt_tokens,
                    "match": result.matched,
                    "error": result.error,
                    "read_bytes": result.read_bytes,
                    "read_runs": result.read_runs,
                })
            );
        } else {
            let verdict = match (&result.error, result.matched) {
                (Some(error), _) => format!("ERROR {error}"),
                (None, true) => "match".to_string(),
                (None, false) => "MISMATCH (P/D output differs from direct)".to_string(),
            };
            progress.suspend(|| {
                println!(
                    "{:>8} {:>10.1} {:>6}  {verdict}",
                    result.prompt_tokens,
                    result.read_bytes as f64 / 1024.0,
                    result.read_runs
                )
            });
        }
        progress.inc(1);
        results.push(result);
    }
    progress.finish_and_clear();
    let elapsed = started.elapsed();
    let stats = cluster.wait_idle(std::time::Duration::from_secs(2)).await?;
    cluster.shutdown();
    let matched = results.iter().filter(|result| result.matched).count();
    let mismatched: Vec<u64> = results
        .iter()
        .filter(|result| !result.matched && result.error.is_none())
        .map(|result| result.prompt_tokens)
        .collect();
    let errors: Vec<u64> = results
        .iter()
        .filter(|result| result.error.is_some())
        .map(|result| result.prompt_tokens)
        .collect();
    let idle = stats.iter().all(|leg| leg.is_idle());
    let read_bytes: u64 = results.iter().map(|result| result.read_bytes).sum();
    if args.json {
        println!(
            "{}",
            json!({"summary": {
                "pairing": mode,
                "links": links.to_string(),
                "lengths": results.len(),
                "matched": matched,
                "mismatched": mismatched,
                "errors": errors,
                "legs_idle": idle,
                "read_bytes": read_bytes,
                "elapsed_ms": elapsed.as_millis() as u64,
            }})
        );
    } else {
        for leg in &stats {
            println!(
                "leg {}: free blocks {:?} of {:?}, {} requests, {} grants{}",
                leg.node,
                leg.free,
                leg.capacity,
                leg.requests,
                leg.grants,
                if leg.is_idle() { "" } else { "  <- LEAK" }
            );
        }
        if !mismatched.is_empty() {
            println!("mismatched at prompt lengths {mismatched:?}");
        }
        if !errors.is_empty() {
            println!("failed at prompt lengths {errors:?}");
        }
        println!(
            "{matched}/{} match ({mode} pairing, {links} links, {:.1} KiB read, {:.1} s)",
            results.len(),
            read_bytes as f64 / 1024.0,
            elapsed.as_secs_f64()
        );
    }
    Ok(if matched == results.len() && idle {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
