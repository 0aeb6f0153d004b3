//! `pdkv certs init`: a cluster CA and one certificate per node of a cluster.toml.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, Subcommand};
use pdkv_actors::config::ClusterConfig;
use pdkv_transport::tls::Existing;

/// `pdkv certs` subcommands.
#[derive(Debug, Subcommand)]
pub enum CertsCommand {
    /// Write a new cluster CA (`ca.pem`, `ca.key`) and `<node>.pem`/`<node>.key` for every node
    /// and the router.
    Init(InitArgs),
}

/// Arguments of `pdkv certs init`.
#[derive(Debug, Args)]
pub struct InitArgs {
    /// cluster.toml whose nodes get certificates (default: the embedded shipped one).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Directory to write into (created if missing).
    #[arg(long)]
    pub out: PathBuf,
    /// Overwrite an existing CA in `--out`.
    #[arg(long)]
    pub force: bool,
}

/// Runs `pdkv certs ...`.
pub fn run(command: CertsCommand) -> anyhow::Result<ExitCode> {
    match command {
        CertsCommand::Init(args) => init(args),
    }
}

fn init(args: InitArgs) -> anyhow::Result<ExitCode> {
    let config = match &args.config {
        Some(path) => ClusterConfig::from_file(path)?,
        None => ClusterConfig::embedded_default(),
    };
    let ca_key = args.out.join("ca.key");
    // Every node and the router, which holds a certificate like any node.
    let mut names: Vec<&str> = config.nodes.iter().map(|node| node.name.0.as_str()).collect();
    names.push(pdkv_actors::config::ROUTER_NODE);
    let existing = if args.force {
        Existing::Replace
    } else {
        Existing::Refuse
    };
    pdkv_transport::tls::write_cluster_certs(&args.out, "pdkv", &names, existing)
        .with_context(|| format!("cannot write certificates to {}", args.out.display()))?;
    crate::outln!(
        "wrote {} (CA certificate) and {} (CA key, keep it off the nodes)",
        args.out.join("ca.pem").display(),
        ca_key.display()
    );
    for name in names {
        crate::outln!(
            "wrote {0}.pem and {0}.key for node {name}",
            args.out.join(name).display()
        );
    }
    Ok(ExitCode::SUCCESS)
}
