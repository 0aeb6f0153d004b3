//! The relays of a chaos run, one per directed link, and each node's view of the cluster
//! through them: in the view node X runs, every peer X dials is at the port of the relay
//! X → peer, so a fault can act on one link in one direction.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::Context;
use pdkv_actors::config::{ClusterConfig, ROUTER_NODE, ReadEngineKind, Role};
use pdkv_actors::node::{control_address, peers_of, resolve};

use super::relay::Relay;
use super::schedule::Topology;

/// The relays of a run: one per directed link, keyed by (dialling node, dialled node).
pub(super) struct Relays {
    pub(super) control: BTreeMap<(String, String), Relay>,
    pub(super) data: BTreeMap<(String, String), Relay>,
}

impl Relays {
    /// The relays of both directions between `a` and `b`, control and data.
    pub(super) fn between(&self, a: &str, b: &str) -> Vec<&Relay> {
        let pairs = [(a.to_string(), b.to_string()), (b.to_string(), a.to_string())];
        pairs
            .iter()
            .flat_map(|pair| [self.control.get(pair), self.data.get(pair)])
            .flatten()
            .collect()
    }

    pub(super) fn heal_all(&self) {
        for relay in self.control.values().chain(self.data.values()) {
            relay.faults.heal();
            relay.faults.disarm();
        }
    }
}

/// Every node's name, role and real control address (the router included).
pub(super) fn members(config: &ClusterConfig) -> anyhow::Result<Vec<(String, Role, SocketAddr)>> {
    config
        .nodes
        .iter()
        .map(|node| (node.name.0.as_str(), node.role))
        .chain([(ROUTER_NODE, Role::Router)])
        .map(|(name, role)| Ok((name.to_string(), role, control_address(config, name)?)))
        .collect()
}

/// Starts a relay for every directed link of `config` on `runtime`, each listening on its
/// target's host.
pub(super) fn start_relays(
    config: &ClusterConfig,
    runtime: &tokio::runtime::Handle,
    seed: u64,
) -> anyhow::Result<Relays> {
    let members = members(config)?;
    let mut relays = Relays {
        control: BTreeMap::new(),
        data: BTreeMap::new(),
    };
    // Every port of the config, TCP or UDP: a view must not give two keys one port.
    let mut taken: std::collections::BTreeSet<u16> = config
        .nodes
        .iter()
        .flat_map(|node| {
            let address = &node.address;
            [address.control_port, address.data_port, address.admin_port]
        })
        .chain([config.router.control_port, config.router.http_port])
        .collect();
    // Binds a relay on a port no key of the config holds (a free UDP port may equal a TCP one).
    let mut bind = |start: &dyn Fn() -> std::io::Result<Relay>| -> std::io::Result<Relay> {
        for _ in 0..100 {
            let relay = start()?;
            if taken.insert(relay.listen.port()) {
                return Ok(relay);
            }
        }
        Err(std::io::Error::other(
            "no free port outside the cluster's after 100 tries",
        ))
    };
    let mut index = 0u64;
    for (from, from_role, _) in &members {
        let peers = peers_of(config, *from_role);
        for (to, to_role, target) in &members {
            if !peers.iter().any(|(peer, _)| peer.0 == *to) {
                continue;
            }
            index += 1;
            let listen = SocketAddr::new(target.ip(), 0);
            let relay = bind(&|| Relay::udp(runtime, listen, *target, seed ^ index))
                .with_context(|| format!("cannot start the relay {from} -> {to}"))?;
            relays.control.insert((from.clone(), to.clone()), relay);
            if config.transport.read_engine == ReadEngineKind::Net
                && *from_role == Role::Decode
                && *to_role == Role::Prefill
            {
                let node = config
                    .nodes
                    .iter()
                    .find(|node| node.name.0 == *to)
                    .context("prefill leg")?;
                let target =
                    resolve(&node.address.host, node.address.data_port).map_err(anyhow::Error::msg)?;
                let relay =
                    bind(&|| Relay::tcp(runtime, SocketAddr::new(target.ip(), 0), target, seed ^ index ^ 1))
                        .with_context(|| format!("cannot start the data relay {from} -> {to}"))?;
                relays.data.insert((from.clone(), to.clone()), relay);
            }
        }
    }
    Ok(relays)
}

/// Writes each member's view of the resolved cluster.toml at `config_path`: every peer it
/// dials is at its relay's port. Returns member name → view path.
pub(super) fn write_views(config_path: &Path, relays: &Relays) -> anyhow::Result<BTreeMap<String, PathBuf>> {
    let text = std::fs::read_to_string(config_path)?;
    let doc: toml::Table = text.parse()?;
    let names: Vec<String> = relays.control.keys().map(|(from, _)| from.clone()).collect();
    let mut views = BTreeMap::new();
    for member in names {
        if views.contains_key(&member) {
            continue;
        }
        let mut view = doc.clone();
        let port = |relay: &Relay| toml::Value::Integer(i64::from(relay.listen.port()));
        if let Some(toml::Value::Array(nodes)) = view.get_mut("nodes") {
            for node in nodes.iter_mut() {
                let Some(table) = node.as_table_mut() else {
                    continue;
                };
                let Some(name) = table.get("name").and_then(toml::Value::as_str).map(String::from) else {
                    continue;
                };
                let key = (member.clone(), name);
                if let Some(relay) = relays.control.get(&key) {
                    table.insert("control_port".into(), port(relay));
                }
                if let Some(relay) = relays.data.get(&key) {
                    table.insert("data_port".into(), port(relay));
                }
            }
        }
        if let Some(relay) = relays.control.get(&(member.clone(), ROUTER_NODE.to_string()))
            && let Some(router) = view.get_mut("router").and_then(toml::Value::as_table_mut)
        {
            router.insert("control_port".into(), port(relay));
        }
        let path = config_path.with_file_name(format!("view-{member}.toml"));
        std::fs::write(
            &path,
            format!(
                "# Written by pdkv chaos: the cluster as {member} sees it, every peer behind a relay.\n{}",
                toml::to_string(&view)?
            ),
        )?;
        ClusterConfig::from_file(&path)
            .with_context(|| format!("the view {} is not valid", path.display()))?;
        views.insert(member, path);
    }
    Ok(views)
}

/// The schedule's targets in `config` with `relays`.
pub(super) fn topology(config: &ClusterConfig, relays: &Relays) -> Topology {
    let mut links = Vec::new();
    for (from, to) in relays.control.keys() {
        if from < to {
            links.push((from.clone(), to.clone()));
        }
    }
    Topology {
        legs: config.nodes.iter().map(|node| node.name.0.clone()).collect(),
        links,
        reads: relays.data.keys().cloned().collect(),
    }
}
