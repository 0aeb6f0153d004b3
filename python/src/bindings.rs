//! The agent for Python: `KvAgent`, its error classes, and certificate setup.
//!
//! Blocking calls (a load's connect, claim, READ and release) run with the GIL released, so a
//! worker's other Python threads keep running while a READ is in flight.

use std::net::SocketAddr;
use std::time::Duration;

use pdkv_core::exchange::BlockPair;
use pdkv_core::heads::HeadOrder;
use pdkv_core::identity::ModelFields;
use pdkv_core::wire::Role;
use pyo3::create_exception;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use crate::agent::{
    Agent, AgentError, AgentLimits, AgentSetup, DcpSplit, DecodeSplit, EngineChoice, Memory, MoriSetup,
    Plane, Source,
};
use crate::exchange::parse_groups;

create_exception!(
    _native,
    LoadError,
    PyRuntimeError,
    "A request's KV could not be loaded: vLLM must recompute it, never decode from it."
);
create_exception!(
    _native,
    PeerUnreachable,
    LoadError,
    "The prefill worker could not be reached (down, refused us, or on another host)."
);
create_exception!(
    _native,
    IncompatibleModel,
    LoadError,
    "The prefill worker serves another model or computes its KV differently; the message names \
     each differing field with both values."
);
create_exception!(
    _native,
    HandoffEnded,
    LoadError,
    "The prefill worker no longer holds the request's KV (lease lapsed, released, revoked, another \
     reader, or never announced)."
);
create_exception!(
    _native,
    StaleKv,
    LoadError,
    "The KV changed under the READ (a block was freed, or the prefill worker restarted)."
);
create_exception!(
    _native,
    AgentConfigError,
    PyValueError,
    "The agent's settings or KV memory are wrong."
);

fn to_python(error: AgentError) -> PyErr {
    let message = error.to_string();
    match error {
        AgentError::Config(_) => AgentConfigError::new_err(message),
        AgentError::Unreachable { .. } => PeerUnreachable::new_err(message),
        AgentError::Incompatible { .. } => IncompatibleModel::new_err(message),
        AgentError::HandoffRefused { .. } | AgentError::HandoffMissing { .. } => {
            HandoffEnded::new_err(message)
        }
        AgentError::Restarted { .. } | AgentError::Stale { .. } => StaleKv::new_err(message),
        AgentError::Layers { .. } => IncompatibleModel::new_err(message),
        AgentError::NotHandedOff { .. } | AgentError::Read { .. } | AgentError::DataConnection { .. } => {
            LoadError::new_err(message)
        }
    }
}

/// The connector's model fields (a JSON object) as the handshake's named fields: a string
/// value as it is, any other value as compact JSON.
fn parse_model(json: &str) -> PyResult<ModelFields> {
    let object: serde_json::Map<String, serde_json::Value> = serde_json::from_str(json)
        .map_err(|error| AgentConfigError::new_err(format!("model fields are not a JSON object: {error}")))?;
    let fields = object.into_iter().map(|(name, value)| {
        let text = match value {
            serde_json::Value::String(text) => text,
            other => other.to_string(),
        };
        (name, text)
    });
    ModelFields::new(fields).map_err(|error| AgentConfigError::new_err(error.to_string()))
}

fn parse_role(text: &str) -> PyResult<Role> {
    match text {
        "prefill" => Ok(Role::Prefill),
        "decode" => Ok(Role::Decode),
        other => Err(AgentConfigError::new_err(format!(
            "role {other:?}: a worker is \"prefill\" or \"decode\""
        ))),
    }
}

/// One (prefill or decode) worker's pdkv agent: its KV memory registered with pdkv's READ
/// engines, and (prefill) a control-plane server that hands finished requests' blocks to decode
/// workers.
///
/// Memory given by address is used in place, as ctypes would: it must be this process's memory
/// (KV tensors the caller keeps alive for the agent's life); anything else is undefined
/// behaviour.
#[pyclass(frozen, module = "pdkv_vllm._native")]
struct KvAgent {
    agent: Agent,
}

/// One READ unit from Python: `(remote_position, local_position, remote_block, local_block)`.
type PairTuple = (u64, u64, u32, u32);

#[pymethods]
impl KvAgent {
    /// `memory`: the KV memory regions, each `(fd, address, length, device)`: an open memfd
    /// (address and length unused), or `fd = -1` for memory of this process the caller keeps
    /// alive and in place while the agent lives: host memory (`device = -1`) or memory of GPU
    /// `device`; `mori_host`: offer (and READ with) a mori engine whose control plane binds that
    /// host; `planes`: `(region, offset, bytes_per_block, group, layer, page_bytes)` for every
    /// K, V or state plane, `layer` naming the layer it holds (a decode plane is read from the
    /// prefill plane of the same layer, whichever pipeline stage holds it; a block-outermost
    /// plane names each layer it packs, joined by `|`, one `page_bytes` page each);
    /// `listen`: the prefill worker's control address (`host:port`, port 0 picks one);
    /// `data_listen`: its memory server's (default: `listen`'s host, any port); `advertise` and
    /// `data_advertise`: the control and memory server addresses peers reach it at, when they
    /// differ from the bound ones (every interface bound, a NAT, a relay); `read_engine`:
    /// `"auto"` (shared memory on one host, the network elsewhere), `"shm"` or `"net"`.
    #[new]
    #[pyo3(signature = (
        node, role, certs_dir, peers, groups_json, memory, planes, num_blocks,
        listen=None, data_listen=None, advertise=None, data_advertise=None, read_engine="auto", mori_host=None, mori_port=0, lease_ms=30_000, max_handoffs=4096, claim_wait_ms=5_000,
        connect_timeout_ms=5_000, request_timeout_ms=5_000, read_timeout_ms=30_000, model_json=None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        node: String,
        role: &str,
        certs_dir: std::path::PathBuf,
        peers: Vec<String>,
        groups_json: &str,
        memory: Vec<(i32, usize, usize, i64)>,
        planes: Vec<(u32, u64, u64, usize, String, u64)>,
        num_blocks: u32,
        listen: Option<&str>,
        data_listen: Option<&str>,
        advertise: Option<&str>,
        data_advertise: Option<&str>,
        read_engine: &str,
        mori_host: Option<String>,
        mori_port: u16,
        lease_ms: u64,
        max_handoffs: usize,
        claim_wait_ms: u64,
        connect_timeout_ms: u64,
        request_timeout_ms: u64,
        read_timeout_ms: u64,
        model_json: Option<&str>,
    ) -> PyResult<Self> {
        let address = |what: &str, text: Option<&str>| {
            text.map(|text| {
                text.parse::<SocketAddr>()
                    .map_err(|error| AgentConfigError::new_err(format!("{what} address {text:?}: {error}")))
            })
            .transpose()
        };
        let listen = address("listen", listen)?;
        let data_listen = address("data_listen", data_listen)?;
        let advertise = address("advertise", advertise)?;
        let data_advertise = address("data_advertise", data_advertise)?;
        let engine = match read_engine {
            "auto" => EngineChoice::Auto,
            "shm" => EngineChoice::Shm,
            "net" => EngineChoice::Net,
            "mori" => EngineChoice::Mori,
            other => {
                return Err(AgentConfigError::new_err(format!(
                    "read_engine {other:?}: \"auto\", \"shm\", \"net\" or \"mori\""
                )));
            }
        };
        let mori = mori_host.map(|host| MoriSetup {
            host,
            settings: pdkv_transport::mori::MoriSettings {
                port: mori_port,
                ..Default::default()
            },
        });
        let setup = AgentSetup {
            node,
            role: parse_role(role)?,
            certs_dir,
            peers,
            groups: parse_groups(groups_json)?,
            model: model_json.map(parse_model).transpose()?.unwrap_or_default(),
            memory: memory
                .into_iter()
                .map(|(fd, ptr, len, device)| match (fd, u32::try_from(device)) {
                    (0.., _) => Memory::Memfd(fd),
                    (_, Ok(device)) => Memory::Device { ptr, len, device },
                    (_, Err(_)) => Memory::Borrowed { ptr, len },
                })
                .collect(),
            planes: planes
                .into_iter()
                .map(
                    |(region, offset, bytes_per_block, group, layer, page_bytes)| Plane {
                        region,
                        offset,
                        bytes_per_block,
                        group,
                        layer,
                        page_bytes,
                    },
                )
                .collect(),
            num_blocks,
            listen,
            data_listen,
            advertise,
            data_advertise,
            engine,
            mori,
            limits: AgentLimits {
                lease: Duration::from_millis(lease_ms),
                max_handoffs,
                claim_wait: Duration::from_millis(claim_wait_ms),
                connect: Duration::from_millis(connect_timeout_ms),
                request: Duration::from_millis(request_timeout_ms),
                read: Duration::from_millis(read_timeout_ms),
                data_idle: None,
            },
        };
        let agent = py.detach(|| Agent::start(setup)).map_err(to_python)?;
        Ok(KvAgent { agent })
    }

    /// This worker's node name.
    #[getter]
    fn node(&self) -> String {
        self.agent.node().to_string()
    }

    /// A random id per agent start: KV computed by another incarnation is never read.
    #[getter]
    fn incarnation(&self) -> u64 {
        self.agent.incarnation()
    }

    /// The prefill worker's control address (`host:port`), None on a decode worker.
    #[getter]
    fn address(&self) -> Option<String> {
        self.agent.address().map(|address| address.to_string())
    }

    /// Prefill: hands `blocks` (per group) of finished request `request` to the first decode
    /// worker that claims them, for a lease.
    fn announce(&self, request: &str, blocks: Vec<Vec<u32>>) -> PyResult<()> {
        self.agent.announce(request, blocks).map_err(to_python)
    }

    /// Prefill: gives up a hand-off (vLLM aborted); True if it was live.
    fn revoke(&self, request: &str) -> bool {
        self.agent.revoke(request)
    }

    /// Prefill: requests whose blocks vLLM may free now (released, lease lapsed, revoked).
    fn finished(&self) -> Vec<String> {
        self.agent.finished()
    }

    /// Decode: the READ engines in use (`"shm"`, `"net"`) for the prefill workers it knows.
    fn engines_in_use(&self) -> Vec<String> {
        self.agent.engines_in_use()
    }

    /// Prefill: hand-offs whose lease lapsed before a decoder released them, since start.
    fn expired_handoffs(&self) -> u64 {
        self.agent.expired_handoffs()
    }

    /// Prefill: hand-offs still live.
    fn live_handoffs(&self) -> usize {
        self.agent.live_handoffs()
    }

    /// Decode: READs request `request`'s KV (the prefill side's request id) from prefill worker
    /// `remote_node` at `remote_address`, incarnation `remote_incarnation`, as `pairs` (per group,
    /// from `pdkv_vllm.pair`) say. Returns `(bytes, runs)`; raises a `LoadError` subclass naming
    /// why the KV must be recomputed.
    fn load(
        &self,
        py: Python<'_>,
        request: &str,
        remote_node: &str,
        remote_address: &str,
        remote_incarnation: u64,
        pairs: Vec<Vec<PairTuple>>,
    ) -> PyResult<(u64, usize)> {
        let pairs = to_pairs(pairs);
        let loaded = py
            .detach(|| {
                self.agent
                    .load(request, remote_node, remote_address, remote_incarnation, pairs)
            })
            .map_err(to_python)?;
        Ok((loaded.bytes, loaded.runs))
    }

    /// Decode: READs request `request`'s KV from the prefill workers holding it, as `pairs` say.
    /// `stages` lists the prefill leg's workers per pipeline stage, each `(node, address,
    /// incarnation)` in rank order (one stage: the one holding this worker's layers); each of
    /// this worker's layers is read from the stage holding it. Within a stage, rank `rank` of
    /// `decode_tp` reads the same rank's blocks whole when the stage runs `decode_tp` ranks,
    /// else the KV heads it holds from the ranks holding them (`kv_heads`: the model's KV heads;
    /// `order`: `"heads_outer"`, `"tokens_outer"`, or None where blocks are copied whole only;
    /// `rotation` spreads replicated heads, the same on every decode rank). `stage_readers`: how
    /// many of this leg's stages read each prefill worker (1, or this leg's PP size when the legs'
    /// PP sizes differ). `dcp` and `prefill_dcp`: how this leg and the prefill leg split a
    /// block's tokens over their DCP ranks, `(size, interleave)`; legs of different splits
    /// read the tokens and heads each rank holds from the ranks holding them. Returns `(bytes,
    /// runs)`; raises a `LoadError` subclass naming why the KV must be recomputed.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (request, stages, kv_heads, decode_tp, rank, rotation, order, stage_readers, pairs, dcp=(1, 1), prefill_dcp=(1, 1)))]
    fn load_stages(
        &self,
        py: Python<'_>,
        request: &str,
        stages: Vec<Vec<(String, String, u64)>>,
        kv_heads: u32,
        decode_tp: u32,
        rank: u32,
        rotation: u64,
        order: Option<&str>,
        stage_readers: u32,
        pairs: Vec<Vec<PairTuple>>,
        dcp: (u32, u32),
        prefill_dcp: (u32, u32),
    ) -> PyResult<(u64, usize)> {
        let order = match order {
            None => None,
            Some("heads_outer") => Some(HeadOrder::HeadsOuter),
            Some("tokens_outer") => Some(HeadOrder::TokensOuter),
            Some(other) => {
                return Err(PyValueError::new_err(format!(
                    "order must be \"heads_outer\", \"tokens_outer\" or None, not {other:?}"
                )));
            }
        };
        let split = DecodeSplit {
            kv_heads,
            tp: decode_tp,
            rank,
            rotation,
            order,
            stage_readers,
            dcp: DcpSplit {
                size: dcp.0,
                interleave: dcp.1,
            },
            prefill_dcp: DcpSplit {
                size: prefill_dcp.0,
                interleave: prefill_dcp.1,
            },
        };
        let stages = stages
            .into_iter()
            .map(|stage| {
                stage
                    .into_iter()
                    .map(|(node, address, incarnation)| Source {
                        node,
                        address,
                        incarnation,
                    })
                    .collect()
            })
            .collect();
        let pairs = to_pairs(pairs);
        let loaded = py
            .detach(|| self.agent.load_stages(request, stages, split, pairs))
            .map_err(to_python)?;
        Ok((loaded.bytes, loaded.runs))
    }

    /// Decode: gives back request `request`'s hand-off at prefill worker `remote_node` without
    /// reading it (nothing of it is needed), so its blocks are freed now rather than when its
    /// lease lapses. Raises a `LoadError` subclass when it cannot (the lease then ends it).
    fn release(
        &self,
        py: Python<'_>,
        request: &str,
        remote_node: &str,
        remote_address: &str,
        remote_incarnation: u64,
    ) -> PyResult<()> {
        py.detach(|| {
            self.agent
                .release(request, remote_node, remote_address, remote_incarnation)
        })
        .map_err(to_python)
    }

    /// Stops serving and closes connections; returns the hand-offs it revoked.
    fn close(&self, py: Python<'_>) -> Vec<String> {
        py.detach(|| self.agent.close())
    }
}

/// Python's pair tuples as the exchange's pairs.
fn to_pairs(pairs: Vec<Vec<PairTuple>>) -> Vec<Vec<BlockPair>> {
    pairs
        .into_iter()
        .map(|group| {
            group
                .into_iter()
                .map(|(remote_position, local_position, remote, local)| BlockPair {
                    remote_position,
                    local_position,
                    remote,
                    local,
                })
                .collect()
        })
        .collect()
}

/// Writes a cluster CA and one certificate per node into `dir` (as `pdkv certs init` does):
/// `ca.pem`, `<node>.pem`, `<node>.key` (keys 0600). Refuses to overwrite existing files.
#[pyfunction]
fn write_cluster_certs(dir: std::path::PathBuf, nodes: Vec<String>) -> PyResult<()> {
    let names: Vec<&str> = nodes.iter().map(String::as_str).collect();
    pdkv_transport::tls::write_cluster_certs(&dir, "pdkv", &names, pdkv_transport::tls::Existing::Refuse)
        .map_err(|error| AgentConfigError::new_err(error.to_string()))
}

/// Adds `KvAgent`, its errors and `write_cluster_certs` to the module.
pub fn add_to(module: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = module.py();
    module.add_class::<KvAgent>()?;
    module.add_function(wrap_pyfunction!(write_cluster_certs, module)?)?;
    module.add("LoadError", py.get_type::<LoadError>())?;
    module.add("PeerUnreachable", py.get_type::<PeerUnreachable>())?;
    module.add("IncompatibleModel", py.get_type::<IncompatibleModel>())?;
    module.add("HandoffEnded", py.get_type::<HandoffEnded>())?;
    module.add("StaleKv", py.get_type::<StaleKv>())?;
    module.add("AgentConfigError", py.get_type::<AgentConfigError>())?;
    Ok(())
}
