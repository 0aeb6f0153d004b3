//! `pdkv node` (one leg in this process) and `pdkv router` (the router behind the
//! OpenAI-compatible HTTP API), each from a cluster.toml with fixed ports and `[tls]`
//! certificates (`pdkv launch` writes both).
//!
//! Both print one `READY ...` line on standard output once serving, and on SIGTERM or Ctrl-C
//! stop taking requests, let in-flight ones finish (bounded by the request timeout), and exit 0.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use pdkv_actors::config::{AnyCluster, ClusterConfig, ROUTER_NODE};
use pdkv_actors::node::{NodeProcess, resolve};
use pdkv_actors::scheduler::Stats;
use pdkv_core::wire::Role;
use pdkv_transport::tls::NodeIdentity;

use crate::admin::{self, AdminState, ProcessKind};
use crate::http::{HttpLimits, HttpListener};
use crate::openai::{self, ApiState};

/// Largest completions request body.
const MAX_BODY_BYTES: usize = 1 << 20;

/// How often a draining leg checks whether it is idle.
const DRAIN_POLL: Duration = Duration::from_millis(20);

/// Arguments of `pdkv node`.
#[derive(Debug, Args)]
pub struct NodeArgs {
    /// The cluster.toml (ports fixed, `[tls]` set).
    #[arg(long)]
    pub config: PathBuf,
    /// Which `[[nodes]]` entry to run.
    #[arg(long)]
    pub node: String,
    /// Print the command a vLLM leg runs (`engine = "vllm"`) instead of running it.
    #[arg(long)]
    pub dry_run: bool,
}

/// Arguments of `pdkv router`.
#[derive(Debug, Args)]
pub struct RouterArgs {
    /// The cluster.toml (ports fixed, `[tls]` set).
    #[arg(long)]
    pub config: PathBuf,
}

fn load(path: &std::path::Path, name: &str) -> anyhow::Result<(ClusterConfig, NodeIdentity)> {
    let config = ClusterConfig::from_file(path)?;
    let Some(tls) = &config.tls else {
        bail!(
            "{} has no [tls] table: run `pdkv certs init --config {} --out DIR` and set [tls] dir = \"DIR\", or start the cluster with `pdkv launch`",
            path.display(),
            path.display()
        );
    };
    let identity = NodeIdentity::load(&tls.dir, name)
        .with_context(|| format!("cannot load the certificate of {name} from {}", tls.dir.display()))?;
    Ok((config, identity))
}

/// Runs `pdkv node`.
pub fn run_node(args: NodeArgs) -> anyhow::Result<ExitCode> {
    if args.node == ROUTER_NODE {
        bail!(
            "{ROUTER_NODE} is the router: run `pdkv router --config {}`",
            args.config.display()
        );
    }
    if let AnyCluster::Vllm(cluster) = AnyCluster::from_file(&args.config)? {
        return crate::vllm_leg::run(&cluster, &args.node, args.dry_run);
    }
    if args.dry_run {
        bail!(
            "--dry-run prints a vLLM leg's command; node {} runs pdkv's reference engine",
            args.node
        );
    }
    let (config, identity) = load(&args.config, &args.node)?;
    let node = config
        .nodes
        .iter()
        .find(|node| node.name.0 == args.node)
        .with_context(|| {
            let names: Vec<&str> = config.nodes.iter().map(|node| node.name.0.as_str()).collect();
            format!(
                "{} has no node {:?} (nodes: {})",
                args.config.display(),
                args.node,
                names.join(", ")
            )
        })?
        .clone();
    if node.address.admin_port == 0 {
        bail!(
            "node {}: admin_port is 0; a node of its own needs fixed ports (`pdkv launch` picks them)",
            args.node
        );
    }
    let admin_bind =
        resolve(node.address.bind_host(), node.address.admin_port).map_err(anyhow::Error::msg)?;
    let admin_listener = HttpListener::bind(admin_bind, "admin")?;
    let metrics = admin::install_metrics(ProcessKind::Leg)?;
    let limits = HttpLimits::new(&config.http, crate::http::raise_file_limit());
    let drain_bound = Duration::from_millis(config.limits.request_timeout_ms);
    let system = actix::System::new();
    system.block_on(async move {
        let process = NodeProcess::start(config, &args.node, identity).await?;
        let leg = process.leg().context("a leg node started without its leg")?;
        let scheduler = leg.scheduler.clone();
        let (name, role, board, draining) = (
            process.name().clone(),
            process.role(),
            process.board(),
            process.draining_flag(),
        );
        let readiness = Arc::new(move || pdkv_actors::node::readiness(&name, role, &board, &draining));
        let gauges = scheduler.clone();
        let gpus = admin::GpuTelemetry::from_environment();
        let state = AdminState {
            readiness,
            metrics,
            refresh: Some(Arc::new(move || {
                let (scheduler, gpus) = (gauges.clone(), gpus.clone());
                Box::pin(async move {
                    if let Ok(stats) = scheduler.send(Stats).await {
                        export_stats(&stats);
                    }
                    gpus.export().await;
                })
            })),
        };
        let admin = admin_listener.serve(openai::with_json_errors(admin::routes(state)), 1, limits)?;
        crate::outln!(
            "READY node={} role={} control={} admin=http://{}{}",
            process.name(),
            process.role(),
            process.control_addr().map_or("?".into(), |addr| addr.to_string()),
            admin.local_addr(),
            process
                .data_addr()
                .map_or(String::new(), |addr| format!(" data={addr}")),
        );
        wait_for_shutdown_signal().await?;
        process.drain();
        let deadline = Instant::now() + drain_bound;
        let idle = loop {
            match scheduler.send(Stats).await {
                Ok(stats) if stats.is_idle() => break true,
                Ok(_) if Instant::now() < deadline => tokio::time::sleep(DRAIN_POLL).await,
                _ => break false,
            }
        };
        if !idle {
            tracing::warn!(
                bound_ms = drain_bound.as_millis() as u64,
                "drain bound passed with requests in flight"
            );
        }
        drop(admin);
        process.shutdown().await;
        anyhow::Ok(ExitCode::SUCCESS)
    })
}

/// Sets the leg's block gauges from its node's accounting.
fn export_stats(stats: &pdkv_actors::scheduler::LegStats) {
    let load = &stats.load;
    for (group, (&free, &capacity)) in load.free_blocks.iter().zip(&load.capacity).enumerate() {
        let group = group.to_string();
        metrics::gauge!("pdkv_blocks_free", "group" => group.clone()).set(free as f64);
        metrics::gauge!("pdkv_blocks_capacity", "group" => group).set(capacity as f64);
    }
    metrics::gauge!("pdkv_grants_active").set(load.grants as f64);
    metrics::gauge!("pdkv_requests_active").set(load.requests as f64);
}

/// Runs `pdkv router`.
pub fn run_router(args: RouterArgs) -> anyhow::Result<ExitCode> {
    if let AnyCluster::Vllm(cluster) = AnyCluster::from_file(&args.config)? {
        return crate::vllm_router::run(cluster);
    }
    let (config, identity) = load(&args.config, ROUTER_NODE)?;
    if config.router.http_port == 0 {
        bail!("[router] http_port is 0; the router of its own needs a fixed port (`pdkv launch` picks one)");
    }
    let http_bind =
        resolve(config.router.bind_host(), config.router.http_port).map_err(anyhow::Error::msg)?;
    let http_listener = HttpListener::bind(http_bind, "router")?;
    let metrics = admin::install_metrics(ProcessKind::Router)?;
    let limits = HttpLimits::new(&config.http, crate::http::raise_file_limit());
    let capacity = openai::Capacity {
        prompt: config.prompt_limit(),
        context: config.context_limit(),
    };
    let http_threads = config.router.http_threads;
    let (vocab, request_timeout) = (
        config.model.vocab,
        Duration::from_millis(config.limits.request_timeout_ms),
    );
    let system = actix::System::new();
    system.block_on(async move {
        let process = NodeProcess::start(config, ROUTER_NODE, identity).await?;
        let router = process
            .router()
            .context("the router node started without its router")?
            .clone();
        let (name, board, draining) = (process.name().clone(), process.board(), process.draining_flag());
        let readiness =
            Arc::new(move || pdkv_actors::node::readiness(&name, Role::Router, &board, &draining));
        let admin_state = AdminState {
            readiness,
            metrics,
            refresh: None,
        };
        let api = ApiState {
            router,
            vocab,
            max_body_bytes: MAX_BODY_BYTES,
            body_timeout: limits.body_timeout,
            capacity: capacity.clone(),
            request_timeout,
            next_id: Arc::new(AtomicU64::new(1)),
            next_client: Arc::new(AtomicU64::new(1)),
        };
        let app = openai::with_json_errors(openai::routes(api).merge(admin::routes(admin_state)));
        let http = match http_threads {
            0 => http_listener.serve_here(app, limits)?,
            threads => http_listener.serve(app, threads, limits)?,
        };
        crate::outln!(
            "READY node={ROUTER_NODE} role=router control={} http=http://{}",
            process.control_addr().map_or("?".into(), |addr| addr.to_string()),
            http.local_addr()
        );
        wait_for_shutdown_signal().await?;
        process.drain();
        drop(http);
        process.shutdown().await;
        anyhow::Ok(ExitCode::SUCCESS)
    })
}

/// Waits for SIGTERM, SIGINT or SIGHUP (the ssh session of a node started by `pdkv launch`
/// ended).
pub async fn wait_for_shutdown_signal() -> anyhow::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut terminate = signal(SignalKind::terminate()).context("cannot watch SIGTERM")?;
    let mut interrupt = signal(SignalKind::interrupt()).context("cannot watch SIGINT")?;
    let mut hangup = signal(SignalKind::hangup()).context("cannot watch SIGHUP")?;
    tokio::select! {
        _ = terminate.recv() => tracing::info!("SIGTERM: draining"),
        _ = interrupt.recv() => tracing::info!("SIGINT: draining"),
        _ = hangup.recv() => tracing::info!("SIGHUP: draining"),
    }
    Ok(())
}
