//! `pdkv node` for a vLLM leg: resolves the node's addresses on this host, derives vLLM's
//! server command and kv-transfer-config from cluster.toml
//! ([`VllmCluster::server_command`]), and replaces this process with it (`exec`), so the
//! launcher's process is vLLM's and signals reach vLLM directly. `--dry-run` prints the command
//! instead.

use std::os::unix::process::CommandExt;
use std::process::{Command, ExitCode};

use anyhow::{Context, bail};
use pdkv_actors::engines::{ResolvedAddress, VllmCluster, VllmNode};
use pdkv_actors::node::resolve;

/// Resolves `node`'s bind and advertised addresses here (DNS names too: the connector takes
/// IP addresses).
pub fn resolved_address(node: &VllmNode) -> anyhow::Result<ResolvedAddress> {
    let ip = |host: &str| {
        resolve(host, 0)
            .map(|address| address.ip())
            .map_err(anyhow::Error::msg)
            .with_context(|| format!("node {}", node.name))
    };
    Ok(ResolvedAddress {
        bind: ip(node.address.bind_host())?,
        advertise: ip(&node.address.host)?,
    })
}

/// The command line of `command`, quoted for a POSIX shell.
pub fn shell_line(command: &Command) -> String {
    let quote = |text: &str| {
        if !text.is_empty()
            && text
                .bytes()
                .all(|byte| byte.is_ascii_alphanumeric() || b"-_./=:,@%+".contains(&byte))
        {
            text.to_string()
        } else {
            format!("'{}'", text.replace('\'', r"'\''"))
        }
    };
    let mut words: Vec<String> = command
        .get_envs()
        .filter_map(|(name, value)| {
            Some(format!(
                "{}={}",
                name.to_string_lossy(),
                quote(&value?.to_string_lossy())
            ))
        })
        .collect();
    words.push(quote(&command.get_program().to_string_lossy()));
    words.extend(command.get_args().map(|arg| quote(&arg.to_string_lossy())));
    words.join(" ")
}

/// The process that runs `node`.
pub fn server_process(cluster: &VllmCluster, node: &VllmNode) -> anyhow::Result<Command> {
    if node.address.admin_port == 0
        || (node.role == pdkv_core::wire::Role::Prefill && node.address.control_port == 0)
    {
        bail!(
            "node {}: a port is 0; a node of its own needs fixed ports (`pdkv launch` picks them)",
            node.name
        );
    }
    if cluster.tls.is_none() {
        bail!(
            "node {}: the cluster has no [tls] table: run `pdkv certs init` and set [tls] dir, or start the cluster with `pdkv launch`",
            node.name
        );
    }
    let server = cluster.server_command(node, &resolved_address(node)?);
    let mut command = Command::new(&server.program);
    command.args(&server.args).envs(&server.env);
    Ok(command)
}

/// Runs vLLM leg `name` in place of this process (or prints its command with `dry_run`).
pub fn run(cluster: &VllmCluster, name: &str, dry_run: bool) -> anyhow::Result<ExitCode> {
    let node = cluster
        .node(name)
        .with_context(|| format!("no vLLM node {name:?}"))?;
    let mut command = server_process(cluster, node)?;
    if dry_run {
        crate::outln!("{}", shell_line(&command));
        return Ok(ExitCode::SUCCESS);
    }
    tracing::info!(node = name, command = %shell_line(&command), "starting vLLM");
    let error = command.exec();
    bail!(
        "node {name}: cannot run {} ({error}); [engines.vllm] python must name a Python with vLLM and pdkv_vllm",
        cluster.engine.python.display()
    )
}
