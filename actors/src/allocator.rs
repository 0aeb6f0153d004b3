//! The allocator actor: owns one leg's [`Allocator`] and [`GrantTable`].
//!
//! A grant is a pin with a lease, so both live here: pinning and issuing happen in one message,
//! and a lapsed lease unpins in the same place that frees. Every change mirrors freed blocks'
//! new generations into the leg's shared generation tables (readers check them after copying)
//! and wakes requests waiting for blocks. Lease expiry is a timer computed from the table's
//! earliest deadline (timers are data).

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use actix::{Actor, AsyncContext, Context, Handler, Message, MessageResult, SpawnHandle};
use pdkv_core::allocator::{AllocError, Allocation, Allocator};
use pdkv_core::block::BlockId;
use pdkv_core::grant::{GrantError, GrantTable};
use pdkv_core::leg::IssuedGrant;
use pdkv_core::wire::{GrantId, LegLoad, NodeId, RequestId};
use pdkv_transport::clock::MonotonicClock;
use tokio::sync::watch;

use crate::error::RequestError;
use crate::memory::LegMemory;

/// The allocator actor of one leg.
pub struct AllocatorActor {
    node: NodeId,
    allocator: Allocator,
    /// The leg's one grant table: this actor issues, renews and ends grants; a network memory
    /// server's authorizer reads the same table (see [`AllocatorActor::grant_table`]).
    grants: Arc<Mutex<GrantTable>>,
    lease_ms: u64,
    memory: Arc<LegMemory>,
    /// Counts frees; requests waiting for blocks watch it and retry.
    freed: watch::Sender<u64>,
    /// Lease times; the same kind of clock a memory server checks grants with.
    clock: MonotonicClock,
    expiry_timer: Option<(u64, SpawnHandle)>,
    mailbox: usize,
}

impl AllocatorActor {
    /// An allocator actor over `allocator` issuing grants into `grants` with leases on `clock`
    /// (both shared with a network memory server, if the leg serves one), mirroring
    /// generations into `memory`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        node: NodeId,
        allocator: Allocator,
        grants: Arc<Mutex<GrantTable>>,
        clock: MonotonicClock,
        lease_ms: u64,
        memory: Arc<LegMemory>,
        freed: watch::Sender<u64>,
        mailbox: usize,
    ) -> Self {
        AllocatorActor {
            node,
            allocator,
            grants,
            lease_ms,
            memory,
            freed,
            clock,
            expiry_timer: None,
            mailbox,
        }
    }

    /// The leg's grant table, shared with whoever checks READs against it (a network memory
    /// server's `GrantAuthorizer`).
    pub fn grant_table(&self) -> Arc<Mutex<GrantTable>> {
        self.grants.clone()
    }

    fn table(&self) -> std::sync::MutexGuard<'_, GrantTable> {
        // A panic while holding the lock cannot leave the table half-changed: every method
        // changes it in one step.
        self.grants.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn now_ms(&self) -> u64 {
        self.clock.now_ms()
    }

    /// Mirrors freed blocks' generations into shared memory and wakes waiters.
    fn publish_freed(&mut self) {
        let freed = self.allocator.poll_freed();
        if freed.is_empty() {
            return;
        }
        for block in &freed {
            if let Some(table) = self.memory.generations.get(block.group) {
                // The table holds capacity + 1 words; the allocator only frees ids it owns.
                if let Err(error) = table.store_u32(block.block as usize, block.generation) {
                    tracing::error!(node = %self.node, %error, "generation table too small");
                }
            }
        }
        self.freed.send_modify(|frees| *frees = frees.wrapping_add(1));
    }

    fn revoke(&mut self, grant: GrantId) {
        let revoked = self.table().revoke(grant);
        if let Some(grant) = revoked {
            tracing::debug!(node = %self.node, grant = grant.id.0, request = %grant.request, "grant revoked");
            if let Err(error) = self.allocator.unpin(&grant.blocks) {
                tracing::error!(node = %self.node, %error, "unpin of a revoked grant failed");
            }
        }
    }

    /// Arms the lease timer for the earliest deadline, if it changed.
    fn schedule_expiry(&mut self, ctx: &mut Context<Self>) {
        let next = self.table().poll_timeout();
        if self.expiry_timer.as_ref().map(|(at, _)| *at) == next {
            return;
        }
        if let Some((_, handle)) = self.expiry_timer.take() {
            ctx.cancel_future(handle);
        }
        if let Some(at) = next {
            let delay = Duration::from_millis(at.saturating_sub(self.now_ms()));
            let handle = ctx.run_later(delay, |actor, ctx| {
                actor.expiry_timer = None;
                let now = actor.now_ms();
                let expired = actor.table().expire(now);
                for grant in expired {
                    metrics::counter!("pdkv_lease_expired_total").increment(1);
                    tracing::warn!(node = %actor.node, grant = grant.id.0, request = %grant.request, peer = %grant.peer, "lease expired, unpinning");
                    if let Err(error) = actor.allocator.unpin(&grant.blocks) {
                        tracing::error!(node = %actor.node, %error, "unpin of an expired grant failed");
                    }
                }
                actor.publish_freed();
                actor.schedule_expiry(ctx);
            });
            self.expiry_timer = Some((at, handle));
        }
    }
}

impl Actor for AllocatorActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.set_mailbox_capacity(self.mailbox);
    }
}

/// Admit a request: allocate its blocks (see [`Allocator::allocate`]).
#[derive(Debug, Message)]
#[rtype(result = "Result<Allocation, AllocError>")]
pub struct Allocate {
    /// The request.
    pub request: RequestId,
    /// Its prompt (for prefix hits).
    pub prompt: Arc<[u32]>,
    /// Token slots to cover.
    pub slots: u64,
    /// First token this leg computes whose earlier KV comes from elsewhere, if any.
    pub attending_token: Option<u64>,
}

impl Handler<Allocate> for AllocatorActor {
    type Result = Result<Allocation, AllocError>;

    fn handle(&mut self, msg: Allocate, _ctx: &mut Self::Context) -> Self::Result {
        let result = self
            .allocator
            .allocate(msg.request, &msg.prompt, msg.slots, msg.attending_token);
        // Evicting cached blocks bumps generations too.
        self.publish_freed();
        result
    }
}

/// Grow a request's lists to cover more slots.
#[derive(Debug, Message)]
#[rtype(result = "Result<Vec<Vec<BlockId>>, AllocError>")]
pub struct Extend {
    /// The request.
    pub request: RequestId,
    /// Token slots to cover.
    pub slots: u64,
}

impl Handler<Extend> for AllocatorActor {
    type Result = Result<Vec<Vec<BlockId>>, AllocError>;

    fn handle(&mut self, msg: Extend, _ctx: &mut Self::Context) -> Self::Result {
        let result = self.allocator.extend(msg.request, msg.slots).map(<[_]>::to_vec);
        self.publish_freed();
        result
    }
}

/// Free window blocks that `attending_token` no longer sees; returns the request's lists.
#[derive(Debug, Message)]
#[rtype(result = "Result<Vec<Vec<BlockId>>, AllocError>")]
pub struct ReleaseWindow {
    /// The request.
    pub request: RequestId,
    /// The next token to be computed (or recomputed by a decode leg).
    pub attending_token: u64,
}

impl Handler<ReleaseWindow> for AllocatorActor {
    type Result = Result<Vec<Vec<BlockId>>, AllocError>;

    fn handle(&mut self, msg: ReleaseWindow, _ctx: &mut Self::Context) -> Self::Result {
        self.allocator.release_window(msg.request, msg.attending_token)?;
        self.publish_freed();
        self.allocator
            .blocks(msg.request)
            .map(<[_]>::to_vec)
            .ok_or(AllocError::UnknownRequest(msg.request))
    }
}

/// A request is done on this leg; pinned blocks stay until their grant ends.
#[derive(Debug, Message)]
#[rtype(result = "Result<(), AllocError>")]
pub struct Finish {
    /// The request.
    pub request: RequestId,
    /// The prompt, to register its full blocks in the prefix cache (successful requests only).
    pub cache_prompt: Option<Arc<[u32]>>,
}

impl Handler<Finish> for AllocatorActor {
    type Result = Result<(), AllocError>;

    fn handle(&mut self, msg: Finish, _ctx: &mut Self::Context) -> Self::Result {
        let result = self.allocator.finish(msg.request, msg.cache_prompt.as_deref());
        self.publish_freed();
        result
    }
}

/// Pin `lists` and grant `peer` a READ of them under a lease.
#[derive(Debug, Message)]
#[rtype(result = "Result<IssuedGrant, RequestError>")]
pub struct GrantBlocks {
    /// The request.
    pub request: RequestId,
    /// The only peer that may read.
    pub peer: NodeId,
    /// Blocks to pin, per group.
    pub lists: Vec<Vec<BlockId>>,
}

impl Handler<GrantBlocks> for AllocatorActor {
    type Result = Result<IssuedGrant, RequestError>;

    fn handle(&mut self, msg: GrantBlocks, ctx: &mut Self::Context) -> Self::Result {
        let generations = self.allocator.pin(&msg.lists)?;
        let now = self.now_ms();
        let issued = self
            .table()
            .issue(msg.request, msg.peer, msg.lists.clone(), self.lease_ms, now);
        match issued {
            Ok(grant) => {
                self.schedule_expiry(ctx);
                Ok(IssuedGrant {
                    grant,
                    generations,
                    lease_ms: self.lease_ms,
                })
            }
            Err(error) => {
                self.allocator.unpin(&msg.lists)?;
                self.publish_freed();
                Err(error.into())
            }
        }
    }
}

/// The peer is done reading: end the grant and unpin.
#[derive(Debug, Message)]
#[rtype(result = "Result<(), GrantError>")]
pub struct ReleaseGrant {
    /// The grant.
    pub grant: GrantId,
    /// The peer releasing it.
    pub peer: NodeId,
}

impl Handler<ReleaseGrant> for AllocatorActor {
    type Result = Result<(), GrantError>;

    fn handle(&mut self, msg: ReleaseGrant, ctx: &mut Self::Context) -> Self::Result {
        let grant = self.table().release(msg.grant, &msg.peer)?;
        if let Err(error) = self.allocator.unpin(&grant.blocks) {
            tracing::error!(node = %self.node, %error, "unpin of a released grant failed");
        }
        self.publish_freed();
        self.schedule_expiry(ctx);
        Ok(())
    }
}

/// End a grant nobody will read (the request was aborted or is over) and unpin its blocks.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct RevokeGrant {
    /// The grant.
    pub grant: GrantId,
}

impl Handler<RevokeGrant> for AllocatorActor {
    type Result = ();

    fn handle(&mut self, msg: RevokeGrant, ctx: &mut Self::Context) -> Self::Result {
        self.revoke(msg.grant);
        self.publish_freed();
        self.schedule_expiry(ctx);
    }
}

/// End every grant issued for a request (the router aborted it) and unpin their blocks.
#[derive(Debug, Message)]
#[rtype(result = "usize")]
pub struct RevokeRequest {
    /// The request.
    pub request: RequestId,
}

impl Handler<RevokeRequest> for AllocatorActor {
    type Result = usize;

    fn handle(&mut self, msg: RevokeRequest, ctx: &mut Self::Context) -> Self::Result {
        let grants = self.table().grants_of(msg.request);
        for &grant in &grants {
            self.revoke(grant);
        }
        self.publish_freed();
        self.schedule_expiry(ctx);
        grants.len()
    }
}

/// The peer still waits: extend the lease. Answers the lease length, which runs from now.
#[derive(Debug, Message)]
#[rtype(result = "Result<u64, GrantError>")]
pub struct RenewGrant {
    /// The grant.
    pub grant: GrantId,
    /// The peer renewing it.
    pub peer: NodeId,
}

impl Handler<RenewGrant> for AllocatorActor {
    type Result = Result<u64, GrantError>;

    fn handle(&mut self, msg: RenewGrant, ctx: &mut Self::Context) -> Self::Result {
        let now = self.now_ms();
        let result = self.table().renew(msg.grant, &msg.peer, now);
        self.schedule_expiry(ctx);
        result.map(|_expires_at_ms| self.lease_ms)
    }
}

/// A leg's block accounting, for leak checks and the demo's summary: its name and the load
/// it reports to routers (one type for both).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LegStats {
    /// Leg name.
    pub node: NodeId,
    /// Requests, grants and free blocks per group.
    pub load: LegLoad,
}

impl LegStats {
    /// Whether nothing is held: free equals capacity in every group, no request, no grant.
    pub fn is_idle(&self) -> bool {
        self.load.is_idle()
    }
}

/// Ask for the leg's [`LegStats`].
#[derive(Debug, Message)]
#[rtype(result = "LegStats")]
pub struct Stats;

impl Handler<Stats> for AllocatorActor {
    type Result = MessageResult<Stats>;

    fn handle(&mut self, _msg: Stats, _ctx: &mut Self::Context) -> Self::Result {
        let groups = self.memory.generations.len();
        MessageResult(LegStats {
            node: self.node.clone(),
            load: LegLoad {
                requests: self.allocator.num_requests() as u64,
                grants: self.table().len() as u64,
                free_blocks: (0..groups)
                    .map(|group| self.allocator.free_blocks(group) as u64)
                    .collect(),
                capacity: (0..groups)
                    .map(|group| u64::from(self.allocator.capacity(group)))
                    .collect(),
            },
        })
    }
}
