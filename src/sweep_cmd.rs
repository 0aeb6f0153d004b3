//! `pdkv demo` and `pdkv sweep`: P/D against direct over many prompt lengths.
//!
//! By default the cluster runs as local processes (`pdkv launch`): every prompt goes through the
//! router's HTTP API, and the client computes the direct (one-leg) output itself from the same
//! seeded model, in-process. `--in-process` runs the whole actor cluster in this process instead.

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
    /// Run the actor cluster in this process instead of as local processes.
    #[arg(long)]
    pub in_process: bool,
    /// With `--in-process`: override `[transport] links`, `local` (actor mailboxes) or `quic`
    /// (QUIC with mutual TLS on loopback).
    #[arg(long, value_enum, requires = "in_process")]
    pub links: Option<LinksArg>,
    /// Without `--in-process`: the run directory (default: a fresh one under the system's
    /// temporary directory, removed when every length matched).
    #[arg(long, conflicts_with = "in_process")]
    pub run_dir: Option<PathBuf>,
    /// Without `--in-process`: seconds the processes have to become ready (default 30; 600 for
    /// vLLM legs).
    #[arg(long, conflicts_with = "in_process")]
    pub ready_timeout: Option<f64>,
    /// Sweep a cluster that is already running, through its router at this URL
    /// (`http://host:port`), instead of launching one; `--config` must be the cluster's.
    #[arg(long, conflicts_with_all = ["in_process", "run_dir"])]
    pub router: Option<String>,
    /// With `--router`: the legs whose `/metrics` are checked for leaks afterwards, as
    /// `name=http://host:admin_port,...`.
    #[arg(long, requires = "router", value_delimiter = ',')]
    pub legs: Vec<String>,
    /// vLLM legs: what answers are compared against: `plain` (a vLLM instance of the same
    /// model and flags, started here, without connector or prefix cache), `leg` (the first
    /// prefill leg asked without KV transfer) or the URL of a running server.
    #[arg(long, default_value = "plain")]
    pub oracle: crate::vllm_sweep::Oracle,
    /// vLLM legs: top log-probabilities compared per generated token (0..=20).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(0..=20))]
    pub logprobs: u32,
    /// vLLM legs: largest difference of log-probabilities still equal. Default 1e-4: batches
    /// and chunked prefills change float rounding (measured up to 4e-6 on CPU), wrong KV changes
    /// log-probabilities by tenths; 0 asks for bitwise equality.
    #[arg(long, default_value_t = 1e-4)]
    pub logprob_tolerance: f64,
    /// vLLM legs: requests in flight at once (1: one at a time, and the prompt tokens each
    /// decode read are counted).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=256))]
    pub concurrency: u64,
    /// vLLM legs: send every prompt twice (all first sends, then all second sends), so the
    /// second finds it in the decode leg's prefix cache.
    #[arg(long)]
    pub repeat: bool,
    /// vLLM legs: how the oracle computes the last prompt token. `prefill` (default): in the
    /// prompt's prefill, as a plain instance does. `decode`: in a decode step, as the decode leg
    /// does after its READ: the oracle is asked for the prompt without its last token and one
    /// token more, the prompt sent through P/D ends in the oracle's first token, and P/D's
    /// tokens are compared with the oracle's after it (a one-token prompt is compared as it
    /// is). For models whose vLLM kernels compute a token otherwise in a prefill than in a
    /// decode step (LFM2's short convolution on CPU: up to 0.044 logprob apart in a plain
    /// instance), where only `decode` compares like with like.
    #[arg(long, value_enum, default_value = "prefill")]
    pub last_token: LastToken,
}

/// `--last-token` values: where the oracle computes a prompt's last token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LastToken {
    /// In the prompt's prefill.
    Prefill,
    /// In a decode step after the rest of the prompt's prefill.
    Decode,
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
    let lengths_of = |default_lengths: Option<Vec<u64>>| match (&args.lengths, default_lengths) {
        (Some(spec), _) => {
            crate::lengths::parse_lengths(spec).map_err(|error| anyhow::anyhow!("--lengths: {error}"))
        }
        (None, Some(lengths)) => Ok(lengths),
        (None, None) => {
            anyhow::bail!("--lengths is required, e.g. --lengths 1..1100 or --lengths 251,377,440")
        }
    };
    if let Some(path) = &args.config
        && let pdkv_actors::config::AnyCluster::Vllm(cluster) =
            pdkv_actors::config::AnyCluster::from_file(path)?
    {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
        let lengths = lengths_of(default_lengths)?;
        return crate::vllm_sweep::run(&args, cluster, text, lengths);
    }
    if args.repeat
        || args.concurrency != 1
        || args.oracle != crate::vllm_sweep::Oracle::Plain
        || args.last_token != LastToken::Prefill
    {
        anyhow::bail!(
            "--repeat, --concurrency, --oracle and --last-token are for vLLM legs; the reference engine's direct run is computed here"
        );
    }
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
    let lengths = lengths_of(default_lengths)?;
    // Refuse before starting the cluster or building a prompt: no length may outgrow the legs.
    if let Some(&longest) = lengths.iter().max() {
        config
            .check_prompt_tokens(longest)
            .map_err(|error| anyhow::anyhow!("--lengths: {error}"))?;
    }
    let system = actix::System::new();
    if args.in_process {
        return system.block_on(async move { sweep_cluster(config, &lengths, &args).await });
    }
    system.block_on(async move { sweep_processes(config, &lengths, &args).await })
}

/// The run directory of a process sweep, and whether it was made here (and may be removed).
pub(crate) fn sweep_run_dir(args: &SweepArgs) -> (PathBuf, bool) {
    match &args.run_dir {
        Some(dir) => (dir.clone(), false),
        None => {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |elapsed| elapsed.subsec_nanos());
            let dir = std::env::temp_dir().join(format!("pdkv-sweep-{}-{nanos}", std::process::id()));
            (dir, true)
        }
    }
}

/// The config text the processes run: the file (or the embedded default) with `--pairing`
/// written into `[exchange]`.
fn process_config_text(args: &SweepArgs) -> anyhow::Result<String> {
    let text = match &args.config {
        Some(path) => {
            std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?
        }
        None => pdkv_actors::config::DEFAULT_CLUSTER_TOML.to_string(),
    };
    let Some(PairingModeArg(mode)) = args.pairing else {
        return Ok(text);
    };
    let mut doc: toml::Table = text.parse().context("cluster.toml is not TOML")?;
    let exchange = doc
        .entry("exchange")
        .or_insert_with(|| toml::Value::Table(toml::Table::new()));
    if let toml::Value::Table(exchange) = exchange {
        let name = match mode {
            PairingMode::Anchored => "anchored",
            PairingMode::Legacy => "legacy",
        };
        exchange.insert("pairing".into(), toml::Value::String(name.into()));
    }
    Ok(toml::to_string(&doc)?)
}

/// Launches the cluster as processes, sends every length through the router's HTTP API and
/// compares each answer with a direct run computed here.
async fn sweep_processes(
    config: ClusterConfig,
    lengths: &[u64],
    args: &SweepArgs,
) -> anyhow::Result<ExitCode> {
    let mode = match config.exchange.pairing {
        PairingMode::Anchored => "anchored",
        PairingMode::Legacy => "legacy",
    };
    let (run_dir, temporary) = sweep_run_dir(args);
    let (launched, router_url, legs) = match &args.router {
        Some(url) => (
            None,
            url.trim_end_matches('/').to_string(),
            parse_legs(&args.legs)?,
        ),
        None => {
            let mut options =
                crate::launch_cmd::options(None, run_dir.clone(), args.ready_timeout.unwrap_or(30.0))?;
            options.config_text = process_config_text(args)?;
            if let Some(path) = &args.config {
                options.config_name = path.display().to_string();
            }
            let launched = tokio::task::spawn_blocking(move || crate::launch::Cluster::launch(&options))
                .await
                .context("launcher thread")??;
            let legs = launched
                .members
                .iter()
                .filter(|member| member.name != pdkv_actors::config::ROUTER_NODE)
                .map(|member| (member.name.clone(), member.admin_url.clone()))
                .collect();
            let url = launched.router_url.clone();
            (Some(launched), url, legs)
        }
    };
    // The reference: one leg alone, in this process, on the same seeded model.
    let mut reference = config.clone();
    reference.transport.read_engine = pdkv_actors::config::ReadEngineKind::Local;
    reference.transport.links = LinkKind::Local;
    let direct = LocalCluster::start(reference)
        .await
        .context("cannot start the in-process reference leg")?;
    let request_timeout = std::time::Duration::from_millis(config.limits.request_timeout_ms + 5000);
    let client = std::sync::Arc::new(crate::client::Client::new(&router_url, request_timeout));
    let started = Instant::now();
    let mut printer = Printer::new(args.json, lengths.len());
    let mut results: Vec<Comparison> = Vec::with_capacity(lengths.len());
    for &length in lengths {
        if crate::output::closed() {
            break;
        }
        let result = compare_over_http(&config, &client, &direct, length, args.max_tokens).await;
        printer.row(&result);
        results.push(result);
    }
    printer.finish();
    let elapsed = started.elapsed();
    direct.shutdown();
    let groups = config.layout.groups().len();
    let stats =
        tokio::task::spawn_blocking(move || wait_legs_idle(&legs, groups, std::time::Duration::from_secs(3)))
            .await
            .context("metrics thread")??;
    let Some(mut launched) = launched else {
        return Ok(report(
            &results,
            &stats,
            mode,
            "a running cluster",
            elapsed,
            args.json,
        ));
    };
    tokio::task::spawn_blocking(move || launched.stop())
        .await
        .context("launcher thread")?;
    let code = report(&results, &stats, mode, "processes over QUIC", elapsed, args.json);
    if temporary && code == ExitCode::SUCCESS {
        let _ = std::fs::remove_dir_all(&run_dir);
    } else if code != ExitCode::SUCCESS {
        eprintln!("logs and the resolved cluster.toml are in {}", run_dir.display());
    }
    Ok(code)
}

/// `--legs name=http://host:port,...`.
pub(crate) fn parse_legs(legs: &[String]) -> anyhow::Result<Vec<(String, String)>> {
    legs.iter()
        .map(|leg| {
            leg.split_once('=')
                .map(|(name, url)| (name.to_string(), url.trim_end_matches('/').to_string()))
                .with_context(|| format!("--legs: {leg:?} is not name=http://host:port"))
        })
        .collect()
}

/// Polls every leg's `/metrics` until all are idle or `timeout` passes; returns the last reading.
pub(crate) fn wait_legs_idle(
    legs: &[(String, String)],
    groups: usize,
    timeout: std::time::Duration,
) -> anyhow::Result<Vec<pdkv_actors::scheduler::LegStats>> {
    let deadline = Instant::now() + timeout;
    loop {
        let stats = legs
            .iter()
            .map(|(name, url)| crate::client::leg_stats(name, url, groups))
            .collect::<Result<Vec<_>, String>>()
            .map_err(anyhow::Error::msg)?;
        if stats.iter().all(|leg| leg.is_idle()) || Instant::now() >= deadline {
            return Ok(stats);
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// One length through the router's HTTP API against a direct run here.
async fn compare_over_http(
    config: &ClusterConfig,
    client: &std::sync::Arc<crate::client::Client>,
    direct: &LocalCluster,
    length: u64,
    max_tokens: u32,
) -> Comparison {
    let failed = |error: String| Comparison {
        prompt_tokens: length,
        matched: false,
        error: Some(error),
        read_bytes: 0,
        read_runs: 0,
    };
    if let Err(error) = config.check_prompt_tokens(length) {
        return failed(error.to_string());
    }
    let params = config.model;
    let prompt = pdkv_actors::engine::prompt_tokens(params.seed, length as usize, params.vocab);
    let sampling = sweep::sampling_for(length, params.vocab);
    let (http_client, http_prompt, http_sampling) = (client.clone(), prompt.clone(), sampling.clone());
    let answer = tokio::task::spawn_blocking(move || {
        http_client.complete_sampled(&http_prompt, max_tokens, &http_sampling)
    })
    .await
    .unwrap_or_else(|error| Err(error.to_string()));
    let answer = match answer {
        Ok(answer) => answer,
        Err(error) => return failed(format!("p/d: {error}")),
    };
    match direct.direct_sampled(prompt, max_tokens, sampling, None).await {
        Ok(reference) => Comparison {
            prompt_tokens: length,
            matched: answer.tokens == reference.tokens && answer.logits_digest == reference.logits_digest,
            error: None,
            read_bytes: answer.read_bytes,
            read_runs: answer.read_runs,
        },
        Err(error) => Comparison {
            error: Some(format!("direct: {error}")),
            read_bytes: answer.read_bytes,
            read_runs: answer.read_runs,
            ..failed(String::new())
        },
    }
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
    let mut printer = Printer::new(args.json, lengths.len());
    let mut results: Vec<Comparison> = Vec::with_capacity(lengths.len());
    for &length in lengths {
        if crate::output::closed() {
            break;
        }
        let result = sweep::compare(&cluster, length, args.max_tokens).await;
        printer.row(&result);
        results.push(result);
    }
    printer.finish();
    let elapsed = started.elapsed();
    let stats = cluster.wait_idle(std::time::Duration::from_secs(2)).await?;
    cluster.shutdown();
    let transport = format!("in one process, {links} links");
    Ok(report(&results, &stats, mode, &transport, elapsed, args.json))
}

/// Prints a row per length (a table with a progress bar, or JSON lines).
struct Printer {
    json: bool,
    progress: indicatif::ProgressBar,
}

impl Printer {
    fn new(json: bool, lengths: usize) -> Self {
        let progress = if json {
            indicatif::ProgressBar::hidden()
        } else {
            crate::outln!("{:>8} {:>10} {:>6}  result", "prompt", "read KiB", "runs");
            indicatif::ProgressBar::new(lengths as u64)
        };
        Printer { json, progress }
    }

    fn row(&mut self, result: &Comparison) {
        if self.json {
            crate::outln!(
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
            self.progress.suspend(|| {
                crate::outln!(
                    "{:>8} {:>10.1} {:>6}  {verdict}",
                    result.prompt_tokens,
                    result.read_bytes as f64 / 1024.0,
                    result.read_runs
                )
            });
        }
        self.progress.inc(1);
    }

    fn finish(&self) {
        self.progress.finish_and_clear();
    }
}

/// Prints the legs' accounting and the summary; success when every length matched and every
/// leg is idle.
fn report(
    results: &[Comparison],
    stats: &[pdkv_actors::scheduler::LegStats],
    mode: &str,
    transport: &str,
    elapsed: std::time::Duration,
    json_lines: bool,
) -> ExitCode {
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
    if json_lines {
        crate::outln!(
            "{}",
            json!({"summary": {
                "pairing": mode,
                "transport": transport,
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
        for leg in stats {
            crate::outln!(
                "leg {}: free blocks {:?} of {:?}, {} requests, {} grants{}",
                leg.node,
                leg.load.free_blocks,
                leg.load.capacity,
                leg.load.requests,
                leg.load.grants,
                if leg.is_idle() { "" } else { "  <- LEAK" }
            );
        }
        if !mismatched.is_empty() {
            crate::outln!("mismatched at prompt lengths {mismatched:?}");
        }
        if !errors.is_empty() {
            crate::outln!("failed at prompt lengths {errors:?}");
        }
        crate::outln!(
            "{matched}/{} match ({mode} pairing, {transport}, {:.1} KiB read, {:.1} s)",
            results.len(),
            read_bytes as f64 / 1024.0,
            elapsed.as_secs_f64()
        );
    }
    // A reader that left before the end stopped the sweep: not every length was compared.
    if matched == results.len() && idle && !crate::output::closed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
