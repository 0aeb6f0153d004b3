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

/// The certificate directory the rendered files use: `[tls] dir`, or new certificates in
/// `out/certs`.
fn certificates(config: &AnyCluster, out: &Path) -> anyhow::Result<std::path::PathBuf> {
    if let Some(tls) = config.tls() {
        // Absolute, so the rendered files work from any directory.
        return std::path::absolute(&tls.dir)
            .with_context(|| format!("cannot resolve {}", tls.dir.display()));
    }
    let certs = out.join("certs");
    let names = crate::launch::certificate_names(config);
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    write_cluster_certs(&certs, "pdkv", &names, Existing::Replace)
        .with_context(|| format!("cannot write certificates to {}", certs.display()))?;
    Ok(certs)
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

/// Writes the files for `target` into `out`; returns the paths written.
pub fn render(
    target: Target,
    config_text: &str,
    out: &Path,
    image: &str,
) -> anyhow::Result<Vec<std::path::PathBuf>> {
    let config = AnyCluster::from_toml(config_text)?;
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let out = out
        .canonicalize()
        .with_context(|| format!("cannot resolve {}", out.display()))?;
    let certs = certificates(&config, &out)?;
    match target {
        Target::Slurm => render_slurm(&config, config_text, &out, &certs),
        Target::K8s => render_k8s(&config, config_text, &out, &certs, image),
    }
}

fn render_slurm(
    config: &AnyCluster,
    config_text: &str,
    out: &Path,
    certs: &Path,
) -> anyhow::Result<Vec<std::path::PathBuf>> {
    let doc = placed(
        config_text,
        |index| format!("@HOST_{}@", index.unwrap_or(0)),
        None,
        &certs.display().to_string(),
    )?;
    let text = toml::to_string(&doc)?;
    // Checked with stand-in host names: the router shares the first node's host, so their
    // ports must differ.
    let checked = AnyCluster::from_toml(&text.replace("@HOST_", "host-").replace('@', ""))
        .context("the rendered cluster.toml is not valid")?;
    let template = out.join("cluster.toml.in");
    std::fs::write(&template, text)?;
    let nodes = config.placed();
    let hosts = nodes.len();
    let mut script = format!(
        r#"#!/usr/bin/env bash
# Rendered by `pdkv launch --render slurm`: one host per pdkv node, the router beside the first.
# Submit with `sbatch {out}/pdkv.sbatch`; {out} must be visible on every host.
#SBATCH --job-name=pdkv
#SBATCH --nodes={hosts}
#SBATCH --ntasks={tasks}
#SBATCH --output=pdkv-%j.out
set -euo pipefail
RENDER_DIR="${{PDKV_RENDER_DIR:-{out}}}"
PDKV="${{PDKV_BIN:-pdkv}}"
RUN="$RENDER_DIR/run-${{SLURM_JOB_ID:-local}}"
mkdir -p "$RUN"
mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
if [ "${{#HOSTS[@]}}" -lt {hosts} ]; then
  echo "pdkv: the allocation has ${{#HOSTS[@]}} hosts, the cluster needs {hosts}" >&2
  exit 1
fi
sed_args=()
for i in "${{!HOSTS[@]}}"; do
  sed_args+=(-e "s/@HOST_${{i}}@/${{HOSTS[$i]}}/g")
done
sed "${{sed_args[@]}}" "$RENDER_DIR/cluster.toml.in" > "$RUN/cluster.toml"
pids=()
stop() {{ kill "${{pids[@]}}" 2>/dev/null || true; }}
trap stop EXIT INT TERM
"#,
        out = out.display(),
        tasks = hosts + 1,
    );
    for (index, node) in nodes.iter().enumerate() {
        script.push_str(&format!(
            "srun --nodes=1 --ntasks=1 --overlap --nodelist=\"${{HOSTS[{index}]}}\" --output=\"$RUN/{name}.log\" \\\n  \"$PDKV\" node --config \"$RUN/cluster.toml\" --node {name} &\npids+=($!)\n",
            name = node.name
        ));
    }
    script.push_str(&format!(
        "srun --nodes=1 --ntasks=1 --overlap --nodelist=\"${{HOSTS[0]}}\" --output=\"$RUN/{ROUTER_NODE}.log\" \\\n  \"$PDKV\" router --config \"$RUN/cluster.toml\" &\npids+=($!)\n\
         echo \"pdkv: router at http://${{HOSTS[0]}}:{http_port}\"\n\
         # The first process to exit ends the job (the trap stops the others).\n\
         wait -n\n\
         echo \"pdkv: a process exited; stopping the cluster (logs in $RUN)\" >&2\n\
         exit 1\n",
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
        documents.push(stateful_set(
            role,
            nodes.len(),
            image,
            &script,
            &ports,
            "admin",
            probes,
        ));
    }
    let router = placed_config.router();
    let ports = json!([
        {"name": "control", "containerPort": router.control_port, "protocol": "UDP"},
        {"name": "http", "containerPort": router.http_port, "protocol": "TCP"},
    ]);
    let script = format!("exec pdkv router --config {POD_CONFIG}/cluster.toml");
    documents.push(headless_service("router", &ports));
    documents.push(stateful_set(
        "router",
        1,
        image,
        &script,
        &ports,
        "http",
        ("/ready", "/live"),
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

fn stateful_set(
    role: &str,
    replicas: usize,
    image: &str,
    script: &str,
    ports: &Value,
    probe_port: &str,
    (ready_path, live_path): (&str, &str),
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
                    "containers": [{
                        "name": role,
                        "image": image,
                        "command": ["/bin/sh", "-c", script],
                        "ports": ports,
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
                        {"name": "certs", "secret": {"secretName": "pdkv-certs", "defaultMode": 0o400}},
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
