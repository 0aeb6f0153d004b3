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
use pdkv_core::router::{Answer, ClientRequest, Dispatcher, ProbeAnswer, RouterOutput, Ticket};
use pdkv_core::sampling::Sampling;
use pdkv_core::wire::{Body, Envelope, Failure, Incarnation, KvParams, LegLoad, NodeId, RequestId, Stage};
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

/// A client waiting for its request's answer.
struct Waiting {
    reply: Reply,
    /// Where the decode leg's streamed tokens go (a streaming client).
    stream: Option<TokenStream>,
    started: Instant,
    /// When the current attempt's KV parameters arrived.
    kv_ready: Option<Instant>,
}

/// The client's end of a streaming request: tokens as the decode leg generates them. Bounded
/// by the request's `max_tokens` (each message carries at least one token).
pub type TokenStream = tokio::sync::mpsc::Sender<Vec<u32>>;

/// The router actor: the door and links of the router node around core's [`Dispatcher`],
/// which holds every rule (leg choice, attempts, retries, streamed-token skip, probes).
pub struct Router {
    hello: Hello,
    peers: Peers,
    clock: MonotonicClock,
    request_timeout_ms: u64,
    prompt_limit: PromptLimit,
    mailbox: usize,
    dispatcher: Dispatcher,
    /// Clients waiting, by ticket.
    waiting: HashMap<Ticket, Waiting>,
    /// Diagnosis requests waiting for a leg's first answer.
    probes: HashMap<RequestId, oneshot::Sender<Result<Body, RequestError>>>,
    /// The one timer, at the dispatcher's next deadline.
    timer: MachineTimer,
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
            dispatcher: Dispatcher::new(selection, 0, first_request_id(hello.incarnation)),
            peers: Peers::new(hello.node.clone(), hello.incarnation),
            hello,
            clock: MonotonicClock::new(),
            request_timeout_ms,
            prompt_limit,
            mailbox,
            waiting: HashMap::new(),
            probes: HashMap::new(),
            timer: None,
        }
    }

    /// Lets a request start over on other legs up to `max_retries` times.
    pub fn with_retries(mut self, max_retries: u32) -> Self {
        self.dispatcher.set_max_retries(max_retries);
        self
    }

    /// Tells the dispatcher whether `node` is a leg it may use now: admitted and linked both
    /// ways. A leg that went (or restarted) fails the requests it served.
    fn sync_leg(&mut self, node: &NodeId, ctx: &mut Context<Self>) {
        let leg = self
            .peers
            .linked_hellos()
            .find(|hello| hello.node == *node)
            .map(|hello| (hello.role, hello.incarnation));
        let now = self.clock.now_ms();
        self.dispatcher.set_leg(node, leg, now);
        self.carry_out(ctx);
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

    /// Carries out what the dispatcher asks, in order, then arms the timer at its next deadline.
    fn carry_out(&mut self, ctx: &mut Context<Self>) {
        let now = self.clock.now_ms();
        while let Some(output) = self.dispatcher.poll_output() {
            match output {
                RouterOutput::Send(out) => {
                    if let Err(error) = self.peers.send(&out.to, out.request, out.budget_ms, out.body) {
                        tracing::warn!(request = %out.request, to = %out.to, %error, "message not sent");
                        self.dispatcher
                            .handle_send_failed(out.request, &out.to, error.fault(), now);
                    }
                }
                RouterOutput::Started {
                    request,
                    prefill,
                    decode,
                    retries,
                    ..
                } => {
                    tracing::debug!(%request, %prefill, %decode, "request started");
                    if retries > 0 {
                        tracing::info!(%request, %prefill, attempt = retries, "retrying on other legs");
                        metrics::counter!("pdkv_retries_total").increment(1);
                    }
                }
                RouterOutput::Retrying { lost, reason, .. } => {
                    tracing::warn!(leg = %lost, %reason, "starting over without a failed leg");
                }
                RouterOutput::Prefilled { ticket, request } => {
                    tracing::debug!(%request, "prefilled");
                    if let Some(waiting) = self.waiting.get_mut(&ticket) {
                        waiting.kv_ready.get_or_insert_with(Instant::now);
                    }
                }
                RouterOutput::Tokens { ticket, tokens } => {
                    if let Some(stream) = self
                        .waiting
                        .get(&ticket)
                        .and_then(|waiting| waiting.stream.as_ref())
                        && stream.try_send(tokens).is_err()
                    {
                        // The client went away, or sent more than it has room for: the answer
                        // still carries every token.
                        tracing::debug!(%ticket, "streamed tokens dropped");
                    }
                }
                RouterOutput::Done { ticket, answer } => {
                    let Some(waiting) = self.waiting.remove(&ticket) else {
                        continue;
                    };
                    let result = match answer {
                        Answer::Output { request, output } => {
                            let done = Instant::now();
                            let kv_ready = waiting.kv_ready.unwrap_or(done);
                            Ok(Output::from_decode(
                                request,
                                output,
                                kv_ready.saturating_duration_since(waiting.started),
                                done.saturating_duration_since(kv_ready),
                            ))
                        }
                        Answer::Failed { stage, reason } => {
                            tracing::debug!(%ticket, %stage, %reason, "request failed");
                            Err(RequestError::from_failure(stage, reason, self.request_timeout_ms))
                        }
                        Answer::NoLeg { role, avoided } => Err(RequestError::NoLeg { role, avoided }),
                    };
                    // The client may have gone; nothing else waits for the answer.
                    let _ = waiting.reply.send(result);
                }
                RouterOutput::Probed { request, answer } => {
                    let Some(reply) = self.probes.remove(&request) else {
                        continue;
                    };
                    let result = match answer {
                        ProbeAnswer::Answered(body) => Ok(body),
                        ProbeAnswer::TimedOut => Err(RequestError::Timeout {
                            stage: Stage::Router.as_str(),
                            after_ms: self.request_timeout_ms,
                        }),
                        ProbeAnswer::Unreachable { to, fault } => Err(RequestError::Failed {
                            stage: Stage::Router,
                            failure: Failure::Unreachable { to, fault },
                        }),
                    };
                    let _ = reply.send(result);
                }
            }
        }
        timer::rearm(
            &mut self.timer,
            self.dispatcher.poll_timeout(),
            now,
            ctx,
            |router: &mut Router, ctx| {
                router.timer = None;
                let now = router.clock.now_ms();
                router.dispatcher.handle_timeout(now);
                router.carry_out(ctx);
            },
        );
    }

    /// Sends one message to one leg outside any request and waits (bounded by the request
    /// timeout) for its first answer.
    fn probe(
        &mut self,
        request: RequestId,
        leg: NodeId,
        body: Body,
        ctx: &mut Context<Self>,
    ) -> ResponseFuture<Result<Body, RequestError>> {
        let (reply, answer) = oneshot::channel();
        self.probes.insert(request, reply);
        let now = self.clock.now_ms();
        let deadline = now.saturating_add(self.request_timeout_ms);
        self.dispatcher.probe(request, leg, body, deadline, now);
        self.carry_out(ctx);
        Box::pin(async move {
            answer.await.unwrap_or_else(|_| {
                Err(RequestError::Mailbox {
                    actor: "router",
                    detail: "stopped".into(),
                })
            })
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
        }
        self.sync_leg(&node, ctx);
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
        self.sync_leg(&msg.peer, ctx);
    }
}

impl Handler<SetLink> for Router {
    type Result = ();

    fn handle(&mut self, msg: SetLink, ctx: &mut Self::Context) -> Self::Result {
        self.peers.set_link(&msg.peer, msg.link);
        self.sync_leg(&msg.peer, ctx);
    }
}

impl Handler<Inbound> for Router {
    type Result = Result<(), Refusal>;

    fn handle(&mut self, msg: Inbound, ctx: &mut Self::Context) -> Self::Result {
        let (peer, request, kind) = (msg.peer.clone(), msg.envelope.request, msg.envelope.body.kind());
        if let Err(refusal) = self.peers.check(&msg) {
            log_refusal(&peer, request, kind, &refusal);
            return Err(refusal);
        }
        let Envelope {
            request,
            from,
            incarnation,
            body,
            ..
        } = msg.envelope;
        let now = self.clock.now_ms();
        self.dispatcher
            .handle_message(&from, incarnation, request, body, now);
        self.carry_out(ctx);
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
        actix::MessageResult(self.dispatcher.loads().clone())
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
        let now = self.clock.now_ms();
        if self.dispatcher.cancel(msg.client, now) {
            tracing::info!(client = msg.client, "client gone: aborting both legs");
            metrics::counter!("pdkv_requests_total", "outcome" => "cancelled").increment(1);
        }
        self.carry_out(ctx);
    }
}

impl Handler<Generate> for Router {
    type Result = ResponseActFuture<Self, Result<Output, RequestError>>;

    fn handle(&mut self, msg: Generate, ctx: &mut Self::Context) -> Self::Result {
        if let Err(error) = self.check_prompt(&msg.prompt) {
            return Box::pin(actix::fut::ready(Err(error)));
        }
        let (reply, answer) = oneshot::channel();
        let now = self.clock.now_ms();
        let request = ClientRequest {
            prompt: msg.prompt,
            max_tokens: msg.max_tokens,
            sampling: msg.sampling,
            stream: msg.stream.is_some(),
            deadline_ms: now.saturating_add(self.request_timeout_ms),
            client: msg.client,
        };
        let ticket = self.dispatcher.submit(request, now);
        let waiting = Waiting {
            reply,
            stream: msg.stream,
            started: Instant::now(),
            kv_ready: None,
        };
        self.waiting.insert(ticket, waiting);
        self.carry_out(ctx);
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

    fn handle(&mut self, msg: PrefillOnly, ctx: &mut Self::Context) -> Self::Result {
        let budget_ms = self.request_timeout_ms;
        let request = self.dispatcher.new_request();
        let answer = self.probe(
            request,
            msg.prefill,
            Body::Prefill {
                prompt: msg.prompt,
                decode: msg.decode,
            },
            ctx,
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

    fn handle(&mut self, msg: DecodeOnly, ctx: &mut Self::Context) -> Self::Result {
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
            ctx,
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
