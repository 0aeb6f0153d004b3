//! `pdkv load`: a load generator against a router's HTTP API.
//!
//! Closed loop (`--concurrency N`: N clients, each sending its next request when the last one
//! answered) or open loop (`--rate R`: R requests a second on a fixed schedule, at most
//! `--max-in-flight` outstanding; a request that would exceed it is counted as dropped). Prompt
//! lengths are drawn uniformly from `--lengths`, seeded. Every request is streamed, so the time
//! to the first token (TTFT) and the gaps between tokens are measured by the client. Without
//! `--router` it launches the cluster (`--config`, default the shipped one) itself, and then also
//! reports the router process's CPU share.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use pdkv_actors::config::{ClusterConfig, ROUTER_NODE};
use pdkv_actors::engine::prompt_tokens;
use pdkv_core::sampling::Sampling;
use rand_chacha::ChaCha8Rng;
use rand_core::{RngCore, SeedableRng};
use serde_json::{Value, json};

use crate::launch::http_agent;

/// Arguments of `pdkv load`.
#[derive(Debug, Args)]
pub struct LoadArgs {
    /// A running router (`http://host:port`); without it the cluster is launched here.
    #[arg(long)]
    pub router: Option<String>,
    /// cluster.toml (the running cluster's, for its vocabulary; or the one to launch).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Closed loop: this many clients, each with one request outstanding.
    #[arg(long, conflicts_with = "rate", value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub concurrency: Option<u32>,
    /// Open loop: requests a second.
    #[arg(long)]
    pub rate: Option<f64>,
    /// Open loop: most requests outstanding; more are dropped and counted.
    #[arg(long, default_value_t = 256)]
    pub max_in_flight: usize,
    /// Seconds to send requests for.
    #[arg(long, default_value_t = 10.0)]
    pub duration: f64,
    /// Prompt lengths to draw from, as for `pdkv sweep` (`16..1024`, `100,200`).
    #[arg(long, default_value = "16..1024")]
    pub lengths: String,
    /// Tokens every prompt starts with, the same for all (a system prompt, a few-shot header):
    /// a decode leg with prefix caching reads them once. Each prompt's own tokens follow,
    /// `--lengths` of them.
    #[arg(long, default_value_t = 0)]
    pub shared_prefix: usize,
    /// Sample with this temperature (with `--top-p`, and a seed per request drawn from
    /// `--seed`); 0, the default, decodes greedily.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// With `--temperature`: the top-p of every request.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub max_tokens: u32,
    /// Seed of the prompt lengths and contents.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Print the report as one JSON object.
    #[arg(long)]
    pub json: bool,
    /// Draw latency and throughput over time into this SVG file.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Without `--router`: seconds the launched cluster has to become ready.
    #[arg(long, default_value_t = 30.0)]
    pub ready_timeout: f64,
}

/// Seeds the shared prefix apart from every request's own tokens.
const SHARED_PREFIX_SEED: u64 = 0x5348_4152_4544;

/// Pauses between attempts of a client whose requests cannot reach the router: 50 ms,
/// doubling to 2 s, back to none after a request that reached it.
#[derive(Debug, Default)]
pub(crate) struct Backoff {
    next: Option<Duration>,
}

impl Backoff {
    const FIRST: Duration = Duration::from_millis(50);
    const MOST: Duration = Duration::from_secs(2);

    /// The pause before the next attempt, after one that `failed` to reach the router.
    pub(crate) fn after(&mut self, failed: bool) -> Option<Duration> {
        if !failed {
            self.next = None;
            return None;
        }
        let pause = self.next.unwrap_or(Self::FIRST);
        self.next = Some((pause * 2).min(Self::MOST));
        Some(pause)
    }
}

/// One request's outcome.
#[derive(Debug, Clone)]
pub(crate) struct Sample {
    /// Seconds from the start of the run to the request's send.
    pub(crate) start_s: f64,
    /// Seconds to the last byte, or to the error.
    pub(crate) latency_s: f64,
    /// Seconds to the first token chunk.
    pub(crate) ttft_s: Option<f64>,
    /// Gaps between token chunks.
    pub(crate) gaps_s: Vec<f64>,
    pub(crate) prompt_tokens: usize,
    pub(crate) tokens: usize,
    /// The generated token ids, in order.
    pub(crate) token_ids: Vec<u32>,
    /// The digest of every step's logits, from the stream's last chunk.
    pub(crate) logits_digest: Option<u64>,
    pub(crate) read_bytes: u64,
    pub(crate) error: Option<String>,
    /// The error came from the router (an error status or an error chunk), not from the
    /// connection (refused, reset, timed out).
    pub(crate) answered: bool,
}

/// Sends one streamed completion and times it.
pub(crate) fn complete(
    agent: &ureq::Agent,
    base: &str,
    prompt: &[u32],
    max_tokens: u32,
    sampling: &Sampling,
    run_start: Instant,
) -> Sample {
    let started = Instant::now();
    let mut sample = Sample {
        start_s: started.duration_since(run_start).as_secs_f64(),
        latency_s: 0.0,
        ttft_s: None,
        gaps_s: Vec::new(),
        prompt_tokens: prompt.len(),
        tokens: 0,
        token_ids: Vec::new(),
        logits_digest: None,
        read_bytes: 0,
        error: None,
        answered: false,
    };
    let mut answered = false;
    let mut body = json!({"prompt": prompt, "max_tokens": max_tokens, "stream": true});
    crate::client::add_sampling(&mut body, sampling);
    let result = (|| -> Result<(), String> {
        let response = agent
            .post(format!("{base}/v1/completions"))
            .send_json(&body)
            .map_err(|error| error.to_string())?;
        let status = response.status().as_u16();
        if status != 200 {
            answered = true;
            let mut response = response;
            let text = response.body_mut().read_to_string().unwrap_or_default();
            let message = serde_json::from_str::<Value>(&text)
                .ok()
                .and_then(|body| body["error"]["message"].as_str().map(String::from))
                .unwrap_or(text);
            return Err(format!("{status}: {message}"));
        }
        let mut last_token: Option<Instant> = None;
        let mut done = false;
        let mut reader = BufReader::new(response.into_body().into_reader());
        for line in (&mut reader).lines() {
            let line = line.map_err(|error| error.to_string())?;
            let Some(data) = line.strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                done = true;
                break;
            }
            let chunk: Value = serde_json::from_str(data).map_err(|error| error.to_string())?;
            if let Some(error) = chunk.get("error") {
                answered = true;
                return Err(error["message"].as_str().unwrap_or("error chunk").to_string());
            }
            let now = Instant::now();
            let ids: Vec<u32> = chunk["choices"]
                .as_array()
                .into_iter()
                .flatten()
                .flat_map(|choice| choice["token_ids"].as_array().into_iter().flatten())
                .map(|id| id.as_u64().and_then(|id| u32::try_from(id).ok()))
                .collect::<Option<_>>()
                .ok_or("a token id is not a u32")?;
            let tokens = ids.len();
            sample.token_ids.extend(ids);
            if tokens > 0 {
                match last_token {
                    None => sample.ttft_s = Some(now.duration_since(started).as_secs_f64()),
                    Some(previous) => sample.gaps_s.push(now.duration_since(previous).as_secs_f64()),
                }
                last_token = Some(now);
                sample.tokens += tokens;
            }
            if let Some(bytes) = chunk["pdkv"]["read_bytes"].as_u64() {
                sample.read_bytes = bytes;
            }
            if let Some(digest) = chunk["pdkv"]["logits_digest"].as_str() {
                sample.logits_digest = Some(
                    u64::from_str_radix(digest, 16)
                        .map_err(|error| format!("logits digest {digest:?}: {error}"))?,
                );
            }
        }
        if !done {
            return Err("the stream ended without [DONE]".into());
        }
        // Read the body to its end (the chunked encoding's last chunk): a body left unread
        // closes the connection, and every request would pay a new one.
        std::io::copy(&mut reader, &mut std::io::sink()).map_err(|error| error.to_string())?;
        Ok(())
    })();
    sample.latency_s = started.elapsed().as_secs_f64();
    sample.error = result.err();
    sample.answered = answered && sample.error.is_some();
    sample
}

/// The `q`-quantile (0..=1) of `values` (nearest rank), or 0 when empty.
pub(crate) fn quantile(values: &mut [f64], q: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f64::total_cmp);
    let rank = ((q * values.len() as f64).ceil() as usize).clamp(1, values.len());
    values[rank - 1]
}

/// CPU seconds a process has used (user + system), from `/proc/<pid>/stat`.
fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which is in parentheses and may hold spaces.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    // SAFETY: sysconf has no preconditions.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (per_second > 0).then(|| ticks / per_second as f64)
}

/// Runs `pdkv load`.
pub fn run(args: LoadArgs) -> anyhow::Result<ExitCode> {
    if !(args.duration.is_finite() && args.duration > 0.0 && args.duration <= 86_400.0) {
        bail!(
            "--duration: {} is not a number of seconds in (0, 86400]",
            args.duration
        );
    }
    if let Some(rate) = args.rate
        && !(rate.is_finite() && rate > 0.0 && rate <= 100_000.0)
    {
        bail!("--rate: {rate} is not a number of requests a second in (0, 100000]");
    }
    let lengths = crate::lengths::parse_lengths(&args.lengths)
        .map_err(|error| anyhow::anyhow!("--lengths: {error}"))?;
    let config = match &args.config {
        Some(path) => ClusterConfig::from_file(path)?,
        None => ClusterConfig::embedded_default(),
    };
    if let Some(&longest) = lengths.iter().max() {
        config
            .check_prompt_tokens(longest + args.shared_prefix as u64)
            .map_err(|error| {
                anyhow::anyhow!("--lengths with --shared-prefix {}: {error}", args.shared_prefix)
            })?;
    }
    let (cluster, base, run_dir) = match &args.router {
        Some(url) => (None, url.trim_end_matches('/').to_string(), None),
        None => {
            let run_dir = std::env::temp_dir().join(format!("pdkv-load-{}", std::process::id()));
            let options =
                crate::launch_cmd::options(args.config.as_ref(), run_dir.clone(), args.ready_timeout)?;
            let cluster = crate::launch::Cluster::launch(&options)?;
            let base = cluster.router_url.clone();
            (Some(cluster), base, Some(run_dir))
        }
    };
    let router_pid = cluster.as_ref().and_then(|cluster| {
        cluster
            .members
            .iter()
            .find(|member| member.name == ROUTER_NODE)
            .and_then(|member| member.pid())
    });
    let timeout = Duration::from_millis(config.limits.request_timeout_ms + 5000);
    let duration = Duration::from_secs_f64(args.duration);
    let cpu_before = router_pid.and_then(cpu_seconds);
    let samples = Arc::new(Mutex::new(Vec::new()));
    let dropped = Arc::new(AtomicUsize::new(0));
    let run_start = Instant::now();
    let (vocab, seed, max_tokens) = (config.model.vocab, args.seed, args.max_tokens);
    let probe = Sampling {
        temperature: args.temperature,
        top_p: args.top_p,
        ..Sampling::default()
    };
    probe
        .check()
        .map_err(|error| anyhow::anyhow!("--temperature / --top-p: {error}"))?;
    let (temperature, top_p) = (args.temperature, args.top_p);
    let lengths = Arc::new(lengths);
    // Drawn from a seed no request's own tokens use.
    let prefix: Arc<[u32]> = prompt_tokens(seed ^ SHARED_PREFIX_SEED, args.shared_prefix, vocab).into();
    let request = {
        let (base, lengths) = (base.clone(), lengths.clone());
        move |agent: &ureq::Agent, index: u64| {
            let mut rng = ChaCha8Rng::seed_from_u64(seed ^ index.wrapping_mul(0x9E37_79B9_7F4A_7C15));
            let length = lengths[(rng.next_u64() % lengths.len() as u64) as usize];
            let mut prompt = prefix.to_vec();
            prompt.extend(prompt_tokens(seed.wrapping_add(index), length as usize, vocab));
            let sampling = Sampling {
                temperature,
                top_p,
                seed: rng.next_u64(),
                ..Sampling::default()
            };
            complete(agent, &base, &prompt, max_tokens, &sampling, run_start)
        }
    };
    let next = Arc::new(std::sync::atomic::AtomicU64::new(0));
    match (args.concurrency, args.rate) {
        (_, Some(rate)) => {
            let in_flight = Arc::new(AtomicUsize::new(0));
            let interval = Duration::from_secs_f64(1.0 / rate);
            let mut handles = Vec::new();
            let mut due = run_start;
            while due.duration_since(run_start) < duration {
                std::thread::sleep(due.saturating_duration_since(Instant::now()));
                due += interval;
                if in_flight.load(Ordering::SeqCst) >= args.max_in_flight {
                    dropped.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                in_flight.fetch_add(1, Ordering::SeqCst);
                let (request, samples, in_flight, next) =
                    (request.clone(), samples.clone(), in_flight.clone(), next.clone());
                handles.push(std::thread::spawn(move || {
                    let agent = http_agent(timeout);
                    let sample = request(&agent, next.fetch_add(1, Ordering::Relaxed));
                    samples
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .push(sample);
                    in_flight.fetch_sub(1, Ordering::SeqCst);
                }));
                handles.retain(|handle| !handle.is_finished());
            }
            for handle in handles {
                let _ = handle.join();
            }
        }
        (concurrency, None) => {
            let stop = Arc::new(AtomicBool::new(false));
            let clients: Vec<_> = (0..concurrency.unwrap_or(16))
                .map(|_| {
                    let (request, samples, stop, next) =
                        (request.clone(), samples.clone(), stop.clone(), next.clone());
                    std::thread::spawn(move || {
                        let agent = http_agent(timeout);
                        let mut backoff = Backoff::default();
                        while !stop.load(Ordering::Relaxed) {
                            let sample = request(&agent, next.fetch_add(1, Ordering::Relaxed));
                            // A router that cannot be reached is tried again after a growing
                            // pause, not at once in a tight loop.
                            let pause = backoff.after(sample.error.is_some() && !sample.answered);
                            samples
                                .lock()
                                .unwrap_or_else(PoisonError::into_inner)
                                .push(sample);
                            if let Some(pause) = pause {
                                std::thread::sleep(pause);
                            }
                        }
                    })
                })
                .collect();
            std::thread::sleep(duration);
            stop.store(true, Ordering::Relaxed);
            for client in clients {
                let _ = client.join();
            }
        }
    }
    let elapsed = run_start.elapsed();
    let router_cpu = match (router_pid.and_then(cpu_seconds), cpu_before) {
        (Some(after), Some(before)) => Some((after - before) / elapsed.as_secs_f64()),
        _ => None,
    };
    let samples = std::mem::take(&mut *samples.lock().unwrap_or_else(PoisonError::into_inner));
    if !samples.is_empty()
        && samples
            .iter()
            .all(|sample| sample.error.is_some() && !sample.answered)
    {
        if let Some(mut cluster) = cluster {
            cluster.stop();
        }
        if let Some(run_dir) = &run_dir {
            let _ = std::fs::remove_dir_all(run_dir);
        }
        bail!(
            "the router at {base} is unreachable: {} ({} attempts)",
            samples[0].error.as_deref().unwrap_or("no answer"),
            samples.len()
        );
    }
    let report = summarize(
        &samples,
        elapsed,
        dropped.load(Ordering::Relaxed),
        router_cpu,
        &args,
    );
    if let Some(path) = &args.plot {
        plot(&samples, path).with_context(|| format!("cannot draw {}", path.display()))?;
    }
    if let Some(mut cluster) = cluster {
        cluster.stop();
    }
    if let Some(run_dir) = run_dir {
        let _ = std::fs::remove_dir_all(run_dir);
    }
    if args.json {
        crate::outln!("{report}");
    } else {
        print_report(&report);
    }
    Ok(
        if report["errors"] == 0 && report["requests"].as_u64() > Some(0) {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        },
    )
}

fn summarize(
    samples: &[Sample],
    elapsed: Duration,
    dropped: usize,
    router_cpu: Option<f64>,
    args: &LoadArgs,
) -> Value {
    let ok: Vec<&Sample> = samples.iter().filter(|sample| sample.error.is_none()).collect();
    let mut errors: BTreeMap<String, usize> = BTreeMap::new();
    for sample in samples {
        if let Some(error) = &sample.error {
            *errors.entry(error.clone()).or_default() += 1;
        }
    }
    let mut latency: Vec<f64> = ok.iter().map(|sample| sample.latency_s).collect();
    let mut ttft: Vec<f64> = ok.iter().filter_map(|sample| sample.ttft_s).collect();
    let mut gaps: Vec<f64> = ok
        .iter()
        .flat_map(|sample| sample.gaps_s.iter().copied())
        .collect();
    let seconds = elapsed.as_secs_f64();
    let read_bytes: u64 = ok.iter().map(|sample| sample.read_bytes).sum();
    let tokens: usize = ok.iter().map(|sample| sample.tokens).sum();
    let prompt_tokens: usize = ok.iter().map(|sample| sample.prompt_tokens).sum();
    // No figure (null) where there is nothing to measure, never a made-up 0.
    let ms = |values: &mut Vec<f64>, q: f64| {
        (!values.is_empty()).then(|| (quantile(values, q) * 1e6).round() / 1e3)
    };
    json!({
        "mode": match (args.concurrency, args.rate) {
            (_, Some(rate)) => format!("open loop, {rate} req/s"),
            (concurrency, None) => format!("closed loop, {} clients", concurrency.unwrap_or(16)),
        },
        "seconds": (seconds * 1e3).round() / 1e3,
        "requests": ok.len(),
        "errors": samples.len() - ok.len(),
        "error_kinds": errors,
        "dropped": dropped,
        "requests_per_s": ok.len() as f64 / seconds,
        "prompt_tokens_per_s": prompt_tokens as f64 / seconds,
        "generated_tokens_per_s": tokens as f64 / seconds,
        "latency_ms": {"p50": ms(&mut latency, 0.5), "p99": ms(&mut latency, 0.99)},
        "ttft_ms": {"p50": ms(&mut ttft, 0.5), "p99": ms(&mut ttft, 0.99)},
        "inter_token_ms": {"p50": ms(&mut gaps, 0.5), "p99": ms(&mut gaps, 0.99)},
        "shared_prefix_tokens": args.shared_prefix,
        "kv_read_gb_per_s": read_bytes as f64 / seconds / 1e9,
        "router_cpu_share": router_cpu,
    })
}

fn print_report(report: &Value) {
    crate::outln!(
        "{} for {} s",
        report["mode"].as_str().unwrap_or(""),
        report["seconds"]
    );
    crate::outln!(
        "requests: {} ok, {} errors, {} dropped; {:.1} req/s, {:.0} prompt tokens/s, {:.0} generated tokens/s",
        report["requests"],
        report["errors"],
        report["dropped"],
        report["requests_per_s"].as_f64().unwrap_or(0.0),
        report["prompt_tokens_per_s"].as_f64().unwrap_or(0.0),
        report["generated_tokens_per_s"].as_f64().unwrap_or(0.0),
    );
    for (name, key) in [
        ("latency", "latency_ms"),
        ("TTFT", "ttft_ms"),
        ("inter-token", "inter_token_ms"),
    ] {
        let figure = |value: &Value| value.as_f64().map_or("n/a".to_string(), |ms| format!("{ms} ms"));
        crate::outln!(
            "{name:>12}: p50 {}, p99 {}",
            figure(&report[key]["p50"]),
            figure(&report[key]["p99"])
        );
    }
    crate::outln!(
        "KV read: {:.3} GB/s",
        report["kv_read_gb_per_s"].as_f64().unwrap_or(0.0)
    );
    if let Some(share) = report["router_cpu_share"].as_f64() {
        crate::outln!("router CPU: {:.0}% of one core", share * 100.0);
    }
    if let Some(errors) = report["error_kinds"].as_object() {
        for (kind, count) in errors {
            crate::outln!("error x{count}: {kind}");
        }
    }
}

/// Latency of every request over time (top) and completed requests a second (bottom).
fn plot(samples: &[Sample], path: &std::path::Path) -> anyhow::Result<()> {
    use plotters::prelude::*;
    let root = SVGBackend::new(path, (960, 640)).into_drawing_area();
    root.fill(&WHITE).map_err(|error| anyhow::anyhow!("{error}"))?;
    let (top, bottom) = root.split_vertically(320);
    let end_s = samples
        .iter()
        .map(|sample| sample.start_s + sample.latency_s)
        .fold(1.0, f64::max);
    let max_ms = samples
        .iter()
        .map(|sample| sample.latency_s * 1e3)
        .fold(1.0, f64::max)
        * 1.1;
    let fail = |error: &dyn std::fmt::Display| anyhow::anyhow!("{error}");
    // Both panels share the time axis and the width of the label area, so they line up.
    let label_area = 70;
    let mut latency = ChartBuilder::on(&top)
        .caption("request latency by send time", ("sans-serif", 16))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(label_area)
        .build_cartesian_2d(0.0..end_s, 0.0..max_ms)
        .map_err(|error| fail(&error))?;
    latency
        .configure_mesh()
        .x_desc("time since start (s)")
        .y_desc("latency (ms)")
        .draw()
        .map_err(|error| fail(&error))?;
    for (label, color, failed) in [("ok", BLUE, false), ("error", RED, true)] {
        latency
            .draw_series(
                samples
                    .iter()
                    .filter(|sample| sample.error.is_some() == failed)
                    .map(|sample| Circle::new((sample.start_s, sample.latency_s * 1e3), 2, color.filled())),
            )
            .map_err(|error| fail(&error))?
            .label(label)
            .legend(move |(x, y)| Circle::new((x + 5, y), 3, color.filled()));
    }
    latency
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|error| fail(&error))?;
    let seconds = end_s.ceil() as usize;
    let mut per_second = vec![0u32; seconds + 1];
    for sample in samples.iter().filter(|sample| sample.error.is_none()) {
        per_second[((sample.start_s + sample.latency_s) as usize).min(seconds)] += 1;
    }
    let max_rate = f64::from(per_second.iter().copied().max().unwrap_or(1).max(1)) * 1.1;
    let mut throughput = ChartBuilder::on(&bottom)
        .caption("throughput", ("sans-serif", 16))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(label_area)
        .build_cartesian_2d(0.0..end_s, 0.0..max_rate)
        .map_err(|error| fail(&error))?;
    throughput
        .configure_mesh()
        .x_desc("time since start (s)")
        .y_desc("completed requests (1/s)")
        .draw()
        .map_err(|error| fail(&error))?;
    throughput
        .draw_series(LineSeries::new(
            per_second
                .iter()
                .enumerate()
                .map(|(second, &count)| (second as f64 + 0.5, f64::from(count))),
            &BLACK,
        ))
        .map_err(|error| fail(&error))?
        .label("ok requests completed in each second")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 15, y)], BLACK));
    throughput
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|error| fail(&error))?;
    root.present().map_err(|error| anyhow::anyhow!("{error}"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{Backoff, complete, quantile};
    use pdkv_core::sampling::Sampling;
    use std::io::{BufRead, BufReader, Read, Write};
    use std::net::TcpListener;
    use std::time::{Duration, Instant};

    /// Serves `requests` streamed completions over HTTP/1.1 keep-alive on loopback and returns
    /// how many connections they came on.
    fn serve_streams(listener: TcpListener, requests: usize) -> usize {
        let mut connections = 0;
        let mut served = 0;
        while served < requests {
            let (stream, _) = listener.accept().expect("accept");
            stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            connections += 1;
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut writer = stream;
            while served < requests {
                let mut length = 0;
                let mut line = String::new();
                loop {
                    line.clear();
                    if reader.read_line(&mut line).unwrap_or(0) == 0 {
                        break;
                    }
                    if let Some(value) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                        length = value.trim().parse().unwrap();
                    }
                    if line == "\r\n" {
                        break;
                    }
                }
                if line != "\r\n" {
                    break; // The client closed this connection.
                }
                reader.read_exact(&mut vec![0; length]).unwrap();
                let events = "data: {\"choices\":[{\"token_ids\":[7]}]}\n\ndata: [DONE]\n\n";
                let response = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{events}\r\n0\r\n\r\n",
                    events.len()
                );
                writer.write_all(response.as_bytes()).unwrap();
                served += 1;
            }
        }
        connections
    }

    /// Streamed completions one after another reuse one connection: the stream is read to its
    /// end, so no request pays for a new connection (and the latencies do not include one).
    #[test]
    fn streamed_completions_reuse_one_connection() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let server = std::thread::spawn(move || serve_streams(listener, 3));
        let agent = crate::launch::http_agent(Duration::from_secs(5));
        for _ in 0..3 {
            let sample = complete(&agent, &base, &[1, 2, 3], 1, &Sampling::default(), Instant::now());
            assert_eq!(sample.error, None);
            assert_eq!(sample.token_ids, vec![7]);
        }
        assert_eq!(server.join().unwrap(), 1, "connections for three requests");
    }

    #[test]
    fn an_unreachable_router_is_tried_again_after_growing_pauses() {
        let mut backoff = Backoff::default();
        let pauses: Vec<Option<Duration>> = (0..8).map(|_| backoff.after(true)).collect();
        let ms = |ms| Some(Duration::from_millis(ms));
        assert_eq!(
            pauses,
            vec![
                ms(50),
                ms(100),
                ms(200),
                ms(400),
                ms(800),
                ms(1600),
                ms(2000),
                ms(2000)
            ]
        );
        assert_eq!(backoff.after(false), None);
        assert_eq!(
            backoff.after(true),
            ms(50),
            "a request that got through resets it"
        );
    }

    #[test]
    fn quantiles_are_nearest_rank() {
        let mut values: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&mut values, 0.5), 50.0);
        assert_eq!(quantile(&mut values, 0.99), 99.0);
        assert_eq!(quantile(&mut values, 1.0), 100.0);
        assert_eq!(quantile(&mut [3.0, 1.0, 2.0], 0.5), 2.0);
        assert_eq!(quantile(&mut [], 0.5), 0.0);
    }
}
