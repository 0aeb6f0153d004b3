//! `pdkv sweep` and `pdkv demo` for a cluster of vLLM legs: every prompt length through the
//! router (prefill leg, then decode leg reading the KV), against an oracle with the same weights
//! that transfers no KV: a plain vLLM instance this command starts (`--oracle plain`, the
//! default: no connector, no prefix cache), a prefill leg asked without KV transfer
//! (`--oracle leg`), or a server at a URL.
//!
//! Requests are greedy with `ignore_eos`, so each answer has `--max-tokens` tokens; the token ids
//! and the top `--logprobs` log-probabilities of every generated token must be equal (exactly,
//! or within `--logprob-tolerance`). Each row also says how many prompt tokens the decode legs
//! read from a prefill leg (the change of their `vllm:external_prefix_cache_hits_total`; exact
//! when requests go one at a time), so a run that silently recomputed everything shows. After
//! the last length every leg must be idle: no request running or waiting, its KV cache usage
//! back to zero (hand-offs released or lapsed within `[limits] lease_ms`).

use std::path::PathBuf;
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use futures_util::StreamExt;
use pdkv_actors::config::ROUTER_NODE;
use pdkv_actors::engines::VllmCluster;
use pdkv_core::wire::Role;
use serde_json::{Value, json};

use crate::client::sample_sum;
use crate::sweep_cmd::{LastToken, SweepArgs};

/// How often a leg's idleness is polled after the last length.
const IDLE_POLL: Duration = Duration::from_millis(100);

/// Where answers are compared against.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Oracle {
    /// A plain vLLM instance started here.
    Plain,
    /// The first prefill leg, asked without KV transfer.
    Leg,
    /// A server already running at this URL.
    Url(String),
}

impl std::str::FromStr for Oracle {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "plain" => Ok(Oracle::Plain),
            "leg" => Ok(Oracle::Leg),
            url if url.starts_with("http://") || url.starts_with("https://") => {
                Ok(Oracle::Url(url.trim_end_matches('/').to_string()))
            }
            other => Err(format!("{other:?}: \"plain\", \"leg\" or an http:// URL")),
        }
    }
}

/// One length's result.
#[derive(Debug, Clone)]
struct Row {
    prompt_tokens: u64,
    /// Which send of this prompt (`--repeat`: 0, then 1).
    send: u32,
    matched: bool,
    error: Option<String>,
    /// Prompt tokens the decode legs were to read (sequential sends only).
    read_tokens: Option<u64>,
    /// Whether that read completed (`None`: none was planned, or sends overlapped).
    loaded: Option<bool>,
    /// Where the first difference was.
    difference: Option<String>,
    /// The largest log-probability difference to the oracle.
    largest_difference: f64,
}

/// A plain vLLM server this sweep started; stopped when dropped.
pub struct PlainServer {
    child: Child,
    url: String,
    log: PathBuf,
}

impl PlainServer {
    /// Its base URL.
    pub fn url(&self) -> &str {
        &self.url
    }
}

impl Drop for PlainServer {
    fn drop(&mut self) {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::killpg(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = nix::sys::signal::killpg(pid, nix::sys::signal::Signal::SIGKILL);
        let _ = self.child.wait();
    }
}

/// Starts the oracle: the cluster's model and engine flags, no connector, no prefix cache, on
/// a free loopback port; waits for its `/health`.
pub fn start_plain(
    cluster: &VllmCluster,
    run_dir: &std::path::Path,
    ready: Duration,
) -> anyhow::Result<PlainServer> {
    use std::os::unix::process::CommandExt;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let engine = &cluster.engine;
    let log = run_dir.join("oracle.log");
    let file = std::fs::File::create(&log).with_context(|| format!("cannot create {}", log.display()))?;
    let mut command = Command::new(&engine.python);
    command
        .args([
            "-m",
            pdkv_actors::engines::VLLM_SERVER_MODULE,
            "--model",
            &engine.model,
        ])
        .args(["--served-model-name", &engine.served_model_name])
        .args([
            "--host",
            "127.0.0.1",
            "--port",
            &port.to_string(),
            "--no-enable-prefix-caching",
        ])
        .args(&engine.args)
        .envs(&engine.env)
        .env("PYTHONUNBUFFERED", "1")
        .stdin(Stdio::null())
        .stdout(file.try_clone()?)
        .stderr(file)
        .process_group(0);
    if engine.device == pdkv_actors::engines::Device::Cpu {
        // The legs' cores, shared: the oracle's requests come one at a time.
        if let Some(cpus) = cluster.nodes.iter().find_map(|node| node.cpus.clone()) {
            command.env("VLLM_CPU_OMP_THREADS_BIND", cpus);
        }
    }
    let child = command
        .spawn()
        .with_context(|| format!("cannot start the oracle ({})", engine.python.display()))?;
    let mut server = PlainServer {
        child,
        url: format!("http://127.0.0.1:{port}"),
        log,
    };
    let agent = crate::launch::http_agent(Duration::from_secs(2));
    let deadline = Instant::now() + ready;
    loop {
        if let Ok(Some(status)) = server.child.try_wait() {
            bail!(
                "the oracle exited during startup ({status}); log {}:\n{}",
                server.log.display(),
                tail(&server.log)
            );
        }
        if agent
            .get(format!("{}/health", server.url))
            .call()
            .is_ok_and(|response| response.status().as_u16() == 200)
        {
            return Ok(server);
        }
        if Instant::now() >= deadline {
            bail!(
                "the oracle is not ready after {:.0} s; log {}:\n{}",
                ready.as_secs_f64(),
                server.log.display(),
                tail(&server.log)
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn tail(path: &std::path::Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

/// The prompt of length `length`: token ids in 1..=255 (every vocabulary has them) from a
/// generator seeded by the length, so prompts of different lengths share no prefix.
pub fn prompt(length: u64) -> Vec<u64> {
    use rand_core::{RngCore, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0x5eed_0000 ^ length);
    (0..length).map(|_| 1 + u64::from(rng.next_u32() % 255)).collect()
}

/// The request every side gets: greedy, fixed length, logprobs with token ids as keys.
pub(crate) fn body(model: &str, prompt: &[u64], max_tokens: u32, logprobs: u32) -> Value {
    json!({
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": true,
        "logprobs": logprobs,
        "return_token_ids": true,
        "return_tokens_as_token_ids": true,
    })
}

async fn complete(
    client: &reqwest::Client,
    url: &str,
    body: &Value,
    timeout: Duration,
) -> Result<Value, String> {
    let response = client
        .post(format!("{url}/v1/completions"))
        .json(body)
        .timeout(timeout)
        .send()
        .await
        .map_err(|error| format!("{url}: {error}"))?;
    let status = response.status();
    let answer: Value = response.json().await.map_err(|error| format!("{url}: {error}"))?;
    if !status.is_success() {
        return Err(format!(
            "{url} answered {status}: {}",
            answer["error"]["message"].as_str().unwrap_or("no message")
        ));
    }
    Ok(answer)
}

/// The first generated token id of an answer, if it has one.
fn first_token(answer: &Value) -> Option<u64> {
    answer["choices"][0]["token_ids"][0].as_u64()
}

/// `answer` as if its first generated token had been part of the prompt: every per-token list
/// of its first choice (token ids, logprobs, top logprobs, tokens, offsets) without its first
/// entry.
fn without_first_token(answer: &Value) -> Value {
    let mut answer = answer.clone();
    let drop_first = |list: Option<&mut Value>| {
        if let Some(items) = list.and_then(Value::as_array_mut)
            && !items.is_empty()
        {
            items.remove(0);
        }
    };
    if let Some(choice) = answer.pointer_mut("/choices/0") {
        drop_first(choice.get_mut("token_ids"));
        if let Some(logprobs) = choice.get_mut("logprobs") {
            for key in ["token_logprobs", "top_logprobs", "tokens", "text_offset"] {
                drop_first(logprobs.get_mut(key));
            }
        }
    }
    answer
}

/// Where two answers' choices first differ, if they do: token ids, then each token's
/// log-probability and top log-probabilities (within `tolerance`).
pub fn difference(ours: &Value, theirs: &Value, tolerance: f64) -> Option<String> {
    let (ours, theirs) = (&ours["choices"][0], &theirs["choices"][0]);
    if ours["token_ids"] != theirs["token_ids"] || ours["token_ids"].is_null() {
        return Some(format!(
            "token ids {} vs {}",
            ours["token_ids"], theirs["token_ids"]
        ));
    }
    let close = |a: &Value, b: &Value| match (a.as_f64(), b.as_f64()) {
        (Some(a), Some(b)) => (a - b).abs() <= tolerance,
        _ => a == b,
    };
    let (ours, theirs) = (&ours["logprobs"], &theirs["logprobs"]);
    let list = |value: &Value, key: &str| value[key].as_array().cloned().unwrap_or_default();
    let (our_tokens, their_tokens) = (list(ours, "token_logprobs"), list(theirs, "token_logprobs"));
    if our_tokens.len() != their_tokens.len() {
        return Some(format!("{} logprobs vs {}", our_tokens.len(), their_tokens.len()));
    }
    for (step, (a, b)) in our_tokens.iter().zip(&their_tokens).enumerate() {
        if !close(a, b) {
            return Some(format!("token {step}: logprob {a} vs {b}"));
        }
    }
    let (our_top, their_top) = (list(ours, "top_logprobs"), list(theirs, "top_logprobs"));
    for (step, (a, b)) in our_top.iter().zip(&their_top).enumerate() {
        let (Some(a), Some(b)) = (a.as_object(), b.as_object()) else {
            if a != b {
                return Some(format!("token {step}: top logprobs {a} vs {b}"));
            }
            continue;
        };
        if a.len() != b.len()
            || a.iter()
                .any(|(token, value)| b.get(token).is_none_or(|other| !close(value, other)))
        {
            return Some(format!(
                "token {step}: top logprobs {} vs {}",
                Value::from(a.clone()),
                Value::from(b.clone())
            ));
        }
    }
    None
}

/// The largest difference between two answers' log-probabilities (chosen tokens' and top
/// ones present in both); 0 when they have none.
pub fn largest_logprob_difference(ours: &Value, theirs: &Value) -> f64 {
    let (ours, theirs) = (&ours["choices"][0]["logprobs"], &theirs["choices"][0]["logprobs"]);
    let mut largest: f64 = 0.0;
    let mut consider = |a: &Value, b: &Value| {
        if let (Some(a), Some(b)) = (a.as_f64(), b.as_f64()) {
            largest = largest.max((a - b).abs());
        }
    };
    let list = |value: &Value, key: &str| value[key].as_array().cloned().unwrap_or_default();
    for (a, b) in list(ours, "token_logprobs")
        .iter()
        .zip(&list(theirs, "token_logprobs"))
    {
        consider(a, b);
    }
    for (a, b) in list(ours, "top_logprobs")
        .iter()
        .zip(&list(theirs, "top_logprobs"))
    {
        if let (Some(a), Some(b)) = (a.as_object(), b.as_object()) {
            for (token, value) in a {
                if let Some(other) = b.get(token) {
                    consider(value, other);
                }
            }
        }
    }
    largest
}

/// What the decode legs' `/metrics` say about loads: prompt tokens they planned to read
/// (`vllm:external_prefix_cache_hits_total`, counted when a load is scheduled), loads that
/// completed and loads that failed (pdkv's connector stats), summed over legs.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LoadCounts {
    /// Prompt tokens scheduled to be read.
    pub planned_tokens: f64,
    /// READs that completed.
    pub loads: f64,
    /// Loads that failed (recomputed).
    pub failed: f64,
    /// Offers refused before reading (another model, KV layout or prompt; recomputed).
    pub refused: f64,
}

impl LoadCounts {
    /// Reads them from one `/metrics` page.
    pub fn from_metrics(text: &str) -> Self {
        LoadCounts {
            planned_tokens: sample_sum(text, "vllm:external_prefix_cache_hits_total").unwrap_or(0.0),
            loads: sample_sum(text, "vllm:pdkv_load_seconds_count").unwrap_or(0.0),
            failed: sample_sum(text, "vllm:pdkv_failed_loads_total").unwrap_or(0.0),
            refused: sample_sum(text, "vllm:pdkv_refused_offers_total").unwrap_or(0.0),
        }
    }
}

/// A leg's `/metrics` page.
async fn metrics_page(client: &reqwest::Client, url: &str) -> Result<String, String> {
    client
        .get(format!("{url}/metrics"))
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .map_err(|error| format!("{url}/metrics: {error}"))?
        .text()
        .await
        .map_err(|error| format!("{url}/metrics: {error}"))
}

async fn load_counts(client: &reqwest::Client, decode_urls: &[String]) -> Result<LoadCounts, String> {
    let mut total = LoadCounts::default();
    for url in decode_urls {
        let text = metrics_page(client, url).await?;
        let counts = LoadCounts::from_metrics(&text);
        total.planned_tokens += counts.planned_tokens;
        total.loads += counts.loads;
        total.failed += counts.failed;
    }
    Ok(total)
}

/// How long a load's outcome may take to reach the decode leg's `/metrics` after the answer
/// (vLLM exports connector stats with an engine step's output).
const LOAD_STATS_BOUND: Duration = Duration::from_secs(2);

/// The loads that happened since `before`: planned tokens, and whether the load completed
/// (`None` when none was planned). Waits (bounded) for the outcome of a planned load.
async fn loads_since(
    client: &reqwest::Client,
    decode_urls: &[String],
    before: LoadCounts,
) -> Option<(u64, Option<bool>)> {
    let deadline = Instant::now() + LOAD_STATS_BOUND;
    loop {
        let after = load_counts(client, decode_urls).await.ok()?;
        let planned = (after.planned_tokens - before.planned_tokens).max(0.0) as u64;
        let (loads, failed) = (after.loads - before.loads, after.failed - before.failed);
        if planned == 0 || loads > 0.0 || failed > 0.0 || Instant::now() >= deadline {
            let outcome =
                (planned > 0 || loads > 0.0 || failed > 0.0).then_some(loads > 0.0 && failed == 0.0);
            return Some((planned, outcome));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A leg's idleness: requests running plus waiting, and KV cache usage.
async fn leg_load(client: &reqwest::Client, url: &str) -> Result<(f64, f64), String> {
    let text = metrics_page(client, url).await?;
    let requests = sample_sum(&text, "vllm:num_requests_running").unwrap_or(0.0)
        + sample_sum(&text, "vllm:num_requests_waiting").unwrap_or(0.0);
    Ok((
        requests,
        sample_sum(&text, "vllm:kv_cache_usage_perc").unwrap_or(0.0),
    ))
}

/// Runs the sweep over a vLLM cluster.
pub fn run(
    args: &SweepArgs,
    cluster: VllmCluster,
    config_text: String,
    lengths: Vec<u64>,
) -> anyhow::Result<ExitCode> {
    if args.in_process || args.links.is_some() || args.pairing.is_some() {
        bail!(
            "--in-process, --links and --pairing are the reference engine's; vLLM legs run as processes and pair anchored"
        );
    }
    let (run_dir, temporary) = crate::sweep_cmd::sweep_run_dir(args);
    std::fs::create_dir_all(&run_dir).with_context(|| format!("cannot create {}", run_dir.display()))?;
    let ready = Duration::from_secs_f64(args.ready_timeout.unwrap_or(600.0));
    let (launched, router_url, legs) = match &args.router {
        Some(url) => (
            None,
            url.trim_end_matches('/').to_string(),
            crate::sweep_cmd::parse_legs(&args.legs)?,
        ),
        None => {
            let mut options = crate::launch_cmd::options(None, run_dir.clone(), ready.as_secs_f64())?;
            options.config_text = config_text;
            if let Some(path) = &args.config {
                options.config_name = path.display().to_string();
            }
            let launched = crate::launch::Cluster::launch(&options)?;
            let legs = launched
                .members
                .iter()
                .filter(|member| member.name != ROUTER_NODE)
                .map(|member| (member.name.clone(), member.admin_url.clone()))
                .collect();
            let url = launched.router_url.clone();
            (Some(launched), url, legs)
        }
    };
    let oracle_server = match &args.oracle {
        Oracle::Plain => Some(start_plain(&cluster, &run_dir, ready)?),
        _ => None,
    };
    let oracle_url = match (&args.oracle, &oracle_server) {
        (Oracle::Url(url), _) => url.clone(),
        (_, Some(server)) => server.url.clone(),
        _ => cluster
            .nodes
            .iter()
            .find(|node| node.role == Role::Prefill)
            .map(|node| node.http_url())
            .context("no prefill leg to ask")?,
    };
    let decode_names: Vec<String> = cluster
        .nodes
        .iter()
        .filter(|node| node.role == Role::Decode)
        .map(|node| node.name.0.clone())
        .collect();
    let decode_urls: Vec<String> = legs
        .iter()
        .filter(|(name, _)| decode_names.contains(name))
        .map(|(_, url)| url.clone())
        .collect();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let started = Instant::now();
    let timeout = Duration::from_millis(cluster.limits.request_timeout_ms + 5000);
    let idle_bound = Duration::from_millis(cluster.limits.lease_ms) + Duration::from_secs(5);
    let (rows, idle) = runtime.block_on(async {
        let client = reqwest::Client::new();
        let model = cluster.engine.served_model_name.clone();
        let sends: Vec<(u64, u32)> = lengths
            .iter()
            .flat_map(|&length| (0..if args.repeat { 2 } else { 1 }).map(move |send| (length, send)))
            .collect();
        let one = |(length, send): (u64, u32)| {
            let (client, model, router_url, oracle_url, decode_urls) = (
                client.clone(),
                model.clone(),
                router_url.clone(),
                oracle_url.clone(),
                decode_urls.clone(),
            );
            let sequential = args.concurrency == 1;
            let (max_tokens, logprobs, tolerance) = (args.max_tokens, args.logprobs, args.logprob_tolerance);
            let last_token = args.last_token;
            async move {
                let mut prompt = prompt(length);
                // `--last-token decode`: the oracle answers the prompt without its last token,
                // one token more; that first token becomes the prompt's last (below).
                let early = match last_token {
                    LastToken::Decode if length >= 2 => {
                        let shorter = &prompt[..prompt.len() - 1];
                        let early = complete(
                            &client,
                            &oracle_url,
                            &body(&model, shorter, max_tokens + 1, logprobs),
                            timeout,
                        )
                        .await;
                        match early.as_ref().map(first_token) {
                            Ok(Some(token)) => {
                                prompt = [shorter, &[token]].concat();
                                Some(early)
                            }
                            Ok(None) => Some(Err(format!("{oracle_url}: an answer without token ids"))),
                            Err(_) => Some(early),
                        }
                    }
                    _ => None,
                };
                let body = body(&model, &prompt, max_tokens, logprobs);
                let before = if sequential {
                    load_counts(&client, &decode_urls).await.ok()
                } else {
                    None
                };
                let ours = complete(&client, &router_url, &body, timeout).await;
                let loads = match before {
                    Some(before) => loads_since(&client, &decode_urls, before).await,
                    None => None,
                };
                let (read_tokens, loaded) = match loads {
                    Some((planned, outcome)) => (Some(planned), outcome),
                    None => (None, None),
                };
                let theirs = match early {
                    Some(early) => early.map(|answer| without_first_token(&answer)),
                    None => complete(&client, &oracle_url, &body, timeout).await,
                };
                let (matched, error, difference, largest_difference) = match (ours, theirs) {
                    (Ok(ours), Ok(theirs)) => {
                        let largest = largest_logprob_difference(&ours, &theirs);
                        match difference(&ours, &theirs, tolerance) {
                            None => (true, None, None, largest),
                            Some(where_) => (false, None, Some(where_), largest),
                        }
                    }
                    (Err(error), _) => (false, Some(format!("p/d: {error}")), None, 0.0),
                    (_, Err(error)) => (false, Some(format!("oracle: {error}")), None, 0.0),
                };
                Row {
                    prompt_tokens: length,
                    send,
                    matched,
                    error,
                    read_tokens,
                    loaded,
                    difference,
                    largest_difference,
                }
            }
        };
        let mut rows: Vec<Row> = Vec::with_capacity(sends.len());
        if args.repeat {
            // A prompt's second send must follow its first (the decode's prefix cache then
            // holds it): all first sends, then all second sends.
            for round in 0..2 {
                let batch: Vec<(u64, u32)> =
                    sends.iter().copied().filter(|(_, send)| *send == round).collect();
                let mut stream = futures_util::stream::iter(batch)
                    .map(&one)
                    .buffered(args.concurrency as usize);
                while let Some(row) = stream.next().await {
                    print_row(&row, args.json);
                    rows.push(row);
                }
            }
        } else {
            let mut stream = futures_util::stream::iter(sends)
                .map(&one)
                .buffered(args.concurrency as usize);
            while let Some(row) = stream.next().await {
                print_row(&row, args.json);
                rows.push(row);
            }
        }
        let deadline = Instant::now() + idle_bound;
        let idle = loop {
            let mut loads = Vec::new();
            for (name, url) in &legs {
                loads.push((name.clone(), leg_load(&client, url).await));
            }
            let all_idle = loads.iter().all(|(_, load)| {
                load.as_ref()
                    .is_ok_and(|(requests, usage)| *requests == 0.0 && *usage == 0.0)
            });
            if all_idle || Instant::now() >= deadline {
                break loads;
            }
            tokio::time::sleep(IDLE_POLL).await;
        };
        (rows, idle)
    });
    let elapsed = started.elapsed();
    drop(oracle_server);
    if let Some(mut launched) = launched {
        launched.stop();
    }
    let matched = rows.iter().filter(|row| row.matched).count();
    let legs_idle = idle.iter().all(|(_, load)| {
        load.as_ref()
            .is_ok_and(|(requests, usage)| *requests == 0.0 && *usage == 0.0)
    });
    let read: u64 = rows.iter().filter_map(|row| row.read_tokens).sum();
    let failed_loads = rows.iter().filter(|row| row.loaded == Some(false)).count();
    let largest_difference = rows.iter().map(|row| row.largest_difference).fold(0.0, f64::max);
    let failed: Vec<u64> = rows
        .iter()
        .filter(|row| !row.matched)
        .map(|row| row.prompt_tokens)
        .collect();
    if args.json {
        crate::outln!(
            "{}",
            json!({"summary": {
                "engine": "vllm",
                "oracle": match &args.oracle { Oracle::Plain => "plain".to_string(), Oracle::Leg => "leg".to_string(), Oracle::Url(url) => url.clone() },
                "last_token": match args.last_token { LastToken::Prefill => "prefill", LastToken::Decode => "decode" },
                "requests": rows.len(),
                "matched": matched,
                "failed": failed,
                "read_tokens": read,
                "failed_loads": failed_loads,
                "largest_logprob_difference": largest_difference,
                "legs_idle": legs_idle,
                "legs": idle.iter().map(|(name, load)| (name.clone(), match load {
                    Ok((requests, usage)) => json!({"requests": requests, "kv_cache_usage": usage}),
                    Err(error) => json!({"error": error}),
                })).collect::<serde_json::Map<String, Value>>(),
                "elapsed_ms": elapsed.as_millis() as u64,
            }})
        );
    } else {
        for (name, load) in &idle {
            match load {
                Ok((requests, usage)) => crate::outln!(
                    "leg {name}: {requests} requests, KV cache {:.2}% in use{}",
                    usage * 100.0,
                    if *requests == 0.0 && *usage == 0.0 {
                        ""
                    } else {
                        "  <- NOT IDLE"
                    }
                ),
                Err(error) => crate::outln!("leg {name}: {error}"),
            }
        }
        if !failed.is_empty() {
            crate::outln!("failed at prompt lengths {failed:?}");
        }
        crate::outln!(
            "{matched}/{} match (vLLM legs through the router against the oracle, {read} prompt tokens read, logprobs within {largest_difference:.1e}, {:.1} s)",
            rows.len(),
            elapsed.as_secs_f64()
        );
    }
    let ok = matched == rows.len() && legs_idle;
    if temporary && ok {
        let _ = std::fs::remove_dir_all(&run_dir);
    } else if !ok {
        eprintln!("logs and the resolved cluster.toml are in {}", run_dir.display());
    }
    Ok(if ok { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

fn print_row(row: &Row, json_lines: bool) {
    if json_lines {
        crate::outln!(
            "{}",
            json!({
                "prompt_tokens": row.prompt_tokens,
                "send": row.send,
                "match": row.matched,
                "error": row.error,
                "difference": row.difference,
                "largest_logprob_difference": row.largest_difference,
                "read_tokens": row.read_tokens,
                "loaded": row.loaded,
            })
        );
        return;
    }
    let verdict = match (&row.error, &row.difference) {
        (Some(error), _) => format!("ERROR {error}"),
        (None, Some(difference)) => format!("MISMATCH {difference}"),
        (None, None) => "match".into(),
    };
    let read = match (row.read_tokens, row.loaded) {
        (Some(tokens), Some(false)) => format!("{tokens} (failed: recomputed)"),
        (Some(tokens), _) => tokens.to_string(),
        (None, _) => "-".into(),
    };
    crate::outln!("{:>8} {:>5} {:>8}  {verdict}", row.prompt_tokens, row.send, read);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(ids: &[u64], logprobs: &[f64], top: Value) -> Value {
        json!({"choices": [{"token_ids": ids, "logprobs": {"token_logprobs": logprobs, "top_logprobs": top}}]})
    }

    #[test]
    fn answers_differ_at_their_first_differing_token_or_logprob() {
        let top = json!([{"token_id:5": -0.5, "token_id:7": -1.5}]);
        let a = answer(&[5], &[-0.5], top.clone());
        assert_eq!(difference(&a, &a, 0.0), None);
        assert!(
            difference(&a, &answer(&[7], &[-0.5], top.clone()), 0.0)
                .unwrap()
                .starts_with("token ids")
        );
        let shifted = answer(&[5], &[-0.5000001], top.clone());
        assert!(difference(&a, &shifted, 0.0).unwrap().contains("logprob"));
        assert_eq!(difference(&a, &shifted, 1e-6), None);
        let other_top = answer(&[5], &[-0.5], json!([{"token_id:5": -0.5, "token_id:9": -1.5}]));
        assert!(difference(&a, &other_top, 1.0).unwrap().contains("top logprobs"));
        assert!((largest_logprob_difference(&a, &shifted) - 1e-7).abs() < 1e-9);
        assert_eq!(largest_logprob_difference(&a, &a), 0.0);
        let no_ids = json!({"choices": [{"text": "x"}]});
        assert!(
            difference(&no_ids, &no_ids, 0.0).is_some(),
            "answers without token ids never match"
        );
    }

    #[test]
    fn an_answer_without_its_first_token_is_the_answer_one_token_later() {
        let two = json!({"choices": [{
            "text": "ab",
            "token_ids": [5, 7],
            "logprobs": {
                "token_logprobs": [-0.5, -1.25],
                "top_logprobs": [{"token_id:5": -0.5}, {"token_id:7": -1.25}],
                "tokens": ["token_id:5", "token_id:7"],
                "text_offset": [0, 1],
            },
        }]});
        assert_eq!(first_token(&two), Some(5));
        let later = without_first_token(&two);
        let one = answer(&[7], &[-1.25], json!([{"token_id:7": -1.25}]));
        assert_eq!(difference(&later, &one, 0.0), None);
        assert_eq!(later["choices"][0]["logprobs"]["tokens"], json!(["token_id:7"]));
        assert_eq!(later["choices"][0]["logprobs"]["text_offset"], json!([1]));
        assert_eq!(first_token(&json!({"choices": [{"text": "x"}]})), None);
        // Nothing to drop leaves the answer as it was.
        let empty = json!({"choices": [{"token_ids": []}]});
        assert_eq!(without_first_token(&empty), empty);
    }

    #[test]
    fn prompts_share_no_prefix_and_stay_in_every_vocabulary() {
        let (a, b) = (prompt(64), prompt(65));
        assert_ne!(a[..32], b[..32]);
        assert!(a.iter().chain(&b).all(|&token| (1..=255).contains(&token)));
        assert_eq!(prompt(64), a, "seeded by the length");
    }

    #[test]
    fn oracles_parse_by_name_or_url() {
        assert_eq!("plain".parse(), Ok(Oracle::Plain));
        assert_eq!("leg".parse(), Ok(Oracle::Leg));
        assert_eq!("http://h:1/".parse(), Ok(Oracle::Url("http://h:1".into())));
        assert!("ftp://h".parse::<Oracle>().is_err());
    }
}
