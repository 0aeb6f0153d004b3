//! The router: a thin shell around one [`RouterMachine`] per request.
//!
//! It picks a prefill and a decode leg among the admitted peers (the least loaded, or in turn:
//! `[router] selection`), starts
//! the request's machine and carries out what it asks: messages to the legs over links, the
//! client's answer at the end. It is also a door ([`Admit`], [`Inbound`]): legs answer over the
//! same links. The whole request is bounded by `limits.request_timeout_ms`; the budget left
//! travels in every envelope. A leg that restarts (says hello with a new incarnation) fails the
//! requests it served, and a link that refuses a message fails its request at once.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::{
    Actor, ActorFutureExt, Context, Handler, Message, ResponseActFuture, ResponseFuture, WrapFuture,
};
use pdkv_core::leg::{RequestOutcome, RouterCommand, RouterMachine};
use pdkv_core::proxy;
use pdkv_core::router::Attempts;
use pdkv_core::sampling::Sampling;
use pdkv_core::wire::{Body, Envelope, Incarnation, KvParams, LegLoad, NodeId, RequestId, Role, Stage};
use pdkv_transport::clock::MonotonicClock;
use pdkv_transport::control::{Hello, check_compat};
use tokio::sync::oneshot;

use crate::config::{PromptLimit, PromptTooLong};
use crate::deployment::Selection;
use crate::error::RequestError;
use crate::link::{Admit, Inbound, LinkLost, Peers, Refusal, SetLink, log_refusal};
use crate::timer::{self, MachineTimer};

/// What a client waits on.
type Reply = oneshot::Sender<Result<Output, RequestError>>;

struct Pending {
    machine: RouterMachine,
    reply: Option<Reply>,
    timer: MachineTimer,
    started: Instant,
    /// When the prefill leg's KV parameters arrived.
    kv_ready: Option<Instant>,
    /// Where the decode leg's streamed tokens go (a streaming client).
    stream: Option<TokenStream>,
    /// What a retry needs: the request as the client sent it, its deadline, tries so far and
    /// the prefill legs it failed on.
    prompt: Arc<[u32]>,
    max_tokens: u32,
    sampling: Arc<Sampling>,
    deadline_ms: u64,
    /// Retries so far, the legs to avoid, and the tokens the client was streamed (core's rules).
    attempts: Attempts,
    client: Option<u64>,
}

/// A client's request about to start on some legs (first time, or again).
struct Attempt {
    prompt: Arc<[u32]>,
    max_tokens: u32,
    sampling: Arc<Sampling>,
    deadline_ms: u64,
    stream: Option<TokenStream>,
    reply: Reply,
    started: Instant,
    /// Retries so far, the legs to avoid, and the tokens the client was streamed.
    attempts: Attempts,
    /// The error to give the client if no leg is left to try.
    last_error: Option<RequestError>,
    /// The client's name for the request ([`Generate::client`]).
    client: Option<u64>,
}

/// The client's end of a streaming request: tokens as the decode leg generates them. Bounded
/// by the request's `max_tokens` (each message carries at least one token).
pub type TokenStream = tokio::sync::mpsc::Sender<Vec<u32>>;

/// A request sent to one leg outside any [`RouterMachine`] (diagnosis and tests): the first
/// answer about it is handed back as is.
struct Probe {
    reply: oneshot::Sender<Body>,
    leg: NodeId,
}

/// The router actor.
pub struct Router {
    hello: Hello,
    peers: Peers,
    clock: MonotonicClock,
    next_request: u64,
    next_prefill: usize,
    next_decode: usize,
    selection: Selection,
    request_timeout_ms: u64,
    prompt_limit: PromptLimit,
    mailbox: usize,
    requests: HashMap<RequestId, Pending>,
    probes: HashMap<RequestId, Probe>,
    /// Each leg's last load report.
    loads: HashMap<NodeId, LegLoad>,
    /// Times a request may start over on another prefill leg (`[failure] max_retries`).
    max_retries: u32,
    /// The request each cancellable client request currently runs as (a retry moves it).
    clients: HashMap<u64, RequestId>,
}

/// The first request id of a router incarnation. Legs key requests (and the tombstones of
/// those they started or saw aborted) by id, so each incarnation numbers its requests in a
/// space of its own: 2^32 ids from a base taken from its (random) incarnation, below the
/// in-process direct runs' `1 << 62`. A restarted router, or a second one, does not reuse
/// the ids of requests the legs still remember.
pub fn first_request_id(incarnation: Incarnation) -> u64 {
    ((incarnation.0 % ((1 << 30) - 1)) + 1) << 32
}

impl Router {
    /// A router that says `hello` to the legs.
    pub fn new(
        hello: Hello,
        request_timeout_ms: u64,
        prompt_limit: PromptLimit,
        selection: Selection,
        mailbox: usize,
    ) -> Self {
        Router {
            next_request: first_request_id(hello.incarnation),
            max_retries: 0,
            clients: HashMap::new(),
            selection,
            peers: Peers::new(hello.node.clone(), hello.incarnation),
            hello,
            clock: MonotonicClock::new(),
            next_prefill: 0,
            next_decode: 0,
            request_timeout_ms,
            prompt_limit,
            mailbox,
            requests: HashMap::new(),
            probes: HashMap::new(),
            loads: HashMap::new(),
        }
    }

    /// A leg (that incarnation of it) is gone: its load report goes, and every request on it
    /// fails, or starts over where the policy allows.
    fn leg_lost(&mut self, leg: &NodeId, ctx: &mut Context<Self>) {
        self.loads.remove(leg);
        let affected: Vec<RequestId> = self
            .requests
            .iter()
            .filter(|(_, pending)| {
                let (prefill, decode) = pending.machine.legs();
                prefill == leg || decode == leg
            })
            .map(|(&request, _)| request)
            .collect();
        for request in affected {
            if let Some(pending) = self.requests.get_mut(&request) {
                pending.machine.handle_peer_lost(leg);
            }
            self.drive(request, ctx);
        }
    }

    /// Lets a request start over on another prefill leg up to `max_retries` times.
    pub fn with_retries(mut self, max_retries: u32) -> Self {
        self.max_retries = max_retries;
        self
    }

    /// Starts a request on legs it has not failed on: a new machine under a new id, with what
    /// is left of the client's deadline. Answers the client at once if no leg is left.
    fn start_request(&mut self, attempt: Attempt, ctx: &mut Context<Self>) {
        let legs = self
            .pick(Role::Prefill, attempt.attempts.avoid())
            .and_then(|prefill| Ok((prefill, self.pick(Role::Decode, attempt.attempts.avoid())?)));
        let (prefill, decode) = match legs {
            Ok(legs) => legs,
            Err(error) => {
                let _ = attempt.reply.send(Err(attempt.last_error.unwrap_or(error)));
                return;
            }
        };
        let request = self.new_request();
        let now = self.clock.now_ms();
        if attempt.attempts.retries() > 0 {
            tracing::info!(%request, prefill = %prefill.node, attempt = attempt.attempts.retries(), "retrying on other legs");
            metrics::counter!("pdkv_retries_total").increment(1);
        }
        let machine = RouterMachine::new(
            request,
            attempt.prompt.to_vec(),
            attempt.max_tokens,
            (prefill.node, prefill.incarnation),
            (decode.node, decode.incarnation),
            attempt.deadline_ms,
            now,
        )
        .with_streaming(attempt.stream.is_some())
        .with_sampling(Sampling::clone(&attempt.sampling));
        let pending = Pending {
            machine,
            reply: Some(attempt.reply),
            timer: None,
            started: attempt.started,
            kv_ready: None,
            stream: attempt.stream,
            prompt: attempt.prompt,
            max_tokens: attempt.max_tokens,
            sampling: attempt.sampling,
            deadline_ms: attempt.deadline_ms,
            attempts: attempt.attempts,
            client: attempt.client,
        };
        if let Some(client) = attempt.client {
            self.clients.insert(client, request);
        }
        self.requests.insert(request, pending);
        self.drive(request, ctx);
    }

    /// Refuses a prompt no leg can hold before any leg does work for it.
    fn check_prompt(&self, prompt: &[u32]) -> Result<(), RequestError> {
        let num_prompt_tokens = prompt.len() as u64;
        if num_prompt_tokens == 0 {
            return Err(RequestError::EmptyPrompt);
        }
        if num_prompt_tokens > self.prompt_limit.max_tokens {
            return Err(PromptTooLong {
                num_prompt_tokens,
                limit: self.prompt_limit.clone(),
            }
            .into());
        }
        Ok(())
    }

    /// The next leg of `role` among those linked both ways (in name order), chosen by the one
    /// rule both routers share ([`proxy::choose`]): `least_loaded` takes the leg with the
    /// fewest requests — this router's in flight there, or the leg's own last report (which
    /// also counts other routers' requests), whichever is more — then the one whose scarcest
    /// group has the largest free share; ties go in turn. `round_robin`: each in turn.
    fn pick(&mut self, role: Role, avoid: &[NodeId]) -> Result<Hello, RequestError> {
        let mut legs: Vec<&Hello> = self
            .peers
            .linked_hellos()
            .filter(|hello| hello.role == role)
            .collect();
        legs.sort_by(|a, b| a.node.cmp(&b.node));
        let views: Vec<proxy::LegView> = legs
            .iter()
            .map(|leg| {
                let in_flight = self
                    .requests
                    .values()
                    .filter(|pending| {
                        let (prefill, decode) = pending.machine.legs();
                        *prefill == leg.node || *decode == leg.node
                    })
                    .count();
                let report = self.loads.get(&leg.node);
                proxy::LegView {
                    healthy: true,
                    in_flight: u32::try_from(in_flight).unwrap_or(u32::MAX),
                    reported: report.map_or(0, |load| u32::try_from(load.requests).unwrap_or(u32::MAX)),
                    kv_usage: report.map_or(0.0, |load| 1.0 - load.free_share()),
                }
            })
            .collect();
        let avoided: Vec<usize> = (0..legs.len())
            .filter(|&index| avoid.contains(&legs[index].node))
            .collect();
        let turn = match role {
            Role::Prefill => &mut self.next_prefill,
            _ => &mut self.next_decode,
        };
        match proxy::choose(&views, &avoided, self.selection, turn) {
            Some(index) => Ok(legs[index].clone()),
            None => Err(RequestError::NoLeg {
                role,
                avoided: avoid.to_vec(),
            }),
        }
    }

    fn new_request(&mut self) -> RequestId {
        let request = RequestId(self.next_request);
        self.next_request += 1;
        request
    }

    fn drive(&mut self, request: RequestId, ctx: &mut Context<Self>) {
        let now = self.clock.now_ms();
        let mut retry = None;
        loop {
            let Some(pending) = self.requests.get_mut(&request) else {
                return;
            };
            let Some(command) = pending.machine.poll_command() else {
                break;
            };
            match command {
                RouterCommand::Send { to, body } => {
                    let budget_ms = pending
                        .machine
                        .poll_timeout()
                        .map_or(0, |deadline| deadline.saturating_sub(now));
                    if let Err(error) = self.peers.send(&to, request, budget_ms, body)
                        && let Some(pending) = self.requests.get_mut(&request)
                    {
                        tracing::warn!(%request, %to, %error, "message not sent");
                        pending.machine.handle_send_failed(&to, error.fault());
                    }
                }
                RouterCommand::Complete(outcome) => {
                    // Start over on other legs, from the prompt, within the same deadline, where
                    // core's rules allow it.
                    let lost = match &outcome {
                        RequestOutcome::Failed { stage, reason } if pending.reply.is_some() => {
                            let (prefill, decode) = pending.machine.legs();
                            let (prefill, decode) = (prefill.clone(), decode.clone());
                            pending.attempts.retry_after(*stage, reason, &prefill, &decode)
                        }
                        _ => None,
                    };
                    if let (Some(lost), RequestOutcome::Failed { stage, reason }) = (lost, &outcome)
                        && let Some(reply) = pending.reply.take()
                    {
                        tracing::warn!(%request, leg = %lost, %reason, "starting over without a failed leg");
                        retry = Some(Attempt {
                            prompt: pending.prompt.clone(),
                            max_tokens: pending.max_tokens,
                            sampling: pending.sampling.clone(),
                            deadline_ms: pending.deadline_ms,
                            stream: pending.stream.take(),
                            reply,
                            started: pending.started,
                            attempts: pending.attempts.clone(),
                            last_error: Some(RequestError::from_failure(
                                *stage,
                                reason.clone(),
                                self.request_timeout_ms,
                            )),
                            client: pending.client,
                        });
                        continue;
                    }
                    let result = match outcome {
                        RequestOutcome::Output(output) => {
                            let done = Instant::now();
                            let kv_ready = pending.kv_ready.unwrap_or(done);
                            Ok(Output::from_decode(
                                request,
                                output,
                                kv_ready.saturating_duration_since(pending.started),
                                done.saturating_duration_since(kv_ready),
                            ))
                        }
                        RequestOutcome::Failed { stage, reason } => {
                            tracing::debug!(%request, %stage, %reason, "request failed");
                            Err(RequestError::from_failure(stage, reason, self.request_timeout_ms))
                        }
                    };
                    if let Some(reply) = pending.reply.take() {
                        // The client may have gone; nothing else waits for the answer.
                        let _ = reply.send(result);
                    }
                }
            }
        }
        if let Some(attempt) = retry {
            self.start_request(attempt, ctx);
        }
        let Some(pending) = self.requests.get_mut(&request) else {
            return;
        };
        if pending.machine.is_done() {
            if let Some(mut pending) = self.requests.remove(&request) {
                timer::cancel(&mut pending.timer, ctx);
                if let Some(client) = pending.client
                    && self.clients.get(&client) == Some(&request)
                {
                    self.clients.remove(&client);
                }
            }
            return;
        }
        let next = pending.machine.poll_timeout();
        timer::rearm(
            &mut pending.timer,
            next,
            now,
            ctx,
            move |router: &mut Router, ctx| {
                let now = router.clock.now_ms();
                if let Some(pending) = router.requests.get_mut(&request) {
                    pending.timer = None;
                    pending.machine.handle_timeout(now);
                }
                router.drive(request, ctx);
            },
        );
    }

    /// Sends one message to one leg outside any machine and waits (bounded) for its first answer.
    fn probe(
        &mut self,
        request: RequestId,
        leg: NodeId,
        body: Body,
    ) -> ResponseFuture<Result<Body, RequestError>> {
        let (reply, answer) = oneshot::channel();
        let budget_ms = self.request_timeout_ms;
        if let Err(error) = self.peers.send(&leg, request, budget_ms, body) {
            let error = RequestError::Failed {
                stage: Stage::Router,
                failure: pdkv_core::wire::Failure::Unreachable {
                    to: leg,
                    fault: error.fault(),
                },
            };
            return Box::pin(async move { Err(error) });
        }
        self.probes.insert(request, Probe { reply, leg });
        let timeout = Duration::from_millis(budget_ms);
        Box::pin(async move {
            match tokio::time::timeout(timeout, answer).await {
                Ok(Ok(body)) => Ok(body),
                Ok(Err(_)) => Err(RequestError::Mailbox {
                    actor: "router",
                    detail: "stopped".into(),
                }),
                Err(_) => Err(RequestError::Timeout {
                    stage: Stage::Router.as_str(),
                    after_ms: budget_ms,
                }),
            }
        })
    }
}

impl Actor for Router {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.set_mailbox_capacity(self.mailbox);
    }
}

impl Handler<Admit> for Router {
    type Result = Result<(), Refusal>;

    fn handle(&mut self, msg: Admit, ctx: &mut Self::Context) -> Self::Result {
        check_compat(&self.hello, &msg.hello).map_err(|error| Refusal::Incompatible(error.to_string()))?;
        let node = msg.hello.node.clone();
        if let Some(old) = self.peers.admit(msg.hello, msg.dialed_in) {
            tracing::warn!(leg = %node, %old, "leg restarted: failing its requests");
            self.leg_lost(&node, ctx);
        }
        Ok(())
    }
}

impl Handler<LinkLost> for Router {
    type Result = ();

    fn handle(&mut self, msg: LinkLost, ctx: &mut Self::Context) -> Self::Result {
        if !self.peers.drop_link(&msg.peer, msg.incarnation) {
            return;
        }
        tracing::warn!(leg = %msg.peer, reason = %msg.reason, "leg lost: failing its requests");
        self.leg_lost(&msg.peer, ctx);
    }
}

impl Handler<SetLink> for Router {
    type Result = ();

    fn handle(&mut self, msg: SetLink, _ctx: &mut Self::Context) -> Self::Result {
        self.peers.set_link(&msg.peer, msg.link);
    }
}

impl Handler<Inbound> for Router {
    type Result = Result<(), Refusal>;

    fn handle(&mut self, msg: Inbound, ctx: &mut Self::Context) -> Self::Result {
        let (peer, request, kind) = (msg.peer.clone(), msg.envelope.request, msg.envelope.body.kind());
        let taken = self.take(msg, ctx);
        if let Err(refusal) = &taken {
            log_refusal(&peer, request, kind, refusal);
        }
        taken
    }
}

impl Router {
    /// Checks an inbound envelope and acts on it; the error is why it was refused.
    fn take(&mut self, msg: Inbound, ctx: &mut Context<Self>) -> Result<(), Refusal> {
        self.peers.check(&msg)?;
        let Envelope {
            request,
            from,
            incarnation,
            body,
            ..
        } = msg.envelope;
        match body {
            Body::Load(load) => {
                self.loads.insert(from, load);
                return Ok(());
            }
            Body::Tokens { tokens } => {
                let Some(pending) = self
                    .requests
                    .get_mut(&request)
                    .filter(|pending| pending.machine.legs().1 == &from)
                else {
                    return Ok(());
                };
                // A retried request streams on from where the client is.
                let fresh = pending.attempts.take_streamed(&tokens);
                if fresh.is_empty() {
                    return Ok(());
                }
                if let Some(stream) = &pending.stream
                    && stream.try_send(fresh.to_vec()).is_err()
                {
                    // The client went away, or sent more than it has room for: the answer
                    // still carries every token.
                    tracing::debug!(%request, "streamed tokens dropped");
                }
                return Ok(());
            }
            _ => {}
        }
        if self.probes.get(&request).is_some_and(|probe| probe.leg == from) {
            if let Some(probe) = self.probes.remove(&request) {
                let _ = probe.reply.send(body);
            }
            return Ok(());
        }
        if let Body::KvReady(params) = &body {
            tracing::debug!(%request, prefill = %from, grant = params.grant.0, "prefilled");
        }
        if self.requests.contains_key(&request) {
            if let Some(pending) = self.requests.get_mut(&request) {
                if matches!(body, Body::KvReady(_)) && pending.kv_ready.is_none() {
                    pending.kv_ready = Some(Instant::now());
                }
                pending.machine.handle_message(&from, incarnation, body);
            }
            self.drive(request, ctx);
        } else if let Body::KvReady(params) = body {
            // A grant for a request that is over: free it now rather than at lease end.
            tracing::debug!(%request, leg = %from, grant = params.grant.0, "late grant aborted");
            if let Err(error) = self.peers.send(&from, request, 0, Body::Abort) {
                tracing::warn!(%request, leg = %from, %error, "abort not sent");
            }
        }
        Ok(())
    }
}

/// The legs' last load reports (diagnosis, `/ready`).
#[derive(Debug, Message)]
#[rtype(result = "HashMap<NodeId, LegLoad>")]
pub struct LegLoads;

impl Handler<LegLoads> for Router {
    type Result = actix::MessageResult<LegLoads>;

    fn handle(&mut self, _msg: LegLoads, _ctx: &mut Self::Context) -> Self::Result {
        actix::MessageResult(self.loads.clone())
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
    pub read_runs: u64,
    /// Prefix-hit blocks the decode leg reused.
    pub cached_blocks: u64,
    /// Why generation ended.
    pub finish: pdkv_core::sampling::Finish,
    /// Per generated token, when the request asked for log-probabilities.
    pub logprobs: Vec<pdkv_core::sampling::TokenLogprobs>,
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

/// Serve a request P/D: prefill on one leg, READ and decode on another.
#[derive(Debug, Message)]
#[rtype(result = "Result<Output, RequestError>")]
pub struct Generate {
    /// Prompt tokens.
    pub prompt: Arc<[u32]>,
    /// Tokens to generate.
    pub max_tokens: u32,
    /// How the decode leg chooses tokens and when it stops early.
    pub sampling: Sampling,
    /// Tokens as they are generated, before the answer (a streaming client): a channel with
    /// room for `max_tokens` messages.
    pub stream: Option<TokenStream>,
    /// A name the client may later cancel the request by ([`Cancel`]), unique among its
    /// requests in flight.
    pub client: Option<u64>,
}

/// The client of a request went away: both legs are told to free what it holds, now.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct Cancel {
    /// The name the client gave the request in [`Generate::client`].
    pub client: u64,
}

impl Handler<Cancel> for Router {
    type Result = ();

    fn handle(&mut self, msg: Cancel, ctx: &mut Self::Context) -> Self::Result {
        let Some(request) = self.clients.remove(&msg.client) else {
            return;
        };
        if let Some(pending) = self.requests.get_mut(&request) {
            tracing::info!(%request, "client gone: aborting both legs");
            metrics::counter!("pdkv_requests_total", "outcome" => "cancelled").increment(1);
            pending.machine.handle_cancel();
        }
        self.drive(request, ctx);
    }
}

impl Handler<Generate> for Router {
    type Result = ResponseActFuture<Self, Result<Output, RequestError>>;

    fn handle(&mut self, msg: Generate, ctx: &mut Self::Context) -> Self::Result {
        if let Err(error) = self.check_prompt(&msg.prompt) {
            return Box::pin(actix::fut::ready(Err(error)));
        }
        let (reply, answer) = oneshot::channel();
        let attempt = Attempt {
            prompt: msg.prompt,
            max_tokens: msg.max_tokens,
            sampling: Arc::new(msg.sampling),
            deadline_ms: self.clock.now_ms().saturating_add(self.request_timeout_ms),
            stream: msg.stream,
            reply,
            started: Instant::now(),
            attempts: Attempts::new(self.max_retries),
            last_error: None,
            client: msg.client,
        };
        self.start_request(attempt, ctx);
        Box::pin(
            async move {
                answer.await.unwrap_or_else(|_| {
                    Err(RequestError::Mailbox {
                        actor: "router",
                        detail: "stopped before answering".into(),
                    })
                })
            }
            .into_actor(self)
            .map(|result, _, _| result),
        )
    }
}

/// Diagnosis: ask one prefill leg to compute a prompt and grant `decode` a READ, without a
/// decode stage. The grant lives until released or its lease lapses.
#[derive(Debug, Message)]
#[rtype(result = "Result<KvParams, RequestError>")]
pub struct PrefillOnly {
    /// The prefill leg.
    pub prefill: NodeId,
    /// The decode leg the grant is for.
    pub decode: NodeId,
    /// The prompt.
    pub prompt: Vec<u32>,
}

impl Handler<PrefillOnly> for Router {
    type Result = ResponseFuture<Result<KvParams, RequestError>>;

    fn handle(&mut self, msg: PrefillOnly, _ctx: &mut Self::Context) -> Self::Result {
        let budget_ms = self.request_timeout_ms;
        let request = self.new_request();
        let answer = self.probe(
            request,
            msg.prefill,
            Body::Prefill {
                prompt: msg.prompt,
                decode: msg.decode,
            },
        );
        Box::pin(async move {
            match answer.await? {
                Body::KvReady(params) => Ok(params),
                Body::Failed { stage, reason } => Err(RequestError::from_failure(stage, reason, budget_ms)),
                other => Err(RequestError::UnexpectedAnswer(other.kind())),
            }
        })
    }
}

/// Diagnosis: ask one decode leg to READ and decode under `params`, without a prefill stage.
#[derive(Debug, Message)]
#[rtype(result = "Result<Output, RequestError>")]
pub struct DecodeOnly {
    /// The decode leg.
    pub decode: NodeId,
    /// The prompt the KV was computed from.
    pub prompt: Vec<u32>,
    /// What a prefill leg handed back.
    pub params: KvParams,
    /// Tokens to generate.
    pub max_tokens: u32,
}

impl Handler<DecodeOnly> for Router {
    type Result = ResponseFuture<Result<Output, RequestError>>;

    fn handle(&mut self, msg: DecodeOnly, _ctx: &mut Self::Context) -> Self::Result {
        let budget_ms = self.request_timeout_ms;
        let request = msg.params.request;
        let answer = self.probe(
            request,
            msg.decode,
            Body::Decode {
                prompt: msg.prompt,
                params: msg.params,
                max_tokens: msg.max_tokens,
                stream: false,
                sampling: Sampling::default(),
            },
        );
        Box::pin(async move {
            match answer.await? {
                Body::Output(output) => Ok(Output::from_decode(
                    request,
                    output,
                    Duration::ZERO,
                    Duration::ZERO,
                )),
                Body::Failed { stage, reason } => Err(RequestError::from_failure(stage, reason, budget_ms)),
                other => Err(RequestError::UnexpectedAnswer(other.kind())),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_router_incarnation_numbers_requests_in_a_space_of_its_own() {
        const SPACE: u64 = 1 << 32;
        const DIRECT_BASE: u64 = 1 << 62;
        let incarnations = [
            0,
            1,
            2,
            (1 << 30) - 2,
            (1 << 30) - 1,
            u64::MAX,
            0x5eed_1234_abcd_0001,
        ];
        for incarnation in incarnations {
            let first = first_request_id(Incarnation(incarnation));
            assert_eq!(first % SPACE, 0, "{incarnation:#x}");
            assert!(first >= SPACE, "id 0 is the load reports'");
            assert!(first + (SPACE - 1) < DIRECT_BASE, "{incarnation:#x}");
        }
        // Neighbouring incarnations get other spaces.
        assert_ne!(first_request_id(Incarnation(7)), first_request_id(Incarnation(8)));
    }
}
