//! Two "hosts" on one machine: the prefill leg runs in a network namespace of its own, joined to
//! this one by a veth pair, so the legs have different addresses and different host ids, shared
//! memory is not offered, and every READ goes over the network engine.
//!
//! Needs root (CI runs as root). Without root the test says so on stderr and passes, unless
//! `PDKV_REQUIRE_NETNS=1` (set by `.ci/run`) makes it fail instead.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

mod support;

use support::{certs_init, sweep_running};

const SHIPPED: &str = include_str!("../cluster.toml");

fn run(program: &str, args: &[&str]) {
    let output = Command::new(program).args(args).output().unwrap_or_else(|error| {
        panic!("{program} {args:?}: {error}");
    });
    assert!(
        output.status.success(),
        "{program} {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// A network namespace and a veth pair, removed when dropped.
struct Namespace {
    name: String,
}

impl Drop for Namespace {
    fn drop(&mut self) {
        // Deleting the namespace deletes its veth end, and with it the pair.
        let _ = Command::new("ip").args(["netns", "del", &self.name]).status();
    }
}

/// Children killed (SIGTERM, then SIGKILL) when dropped.
struct Children(Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for child in &self.0 {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(child.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
        }
        for child in &mut self.0 {
            let deadline = Instant::now() + Duration::from_secs(20);
            while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn free_port(host: &str, udp: bool) -> u16 {
    if udp {
        std::net::UdpSocket::bind((host, 0))
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    } else {
        std::net::TcpListener::bind((host, 0))
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }
}

fn ready(url: &str) -> Option<Value> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_millis(500)))
        .build()
        .into();
    let mut response = agent.get(format!("{url}/ready")).call().ok()?;
    response.body_mut().read_json().ok()
}

fn spawn(namespace: Option<&str>, args: &[&str], config: &Path, log: &Path) -> Child {
    let log = std::fs::File::create(log).unwrap();
    let mut command = match namespace {
        Some(namespace) => {
            let mut command = Command::new("ip");
            command.args(["netns", "exec", namespace, env!("CARGO_BIN_EXE_pdkv")]);
            command
        }
        None => Command::new(env!("CARGO_BIN_EXE_pdkv")),
    };
    command
        .args(args)
        .arg("--config")
        .arg(config)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap()
}

#[test]
fn legs_in_two_network_namespaces_read_over_the_network_engine() {
    if !nix::unistd::Uid::effective().is_root() {
        assert!(
            std::env::var("PDKV_REQUIRE_NETNS").as_deref() != Ok("1"),
            "PDKV_REQUIRE_NETNS=1 but not root: the network-namespace test cannot run"
        );
        eprintln!("SKIPPED legs_in_two_network_namespaces_read_over_the_network_engine: needs root");
        return;
    }
    let pid = std::process::id();
    let subnet = 10 + pid % 240;
    let (host_a, host_b) = (format!("10.231.{subnet}.1"), format!("10.231.{subnet}.2"));
    let namespace = Namespace {
        name: format!("pdkv-test-{pid}"),
    };
    let (veth_a, veth_b) = (
        format!("pdkv{}a", pid % 100_000),
        format!("pdkv{}b", pid % 100_000),
    );
    run("ip", &["netns", "add", &namespace.name]);
    run(
        "ip",
        &["link", "add", &veth_a, "type", "veth", "peer", "name", &veth_b],
    );
    run("ip", &["link", "set", &veth_b, "netns", &namespace.name]);
    run("ip", &["addr", "add", &format!("{host_a}/24"), "dev", &veth_a]);
    run("ip", &["link", "set", &veth_a, "up"]);
    let in_ns = |args: &[&str]| {
        let mut all = vec!["netns", "exec", namespace.name.as_str(), "ip"];
        all.extend_from_slice(args);
        run("ip", &all);
    };
    in_ns(&["addr", "add", &format!("{host_b}/24"), "dev", &veth_b]);
    in_ns(&["link", "set", &veth_b, "up"]);
    in_ns(&["link", "set", "lo", "up"]);

    let dir = std::env::temp_dir().join(format!("pdkv-test-netns-{pid}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // prefill-0 in the namespace (its ports are free there: nothing else runs in it); decode-0
    // and the router here, on this side of the veth pair.
    let mut text = SHIPPED[..SHIPPED.find("[[nodes]]").unwrap()].to_string();
    text.push_str(&format!(
        "[[nodes]]\nname = \"prefill-0\"\nrole = \"prefill\"\nblocks_per_group = 64\nhost = \"{host_b}\"\ncontrol_port = 7100\ndata_port = 7101\nadmin_port = 7102\n\n"
    ));
    let decode_admin = free_port(&host_a, false);
    text.push_str(&format!(
        "[[nodes]]\nname = \"decode-0\"\nrole = \"decode\"\nlookahead_tokens = 9\nblocks_per_group = 64\nhost = \"{host_a}\"\ncontrol_port = {}\ndata_port = {}\nadmin_port = {decode_admin}\n\n",
        free_port(&host_a, true),
        free_port(&host_a, false),
    ));
    let router_http = free_port(&host_a, false);
    text.push_str(&format!(
        "[router]\nhost = \"{host_a}\"\ncontrol_port = {}\nhttp_port = {router_http}\n\n[tls]\ndir = \"{}\"\n",
        free_port(&host_a, true),
        dir.join("certs").display()
    ));
    let config = dir.join("cluster.toml");
    std::fs::write(&config, text).unwrap();
    certs_init(&config, &dir.join("certs"));

    let children = Children(vec![
        spawn(
            Some(&namespace.name),
            &["node", "--node", "prefill-0"],
            &config,
            &dir.join("prefill-0.log"),
        ),
        spawn(
            None,
            &["node", "--node", "decode-0"],
            &config,
            &dir.join("decode-0.log"),
        ),
        spawn(None, &["router"], &config, &dir.join("router.log")),
    ]);
    let router = format!("http://{host_a}:{router_http}");
    let decode = format!("http://{host_a}:{decode_admin}");
    let prefill = format!("http://{host_b}:7102");
    let deadline = Instant::now() + Duration::from_secs(60);
    for url in [&router, &decode, &prefill] {
        loop {
            if ready(url).is_some_and(|ready| ready["all_peers_linked"] == true) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{url} not ready; logs in {}: {}",
                dir.display(),
                std::fs::read_to_string(dir.join("decode-0.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    let legs = [format!("prefill-0={prefill}"), format!("decode-0={decode}")];
    let summary = sweep_running(&config, &router, &legs, "1..=20,64,65,128,129,500,1101");
    assert_eq!(summary["summary"]["matched"], 26, "{summary}");
    assert_eq!(summary["summary"]["legs_idle"], true);
    assert!(summary["summary"]["read_bytes"].as_u64().unwrap() > 0);
    drop(children);
    let log = std::fs::read_to_string(dir.join("decode-0.log")).unwrap();
    assert!(
        log.contains("engine=Net"),
        "the decode leg reads over the network: {log}"
    );
    assert!(
        !log.contains("engine=Shm"),
        "shared memory is not offered across hosts: {log}"
    );
    std::fs::remove_dir_all(dir).ok();
}
