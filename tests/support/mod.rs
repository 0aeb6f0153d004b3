//! Helpers shared by the tests that run clusters of real processes.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

pub const SHIPPED: &str = include_str!("../../cluster.toml");

pub fn pdkv() -> Command {
    Command::new(env!("CARGO_BIN_EXE_pdkv"))
}

pub fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("pdkv-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The shipped cluster.toml with its nodes replaced by `prefill` prefill and `decode` decode legs.
pub fn cluster_toml(prefill: usize, decode: usize) -> String {
    let mut text = SHIPPED[..SHIPPED.find("[[nodes]]").unwrap()].to_string();
    for (role, count, lookahead) in [("prefill", prefill, 0), ("decode", decode, 9)] {
        for index in 0..count {
            text.push_str(&format!(
                "[[nodes]]\nname = \"{role}-{index}\"\nrole = \"{role}\"\nlookahead_tokens = {lookahead}\nblocks_per_group = 64\n\n"
            ));
        }
    }
    text
}

/// `pdkv launch --config config --run-dir run_dir extra…`.
pub fn launch_command(config: &Path, run_dir: &Path, extra: &[&str]) -> Command {
    let mut command = pdkv();
    command
        .args(["launch", "--config"])
        .arg(config)
        .arg("--run-dir")
        .arg(run_dir)
        .args(extra);
    command
}

/// A running `pdkv launch`; interrupted (Ctrl-C) and waited for when dropped.
pub struct Launched {
    pub child: Child,
    pub router: String,
    /// (name, pid, admin URL) per process.
    pub members: Vec<(String, u32, String)>,
    pub run_dir: PathBuf,
}

impl Launched {
    pub fn start(config: &Path, run_dir: &Path) -> Launched {
        Self::start_with(config, run_dir, &[])
    }

    /// Starts `pdkv launch` with `extra` arguments.
    pub fn start_with(config: &Path, run_dir: &Path, extra: &[&str]) -> Launched {
        Self::start_within(config, run_dir, extra, Duration::from_secs(60))
    }

    /// [`Launched::start_with`], waiting at most `ready` for the cluster (vLLM legs take
    /// minutes on a loaded CPU).
    pub fn start_within(config: &Path, run_dir: &Path, extra: &[&str], ready: Duration) -> Launched {
        Self::start_command(launch_command(config, run_dir, extra), run_dir, ready)
    }

    /// Runs a `pdkv launch` command (from [`launch_command`]) until its cluster is ready, at most
    /// `ready`.
    pub fn start_command(mut command: Command, run_dir: &Path, ready: Duration) -> Launched {
        let mut child = command
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (lines_tx, lines_rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if lines_tx.send(line).is_err() {
                    break;
                }
            }
        });
        let deadline = Instant::now() + ready;
        let mut members = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = match lines_rx.recv_timeout(left) {
                Ok(line) => line,
                Err(_) => {
                    let _ = child.kill();
                    let output = child.wait_with_output().unwrap();
                    panic!(
                        "launch did not get ready: {}",
                        String::from_utf8_lossy(&output.stderr)
                    );
                }
            };
            if let Some(rest) = line.strip_prefix("READY router=") {
                let router = rest.split_whitespace().next().unwrap().to_string();
                return Launched {
                    child,
                    router,
                    members,
                    run_dir: run_dir.to_path_buf(),
                };
            }
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.len() >= 4 && fields[1] == "pid" {
                members.push((
                    fields[0].to_string(),
                    fields[2].parse().unwrap(),
                    fields[3].to_string(),
                ));
            }
        }
    }

    pub fn admin(&self, name: &str) -> &str {
        &self.members.iter().find(|member| member.0 == name).unwrap().2
    }

    /// Ctrl-C; returns the launcher's exit code.
    pub fn interrupt(mut self) -> i32 {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGINT,
        )
        .unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.code().unwrap_or(-1);
            }
            assert!(Instant::now() < deadline, "launch did not stop");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Launched {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(self.child.id() as i32),
                nix::sys::signal::Signal::SIGINT,
            );
            let _ = self.child.wait();
        }
    }
}

pub fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(60)))
        .build()
        .into()
}

pub fn get(url: &str) -> (u16, String) {
    let mut response = agent().get(url).call().unwrap();
    (
        response.status().as_u16(),
        response.body_mut().read_to_string().unwrap(),
    )
}

/// Polls `url` (a `/metrics` page) every 20 ms until `ready` holds for its text, which it
/// returns; fails naming `what` after 10 s.
pub fn wait_for_metrics(url: &str, what: &str, ready: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, metrics) = get(url);
        if ready(&metrics) {
            return metrics;
        }
        assert!(Instant::now() < deadline, "{what}: {metrics}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A Prometheus sample's value.
pub fn sample(metrics: &str, key: &str) -> Option<f64> {
    metrics
        .lines()
        .find_map(|line| line.strip_prefix(key)?.strip_prefix(' ')?.trim().parse().ok())
}

pub fn process_alive(pid: u32) -> bool {
    // Signal 0 checks existence; a reaped child is gone (ESRCH).
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), None).is_ok()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|stat| stat.split_whitespace().nth(2) == Some("Z"))
            .unwrap_or(true)
}

/// `pdkv sweep` against a running router (`--legs` checked for leaks): asserts it exits 0 and
/// returns its summary line.
pub fn sweep_running(config: &Path, router: &str, legs: &[String], lengths: &str) -> serde_json::Value {
    let mut command = pdkv();
    command.args(["sweep", "--config"]).arg(config).args([
        "--router",
        router,
        "--json",
        "--lengths",
        lengths,
    ]);
    if !legs.is_empty() {
        command.args(["--legs", &legs.join(",")]);
    }
    let output = command.output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(
        output.status.code(),
        Some(0),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_str(stdout.lines().last().unwrap()).unwrap()
}

/// `pdkv certs init --config config --out out`, asserting it succeeds.
pub fn certs_init(config: &Path, out: &Path) {
    let status = pdkv()
        .args(["certs", "init", "--config"])
        .arg(config)
        .arg("--out")
        .arg(out)
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
}

/// Ports free on loopback right now (held until returned, then released).
pub fn free_ports(count: usize) -> Vec<u16> {
    let sockets: Vec<std::net::TcpListener> = (0..count)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    sockets
        .iter()
        .map(|socket| socket.local_addr().unwrap().port())
        .collect()
}

/// The shipped 1P1D cluster.toml with fixed ports — prefill-0 and decode-0 at (control, data,
/// admin), the router at (control, http) — and its certificates in `dir/certs`.
pub fn fixed_ports_toml(dir: &Path, prefill: [u16; 3], decode: [u16; 3], router: [u16; 2]) -> String {
    let placed = |[control, data, admin]: [u16; 3]| {
        format!("blocks_per_group = 64\ncontrol_port = {control}\ndata_port = {data}\nadmin_port = {admin}\n")
    };
    let mut text = cluster_toml(1, 1);
    text = text.replacen("blocks_per_group = 64\n", &placed(prefill), 1);
    let second = text.rfind("blocks_per_group = 64\n").unwrap();
    text.replace_range(second..second + "blocks_per_group = 64\n".len(), &placed(decode));
    text.push_str(&format!(
        "\n[router]\ncontrol_port = {}\nhttp_port = {}\n\n[tls]\ndir = \"{}\"\n",
        router[0],
        router[1],
        dir.join("certs").display()
    ));
    text
}

/// [`fixed_ports_toml`] with eight ports from [`free_ports`]: prefill-0 at `ports[0..3]`, decode-0
/// at `ports[3..6]`, the router at `ports[6..8]`.
pub fn fixed_ports_cluster(dir: &Path, ports: &[u16]) -> String {
    fixed_ports_toml(
        dir,
        [ports[0], ports[1], ports[2]],
        [ports[3], ports[4], ports[5]],
        [ports[6], ports[7]],
    )
}

/// Starts `pdkv node --node name --config config` with `env` added, and waits for its first
/// stdout line (READY when it started).
pub fn start_node(config: &Path, name: &str, env: &[(&str, &std::ffi::OsStr)]) -> (Child, String) {
    let mut command = pdkv();
    command
        .args(["node", "--node", name, "--config"])
        .arg(config)
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    for (key, value) in env {
        command.env(key, value);
    }
    let mut child = command.spawn().unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    (child, line)
}
