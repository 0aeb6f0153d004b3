//! `pdkv launch --render slurm|k8s`: the rendered files parse, hold the expected objects, and
//! the sbatch script really starts a working cluster when `scontrol` and `srun` are stand-ins
//! that run each step here (hosts 127.0.0.1 and 127.0.0.2).

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use pdkv_actors::config::ClusterConfig;
use serde::Deserialize;
use serde_json::Value;

mod support;

use support::sweep_running;

const SHIPPED: &str = include_str!("../cluster.toml");

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("pdkv-test-render-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn render(target: &str, config: &Path, out: &Path) {
    let output = Command::new(env!("CARGO_BIN_EXE_pdkv"))
        .args(["launch", "--render", target, "--config"])
        .arg(config)
        .arg("--out")
        .arg(out)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

fn executable(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// 2P1D: two pods of one StatefulSet run two different nodes.
#[test]
fn kubernetes_manifests_hold_a_workload_per_role_with_probes_and_certificates() {
    let dir = temp_dir("k8s");
    let mut text = SHIPPED[..SHIPPED.find("[[nodes]]").unwrap()].to_string();
    for (name, role) in [("p-a", "prefill"), ("p-b", "prefill"), ("d-a", "decode")] {
        text.push_str(&format!(
            "[[nodes]]\nname = \"{name}\"\nrole = \"{role}\"\nblocks_per_group = 64\n\n"
        ));
    }
    let config = dir.join("cluster.toml");
    std::fs::write(&config, &text).unwrap();
    render("k8s", &config, &dir.join("out"));
    // Rendering again over the certificates it wrote is refused without --force.
    let again = Command::new(env!("CARGO_BIN_EXE_pdkv"))
        .args(["launch", "--render", "k8s", "--config"])
        .arg(&config)
        .arg("--out")
        .arg(dir.join("out"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&again.stderr);
    assert_eq!(again.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("already holds a CA") && stderr.contains("--force"),
        "{stderr}"
    );
    let ca = std::fs::read_to_string(dir.join("out/certs/ca.pem")).unwrap();
    let forced = Command::new(env!("CARGO_BIN_EXE_pdkv"))
        .args(["launch", "--render", "k8s", "--force", "--config"])
        .arg(&config)
        .arg("--out")
        .arg(dir.join("out"))
        .output()
        .unwrap();
    assert!(
        forced.status.success(),
        "{}",
        String::from_utf8_lossy(&forced.stderr)
    );
    assert_ne!(
        std::fs::read_to_string(dir.join("out/certs/ca.pem")).unwrap(),
        ca,
        "--force mints a new CA"
    );
    let yaml = std::fs::read_to_string(dir.join("out/pdkv.yaml")).unwrap();
    let documents: Vec<Value> = yaml_serde::Deserializer::from_str(&yaml)
        .map(|document| Value::deserialize(document).unwrap())
        .collect();
    let find = |kind: &str, name: &str| -> &Value {
        documents
            .iter()
            .find(|document| document["kind"] == kind && document["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("no {kind} {name} in {yaml}"))
    };
    let secret = find("Secret", "pdkv-certs");
    for file in [
        "ca.pem",
        "p-a.pem",
        "p-a.key",
        "p-b.pem",
        "d-a.key",
        "router.pem",
        "router.key",
    ] {
        assert!(
            secret["stringData"][file]
                .as_str()
                .unwrap()
                .starts_with("-----BEGIN"),
            "{file}"
        );
    }
    let toml = find("ConfigMap", "pdkv-config")["data"]["cluster.toml"]
        .as_str()
        .unwrap();
    let placed = ClusterConfig::from_toml(toml).unwrap();
    assert_eq!(placed.nodes[1].address.host, "pdkv-prefill-1.pdkv-prefill");
    assert_eq!(placed.nodes[2].address.host, "pdkv-decode-0.pdkv-decode");
    assert_eq!(placed.nodes[2].address.bind.as_deref(), Some("0.0.0.0"));
    assert_eq!(placed.router.host, "pdkv-router-0.pdkv-router");
    assert_eq!(placed.tls.as_ref().unwrap().dir, PathBuf::from("/etc/pdkv/certs"));
    for (role, replicas) in [("prefill", 2), ("decode", 1), ("router", 1)] {
        let service = find("Service", &format!("pdkv-{role}"));
        assert_eq!(service["spec"]["clusterIP"], "None");
        assert_eq!(service["spec"]["publishNotReadyAddresses"], true);
        let set = find("StatefulSet", &format!("pdkv-{role}"));
        assert_eq!(set["spec"]["replicas"], replicas);
        assert_eq!(set["spec"]["serviceName"], format!("pdkv-{role}"));
        let pod = &set["spec"]["template"]["spec"];
        assert_eq!(pod["securityContext"]["runAsNonRoot"], true, "{role}");
        assert!(
            pod["securityContext"]["runAsUser"].as_u64().unwrap() > 0,
            "{role}"
        );
        let container = &pod["containers"][0];
        let probe_port = container["readinessProbe"]["httpGet"]["port"].as_str().unwrap();
        assert_eq!(
            container["image"],
            format!("pdkv:{}", env!("CARGO_PKG_VERSION")),
            "the image of this version"
        );
        assert_eq!(container["securityContext"]["allowPrivilegeEscalation"], false);
        assert_eq!(container["securityContext"]["capabilities"]["drop"][0], "ALL");
        let memory = |quantity: &Value| -> u64 {
            quantity
                .as_str()
                .unwrap()
                .strip_suffix("Mi")
                .unwrap()
                .parse::<u64>()
                .unwrap()
                << 20
        };
        let requested = memory(&container["resources"]["requests"]["memory"]);
        assert!(
            memory(&container["resources"]["limits"]["memory"]) >= requested,
            "{role}"
        );
        if role != "router" {
            // A leg's pod holds its KV: 4 layers x 65 blocks x 64 tokens x d_model 32 x K and V
            // as f32, plus bookkeeping, plus the base allowance.
            let kv = 4 * 65 * 64 * 32 * 2 * 4;
            assert!(
                requested >= kv + (256 << 20),
                "{role}: {requested} < {kv} + 256 MiB"
            );
            assert_eq!(
                container["resources"]["requests"]["cpu"], "3",
                "two compute workers and one"
            );
        }
        assert_eq!(container["readinessProbe"]["httpGet"]["path"], "/ready");
        assert_eq!(container["livenessProbe"]["httpGet"]["path"], "/live");
        let port = container["ports"]
            .as_array()
            .unwrap()
            .iter()
            .find(|port| port["name"] == probe_port)
            .unwrap_or_else(|| panic!("probe port {probe_port} is not a container port"))["containerPort"]
            .as_u64()
            .unwrap();
        let expected = match role {
            "router" => placed.router.http_port,
            _ => {
                placed
                    .nodes
                    .iter()
                    .find(|node| node.role.to_string() == role)
                    .unwrap()
                    .address
                    .admin_port
            }
        };
        assert_eq!(port, u64::from(expected), "{role} probes its admin/http port");
    }
    assert_eq!(
        find("Service", "pdkv-api")["spec"]["selector"]["app.kubernetes.io/name"],
        "pdkv-router"
    );
    // Pod pdkv-prefill-1 runs the second prefill node: run its command with a stand-in `pdkv`.
    let set = find("StatefulSet", "pdkv-prefill");
    let script = set["spec"]["template"]["spec"]["containers"][0]["command"][2]
        .as_str()
        .unwrap();
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    executable(&bin.join("pdkv"), "#!/bin/sh\necho \"$@\"\n");
    let output = Command::new("/bin/sh")
        .args(["-c", script])
        .env("HOSTNAME", "pdkv-prefill-1")
        .env("PATH", format!("{}:/usr/bin:/bin", bin.display()))
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&output.stdout).trim(),
        "node --config /etc/pdkv/config/cluster.toml --node p-b"
    );
    std::fs::remove_dir_all(dir).ok();
}

/// The pid of this test's `pdkv node --node name` (its command line read from /proc).
fn node_process(name: &str) -> Option<nix::unistd::Pid> {
    let wanted = format!("\0--node\0{name}\0");
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|entry| {
        let pid: i32 = entry.file_name().to_str()?.parse().ok()?;
        let cmdline = std::fs::read(entry.path().join("cmdline")).ok()?;
        let cmdline = String::from_utf8_lossy(&cmdline);
        (cmdline.starts_with(env!("CARGO_BIN_EXE_pdkv"))
            && cmdline.contains(&wanted)
            && cmdline.contains("run-42"))
        .then(|| nix::unistd::Pid::from_raw(pid))
    })
}

fn free_port(host: &str) -> u16 {
    std::net::TcpListener::bind((host, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn the_sbatch_script_starts_a_working_cluster() {
    let dir = temp_dir("slurm");
    // Fixed, free ports: node 0 and the router on 127.0.0.1, node 1 on 127.0.0.2.
    let (a, b) = ("127.0.0.1", "127.0.0.2");
    let mut text = SHIPPED[..SHIPPED.find("[[nodes]]").unwrap()].to_string();
    text.push_str(&format!(
        "[[nodes]]\nname = \"prefill-0\"\nrole = \"prefill\"\nblocks_per_group = 64\ncontrol_port = {}\ndata_port = {}\nadmin_port = {}\n\n",
        free_port(a),
        free_port(a),
        free_port(a)
    ));
    let decode_admin = free_port(b);
    text.push_str(&format!(
        "[[nodes]]\nname = \"decode-0\"\nrole = \"decode\"\nlookahead_tokens = 9\nblocks_per_group = 64\ncontrol_port = {}\ndata_port = {}\nadmin_port = {decode_admin}\n\n",
        free_port(b),
        free_port(b)
    ));
    let http = free_port(a);
    text.push_str(&format!(
        "[router]\ncontrol_port = {}\nhttp_port = {http}\n",
        free_port(a)
    ));
    let config = dir.join("cluster.toml");
    std::fs::write(&config, &text).unwrap();
    let rendered = dir.join("out");
    render("slurm", &config, &rendered);
    // The rendered directory works from wherever it is moved to.
    let out = dir.join("moved");
    std::fs::rename(&rendered, &out).unwrap();
    let script = out.join("pdkv.sbatch");
    let syntax = Command::new("bash").arg("-n").arg(&script).output().unwrap();
    assert!(
        syntax.status.success(),
        "{}",
        String::from_utf8_lossy(&syntax.stderr)
    );
    let sbatch = std::fs::read_to_string(&script).unwrap();
    assert!(sbatch.contains("#SBATCH --nodes=2"), "{sbatch}");
    assert_eq!(
        sbatch.matches("srun ").count(),
        3,
        "one step per node and the router"
    );

    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    executable(
        &bin.join("scontrol"),
        &format!("#!/bin/sh\nprintf '{a}\\n{b}\\n'\n"),
    );
    executable(
        &bin.join("srun"),
        "#!/bin/sh\nout=/dev/null\nwhile [ $# -gt 0 ]; do\n  case \"$1\" in\n    --output=*) out=\"${1#--output=}\"; shift ;;\n    --*) shift ;;\n    *) break ;;\n  esac\ndone\nexec \"$@\" >\"$out\" 2>&1\n",
    );
    let mut job = Command::new("bash")
        .arg(&script)
        .env(
            "PATH",
            format!("{}:{}", bin.display(), std::env::var("PATH").unwrap()),
        )
        .env("PDKV_BIN", env!("CARGO_BIN_EXE_pdkv"))
        .env("SLURM_JOB_ID", "42")
        .env("SLURM_JOB_NODELIST", "stand-in[1-2]")
        .env("RUST_LOG", "info")
        .env_remove("PDKV_RENDER_DIR")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let router = format!("http://{a}:{http}");
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_millis(500)))
        .build()
        .into();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let ready = agent
            .get(format!("{router}/ready"))
            .call()
            .ok()
            .and_then(|mut response| response.body_mut().read_json::<Value>().ok());
        if ready.is_some_and(|ready| ready["all_peers_linked"] == true) {
            break;
        }
        assert!(
            job.try_wait().unwrap().is_none(),
            "the job ended before the cluster was ready"
        );
        assert!(
            Instant::now() < deadline,
            "not ready; logs in {}",
            out.join("run-42").display()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    sweep_running(&out.join("run-42/cluster.toml"), &router, &[], "1,100,500");
    // decode-0 dies: the job ends on its own, naming it and its status.
    let decode = node_process("decode-0").expect("the decode node's process");
    nix::sys::signal::kill(decode, nix::sys::signal::Signal::SIGKILL).unwrap();
    let mut stderr = String::new();
    std::io::Read::read_to_string(job.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    let status = job.wait().unwrap();
    assert_eq!(
        status.code(),
        Some(128 + 9),
        "the job exits with the node's status: {stderr}"
    );
    assert!(
        stderr.contains("decode-0") && stderr.contains("exited with status 137"),
        "the job names the process that ended it: {stderr}"
    );
    // The trap stopped every step: no pdkv process of this job is left.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let listening = std::net::TcpStream::connect((a, http)).is_ok()
            || std::net::TcpStream::connect((b, decode_admin)).is_ok();
        if !listening {
            break;
        }
        assert!(Instant::now() < deadline, "a step outlived the job");
        std::thread::sleep(Duration::from_millis(50));
    }
    let placed = std::fs::read_to_string(out.join("run-42/cluster.toml")).unwrap();
    assert!(placed.contains(&format!("host = \"{b}\"")), "{placed}");
    std::fs::remove_dir_all(dir).ok();
}

/// A cluster of vLLM legs: every pod runs `pdkv node` (which execs vLLM's server), its probes
/// are vLLM's `/health` with a start-up allowance for loading the model, and the Secret holds a
/// certificate for every worker rank (decode `-tp 2`: `d-a` and `d-a-1`). The sbatch script
/// starts each leg with `pdkv node` too.
#[test]
fn vllm_legs_render_with_health_probes_and_a_certificate_per_rank() {
    let dir = temp_dir("vllm");
    let text = "[engines.vllm]\npython = \"/opt/vllm/bin/python\"\nmodel = \"/models/m\"\nserved_model_name = \"m\"\n\n[[nodes]]\nname = \"p-a\"\nrole = \"prefill\"\nengine = \"vllm\"\n\n[[nodes]]\nname = \"d-a\"\nrole = \"decode\"\nengine = \"vllm\"\nengine_args = [\"-tp\", \"2\"]\n";
    let config = dir.join("cluster.toml");
    std::fs::write(&config, text).unwrap();
    render("k8s", &config, &dir.join("k8s"));
    let yaml = std::fs::read_to_string(dir.join("k8s/pdkv.yaml")).unwrap();
    let documents: Vec<Value> = yaml_serde::Deserializer::from_str(&yaml)
        .map(|document| Value::deserialize(document).unwrap())
        .collect();
    let find = |kind: &str, name: &str| -> &Value {
        documents
            .iter()
            .find(|document| document["kind"] == kind && document["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("no {kind} {name} in {yaml}"))
    };
    let secret = find("Secret", "pdkv-certs");
    for file in ["p-a.pem", "d-a.key", "d-a-1.pem", "d-a-1.key", "router.pem"] {
        assert!(secret["stringData"][file].is_string(), "{file}");
    }
    for role in ["prefill", "decode"] {
        let container =
            &find("StatefulSet", &format!("pdkv-{role}"))["spec"]["template"]["spec"]["containers"][0];
        assert_eq!(
            container["readinessProbe"]["httpGet"]["path"], "/health",
            "{role}"
        );
        assert_eq!(container["livenessProbe"]["httpGet"]["path"], "/health", "{role}");
        assert_eq!(container["startupProbe"]["failureThreshold"], 60, "{role}");
    }
    let router = &find("StatefulSet", "pdkv-router")["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(router["readinessProbe"]["httpGet"]["path"], "/ready");
    // The pod's cluster.toml gives each leg its vLLM command (the host names resolve there;
    // here the command is checked with the prefill bound to loopback).
    let toml = find("ConfigMap", "pdkv-config")["data"]["cluster.toml"]
        .as_str()
        .unwrap();
    let local = toml
        .replace("pdkv-prefill-0.pdkv-prefill", "127.0.0.1")
        .replace("pdkv-decode-0.pdkv-decode", "127.0.0.2");
    let pod_config = dir.join("pod.toml");
    std::fs::write(&pod_config, local).unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_pdkv"))
        .args(["node", "--dry-run", "--node", "p-a", "--config"])
        .arg(&pod_config)
        .output()
        .unwrap();
    let line = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        line.contains("/opt/vllm/bin/python -m vllm.entrypoints.openai.api_server --model /models/m"),
        "{line}"
    );
    assert!(line.contains("--host 0.0.0.0 --port 7102"), "{line}");
    assert!(
        line.contains(r#""listen":"0.0.0.0:7100""#) && line.contains(r#""advertise":"127.0.0.1:7100""#),
        "{line}"
    );
    assert!(line.contains(r#""certs":"/etc/pdkv/certs""#), "{line}");
    render("slurm", &config, &dir.join("slurm"));
    let script = std::fs::read_to_string(dir.join("slurm/pdkv.sbatch")).unwrap();
    for node in ["p-a", "d-a"] {
        assert!(
            script.contains(&format!("node --config \"$RUN/cluster.toml\" --node {node}")),
            "{script}"
        );
    }
    std::fs::remove_dir_all(dir).ok();
}
