//! The scheduler actor: drives one request at a time through its leg (many may be in flight).
//!
//! - Prefill leg: allocate `T + k_P` slots for the `T` tokens it computes (`N`, or `N - 1` with
//!   `prefill_tokens = "all_but_last"`; the mamba state is kept as it stood after `N - 1`
//!   tokens either way), free window blocks the decode leg will not read, offer, pin and grant
//!   the blocks holding tokens up to `N - 2`, and hand back the [`KvParams`].
//! - Decode leg: allocate `N + k_D` slots (window groups null below the last token's window,
//!   prefix hits reused), pair with the offer, READ, release the grant, recompute the last prompt
//!   token and decode.
//! - Direct: one leg does everything; the reference P/D output is checked against.
//!
//! The scheduler holds no mutable state: each handler runs a future over an immutable
//! [`LegContext`], so requests interleave while the allocator actor serialises block changes.
//! Every failure path releases what the request holds: its blocks, and the grant it read under.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use actix::{Actor, Addr, Context, Handler, Message, Recipient, ResponseFuture};
use pdkv_core::allocator::{AllocError, Allocation, window_crosses_block};
use pdkv_core::block::BlockId;
use pdkv_core::layout::GroupKind;
use pdkv_core::wire::{Incarnation, KvParams, NodeId, RequestId};
use pdkv_transport::engine::EngineKey;
use tokio::sync::Notify;

use crate::allocator::{
    Allocate, AllocatorActor, Extend, Finish, GrantBlocks, ReleaseGrant, ReleaseWindow, RenewGrant,
};
use crate::config::{Limits, PrefillTokens, Role};
use crate::engine::{LogitsDigest, Model, argmax};
use crate::error::{RequestError, ask};
use crate::exchange::{ExchangeActor, MakeOffer, PairWithOffer};
use crate::memory::LegMemory;
use crate::transfer::{Read, TransferActor};

/// The moment a request is over for the router; legs stop waiting and release by then.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadline {
    /// When it passes.
    pub at: Instant,
    /// The whole request's bound, for error messages.
    pub budget_ms: u64,
}

impl Deadline {
    /// A deadline `budget` from now.
    pub fn after(budget: Duration) -> Self {
        Deadline {
            at: Instant::now() + budget,
            budget_ms: budget.as_millis() as u64,
        }
    }

    /// Whether it has passed.
    pub fn is_past(&self) -> bool {
        Instant::now() >= self.at
    }

    /// The error of a request that ran out of time in `stage`.
    pub fn passed(&self, stage: &'static str) -> RequestError {
        RequestError::Timeout {
            stage,
            after_ms: self.budget_ms,
        }
    }
}

/// A finished request's result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Output {
    /// The request.
    pub request: RequestId,
    /// Generated tokens.
    pub tokens: Vec<u32>,
    /// Digest of every generated step's logits (bitwise).
    pub logits_digest: u64,
    /// Bytes the decode leg read (0 for direct runs).
    pub read_bytes: u64,
    /// READ ranges posted.
    pub read_runs: usize,
    /// Prefix-hit blocks the decode leg reused.
    pub cached_blocks: u64,
}

/// How a decode leg reaches a prefill leg's grants.
#[derive(Clone)]
pub struct GrantPeer {
    /// Ends a grant once the READ is over.
    pub release: Recipient<ReleaseGrant>,
    /// Extends a grant's lease while the decode leg waits.
    pub renew: Recipient<RenewGrant>,
}

/// Everything a leg's request futures need; immutable once built.
pub struct LegContext {
    /// Leg name (also its READ engine key).
    pub node: NodeId,
    /// This leg's incarnation, named in the grants it issues.
    pub incarnation: Incarnation,
    /// Prefill or decode.
    pub role: Role,
    /// Slots reserved beyond the prompt.
    pub lookahead_tokens: u64,
    /// How much of a prompt this leg computes when it prefills.
    pub prefill_tokens: PrefillTokens,
    /// Bounds.
    pub limits: Limits,
    /// The reference model.
    pub model: Arc<Model>,
    /// The leg's KV memory.
    pub memory: Arc<LegMemory>,
    /// The allocator actor.
    pub allocator: Addr<AllocatorActor>,
    /// The exchange actor.
    pub exchange: Addr<ExchangeActor>,
    /// The transfer actor (decode legs).
    pub transfer: Option<Addr<TransferActor>>,
    /// Where to renew and release grants, per prefill leg (decode legs).
    pub grant_peers: HashMap<NodeId, GrantPeer>,
    /// Woken when the allocator frees blocks.
    pub freed: Arc<Notify>,
    /// Requests now waiting for blocks (bounded by `limits.wait_queue`).
    pub waiting: AtomicUsize,
}

impl LegContext {
    /// Allocates, waiting (bounded in count and time) while the leg is out of blocks: at most
    /// `alloc_wait_ms`, and never past the request's `deadline`.
    async fn allocate(
        &self,
        request: RequestId,
        prompt: &Arc<[u32]>,
        slots: u64,
        attending_token: Option<u64>,
        deadline: Deadline,
        stage: &'static str,
    ) -> Result<Allocation, RequestError> {
        let started = Instant::now();
        let alloc_deadline = started + Duration::from_millis(self.limits.alloc_wait_ms);
        let wait_until = alloc_deadline.min(deadline.at);
        loop {
            let notified = self.freed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let message = Allocate {
                request,
                prompt: prompt.clone(),
                slots,
                attending_token,
            };
            let last = match ask(&self.allocator, message, "allocator").await? {
                Ok(allocation) => return Ok(allocation),
                Err(error @ AllocError::OutOfBlocks { .. }) => error,
                Err(error) => return Err(error.into()),
            };
            if self.waiting.fetch_add(1, Ordering::SeqCst) >= self.limits.wait_queue {
                self.waiting.fetch_sub(1, Ordering::SeqCst);
                return Err(RequestError::QueueFull {
                    leg: self.node.to_string(),
                    capacity: self.limits.wait_queue,
                });
            }
            let woken = tokio::time::timeout_at(wait_until.into(), notified).await;
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            if woken.is_err() {
                if wait_until < alloc_deadline {
                    return Err(deadline.passed(stage));
                }
                return Err(RequestError::AllocTimeout {
                    waited_ms: started.elapsed().as_millis() as u64,
                    last,
                });
            }
        }
    }

    async fn finish(&self, request: RequestId, cache_prompt: Option<Arc<[u32]>>) {
        let message = Finish {
            request,
            cache_prompt,
        };
        match ask(&self.allocator, message, "allocator").await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => tracing::error!(node = %self.node, %request, %error, "finish failed"),
            Err(error) => tracing::error!(node = %self.node, %request, %error, "finish not delivered"),
        }
    }

    /// Token slots a request of `tokens` computed tokens holds here: plus the lookahead tail.
    fn slots_for(&self, tokens: u64) -> Result<u64, RequestError> {
        tokens
            .checked_add(self.lookahead_tokens)
            .ok_or(RequestError::SlotOverflow {
                tokens,
                lookahead_tokens: self.lookahead_tokens,
            })
    }

    fn has_window_groups(&self) -> bool {
        self.model
            .layout()
            .groups()
            .iter()
            .any(|group| matches!(group.kind(), GroupKind::SlidingWindow { .. }))
    }

    /// Prefill leg: compute the prompt, offer its KV and grant `peer` a READ of it, unless the
    /// request's deadline passes first: then nothing stays granted.
    async fn prefill(
        &self,
        request: RequestId,
        prompt: Arc<[u32]>,
        peer: NodeId,
        deadline: Deadline,
    ) -> Result<KvParams, RequestError> {
        let num_tokens = prompt.len() as u64;
        if num_tokens == 0 {
            return Err(RequestError::EmptyPrompt);
        }
        // A request holds at least one slot, even a one-token prompt computed up to N - 1 = 0.
        let slots = self.slots_for(self.prefill_tokens.computed(num_tokens))?.max(1);
        let allocation = self
            .allocate(request, &prompt, slots, None, deadline, "prefill")
            .await?;
        let result = self
            .prefill_allocated(request, &prompt, peer.clone(), &allocation, deadline)
            .await;
        // The request's own hold ends here; granted blocks stay pinned until released or expired.
        self.finish(request, None).await;
        let params = result?;
        if deadline.is_past() {
            // Nobody waits for these parameters any more: unpin now rather than at lease end.
            let release = ReleaseGrant {
                grant: params.grant,
                peer,
            };
            if let Err(error) = ask(&self.allocator, release, "allocator").await? {
                tracing::warn!(node = %self.node, %request, %error, "release of a late grant failed");
            }
            return Err(deadline.passed("prefill"));
        }
        Ok(params)
    }

    async fn prefill_allocated(
        &self,
        request: RequestId,
        prompt: &Arc<[u32]>,
        peer: NodeId,
        allocation: &Allocation,
        deadline: Deadline,
    ) -> Result<KvParams, RequestError> {
        let num_tokens = prompt.len() as u64;
        let computed = self.prefill_tokens.computed(num_tokens) as usize;
        for (position, &token) in prompt.iter().enumerate().take(computed) {
            // The mamba state stays as it was after N - 1 tokens: the decode leg recomputes N - 1.
            let commit_state = (position as u64) + 1 < num_tokens;
            self.model.step(
                &self.memory,
                &allocation.blocks,
                position as u64,
                token,
                commit_state,
            )?;
        }
        if deadline.is_past() {
            return Err(deadline.passed("prefill"));
        }
        let release = ReleaseWindow {
            request,
            attending_token: num_tokens - 1,
        };
        let lists = ask(&self.allocator, release, "allocator").await??;
        let offer = ask(
            &self.exchange,
            MakeOffer {
                num_prompt_tokens: num_tokens,
                lists,
            },
            "exchange",
        )
        .await??;
        let offered: Vec<Vec<BlockId>> = offer.groups.iter().map(|list| list.blocks.clone()).collect();
        let issued = ask(
            &self.allocator,
            GrantBlocks {
                request,
                peer,
                lists: offered,
            },
            "allocator",
        )
        .await??;
        Ok(KvParams {
            request,
            prefill_node: self.node.clone(),
            prefill_incarnation: self.incarnation,
            offer,
            generations: issued.generations,
            grant: issued.grant,
            lease_ms: issued.lease_ms,
            prompt: prompt.to_vec(),
        })
    }

    /// Decode leg: READ the offered KV, recompute the last prompt token and decode, or stop at
    /// the request's deadline with everything released.
    async fn decode(
        &self,
        params: KvParams,
        max_tokens: u32,
        deadline: Deadline,
    ) -> Result<Output, RequestError> {
        let params = Arc::new(params);
        let request = params.request;
        let result = self.decode_granted(&params, max_tokens, deadline).await;
        if let Err(error) = &result {
            tracing::warn!(node = %self.node, %request, %error, "decode failed");
        }
        result
    }

    async fn decode_granted(
        &self,
        params: &Arc<KvParams>,
        max_tokens: u32,
        deadline: Deadline,
    ) -> Result<Output, RequestError> {
        let request = params.request;
        let prompt: Arc<[u32]> = params.prompt.clone().into();
        let num_tokens = prompt.len() as u64;
        let renewal = self.keep_lease_alive(params);
        let read = async {
            if num_tokens == 0 {
                return Err(RequestError::EmptyPrompt);
            }
            if params.offer.num_prompt_tokens != num_tokens {
                return Err(RequestError::BadParams(format!(
                    "offer is for {} tokens, prompt has {num_tokens}",
                    params.offer.num_prompt_tokens
                )));
            }
            let allocation = self
                .allocate(
                    request,
                    &prompt,
                    self.slots_for(num_tokens)?,
                    Some(num_tokens - 1),
                    deadline,
                    "decode",
                )
                .await?;
            let read = self.read(params, &allocation).await;
            Ok((allocation, read))
        }
        .await;
        // Whatever happened, the READ is over: let the prefill leg unpin now, not at lease end.
        // The release travels on its own while this leg decodes.
        if let Some(renewal) = renewal {
            renewal.abort();
        }
        self.release_grant(params);
        let (allocation, read) = read?;
        // A READ in flight is never abandoned (its bytes would land in blocks freed for others);
        // the deadline is checked once it is over.
        let read = read.and_then(|report| {
            if deadline.is_past() {
                Err(deadline.passed("decode"))
            } else {
                Ok(report)
            }
        });
        let report = match read {
            Ok(report) => report,
            Err(error) => {
                self.finish(request, None).await;
                return Err(error);
            }
        };
        // The allocation above succeeded with this many slots, so the sum did not overflow.
        let slots = num_tokens + self.lookahead_tokens;
        let generated = self
            .generate(
                request,
                &prompt,
                allocation.blocks.clone(),
                slots,
                max_tokens,
                Some(num_tokens - 1),
                deadline,
            )
            .await;
        match generated {
            Ok((tokens, digest)) => {
                self.finish(request, Some(prompt)).await;
                Ok(Output {
                    request,
                    tokens,
                    logits_digest: digest,
                    read_bytes: report.bytes,
                    read_runs: report.runs,
                    cached_blocks: allocation.cached_blocks.iter().sum(),
                })
            }
            Err(error) => {
                self.finish(request, None).await;
                Err(error)
            }
        }
    }

    async fn read(
        &self,
        params: &Arc<KvParams>,
        allocation: &Allocation,
    ) -> Result<pdkv_transport::engine::ReadReport, RequestError> {
        let pair = PairWithOffer {
            params: params.clone(),
            lists: allocation.blocks.clone(),
            cached_blocks: allocation.cached_blocks.clone(),
        };
        let spec = ask(&self.exchange, pair, "exchange").await??;
        let transfer = self.transfer.as_ref().ok_or_else(|| {
            RequestError::BadParams(format!("{} is a {} leg and cannot read", self.node, self.role))
        })?;
        let read = Read {
            request: params.request,
            remote: EngineKey(params.prefill_node.0.clone()),
            grant: params.grant,
            plan: spec.plan,
            checks: spec.checks,
        };
        ask(transfer, read, "transfer").await?
    }

    /// Renews the grant every third of its lease until aborted, so a decode leg that waits
    /// (for blocks, for its READ) does not lose the KV it is about to read.
    fn keep_lease_alive(&self, params: &KvParams) -> Option<tokio::task::JoinHandle<()>> {
        let peer = self.grant_peers.get(&params.prefill_node)?.renew.clone();
        let period = std::time::Duration::from_millis((params.lease_ms / 3).max(1));
        let (grant, node, request) = (params.grant, self.node.clone(), params.request);
        Some(actix::spawn(async move {
            loop {
                tokio::time::sleep(period).await;
                let renew = RenewGrant {
                    grant,
                    peer: node.clone(),
                };
                match peer.send(renew).await {
                    Ok(Ok(_)) => tracing::trace!(%node, %request, "lease renewed"),
                    Ok(Err(error)) => {
                        tracing::warn!(%node, %request, %error, "lease renewal refused");
                        return;
                    }
                    Err(error) => {
                        tracing::warn!(%node, %request, %error, "lease renewal not delivered");
                        return;
                    }
                }
            }
        }))
    }

    /// Sends the grant's release without waiting for it; the prefill leg's bounded mailbox
    /// applies backpressure to the spawned send, and a lost release is covered by the lease.
    fn release_grant(&self, params: &KvParams) {
        let Some(recipient) = self
            .grant_peers
            .get(&params.prefill_node)
            .map(|peer| peer.release.clone())
        else {
            tracing::error!(node = %self.node, prefill = %params.prefill_node, "no route to release a grant");
            return;
        };
        let message = ReleaseGrant {
            grant: params.grant,
            peer: self.node.clone(),
        };
        let (node, request) = (self.node.clone(), params.request);
        actix::spawn(async move {
            match recipient.send(message).await {
                Ok(Ok(())) => {}
                Ok(Err(error)) => tracing::warn!(%node, %request, %error, "grant release refused"),
                Err(error) => tracing::warn!(%node, %request, %error, "grant release not delivered"),
            }
        });
    }

    /// Computes the last prompt token and `max_tokens - 1` more, greedily. `lists` cover `slots`
    /// slots; more blocks are taken as decoding passes them, window blocks freed as it moves.
    /// `windows_released_for` is the attending token the window groups were last trimmed for
    /// (`None`: never), so the allocator is asked only when a block falls out of a window. Stops
    /// between tokens once `deadline` has passed.
    #[allow(clippy::too_many_arguments)]
    async fn generate(
        &self,
        request: RequestId,
        prompt: &Arc<[u32]>,
        mut lists: Vec<Vec<BlockId>>,
        mut slots: u64,
        max_tokens: u32,
        mut windows_released_for: Option<u64>,
        deadline: Deadline,
    ) -> Result<(Vec<u32>, u64), RequestError> {
        let first_position = prompt.len() as u64 - 1;
        let mut token = prompt[prompt.len() - 1];
        let mut digest = LogitsDigest::default();
        let mut tokens = Vec::with_capacity(max_tokens as usize);
        let windows = self.has_window_groups();
        for position in first_position..first_position + u64::from(max_tokens.max(1)) {
            if deadline.is_past() {
                return Err(deadline.passed("decode"));
            }
            if position >= slots {
                slots = position + 1;
                lists = ask(&self.allocator, Extend { request, slots }, "allocator").await??;
            }
            let logits = self.model.step(&self.memory, &lists, position, token, true)?;
            digest.update(&logits);
            token = argmax(&logits);
            tokens.push(token);
            let attending_token = position + 1;
            let moved = windows_released_for
                .is_none_or(|from| window_crosses_block(self.model.layout(), from, attending_token));
            if windows && moved {
                let release = ReleaseWindow {
                    request,
                    attending_token,
                };
                lists = ask(&self.allocator, release, "allocator").await??;
                windows_released_for = Some(attending_token);
            }
        }
        Ok((tokens, digest.finish()))
    }

    /// One leg alone: compute the prompt and decode (the reference for P/D).
    async fn direct(
        &self,
        request: RequestId,
        prompt: Arc<[u32]>,
        max_tokens: u32,
    ) -> Result<Output, RequestError> {
        let num_tokens = prompt.len() as u64;
        if num_tokens == 0 {
            return Err(RequestError::EmptyPrompt);
        }
        let slots = self.slots_for(num_tokens)?;
        let deadline = Deadline::after(Duration::from_millis(self.limits.request_timeout_ms));
        let allocation = self
            .allocate(request, &prompt, slots, None, deadline, "direct")
            .await?;
        let result = async {
            for (position, &token) in prompt.iter().enumerate().take(prompt.len() - 1) {
                self.model
                    .step(&self.memory, &allocation.blocks, position as u64, token, true)?;
            }
            self.generate(
                request,
                &prompt,
                allocation.blocks.clone(),
                slots,
                max_tokens,
                None,
                deadline,
            )
            .await
        }
        .await;
        self.finish(request, None).await;
        let (tokens, logits_digest) = result?;
        Ok(Output {
            request,
            tokens,
            logits_digest,
            read_bytes: 0,
            read_runs: 0,
            cached_blocks: 0,
        })
    }
}

/// The scheduler actor of one leg.
pub struct Scheduler {
    leg: Arc<LegContext>,
}

impl Scheduler {
    /// A scheduler over `leg`.
    pub fn new(leg: Arc<LegContext>) -> Self {
        Scheduler { leg }
    }
}

impl Actor for Scheduler {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.set_mailbox_capacity(self.leg.limits.mailbox);
    }
}

/// Prefill leg: compute a prompt and grant `peer` a READ of its KV.
#[derive(Debug, Message)]
#[rtype(result = "Result<KvParams, RequestError>")]
pub struct Prefill {
    /// The request.
    pub request: RequestId,
    /// Its prompt.
    pub prompt: Arc<[u32]>,
    /// The decode leg that will read.
    pub peer: NodeId,
    /// When the router stops waiting: no grant is handed out after it.
    pub deadline: Deadline,
}

impl Handler<Prefill> for Scheduler {
    type Result = ResponseFuture<Result<KvParams, RequestError>>;

    fn handle(&mut self, msg: Prefill, _ctx: &mut Self::Context) -> Self::Result {
        let leg = self.leg.clone();
        Box::pin(async move { leg.prefill(msg.request, msg.prompt, msg.peer, msg.deadline).await })
    }
}

/// Decode leg: READ a prefilled request's KV and decode `max_tokens` tokens.
#[derive(Debug, Message)]
#[rtype(result = "Result<Output, RequestError>")]
pub struct Decode {
    /// What the prefill leg handed back.
    pub params: KvParams,
    /// Tokens to generate.
    pub max_tokens: u32,
    /// When the router stops waiting: the leg releases the grant and its blocks by then (or as
    /// soon as a READ already in flight ends).
    pub deadline: Deadline,
}

impl Handler<Decode> for Scheduler {
    type Result = ResponseFuture<Result<Output, RequestError>>;

    fn handle(&mut self, msg: Decode, _ctx: &mut Self::Context) -> Self::Result {
        let leg = self.leg.clone();
        Box::pin(async move { leg.decode(msg.params, msg.max_tokens, msg.deadline).await })
    }
}

/// Any leg: run a request alone, for reference.
#[derive(Debug, Message)]
#[rtype(result = "Result<Output, RequestError>")]
pub struct Direct {
    /// The request.
    pub request: RequestId,
    /// Its prompt.
    pub prompt: Arc<[u32]>,
    /// Tokens to generate.
    pub max_tokens: u32,
}

impl Handler<Direct> for Scheduler {
    type Result = ResponseFuture<Result<Output, RequestError>>;

    fn handle(&mut self, msg: Direct, _ctx: &mut Self::Context) -> Self::Result {
        let leg = self.leg.clone();
        Box::pin(async move { leg.direct(msg.request, msg.prompt, msg.max_tokens).await })
    }
}
