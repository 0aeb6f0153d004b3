//! The transfer actor: executes a decode leg's READ plan through a [`ReadEngine`].
//!
//! It posts the plan and awaits the engine's handle (bounded by the read timeout) without
//! blocking its arbiter: engines copy small batches inline and large ones on their own worker
//! threads, as mori's backend threads do. The bytes move between registered regions and never
//! through a mailbox. After
//! the copy it reads the prefill leg's generation words for every source block: a block freed and
//! possibly reused during the copy fails the READ (fail closed), as does any partial transfer.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use actix::{Actor, Context, Handler, Message, ResponseFuture};
use pdkv_core::exchange::Pairing;
use pdkv_core::layout::KvLayout;
use pdkv_core::leg::{GenerationCheck, ReadDone};
use pdkv_core::plan::{self, RegionLayout, TransferPlan};
use pdkv_core::wire::{Failure, GrantId, NodeId, RequestId};
use pdkv_transport::control::Hello;
use pdkv_transport::engine::{EngineKey, EngineKind, ReadEngine, ReadOp};
use pdkv_transport::host::same_host;

/// Which of a decode leg's engines reads from a prefill leg: the first of `ours` (in preference
/// order) that the peer offers and that can reach it. Same-host engines (in-process, shared
/// memory) need equal host ids; the network engine and mori reach any host.
pub fn choose_engine(ours: &[EngineKind], our_host: &str, peer: &Hello) -> Result<usize, String> {
    let offered = |kind: EngineKind| peer.engines.iter().any(|advert| advert.engine.kind == kind);
    let local = same_host(our_host, &peer.host);
    ours.iter()
        .position(|&kind| {
            offered(kind)
                && match kind {
                    EngineKind::Local | EngineKind::Shm => local,
                    EngineKind::Net | EngineKind::Mori => true,
                }
        })
        .ok_or_else(|| {
            let offers: Vec<EngineKind> = peer.engines.iter().map(|advert| advert.engine.kind).collect();
            format!(
                "{} offers READ engines {offers:?}{}, this leg reads with {ours:?}",
                peer.node,
                if local { "" } else { " from another host" }
            )
        })
}

/// The transfer actor of one decode leg.
pub struct TransferActor {
    /// This leg's engines, in preference order.
    engines: Vec<Arc<dyn ReadEngine>>,
    /// This leg's host id.
    host: String,
    /// The engine each prefill leg is read with, chosen at its hello.
    chosen: HashMap<NodeId, Arc<dyn ReadEngine>>,
    layout: KvLayout,
    local_regions: RegionLayout,
    /// Region layouts of the prefill legs this leg reads from, learned from their hellos.
    remote_regions: HashMap<NodeId, RegionLayout>,
    read_timeout: Duration,
    mailbox: usize,
}

impl TransferActor {
    /// A transfer actor over `engines` (in preference order) for a leg on `host` whose memory
    /// is placed as `local_regions`.
    pub fn new(
        engines: Vec<Arc<dyn ReadEngine>>,
        host: String,
        layout: KvLayout,
        local_regions: RegionLayout,
        read_timeout: Duration,
        mailbox: usize,
    ) -> Self {
        TransferActor {
            engines,
            host,
            chosen: HashMap::new(),
            layout,
            local_regions,
            remote_regions: HashMap::new(),
            read_timeout,
            mailbox,
        }
    }
}

impl Actor for TransferActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.set_mailbox_capacity(self.mailbox);
    }
}

/// A prefill leg said hello: learn its READ engine and where its blocks sit.
#[derive(Debug, Message)]
#[rtype(result = "Result<(), Failure>")]
pub struct AddPeer {
    /// The prefill leg's hello.
    pub hello: Hello,
}

impl Handler<AddPeer> for TransferActor {
    type Result = Result<(), Failure>;

    fn handle(&mut self, msg: AddPeer, _ctx: &mut Self::Context) -> Self::Result {
        let kinds: Vec<EngineKind> = self
            .engines
            .iter()
            .map(|engine| engine.descriptor().kind)
            .collect();
        let index = choose_engine(&kinds, &self.host, &msg.hello).map_err(Failure::Read)?;
        let engine = self.engines[index].clone();
        let advert = msg
            .hello
            .engines
            .iter()
            .find(|advert| advert.engine.kind == kinds[index])
            .ok_or_else(|| {
                Failure::Read(format!(
                    "{} offers no {:?} READ engine",
                    msg.hello.node, kinds[index]
                ))
            })?;
        engine
            .register_remote(&advert.engine, &advert.regions)
            .map_err(|error| Failure::Read(error.to_string()))?;
        tracing::info!(peer = %msg.hello.node, engine = ?kinds[index], "reading from peer");
        self.chosen.insert(msg.hello.node.clone(), engine);
        self.remote_regions
            .insert(msg.hello.node.clone(), msg.hello.regions.clone());
        Ok(())
    }
}

/// READ the paired blocks from a prefill leg.
#[derive(Debug, Message)]
#[rtype(result = "Result<ReadDone, Failure>")]
pub struct Read {
    /// The request (for logs).
    pub request: RequestId,
    /// The prefill leg.
    pub prefill: NodeId,
    /// The grant the READ is made under.
    pub grant: GrantId,
    /// Block pairs per group.
    pub pairing: Pairing,
    /// Generations to verify after the copy.
    pub checks: Vec<GenerationCheck>,
}

impl Handler<Read> for TransferActor {
    type Result = ResponseFuture<Result<ReadDone, Failure>>;

    fn handle(&mut self, msg: Read, _ctx: &mut Self::Context) -> Self::Result {
        let planned = match (
            self.remote_regions.get(&msg.prefill),
            self.chosen.get(&msg.prefill),
        ) {
            (Some(remote), Some(engine)) => {
                plan::plan(&self.layout, &msg.pairing, &self.local_regions, remote)
                    .map(|plan| (plan, remote.clone(), engine.clone()))
                    .map_err(|error| Failure::Plan(error.to_string()))
            }
            _ => Err(Failure::Read(format!("{} never said hello", msg.prefill))),
        };
        let read_timeout = self.read_timeout;
        Box::pin(async move {
            let started = std::time::Instant::now();
            let result = async {
                let (plan, remote_regions, engine) = planned?;
                let remote = EngineKey(msg.prefill.0.clone());
                let report = read_plan(engine.as_ref(), &remote, msg.grant, &plan, read_timeout).await?;
                verify_generations(engine.as_ref(), &remote, &msg, &remote_regions).await?;
                Ok(report)
            }
            .await;
            match &result {
                Ok(report) => {
                    tracing::debug!(request = %msg.request, bytes = report.bytes, runs = report.runs, "read done");
                    metrics::histogram!("pdkv_kv_transfer_seconds").record(started.elapsed().as_secs_f64());
                    metrics::histogram!("pdkv_kv_transfer_bytes").record(report.bytes as f64);
                    metrics::histogram!("pdkv_kv_transfer_runs").record(report.runs as f64);
                }
                Err(failure) => {
                    metrics::counter!("pdkv_kv_transfer_failures_total", "reason" => failure_reason(failure))
                        .increment(1);
                }
            }
            result
        })
    }
}

/// A transfer failure's metric label.
fn failure_reason(failure: &Failure) -> &'static str {
    match failure {
        Failure::StaleBlock { .. } => "stale_block",
        Failure::Plan(_) => "plan",
        Failure::Read(_) => "read",
        _ => "other",
    }
}

async fn read_plan(
    engine: &dyn ReadEngine,
    remote: &EngineKey,
    grant: GrantId,
    plan: &TransferPlan,
    read_timeout: Duration,
) -> Result<ReadDone, Failure> {
    let ops: Vec<ReadOp> = plan
        .layers
        .iter()
        .map(|layer| ReadOp {
            grant,
            local_region: layer.local_region,
            remote_engine: remote.clone(),
            remote_region: layer.remote_region,
            runs: layer.runs.clone(),
        })
        .collect();
    let read = |error: pdkv_transport::engine::EngineError| Failure::Read(error.to_string());
    let report = engine
        .batch_read(ops)
        .map_err(read)?
        .wait(read_timeout)
        .await
        .map_err(read)?;
    Ok(ReadDone {
        bytes: report.bytes,
        runs: report.runs as u64,
    })
}

/// Reads the prefill leg's generation words after the copy: any change means a source block was
/// freed (and maybe reused) while it was being read.
async fn verify_generations(
    engine: &dyn ReadEngine,
    remote: &EngineKey,
    msg: &Read,
    remote_regions: &RegionLayout,
) -> Result<(), Failure> {
    let mut by_group: BTreeMap<usize, Vec<&GenerationCheck>> = BTreeMap::new();
    for check in &msg.checks {
        by_group.entry(check.group).or_default().push(check);
    }
    for (group, checks) in by_group {
        let blocks: Vec<u32> = checks.iter().map(|check| check.block).collect();
        let table = remote_regions.generation_region(group).ok_or_else(|| {
            Failure::Read(format!(
                "{} has no generation table for group {group}",
                msg.prefill
            ))
        })?;
        let found = engine
            .read_remote_words(remote, msg.grant, table, &blocks)
            .await
            .map_err(|error| Failure::Read(error.to_string()))?;
        for (check, found) in checks.iter().zip(found) {
            if found != check.generation {
                tracing::warn!(request = %msg.request, group, block = check.block, "stale block after read");
                return Err(Failure::StaleBlock {
                    group: group as u64,
                    block: check.block,
                    expected: check.generation,
                    found,
                });
            }
        }
    }
    Ok(())
}
