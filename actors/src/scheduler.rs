//! The scheduler actor: a thin shell around one leg's request machines
//! ([`pdkv_core::leg::PrefillMachine`], [`pdkv_core::leg::DecodeMachine`]).
//!
//! The machines decide everything about a request: how long to wait for blocks, when to renew a
//! lease, what to release on each path, when the request is over. The scheduler feeds them what
//! happened (a message from a peer, the allocator's answer, a finished computation or READ, blocks
//! freed, a timer) and carries out what they ask, in order: allocator commands go to the
//! allocator actor, computations to the leg's [`ComputePool`], READs to the transfer actor,
//! messages out through the exchange actor. It arms one timer per request at the machine's
//! `poll_timeout`, and bounds how many requests may wait for blocks (`limits.wait_queue`).
//!
//! Time is a [`MonotonicClock`] in milliseconds; a request's deadline is its receive time plus
//! the budget its envelope carried, so nodes need no synchronised clocks.
//!
//! [`Direct`] runs a request on this leg alone, outside the protocol: it is the reference that
//! P/D output is checked against.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use actix::{
    Actor, ActorFutureExt, Addr, AsyncContext, Context, Handler, Message, ResponseFuture, WrapFuture,
};
use pdkv_core::allocator::{AllocError, Allocation, window_crosses_block};
use pdkv_core::block::BlockId;
use pdkv_core::layout::GroupKind;
use pdkv_core::leg::{DecodeCommand, DecodeMachine, Generated, LegConfig, PrefillCommand, PrefillMachine};
use pdkv_core::sampling::{self, Sampling, TokenLogprobs};
use pdkv_core::wire::{Body, Envelope, Failure, NodeId, RequestId, Stage};
use pdkv_transport::clock::MonotonicClock;
use tokio::sync::watch;

use crate::allocator::{Allocate, AllocatorActor, Extend, Finish, GrantBlocks, ReleaseWindow, RevokeGrant};
use crate::compute::ComputePool;
use crate::config::Limits;
use crate::engine::{LogitsDigest, Model};
use crate::error::{RequestError, ask};
use crate::exchange::{Deliver, ExchangeActor, Outbound};
use crate::link::Refusal;
use crate::memory::LegMemory;
use crate::timer::{self, MachineTimer};
use crate::transfer::{Read, TransferActor};

/// Requests a leg remembers having started or seen aborted, so that a duplicated or late
/// request for one is refused instead of computed again.
const TOMBSTONES_REMEMBERED: usize = 16384;

/// How a remembered request was seen here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tombstone {
    /// It started here (and may have ended).
    Started,
    /// It was aborted before it started here.
    Aborted,
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
    pub read_runs: u64,
    /// Prefix-hit blocks the decode leg reused.
    pub cached_blocks: u64,
    /// Why generation ended.
    pub finish: sampling::Finish,
    /// Per generated token, when the request asked for log-probabilities.
    pub logprobs: Vec<TokenLogprobs>,
    /// Router's view: from sending the prefill request to receiving the KV parameters.
    pub prefill_stage: Duration,
    /// Router's view: from receiving the KV parameters to receiving the output.
    pub decode_stage: Duration,
}

impl Output {
    /// The answer a decode leg sent for `request`, with the router's stage timings.
    pub fn from_decode(
        request: RequestId,
        output: pdkv_core::wire::DecodeOutput,
        prefill_stage: Duration,
        decode_stage: Duration,
    ) -> Self {
        Output {
            request,
            tokens: output.tokens,
            logits_digest: output.logits_digest,
            read_bytes: output.read_bytes,
            read_runs: output.read_runs,
            cached_blocks: output.cached_blocks,
            finish: output.finish,
            logprobs: output.logprobs,
            prefill_stage,
            decode_stage,
        }
    }
}

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
    /// The allocator actor.
    pub allocator: Addr<AllocatorActor>,
    /// The transfer actor (decode legs).
    pub transfer: Option<Addr<TransferActor>>,
    /// Where the engine runs.
    pub compute: ComputePool,
    /// Counts frees on this leg.
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
            .any(|group| matches!(group.kind(), GroupKind::SlidingWindow { .. }))
    }
}

enum Machine {
    Prefill(PrefillMachine),
    Decode(DecodeMachine),
}

enum Command {
    Prefill(PrefillCommand),
    Decode(DecodeCommand),
}

impl Machine {
    fn poll_command(&mut self) -> Option<Command> {
        match self {
            Machine::Prefill(machine) => machine.poll_command().map(Command::Prefill),
            Machine::Decode(machine) => machine.poll_command().map(Command::Decode),
        }
    }

    fn poll_timeout(&self) -> Option<u64> {
        match self {
            Machine::Prefill(machine) => machine.poll_timeout(),
            Machine::Decode(machine) => machine.poll_timeout(),
        }
    }

    fn is_done(&self) -> bool {
        match self {
            Machine::Prefill(machine) => machine.is_done(),
            Machine::Decode(machine) => machine.is_done(),
        }
    }

    fn is_waiting_for_blocks(&self) -> bool {
        match self {
            Machine::Prefill(machine) => machine.is_waiting_for_blocks(),
            Machine::Decode(machine) => machine.is_waiting_for_blocks(),
        }
    }

    fn handle_queue_full(&mut self, capacity: u64) {
        match self {
            Machine::Prefill(machine) => machine.handle_queue_full(capacity),
            Machine::Decode(machine) => machine.handle_queue_full(capacity),
        }
    }

    fn handle_blocks_freed(&mut self) {
        match self {
            Machine::Prefill(machine) => machine.handle_blocks_freed(),
            Machine::Decode(machine) => machine.handle_blocks_freed(),
        }
    }

    fn handle_timeout(&mut self, now_ms: u64) {
        match self {
            Machine::Prefill(machine) => machine.handle_timeout(now_ms),
            Machine::Decode(machine) => machine.handle_timeout(now_ms),
        }
    }

    fn handle_abort(&mut self) {
        match self {
            Machine::Prefill(machine) => machine.handle_abort(),
            Machine::Decode(machine) => machine.handle_abort(),
        }
    }
}

/// One request on this leg: its machine and what the shell keeps for it.
struct Job {
    machine: Machine,
    prompt: Arc<[u32]>,
    /// The request's blocks per group, as the allocator last listed them.
    lists: Vec<Vec<BlockId>>,
    deadline_ms: u64,
    timer: MachineTimer,
    /// The router to send each generated token to (a streaming decode request).
    stream_to: Option<NodeId>,
    /// Set by [`DecodeCommand::StopGenerating`]; the generation checks it between tokens.
    stop: Arc<AtomicBool>,
}

/// The scheduler actor of one leg.
pub struct Scheduler {
    leg: Arc<LegContext>,
    exchange: Addr<ExchangeActor>,
    jobs: HashMap<RequestId, Job>,
    /// Requests started or aborted here, oldest first (at most [`TOMBSTONES_REMEMBERED`]): a
    /// request message for one — duplicated, or reordered past its abort — is refused, not
    /// started again.
    tombstone_order: VecDeque<RequestId>,
    tombstones: HashMap<RequestId, Tombstone>,
    /// Taken while a wait for the next free is pending.
    freed: Option<watch::Receiver<u64>>,
    /// New requests are refused ([`Drain`]).
    draining: bool,
}

impl Scheduler {
    /// A scheduler over `leg`, sending through `exchange`.
    pub fn new(leg: Arc<LegContext>, exchange: Addr<ExchangeActor>) -> Self {
        let freed = Some(leg.freed.clone());
        Scheduler {
            leg,
            exchange,
            jobs: HashMap::new(),
            tombstone_order: VecDeque::new(),
            tombstones: HashMap::new(),
            freed,
            draining: false,
        }
    }

    fn now_ms(&self) -> u64 {
        self.leg.clock.now_ms()
    }

    /// Wakes waiting requests whenever the allocator frees blocks.
    fn watch_frees(&mut self, ctx: &mut Context<Self>) {
        let Some(mut freed) = self.freed.take() else {
            return;
        };
        let changed = async move {
            let open = freed.changed().await.is_ok();
            (open, freed)
        };
        ctx.spawn(changed.into_actor(self).map(|(open, freed), actor, ctx| {
            actor.freed = Some(freed);
            if !open {
                return;
            }
            let waiting: Vec<RequestId> = actor
                .jobs
                .iter()
                .filter(|(_, job)| job.machine.is_waiting_for_blocks())
                .map(|(&request, _)| request)
                .collect();
            for request in waiting {
                if let Some(job) = actor.jobs.get_mut(&request) {
                    job.machine.handle_blocks_freed();
                }
                actor.drive(request, ctx);
            }
            actor.watch_frees(ctx);
        }));
    }

    /// Carries out what the request's machine asks, then re-arms its timer or forgets it.
    fn drive(&mut self, request: RequestId, ctx: &mut Context<Self>) {
        loop {
            let Some(job) = self.jobs.get_mut(&request) else {
                return;
            };
            let Some(command) = job.machine.poll_command() else {
                break;
            };
            match command {
                Command::Prefill(command) => self.prefill_command(request, command, ctx),
                Command::Decode(command) => self.decode_command(request, command, ctx),
            }
        }
        let Some(job) = self.jobs.get_mut(&request) else {
            return;
        };
        if job.machine.is_done() {
            if let Some(mut job) = self.jobs.remove(&request) {
                timer::cancel(&mut job.timer, ctx);
            }
            return;
        }
        let next = job.machine.poll_timeout();
        let now = self.leg.clock.now_ms();
        timer::rearm(
            &mut job.timer,
            next,
            now,
            ctx,
            move |actor: &mut Scheduler, ctx| {
                let now = actor.now_ms();
                if let Some(job) = actor.jobs.get_mut(&request) {
                    job.timer = None;
                    job.machine.handle_timeout(now);
                }
                actor.drive(request, ctx);
            },
        );
    }

    /// Feeds the machine of `request` (if it still runs) and drives it.
    fn with_machine(
        &mut self,
        request: RequestId,
        ctx: &mut Context<Self>,
        feed: impl FnOnce(&mut Job, u64),
    ) {
        let now = self.now_ms();
        if let Some(job) = self.jobs.get_mut(&request) {
            feed(job, now);
            if job.machine.is_waiting_for_blocks() {
                let capacity = self.leg.limits.wait_queue;
                let waiting = self
                    .jobs
                    .values()
                    .filter(|job| job.machine.is_waiting_for_blocks())
                    .count();
                if waiting > capacity
                    && let Some(job) = self.jobs.get_mut(&request)
                {
                    job.machine.handle_queue_full(capacity as u64);
                }
            }
        }
        self.drive(request, ctx);
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

    /// Sends `body` about a running request, with the budget its deadline leaves.
    fn send(&self, request: RequestId, to: NodeId, body: Body, ctx: &mut Context<Self>) {
        let deadline_ms = self.jobs.get(&request).map_or(0, |job| job.deadline_ms);
        let budget_ms = deadline_ms.saturating_sub(self.now_ms());
        self.send_with_budget(request, to, budget_ms, body, ctx);
    }

    fn send_with_budget(
        &self,
        request: RequestId,
        to: NodeId,
        budget_ms: u64,
        body: Body,
        ctx: &mut Context<Self>,
    ) {
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
                .map(|result, actor, _| {
                    if let Err(error) = result {
                        tracing::error!(node = %actor.leg.node(), %error, "exchange unreachable");
                    }
                }),
        );
    }

    fn allocate(
        &self,
        request: RequestId,
        slots: u64,
        attending_token: Option<u64>,
        ctx: &mut Context<Self>,
    ) {
        let Some(job) = self.jobs.get(&request) else {
            return;
        };
        let message = Allocate {
            request,
            prompt: job.prompt.clone(),
            slots,
            attending_token,
        };
        ctx.spawn(
            self.leg
                .allocator
                .send(message)
                .into_actor(self)
                .map(move |result, actor, ctx| {
                    let result = match result {
                        Ok(result) => result,
                        Err(error) => return actor.lost_allocator(request, error),
                    };
                    actor.with_machine(request, ctx, |job, now| {
                        if let Ok(allocation) = &result {
                            job.lists = allocation.blocks.clone();
                        }
                        match &mut job.machine {
                            Machine::Prefill(machine) => machine.handle_allocated(result.map(|_| ()), now),
                            Machine::Decode(machine) => machine.handle_allocated(result, now),
                        }
                    });
                }),
        );
    }

    fn finish(&self, request: RequestId, cache_prompt: Option<Arc<[u32]>>, ctx: &mut Context<Self>) {
        let message = Finish {
            request,
            cache_prompt,
        };
        ctx.spawn(self.leg.allocator.send(message).into_actor(self).map(
            move |result, actor, _| match result {
                Ok(Ok(())) => {}
                Ok(Err(error)) => {
                    tracing::error!(node = %actor.leg.node(), %request, %error, "finish failed")
                }
                Err(error) => {
                    tracing::error!(node = %actor.leg.node(), %request, %error, "finish not delivered")
                }
            },
        ));
    }

    /// The allocator is gone (the leg is shutting down): nothing more can happen for `request`.
    fn lost_allocator(&mut self, request: RequestId, error: actix::MailboxError) {
        tracing::error!(node = %self.leg.node(), %request, %error, "allocator unreachable, dropping the request");
        self.jobs.remove(&request);
    }

    fn prefill_command(&mut self, request: RequestId, command: PrefillCommand, ctx: &mut Context<Self>) {
        match command {
            PrefillCommand::Allocate { slots } => self.allocate(request, slots, None, ctx),
            PrefillCommand::Compute { tokens } => {
                let Some(job) = self.jobs.get(&request) else {
                    return;
                };
                let (leg, prompt, lists) = (self.leg.clone(), job.prompt.clone(), job.lists.clone());
                let work = async move {
                    let pool = leg.compute.clone();
                    pool.run(tokens, move || compute_prompt(&leg, &prompt, &lists, tokens))
                        .await
                };
                ctx.spawn(work.into_actor(self).map(move |result, actor, ctx| {
                    actor.with_machine(request, ctx, |job, now| {
                        if let Machine::Prefill(machine) = &mut job.machine {
                            machine.handle_computed(result, now);
                        }
                    });
                }));
            }
            PrefillCommand::ReleaseWindow { attending_token } => {
                let message = ReleaseWindow {
                    request,
                    attending_token,
                };
                ctx.spawn(self.leg.allocator.send(message).into_actor(self).map(
                    move |result, actor, ctx| {
                        let result = match result {
                            Ok(result) => result,
                            Err(error) => return actor.lost_allocator(request, error),
                        };
                        actor.with_machine(request, ctx, |job, _| {
                            if let Ok(lists) = &result {
                                job.lists = lists.clone();
                            }
                            if let Machine::Prefill(machine) = &mut job.machine {
                                machine.handle_window_released(result);
                            }
                        });
                    },
                ));
            }
            PrefillCommand::Grant { lists, peer } => {
                let message = GrantBlocks { request, peer, lists };
                ctx.spawn(self.leg.allocator.send(message).into_actor(self).map(
                    move |result, actor, ctx| {
                        let result = match result {
                            Ok(result) => result.map_err(|error| error.to_failure()),
                            Err(error) => return actor.lost_allocator(request, error),
                        };
                        actor.with_machine(request, ctx, |job, now| {
                            if let Machine::Prefill(machine) = &mut job.machine {
                                machine.handle_granted(result, now);
                            }
                        });
                    },
                ));
            }
            PrefillCommand::Revoke { grant } => {
                ctx.spawn(
                    self.leg
                        .allocator
                        .send(RevokeGrant { grant })
                        .into_actor(self)
                        .map(|_, _, _| ()),
                );
            }
            PrefillCommand::Finish => self.finish(request, None, ctx),
            PrefillCommand::Send { to, body } => self.send(request, to, body, ctx),
        }
    }

    fn decode_command(&mut self, request: RequestId, command: DecodeCommand, ctx: &mut Context<Self>) {
        match command {
            DecodeCommand::Allocate {
                slots,
                attending_token,
            } => self.allocate(request, slots, Some(attending_token), ctx),
            DecodeCommand::Read { pairing, checks } => {
                let Some(Job {
                    machine: Machine::Decode(machine),
                    ..
                }) = self.jobs.get(&request)
                else {
                    return;
                };
                let read = Read {
                    request,
                    prefill: machine.prefill_node().clone(),
                    grant: machine.grant(),
                    pairing,
                    checks,
                };
                let transfer = self.leg.transfer.clone();
                let node = self.leg.node().clone();
                let work = async move {
                    match transfer {
                        Some(transfer) => transfer
                            .send(read)
                            .await
                            .unwrap_or_else(|error| Err(Failure::Read(format!("transfer actor: {error}")))),
                        None => Err(Failure::BadParams(format!(
                            "{node} is a prefill leg and cannot read"
                        ))),
                    }
                };
                ctx.spawn(work.into_actor(self).map(move |result, actor, ctx| {
                    actor.with_machine(request, ctx, |job, now| {
                        if let Machine::Decode(machine) = &mut job.machine {
                            machine.handle_read_done(result, now);
                        }
                    });
                }));
            }
            DecodeCommand::Generate {
                slots,
                max_tokens,
                deadline_ms,
                sampling,
            } => {
                let Some(job) = self.jobs.get(&request) else {
                    return;
                };
                let prompt = job.prompt.clone();
                let sink = job
                    .stream_to
                    .clone()
                    .map(|router| self.token_sink(request, router, deadline_ms));
                let run = Generation {
                    request,
                    lists: job.lists.clone(),
                    slots,
                    max_tokens,
                    sampling,
                    windows_released_for: Some(prompt.len() as u64 - 1),
                    deadline_ms,
                    sink,
                    stop: job.stop.clone(),
                };
                let work = generate(self.leg.clone(), prompt, run);
                ctx.spawn(work.into_actor(self).map(move |result, actor, ctx| {
                    actor.with_machine(request, ctx, |job, _| {
                        if let Machine::Decode(machine) = &mut job.machine {
                            machine.handle_generated(result);
                        }
                    });
                }));
            }
            DecodeCommand::StopGenerating => {
                if let Some(job) = self.jobs.get(&request) {
                    job.stop.store(true, Ordering::Relaxed);
                }
            }
            DecodeCommand::Finish { cache_prompt } => {
                let prompt = self.jobs.get(&request).map(|job| job.prompt.clone());
                self.finish(request, prompt.filter(|_| cache_prompt), ctx);
            }
            DecodeCommand::Send { to, body } => self.send(request, to, body, ctx),
        }
    }

    /// Starts or feeds the machine of the request an envelope is about. Duplicates of a request
    /// already running and aborts of a request already over are accepted and change nothing;
    /// a renewal for a request this leg does not run is refused.
    fn deliver(&mut self, envelope: Envelope, ctx: &mut Context<Self>) -> Result<(), Refusal> {
        let now = self.now_ms();
        let Envelope {
            request,
            from,
            budget_ms,
            body,
            ..
        } = envelope;
        let deadline_ms = now.saturating_add(budget_ms);
        let new_job =
            matches!(body, Body::Prefill { .. } | Body::Decode { .. }) && !self.jobs.contains_key(&request);
        if new_job && self.draining {
            let stage = if matches!(body, Body::Prefill { .. }) {
                Stage::Prefill
            } else {
                Stage::Decode
            };
            let reason = "draining: the leg is shutting down".to_string();
            let failed = Body::Failed {
                stage,
                reason: Failure::Refused {
                    node: self.leg.node().clone(),
                    reason: reason.clone(),
                },
            };
            self.send_with_budget(request, from, budget_ms, failed, ctx);
            return Err(Refusal::Busy {
                node: self.leg.node().clone(),
                detail: reason,
            });
        }
        if matches!(body, Body::Prefill { .. } | Body::Decode { .. }) {
            match self.tombstones.get(&request) {
                Some(Tombstone::Aborted) => {
                    return Err(Refusal::Aborted {
                        node: self.leg.node().clone(),
                        request,
                    });
                }
                Some(Tombstone::Started) => {
                    tracing::debug!(node = %self.leg.node(), %request, kind = body.kind(), "refused: already started here");
                    return Err(Refusal::Duplicate {
                        node: self.leg.node().clone(),
                        request,
                    });
                }
                None => {}
            }
        }
        if let Body::Decode { sampling, .. } = &body
            && let Err(error) = sampling.check()
        {
            let detail = format!("sampling: {error}");
            tracing::warn!(node = %self.leg.node(), %request, %detail, "decode refused: bad sampling");
            let failed = Body::Failed {
                stage: Stage::Decode,
                reason: Failure::BadParams(detail.clone()),
            };
            self.send_with_budget(request, from, budget_ms, failed, ctx);
            return Err(Refusal::BadMessage {
                node: self.leg.node().clone(),
                detail,
            });
        }
        match body {
            Body::Prefill { prompt, decode } if !self.jobs.contains_key(&request) => {
                let prompt_arc: Arc<[u32]> = prompt.clone().into();
                let machine = PrefillMachine::new(
                    self.leg.config.clone(),
                    request,
                    from,
                    prompt,
                    decode,
                    deadline_ms,
                    now,
                );
                self.start(request, Machine::Prefill(machine), prompt_arc, deadline_ms, ctx);
                Ok(())
            }
            Body::Decode { params, .. } if params.request != request => {
                tracing::warn!(node = %self.leg.node(), %request, named = %params.request, "decode refused: kv params name another request");
                // Told to the sender as a refusal and, for its request machine, as a failure.
                let failure = Failure::BadParams(format!(
                    "kv params are for {}, the message for {request}",
                    params.request
                ));
                let failed = Body::Failed {
                    stage: Stage::Decode,
                    reason: failure,
                };
                self.send_with_budget(request, from, budget_ms, failed, ctx);
                Err(Refusal::BadMessage {
                    node: self.leg.node().clone(),
                    detail: format!("kv params are for {}, the message for {request}", params.request),
                })
            }
            Body::Decode {
                params,
                max_tokens,
                stream,
                sampling,
            } if !self.jobs.contains_key(&request) => {
                let prompt: Arc<[u32]> = params.prompt.clone().into();
                let stream_to = stream.then(|| from.clone());
                let machine = DecodeMachine::new(
                    self.leg.config.clone(),
                    from,
                    params,
                    max_tokens,
                    deadline_ms,
                    now,
                )
                .with_sampling(sampling);
                self.start(request, Machine::Decode(machine), prompt, deadline_ms, ctx);
                if let Some(job) = self.jobs.get_mut(&request) {
                    job.stream_to = stream_to;
                }
                Ok(())
            }
            Body::Renewed { grant, lease_ms } => {
                let Some(Job {
                    machine: Machine::Decode(machine),
                    ..
                }) = self.jobs.get_mut(&request)
                else {
                    return Err(Refusal::UnknownRequest {
                        node: self.leg.node().clone(),
                        request,
                    });
                };
                if machine.grant() == grant {
                    machine.handle_renewed(lease_ms, now);
                }
                self.drive(request, ctx);
                Ok(())
            }
            Body::Abort => {
                match self.jobs.get_mut(&request) {
                    Some(job) => job.machine.handle_abort(),
                    None => self.remember(request, Tombstone::Aborted),
                }
                self.drive(request, ctx);
                Ok(())
            }
            body => {
                tracing::debug!(node = %self.leg.node(), %request, kind = body.kind(), "ignored (duplicate or late)");
                Ok(())
            }
        }
    }

    fn remember(&mut self, request: RequestId, how: Tombstone) {
        if self.tombstones.insert(request, how).is_some() {
            return;
        }
        self.tombstone_order.push_back(request);
        if self.tombstone_order.len() > TOMBSTONES_REMEMBERED
            && let Some(oldest) = self.tombstone_order.pop_front()
        {
            self.tombstones.remove(&oldest);
        }
    }

    fn start(
        &mut self,
        request: RequestId,
        machine: Machine,
        prompt: Arc<[u32]>,
        deadline_ms: u64,
        ctx: &mut Context<Self>,
    ) {
        let stage = match &machine {
            Machine::Prefill(_) => "prefill",
            Machine::Decode(_) => "decode",
        };
        metrics::counter!("pdkv_leg_requests_total", "stage" => stage).increment(1);
        self.remember(request, Tombstone::Started);
        let job = Job {
            machine,
            prompt,
            lists: Vec::new(),
            deadline_ms,
            timer: None,
            stream_to: None,
            stop: Arc::new(AtomicBool::new(false)),
        };
        self.jobs.insert(request, job);
        self.drive(request, ctx);
    }
}

impl Actor for Scheduler {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.set_mailbox_capacity(self.leg.limits.mailbox);
        self.watch_frees(ctx);
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
        tracing::info!(node = %self.leg.node(), requests = self.jobs.len(), "draining");
        self.draining = true;
    }
}

impl Handler<Deliver> for Scheduler {
    type Result = Result<(), Refusal>;

    fn handle(&mut self, msg: Deliver, ctx: &mut Self::Context) -> Self::Result {
        self.deliver(msg.envelope, ctx)
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
    let alloc = |error: AllocError| Failure::Alloc(error.to_string());
    let mailbox = |error: actix::MailboxError| Failure::Engine(format!("allocator unreachable: {error}"));
    let generated = metrics::counter!("pdkv_generated_tokens_total");
    while state.position < end && state.stopped.is_none() {
        if state.position >= run.slots {
            run.slots = state.position + 1;
            let extend = Extend {
                request: run.request,
                slots: run.slots,
            };
            run.lists = leg
                .allocator
                .send(extend)
                .await
                .map_err(mailbox)?
                .map_err(alloc)?;
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
            run.lists = leg
                .allocator
                .send(release)
                .await
                .map_err(mailbox)?
                .map_err(alloc)?;
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

    fn handle(&mut self, msg: Direct, _ctx: &mut Self::Context) -> Self::Result {
        Box::pin(direct(self.leg.clone(), msg))
    }
}

/// One leg alone: compute the prompt and decode, waiting for blocks at most `alloc_wait_ms`.
async fn direct(leg: Arc<LegContext>, msg: Direct) -> Result<Output, RequestError> {
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
    let allocation = allocate_waiting(&leg, request, &prompt, slots).await?;
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
        generate(leg.clone(), prompt.clone(), run).await
    }
    .await;
    let finish = Finish {
        request,
        cache_prompt: None,
    };
    ask(&leg.allocator, finish, "allocator").await??;
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
    request: RequestId,
    prompt: &Arc<[u32]>,
    slots: u64,
) -> Result<Allocation, RequestError> {
    let wait = Duration::from_millis(leg.limits.alloc_wait_ms);
    let until = tokio::time::Instant::now() + wait;
    let mut freed = leg.freed.clone();
    loop {
        freed.borrow_and_update();
        let message = Allocate {
            request,
            prompt: prompt.clone(),
            slots,
            attending_token: None,
        };
        let last = match ask(&leg.allocator, message, "allocator").await? {
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
                        last: last.to_string(),
                    },
                });
            }
        }
    }
}
