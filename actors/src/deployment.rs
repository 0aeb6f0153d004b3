//! Where a cluster's processes run and how they are reached: node addresses and ports, how a
//! node is started on its host, the router's front door, certificates and logging
//! (`cluster.toml` v2).
//!
//! Every key is optional: a file without addresses (like the shipped one) puts every node on
//! loopback with ports picked free at start (port 0), which is all a cluster in one process or
//! on one machine needs.

use std::collections::HashMap;
use std::net::IpAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::config::ConfigError;

/// The host a node or the router binds and is reached at by default.
pub const LOOPBACK: &str = "127.0.0.1";

/// A node's network placement (`[[nodes]]` keys `host`, `control_port`, `data_port`,
/// `admin_port`); port 0 means "pick a free one at start".
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeAddress {
    /// Host name or IP address the node's peers dial (and it binds, unless `bind` says
    /// otherwise).
    pub host: String,
    /// Address to bind instead of `host` (e.g. `0.0.0.0` in a container whose DNS name
    /// resolves only once it runs).
    pub bind: Option<String>,
    /// QUIC control plane (mutual TLS).
    pub control_port: u16,
    /// Network READ data port (TCP), for the net engine.
    pub data_port: u16,
    /// Admin HTTP (`/live`, `/ready`, `/metrics`).
    pub admin_port: u16,
}

impl NodeAddress {
    /// Where the node's listeners bind.
    pub fn bind_host(&self) -> &str {
        self.bind.as_deref().unwrap_or(&self.host)
    }
}

impl Default for NodeAddress {
    fn default() -> Self {
        NodeAddress {
            host: LOOPBACK.into(),
            bind: None,
            control_port: 0,
            data_port: 0,
            admin_port: 0,
        }
    }
}

/// How `pdkv launch` starts a node (`[[nodes]] launch`, `ssh`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Launch {
    /// A child process on this machine.
    #[default]
    Local,
    /// A process on another host, started through the system ssh.
    Ssh {
        /// The ssh destination (`user@host` or a `Host` of the ssh config).
        target: String,
    },
}

/// The `launch` key as written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LaunchKind {
    /// A child process on this machine.
    #[default]
    Local,
    /// Through ssh; needs `ssh`.
    Ssh,
}

/// How the router chooses legs (`[router] selection`): the rule both routers share.
pub use pdkv_core::proxy::Policy as Selection;

/// `[router]`: the router's front door.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RouterConfig {
    /// Host the legs dial and the HTTP API is reached at (and binds, unless `bind` says
    /// otherwise).
    pub host: String,
    /// Address to bind instead of `host`.
    pub bind: Option<String>,
    /// HTTP port of the OpenAI-compatible API (0: pick a free one).
    pub http_port: u16,
    /// QUIC control port the router's links use (0: pick a free one).
    pub control_port: u16,
    /// How legs are chosen.
    pub selection: Selection,
    /// vLLM legs: the bound on a request's prefill stage, after which the router tries another
    /// prefill leg (or a local prefill). At most `request_timeout_ms`. Default 10 000.
    pub prefill_timeout_ms: u64,
    /// Threads of the router's HTTP API. 0 (default): the router's own thread, beside its
    /// actor and QUIC links, so a request reaches the router without a thread hand-off (about
    /// a third less latency per request on a 2-vCPU VM). N: a runtime of N threads of its own,
    /// for a router whose HTTP parsing and streaming outgrow one core. At most 256.
    pub http_threads: usize,
}

impl RouterConfig {
    /// Where the router's listeners bind.
    pub fn bind_host(&self) -> &str {
        self.bind.as_deref().unwrap_or(&self.host)
    }
}

impl Default for RouterConfig {
    fn default() -> Self {
        RouterConfig {
            host: LOOPBACK.into(),
            bind: None,
            http_port: 0,
            control_port: 0,
            selection: Selection::default(),
            prefill_timeout_ms: 10_000,
            http_threads: 0,
        }
    }
}

/// `[http]`: how every HTTP server of the cluster (the router's API, each node's admin port)
/// bounds its clients, so idle or slow connections cannot lock others out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HttpConfig {
    /// Longest wait for a request's whole header, from the connection's start or the end of
    /// the previous answer on a kept-alive connection (so also the idle timeout). Default 10 000.
    pub header_timeout_ms: u64,
    /// Longest wait for a request's whole body once its header is in. Default 30 000.
    pub body_timeout_ms: u64,
    /// Longest a streamed answer waits for a client that stopped reading before the request is
    /// cancelled and the connection closed. Default 30 000.
    pub stall_timeout_ms: u64,
    /// Open connections per server; 0 (default) chooses from the process's file limit (raised
    /// to its hard limit at start): three quarters of it, at most 16 384. Beyond it the oldest
    /// idle connection is closed, or the new one is refused when none is idle.
    pub max_connections: usize,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            header_timeout_ms: 10_000,
            body_timeout_ms: 30_000,
            stall_timeout_ms: 30_000,
            max_connections: 0,
        }
    }
}

/// Most connections one HTTP server may be set to hold.
pub const MAX_HTTP_CONNECTIONS: usize = 1 << 20;

impl HttpConfig {
    /// Refuses bounds of zero or of more than a day, and connection caps past
    /// [`MAX_HTTP_CONNECTIONS`].
    pub fn check(&self) -> Result<(), ConfigError> {
        for (key, value) in [
            ("header_timeout_ms", self.header_timeout_ms),
            ("body_timeout_ms", self.body_timeout_ms),
            ("stall_timeout_ms", self.stall_timeout_ms),
        ] {
            if !(1..=86_400_000).contains(&value) {
                return Err(ConfigError::invalid(
                    format!("http.{key}"),
                    format!("{value} is outside 1..=86400000 (a day)"),
                ));
            }
        }
        if self.max_connections > MAX_HTTP_CONNECTIONS {
            return Err(ConfigError::invalid(
                "http.max_connections",
                format!("{} is more than {MAX_HTTP_CONNECTIONS}", self.max_connections),
            ));
        }
        Ok(())
    }
}

/// `[tls]`: where `pdkv certs init` wrote the cluster CA and the node certificates.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// Directory holding `ca.pem` and `<node>.pem` / `<node>.key` for every node and the router.
    pub dir: PathBuf,
}

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// `[logging]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoggingConfig {
    /// Filter when `RUST_LOG` is unset (tracing-subscriber syntax).
    pub level: String,
    /// Line format.
    pub format: LogFormat,
}

impl Default for LoggingConfig {
    fn default() -> Self {
        LoggingConfig {
            level: "warn".into(),
            format: LogFormat::Text,
        }
    }
}

/// The deployment keys of one `[[nodes]]` entry, as written.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodePlacement {
    /// `host`.
    pub host: Option<String>,
    /// `bind`.
    pub bind: Option<String>,
    /// `control_port`.
    pub control_port: Option<u16>,
    /// `data_port`.
    pub data_port: Option<u16>,
    /// `admin_port`.
    pub admin_port: Option<u16>,
    /// `launch`.
    pub launch: Option<LaunchKind>,
    /// `ssh`.
    pub ssh: Option<String>,
}

/// Checks a node's placement and fills in defaults; `key` names the node's table in errors.
pub fn node_deployment(key: &str, placement: NodePlacement) -> Result<(NodeAddress, Launch), ConfigError> {
    let host = placement.host.unwrap_or_else(|| LOOPBACK.into());
    check_host(&format!("{key}.host"), &host)?;
    if let Some(bind) = &placement.bind {
        check_host(&format!("{key}.bind"), bind)?;
    }
    let address = NodeAddress {
        host,
        bind: placement.bind,
        control_port: placement.control_port.unwrap_or(0),
        data_port: placement.data_port.unwrap_or(0),
        admin_port: placement.admin_port.unwrap_or(0),
    };
    let launch = match (placement.launch.unwrap_or_default(), placement.ssh) {
        (LaunchKind::Local, None) => Launch::Local,
        (LaunchKind::Local, Some(_)) => {
            return Err(ConfigError::invalid(
                format!("{key}.ssh"),
                "only nodes with launch = \"ssh\" take an ssh target",
            ));
        }
        (LaunchKind::Ssh, None) => {
            return Err(ConfigError::invalid(
                format!("{key}.ssh"),
                "launch = \"ssh\" needs an ssh target, e.g. ssh = \"user@host\"",
            ));
        }
        (LaunchKind::Ssh, Some(target)) => {
            if target.is_empty() || target.starts_with('-') || target.chars().any(char::is_whitespace) {
                return Err(ConfigError::invalid(
                    format!("{key}.ssh"),
                    format!("{target:?} is not an ssh destination (user@host, no spaces, not an option)"),
                ));
            }
            Launch::Ssh { target }
        }
    };
    Ok((address, launch))
}

/// A host is an IP address or a DNS name (letters, digits, '-' and '.').
pub fn check_host(key: &str, host: &str) -> Result<(), ConfigError> {
    let dns_name = !host.is_empty()
        && host.len() <= 253
        && host.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
        });
    if dns_name || host.parse::<IpAddr>().is_ok() {
        Ok(())
    } else {
        Err(ConfigError::invalid(
            key,
            format!("{host:?} is neither an IP address nor a DNS name"),
        ))
    }
}

/// Refuses two listeners on one host and port (port 0, picked at start, never clashes).
pub fn check_ports<'a>(
    listeners: impl IntoIterator<Item = (String, &'a str, u16)>,
) -> Result<(), ConfigError> {
    let mut taken: HashMap<(String, u16), (String, &'a str)> = HashMap::new();
    for (key, host, port) in listeners {
        if port == 0 {
            continue;
        }
        for address in host_addresses(host) {
            if let Some((first, first_host)) = taken.get(&(address.clone(), port)) {
                let same = if *first_host == host {
                    String::new()
                } else {
                    format!(" ({first_host} and {host} are one host)")
                };
                return Err(ConfigError::invalid(
                    key,
                    format!("port {port} on {host} is already taken by {first}{same}"),
                ));
            }
        }
        for address in host_addresses(host) {
            taken.insert((address, port), (key.clone(), host));
        }
    }
    Ok(())
}

/// The addresses a host stands for when listeners are compared: an IP address in its one
/// spelling, `localhost` as both loopback addresses, any other name as itself (lower case).
fn host_addresses(host: &str) -> Vec<String> {
    let name = host.trim_end_matches('.').to_ascii_lowercase();
    if let Ok(ip) = name
        .trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<std::net::IpAddr>()
    {
        return vec![ip.to_string()];
    }
    if name == "localhost" || name.ends_with(".localhost") {
        return vec!["127.0.0.1".into(), "::1".into()];
    }
    vec![name]
}

/// Refuses a cluster whose IP-address hosts mix IPv4 and IPv6: a process's QUIC endpoint binds
/// one family and could not dial a peer of the other. `hosts` are (key, host) of every node and
/// the router, each node's `bind` included; names (resolved at start) are not judged.
pub fn check_address_families<'a>(
    hosts: impl IntoIterator<Item = (String, &'a str)>,
) -> Result<(), ConfigError> {
    let mut first: [Option<(String, &str)>; 2] = [None, None];
    for (key, host) in hosts {
        let Ok(ip) = host.parse::<std::net::IpAddr>() else {
            continue;
        };
        let (family, other) = if ip.is_ipv4() { (0, 1) } else { (1, 0) };
        if let Some((other_key, other_host)) = &first[other] {
            return Err(ConfigError::invalid(
                key,
                format!(
                    "{host} is {} but {other_key} is {other_host}, {}: every node and the router must use one address family",
                    if family == 0 { "IPv4" } else { "IPv6" },
                    if family == 0 { "IPv6" } else { "IPv4" },
                ),
            ));
        }
        first[family].get_or_insert((key, host));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_are_ip_addresses_or_dns_names() {
        for host in ["127.0.0.1", "::1", "10.0.0.7", "node-1.cluster.local", "gpu7"] {
            assert_eq!(check_host("h", host), Ok(()), "{host}");
        }
        for host in ["", "a b", "-bad", "bad-", "x..y", "under_score", "http://x"] {
            assert_eq!(
                check_host("nodes[0].host", host).unwrap_err().to_string(),
                format!("cluster.toml: nodes[0].host: {host:?} is neither an IP address nor a DNS name"),
            );
        }
    }

    #[test]
    fn one_host_spelled_two_ways_takes_a_port_once() {
        for (a, b) in [
            ("127.0.0.1", "localhost"),
            ("::1", "localhost"),
            ("::1", "0:0:0:0:0:0:0:1"),
            ("Gpu7", "gpu7."),
        ] {
            let error = check_ports([("x".to_string(), a, 9000), ("y".to_string(), b, 9000)]).unwrap_err();
            assert_eq!(
                error.to_string(),
                format!("cluster.toml: y: port 9000 on {b} is already taken by x ({a} and {b} are one host)"),
            );
        }
        assert!(
            check_ports([
                ("x".to_string(), "127.0.0.1", 9000),
                ("y".to_string(), "::1", 9000)
            ])
            .is_ok()
        );
    }

    #[test]
    fn ipv4_and_ipv6_hosts_are_not_mixed() {
        let hosts = |list: &[(&'static str, &'static str)]| {
            check_address_families(list.iter().map(|(key, host)| (key.to_string(), *host)))
        };
        assert!(hosts(&[("a", "::1"), ("b", "::1"), ("c", "localhost")]).is_ok());
        assert!(hosts(&[("a", "127.0.0.1"), ("b", "10.0.0.2")]).is_ok());
        assert_eq!(
            hosts(&[("nodes[0].host", "127.0.0.1"), ("router.host", "::1")])
                .unwrap_err()
                .to_string(),
            "cluster.toml: router.host: ::1 is IPv6 but nodes[0].host is 127.0.0.1, IPv4: every node and the router must use one address family"
        );
    }

    #[test]
    fn a_port_is_taken_once_per_host() {
        let ok = [
            ("a".to_string(), "h1", 9000),
            ("b".to_string(), "h2", 9000),
            ("c".to_string(), "h1", 0),
            ("d".to_string(), "h1", 0),
        ];
        assert_eq!(check_ports(ok), Ok(()));
        let clash = [
            ("nodes[0].control_port".to_string(), "h1", 9000),
            ("nodes[1].admin_port".to_string(), "h1", 9000),
        ];
        assert_eq!(
            check_ports(clash).unwrap_err().to_string(),
            "cluster.toml: nodes[1].admin_port: port 9000 on h1 is already taken by nodes[0].control_port"
        );
    }

    #[test]
    fn launch_and_ssh_go_together() {
        let placement = |launch, ssh: Option<&str>| NodePlacement {
            launch,
            ssh: ssh.map(Into::into),
            ..NodePlacement::default()
        };
        assert_eq!(
            node_deployment("nodes[0]", placement(None, None)).unwrap(),
            (NodeAddress::default(), Launch::Local)
        );
        assert_eq!(
            node_deployment("nodes[0]", placement(Some(LaunchKind::Ssh), Some("me@gpu7")))
                .unwrap()
                .1,
            Launch::Ssh {
                target: "me@gpu7".into()
            }
        );
        let error = |launch, ssh| {
            node_deployment("nodes[0]", placement(launch, ssh))
                .unwrap_err()
                .to_string()
        };
        assert_eq!(
            error(Some(LaunchKind::Ssh), None),
            "cluster.toml: nodes[0].ssh: launch = \"ssh\" needs an ssh target, e.g. ssh = \"user@host\""
        );
        assert_eq!(
            error(None, Some("me@gpu7")),
            "cluster.toml: nodes[0].ssh: only nodes with launch = \"ssh\" take an ssh target"
        );
        assert_eq!(
            error(Some(LaunchKind::Ssh), Some("-oProxyCommand=x")),
            "cluster.toml: nodes[0].ssh: \"-oProxyCommand=x\" is not an ssh destination (user@host, no spaces, not an option)"
        );
    }
}
