//! The router's rules above one attempt. A client request ([`Ticket`]) may run as several
//! attempts, each a [`crate::leg::RouterMachine`] under a request id of its own, on other legs
//! than the ones an earlier attempt failed on. [`Attempts`] decides whether a failed attempt
//! starts over and without which leg, and which streamed tokens a client has not seen yet;
//! [`Dispatcher`] owns every open client request, the legs the router may use and their loads,
//! chooses legs ([`crate::proxy::choose`]), and turns what arrives into what to send and what
//! to tell clients.
//!
//! The actix router and the simulation are both shells around one [`Dispatcher`], so the
//! simulation checks the rules that ship (`docs/ARCHITECTURE.md`, "The router").
//!
//! Non-goals: sending, timing, prompt limits (the shell does).

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::Arc;

use crate::leg::{RequestOutcome, RouterCommand, RouterMachine, leg_to_retry_without};
use crate::node::Outbound;
use crate::proxy::{self, LegView, Policy};
use crate::sampling::Sampling;
use crate::wire::{
    Body, DecodeOutput, Failure, Incarnation, LegLoad, LinkFault, NodeId, RequestId, Role, Stage,
};

/// One client request across its attempts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attempts {
    /// Attempts after the first that may run (`[failure] max_retries`).
    max_retries: u32,
    /// Attempts after the first that did run.
    retries: u32,
    /// Legs an earlier attempt failed on, in the order it did.
    avoid: Vec<NodeId>,
    /// Tokens the client has been streamed, over every attempt.
    streamed: usize,
    /// Tokens of the current attempt not to stream again: an earlier attempt streamed them.
    skip: usize,
}

impl Attempts {
    /// A client request that may start over `max_retries` times.
    pub fn new(max_retries: u32) -> Self {
        Attempts {
            max_retries,
            retries: 0,
            avoid: Vec::new(),
            streamed: 0,
            skip: 0,
        }
    }

    /// Legs the next attempt must not run on.
    pub fn avoid(&self) -> &[NodeId] {
        &self.avoid
    }

    /// Attempts after the first so far.
    pub fn retries(&self) -> u32 {
        self.retries
    }

    /// Tokens the client has been streamed.
    pub fn streamed(&self) -> usize {
        self.streamed
    }

    /// The current attempt's decode leg streamed `tokens` (in order, following what it streamed
    /// before): the part the client has not seen. Generation is deterministic for a request
    /// (greedy, or seeded sampling), so an attempt after a failed one produces the same first
    /// tokens, and the client gets each token once, in order.
    pub fn take_streamed<'a>(&mut self, tokens: &'a [u32]) -> &'a [u32] {
        let skipped = self.skip.min(tokens.len());
        self.skip -= skipped;
        let fresh = &tokens[skipped..];
        self.streamed += fresh.len();
        fresh
    }

    /// The current attempt on `prefill` and `decode` failed in `stage` with `reason`: the leg
    /// to start over without, if the failure allows a retry ([`leg_to_retry_without`]) and
    /// retries are left. The next attempt then avoids that leg and skips the tokens the client
    /// already has.
    pub fn retry_after(
        &mut self,
        stage: Stage,
        reason: &Failure,
        prefill: &NodeId,
        decode: &NodeId,
    ) -> Option<NodeId> {
        if self.retries >= self.max_retries {
            return None;
        }
        let lost = leg_to_retry_without(stage, reason, prefill, decode)?.clone();
        self.retries += 1;
        self.avoid.push(lost.clone());
        self.skip = self.streamed;
        Some(lost)
    }
}

/// A client request at the router, across its attempts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ticket(pub u64);

impl std::fmt::Display for Ticket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "client-request-{}", self.0)
    }
}

/// What a client asks the router for.
#[derive(Debug, Clone, PartialEq)]
pub struct ClientRequest {
    /// Prompt tokens (checked by the shell against its limits), shared with the shell.
    pub prompt: Arc<[u32]>,
    /// Tokens to generate.
    pub max_tokens: u32,
    /// How the decode leg chooses tokens.
    pub sampling: Sampling,
    /// Whether the client is streamed tokens as they are generated ([`RouterOutput::Tokens`]).
    pub stream: bool,
    /// When the request fails if it has not ended, on the shell's clock: every attempt shares it.
    pub deadline_ms: u64,
    /// A name the client may cancel the request by ([`Dispatcher::cancel`]), unique among its
    /// requests in flight.
    pub client: Option<u64>,
}

/// How a client request ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Answer {
    /// The decode leg's answer, from attempt `request`.
    Output {
        /// The attempt that answered.
        request: RequestId,
        /// What it answered.
        output: DecodeOutput,
    },
    /// The last attempt failed (in `stage`, for `reason`) and no retry is allowed or left.
    Failed {
        /// Where.
        stage: Stage,
        /// Why.
        reason: Failure,
    },
    /// No attempt could start: no leg of `role` is linked outside `avoided`.
    NoLeg {
        /// The role no leg was left for.
        role: Role,
        /// Legs earlier attempts failed on.
        avoided: Vec<NodeId>,
    },
}

/// How a probe ([`Dispatcher::probe`]) ended.
#[derive(Debug, Clone, PartialEq)]
pub enum ProbeAnswer {
    /// The leg's first answer about the probe's request.
    Answered(Body),
    /// No answer by the probe's deadline.
    TimedOut,
    /// The message could not be sent to `to`.
    Unreachable {
        /// The leg.
        to: NodeId,
        /// Why.
        fault: LinkFault,
    },
}

/// What the router's shell carries out, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum RouterOutput {
    /// Send a message to a leg.
    Send(Outbound),
    /// An attempt of `ticket` started as `request` on `prefill` and `decode`; `retries` earlier
    /// attempts failed.
    Started {
        /// The client request.
        ticket: Ticket,
        /// The attempt's request id.
        request: RequestId,
        /// Its prefill leg.
        prefill: NodeId,
        /// Its decode leg.
        decode: NodeId,
        /// Attempts before this one.
        retries: u32,
    },
    /// An attempt failed in `stage` for `reason`, and the request starts over without `lost`.
    Retrying {
        /// The client request.
        ticket: Ticket,
        /// The leg the next attempt avoids.
        lost: NodeId,
        /// Where the attempt failed.
        stage: Stage,
        /// Why.
        reason: Failure,
    },
    /// The prefill leg's KV parameters for `ticket`'s current attempt arrived (stage timing).
    Prefilled {
        /// The client request.
        ticket: Ticket,
        /// The attempt.
        request: RequestId,
    },
    /// Tokens the client has not seen yet, in order (a streaming client).
    Tokens {
        /// The client request.
        ticket: Ticket,
        /// The tokens.
        tokens: Vec<u32>,
    },
    /// The client request ended; nothing more comes about it.
    Done {
        /// The client request.
        ticket: Ticket,
        /// How.
        answer: Answer,
    },
    /// A probe ended.
    Probed {
        /// The probe's request id.
        request: RequestId,
        /// How.
        answer: ProbeAnswer,
    },
}

/// A client request's state across attempts.
#[derive(Debug)]
struct Open {
    request: ClientRequest,
    attempts: Attempts,
    /// The failure that ended the last attempt: the answer if no leg is left for a retry.
    last_failure: Option<(Stage, Failure)>,
    /// The current attempt, while one runs.
    current: Option<RequestId>,
}

/// One attempt.
#[derive(Debug)]
struct Running {
    machine: RouterMachine,
    ticket: Ticket,
    /// Whether its KV parameters arrived.
    prefilled: bool,
    /// Its deadline, as indexed in [`Dispatcher::deadlines`].
    deadline_ms: u64,
}

/// A message sent to one leg outside any attempt, waiting for its first answer.
#[derive(Debug)]
struct Probe {
    leg: NodeId,
    deadline_ms: u64,
}

/// A leg the router may use: linked both ways.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Leg {
    role: Role,
    incarnation: Incarnation,
    /// Attempts of this router running there.
    in_flight: u32,
}

/// The router's rules over every client request: leg choice, attempts and retries, the
/// streamed-token skip, probes and late grants. Sans-IO: inputs are calls with the shell's
/// clock, outputs come from [`Dispatcher::poll_output`], the next deadline from
/// [`Dispatcher::poll_timeout`].
#[derive(Debug)]
pub struct Dispatcher {
    policy: Policy,
    max_retries: u32,
    next_request: u64,
    next_ticket: u64,
    /// Turns of [`proxy::choose`] per role (prefill, decode).
    turns: [usize; 2],
    legs: BTreeMap<NodeId, Leg>,
    loads: HashMap<NodeId, LegLoad>,
    open: HashMap<Ticket, Open>,
    running: HashMap<RequestId, Running>,
    clients: HashMap<u64, Ticket>,
    probes: HashMap<RequestId, Probe>,
    /// Deadlines of running attempts and probes.
    deadlines: BTreeSet<(u64, RequestId)>,
    outputs: VecDeque<RouterOutput>,
}

impl Dispatcher {
    /// A router choosing legs by `policy`, starting a request over at most `max_retries`
    /// times, numbering attempts from `first_request` up.
    pub fn new(policy: Policy, max_retries: u32, first_request: u64) -> Self {
        Dispatcher {
            policy,
            max_retries,
            next_request: first_request,
            next_ticket: 0,
            turns: [0, 0],
            legs: BTreeMap::new(),
            loads: HashMap::new(),
            open: HashMap::new(),
            running: HashMap::new(),
            clients: HashMap::new(),
            probes: HashMap::new(),
            deadlines: BTreeSet::new(),
            outputs: VecDeque::new(),
        }
    }

    /// Lets a request start over on other legs up to `max_retries` times (requests taken from
    /// now on).
    pub fn set_max_retries(&mut self, max_retries: u32) {
        self.max_retries = max_retries;
    }

    /// Client requests not yet ended.
    pub fn open_requests(&self) -> usize {
        self.open.len()
    }

    /// Attempts and probes still running.
    pub fn running(&self) -> usize {
        self.running.len() + self.probes.len()
    }

    /// The legs' last load reports.
    pub fn loads(&self) -> &HashMap<NodeId, LegLoad> {
        &self.loads
    }

    /// A fresh request id (for a probe the shell names itself).
    pub fn new_request(&mut self) -> RequestId {
        let request = RequestId(self.next_request);
        self.next_request += 1;
        request
    }

    /// `node` may now be used as `leg` (role and incarnation), or no longer (`None`: its link
    /// went, or it restarted). A leg that goes, or comes back as another incarnation, fails
    /// every attempt on it (retried where the rules allow) and its load report is forgotten.
    pub fn set_leg(&mut self, node: &NodeId, leg: Option<(Role, Incarnation)>, now_ms: u64) {
        let known = self.legs.get(node).map(|leg| (leg.role, leg.incarnation));
        if known == leg {
            return;
        }
        if known.is_some() {
            self.legs.remove(node);
            self.loads.remove(node);
            let mut affected = self
                .running
                .iter()
                .filter(|(_, attempt)| {
                    let (prefill, decode) = attempt.machine.legs();
                    prefill == node || decode == node
                })
                .map(|(&request, _)| request)
                .collect::<Vec<_>>();
            // In the order the attempts started, so that the retries they start (and the ids
            // those get) do not depend on a hash map's order: a seed replays.
            affected.sort_unstable();
            for request in affected {
                if let Some(attempt) = self.running.get_mut(&request) {
                    attempt.machine.handle_peer_lost(node);
                }
                self.drive(request, now_ms);
            }
        }
        if let Some((role, incarnation)) = leg {
            let leg = Leg {
                role,
                incarnation,
                in_flight: 0,
            };
            self.legs.insert(node.clone(), leg);
        }
    }

    /// Takes a client request: its first attempt starts now on the legs [`proxy::choose`]
    /// picks, or it ends at once ([`Answer::NoLeg`]) if there are none.
    pub fn submit(&mut self, request: ClientRequest, now_ms: u64) -> Ticket {
        let ticket = Ticket(self.next_ticket);
        self.next_ticket += 1;
        if let Some(client) = request.client {
            self.clients.insert(client, ticket);
        }
        let open = Open {
            request,
            attempts: Attempts::new(self.max_retries),
            last_failure: None,
            current: None,
        };
        self.open.insert(ticket, open);
        self.start_attempt(ticket, now_ms);
        ticket
    }

    /// The client named `client` went away: its current attempt tells both legs to free what
    /// they hold, and the request ends as cancelled. Whether a request was in flight under
    /// that name.
    pub fn cancel(&mut self, client: u64, now_ms: u64) -> bool {
        let Some(ticket) = self.clients.remove(&client) else {
            return false;
        };
        let Some(request) = self.open.get(&ticket).and_then(|open| open.current) else {
            return false;
        };
        if let Some(attempt) = self.running.get_mut(&request) {
            attempt.machine.handle_cancel();
        }
        self.drive(request, now_ms);
        true
    }

    /// Sends `body` about `request` to `leg` outside any attempt; its first answer, or none by
    /// `deadline_ms`, comes back as [`RouterOutput::Probed`].
    pub fn probe(&mut self, request: RequestId, leg: NodeId, body: Body, deadline_ms: u64, now_ms: u64) {
        self.outputs.push_back(RouterOutput::Send(Outbound {
            to: leg.clone(),
            request,
            budget_ms: deadline_ms.saturating_sub(now_ms),
            body,
        }));
        self.deadlines.insert((deadline_ms, request));
        self.probes.insert(request, Probe { leg, deadline_ms });
    }

    /// An envelope from `from` (incarnation `incarnation`, checked by the shell's door) about
    /// `request` arrived.
    pub fn handle_message(
        &mut self,
        from: &NodeId,
        incarnation: Incarnation,
        request: RequestId,
        body: Body,
        now_ms: u64,
    ) {
        match body {
            Body::Load(load) => {
                self.loads.insert(from.clone(), load);
            }
            Body::Tokens { tokens } => {
                let Some(ticket) = self
                    .running
                    .get(&request)
                    .filter(|attempt| attempt.machine.legs().1 == from)
                    .map(|attempt| attempt.ticket)
                else {
                    return;
                };
                // An attempt is running only until its outcome is taken (`drive` drops it), so
                // these tokens are the current attempt's.
                let Some(open) = self.open.get_mut(&ticket) else {
                    return;
                };
                // A retried request streams on from where the client is.
                let fresh = open.attempts.take_streamed(&tokens);
                if !fresh.is_empty() {
                    let tokens = fresh.to_vec();
                    self.outputs.push_back(RouterOutput::Tokens { ticket, tokens });
                }
            }
            body if self.probes.get(&request).is_some_and(|probe| probe.leg == *from) => {
                if let Some(probe) = self.probes.remove(&request) {
                    self.deadlines.remove(&(probe.deadline_ms, request));
                }
                self.outputs.push_back(RouterOutput::Probed {
                    request,
                    answer: ProbeAnswer::Answered(body),
                });
            }
            body => match self.running.get_mut(&request) {
                Some(attempt) => {
                    attempt.machine.handle_message(from, incarnation, body);
                    if !attempt.prefilled && attempt.machine.is_decoding() {
                        attempt.prefilled = true;
                        let ticket = attempt.ticket;
                        self.outputs
                            .push_back(RouterOutput::Prefilled { ticket, request });
                    }
                    self.drive(request, now_ms);
                }
                None => {
                    if let Body::KvReady(_) = body {
                        // A grant for an attempt that is over: free it now, not at lease end.
                        self.outputs.push_back(RouterOutput::Send(Outbound {
                            to: from.clone(),
                            request,
                            budget_ms: 0,
                            body: Body::Abort,
                        }));
                    }
                }
            },
        }
    }

    /// A message about `request` to `to` could not be sent (no link, link full or closed).
    pub fn handle_send_failed(&mut self, request: RequestId, to: &NodeId, fault: LinkFault, now_ms: u64) {
        if let Some(probe) = self.probes.remove(&request) {
            self.deadlines.remove(&(probe.deadline_ms, request));
            self.outputs.push_back(RouterOutput::Probed {
                request,
                answer: ProbeAnswer::Unreachable {
                    to: to.clone(),
                    fault,
                },
            });
            return;
        }
        if let Some(attempt) = self.running.get_mut(&request) {
            attempt.machine.handle_send_failed(to, fault);
            self.drive(request, now_ms);
        }
    }

    /// Time passed: attempts past their deadline fail (both legs told), probes past theirs
    /// end unanswered.
    pub fn handle_timeout(&mut self, now_ms: u64) {
        while let Some(&(at, request)) = self.deadlines.first() {
            if at > now_ms {
                break;
            }
            self.deadlines.pop_first();
            if self.probes.remove(&request).is_some() {
                self.outputs.push_back(RouterOutput::Probed {
                    request,
                    answer: ProbeAnswer::TimedOut,
                });
                continue;
            }
            if let Some(attempt) = self.running.get_mut(&request) {
                attempt.machine.handle_timeout(now_ms);
            }
            self.drive(request, now_ms);
        }
    }

    /// The earliest deadline of a running attempt or probe.
    pub fn poll_timeout(&self) -> Option<u64> {
        self.deadlines.first().map(|&(at, _)| at)
    }

    /// The next thing for the shell to carry out.
    pub fn poll_output(&mut self) -> Option<RouterOutput> {
        self.outputs.pop_front()
    }

    /// The leg of `role` the next attempt of `ticket` runs on: [`proxy::choose`] over the
    /// linked legs in name order, outside the legs earlier attempts failed on.
    fn pick(&mut self, role: Role, avoid: &[NodeId]) -> Option<(NodeId, Incarnation)> {
        let candidates: Vec<(&NodeId, &Leg)> = self.legs.iter().filter(|(_, leg)| leg.role == role).collect();
        let views: Vec<LegView> = candidates
            .iter()
            .map(|(node, leg)| {
                let report = self.loads.get(*node);
                LegView {
                    healthy: true,
                    in_flight: leg.in_flight,
                    reported: report.map_or(0, |load| u32::try_from(load.requests).unwrap_or(u32::MAX)),
                    kv_usage: report.map_or(0.0, |load| 1.0 - load.free_share()),
                }
            })
            .collect();
        let avoided: Vec<usize> = (0..candidates.len())
            .filter(|&index| avoid.contains(candidates[index].0))
            .collect();
        let turn = &mut self.turns[usize::from(role == Role::Decode)];
        let index = proxy::choose(&views, &avoided, self.policy, turn)?;
        let (node, leg) = candidates[index];
        Some((node.clone(), leg.incarnation))
    }

    /// Starts an attempt of `ticket` on legs it has not failed on, or ends it when none is left.
    fn start_attempt(&mut self, ticket: Ticket, now_ms: u64) {
        let Some(open) = self.open.get(&ticket) else {
            return;
        };
        let avoid = open.attempts.avoid().to_vec();
        let prefill = self.pick(Role::Prefill, &avoid);
        let decode = prefill.as_ref().and_then(|_| self.pick(Role::Decode, &avoid));
        let (Some(prefill), Some(decode)) = (prefill.clone(), decode) else {
            let role = if prefill.is_none() {
                Role::Prefill
            } else {
                Role::Decode
            };
            let answer = match self
                .open
                .get_mut(&ticket)
                .and_then(|open| open.last_failure.take())
            {
                Some((stage, reason)) => Answer::Failed { stage, reason },
                None => Answer::NoLeg { role, avoided: avoid },
            };
            return self.end(ticket, answer);
        };
        let request = self.new_request();
        let Some(open) = self.open.get_mut(&ticket) else {
            return;
        };
        open.current = Some(request);
        let wanted = &open.request;
        let machine = RouterMachine::new(
            request,
            wanted.prompt.to_vec(),
            wanted.max_tokens,
            prefill.clone(),
            decode.clone(),
            wanted.deadline_ms,
            now_ms,
        )
        .with_streaming(wanted.stream)
        .with_sampling(wanted.sampling.clone());
        let retries = open.attempts.retries();
        let deadline_ms = open.request.deadline_ms;
        for node in [&prefill.0, &decode.0] {
            if let Some(leg) = self.legs.get_mut(node) {
                leg.in_flight += 1;
            }
        }
        self.deadlines.insert((deadline_ms, request));
        let attempt = Running {
            machine,
            ticket,
            prefilled: false,
            deadline_ms,
        };
        self.running.insert(request, attempt);
        self.outputs.push_back(RouterOutput::Started {
            ticket,
            request,
            prefill: prefill.0,
            decode: decode.0,
            retries,
        });
        self.drive(request, now_ms);
    }

    /// Carries an attempt's commands into outputs; starts the next attempt or ends the client
    /// request when the attempt is over.
    fn drive(&mut self, request: RequestId, now_ms: u64) {
        let mut retry = None;
        while let Some(attempt) = self.running.get_mut(&request) {
            let Some(command) = attempt.machine.poll_command() else {
                break;
            };
            let ticket = attempt.ticket;
            match command {
                RouterCommand::Send { to, body } => {
                    self.outputs.push_back(RouterOutput::Send(Outbound {
                        to,
                        request,
                        budget_ms: attempt.deadline_ms.saturating_sub(now_ms),
                        body,
                    }));
                }
                RouterCommand::Complete(outcome) => {
                    let (prefill, decode) = attempt.machine.legs();
                    let (prefill, decode) = (prefill.clone(), decode.clone());
                    for node in [&prefill, &decode] {
                        if let Some(leg) = self.legs.get_mut(node) {
                            leg.in_flight = leg.in_flight.saturating_sub(1);
                        }
                    }
                    let Some(open) = self.open.get_mut(&ticket) else {
                        continue;
                    };
                    open.current = None;
                    match outcome {
                        RequestOutcome::Output(output) => {
                            self.end(ticket, Answer::Output { request, output })
                        }
                        RequestOutcome::Failed { stage, reason } => {
                            match open.attempts.retry_after(stage, &reason, &prefill, &decode) {
                                Some(lost) => {
                                    self.outputs.push_back(RouterOutput::Retrying {
                                        ticket,
                                        lost,
                                        stage,
                                        reason: reason.clone(),
                                    });
                                    open.last_failure = Some((stage, reason));
                                    retry = Some(ticket);
                                }
                                None => self.end(ticket, Answer::Failed { stage, reason }),
                            }
                        }
                    }
                }
            }
        }
        if let Some(attempt) = self.running.get(&request)
            && attempt.machine.is_done()
        {
            self.deadlines.remove(&(attempt.deadline_ms, request));
            self.running.remove(&request);
        }
        if let Some(ticket) = retry {
            self.start_attempt(ticket, now_ms);
        }
    }

    /// Ends `ticket` with `answer`.
    fn end(&mut self, ticket: Ticket, answer: Answer) {
        if let Some(open) = self.open.remove(&ticket)
            && let Some(client) = open.request.client
            && self.clients.get(&client) == Some(&ticket)
        {
            self.clients.remove(&client);
        }
        self.outputs.push_back(RouterOutput::Done { ticket, answer });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str) -> NodeId {
        NodeId(name.into())
    }

    /// A retried stream gives the client every token once: the new attempt's first tokens,
    /// which the client already has, are skipped, whatever batches they arrive in.
    #[test]
    fn a_retried_stream_neither_repeats_nor_skips_a_token() {
        let answer: Vec<u32> = (100..110).collect();
        for streamed_before in 0..=answer.len() {
            for batch in 1..=3 {
                let mut attempts = Attempts::new(1);
                let mut client = Vec::new();
                for chunk in answer[..streamed_before].chunks(batch) {
                    client.extend_from_slice(attempts.take_streamed(chunk));
                }
                let (p, d) = (node("prefill-0"), node("decode-0"));
                let lost = attempts.retry_after(Stage::Decode, &Failure::LegLost(d.clone()), &p, &d);
                assert_eq!(lost, Some(d));
                for chunk in answer.chunks(batch) {
                    client.extend_from_slice(attempts.take_streamed(chunk));
                }
                assert_eq!(
                    client, answer,
                    "streamed {streamed_before} before, batches of {batch}"
                );
                assert_eq!(attempts.streamed(), answer.len());
            }
        }
    }

    const P: Incarnation = Incarnation(11);
    const D: Incarnation = Incarnation(22);

    fn params(request: RequestId, prefill: &NodeId) -> crate::wire::KvParams {
        crate::wire::KvParams {
            request,
            prefill_node: prefill.clone(),
            prefill_incarnation: P,
            offer: crate::exchange::Offer {
                num_prompt_tokens: 3,
                groups: Vec::new(),
            },
            generations: Vec::new(),
            grant: crate::wire::GrantId(1),
            lease_ms: 1000,
        }
    }

    fn output(tokens: Vec<u32>) -> DecodeOutput {
        DecodeOutput {
            tokens,
            logits_digest: 7,
            read_bytes: 0,
            read_runs: 0,
            cached_blocks: 0,
            finish: crate::sampling::Finish::Length,
            logprobs: Vec::new(),
        }
    }

    fn ask(stream: bool, client: Option<u64>) -> ClientRequest {
        ClientRequest {
            prompt: vec![1, 2, 3].into(),
            max_tokens: 4,
            sampling: Sampling::default(),
            stream,
            deadline_ms: 1000,
            client,
        }
    }

    /// A dispatcher with prefill legs `p0, p1` and decode legs `d0, d1`.
    fn dispatcher(policy: Policy, max_retries: u32) -> Dispatcher {
        let mut dispatcher = Dispatcher::new(policy, max_retries, 100);
        for name in ["p0", "p1"] {
            dispatcher.set_leg(&node(name), Some((Role::Prefill, P)), 0);
        }
        for name in ["d0", "d1"] {
            dispatcher.set_leg(&node(name), Some((Role::Decode, D)), 0);
        }
        dispatcher
    }

    fn outputs(dispatcher: &mut Dispatcher) -> Vec<RouterOutput> {
        std::iter::from_fn(|| dispatcher.poll_output()).collect()
    }

    fn send(to: &str, request: u64, budget_ms: u64, body: Body) -> RouterOutput {
        RouterOutput::Send(Outbound {
            to: node(to),
            request: RequestId(request),
            budget_ms,
            body,
        })
    }

    fn started(ticket: u64, request: u64, prefill: &str, decode: &str, retries: u32) -> RouterOutput {
        RouterOutput::Started {
            ticket: Ticket(ticket),
            request: RequestId(request),
            prefill: node(prefill),
            decode: node(decode),
            retries,
        }
    }

    fn prefill_body() -> Body {
        Body::Prefill {
            prompt: vec![1, 2, 3],
            decode: node("d0"),
        }
    }

    /// A prefill leg lost mid-request: the request starts over under a new id on the other
    /// prefill leg, within the same deadline, and the client gets that attempt's answer.
    #[test]
    fn a_lost_prefill_leg_is_retried_on_another_under_a_new_id() {
        let mut dispatcher = dispatcher(Policy::RoundRobin, 1);
        let ticket = dispatcher.submit(ask(false, None), 10);
        assert_eq!(
            outputs(&mut dispatcher),
            vec![
                started(0, 100, "p0", "d0", 0),
                send("p0", 100, 990, prefill_body()),
            ]
        );
        dispatcher.set_leg(&node("p0"), None, 20);
        let out = outputs(&mut dispatcher);
        assert_eq!(
            out[..2],
            [
                send("d0", 100, 980, Body::Abort),
                RouterOutput::Retrying {
                    ticket,
                    lost: node("p0"),
                    stage: Stage::Prefill,
                    reason: Failure::LegLost(node("p0")),
                },
            ]
        );
        // Round robin over what is left: p1, and the decode leg after d0.
        assert_eq!(
            out[2..],
            [
                started(0, 101, "p1", "d1", 1),
                RouterOutput::Send(Outbound {
                    to: node("p1"),
                    request: RequestId(101),
                    budget_ms: 980,
                    body: Body::Prefill {
                        prompt: vec![1, 2, 3],
                        decode: node("d1"),
                    },
                }),
            ]
        );
        let p1 = node("p1");
        dispatcher.handle_message(
            &p1,
            P,
            RequestId(101),
            Body::KvReady(params(RequestId(101), &p1)),
            30,
        );
        let out = outputs(&mut dispatcher);
        assert_eq!(
            out[0],
            RouterOutput::Prefilled {
                ticket,
                request: RequestId(101)
            }
        );
        assert!(
            matches!(&out[1], RouterOutput::Send(Outbound { to, body: Body::Decode { .. }, .. }) if *to == node("d1"))
        );
        dispatcher.handle_message(&node("d1"), D, RequestId(101), Body::Output(output(vec![9])), 40);
        assert_eq!(
            outputs(&mut dispatcher),
            vec![RouterOutput::Done {
                ticket,
                answer: Answer::Output {
                    request: RequestId(101),
                    output: output(vec![9]),
                },
            }]
        );
        assert_eq!((dispatcher.open_requests(), dispatcher.running()), (0, 0));
        assert_eq!(dispatcher.poll_timeout(), None);
    }

    /// Through the dispatcher, a stream retried after its decode leg was lost gives the client
    /// each token once.
    #[test]
    fn a_retried_stream_through_the_dispatcher_repeats_no_token() {
        let mut dispatcher = dispatcher(Policy::RoundRobin, 1);
        let ticket = dispatcher.submit(ask(true, None), 0);
        let (p0, d0) = (node("p0"), node("d0"));
        dispatcher.handle_message(
            &p0,
            P,
            RequestId(100),
            Body::KvReady(params(RequestId(100), &p0)),
            1,
        );
        dispatcher.handle_message(&d0, D, RequestId(100), Body::Tokens { tokens: vec![5, 6] }, 2);
        dispatcher.set_leg(&d0, None, 3);
        outputs(&mut dispatcher);
        // The retry runs on p1 and d1 as request 101; its first two tokens were streamed.
        dispatcher.handle_message(
            &node("p1"),
            P,
            RequestId(101),
            Body::KvReady(params(RequestId(101), &node("p1"))),
            4,
        );
        // Tokens of the lost attempt that arrive late are not the client's.
        dispatcher.handle_message(&d0, D, RequestId(100), Body::Tokens { tokens: vec![7] }, 5);
        dispatcher.handle_message(
            &node("d1"),
            D,
            RequestId(101),
            Body::Tokens { tokens: vec![5] },
            5,
        );
        dispatcher.handle_message(
            &node("d1"),
            D,
            RequestId(101),
            Body::Tokens {
                tokens: vec![6, 7, 8],
            },
            6,
        );
        let streamed: Vec<u32> = outputs(&mut dispatcher)
            .into_iter()
            .filter_map(|out| match out {
                RouterOutput::Tokens { ticket: t, tokens } if t == ticket => Some(tokens),
                _ => None,
            })
            .flatten()
            .collect();
        assert_eq!(streamed, vec![7, 8]);
    }

    /// With no leg of a role, a request ends at once naming the role; after a failed attempt
    /// with no other leg left, it ends with that attempt's failure.
    #[test]
    fn no_leg_left_ends_the_request_with_the_last_failure() {
        let mut empty = Dispatcher::new(Policy::LeastLoaded, 2, 0);
        empty.set_leg(&node("p0"), Some((Role::Prefill, P)), 0);
        let ticket = empty.submit(ask(false, None), 0);
        assert_eq!(
            outputs(&mut empty),
            vec![RouterOutput::Done {
                ticket,
                answer: Answer::NoLeg {
                    role: Role::Decode,
                    avoided: Vec::new(),
                },
            }]
        );
        let mut one = Dispatcher::new(Policy::LeastLoaded, 2, 0);
        one.set_leg(&node("p0"), Some((Role::Prefill, P)), 0);
        one.set_leg(&node("d0"), Some((Role::Decode, D)), 0);
        let ticket = one.submit(ask(false, None), 0);
        one.handle_send_failed(RequestId(0), &node("p0"), LinkFault::Full, 1);
        let last = outputs(&mut one).pop();
        assert_eq!(
            last,
            Some(RouterOutput::Done {
                ticket,
                answer: Answer::Failed {
                    stage: Stage::Prefill,
                    reason: Failure::Unreachable {
                        to: node("p0"),
                        fault: LinkFault::Full,
                    },
                },
            })
        );
    }

    /// A grant for an attempt that is over is aborted at once; one from a stale incarnation of
    /// a leg the attempt runs on too.
    #[test]
    fn a_late_grant_is_aborted() {
        let mut dispatcher = dispatcher(Policy::RoundRobin, 0);
        let p0 = node("p0");
        dispatcher.handle_message(
            &p0,
            P,
            RequestId(55),
            Body::KvReady(params(RequestId(55), &p0)),
            0,
        );
        assert_eq!(outputs(&mut dispatcher), vec![send("p0", 55, 0, Body::Abort)]);
        dispatcher.submit(ask(false, None), 0);
        outputs(&mut dispatcher);
        dispatcher.handle_message(
            &p0,
            Incarnation(99),
            RequestId(100),
            Body::KvReady(params(RequestId(100), &p0)),
            0,
        );
        assert_eq!(outputs(&mut dispatcher), vec![send("p0", 100, 1000, Body::Abort)]);
    }

    /// A cancelled client ends its current attempt, both legs told; the deadline of another
    /// fails it the same way, and a probe past its deadline ends unanswered.
    #[test]
    fn cancel_deadline_and_probe_end_what_they_name() {
        let mut dispatcher = dispatcher(Policy::RoundRobin, 3);
        let cancelled = dispatcher.submit(ask(false, Some(42)), 0);
        let late = dispatcher.submit(
            ClientRequest {
                deadline_ms: 50,
                ..ask(false, None)
            },
            0,
        );
        outputs(&mut dispatcher);
        assert!(dispatcher.cancel(42, 5));
        assert!(!dispatcher.cancel(42, 5), "the request is over");
        let out = outputs(&mut dispatcher);
        assert_eq!(
            out[..2],
            [
                send("p0", 100, 995, Body::Abort),
                send("d0", 100, 995, Body::Abort)
            ]
        );
        assert_eq!(
            out[2],
            RouterOutput::Done {
                ticket: cancelled,
                answer: Answer::Failed {
                    stage: Stage::Router,
                    reason: Failure::Cancelled,
                },
            }
        );
        let probe = dispatcher.new_request();
        dispatcher.probe(probe, node("d1"), Body::Abort, 70, 5);
        assert_eq!(
            outputs(&mut dispatcher),
            vec![send("d1", probe.0, 65, Body::Abort)]
        );
        assert_eq!(dispatcher.poll_timeout(), Some(50));
        dispatcher.handle_timeout(49);
        assert!(outputs(&mut dispatcher).is_empty());
        dispatcher.handle_timeout(70);
        let out = outputs(&mut dispatcher);
        // The deadline is not retried: a later attempt could not finish either.
        assert_eq!(
            out[2],
            RouterOutput::Done {
                ticket: late,
                answer: Answer::Failed {
                    stage: Stage::Prefill,
                    reason: Failure::DeadlinePassed,
                },
            }
        );
        assert_eq!(
            out[3],
            RouterOutput::Probed {
                request: probe,
                answer: ProbeAnswer::TimedOut,
            }
        );
        assert_eq!(
            (
                dispatcher.open_requests(),
                dispatcher.running(),
                dispatcher.poll_timeout()
            ),
            (0, 0, None)
        );
    }

    /// `least_loaded` counts this router's attempts in flight and the legs' own reports.
    #[test]
    fn least_loaded_spreads_over_attempts_in_flight_and_reports() {
        let mut dispatcher = dispatcher(Policy::LeastLoaded, 0);
        dispatcher.submit(ask(false, None), 0);
        dispatcher.submit(ask(false, None), 0);
        let legs: Vec<(NodeId, NodeId)> = outputs(&mut dispatcher)
            .into_iter()
            .filter_map(|out| match out {
                RouterOutput::Started { prefill, decode, .. } => Some((prefill, decode)),
                _ => None,
            })
            .collect();
        assert_eq!(legs, vec![(node("p0"), node("d0")), (node("p1"), node("d1"))]);
        // p1 reports five requests (other routers'): the next two go to p0.
        let load = LegLoad {
            requests: 5,
            ..LegLoad::default()
        };
        dispatcher.handle_message(&node("p1"), P, RequestId(0), Body::Load(load), 0);
        dispatcher.submit(ask(false, None), 0);
        dispatcher.submit(ask(false, None), 0);
        let prefills: Vec<NodeId> = outputs(&mut dispatcher)
            .into_iter()
            .filter_map(|out| match out {
                RouterOutput::Started { prefill, .. } => Some(prefill),
                _ => None,
            })
            .collect();
        assert_eq!(prefills, vec![node("p0"), node("p0")]);
    }

    #[test]
    fn retries_avoid_each_failed_leg_and_stop_at_the_bound() {
        let (p0, p1, d) = (node("prefill-0"), node("prefill-1"), node("decode-0"));
        let mut attempts = Attempts::new(2);
        let lost = Failure::LegLost(p0.clone());
        assert_eq!(
            attempts.retry_after(Stage::Prefill, &lost, &p0, &d),
            Some(p0.clone())
        );
        let refused = Failure::Refused {
            node: p1.clone(),
            reason: crate::wire::RefusalReason::Draining,
        };
        assert_eq!(
            attempts.retry_after(Stage::Prefill, &refused, &p1, &d),
            Some(p1.clone())
        );
        assert_eq!(attempts.avoid(), &[p0.clone(), p1.clone()]);
        assert_eq!(attempts.retries(), 2);
        // No retry left.
        assert_eq!(attempts.retry_after(Stage::Prefill, &lost, &p0, &d), None);
        // A failure the policy does not retry uses none.
        let mut fresh = Attempts::new(3);
        assert_eq!(
            fresh.retry_after(Stage::Decode, &Failure::Cancelled, &p0, &d),
            None
        );
        assert_eq!(fresh.retries(), 0);
        assert!(fresh.avoid().is_empty());
    }
}
