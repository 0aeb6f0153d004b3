//! The transfer actor: executes a decode leg's READ plan through a [`ReadEngine`].
//!
//! It posts the plan and awaits the engine's handle (bounded by the read timeout) without
//! blocking its arbiter: engines copy small batches inline and large ones on their own worker
//! threads, as mori's backend threads do. The bytes move between registered regions and never
//! through a mailbox. After
//! the copy it reads the prefill leg's generation words for every source block: a block freed and
//! possibly reused during the copy fails the READ (fail closed), as does any partial transfer.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use actix::{Actor, Context, Handler, Message, ResponseFuture};
use pdkv_core::exchange::Pairing;
use pdkv_core::layout::KvLayout;
use pdkv_core::leg::{GenerationCheck, ReadDone};
use pdkv_core::plan::{self, HeadLayout, RegionLayout};
use pdkv_core::wire::{Failure, GrantId, NodeId, RequestId};
use pdkv_transport::control::Hello;
use pdkv_transport::engine::{EngineKey, EngineKind, ReadEngine};
use pdkv_transport::kv_read::{KvRead, KvReadError, choose_engine};

/// The transfer actor of one decode leg.
pub struct TransferActor {
    /// This leg's engines, in preference order.
    engines: Vec<Arc<dyn ReadEngine>>,
    /// This leg's host id.
    host: String,
    /// The engine each prefill leg is read with, chosen at its hello.
    chosen: HashMap<NodeId, Arc<dyn ReadEngine>>,
    layout: KvLayout,
    /// The model's KV heads, as every rank's blocks hold them.
    heads: HeadLayout,
    local_regions: RegionLayout,
    /// Region layouts of the prefill legs this leg reads from, learned from their hellos.
    remote_regions: HashMap<NodeId, RegionLayout>,
    read_timeout: Duration,
    mailbox: usize,
    /// READs planned so far: spreads reads of replicated KV heads over their prefill replicas.
    reads: u64,
}

impl TransferActor {
    /// A transfer actor over `engines` (in preference order) for a leg on `host` whose memory
    /// is placed as `local_regions`, its blocks holding KV heads as `heads` says.
    pub fn new(
        engines: Vec<Arc<dyn ReadEngine>>,
        host: String,
        layout: KvLayout,
        heads: HeadLayout,
        local_regions: RegionLayout,
        read_timeout: Duration,
        mailbox: usize,
    ) -> Self {
        TransferActor {
            engines,
            host,
            chosen: HashMap::new(),
            layout,
            heads,
            local_regions,
            remote_regions: HashMap::new(),
            read_timeout,
            mailbox,
            reads: 0,
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
        // A pair whose KV cannot be resharded is refused when it meets, not at its first READ.
        plan::check_sharding(
            &self.layout,
            self.heads,
            (msg.hello.regions.ranks, msg.hello.regions.dcp),
            (self.local_regions.ranks, self.local_regions.dcp),
        )
        .map_err(Failure::Plan)?;
        let kinds: Vec<EngineKind> = self
            .engines
            .iter()
            .map(|engine| engine.descriptor().kind)
            .collect();
        let index = choose_engine(&kinds, &self.host, &msg.hello)
            .map_err(|error| Failure::Read(error.to_string()))?;
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
        let rotation = self.reads;
        self.reads = self.reads.wrapping_add(1);
        let planned = match (
            self.remote_regions.get(&msg.prefill),
            self.chosen.get(&msg.prefill),
        ) {
            (Some(remote), Some(engine)) => plan::plan_sharded(
                &self.layout,
                &msg.pairing,
                &self.local_regions,
                remote,
                self.heads,
                rotation,
            )
            .map(|plan| (plan, remote.clone(), engine.clone()))
            .map_err(Failure::Plan),
            _ => Err(Failure::Read(format!("{} never said hello", msg.prefill))),
        };
        let read_timeout = self.read_timeout;
        Box::pin(async move {
            let started = std::time::Instant::now();
            let result: Result<ReadDone, Failure> = async {
                let (plan, remote_regions, engine) = planned?;
                let remote = EngineKey(msg.prefill.0.clone());
                let read = KvRead {
                    engine: engine.as_ref(),
                    remote: &remote,
                    grant: msg.grant,
                    plan: &plan,
                    remote_regions: &remote_regions,
                    checks: &msg.checks,
                    timeout: read_timeout,
                };
                let report = read.run().await.map_err(|error| {
                    if let KvReadError::Stale { group, block, .. } = &error {
                        tracing::warn!(request = %msg.request, group, block, "stale block after read");
                    }
                    read_failure(error)
                })?;
                Ok(ReadDone {
                    bytes: report.bytes,
                    runs: report.runs as u64,
                })
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
                    metrics::counter!("pdkv_kv_transfer_failures_total", "reason" => failure.kind())
                        .increment(1);
                }
            }
            result
        })
    }
}

/// How a READ failure crosses the wire: a changed generation keeps its own variant (the
/// router and the client learn the KV was refused, not lost).
fn read_failure(error: KvReadError) -> Failure {
    match error {
        KvReadError::Stale {
            group,
            block,
            expected,
            found,
        } => Failure::StaleBlock {
            group: group as u64,
            block,
            expected,
            found,
        },
        other => Failure::Read(other.to_string()),
    }
}
