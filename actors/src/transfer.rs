//! The transfer actor: executes a decode leg's READ plan through a [`ReadEngine`].
//!
//! It posts the plan and awaits the engine's handle (bounded by the read timeout) without
//! blocking its arbiter: engines copy small batches inline and large ones on their own worker
//! threads, as mori's backend threads do. The bytes move between registered regions and never
//! through a mailbox. After
//! the copy it reads the prefill leg's generation words for every source block: a block freed and
//! possibly reused during the copy fails the READ (fail closed), as does any partial transfer.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use actix::{Actor, Context, Handler, Message, ResponseFuture};
use pdkv_core::plan::TransferPlan;
use pdkv_core::wire::{GrantId, RequestId};
use pdkv_transport::engine::{EngineKey, ReadEngine, ReadOp, ReadReport};

use crate::error::RequestError;
use crate::exchange::GenerationCheck;

/// The transfer actor of one decode leg.
pub struct TransferActor {
    engine: Arc<dyn ReadEngine>,
    /// Region id of group 0's generation table on every leg (layers come first).
    generation_region_base: u32,
    read_timeout: Duration,
    mailbox: usize,
}

impl TransferActor {
    /// A transfer actor over `engine`; generation tables start at region `generation_region_base`.
    pub fn new(
        engine: Arc<dyn ReadEngine>,
        generation_region_base: u32,
        read_timeout: Duration,
        mailbox: usize,
    ) -> Self {
        TransferActor {
            engine,
            generation_region_base,
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

/// READ a plan from a prefill leg's engine.
#[derive(Debug, Message)]
#[rtype(result = "Result<ReadReport, RequestError>")]
pub struct Read {
    /// The request (for logs).
    pub request: RequestId,
    /// The prefill leg's engine.
    pub remote: EngineKey,
    /// The grant the READ is made under.
    pub grant: GrantId,
    /// Byte ranges per layer.
    pub plan: TransferPlan,
    /// Generations to verify after the copy.
    pub checks: Vec<GenerationCheck>,
}

impl Handler<Read> for TransferActor {
    type Result = ResponseFuture<Result<ReadReport, RequestError>>;

    fn handle(&mut self, msg: Read, _ctx: &mut Self::Context) -> Self::Result {
        let engine = self.engine.clone();
        let generation_region_base = self.generation_region_base;
        let read_timeout = self.read_timeout;
        Box::pin(async move {
            let ops: Vec<ReadOp> = msg
                .plan
                .layers
                .iter()
                .map(|layer| ReadOp {
                    grant: msg.grant,
                    local_region: layer.local_region,
                    remote_engine: msg.remote.clone(),
                    remote_region: layer.remote_region,
                    runs: layer.runs.clone(),
                })
                .collect();
            let report = engine.batch_read(ops)?.wait(read_timeout).await?;
            verify_generations(engine.as_ref(), &msg, generation_region_base).await?;
            tracing::debug!(request = %msg.request, bytes = report.bytes, runs = report.runs, "read done");
            Ok(report)
        })
    }
}

/// Reads the prefill leg's generation words after the copy: any change means a source block was
/// freed (and maybe reused) while it was being read.
async fn verify_generations(
    engine: &dyn ReadEngine,
    msg: &Read,
    generation_region_base: u32,
) -> Result<(), RequestError> {
    let mut by_group: BTreeMap<usize, Vec<&GenerationCheck>> = BTreeMap::new();
    for check in &msg.checks {
        by_group.entry(check.group).or_default().push(check);
    }
    for (group, checks) in by_group {
        let blocks: Vec<u32> = checks.iter().map(|check| check.block).collect();
        let found = engine
            .read_remote_words(
                &msg.remote,
                msg.grant,
                generation_region_base + group as u32,
                &blocks,
            )
            .await?;
        for (check, found) in checks.iter().zip(found) {
            if found != check.generation {
                tracing::warn!(request = %msg.request, group, block = check.block, "stale block after read");
                return Err(RequestError::StaleBlock {
                    group,
                    block: check.block,
                    expected: check.generation,
                    found,
                });
            }
        }
    }
    Ok(())
}
