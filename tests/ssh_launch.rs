//! `launch = "ssh"`: `pdkv launch` installs a node's config and certificates on its host and
//! starts it there through the system ssh (ControlMaster, BatchMode). The "remote" host is this
//! machine, reached through an sshd the test starts on a loopback port with keys it makes.
//!
//! Needs root and `/usr/sbin/sshd` (CI installs openssh-server and runs as root). Without them
//! the test says so on stderr and passes, unless `PDKV_REQUIRE_SSHD=1` (set by `.ci/run`).

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod support;

use support::sweep_running;

const SHIPPED: &str = include_str!("../cluster.toml");
const SSHD: &str = "/usr/sbin/sshd";

/// Killed when dropped.
struct Guard(Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn run(program: &str, args: &[&str]) {
    let output = Command::new(program).args(args).output().unwrap();
    assert!(
        output.status.success(),
        "{program} {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Processes whose command line mentions `marker`.
fn processes_mentioning(marker: &str) -> Vec<u32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if pid == std::process::id() {
            continue;
        }
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        if String::from_utf8_lossy(&cmdline).contains(marker) {
            found.push(pid);
        }
    }
    found
}

#[test]
fn a_node_on_another_host_is_installed_started_and_stopped_through_ssh() {
    let root = nix::unistd::Uid::effective().is_root();
    if !root || !Path::new(SSHD).exists() {
        assert!(
            std::env::var("PDKV_REQUIRE_SSHD").as_deref() != Ok("1"),
            "PDKV_REQUIRE_SSHD=1 but root = {root} and {SSHD} exists = {}",
            Path::new(SSHD).exists()
        );
        eprintln!(
            "SKIPPED a_node_on_another_host_is_installed_started_and_stopped_through_ssh: needs root and {SSHD}"
        );
        return;
    }
    let dir = std::env::temp_dir().join(format!("pdkv-test-ssh-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = |name: &str| dir.join(name).display().to_string();
    for key in ["hostkey", "userkey"] {
        run("ssh-keygen", &["-q", "-t", "ed25519", "-N", "", "-f", &path(key)]);
    }
    std::fs::copy(dir.join("userkey.pub"), dir.join("authorized_keys")).unwrap();
    std::fs::create_dir_all("/run/sshd").unwrap();
    let port = free_port();
    let sshd = Guard(
        Command::new(SSHD)
            .args(["-D", "-e", "-p", &port.to_string(), "-h", &path("hostkey")])
            .args([
                "-o",
                "ListenAddress=127.0.0.1",
                "-o",
                "PermitRootLogin=yes",
                "-o",
                "UsePAM=no",
            ])
            .args(["-o", "StrictModes=no", "-o", "PasswordAuthentication=no"])
            .args(["-o", &format!("AuthorizedKeysFile={}", path("authorized_keys"))])
            .args(["-o", &format!("PidFile={}", path("sshd.pid"))])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("sshd.log")).unwrap())
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "sshd did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::fs::write(
        dir.join("ssh_config"),
        format!(
            "Host pdkv-remote\n  HostName 127.0.0.1\n  Port {port}\n  User root\n  IdentityFile {}\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n",
            path("userkey")
        ),
    )
    .unwrap();

    // decode-0 on the "remote" host, with fixed ports (they cannot be picked from here).
    let mut text = SHIPPED.to_string();
    let decode = text.find("name = \"decode-0\"").unwrap();
    text.insert_str(
        decode,
        &format!(
            "launch = \"ssh\"\nssh = \"pdkv-remote\"\ncontrol_port = {}\ndata_port = {}\nadmin_port = {}\n",
            free_port(),
            free_port(),
            free_port()
        ),
    );
    let config = dir.join("cluster.toml");
    std::fs::write(&config, &text).unwrap();
    let run_dir = dir.join("run");
    let mut launch = Command::new(env!("CARGO_BIN_EXE_pdkv"))
        .args(["launch", "--config"])
        .arg(&config)
        .arg("--run-dir")
        .arg(&run_dir)
        .arg("--ssh-config")
        .arg(dir.join("ssh_config"))
        .args(["--remote-bin", env!("CARGO_BIN_EXE_pdkv")])
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(dir.join("launch.err")).unwrap())
        .spawn()
        .unwrap();
    let mut router = None;
    for line in BufReader::new(launch.stdout.take().unwrap())
        .lines()
        .map_while(Result::ok)
    {
        if let Some(rest) = line.strip_prefix("READY router=") {
            router = rest.split_whitespace().next().map(str::to_string);
            break;
        }
    }
    let Some(router) = router else {
        let _ = launch.kill();
        panic!(
            "launch failed: {}",
            std::fs::read_to_string(dir.join("launch.err")).unwrap_or_default()
        );
    };
    let remote_marker = format!("pdkv-run-run-{}", launch.id());
    let remote = processes_mentioning(&remote_marker);
    assert!(
        !remote.is_empty(),
        "the node started over ssh runs from {remote_marker}"
    );

    let summary = sweep_running(&config, &router, &[], "1,64,65,300,1101");
    assert_eq!(summary["summary"]["matched"], 5);

    // Ctrl-C: the ssh session ends, the remote node drains on SIGHUP and exits; nothing of the
    // run is left, the shared ssh connection included.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(launch.id() as i32),
        nix::sys::signal::Signal::SIGINT,
    )
    .unwrap();
    assert_eq!(launch.wait().unwrap().code(), Some(0));
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let left: Vec<u32> = processes_mentioning(&remote_marker)
            .into_iter()
            .chain(processes_mentioning(&run_dir.display().to_string()))
            .collect();
        if left.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "processes left behind: {left:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let log = std::fs::read_to_string(run_dir.join("decode-0.log")).unwrap();
    assert!(log.contains("READY node=decode-0"), "{log}");
    drop(sshd);
    let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
    let _ = std::fs::remove_dir_all(Path::new(&home).join(&remote_marker));
    std::fs::remove_dir_all(dir).ok();
}
