//! Starting a whole cluster.toml as local processes: one `pdkv node` per leg and one
//! `pdkv router`, each in its own process group with its own log file in a run directory.
//!
//! Before starting anything the launcher writes the run directory's `cluster.toml`: the given
//! file with every port that was 0 (or absent) replaced by a free one, and, when the file has no
//! `[tls]`, a throwaway cluster CA and certificates (keys 0600) under `certs/`. Then it starts
//! every process and waits, with a bound, until each one's `/ready` says it is linked to all its
//! peers. Dropping a [`Cluster`] stops every process group it started (SIGTERM, then SIGKILL
//! after a grace period), so no child outlives the launcher.

use std::collections::BTreeMap;
use std::fs::File;
use std::net::{SocketAddr, TcpListener, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use pdkv_actors::config::{AnyCluster, ROUTER_NODE};
use pdkv_actors::deployment::{Launch, LogFormat, TlsConfig};
use pdkv_actors::engines::EngineKind;
use pdkv_actors::node::{host_port, resolve};
use pdkv_transport::tls::{Existing, write_cluster_certs};
use std::os::unix::process::CommandExt;

/// How often the readiness gate and the supervisor look at the children.
const POLL: Duration = Duration::from_millis(50);

/// How long one `/ready` probe may take.
const PROBE_TIMEOUT: Duration = Duration::from_millis(500);

/// Lines of a failed node's log quoted in its error.
const LOG_TAIL_LINES: usize = 40;

/// How the launcher tells that a process serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    /// pdkv's `/ready`: 200 and every peer linked.
    Ready,
    /// vLLM's `/health`: 200 (its engine and the connector's worker started).
    Health,
}

/// One process of a launched cluster.
#[derive(Debug)]
pub struct Member {
    /// Node name (`router` for the router).
    pub name: String,
    /// Its log file (standard output and error).
    pub log: PathBuf,
    /// Where its `/ready` (or, for a vLLM leg, `/health`) and `/metrics` are served.
    pub admin_url: String,
    /// How its readiness is probed.
    pub probe: Probe,
    /// Its role (`Router` for the router).
    pub role: pdkv_core::wire::Role,
    /// The program started: `pdkv`, or `ssh` for a node on another host.
    program: PathBuf,
    args: Vec<String>,
    child: Option<Child>,
    /// Times it was started.
    pub starts: u32,
}

impl Member {
    /// The process id of the running process, if any.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }
}

/// What to start and where.
#[derive(Debug, Clone)]
pub struct LaunchOptions {
    /// The cluster description as given.
    pub config_text: String,
    /// Where it came from (for messages).
    pub config_name: String,
    /// The run directory (created if missing).
    pub run_dir: PathBuf,
    /// Bound on the readiness gate.
    pub ready_timeout: Duration,
    /// The `pdkv` binary the children run.
    pub binary: PathBuf,
    /// The `pdkv` binary on hosts reached through ssh (on their PATH by default).
    pub remote_binary: String,
    /// An ssh config file (`ssh -F`) for nodes with `launch = "ssh"`.
    pub ssh_config: Option<PathBuf>,
}

/// A running cluster of local processes.
#[derive(Debug)]
pub struct Cluster {
    /// The resolved configuration the processes run.
    pub config: AnyCluster,
    /// Its path in the run directory.
    pub config_path: PathBuf,
    /// The router's API base URL.
    pub router_url: String,
    /// Every process, legs first, router last.
    pub members: Vec<Member>,
    /// How long to wait after SIGTERM before SIGKILL.
    grace: Duration,
    /// How nodes on other hosts are reached.
    ssh: Option<Ssh>,
}

/// Binds `host:0` for TCP or UDP and keeps the socket, so no two picks collide.
enum Reserved {
    Tcp(TcpListener),
    Udp(UdpSocket),
}

/// The lowest port a picked one may have.
const LOWEST_PICKED_PORT: u16 = 10_000;

/// Ports picked so far by this process, to vary the random starting point of each pick.
static PICKS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Where free ports are looked for: from [`LOWEST_PICKED_PORT`] up to the kernel's ephemeral
/// range, so no socket bound to port 0 elsewhere (an outgoing connection, another test) takes
/// a picked port between the launcher releasing it and the node binding it.
fn pick_range() -> std::ops::Range<u16> {
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|text| text.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32_768);
    LOWEST_PICKED_PORT..ephemeral_low.max(LOWEST_PICKED_PORT)
}

impl Reserved {
    /// The port it holds.
    fn port(&self) -> Option<u16> {
        match self {
            Reserved::Tcp(socket) => socket.local_addr().ok().map(|address| address.port()),
            Reserved::Udp(socket) => socket.local_addr().ok().map(|address| address.port()),
        }
    }

    /// Binds a free port on `host` below the ephemeral range (any free port if that range is
    /// small or full) and keeps it bound.
    fn pick(host: &str, udp: bool) -> anyhow::Result<(u16, Reserved)> {
        let address: SocketAddr = resolve(host, 0).map_err(anyhow::Error::msg)?;
        let range = pick_range();
        if range.len() >= 1000 {
            use rand_core::{RngCore, SeedableRng};
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |elapsed| elapsed.as_nanos() as u64);
            let pick = PICKS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(
                nanos ^ u64::from(std::process::id()) << 32 ^ pick.wrapping_mul(0x9E37_79B9_7F4A_7C15),
            );
            for _ in 0..200 {
                let port = range.start + (rng.next_u32() % range.len() as u32) as u16;
                let candidate = SocketAddr::new(address.ip(), port);
                let reserved = if udp {
                    UdpSocket::bind(candidate).map(Reserved::Udp)
                } else {
                    TcpListener::bind(candidate).map(Reserved::Tcp)
                };
                if let Ok(reserved) = reserved {
                    return Ok((port, reserved));
                }
            }
        }
        if udp {
            let socket =
                UdpSocket::bind(address).with_context(|| format!("cannot bind a UDP port on {host}"))?;
            Ok((socket.local_addr()?.port(), Reserved::Udp(socket)))
        } else {
            let socket =
                TcpListener::bind(address).with_context(|| format!("cannot bind a TCP port on {host}"))?;
            Ok((socket.local_addr()?.port(), Reserved::Tcp(socket)))
        }
    }
}

/// Sets `table[key]` to a free port on `host` unless it holds a nonzero one. With `width` > 1
/// the `width - 1` ports after it are free too (a vLLM leg's worker rank r listens on port + r).
fn fill_port(
    table: &mut toml::Table,
    key: &str,
    host: &str,
    udp: bool,
    width: u16,
    reserved: &mut Vec<Reserved>,
) -> anyhow::Result<u16> {
    if let Some(port) = table.get(key).and_then(toml::Value::as_integer)
        && port != 0
    {
        return Ok(port as u16);
    }
    // A port number is one key's only, TCP or UDP (cluster.toml refuses two keys on one port).
    let held = |reserved: &[Reserved], port: u16| reserved.iter().any(|held| held.port() == Some(port));
    let mut port = 0;
    'pick: for _ in 0..20 {
        let (picked, socket) = Reserved::pick(host, udp)?;
        let clash = held(reserved, picked);
        reserved.push(socket);
        if clash {
            continue;
        }
        for next in 1..width {
            let Some(following) = picked.checked_add(next) else {
                continue 'pick;
            };
            let address: SocketAddr = resolve(host, following).map_err(anyhow::Error::msg)?;
            let socket = if udp {
                UdpSocket::bind(address).map(Reserved::Udp)
            } else {
                TcpListener::bind(address).map(Reserved::Tcp)
            };
            match socket {
                Ok(socket) if !held(reserved, following) => reserved.push(socket),
                _ => continue 'pick,
            }
        }
        port = picked;
        break;
    }
    if port == 0 {
        bail!("cannot find {width} free consecutive ports for {key} on {host} that no other key holds");
    }
    table.insert(key.into(), toml::Value::Integer(i64::from(port)));
    Ok(port)
}

/// Writes the run directory's cluster.toml (ports fixed, `[tls]` set; for vLLM legs, the
/// Python and model paths made absolute) and returns its path.
pub fn prepare_run_dir(config_text: &str, config_name: &str, run_dir: &Path) -> anyhow::Result<PathBuf> {
    let config = AnyCluster::from_toml(config_text).with_context(|| format!("{config_name} is not valid"))?;
    std::fs::create_dir_all(run_dir).with_context(|| format!("cannot create {}", run_dir.display()))?;
    // Certificates and the CA's key land here: the owner's only.
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(run_dir, std::fs::Permissions::from_mode(0o700))
            .with_context(|| format!("cannot restrict {} to its owner", run_dir.display()))?;
    }
    let run_dir = run_dir
        .canonicalize()
        .with_context(|| format!("cannot resolve {}", run_dir.display()))?;
    let mut doc: toml::Table = config_text
        .parse()
        .with_context(|| format!("{config_name} is not TOML"))?;
    let mut reserved = Vec::new();
    let placed = config.placed();
    if let Some(toml::Value::Array(nodes)) = doc.get_mut("nodes") {
        for (node, checked) in nodes.iter_mut().zip(&placed) {
            let toml::Value::Table(table) = node else {
                bail!("{config_name}: nodes must be tables");
            };
            let host = checked.address.bind_host().to_string();
            if let Launch::Ssh { .. } = checked.launch {
                for key in ["control_port", "data_port", "admin_port"] {
                    if table.get(key).and_then(toml::Value::as_integer).unwrap_or(0) == 0 {
                        bail!(
                            "{config_name}: node {} has launch = \"ssh\" and needs a fixed {key}: a free port on another host cannot be picked from here",
                            checked.name
                        );
                    }
                }
            }
            // A vLLM leg's worker ranks each take the next control and data port.
            let ranks = match &config {
                AnyCluster::Vllm(cluster) => cluster
                    .node(&checked.name.0)
                    .map_or(1, |node| node.ranks(&cluster.engine)),
                AnyCluster::Reference(_) => 1,
            };
            let width = u16::try_from(ranks).unwrap_or(u16::MAX);
            fill_port(table, "control_port", &host, true, width, &mut reserved)?;
            fill_port(table, "data_port", &host, false, width, &mut reserved)?;
            fill_port(table, "admin_port", &host, false, 1, &mut reserved)?;
        }
    }
    let router = doc
        .entry("router")
        .or_insert_with(|| toml::Value::Table(toml::Table::new()));
    let toml::Value::Table(router) = router else {
        bail!("{config_name}: [router] must be a table");
    };
    let router_host = config.router().bind_host().to_string();
    if let AnyCluster::Reference(_) = &config {
        // The router's QUIC links to the legs (a vLLM cluster's router speaks HTTP only).
        fill_port(router, "control_port", &router_host, true, 1, &mut reserved)?;
    }
    fill_port(router, "http_port", &router_host, false, 1, &mut reserved)?;
    if let AnyCluster::Vllm(_) = &config {
        absolute_engine_paths(&mut doc)?;
    }
    if config.tls().is_none() {
        let certs = run_dir.join("certs");
        let names = certificate_names(&config);
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        write_cluster_certs(&certs, "pdkv", &names, Existing::Replace)
            .with_context(|| format!("cannot write certificates to {}", certs.display()))?;
        let mut tls = toml::Table::new();
        tls.insert("dir".into(), toml::Value::String(certs.display().to_string()));
        doc.insert("tls".into(), toml::Value::Table(tls));
    }
    let path = run_dir.join("cluster.toml");
    let text = format!(
        "# Written by pdkv launch from {config_name}: ports fixed, certificates set.\n{}",
        toml::to_string(&doc).context("cannot write the resolved cluster.toml")?
    );
    std::fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))?;
    drop(reserved);
    AnyCluster::from_file(&path).with_context(|| format!("the resolved {} is not valid", path.display()))?;
    Ok(path)
}

/// Every name a certificate is written for: each node (each worker rank of a vLLM leg:
/// `<node>-<rank>`) and the router.
pub fn certificate_names(config: &AnyCluster) -> Vec<String> {
    let mut names: Vec<String> = match config {
        AnyCluster::Reference(config) => config.nodes.iter().map(|node| node.name.0.clone()).collect(),
        AnyCluster::Vllm(cluster) => cluster
            .nodes
            .iter()
            .flat_map(|node| node.rank_names(&cluster.engine))
            .collect(),
    };
    names.push(ROUTER_NODE.into());
    names
}

/// `[engines.vllm] python` and `model` made absolute where they name paths that exist from
/// here (relative paths are the launcher's; a hub name stays as it is), so the run directory's
/// cluster.toml works from any directory.
fn absolute_engine_paths(doc: &mut toml::Table) -> anyhow::Result<()> {
    let Some(toml::Value::Table(vllm)) = doc
        .get_mut("engines")
        .and_then(|engines| engines.as_table_mut())
        .and_then(|engines| engines.get_mut("vllm"))
    else {
        return Ok(());
    };
    for key in ["python", "model"] {
        if let Some(toml::Value::String(path)) = vllm.get_mut(key)
            && Path::new(path.as_str()).is_relative()
            && Path::new(path.as_str()).exists()
        {
            *path = std::path::absolute(path.as_str())
                .with_context(|| format!("engines.vllm.{key}: cannot resolve {path}"))?
                .display()
                .to_string();
        }
    }
    Ok(())
}

fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(LOG_TAIL_LINES)..].join("\n")
}

impl Cluster {
    /// Prepares the run directory, starts every process and waits until all are linked.
    pub fn launch(options: &LaunchOptions) -> anyhow::Result<Cluster> {
        let config_path = prepare_run_dir(&options.config_text, &options.config_name, &options.run_dir)?;
        Cluster::start(options, config_path, &BTreeMap::new())
    }

    /// Starts every process of the prepared `config_path` and waits until all are linked. A
    /// member named in `views` runs that file instead: the same cluster seen through other
    /// addresses (`pdkv chaos` puts a relay on every link this way).
    pub fn start(
        options: &LaunchOptions,
        config_path: PathBuf,
        views: &BTreeMap<String, PathBuf>,
    ) -> anyhow::Result<Cluster> {
        let config = AnyCluster::from_file(&config_path)?;
        let run_dir = config_path.parent().context("run directory")?.to_path_buf();
        let mut members = Vec::new();
        let format = match config.logging().format {
            LogFormat::Text => "text",
            LogFormat::Json => "json",
        };
        let config_arg = |name: &str| views.get(name).unwrap_or(&config_path).display().to_string();
        let ssh = Ssh {
            config: options.ssh_config.clone(),
            control_path: run_dir.join("ssh-%C"),
        };
        let level = config.logging().level.clone();
        for node in config.placed() {
            let log = run_dir.join(format!("{}.log", node.name));
            let admin_url = format!(
                "http://{}",
                host_port(&node.address.host, node.address.admin_port)
            );
            let probe = match node.engine {
                EngineKind::Reference => Probe::Ready,
                EngineKind::Vllm => Probe::Health,
            };
            if let Launch::Ssh { target } = node.launch {
                let remote_dir = format!(
                    "pdkv-run-{}-{}",
                    run_dir
                        .file_name()
                        .map_or("run".into(), |name| name.to_string_lossy()),
                    std::process::id()
                );
                let names = match &config {
                    AnyCluster::Vllm(cluster) => cluster
                        .node(&node.name.0)
                        .map(|vllm| vllm.rank_names(&cluster.engine))
                        .unwrap_or_default(),
                    AnyCluster::Reference(_) => vec![node.name.0.clone()],
                };
                ssh.install(target, &remote_dir, &config_path, config.tls(), &names)?;
                let command = format!(
                    "RUST_LOG={} exec {} --log-format {format} node --config {remote_dir}/cluster.toml --node {}",
                    shell_quote(
                        &std::env::var("RUST_LOG")
                            .unwrap_or_else(|_| format!("{level},pdkv=info,pdkv_actors=info"))
                    ),
                    shell_quote(&options.remote_binary),
                    node.name
                );
                let mut args = ssh.options();
                // A terminal, so the remote node gets SIGHUP (and drains) when this ssh ends.
                args.extend(["-tt".into(), target.clone(), command]);
                members.push(Member {
                    name: node.name.0.clone(),
                    log,
                    admin_url,
                    probe,
                    role: node.role,
                    program: PathBuf::from("ssh"),
                    args,
                    child: None,
                    starts: 0,
                });
                continue;
            }
            members.push(Member {
                name: node.name.0.clone(),
                log,
                admin_url,
                probe,
                role: node.role,
                program: options.binary.clone(),
                args: vec![
                    "--log-format".into(),
                    format.into(),
                    "node".into(),
                    "--config".into(),
                    config_arg(&node.name.0),
                    "--node".into(),
                    node.name.0.clone(),
                ],
                child: None,
                starts: 0,
            });
        }
        let router_url = format!(
            "http://{}",
            host_port(&config.router().host, config.router().http_port)
        );
        members.push(Member {
            name: ROUTER_NODE.into(),
            log: run_dir.join(format!("{ROUTER_NODE}.log")),
            admin_url: router_url.clone(),
            probe: Probe::Ready,
            role: pdkv_core::wire::Role::Router,
            program: options.binary.clone(),
            args: vec![
                "--log-format".into(),
                format.into(),
                "router".into(),
                "--config".into(),
                config_arg(ROUTER_NODE),
            ],
            child: None,
            starts: 0,
        });
        let grace = Duration::from_millis(config.limits().request_timeout_ms) + Duration::from_secs(2);
        let mut cluster = Cluster {
            config,
            config_path,
            router_url,
            members,
            grace,
            ssh: Some(ssh),
        };
        for index in 0..cluster.members.len() {
            cluster.spawn(index)?;
        }
        let started = Instant::now();
        cluster.wait_ready(options.ready_timeout)?;
        if let AnyCluster::Vllm(vllm) = &cluster.config {
            let left = options.ready_timeout.saturating_sub(started.elapsed());
            check_handoffs(vllm, &cluster.members, left)?;
        }
        Ok(cluster)
    }

    /// Starts member `index` (again).
    pub fn spawn(&mut self, index: usize) -> anyhow::Result<()> {
        let level = self.config.logging().level.clone();
        let member = &mut self.members[index];
        let log = File::options()
            .create(true)
            .append(true)
            .open(&member.log)
            .with_context(|| format!("cannot open {}", member.log.display()))?;
        let mut command = Command::new(&member.program);
        command
            .args(&member.args)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .process_group(0);
        if std::env::var_os("RUST_LOG").is_none() {
            command.env("RUST_LOG", format!("{level},pdkv=info,pdkv_actors=info"));
        }
        let child = command
            .spawn()
            .with_context(|| format!("cannot start {} ({})", member.name, member.program.display()))?;
        tracing::info!(node = %member.name, pid = child.id(), "started");
        member.child = Some(child);
        member.starts += 1;
        Ok(())
    }

    /// Waits until every process answers `/ready` with all its peers linked; fails naming the
    /// first process that exited or is not ready by the deadline, with its log.
    pub fn wait_ready(&mut self, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        let agent = http_agent(PROBE_TIMEOUT);
        let mut pending: Vec<usize> = (0..self.members.len()).collect();
        let mut last: BTreeMap<usize, String> = BTreeMap::new();
        while !pending.is_empty() {
            if let Some((index, status)) = self.exited() {
                let member = &self.members[index];
                bail!(
                    "{} exited during startup ({status}); log {}:\n{}",
                    member.name,
                    member.log.display(),
                    log_tail(&member.log)
                );
            }
            pending.retain(|&index| {
                let member = &self.members[index];
                let probed = match member.probe {
                    Probe::Ready => probe_ready(&agent, &member.admin_url),
                    Probe::Health => probe_health(&agent, &member.admin_url),
                };
                match probed {
                    Ok(()) => false,
                    Err(why) => {
                        last.insert(index, why);
                        true
                    }
                }
            });
            if pending.is_empty() {
                break;
            }
            if Instant::now() >= deadline {
                let index = pending[0];
                let member = &self.members[index];
                bail!(
                    "{} not ready after {:.1} s ({}); log {}:\n{}",
                    member.name,
                    timeout.as_secs_f64(),
                    last.get(&index).map_or("no answer", String::as_str),
                    member.log.display(),
                    log_tail(&member.log)
                );
            }
            std::thread::sleep(POLL);
        }
        Ok(())
    }

    /// The first member whose process has exited, with its status (reaped).
    pub fn exited(&mut self) -> Option<(usize, ExitStatus)> {
        for (index, member) in self.members.iter_mut().enumerate() {
            if let Some(child) = &mut member.child
                && let Ok(Some(status)) = child.try_wait()
            {
                member.child = None;
                return Some((index, status));
            }
        }
        None
    }

    /// Stops every process: SIGTERM to each group (the router first, so no new requests come),
    /// then SIGKILL to whatever still runs after the grace period. Returns each process's status.
    pub fn stop(&mut self) -> Vec<(String, Option<ExitStatus>)> {
        let order: Vec<usize> = (0..self.members.len()).rev().collect();
        for &index in &order {
            if let Some(pid) = self.members[index].pid() {
                let _ = killpg(Pid::from_raw(pid as i32), Signal::SIGTERM);
            }
        }
        let deadline = Instant::now() + self.grace;
        let mut statuses = Vec::new();
        for index in order {
            let member = &mut self.members[index];
            let Some(child) = &mut member.child else {
                continue;
            };
            let status = loop {
                match child.try_wait() {
                    Ok(Some(status)) => break Some(status),
                    Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
                    _ => {
                        tracing::warn!(node = %member.name, "still running after the grace period: SIGKILL");
                        let _ = killpg(Pid::from_raw(child.id() as i32), Signal::SIGKILL);
                        break child.wait().ok();
                    }
                }
            };
            // Whatever the node left in its group goes with it.
            let _ = killpg(Pid::from_raw(child.id() as i32), Signal::SIGKILL);
            member.child = None;
            statuses.push((member.name.clone(), status));
        }
        if let Some(ssh) = self.ssh.take() {
            let targets: Vec<String> = self
                .config
                .placed()
                .into_iter()
                .filter_map(|node| match node.launch {
                    Launch::Ssh { target } => Some(target.clone()),
                    Launch::Local => None,
                })
                .collect();
            ssh.close(&targets);
        }
        statuses
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if self.members.iter().any(|member| member.child.is_some()) {
            self.stop();
        }
    }
}

/// Quotes `text` for a POSIX shell.
fn shell_quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', r"'\''"))
}

/// The system ssh with one shared connection per host (ControlMaster) and no prompts
/// (BatchMode): what `launch = "ssh"` nodes are installed and started through.
#[derive(Debug, Clone)]
struct Ssh {
    config: Option<PathBuf>,
    control_path: PathBuf,
}

/// Bound on one ssh setup command (mkdir, copying a file).
const SSH_SETUP_TIMEOUT: Duration = Duration::from_secs(30);

impl Ssh {
    fn options(&self) -> Vec<String> {
        let mut options = Vec::new();
        if let Some(config) = &self.config {
            options.extend(["-F".into(), config.display().to_string()]);
        }
        for option in [
            "BatchMode=yes".to_string(),
            "ControlMaster=auto".to_string(),
            format!("ControlPath={}", self.control_path.display()),
            "ControlPersist=60".to_string(),
            "ConnectTimeout=10".to_string(),
            "ServerAliveInterval=5".to_string(),
        ] {
            options.extend(["-o".into(), option]);
        }
        options
    }

    /// Runs `command` on `target` with `input` on its standard input, bounded.
    fn run(&self, target: &str, command: &str, input: &[u8]) -> anyhow::Result<()> {
        use std::io::Write;
        let mut child = Command::new("ssh")
            .args(self.options())
            .arg(target)
            .arg(command)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .context("cannot run ssh")?;
        if let Some(mut stdin) = child.stdin.take() {
            stdin
                .write_all(input)
                .with_context(|| format!("ssh {target}: cannot send input"))?;
        }
        let deadline = Instant::now() + SSH_SETUP_TIMEOUT;
        let status = loop {
            if let Some(status) = child.try_wait()? {
                break status;
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                bail!(
                    "ssh {target} {command:?}: no answer within {} s",
                    SSH_SETUP_TIMEOUT.as_secs()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        if !status.success() {
            let mut stderr = String::new();
            if let Some(mut pipe) = child.stderr.take() {
                let _ = std::io::Read::read_to_string(&mut pipe, &mut stderr);
            }
            bail!("ssh {target} {command:?} failed ({status}): {}", stderr.trim());
        }
        Ok(())
    }

    /// Copies what a node needs to `target:dir`: the cluster.toml (with `[tls] dir` pointing at
    /// the copy), the CA certificate, and the certificate and key (0600) of each of `names` (the
    /// node, and a vLLM leg's further worker ranks).
    fn install(
        &self,
        target: &str,
        dir: &str,
        config_path: &Path,
        tls: Option<&TlsConfig>,
        names: &[String],
    ) -> anyhow::Result<()> {
        let tls = tls.context("the resolved cluster.toml has no [tls]")?;
        self.run(target, &format!("umask 077 && mkdir -p {dir}/certs"), &[])?;
        let text = std::fs::read_to_string(config_path)?;
        let mut doc: toml::Table = text.parse()?;
        let mut remote_tls = toml::Table::new();
        remote_tls.insert("dir".into(), toml::Value::String(format!("{dir}/certs")));
        doc.insert("tls".into(), toml::Value::Table(remote_tls));
        self.run(
            target,
            &format!("cat > {dir}/cluster.toml"),
            toml::to_string(&doc)?.as_bytes(),
        )?;
        let mut files = vec!["ca.pem".to_string()];
        for name in names {
            files.extend([format!("{name}.pem"), format!("{name}.key")]);
        }
        for file in files {
            let bytes = std::fs::read(tls.dir.join(&file))
                .with_context(|| format!("cannot read {}", tls.dir.join(&file).display()))?;
            self.run(target, &format!("umask 077 && cat > {dir}/certs/{file}"), &bytes)?;
        }
        Ok(())
    }

    /// Ends the shared connections (their masters outlive single commands otherwise).
    fn close(&self, targets: &[String]) {
        for target in targets {
            let _ = Command::new("ssh")
                .args(self.options())
                .args(["-O", "exit", target])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// An HTTP client that reports 4xx/5xx as answers, not errors.
pub fn http_agent(timeout: Duration) -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(timeout))
        .build()
        .into()
}

/// Prompt tokens of a hand-off probe: a few blocks of any block size, ids every vocabulary has.
const PROBE_TOKENS: usize = 65;

/// How the vLLM connector's log line for a refused offer ends (`pdkv_vllm.connector`).
const REFUSAL_MARK: &str = "; computing the prompt here";

/// Why a hand-off probe did not read.
enum ProbeFailure {
    /// The decode leg refused the offer before reading: its legs serve another model or KV
    /// layout, which no retry changes.
    Refused,
    /// Anything else (a leg still warming up, a failed READ): worth another probe.
    Other(String),
}

impl<T: Into<String>> From<T> for ProbeFailure {
    fn from(why: T) -> Self {
        ProbeFailure::Other(why.into())
    }
}

/// Gates a vLLM cluster on its connectors: every prefill leg hands a probe prompt's KV to a
/// decode leg and every decode leg reads one (`max(prefill, decode)` probes), each checked by
/// the decode leg's `vllm:pdkv_load_seconds_count` moving (a load that failed is recomputed and
/// moves `vllm:pdkv_failed_loads_total` instead). Retried with new prompts until `timeout`; an
/// offer the decode leg refuses (another model or KV layout) fails at once. Fails naming the
/// pair and quoting the decode leg's log, which names each field the legs differ in.
fn check_handoffs(
    cluster: &pdkv_actors::engines::VllmCluster,
    members: &[Member],
    timeout: Duration,
) -> anyhow::Result<()> {
    use pdkv_core::wire::Role;
    let deadline = Instant::now() + timeout;
    let prefills: Vec<&pdkv_actors::engines::VllmNode> = cluster
        .nodes
        .iter()
        .filter(|node| node.role == Role::Prefill)
        .collect();
    let decodes: Vec<&pdkv_actors::engines::VllmNode> = cluster
        .nodes
        .iter()
        .filter(|node| node.role == Role::Decode)
        .collect();
    let agent = http_agent(Duration::from_millis(cluster.limits.request_timeout_ms));
    let model = &cluster.engine.served_model_name;
    for pair in 0..prefills.len().max(decodes.len()) {
        let (prefill, decode) = (prefills[pair % prefills.len()], decodes[pair % decodes.len()]);
        let mut attempt = 0usize;
        loop {
            let prompt: Vec<u64> = (0..PROBE_TOKENS)
                .map(|i| 1 + ((pair * 31 + attempt * 17 + i * 7) % 97) as u64)
                .collect();
            let probed = probe_handoff(&agent, model, &prefill.http_url(), &decode.http_url(), &prompt);
            let why = match probed {
                Ok(()) => break,
                Err(ProbeFailure::Refused) => {
                    let (path, tail) = decode_log(members, &decode.name.0);
                    // The connector's refusal names each differing field with both values;
                    // quoted first, as the error is cut to a screen.
                    let refusal = tail
                        .lines()
                        .rfind(|line| line.contains(REFUSAL_MARK))
                        .unwrap_or("(not in the log's tail)");
                    bail!(
                        "{} refused the KV {} offered: {refusal}; log {path}",
                        decode.name,
                        prefill.name,
                    );
                }
                Err(ProbeFailure::Other(why)) => why,
            };
            if Instant::now() >= deadline {
                let log = decode_log(members, &decode.name.0);
                bail!(
                    "{} did not read KV from {}: {why}; log {}:\n{}",
                    decode.name,
                    prefill.name,
                    log.0,
                    log.1
                );
            }
            tracing::info!(prefill = %prefill.name, decode = %decode.name, %why, "hand-off probe failed; again");
            attempt += 1;
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    Ok(())
}

/// A member's log: its path and its last lines.
fn decode_log(members: &[Member], name: &str) -> (String, String) {
    members
        .iter()
        .find(|member| member.name == name)
        .map(|member| (member.log.display().to_string(), log_tail(&member.log)))
        .unwrap_or_default()
}

/// One probe: the prompt through `prefill` and `decode` as the router sends it; `Ok` when the
/// decode leg completed a READ of it (pdkv's `vllm:pdkv_load_seconds_count` moved; a failed
/// load, which vLLM recomputes, moves `vllm:pdkv_failed_loads_total` instead, a refused offer
/// `vllm:pdkv_refused_offers_total`).
fn probe_handoff(
    agent: &ureq::Agent,
    model: &str,
    prefill: &str,
    decode: &str,
    prompt: &[u64],
) -> Result<(), ProbeFailure> {
    use crate::vllm_sweep::LoadCounts;
    let counts = || -> Result<LoadCounts, String> {
        let text = agent
            .get(format!("{decode}/metrics"))
            .call()
            .map_err(|error| format!("{decode}/metrics: {error}"))?
            .body_mut()
            .read_to_string()
            .map_err(|error| format!("{decode}/metrics: {error}"))?;
        Ok(LoadCounts::from_metrics(&text))
    };
    let post = |url: String, body: serde_json::Value| -> Result<serde_json::Value, String> {
        let mut response = agent
            .post(&url)
            .send_json(&body)
            .map_err(|error| format!("{url}: {error}"))?;
        let status = response.status().as_u16();
        let answer: serde_json::Value = response
            .body_mut()
            .read_json()
            .map_err(|error| format!("{url}: {error}"))?;
        if status != 200 {
            return Err(format!("{url} answered {status}: {answer}"));
        }
        Ok(answer)
    };
    let before = counts()?;
    let answer = post(
        format!("{prefill}/v1/completions"),
        serde_json::json!({"model": model, "prompt": prompt, "max_tokens": 1, "ignore_eos": true,
                            "kv_transfer_params": {"do_remote_decode": true}}),
    )?;
    let params = answer
        .get("kv_transfer_params")
        .filter(|params| params.is_object())
        .ok_or("the prefill leg answered without kv_transfer_params (is its kv_role kv_producer?)")?
        .clone();
    post(
        format!("{decode}/v1/completions"),
        serde_json::json!({"model": model, "prompt": prompt, "max_tokens": 1, "kv_transfer_params": params}),
    )?;
    // The load's outcome reaches /metrics with an engine step's output: poll briefly.
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let after = counts()?;
        if after.loads > before.loads {
            return Ok(());
        }
        if after.refused > before.refused {
            return Err(ProbeFailure::Refused);
        }
        if after.failed > before.failed {
            return Err(
                "the decode leg's READ failed and it recomputed the prompt (its log says why)".into(),
            );
        }
        if Instant::now() >= deadline {
            return Err("the decode leg reported no READ (is pdkv_vllm installed where it runs?)".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Whether a vLLM leg's `/health` answers 200.
fn probe_health(agent: &ureq::Agent, base: &str) -> Result<(), String> {
    let response = agent
        .get(format!("{base}/health"))
        .call()
        .map_err(|error| error.to_string())?;
    match response.status().as_u16() {
        200 => Ok(()),
        status => Err(format!("/health {status}")),
    }
}

/// Whether a process's `/ready` says it serves and all its peers are linked.
fn probe_ready(agent: &ureq::Agent, base: &str) -> Result<(), String> {
    let mut response = agent
        .get(format!("{base}/ready"))
        .call()
        .map_err(|error| error.to_string())?;
    let status = response.status().as_u16();
    let body: serde_json::Value = response
        .body_mut()
        .read_json()
        .map_err(|error| error.to_string())?;
    if status == 200 && body["all_peers_linked"] == serde_json::Value::Bool(true) {
        return Ok(());
    }
    let waiting: Vec<String> = body["peers"]
        .as_object()
        .map(|peers| {
            peers
                .iter()
                .filter(|(_, peer)| peer["linked"] != serde_json::Value::Bool(true))
                .map(|(name, peer)| {
                    format!(
                        "{name}: {}",
                        peer["last_error"].as_str().unwrap_or("not linked yet")
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    Err(format!("/ready {status}, waiting for {}", waiting.join("; ")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Picked ports sit below the kernel's ephemeral range (where nothing binding port 0 can
    /// take them) and are distinct across keys, TCP or UDP.
    #[test]
    fn a_wide_pick_holds_consecutive_ports_no_other_key_holds() {
        let mut reserved = Vec::new();
        let mut first = toml::Table::new();
        let single = fill_port(&mut first, "admin_port", "127.0.0.1", false, 1, &mut reserved).unwrap();
        let mut table = toml::Table::new();
        let base = fill_port(&mut table, "data_port", "127.0.0.1", false, 3, &mut reserved).unwrap();
        assert_eq!(table["data_port"].as_integer(), Some(i64::from(base)));
        let ports: Vec<u16> = (base..base + 3).collect();
        assert!(!ports.contains(&single), "{single} in {ports:?}");
        for port in ports {
            // Held by the launcher until the node binds it.
            assert!(
                TcpListener::bind(("127.0.0.1", port)).is_err(),
                "port {port} of the pick is not held"
            );
        }
        // A fixed port is kept as it is.
        let mut fixed = toml::Table::new();
        fixed.insert("control_port".into(), toml::Value::Integer(7100));
        assert_eq!(
            fill_port(&mut fixed, "control_port", "127.0.0.1", true, 2, &mut reserved).unwrap(),
            7100
        );
    }

    #[test]
    fn picked_ports_are_below_the_ephemeral_range_and_distinct() {
        let text = "[model]\nseed = 1\nd_model = 8\nvocab = 16\nlayer_groups = [0]\n\n[[model.groups]]\nkind = \"full\"\nblock_size = 16\n\n[[nodes]]\nname = \"p\"\nrole = \"prefill\"\nblocks_per_group = 8\n\n[[nodes]]\nname = \"d\"\nrole = \"decode\"\nblocks_per_group = 8\n";
        let dir = std::env::temp_dir().join(format!("pdkv-pick-{}", std::process::id()));
        let path = prepare_run_dir(text, "test", &dir).expect("prepared");
        let config = pdkv_actors::config::ClusterConfig::from_file(&path).expect("valid");
        let ephemeral_low: u16 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .expect("linux")
            .split_whitespace()
            .next()
            .expect("low end")
            .parse()
            .expect("a port");
        let mut ports: Vec<u16> = config
            .nodes
            .iter()
            .flat_map(|node| {
                [
                    node.address.control_port,
                    node.address.data_port,
                    node.address.admin_port,
                ]
            })
            .chain([config.router.control_port, config.router.http_port])
            .collect();
        for &port in &ports {
            assert!(
                (LOWEST_PICKED_PORT..ephemeral_low).contains(&port),
                "{port} outside {LOWEST_PICKED_PORT}..{ephemeral_low}"
            );
        }
        ports.sort_unstable();
        ports.dedup();
        assert_eq!(
            ports.len(),
            8,
            "two nodes x 3 ports + the router's 2, all distinct"
        );
        std::fs::remove_dir_all(dir).ok();
    }
}
