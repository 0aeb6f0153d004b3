//! `pdkv chaos` for a cluster of vLLM legs: the same launcher, relays, seeded fault schedule
//! and conductor as for pdkv's own legs, with a plain vLLM instance of the same weights as the
//! oracle.
//!
//! Relays sit on the links vLLM legs have: the router's HTTP to every leg (TCP), and each
//! prefill leg's connector, its control plane (UDP, QUIC) and its memory server (TCP), which the
//! prefill advertises in its `kv_transfer_params` (`advertise_control_port` and
//! `advertise_data_port` in its view of the cluster). With several decode legs, a prefill's
//! connector relays are shared by all of them, so a partition of that link (or a kill at the
//! READ) acts on every decoder; the schedule names the first decode leg as its other end.
//!
//! Each request is the sweep's (greedy, fixed length, top-5 logprobs); an answer is **ok** when
//! its token ids and logprobs equal the oracle's (within `--logprob-tolerance`), **wrong** when
//! they differ, a **clean error** when the router answered an error status in time, **hung**
//! when nothing came by the deadline, **broken** when the connection to the router failed.
//! After the load every fault is healed, killed legs are back, 8 requests must be ok, and every
//! leg must be idle: no request running or waiting, its KV cache usage back to zero (hand-offs
//! released or lapsed within `lease_ms`).

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::Path;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use pdkv_actors::config::{AnyCluster, ROUTER_NODE};
use pdkv_actors::engines::VllmCluster;
use pdkv_actors::node::resolve;
use pdkv_core::wire::Role;
use rand_chacha::ChaCha8Rng;
use rand_core::{RngCore, SeedableRng};
use serde_json::{Value, json};

use super::conductor::Conductor;
use super::observe::Watcher;
use super::relay::Relay;
use super::schedule::{self, Timing, Topology};
use super::wiring::Relays;
use super::{ANSWER_SLACK, ChaosArgs, ERROR_BACKOFF, PROBES, WATCH_EVERY};
use crate::launch::{Cluster, LaunchOptions, http_agent};

/// How a vLLM answer compares with the oracle's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Ok,
    Wrong,
    CleanError,
    Hung,
    Broken,
}

/// One request of the load.
#[derive(Debug, Clone)]
struct Sample {
    prompt: usize,
    latency_s: f64,
    answer: Result<Value, (bool, String)>,
}

/// Sends one request to the router and times it.
fn send(agent: &ureq::Agent, router: &str, body: &Value, prompt: usize) -> Sample {
    let started = Instant::now();
    let answer = match agent.post(format!("{router}/v1/completions")).send_json(body) {
        Ok(mut response) => {
            let status = response.status().as_u16();
            match response.body_mut().read_json::<Value>() {
                Ok(answer) if status == 200 => Ok(answer),
                Ok(answer) => Err((
                    true,
                    format!(
                        "{status}: {}",
                        answer["error"]["message"].as_str().unwrap_or("no message")
                    ),
                )),
                Err(error) => Err((status != 200, format!("{status}: {error}"))),
            }
        }
        Err(error) => Err((false, error.to_string())),
    };
    Sample {
        prompt,
        latency_s: started.elapsed().as_secs_f64(),
        answer,
    }
}

fn classify(sample: &Sample, oracle: &Value, deadline: Duration, tolerance: f64) -> Outcome {
    let late = sample.latency_s > deadline.as_secs_f64();
    match &sample.answer {
        _ if late => Outcome::Hung,
        Ok(answer) => match crate::vllm_sweep::difference(answer, oracle, tolerance) {
            None => Outcome::Ok,
            Some(_) => Outcome::Wrong,
        },
        Err((true, _)) => Outcome::CleanError,
        Err((false, _)) => Outcome::Broken,
    }
}

/// The relays of a vLLM cluster (see the module documentation), keyed as the conductor looks
/// them up: `(router, leg)` for HTTP, `(first decode leg, prefill leg)` for the connector.
fn start_relays(config: &VllmCluster, runtime: &tokio::runtime::Handle, seed: u64) -> anyhow::Result<Relays> {
    let mut relays = Relays {
        control: BTreeMap::new(),
        data: BTreeMap::new(),
    };
    let decode = config
        .nodes
        .iter()
        .find(|node| node.role == Role::Decode)
        .map(|node| node.name.0.clone())
        .context("no decode leg")?;
    for (index, node) in config.nodes.iter().enumerate() {
        let seed = seed ^ ((index as u64 + 1) << 8);
        let at = |port: u16| resolve(&node.address.host, port).map_err(anyhow::Error::msg);
        let listen = |target: SocketAddr| SocketAddr::new(target.ip(), 0);
        let http = at(node.address.admin_port)?;
        let relay = Relay::tcp(runtime, listen(http), http, seed)
            .with_context(|| format!("cannot start the relay router -> {}", node.name))?;
        relays
            .control
            .insert((ROUTER_NODE.to_string(), node.name.0.clone()), relay);
        if node.role == Role::Prefill {
            let control = at(node.address.control_port)?;
            let relay = Relay::udp(runtime, listen(control), control, seed ^ 1)
                .with_context(|| format!("cannot start the connector relay {decode} -> {}", node.name))?;
            relays
                .control
                .insert((decode.clone(), node.name.0.clone()), relay);
            let data = at(node.address.data_port)?;
            let relay = Relay::tcp(runtime, listen(data), data, seed ^ 2)
                .with_context(|| format!("cannot start the data relay {decode} -> {}", node.name))?;
            relays.data.insert((decode.clone(), node.name.0.clone()), relay);
        }
    }
    Ok(relays)
}

/// The views: the router reaches every leg at its HTTP relay; each prefill leg advertises its
/// connector relays. Returns member name → view path.
fn write_views(config_path: &Path, relays: &Relays) -> anyhow::Result<BTreeMap<String, std::path::PathBuf>> {
    let doc: toml::Table = std::fs::read_to_string(config_path)?.parse()?;
    let port = |relay: &Relay| toml::Value::Integer(i64::from(relay.listen.port()));
    let mut views = BTreeMap::new();
    let mut router = doc.clone();
    let mut prefills: Vec<(String, toml::Table)> = Vec::new();
    if let Some(toml::Value::Array(nodes)) = router.get_mut("nodes") {
        for node in nodes.iter_mut().filter_map(toml::Value::as_table_mut) {
            let name = node
                .get("name")
                .and_then(toml::Value::as_str)
                .unwrap_or_default()
                .to_string();
            if let Some(relay) = relays.control.get(&(ROUTER_NODE.to_string(), name.clone())) {
                node.insert("admin_port".into(), port(relay));
            }
        }
    }
    views.insert(ROUTER_NODE.to_string(), router);
    for ((_, to), relay) in relays.control.iter().filter(|((from, _), _)| from != ROUTER_NODE) {
        let mut view = doc.clone();
        if let Some(toml::Value::Array(nodes)) = view.get_mut("nodes") {
            for node in nodes.iter_mut().filter_map(toml::Value::as_table_mut) {
                if node.get("name").and_then(toml::Value::as_str) == Some(to.as_str()) {
                    node.insert("advertise_control_port".into(), port(relay));
                    let data = relays.data.iter().find(|((_, prefill), _)| prefill == to);
                    if let Some((_, data)) = data {
                        node.insert("advertise_data_port".into(), port(data));
                    }
                }
            }
        }
        prefills.push((to.clone(), view));
    }
    views.extend(prefills);
    views
        .into_iter()
        .map(|(member, view)| {
            let path = config_path.with_file_name(format!("view-{member}.toml"));
            std::fs::write(
                &path,
                format!(
                    "# Written by pdkv chaos: the cluster as {member} sees it, its links behind relays.\n{}",
                    toml::to_string(&view)?
                ),
            )?;
            AnyCluster::from_file(&path)
                .with_context(|| format!("the view {} is not valid", path.display()))?;
            Ok((member, path))
        })
        .collect()
}

/// A leg's requests in flight and KV cache usage, from its `/metrics`, or why they are unknown.
type LegLoad = Result<(f64, f64), String>;

/// A leg's requests in flight and KV cache usage, from its `/metrics`.
fn leg_load(agent: &ureq::Agent, url: &str) -> LegLoad {
    let text = agent
        .get(format!("{url}/metrics"))
        .call()
        .map_err(|error| error.to_string())?
        .body_mut()
        .read_to_string()
        .map_err(|error| error.to_string())?;
    let sum = |name| crate::client::sample_sum(&text, name).unwrap_or(0.0);
    Ok((
        sum("vllm:num_requests_running") + sum("vllm:num_requests_waiting"),
        sum("vllm:kv_cache_usage_perc"),
    ))
}

/// Runs `pdkv chaos` over vLLM legs.
pub(super) fn run(args: &ChaosArgs, mut options: LaunchOptions, lengths: &[u64]) -> anyhow::Result<ExitCode> {
    let (run_dir, temporary) = match &args.run_dir {
        Some(dir) => (dir.clone(), false),
        None => (
            std::env::temp_dir().join(format!("pdkv-chaos-{}-{}", std::process::id(), args.seed)),
            true,
        ),
    };
    options.run_dir = run_dir.clone();
    let config_path = crate::launch::prepare_run_dir(&options.config_text, &options.config_name, &run_dir)?;
    let AnyCluster::Vllm(config) = AnyCluster::from_file(&config_path)? else {
        bail!("the resolved cluster is not one of vLLM legs");
    };
    let ready = Duration::from_secs_f64(args.ready_timeout.unwrap_or(600.0));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("pdkv-relay")
        .enable_all()
        .build()
        .context("cannot start the relays' runtime")?;
    let relays = start_relays(&config, runtime.handle(), args.seed)?;
    let views = write_views(&config_path, &relays)?;
    eprintln!("chaos: starting the oracle and the cluster");
    let oracle = crate::vllm_sweep::start_plain(&config, &run_dir, ready)?;
    let mut rng = ChaCha8Rng::seed_from_u64(args.seed ^ 0x005E_ED0F_C4A0);
    let model = config.engine.served_model_name.clone();
    let bodies: Vec<Value> = (0..args.prompts)
        .map(|_| {
            let length = lengths[(rng.next_u64() % lengths.len() as u64) as usize];
            let prompt: Vec<u64> = (0..length).map(|_| 1 + u64::from(rng.next_u32() % 255)).collect();
            crate::vllm_sweep::body(&model, &prompt, args.max_tokens, 5)
        })
        .collect();
    let oracle_agent = http_agent(Duration::from_millis(config.limits.request_timeout_ms));
    let expected: Vec<Value> = bodies
        .iter()
        .map(|body| {
            let mut response = oracle_agent
                .post(format!("{}/v1/completions", oracle.url()))
                .send_json(body)
                .context("the oracle did not answer")?;
            response
                .body_mut()
                .read_json::<Value>()
                .context("the oracle's answer")
        })
        .collect::<anyhow::Result<_>>()?;
    drop(oracle);
    let mut cluster = Cluster::start(&options, config_path, &views)?;
    let detect =
        Duration::from_millis(config.failure.heartbeat_ms * u64::from(config.failure.heartbeat_misses));
    let lease = Duration::from_millis(config.limits.lease_ms);
    let duration = Duration::from_secs_f64(args.duration);
    let timing = Timing {
        mean_gap: Duration::from_secs_f64(args.fault_interval),
        lease,
        detect,
        margin: Duration::from_secs_f64((args.duration / 10.0).clamp(0.5, 5.0)),
    };
    let topology = Topology {
        legs: config.nodes.iter().map(|node| node.name.0.clone()).collect(),
        links: relays.control.keys().cloned().collect(),
        reads: relays.data.keys().cloned().collect(),
    };
    let faults = schedule::plan(args.seed, duration, &args.faults, &topology, timing);
    eprintln!(
        "chaos: {} faults over {:.0} s, seed {}; logs in {}",
        faults.len(),
        args.duration,
        args.seed,
        run_dir.display()
    );
    let deadline = Duration::from_millis(config.limits.request_timeout_ms) + ANSWER_SLACK;
    let watcher = Watcher::start(&[(ROUTER_NODE.to_string(), cluster.router_url.clone())]);
    let run_start = Instant::now();
    let router_url = cluster.router_url.clone();
    let samples = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let bodies = Arc::new(bodies);
    let clients: Vec<std::thread::JoinHandle<()>> = (0..args.concurrency)
        .map(|client| {
            let (samples, stop, router, bodies) =
                (samples.clone(), stop.clone(), router_url.clone(), bodies.clone());
            let seed = args.seed;
            std::thread::spawn(move || {
                let agent = http_agent(deadline + Duration::from_secs(3));
                let mut rng = ChaCha8Rng::seed_from_u64(seed ^ (u64::from(client) << 32));
                while !stop.load(Ordering::Relaxed) {
                    let index = (rng.next_u64() % bodies.len() as u64) as usize;
                    let sample = send(&agent, &router, &bodies[index], index);
                    if sample.answer.is_err() {
                        std::thread::sleep(ERROR_BACKOFF);
                    }
                    samples
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .push(sample);
                }
            })
        })
        .collect();
    let detect_window = detect + WATCH_EVERY * 4;
    let mut conductor = Conductor {
        cluster: &mut cluster,
        relays: &relays,
        start: run_start,
        pids: Arc::default(),
        expected: Arc::default(),
        down: HashMap::new(),
        records: Vec::new(),
        active: Vec::new(),
        unexpected: Vec::new(),
        restarts: 0,
        restart_after: detect * 2,
        detect_window,
    };
    conductor.refresh_pids();
    conductor.run_schedule(&faults, &watcher, duration)?;
    stop.store(true, Ordering::Relaxed);
    // Every stopped leg starts again (a vLLM leg takes its start-up time to serve).
    let restart_deadline = Instant::now() + deadline + conductor.restart_after + Duration::from_secs(5);
    conductor.settle(&watcher, restart_deadline, || {
        clients.iter().all(std::thread::JoinHandle::is_finished)
    })?;
    let load_elapsed = run_start.elapsed();
    for client in clients {
        let _ = client.join();
    }
    let samples = std::mem::take(&mut *samples.lock().unwrap_or_else(PoisonError::into_inner));
    let ready = conductor
        .cluster
        .wait_ready(ready)
        .map_err(|error| format!("{error:#}"));
    let probe_agent = http_agent(deadline + Duration::from_secs(3));
    let probes: Vec<Outcome> = (0..PROBES)
        .map(|index| {
            let prompt = index % bodies.len();
            let sample = send(&probe_agent, &router_url, &bodies[prompt], prompt);
            classify(&sample, &expected[prompt], deadline, args.logprob_tolerance)
        })
        .collect();
    let idle_bound = lease + detect * 2 + Duration::from_secs(5);
    let idle_deadline = Instant::now() + idle_bound;
    let metrics_agent = http_agent(Duration::from_secs(5));
    let legs: Vec<(String, String)> = config
        .nodes
        .iter()
        .map(|node| (node.name.0.clone(), node.http_url()))
        .collect();
    let loads = loop {
        let loads: Vec<(String, LegLoad)> = legs
            .iter()
            .map(|(name, url)| (name.clone(), leg_load(&metrics_agent, url)))
            .collect();
        let idle = loads.iter().all(|(_, load)| matches!(load, Ok((0.0, 0.0))));
        if idle || Instant::now() >= idle_deadline {
            break loads;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    watcher.stop();
    let records = std::mem::take(&mut conductor.records);
    let unexpected = std::mem::take(&mut conductor.unexpected);
    let restarts = conductor.restarts;
    drop(conductor);
    cluster.stop();
    let outcomes: Vec<Outcome> = samples
        .iter()
        .map(|sample| classify(sample, &expected[sample.prompt], deadline, args.logprob_tolerance))
        .collect();
    let count = |outcome: Outcome| outcomes.iter().filter(|seen| **seen == outcome).count();
    let probes_ok = probes.iter().filter(|outcome| **outcome == Outcome::Ok).count();
    let legs_idle = loads.iter().all(|(_, load)| matches!(load, Ok((0.0, 0.0))));
    let mut errors: BTreeMap<String, usize> = BTreeMap::new();
    for sample in &samples {
        if let Err((_, message)) = &sample.answer {
            *errors.entry(super::report::error_kind(message)).or_default() += 1;
        }
    }
    let pass = count(Outcome::Wrong) == 0
        && count(Outcome::Hung) == 0
        && count(Outcome::Broken) == 0
        && probes_ok == probes.len()
        && legs_idle
        && unexpected.is_empty()
        && ready.is_ok();
    let report = json!({
        "engine": "vllm",
        "config": options.config_name,
        "seed": args.seed,
        "duration_s": load_elapsed.as_secs_f64(),
        "requests": samples.len(),
        "ok": count(Outcome::Ok),
        "wrong": count(Outcome::Wrong),
        "clean_errors": count(Outcome::CleanError),
        "hung": count(Outcome::Hung),
        "broken": count(Outcome::Broken),
        "errors": errors,
        "faults": records.iter().map(|record| json!({
            "kind": record.fault.kind.name(),
            "node": record.fault.node,
            "peer": record.fault.peer,
            "at_s": record.fault.at.as_secs_f64(),
            "hold_s": record.fault.hold.as_secs_f64(),
            "fired": record.origin().is_some(),
        })).collect::<Vec<_>>(),
        "restarts": restarts,
        "unexpected_exits": unexpected,
        "ready_after": ready.err(),
        "probes": probes.len(),
        "recovered_probes": probes_ok,
        "legs_idle": legs_idle,
        "legs": loads.iter().map(|(name, load)| (name.clone(), match load {
            Ok((requests, usage)) => json!({"requests": requests, "kv_cache_usage": usage}),
            Err(error) => json!({"error": error}),
        })).collect::<serde_json::Map<String, Value>>(),
        "pass": pass,
    });
    if args.json {
        crate::outln!("{report}");
    } else {
        crate::outln!(
            "chaos (vLLM legs): {} requests: {} ok, {} wrong, {} clean errors, {} hung, {} broken; {} faults, {} restarts; probes {}/{}; legs idle: {legs_idle}{}",
            samples.len(),
            count(Outcome::Ok),
            count(Outcome::Wrong),
            count(Outcome::CleanError),
            count(Outcome::Hung),
            count(Outcome::Broken),
            records.len(),
            restarts,
            probes_ok,
            probes.len(),
            if pass { "" } else { "  FAIL" }
        );
        for (kind, count) in &errors {
            crate::outln!("  {count:>5} × {kind}");
        }
    }
    if pass && temporary {
        let _ = std::fs::remove_dir_all(&run_dir);
    } else if !pass {
        eprintln!("chaos: logs and configs are in {}", run_dir.display());
    }
    Ok(if pass {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
