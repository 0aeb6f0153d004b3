//! The scheduler actor: a thin shell around one leg's [`LegNode`] (`pdkv_core::node`).
//!
//! The node decides everything about the leg's requests: which messages it takes from whom,
//! how long a request waits for blocks, when a lease is renewed or lapses, what is released on
//! each path; its allocator and grant table live inside it. The scheduler feeds it what happened
//! (a message from a peer, a finished computation, READ or generation, a timer) with one call,
//! then carries out what it asks, in order: messages out through the exchange actor, freed
//! blocks' generations into the leg's shared generation tables (before anything after them, so a
//! reader's check sees a block freed before it can be reused), computations and generations on
//! the leg's [`ComputePool`], READs on the transfer actor. One timer, armed at the node's
//! `poll_timeout`, serves every request and lease of the leg.
//!
//! Time is a [`MonotonicClock`] in milliseconds; a request's deadline is its receive time plus
//! the budget its envelope carried, so nodes need no synchronised clocks.
//!
//! [`Direct`] runs a request on this leg alone, outside the protocol: it is the reference that
//! P/D output is checked against.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use actix::{
    Actor, ActorFutureExt, Addr, AsyncContext, Context, Handler, Message, MessageResult, ResponseFuture,
    WrapFuture,
};
use pdkv_core::allocator::{AllocError, Allocation, window_crosses_block};
use pdkv_core::block::BlockId;
use pdkv_core::leg::{Generated, LegConfig};
use pdkv_core::node::{LegNode, NodeOutput, Refusal};
use pdkv_core::sampling::{self, Sampling, TokenLogprobs};
use pdkv_core::wire::{Body, Envelope, Failure, LegLoad, NodeId, ParamsError, RequestId, Role, Stage};
use pdkv_transport::clock::MonotonicClock;
use tokio::sync::watch;

use crate::compute::ComputePool;
use crate::config::Limits;
use crate::engine::{LogitsDigest, Model};
use crate::error::{RequestError, ask};
use crate::exchange::{ExchangeActor, Outbound};
use crate::memory::LegMemory;
use crate::router::Output;
use crate::timer::{self, MachineTimer};
use crate::transfer::{Read, TransferActor};

/// Everything a leg's scheduler and its computations need; immutable once built.
pub struct LegContext {
    /// What the request machines know about the leg.
    pub config: LegConfig,
    /// Bounds.
    pub limits: Limits,
    /// The reference model.
    pub model: Arc<Model>,
    /// The leg's KV memory.
    pub memory: Arc<LegMemory>,
    /// The transfer actor (decode legs).
    pub transfer: Option<Addr<TransferActor>>,
    /// Where the engine runs.
    pub compute: ComputePool,
    /// Counts frees on this leg (direct runs wait on it for blocks).
    pub freed: watch::Receiver<u64>,
    /// The leg's clock.
    pub clock: MonotonicClock,
}

impl LegContext {
    /// The leg's name.
    pub fn node(&self) -> &NodeId {
        &self.config.node
    }

    fn has_window_groups(&self) -> bool {
        self.model
            .layout()
            .groups()
            .iter()
            .any(|group| group.kind().is_local_attention())
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

/// The scheduler actor of one leg.
pub struct Scheduler {
    leg: Arc<LegContext>,
    exchange: Addr<ExchangeActor>,
    node: LegNode,
    /// The one timer: the node's next deadline (a machine's or a lease's).
    timer: MachineTimer,
    /// Set by [`NodeOutput::StopGenerating`]; a running generation checks its flag between
    /// tokens.
    stops: HashMap<RequestId, Arc<AtomicBool>>,
    /// Counts frees, for direct runs waiting for blocks.
    freed: watch::Sender<u64>,
}

impl Scheduler {
    /// A scheduler driving `node` over `leg`, sending through `exchange`, counting frees on
    /// `freed` (the sender of `leg.freed`).
    pub fn new(
        leg: Arc<LegContext>,
        node: LegNode,
        exchange: Addr<ExchangeActor>,
        freed: watch::Sender<u64>,
    ) -> Self {
        Scheduler {
            leg,
            exchange,
            node,
            timer: None,
            stops: HashMap::new(),
            freed,
        }
    }

    fn now_ms(&self) -> u64 {
        self.leg.clock.now_ms()
    }

    /// Carries out what the node asks, in order, then re-arms the node's timer.
    fn carry_out(&mut self, ctx: &mut Context<Self>) {
        while let Some(output) = self.node.poll_output() {
            match output {
                NodeOutput::Send(out) => self.send(out.to, out.request, out.budget_ms, out.body, ctx),
                NodeOutput::Freed(blocks) => self.publish_freed(&blocks),
                NodeOutput::Compute {
                    request,
                    prompt,
                    lists,
                    tokens,
                } => {
                    let leg = self.leg.clone();
                    // Created here, not when first polled: jobs of one burst see each other.
                    let work = self
                        .leg
                        .compute
                        .run(tokens, move || compute_prompt(&leg, &prompt, &lists, tokens));
                    ctx.spawn(work.into_actor(self).map(move |result, actor, ctx| {
                        let now = actor.now_ms();
                        actor.node.handle_computed(request, result, now);
                        actor.carry_out(ctx);
                    }));
                }
                NodeOutput::Read {
                    request,
                    prefill,
                    grant,
                    pairing,
                    checks,
                    ..
                } => {
                    let read = Read {
                        request,
                        prefill,
                        grant,
                        pairing,
                        checks,
                    };
                    let transfer = self.leg.transfer.clone();
                    let node = self.leg.node().clone();
                    let work = async move {
                        match transfer {
                            Some(transfer) => transfer.send(read).await.unwrap_or_else(|error| {
                                Err(Failure::Read(format!("transfer actor: {error}")))
                            }),
                            None => Err(Failure::BadParams(ParamsError::NotAReader(node))),
                        }
                    };
                    ctx.spawn(work.into_actor(self).map(move |result, actor, ctx| {
                        let now = actor.now_ms();
                        actor.node.handle_read_done(request, result, now);
                        actor.carry_out(ctx);
                    }));
                }
                NodeOutput::Generate {
                    request,
                    prompt,
                    lists,
                    slots,
                    max_tokens,
                    deadline_ms,
                    sampling,
                    stream_to,
                } => {
                    let stop = Arc::new(AtomicBool::new(false));
                    self.stops.insert(request, stop.clone());
                    let sink = stream_to.map(|router| self.token_sink(request, router, deadline_ms));
                    let run = Generation {
                        request,
                        lists,
                        slots,
                        max_tokens,
                        sampling,
                        windows_released_for: Some(prompt.len() as u64 - 1),
                        deadline_ms,
                        sink,
                        stop,
                    };
                    let work = generate(self.leg.clone(), ctx.address(), prompt, run);
                    ctx.spawn(work.into_actor(self).map(move |result, actor, ctx| {
                        actor.stops.remove(&request);
                        let now = actor.now_ms();
                        actor.node.handle_generated(request, result, now);
                        actor.carry_out(ctx);
                    }));
                }
                NodeOutput::LeaseExpired { grant, request, peer } => {
                    metrics::counter!("pdkv_lease_expired_total").increment(1);
                    tracing::warn!(node = %self.leg.node(), grant = grant.0, %request, ?peer, "lease expired, unpinning");
                }
                NodeOutput::StopGenerating { request } => {
                    if let Some(stop) = self.stops.get(&request) {
                        stop.store(true, Ordering::Relaxed);
                    }
                }
            }
        }
        while let Some(anomaly) = self.node.poll_anomaly() {
            tracing::error!(node = %self.leg.node(), %anomaly, "leg rule broken (a bug)");
        }
        let (next, now) = (self.node.poll_timeout(), self.now_ms());
        timer::rearm(&mut self.timer, next, now, ctx, |actor: &mut Scheduler, ctx| {
            actor.timer = None;
            let now = actor.now_ms();
            actor.node.handle_timeout(now);
            actor.carry_out(ctx);
        });
    }

    /// Mirrors freed blocks' new generations into the leg's shared generation tables (which
    /// readers check after copying), then wakes direct runs waiting for blocks.
    fn publish_freed(&mut self, blocks: &[pdkv_core::allocator::FreedBlock]) {
        for block in blocks {
            if let Some(table) = self.leg.memory.generations.get(block.group) {
                // The table holds capacity + 1 words; the allocator only frees ids it owns.
                if let Err(error) = table.store_u32(block.block as usize, block.generation) {
                    tracing::error!(node = %self.leg.node(), %error, "generation table too small");
                }
            }
        }
        self.freed.send_modify(|frees| *frees = frees.wrapping_add(1));
    }

    /// A sink that sends each token to `router` as a `Tokens` message, from any thread. A token
    /// that finds the exchange's mailbox full is not sent (the final `Output` carries it).
    fn token_sink(&self, request: RequestId, router: NodeId, deadline_ms: u64) -> TokenSink {
        let (exchange, clock) = (self.exchange.clone(), self.leg.clock);
        Arc::new(move |token: u32| {
            let message = Outbound {
                to: router.clone(),
                request,
                budget_ms: deadline_ms.saturating_sub(clock.now_ms()),
                body: Body::Tokens { tokens: vec![token] },
            };
            if exchange.try_send(message).is_err() {
                tracing::debug!(%request, "a streamed token was not sent: exchange mailbox full");
            }
        })
    }

    /// Sends `body` through the exchange; a grant that cannot go out is revoked by the node.
    fn send(&self, to: NodeId, request: RequestId, budget_ms: u64, body: Body, ctx: &mut Context<Self>) {
        let grants = matches!(body, Body::KvReady(_));
        let message = Outbound {
            to,
            request,
            budget_ms,
            body,
        };
        ctx.spawn(
            self.exchange
                .send(message)
                .into_actor(self)
                .map(move |result, actor, ctx| match result {
                    Ok(true) => {}
                    Ok(false) if grants => {
                        // Nobody will hear of the grant: free its blocks now, not at lease end.
                        let now = actor.now_ms();
                        actor.node.handle_kv_ready_undeliverable(request, now);
                        actor.carry_out(ctx);
                    }
                    Ok(false) => {}
                    Err(error) => {
                        tracing::error!(node = %actor.leg.node(), %error, "exchange unreachable");
                    }
                }),
        );
    }
}

impl Actor for Scheduler {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.set_mailbox_capacity(self.leg.limits.mailbox);
    }
}

/// A message for the scheduler from a peer, already checked by the exchange (a known peer, its
/// current incarnation, on its own link), with the role that peer said hello as.
#[derive(Debug, Message)]
#[rtype(result = "Result<(), Refusal>")]
pub struct Deliver {
    /// The envelope.
    pub envelope: Envelope,
    /// The sender's role.
    pub from_role: Role,
}

impl Handler<Deliver> for Scheduler {
    type Result = Result<(), Refusal>;

    fn handle(&mut self, msg: Deliver, ctx: &mut Self::Context) -> Self::Result {
        let now = self.now_ms();
        let (request, kind) = (msg.envelope.request, msg.envelope.body.kind());
        let started = matches!(msg.envelope.body, Body::Prefill { .. } | Body::Decode { .. });
        let result = self.node.handle_envelope(msg.from_role, msg.envelope, now);
        if started && result.is_ok() {
            let stage = if kind == "prefill" { "prefill" } else { "decode" };
            metrics::counter!("pdkv_leg_requests_total", "stage" => stage).increment(1);
        }
        if let Err(refusal) = &result {
            tracing::debug!(node = %self.leg.node(), %request, kind, %refusal, "refused");
        }
        self.carry_out(ctx);
        result
    }
}

/// Stop taking new requests (SIGTERM): requests in flight run to their end, new ones are
/// answered with a refusal at once so the router can go elsewhere.
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "()")]
pub struct Drain;

impl Handler<Drain> for Scheduler {
    type Result = ();

    fn handle(&mut self, _msg: Drain, _ctx: &mut Self::Context) -> Self::Result {
        tracing::info!(node = %self.leg.node(), requests = self.node.num_jobs(), "draining");
        self.node.drain();
    }
}

/// The exchange lost its link to `peer` (the incarnation it knew): the grants it holds are
/// revoked now, not when their leases lapse, and if it is a router the requests it asked for are
/// aborted (`LegNode::handle_peer_lost`).
#[derive(Debug, Clone, Message)]
#[rtype(result = "()")]
pub struct PeerLost {
    /// The peer.
    pub peer: NodeId,
}

impl Handler<PeerLost> for Scheduler {
    type Result = ();

    fn handle(&mut self, msg: PeerLost, ctx: &mut Self::Context) -> Self::Result {
        let now = self.now_ms();
        self.node.handle_peer_lost(&msg.peer, now);
        self.carry_out(ctx);
    }
}

/// Ask for the leg's [`LegStats`].
#[derive(Debug, Message)]
#[rtype(result = "LegStats")]
pub struct Stats;

impl Handler<Stats> for Scheduler {
    type Result = MessageResult<Stats>;

    fn handle(&mut self, _msg: Stats, _ctx: &mut Self::Context) -> Self::Result {
        MessageResult(LegStats {
            node: self.leg.node().clone(),
            load: self.node.load(),
        })
    }
}

/// A running generation needs `slots` token slots: its lists, grown.
#[derive(Debug, Message)]
#[rtype(result = "Result<Vec<Vec<BlockId>>, AllocError>")]
struct Extend {
    request: RequestId,
    slots: u64,
}

impl Handler<Extend> for Scheduler {
    type Result = Result<Vec<Vec<BlockId>>, AllocError>;

    fn handle(&mut self, msg: Extend, ctx: &mut Self::Context) -> Self::Result {
        let now = self.now_ms();
        let result = self.node.extend(msg.request, msg.slots, now);
        self.carry_out(ctx);
        result
    }
}

/// A running generation's window moved to `attending_token`: free what it left; its lists.
#[derive(Debug, Message)]
#[rtype(result = "Result<Vec<Vec<BlockId>>, AllocError>")]
struct ReleaseWindow {
    request: RequestId,
    attending_token: u64,
}

impl Handler<ReleaseWindow> for Scheduler {
    type Result = Result<Vec<Vec<BlockId>>, AllocError>;

    fn handle(&mut self, msg: ReleaseWindow, ctx: &mut Self::Context) -> Self::Result {
        let now = self.now_ms();
        let result = self.node.release_window(msg.request, msg.attending_token, now);
        self.carry_out(ctx);
        result
    }
}

/// Take blocks for a request outside the protocol (a direct run, or a test holding blocks).
#[derive(Debug, Message)]
#[rtype(result = "Result<Allocation, AllocError>")]
pub struct DirectAllocate {
    /// The request.
    pub request: RequestId,
    /// Its prompt (for prefix hits).
    pub prompt: Arc<[u32]>,
    /// Token slots to cover.
    pub slots: u64,
}

impl Handler<DirectAllocate> for Scheduler {
    type Result = Result<Allocation, AllocError>;

    fn handle(&mut self, msg: DirectAllocate, ctx: &mut Self::Context) -> Self::Result {
        let now = self.now_ms();
        let result = self
            .node
            .allocate_direct(msg.request, &msg.prompt, msg.slots, now);
        self.carry_out(ctx);
        result
    }
}

/// Give back what a [`DirectAllocate`] took.
#[derive(Debug, Message)]
#[rtype(result = "Result<(), AllocError>")]
pub struct DirectFinish {
    /// The request.
    pub request: RequestId,
}

impl Handler<DirectFinish> for Scheduler {
    type Result = Result<(), AllocError>;

    fn handle(&mut self, msg: DirectFinish, ctx: &mut Self::Context) -> Self::Result {
        let now = self.now_ms();
        let result = self.node.finish_direct(msg.request, now);
        self.carry_out(ctx);
        result
    }
}

/// Computes the first `tokens` prompt tokens into `lists`. The mamba state is committed only up
/// to `N - 1` tokens: the decode leg recomputes the last one.
fn compute_prompt(
    leg: &LegContext,
    prompt: &[u32],
    lists: &[Vec<BlockId>],
    tokens: u64,
) -> Result<(), Failure> {
    let num_tokens = prompt.len() as u64;
    for (position, &token) in prompt.iter().enumerate().take(tokens as usize) {
        let commit_state = (position as u64) + 1 < num_tokens;
        leg.model
            .step(&leg.memory, lists, position as u64, token, commit_state)
            .map_err(|error| Failure::Engine(error.to_string()))?;
    }
    Ok(())
}

/// A decode run: from the last prompt token, `max_tokens` tokens (at least one).
struct Generation {
    request: RequestId,
    lists: Vec<Vec<BlockId>>,
    slots: u64,
    max_tokens: u32,
    /// How each token is chosen and when generation stops early.
    sampling: Sampling,
    /// The attending token the window groups were last trimmed for (`None`: never).
    windows_released_for: Option<u64>,
    deadline_ms: u64,
    /// Told each token as it is generated (a streaming request), from the compute thread.
    sink: Option<TokenSink>,
    /// The request was aborted: stop before the next token.
    stop: Arc<AtomicBool>,
}

/// Hands generated tokens to the router as they come.
type TokenSink = Arc<dyn Fn(u32) + Send + Sync>;

/// Where a run of steps on the compute pool stopped.
struct StepRun {
    position: u64,
    token: u32,
    digest: LogitsDigest,
    tokens: Vec<u32>,
    /// Per token, when asked for.
    logprobs: Vec<TokenLogprobs>,
    /// Set once a stop ended generation before `max_tokens`.
    stopped: Option<sampling::Finish>,
    /// A window group's oldest block fell out of the window at this attending token.
    window_moved: bool,
}

/// Computes the last prompt token and up to `max_tokens - 1` more on the compute pool, each
/// chosen by the request's sampler (`pdkv_core::sampling`: greedy unless asked otherwise), and
/// stops early at a stop token or sequence.
/// Steps run in batches: a batch ends where the allocator must act (more blocks as decoding
/// passes the allocation, window blocks freed as the window moves). Stops between tokens once
/// the deadline has passed or the request was aborted ([`Generation::stop`]).
async fn generate(
    leg: Arc<LegContext>,
    scheduler: Addr<Scheduler>,
    prompt: Arc<[u32]>,
    mut run: Generation,
) -> Result<Generated, Failure> {
    let first_position = prompt.len() as u64 - 1;
    let end = first_position + u64::from(run.max_tokens.max(1));
    let windows = leg.has_window_groups();
    let mut state = StepRun {
        position: first_position,
        token: prompt[prompt.len() - 1],
        digest: LogitsDigest::default(),
        tokens: Vec::with_capacity(run.max_tokens as usize),
        logprobs: Vec::new(),
        stopped: None,
        window_moved: false,
    };
    let alloc = Failure::Alloc;
    let mailbox = |error: actix::MailboxError| Failure::Engine(format!("scheduler unreachable: {error}"));
    let generated = metrics::counter!("pdkv_generated_tokens_total");
    while state.position < end && state.stopped.is_none() {
        if state.position >= run.slots {
            run.slots = state.position + 1;
            let extend = Extend {
                request: run.request,
                slots: run.slots,
            };
            run.lists = scheduler.send(extend).await.map_err(mailbox)?.map_err(alloc)?;
        }
        let (batch_leg, lists, slots, released_for, deadline_ms, sink, stop, generated, sampling) = (
            leg.clone(),
            run.lists.clone(),
            run.slots,
            run.windows_released_for,
            run.deadline_ms,
            run.sink.clone(),
            run.stop.clone(),
            generated.clone(),
            run.sampling.clone(),
        );
        let steps = end.min(slots).saturating_sub(state.position).max(1);
        state = leg
            .compute
            .run(steps, move || {
                let mut state = state;
                state.window_moved = false;
                while state.position < end && state.position < slots {
                    if stop.load(Ordering::Relaxed) {
                        return Err(Failure::Cancelled);
                    }
                    if batch_leg.clock.now_ms() >= deadline_ms {
                        return Err(Failure::DeadlinePassed);
                    }
                    let logits = batch_leg
                        .model
                        .step(&batch_leg.memory, &lists, state.position, state.token, true)
                        .map_err(|error| Failure::Engine(error.to_string()))?;
                    state.digest.update(&logits);
                    let step = state.tokens.len() as u64;
                    let choice = sampling::choose(&sampling, step, &logits)
                        .ok_or_else(|| Failure::Engine("the model gave no logits".into()))?;
                    state.token = choice.token;
                    state.tokens.push(state.token);
                    if sampling.logprobs.is_some() {
                        state.logprobs.push(choice);
                    }
                    generated.increment(1);
                    if let Some(sink) = &sink {
                        sink(state.token);
                    }
                    state.position += 1;
                    if let Some(finish) = sampling::stop_after(&sampling, &state.tokens) {
                        state.stopped = Some(finish);
                        break;
                    }
                    let attending_token = state.position;
                    if windows
                        && released_for.is_none_or(|from| {
                            window_crosses_block(batch_leg.model.layout(), from, attending_token)
                        })
                    {
                        state.window_moved = true;
                        break;
                    }
                }
                Ok(state)
            })
            .await?;
        if state.window_moved {
            let release = ReleaseWindow {
                request: run.request,
                attending_token: state.position,
            };
            run.lists = scheduler.send(release).await.map_err(mailbox)?.map_err(alloc)?;
            run.windows_released_for = Some(state.position);
        }
    }
    Ok(Generated {
        tokens: state.tokens,
        logits_digest: state.digest.finish(),
        finish: state.stopped.unwrap_or(sampling::Finish::Length),
        logprobs: state.logprobs,
    })
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
    /// How tokens are chosen (the same sampler a decode leg runs).
    pub sampling: Sampling,
}

impl Handler<Direct> for Scheduler {
    type Result = ResponseFuture<Result<Output, RequestError>>;

    fn handle(&mut self, msg: Direct, ctx: &mut Self::Context) -> Self::Result {
        Box::pin(direct(self.leg.clone(), ctx.address(), msg))
    }
}

/// One leg alone: compute the prompt and decode, waiting for blocks at most `alloc_wait_ms`.
async fn direct(
    leg: Arc<LegContext>,
    scheduler: Addr<Scheduler>,
    msg: Direct,
) -> Result<Output, RequestError> {
    let Direct {
        request,
        prompt,
        max_tokens,
        sampling,
    } = msg;
    let num_tokens = prompt.len() as u64;
    if num_tokens == 0 {
        return Err(RequestError::EmptyPrompt);
    }
    let slots = num_tokens
        .checked_add(leg.config.lookahead_tokens)
        .ok_or(RequestError::SlotOverflow {
            tokens: num_tokens,
            lookahead_tokens: leg.config.lookahead_tokens,
        })?;
    let deadline_ms = leg.clock.now_ms().saturating_add(leg.limits.request_timeout_ms);
    let allocation = allocate_waiting(&leg, &scheduler, request, &prompt, slots).await?;
    let result = async {
        let lists = allocation.blocks.clone();
        let (compute_leg, compute_prompt_tokens) = (leg.clone(), prompt.clone());
        leg.compute
            .run(num_tokens - 1, move || {
                compute_prompt(&compute_leg, &compute_prompt_tokens, &lists, num_tokens - 1)
            })
            .await?;
        let run = Generation {
            request,
            lists: allocation.blocks.clone(),
            slots,
            max_tokens,
            sampling,
            windows_released_for: None,
            deadline_ms,
            sink: None,
            // A direct run is never aborted: it ends by its deadline.
            stop: Arc::new(AtomicBool::new(false)),
        };
        generate(leg.clone(), scheduler.clone(), prompt.clone(), run).await
    }
    .await;
    ask(&scheduler, DirectFinish { request }, "scheduler").await??;
    let generated = result.map_err(|failure| {
        RequestError::from_failure(Stage::Decode, failure, leg.limits.request_timeout_ms)
    })?;
    Ok(Output {
        request,
        tokens: generated.tokens,
        logits_digest: generated.logits_digest,
        read_bytes: 0,
        read_runs: 0,
        cached_blocks: 0,
        finish: generated.finish,
        logprobs: generated.logprobs,
        prefill_stage: Duration::ZERO,
        decode_stage: Duration::ZERO,
    })
}

/// Allocates for a direct run, retrying as blocks are freed, for at most `alloc_wait_ms`.
async fn allocate_waiting(
    leg: &LegContext,
    scheduler: &Addr<Scheduler>,
    request: RequestId,
    prompt: &Arc<[u32]>,
    slots: u64,
) -> Result<Allocation, RequestError> {
    let wait = Duration::from_millis(leg.limits.alloc_wait_ms);
    let until = tokio::time::Instant::now() + wait;
    let mut freed = leg.freed.clone();
    loop {
        freed.borrow_and_update();
        let message = DirectAllocate {
            request,
            prompt: prompt.clone(),
            slots,
        };
        let last = match ask(scheduler, message, "scheduler").await? {
            Ok(allocation) => return Ok(allocation),
            Err(error @ AllocError::OutOfBlocks { .. }) => error,
            Err(error) => return Err(error.into()),
        };
        match tokio::time::timeout_at(until, freed.changed()).await {
            Ok(Ok(())) => continue,
            _ => {
                return Err(RequestError::Failed {
                    stage: Stage::Decode,
                    failure: Failure::NoFreeBlocks {
                        waited_ms: leg.limits.alloc_wait_ms,
                        last,
                    },
                });
            }
        }
    }
}
