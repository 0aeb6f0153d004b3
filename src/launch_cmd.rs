//! `pdkv launch`: start every node of a cluster.toml and the router as local processes, wait
//! until they are linked, then supervise them until Ctrl-C / SIGTERM (drain and stop all) or the
//! first unexpected exit (report it and stop all, or restart that node with
//! `--restart on-failure`).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use clap::{Args, ValueEnum};
use pdkv_actors::config::DEFAULT_CLUSTER_TOML;

use crate::launch::{Cluster, LaunchOptions};

/// How often the supervisor looks at its children.
const SUPERVISE_POLL: Duration = Duration::from_millis(50);

/// Restarts of one node allowed before the launcher gives up on it.
const MAX_RESTARTS: u32 = 100;

/// What to do when a node exits on its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RestartArg {
    /// Report it and stop the cluster.
    Never,
    /// Start it again (a new incarnation); chaos testing needs this.
    OnFailure,
}

/// Arguments of `pdkv launch`.
#[derive(Debug, Args)]
pub struct LaunchArgs {
    /// cluster.toml to launch (default: the embedded copy of the shipped one).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Run directory for the resolved cluster.toml, certificates and logs (default:
    /// `$XDG_STATE_HOME/pdkv/runs/run-<unix time>-<pid>`, else under `~/.local/state`, else the
    /// temporary directory; printed at start). It holds the cluster CA's private key: it is
    /// made readable by its owner only.
    #[arg(long)]
    pub run_dir: Option<PathBuf>,
    /// Seconds every process has to become ready (default: 30, or 600 when the legs are vLLM
    /// engines, which load a model and, on CPU, compile kernels as they start).
    #[arg(long)]
    pub ready_timeout: Option<f64>,
    /// What to do when a node exits on its own.
    #[arg(long, value_enum, default_value_t = RestartArg::Never)]
    pub restart: RestartArg,
    /// Write files that run the cluster under Slurm (`slurm`: an sbatch script) or Kubernetes
    /// (`k8s`: manifests) into `--out` instead of starting anything.
    #[arg(long, value_enum, requires = "out")]
    pub render: Option<crate::render::Target>,
    /// Where `--render` writes.
    #[arg(long, requires = "render")]
    pub out: Option<PathBuf>,
    /// The `pdkv` binary on hosts of `launch = "ssh"` nodes.
    #[arg(long, default_value = "pdkv")]
    pub remote_bin: String,
    /// An ssh config file (`ssh -F`) for `launch = "ssh"` nodes.
    #[arg(long)]
    pub ssh_config: Option<PathBuf>,
    /// With `--render k8s`: the container image holding `pdkv` on its PATH (default: this
    /// version's tag).
    #[arg(long, default_value = concat!("pdkv:", env!("CARGO_PKG_VERSION")), requires = "render")]
    pub image: String,
    /// With `--render`: replace certificates an earlier render wrote into `--out` (nodes started
    /// from the earlier files will not trust the new CA).
    #[arg(long, requires = "render")]
    pub force: bool,
}

/// Seconds processes get to become ready by default: vLLM legs start in tens of seconds to
/// minutes (model load, kernel warm-up), pdkv's own in well under a second.
pub fn default_ready_timeout(config: Option<&PathBuf>) -> f64 {
    let text = match config {
        Some(path) => std::fs::read_to_string(path).unwrap_or_default(),
        None => DEFAULT_CLUSTER_TOML.to_string(),
    };
    match pdkv_actors::config::AnyCluster::from_toml(&text) {
        Ok(pdkv_actors::config::AnyCluster::Vllm(_)) => 600.0,
        _ => 30.0,
    }
}

/// Reads the config text and names it.
pub fn options(
    config: Option<&PathBuf>,
    run_dir: PathBuf,
    ready_timeout: f64,
) -> anyhow::Result<LaunchOptions> {
    let (config_text, config_name) = match config {
        Some(path) => (
            std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?,
            path.display().to_string(),
        ),
        None => (
            DEFAULT_CLUSTER_TOML.to_string(),
            "the embedded cluster.toml".to_string(),
        ),
    };
    if !(ready_timeout.is_finite() && ready_timeout > 0.0 && ready_timeout <= 3600.0) {
        anyhow::bail!("--ready-timeout: {ready_timeout} is not a number of seconds in (0, 3600]");
    }
    Ok(LaunchOptions {
        config_text,
        config_name,
        run_dir,
        ready_timeout: Duration::from_secs_f64(ready_timeout),
        binary: std::env::current_exe().context("cannot find the pdkv binary")?,
        remote_binary: "pdkv".into(),
        ssh_config: None,
    })
}

/// Where a launch without `--run-dir` keeps its files: the user's state directory (XDG), never
/// the working tree, so a CA key is not left beside the sources.
pub fn default_run_dir() -> PathBuf {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_secs());
    let state = std::env::var_os("XDG_STATE_HOME")
        .map(PathBuf::from)
        .filter(|dir| dir.is_absolute())
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".local/state")))
        .filter(|dir| dir.is_absolute())
        .unwrap_or_else(std::env::temp_dir);
    state
        .join("pdkv/runs")
        .join(format!("run-{now}-{}", std::process::id()))
}

/// Runs `pdkv launch`.
pub fn run(args: LaunchArgs) -> anyhow::Result<ExitCode> {
    if let (Some(target), Some(out)) = (args.render, &args.out) {
        let text = match &args.config {
            Some(path) => {
                std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?
            }
            None => DEFAULT_CLUSTER_TOML.to_string(),
        };
        for path in crate::render::render(target, &text, out, &args.image, args.force)? {
            crate::outln!("wrote {}", path.display());
        }
        return Ok(ExitCode::SUCCESS);
    }
    let run_dir = args.run_dir.clone().unwrap_or_else(default_run_dir);
    crate::outln!("run directory {}", run_dir.display());
    let ready_timeout = args
        .ready_timeout
        .unwrap_or_else(|| default_ready_timeout(args.config.as_ref()));
    let mut options = options(args.config.as_ref(), run_dir, ready_timeout)?;
    options.remote_binary = args.remote_bin.clone();
    options.ssh_config = args.ssh_config.clone();
    let mut cluster = Cluster::launch(&options)?;
    for member in &cluster.members {
        crate::outln!(
            "{:<12} pid {:<8} {}  log {}",
            member.name,
            member.pid().unwrap_or(0),
            member.admin_url,
            member.log.display()
        );
    }
    crate::outln!(
        "READY router={} config={}",
        cluster.router_url,
        cluster.config_path.display()
    );
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the supervisor's runtime")?;
    let code = runtime.block_on(supervise(&mut cluster, args.restart))?;
    for (name, status) in cluster.stop() {
        tracing::info!(node = %name, ?status, "stopped");
    }
    Ok(code)
}

async fn supervise(cluster: &mut Cluster, restart: RestartArg) -> anyhow::Result<ExitCode> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut terminate = signal(SignalKind::terminate()).context("cannot watch SIGTERM")?;
    let mut interrupt = signal(SignalKind::interrupt()).context("cannot watch SIGINT")?;
    loop {
        tokio::select! {
            _ = terminate.recv() => {
                eprintln!("SIGTERM: stopping the cluster");
                return Ok(ExitCode::SUCCESS);
            }
            _ = interrupt.recv() => {
                eprintln!("interrupted: stopping the cluster");
                return Ok(ExitCode::SUCCESS);
            }
            _ = tokio::time::sleep(SUPERVISE_POLL) => {}
        }
        if let Some((index, status)) = cluster.exited() {
            let member = &cluster.members[index];
            eprintln!(
                "{} exited unexpectedly ({status}); log {}",
                member.name,
                member.log.display()
            );
            if restart == RestartArg::OnFailure && member.starts <= MAX_RESTARTS {
                cluster.spawn(index)?;
                eprintln!(
                    "{} restarted (start {})",
                    cluster.members[index].name, cluster.members[index].starts
                );
                continue;
            }
            return Ok(ExitCode::FAILURE);
        }
    }
}
