//! `pdkv chaos`: launch a cluster as local processes with a fault-injecting relay on every
//! link, drive load through the router, inject seeded faults, and check every answer against
//! the direct output computed here.
//!
//! Each node runs its own view of the cluster.toml, in which every peer it dials is reached
//! through a relay of its own (one per directed link: UDP for the QUIC control link, TCP for a
//! decode leg's data connection to a prefill leg), so a fault can act on one link. Faults come
//! from a seeded schedule ([`schedule::plan`]); `pdkv chaos` is also the launcher, so it
//! restarts a killed leg itself (after the fault's hold) and counts any exit it did not cause.
//!
//! A request is **ok** when its tokens and logits digest equal the direct run's, **wrong** when
//! it answered something else, a **clean error** when the router answered an error by the
//! request's deadline, **hung** when nothing came by then, **broken** when the connection to the
//! router failed. After the load, every fault is healed, the cluster must serve again, and every
//! leg must hold no blocks, grants or requests once leases lapse: anything left is **leaked**.
//! The exit status is non-zero on any wrong, hung, broken or leaked, on a node exiting on its
//! own, or on a cluster that does not recover.

mod conductor;
mod observe;
pub mod relay;
mod report;
pub mod schedule;
mod vllm;
mod wiring;

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};
use pdkv_actors::cluster::LocalCluster;
use pdkv_actors::config::{ClusterConfig, LinkKind, ROUTER_NODE, ReadEngineKind};
use pdkv_actors::deployment::Launch;
use pdkv_actors::engine::prompt_tokens;
use rand_chacha::ChaCha8Rng;
use rand_core::{RngCore, SeedableRng};
use serde_json::Value;

use crate::launch::{Cluster, http_agent};
use crate::load_cmd::{Sample, complete};
use conductor::Conductor;
use observe::Watcher;
use report::{Outcome, Report, classify, plot, print_report};
use schedule::{FaultKind, Timing};
use wiring::{start_relays, topology, write_views};

/// How often the conductor looks at processes, faults and readiness.
const TICK: Duration = Duration::from_millis(10);

/// How often each node's `/ready` is read to see links drop and come back.
const WATCH_EVERY: Duration = Duration::from_millis(50);

/// Slack on top of the router's request deadline for an error to reach the client.
const ANSWER_SLACK: Duration = Duration::from_secs(2);

/// How long after a fault ends its links are watched for coming back.
const RECOVERY_BOUND: Duration = Duration::from_secs(30);

/// A client's pause after an error, as a sane client backs off (and so errors that come at
/// once are not counted by the thousand).
const ERROR_BACKOFF: Duration = Duration::from_millis(20);

/// Requests sent after the faults, all of which must succeed.
const PROBES: usize = 8;

/// `--read-engine` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ReadEngineArg {
    /// The network engine: READs cross a TCP relay, so data links can fail too.
    Net,
    /// Shared memory: READs bypass the network (only control links can fail).
    Shm,
}

/// Arguments of `pdkv chaos`.
#[derive(Debug, Args)]
pub struct ChaosArgs {
    /// cluster.toml to launch (default: the embedded copy of the shipped one). Every node must
    /// be `launch = "local"`.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Seconds of load (faults happen inside it).
    #[arg(long, default_value_t = 30.0)]
    pub duration: f64,
    /// Seed of the fault schedule, the relays' losses and the prompts.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Fault kinds to inject (default: all).
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = FaultKind::ALL)]
    pub faults: Vec<FaultKind>,
    /// Mean seconds between one fault's end and the next one's start.
    #[arg(long, default_value_t = 1.0)]
    pub fault_interval: f64,
    /// Clients, each with one request outstanding.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=256))]
    pub concurrency: u32,
    /// Prompt lengths to draw from, as for `pdkv sweep`.
    #[arg(long, default_value = "16..512")]
    pub lengths: String,
    /// Distinct prompts (their direct outputs are computed once, before the run).
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub prompts: u32,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=256))]
    pub max_tokens: u32,
    /// READ engine between the legs (overrides `[transport] read_engine`).
    #[arg(long, value_enum, default_value_t = ReadEngineArg::Net)]
    pub read_engine: ReadEngineArg,
    /// Print the report as one JSON object.
    #[arg(long)]
    pub json: bool,
    /// Draw requests and faults on a time line into this SVG file.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Run directory for the configs, certificates and logs (default: a fresh one under the
    /// system's temporary directory, removed when the run passes).
    #[arg(long)]
    pub run_dir: Option<PathBuf>,
    /// Seconds the cluster has to become ready, at launch and after the faults (default 30;
    /// 600 for vLLM legs).
    #[arg(long)]
    pub ready_timeout: Option<f64>,
    /// vLLM legs: largest difference of log-probabilities to the oracle still equal.
    #[arg(long, default_value_t = 1e-4)]
    pub logprob_tolerance: f64,
}

/// One prompt of the pool and its direct output.
struct Reference {
    prompt: Vec<u32>,
    /// How it is asked for: every other prompt sampled ([`pdkv_actors::sweep::sampling_for`]).
    sampling: pdkv_core::sampling::Sampling,
    tokens: Vec<u32>,
    logits_digest: u64,
}

/// The cluster.toml text with the chaos run's overrides.
fn chaos_config_text(text: &str, name: &str, read_engine: ReadEngineArg) -> anyhow::Result<String> {
    let mut doc: toml::Table = text.parse().with_context(|| format!("{name} is not TOML"))?;
    let transport = doc
        .entry("transport")
        .or_insert_with(|| toml::Value::Table(toml::Table::new()))
        .as_table_mut()
        .with_context(|| format!("{name}: [transport] must be a table"))?;
    let engine = match read_engine {
        ReadEngineArg::Net => "net",
        ReadEngineArg::Shm => "shm",
    };
    transport.insert("read_engine".into(), toml::Value::String(engine.into()));
    Ok(toml::to_string(&doc)?)
}

/// The prompt pool and each prompt's direct output, computed by one leg in this process.
fn references(
    config: &ClusterConfig,
    lengths: &[u64],
    prompts: u32,
    max_tokens: u32,
    seed: u64,
) -> anyhow::Result<Vec<Reference>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x005E_ED0F_C4A0);
    let pool: Vec<Vec<u32>> = (0..prompts)
        .map(|index| {
            let length = lengths[(rng.next_u64() % lengths.len() as u64) as usize];
            prompt_tokens(
                seed.wrapping_mul(1_000_003).wrapping_add(u64::from(index)),
                length as usize,
                config.model.vocab,
            )
        })
        .collect();
    let vocab = config.model.vocab;
    let mut reference = config.clone();
    reference.transport.read_engine = ReadEngineKind::Local;
    reference.transport.links = LinkKind::Local;
    let system = actix::System::new();
    system.block_on(async move {
        let direct = LocalCluster::start(reference)
            .await
            .context("cannot start the in-process reference leg")?;
        let mut references = Vec::with_capacity(pool.len());
        for (index, prompt) in pool.into_iter().enumerate() {
            let sampling = pdkv_actors::sweep::sampling_for(index as u64, vocab);
            let output = direct
                .direct_sampled(prompt.clone(), max_tokens, sampling.clone(), None)
                .await
                .map_err(|error| anyhow::anyhow!("direct run: {error}"))?;
            references.push(Reference {
                prompt,
                sampling,
                tokens: output.tokens,
                logits_digest: output.logits_digest,
            });
        }
        direct.shutdown();
        Ok(references)
    })
}

/// The prompts' clients: each sends its next request when the last one answered.
struct Load {
    samples: Arc<Mutex<Vec<(usize, Sample)>>>,
    stop: Arc<AtomicBool>,
    clients: Vec<std::thread::JoinHandle<()>>,
}

impl Load {
    fn start(
        base: &str,
        prompts: Arc<Vec<(Vec<u32>, pdkv_core::sampling::Sampling)>>,
        args: &ChaosArgs,
        timeout: Duration,
        run_start: Instant,
    ) -> Load {
        let samples = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let clients = (0..args.concurrency)
            .map(|client| {
                let (samples, stop, base, prompts) =
                    (samples.clone(), stop.clone(), base.to_string(), prompts.clone());
                let (seed, max_tokens) = (args.seed, args.max_tokens);
                std::thread::spawn(move || {
                    let agent = http_agent(timeout);
                    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ (u64::from(client) << 32));
                    while !stop.load(Ordering::Relaxed) {
                        let index = (rng.next_u64() % prompts.len() as u64) as usize;
                        let (prompt, sampling) = &prompts[index];
                        let sample = complete(&agent, &base, prompt, max_tokens, sampling, run_start);
                        if sample.error.is_some() {
                            std::thread::sleep(ERROR_BACKOFF);
                        }
                        samples
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner)
                            .push((index, sample));
                    }
                })
            })
            .collect();
        Load {
            samples,
            stop,
            clients,
        }
    }

    /// Asks every client to stop after its current request.
    fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }

    /// Whether every client has stopped.
    fn done(&self) -> bool {
        self.clients.iter().all(std::thread::JoinHandle::is_finished)
    }

    fn collect(self) -> Vec<(usize, Sample)> {
        self.stop();
        for client in self.clients {
            let _ = client.join();
        }
        std::mem::take(&mut *self.samples.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

/// Runs `pdkv chaos`.
pub fn run(args: ChaosArgs) -> anyhow::Result<ExitCode> {
    if !(args.duration.is_finite() && args.duration > 0.0 && args.duration <= 86_400.0) {
        bail!(
            "--duration: {} is not a number of seconds in (0, 86400]",
            args.duration
        );
    }
    if !(args.fault_interval.is_finite() && args.fault_interval > 0.0 && args.fault_interval <= 3600.0) {
        bail!(
            "--fault-interval: {} is not a number of seconds in (0, 3600]",
            args.fault_interval
        );
    }
    let lengths = crate::lengths::parse_lengths(&args.lengths)
        .map_err(|error| anyhow::anyhow!("--lengths: {error}"))?;
    let ready_timeout = args
        .ready_timeout
        .unwrap_or_else(|| crate::launch_cmd::default_ready_timeout(args.config.as_ref()));
    let mut options = crate::launch_cmd::options(args.config.as_ref(), PathBuf::new(), ready_timeout)?;
    let any = pdkv_actors::config::AnyCluster::from_toml(&options.config_text)
        .with_context(|| format!("{} is not valid", options.config_name))?;
    if let Some(node) = any.placed().iter().find(|node| *node.launch != Launch::Local) {
        bail!(
            "{}: node {} is not launch = \"local\"; pdkv chaos runs every node on this machine",
            options.config_name,
            node.name
        );
    }
    if let pdkv_actors::config::AnyCluster::Vllm(_) = any {
        let args = ChaosArgs {
            ready_timeout: Some(ready_timeout),
            ..args
        };
        return vllm::run(&args, options, &lengths);
    }
    let given = ClusterConfig::from_toml(&options.config_text)
        .with_context(|| format!("{} is not valid", options.config_name))?;
    if let Some(node) = given.nodes.iter().find(|node| node.launch != Launch::Local) {
        bail!(
            "{}: node {} is not launch = \"local\"; pdkv chaos runs every node on this machine",
            options.config_name,
            node.name
        );
    }
    if let Some(&longest) = lengths.iter().max() {
        given
            .check_prompt_tokens(longest)
            .map_err(|error| anyhow::anyhow!("--lengths: {error}"))?;
    }
    options.config_text = chaos_config_text(&options.config_text, &options.config_name, args.read_engine)?;
    let (run_dir, temporary) = match &args.run_dir {
        Some(dir) => (dir.clone(), false),
        None => (
            std::env::temp_dir().join(format!("pdkv-chaos-{}-{}", std::process::id(), args.seed)),
            true,
        ),
    };
    options.run_dir = run_dir.clone();
    let config_path = crate::launch::prepare_run_dir(&options.config_text, &options.config_name, &run_dir)?;
    let config = ClusterConfig::from_file(&config_path)?;
    eprintln!("chaos: computing the direct output of {} prompts", args.prompts);
    let references = references(&config, &lengths, args.prompts, args.max_tokens, args.seed)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("pdkv-relay")
        .enable_all()
        .build()
        .context("cannot start the relays' runtime")?;
    let relays = start_relays(&config, runtime.handle(), args.seed)?;
    let views = write_views(&config_path, &relays)?;
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
    let topology = topology(&config, &relays);
    let faults = schedule::plan(args.seed, duration, &args.faults, &topology, timing);
    eprintln!(
        "chaos: {} faults over {:.0} s, seed {}; logs in {}",
        faults.len(),
        args.duration,
        args.seed,
        run_dir.display()
    );
    let deadline = Duration::from_millis(config.limits.request_timeout_ms) + ANSWER_SLACK;
    let watched: Vec<(String, String)> = cluster
        .members
        .iter()
        .map(|member| (member.name.clone(), member.admin_url.clone()))
        .collect();
    let watcher = Watcher::start(&watched);
    let run_start = Instant::now();
    let prompts = Arc::new(
        references
            .iter()
            .map(|reference| (reference.prompt.clone(), reference.sampling.clone()))
            .collect::<Vec<_>>(),
    );
    let router_url = cluster.router_url.clone();
    let load = Load::start(
        &router_url,
        prompts,
        &args,
        deadline + Duration::from_secs(3),
        run_start,
    );
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
        // Down for two detection periods: peers notice through missed heartbeats, not the
        // restarted leg's new hello.
        restart_after: detect * 2,
        detect_window: detect + WATCH_EVERY * 4,
    };
    conductor.refresh_pids();
    conductor.run_schedule(&faults, &watcher, duration)?;
    // Quiesce: no new requests, every fault healed, every stopped leg started again.
    load.stop();
    let drain_deadline = Instant::now() + deadline + Duration::from_secs(5) + conductor.restart_after;
    conductor.settle(&watcher, drain_deadline, || load.done())?;
    let load_elapsed = run_start.elapsed();
    let samples = load.collect();
    let ready = conductor
        .cluster
        .wait_ready(Duration::from_secs_f64(ready_timeout))
        .map_err(|error| format!("{error:#}"));
    // Links come back within a few readings of readiness.
    let settle = Instant::now() + WATCH_EVERY * 6;
    while Instant::now() < settle {
        conductor.reap()?;
        conductor.observe(&watcher.snapshot());
        std::thread::sleep(TICK);
    }
    let probe_client = http_agent(deadline + Duration::from_secs(3));
    let probes: Vec<(Outcome, Sample)> = (0..PROBES)
        .map(|index| {
            let reference = &references[index % references.len()];
            let sample = complete(
                &probe_client,
                &router_url,
                &reference.prompt,
                args.max_tokens,
                &reference.sampling,
                run_start,
            );
            (classify(&sample, reference, deadline), sample)
        })
        .collect();
    let legs: Vec<(String, String)> = watched
        .iter()
        .filter(|(name, _)| name != ROUTER_NODE)
        .cloned()
        .collect();
    let idle_bound = lease + detect * 2 + Duration::from_secs(2);
    let stats = crate::sweep_cmd::wait_legs_idle(&legs, config.layout.groups().len(), idle_bound);
    let retries = http_agent(Duration::from_secs(2))
        .get(format!("{router_url}/metrics"))
        .call()
        .ok()
        .and_then(|mut response| response.body_mut().read_to_string().ok())
        .and_then(|text| crate::client::sample(&text, "pdkv_retries_total", ""))
        // A counter: a whole number printed as a float.
        .map_or(0, |retries| retries.max(0.0).round() as u64);
    watcher.stop();
    let records = std::mem::take(&mut conductor.records);
    let unexpected = std::mem::take(&mut conductor.unexpected);
    let restarts = conductor.restarts;
    drop(conductor);
    cluster.stop();
    let relay_counts = relays
        .control
        .values()
        .chain(relays.data.values())
        .map(|relay| relay.faults.counts())
        .fold((0, 0), |(forwarded, dropped), (f, d)| {
            (forwarded + f, dropped + d)
        });
    let outcomes: Vec<Outcome> = samples
        .iter()
        .map(|(index, sample)| classify(sample, &references[*index], deadline))
        .collect();
    let report = Report {
        args: &args,
        config_name: &options.config_name,
        heartbeat_ms: config.failure.heartbeat_ms,
        detect,
        samples: &samples,
        outcomes: &outcomes,
        records: &records,
        run_start,
        load_elapsed,
        ready: ready.err(),
        probes: &probes,
        stats,
        retries,
        restarts,
        unexpected: &unexpected,
        relay_counts,
    }
    .build();
    if let Some(path) = &args.plot {
        plot(&samples, &outcomes, &records, run_start, path)
            .with_context(|| format!("cannot draw {}", path.display()))?;
    }
    if args.json {
        crate::outln!("{report}");
    } else {
        print_report(&report);
    }
    let passed = report["pass"] == Value::Bool(true);
    if passed && temporary {
        let _ = std::fs::remove_dir_all(&run_dir);
    } else if !passed {
        eprintln!("chaos: logs and configs are in {}", run_dir.display());
    }
    Ok(if passed {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
