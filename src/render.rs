//! `pdkv launch --render slurm|k8s`: files that run a cluster.toml's nodes and router as
//! `pdkv node` / `pdkv router` under Slurm or Kubernetes. pdkv writes them and orchestrates
//! nothing.
//!
//! - **Slurm**: `pdkv.sbatch` asks for one host per node, takes the hosts from the allocation
//!   (`scontrol show hostnames`), writes them into `cluster.toml.in`'s placeholders and starts one
//!   `srun` per process (the router beside the first node); the first process to exit ends the
//!   job. The rendered directory must be on a filesystem every host sees.
//! - **Kubernetes**: `pdkv.yaml` holds a Secret with the certificates, a ConfigMap with the
//!   cluster.toml, and per role a headless Service and a StatefulSet whose pods run one node
//!   each (pod `pdkv-<role>-<i>` runs the role's i-th node in file order), with readiness and
//!   liveness probes on the admin port; the router is a StatefulSet of one with a `pdkv-api`
//!   Service for clients.
//!
//! Ports left at 0 become fixed defaults (nodes 7100/7101/7102, router 7000 and 8000), since
//! nothing picks free ports on another host. Without `[tls]` a new CA and certificates are
//! written under `certs/`.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, bail};
use pdkv_actors::config::{AnyCluster, ROUTER_NODE};
use pdkv_actors::engines::EngineKind;
use pdkv_core::wire::Role;
use pdkv_transport::tls::{Existing, write_cluster_certs};
use serde_json::{Value, json};

/// Default control, data and admin ports of a node on a host of its own.
const NODE_PORTS: (u16, u16, u16) = (7100, 7101, 7102);

/// Default control and HTTP ports of the router.
const ROUTER_PORTS: (u16, u16) = (7000, 8000);

/// Where certificates and the config are mounted in a pod.
const POD_CERTS: &str = "/etc/pdkv/certs";
const POD_CONFIG: &str = "/etc/pdkv/config";

/// What to render for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Target {
    /// An sbatch script.
    Slurm,
    /// Kubernetes manifests.
    K8s,
}

fn port(table: &toml::Table, key: &str, default: u16) -> u16 {
    match table.get(key).and_then(toml::Value::as_integer) {
        Some(port) if port != 0 => port as u16,
        _ => default,
    }
}

fn set(table: &mut toml::Table, key: &str, value: impl Into<toml::Value>) {
    table.insert(key.into(), value.into());
}

/// The certificates the rendered files use.
enum Certificates {
    /// `[tls] dir`, made absolute: the operator's own, used where they are.
    Given(std::path::PathBuf),
    /// Written into `out/certs`: they move with the rendered directory.
    Rendered(std::path::PathBuf),
}

impl Certificates {
    fn dir(&self) -> &Path {
        match self {
            Certificates::Given(dir) | Certificates::Rendered(dir) => dir,
        }
    }
}

/// The certificate directory the rendered files use: `[tls] dir`, or new certificates in
/// `out/certs` — refused over existing ones unless `force`, since a new CA would lock out the
/// nodes that run with the old one.
fn certificates(config: &AnyCluster, out: &Path, force: bool) -> anyhow::Result<Certificates> {
    if let Some(tls) = config.tls() {
        return std::path::absolute(&tls.dir)
            .map(Certificates::Given)
            .with_context(|| format!("cannot resolve {}", tls.dir.display()));
    }
    let certs = out.join("certs");
    if certs.join("ca.pem").exists() && !force {
        bail!(
            "{} already holds a CA: rendering again would mint a new one that nodes started from the earlier files do not trust; pass --force to replace it, or set [tls] dir to keep using it",
            certs.display()
        );
    }
    let names = crate::launch::certificate_names(config);
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    write_cluster_certs(&certs, "pdkv", &names, Existing::Replace)
        .with_context(|| format!("cannot write certificates to {}", certs.display()))?;
    Ok(Certificates::Rendered(certs))
}

/// Rewrites every node's and the router's host and ports: `host_of(index)` names node
/// `index`'s host (`None` for the router), and `bind` the address listeners bind.
fn placed(
    config_text: &str,
    host_of: impl Fn(Option<usize>) -> String,
    bind: Option<&str>,
    tls_dir: &str,
) -> anyhow::Result<toml::Table> {
    let mut doc: toml::Table = config_text.parse().context("cluster.toml is not TOML")?;
    if let Some(toml::Value::Array(nodes)) = doc.get_mut("nodes") {
        for (index, node) in nodes.iter_mut().enumerate() {
            let toml::Value::Table(table) = node else {
                bail!("nodes must be tables");
            };
            let (control, data, admin) = (
                port(table, "control_port", NODE_PORTS.0),
                port(table, "data_port", NODE_PORTS.1),
                port(table, "admin_port", NODE_PORTS.2),
            );
            set(table, "host", host_of(Some(index)));
            set(table, "control_port", i64::from(control));
            set(table, "data_port", i64::from(data));
            set(table, "admin_port", i64::from(admin));
            if let Some(bind) = bind {
                set(table, "bind", bind);
            }
            table.remove("launch");
            table.remove("ssh");
        }
    }
    let router = doc
        .entry("router")
        .or_insert_with(|| toml::Value::Table(toml::Table::new()));
    let toml::Value::Table(router) = router else {
        bail!("[router] must be a table");
    };
    let (control, http) = (
        port(router, "control_port", ROUTER_PORTS.0),
        port(router, "http_port", ROUTER_PORTS.1),
    );
    set(router, "host", host_of(None));
    set(router, "control_port", i64::from(control));
    set(router, "http_port", i64::from(http));
    if let Some(bind) = bind {
        set(router, "bind", bind);
    }
    let mut tls = toml::Table::new();
    set(&mut tls, "dir", tls_dir);
    doc.insert("tls".into(), toml::Value::Table(tls));
    Ok(doc)
}

/// Writes the files for `target` into `out` (replacing certificates rendered there before only
/// with `force`); returns the paths written.
pub fn render(
    target: Target,
    config_text: &str,
    out: &Path,
    image: &str,
    force: bool,
) -> anyhow::Result<Vec<std::path::PathBuf>> {
    let config = AnyCluster::from_toml(config_text)?;
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let out = out
        .canonicalize()
        .with_context(|| format!("cannot resolve {}", out.display()))?;
    let certs = certificates(&config, &out, force)?;
    match target {
        Target::Slurm => render_slurm(&config, config_text, &out, &certs),
        Target::K8s => render_k8s(&config, config_text, &out, certs.dir(), image),
    }
}

fn render_slurm(
    config: &AnyCluster,
    config_text: &str,
    out: &Path,
    certs: &Certificates,
) -> anyhow::Result<Vec<std::path::PathBuf>> {
    // Rendered certificates are found from wherever the rendered directory is at run time.
    let tls_dir = match certs {
        Certificates::Given(dir) => dir.display().to_string(),
        Certificates::Rendered(_) => "@RENDER_DIR@/certs".to_string(),
    };
    let doc = placed(
        config_text,
        |index| format!("@HOST_{}@", index.unwrap_or(0)),
        None,
        &tls_dir,
    )?;
    let text = toml::to_string(&doc)?;
    // Checked with stand-in host names: the router shares the first node's host, so their
    // ports must differ.
    let checked = AnyCluster::from_toml(
        &text
            .replace("@RENDER_DIR@", &out.display().to_string())
            .replace("@HOST_", "host-")
            .replace('@', ""),
    )
    .context("the rendered cluster.toml is not valid")?;
    let template = out.join("cluster.toml.in");
    std::fs::write(&template, text)?;
    let nodes = config.placed();
    let hosts = nodes.len();
    let mut script = format!(
        r#"#!/usr/bin/env bash
# Rendered by `pdkv launch --render slurm`: one host per pdkv node, the router beside the first.
# Submit with `sbatch pdkv.sbatch` from this directory (or set PDKV_RENDER_DIR); the directory
# must be visible on every host, and may be moved: paths in it are found from where it is.
#SBATCH --job-name=pdkv
#SBATCH --nodes={hosts}
#SBATCH --ntasks={tasks}
#SBATCH --output=pdkv-%j.out
set -euo pipefail
# This directory: PDKV_RENDER_DIR, else the script's own (run with bash), else the directory
# sbatch was run from (sbatch runs a copy of the script), else where it was rendered.
here="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)"
if [ -n "${{PDKV_RENDER_DIR:-}}" ]; then
  RENDER_DIR="$PDKV_RENDER_DIR"
elif [ -f "$here/cluster.toml.in" ]; then
  RENDER_DIR="$here"
elif [ -f "${{SLURM_SUBMIT_DIR:-/nonexistent}}/cluster.toml.in" ]; then
  RENDER_DIR="$SLURM_SUBMIT_DIR"
else
  RENDER_DIR="{out}"
fi
PDKV="${{PDKV_BIN:-pdkv}}"
RUN="$RENDER_DIR/run-${{SLURM_JOB_ID:-local}}"
mkdir -p "$RUN"
mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
if [ "${{#HOSTS[@]}}" -lt {hosts} ]; then
  echo "pdkv: the allocation has ${{#HOSTS[@]}} hosts, the cluster needs {hosts}" >&2
  exit 1
fi
escaped_dir="$(printf '%s' "$RENDER_DIR" | sed -e 's/[\\|&]/\\&/g')"
sed_args=(-e "s|@RENDER_DIR@|$escaped_dir|g")
for i in "${{!HOSTS[@]}}"; do
  sed_args+=(-e "s/@HOST_${{i}}@/${{HOSTS[$i]}}/g")
done
sed "${{sed_args[@]}}" "$RENDER_DIR/cluster.toml.in" > "$RUN/cluster.toml"
declare -A names=()
stop() {{ kill "${{!names[@]}}" 2>/dev/null || true; }}
trap stop EXIT INT TERM
"#,
        out = out.display(),
        tasks = hosts + 1,
    );
    for (index, node) in nodes.iter().enumerate() {
        script.push_str(&format!(
            "srun --nodes=1 --ntasks=1 --overlap --nodelist=\"${{HOSTS[{index}]}}\" --output=\"$RUN/{name}.log\" \\\n  \"$PDKV\" node --config \"$RUN/cluster.toml\" --node {name} &\nnames[$!]={name}\n",
            name = node.name
        ));
    }
    script.push_str(&format!(
        "srun --nodes=1 --ntasks=1 --overlap --nodelist=\"${{HOSTS[0]}}\" --output=\"$RUN/{ROUTER_NODE}.log\" \\\n  \"$PDKV\" router --config \"$RUN/cluster.toml\" &\nnames[$!]={ROUTER_NODE}\n\
         echo \"pdkv: router at http://${{HOSTS[0]}}:{http_port}\"\n\
         # The first process to exit ends the job (the trap stops the others), named with its status.\n\
         while :; do\n\
         \x20 for pid in \"${{!names[@]}}\"; do\n\
         \x20   if ! kill -0 \"$pid\" 2>/dev/null; then\n\
         \x20     status=0\n\
         \x20     wait \"$pid\" || status=$?\n\
         \x20     echo \"pdkv: ${{names[$pid]}} (pid $pid) exited with status $status; stopping the cluster (its log: $RUN/${{names[$pid]}}.log)\" >&2\n\
         \x20     unset \"names[$pid]\"\n\
         \x20     if [ \"$status\" -eq 0 ]; then exit 1; fi\n\
         \x20     exit \"$status\"\n\
         \x20   fi\n\
         \x20 done\n\
         \x20 sleep 1\n\
         done\n",
        http_port = checked.router().http_port,
    ));
    let path = out.join("pdkv.sbatch");
    std::fs::write(&path, script)?;
    Ok(vec![template, path])
}

fn role_name(role: Role) -> &'static str {
    match role {
        Role::Prefill => "prefill",
        Role::Decode => "decode",
        Role::Router => "router",
    }
}

fn render_k8s(
    config: &AnyCluster,
    config_text: &str,
    out: &Path,
    certs: &Path,
    image: &str,
) -> anyhow::Result<Vec<std::path::PathBuf>> {
    // Pod i of a role's StatefulSet runs that role's i-th node (file order).
    let nodes = config.placed();
    let mut ordinal = BTreeMap::new();
    let mut by_role: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for node in &nodes {
        let names = by_role.entry(role_name(node.role)).or_default();
        ordinal.insert(node.name.0.clone(), (role_name(node.role), names.len()));
        names.push(&node.name.0);
    }
    let host_of = |index: Option<usize>| match index {
        Some(index) => {
            let (role, i) = &ordinal[&nodes[index].name.0];
            format!("pdkv-{role}-{i}.pdkv-{role}")
        }
        None => "pdkv-router-0.pdkv-router".to_string(),
    };
    let doc = placed(config_text, host_of, Some("0.0.0.0"), POD_CERTS)?;
    let cluster_toml = toml::to_string(&doc)?;
    let placed_config =
        AnyCluster::from_toml(&cluster_toml).context("the rendered cluster.toml is not valid")?;
    let placed_nodes = placed_config.placed();
    let mut documents: Vec<Value> = Vec::new();
    let mut secret = serde_json::Map::new();
    let names = crate::launch::certificate_names(config);
    let read = |file: String| -> anyhow::Result<Value> {
        let path = certs.join(&file);
        Ok(Value::String(
            std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?,
        ))
    };
    secret.insert("ca.pem".into(), read("ca.pem".into())?);
    for name in &names {
        secret.insert(format!("{name}.pem"), read(format!("{name}.pem"))?);
        secret.insert(format!("{name}.key"), read(format!("{name}.key"))?);
    }
    documents.push(json!({
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "pdkv-certs", "labels": {"app.kubernetes.io/part-of": "pdkv"}},
        "type": "Opaque",
        "stringData": secret,
    }));
    documents.push(json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "pdkv-config", "labels": {"app.kubernetes.io/part-of": "pdkv"}},
        "data": {"cluster.toml": cluster_toml},
    }));
    for (role, nodes) in &by_role {
        let first = placed_nodes
            .iter()
            .find(|node| node.name.0 == nodes[0])
            .context("node missing after placement")?;
        let address = first.address;
        // A vLLM leg answers vLLM's /health (no /ready or /live of pdkv's).
        let probes = match first.engine {
            EngineKind::Reference => ("/ready", "/live"),
            EngineKind::Vllm => ("/health", "/health"),
        };
        for name in nodes {
            let node = placed_nodes
                .iter()
                .find(|node| node.name.0 == *name)
                .context("node missing after placement")?;
            if (
                node.address.control_port,
                node.address.data_port,
                node.address.admin_port,
            ) != (address.control_port, address.data_port, address.admin_port)
            {
                bail!(
                    "Kubernetes: every {role} node runs from one pod template, so all need the same ports; {} and {name} differ",
                    nodes[0]
                );
            }
        }
        let ports = json!([
            {"name": "control", "containerPort": address.control_port, "protocol": "UDP"},
            {"name": "data", "containerPort": address.data_port, "protocol": "TCP"},
            {"name": "admin", "containerPort": address.admin_port, "protocol": "TCP"},
        ]);
        let script = format!(
            "set -e; i=\"${{HOSTNAME##*-}}\"; set -- {}; shift \"$i\"; exec pdkv node --config {POD_CONFIG}/cluster.toml --node \"$1\"",
            nodes.join(" ")
        );
        documents.push(headless_service(role, &ports));
        let pod = Pod {
            resources: node_resources(config, nodes),
            writable_root: first.engine == EngineKind::Vllm,
        };
        documents.push(stateful_set(
            role,
            nodes.len(),
            image,
            &script,
            &ports,
            "admin",
            probes,
            &pod,
        ));
    }
    let router = placed_config.router();
    let ports = json!([
        {"name": "control", "containerPort": router.control_port, "protocol": "UDP"},
        {"name": "http", "containerPort": router.http_port, "protocol": "TCP"},
    ]);
    let script = format!("exec pdkv router --config {POD_CONFIG}/cluster.toml");
    documents.push(headless_service("router", &ports));
    let pod = Pod {
        resources: json!({
            "requests": {"cpu": "1", "memory": "256Mi"},
            "limits": {"memory": "1024Mi"},
        }),
        writable_root: false,
    };
    documents.push(stateful_set(
        "router",
        1,
        image,
        &script,
        &ports,
        "http",
        ("/ready", "/live"),
        &pod,
    ));
    documents.push(json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "pdkv-api", "labels": {"app.kubernetes.io/part-of": "pdkv"}},
        "spec": {
            "selector": {"app.kubernetes.io/name": "pdkv-router"},
            "ports": [{"name": "http", "port": router.http_port, "targetPort": "http", "protocol": "TCP"}],
        },
    }));
    let mut yaml = String::from("# Rendered by `pdkv launch --render k8s`: kubectl apply -f pdkv.yaml\n");
    for document in &documents {
        yaml.push_str("---\n");
        yaml.push_str(&yaml_serde::to_string(document).context("cannot write YAML")?);
    }
    let path = out.join("pdkv.yaml");
    std::fs::write(&path, yaml)?;
    Ok(vec![path])
}

fn headless_service(role: &str, ports: &Value) -> Value {
    let service_ports: Vec<Value> = ports
        .as_array()
        .map(|ports| {
            ports
                .iter()
                .map(|port| {
                    json!({
                        "name": port["name"],
                        "port": port["containerPort"],
                        "targetPort": port["name"],
                        "protocol": port["protocol"],
                    })
                })
                .collect()
        })
        .unwrap_or_default();
    json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": format!("pdkv-{role}"), "labels": {"app.kubernetes.io/part-of": "pdkv"}},
        "spec": {
            "clusterIP": "None",
            // Peers dial each other before they are ready: names must resolve from the start.
            "publishNotReadyAddresses": true,
            "selector": {"app.kubernetes.io/name": format!("pdkv-{role}")},
            "ports": service_ports,
        },
    })
}

/// The user pods run as: not root (the image's files must be readable by it).
const POD_USER: u64 = 65532;

/// Memory a pod of pdkv's own needs beside its KV: runtime, buffers, the HTTP servers.
const BASE_MEMORY: u64 = 256 << 20;

/// Memory requested for a vLLM leg, whose model's size cluster.toml does not know.
const VLLM_MEMORY: &str = "8Gi";

/// What a role's pods are given.
struct Pod {
    /// `resources` of the container.
    resources: Value,
    /// vLLM writes caches under its home: its root filesystem stays writable.
    writable_root: bool,
}

/// Mebibytes, rounded up, as Kubernetes writes quantities.
fn mebibytes(bytes: u64) -> String {
    format!("{}Mi", bytes.div_ceil(1 << 20))
}

/// Cores in a CPU list such as "0-3,8" (one TP rank's list per '|').
fn cores(list: &str) -> u64 {
    list.split(['|', ','])
        .map(|part| match part.split_once('-') {
            Some((first, last)) => match (first.trim().parse::<u64>(), last.trim().parse::<u64>()) {
                (Ok(first), Ok(last)) if last >= first => last - first + 1,
                _ => 1,
            },
            None => 1,
        })
        .sum()
}

/// Requests and limits of the pods that run `names` (one template per role, so the largest
/// node sets them): a reference leg's KV memory (every layer's region, generation tables,
/// allocator bookkeeping) plus [`BASE_MEMORY`], and a core per compute worker plus one for its
/// control plane; a vLLM leg's bound cores and GPUs.
fn node_resources(config: &AnyCluster, names: &[&str]) -> Value {
    match config {
        AnyCluster::Reference(config) => {
            let kv = config
                .nodes
                .iter()
                .filter(|node| names.contains(&node.name.0.as_str()))
                .filter_map(|node| {
                    pdkv_actors::config::leg_memory_bytes(
                        &config.layout,
                        &config.model,
                        node.shards,
                        node.blocks_per_group,
                    )
                })
                .max()
                .unwrap_or(0);
            let memory = kv + BASE_MEMORY;
            json!({
                "requests": {"cpu": (config.limits.compute_workers + 1).to_string(), "memory": mebibytes(memory)},
                // Room for buffers in flight; past it the pod is restarted rather than the host starved.
                "limits": {"memory": mebibytes(memory.saturating_mul(2))},
            })
        }
        AnyCluster::Vllm(cluster) => {
            let nodes: Vec<_> = cluster
                .nodes
                .iter()
                .filter(|node| names.contains(&node.name.0.as_str()))
                .collect();
            let cpus = nodes
                .iter()
                .map(|node| node.cpus.as_deref().map_or(1, cores))
                .max()
                .unwrap_or(1);
            let gpus = nodes.iter().map(|node| node.gpus.len()).max().unwrap_or(0);
            let mut resources = json!({
                "requests": {"cpu": cpus.to_string(), "memory": VLLM_MEMORY},
            });
            let vendor = match cluster.engine.device {
                pdkv_actors::engines::Device::Rocm => Some("amd.com/gpu"),
                pdkv_actors::engines::Device::Cuda => Some("nvidia.com/gpu"),
                pdkv_actors::engines::Device::Cpu => None,
            };
            if let (Some(vendor), true) = (vendor, gpus > 0) {
                resources["limits"] = json!({ vendor: gpus });
                resources["requests"][vendor] = json!(gpus);
            }
            resources
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn stateful_set(
    role: &str,
    replicas: usize,
    image: &str,
    script: &str,
    ports: &Value,
    probe_port: &str,
    (ready_path, live_path): (&str, &str),
    pod: &Pod,
) -> Value {
    let name = format!("pdkv-{role}");
    let mut set = json!({
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "pdkv", "pdkv/role": role}},
        "spec": {
            "serviceName": name,
            "replicas": replicas,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": {"app.kubernetes.io/name": name}},
            "template": {
                "metadata": {"labels": {"app.kubernetes.io/name": name, "app.kubernetes.io/part-of": "pdkv", "pdkv/role": role}},
                "spec": {
                    "terminationGracePeriodSeconds": 45,
                    "securityContext": {
                        "runAsNonRoot": true,
                        "runAsUser": POD_USER,
                        "runAsGroup": POD_USER,
                        "fsGroup": POD_USER,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "containers": [{
                        "name": role,
                        "image": image,
                        "command": ["/bin/sh", "-c", script],
                        "ports": ports,
                        "resources": pod.resources,
                        "securityContext": {
                            "allowPrivilegeEscalation": false,
                            "readOnlyRootFilesystem": !pod.writable_root,
                            "capabilities": {"drop": ["ALL"]},
                        },
                        "env": [{"name": "RUST_LOG", "value": "info"}],
                        "readinessProbe": {"httpGet": {"path": ready_path, "port": probe_port}, "periodSeconds": 2, "failureThreshold": 3},
                        "livenessProbe": {"httpGet": {"path": live_path, "port": probe_port}, "periodSeconds": 10, "failureThreshold": 3},
                        "volumeMounts": [
                            {"name": "config", "mountPath": POD_CONFIG, "readOnly": true},
                            {"name": "certs", "mountPath": POD_CERTS, "readOnly": true},
                        ],
                    }],
                    "volumes": [
                        {"name": "config", "configMap": {"name": "pdkv-config"}},
                        // Readable by the pod's group (fsGroup), not by others.
                        {"name": "certs", "secret": {"secretName": "pdkv-certs", "defaultMode": 0o440}},
                    ],
                },
            },
        },
    });
    if ready_path == "/health" {
        // A vLLM leg loads its model before /health answers: up to ten minutes before the
        // liveness probe may restart it.
        set["spec"]["template"]["spec"]["containers"][0]["startupProbe"] = json!({"httpGet": {"path": "/health", "port": probe_port}, "periodSeconds": 10, "failureThreshold": 60});
    }
    set
}
