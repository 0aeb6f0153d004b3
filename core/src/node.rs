//! A leg as one sans-IO object: [`LegNode`] is to the leg's request machines what quinn-proto's
//! `Endpoint` is to its `Connection`s.
//!
//! It owns everything a leg shares between its requests: the [`Allocator`], the one
//! [`GrantTable`] (behind a shared handle, because a network memory server checks READs against
//! the same table), the request machines of [`crate::leg`], the tombstones of requests it started
//! or saw aborted, the role table (which message a leg of its role accepts, and from whom), the
//! bound on requests waiting for blocks, draining, and lease expiry. Allocator and grant-table
//! calls happen inside it, synchronously: a machine's `Allocate`, `ReleaseWindow`, `Grant`,
//! `Revoke` and `Finish` never leave the node.
//!
//! What the node cannot do itself comes out of [`LegNode::poll_output`], in order: messages to
//! send, prompts to compute, READs to run, generations to run or stop, and blocks freed (whose
//! new generations a shell publishes before it carries out anything after them, so a reader's
//! generation check sees a block freed before it can be reused). Inputs are `handle_*`; time
//! comes in as `now_ms` from any monotonic millisecond clock the shell owns, and
//! [`LegNode::poll_timeout`] says when to call [`LegNode::handle_timeout`] next.
//!
//! The shipped scheduler actor and the simulation (`crate::testing`) both drive this object, so
//! the simulation checks the rules that ship.
//!
//! Non-goals: moving bytes, computing tokens, links and peers' hellos (the shell's exchange
//! checks who a sender is before a message reaches the node).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::allocator::{AllocError, Allocation, Allocator, FreedBlock};
use crate::block::BlockId;
use crate::exchange::Pairing;
use crate::grant::{GrantError, GrantTable};
use crate::leg::{
    DecodeCommand, DecodeMachine, Generated, GenerationCheck, IssuedGrant, LegConfig, PrefillCommand,
    PrefillMachine, ReadDone,
};
use crate::sampling::Sampling;
use crate::wire::{
    Body, Envelope, Failure, GrantId, Incarnation, LegLoad, NodeId, ParamsError, RefusalReason, RequestId,
    Role, Stage,
};

/// Requests a leg remembers having started or seen aborted, so that a duplicated or late
/// request for one is refused instead of computed again. Each costs about 40 bytes: 640 KiB.
pub const TOMBSTONES_REMEMBERED: usize = 16384;

/// Why a node refused a peer or an envelope. The shell's door (link checks) and the node (the
/// leg's rules) refuse with the same type; a link's sender learns it in its log.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// The sender never said hello to this node.
    #[error("{0} is not a known peer of this node")]
    UnknownPeer(NodeId),
    /// The envelope names another sender than the link's peer.
    #[error("envelope claims to come from {claimed}, but arrived on the link of {peer}")]
    Impersonation {
        /// The link's peer.
        peer: NodeId,
        /// The sender the envelope names.
        claimed: NodeId,
    },
    /// The envelope comes from an incarnation of the peer this node does not know (a restarted
    /// node, or a forged one).
    #[error("{node} incarnation {got} is not the incarnation {known} that said hello")]
    StaleIncarnation {
        /// The peer.
        node: NodeId,
        /// The incarnation the envelope names.
        got: Incarnation,
        /// The incarnation the peer said hello with.
        known: Incarnation,
    },
    /// A peer sent a message only another role may send (a decode leg asking for a prefill, …).
    #[error("{node} may not send {body}: only a {expected} may")]
    WrongSender {
        /// The sender.
        node: NodeId,
        /// The message kind.
        body: &'static str,
        /// The role that may send it.
        expected: Role,
    },
    /// A grant renewal or release was refused (unknown, ended, another peer's, another
    /// incarnation's grant).
    #[error("{node}: {detail}")]
    Grant {
        /// This node.
        node: NodeId,
        /// The grant table's refusal.
        detail: String,
    },
    /// A grant renewal or release names a grant another incarnation of this node issued (it
    /// restarted since): its grant ids mean nothing here.
    #[error("{node}: the grant was issued by incarnation {issuer}, this node is incarnation {mine}")]
    ForeignGrant {
        /// This node.
        node: NodeId,
        /// The incarnation the message names.
        issuer: Incarnation,
        /// This node's incarnation.
        mine: Incarnation,
    },
    /// The message is about a request this node does not run.
    #[error("{node} runs no request {request}")]
    UnknownRequest {
        /// This node.
        node: NodeId,
        /// The request.
        request: RequestId,
    },
    /// The message contradicts itself (kv params for another request, …).
    #[error("{node}: bad message: {detail}")]
    BadMessage {
        /// This node.
        node: NodeId,
        /// What is wrong.
        detail: String,
    },
    /// The request was aborted before this message arrived (it was reordered past the abort).
    #[error("{node}: {request} was aborted")]
    Aborted {
        /// This node.
        node: NodeId,
        /// The request.
        request: RequestId,
    },
    /// The request already started here: the message is a duplicate or came late.
    #[error("{node}: {request} already started here (a duplicated or late message)")]
    Duplicate {
        /// This node.
        node: NodeId,
        /// The request.
        request: RequestId,
    },
    /// The peers cannot work together (protocol, layout, names).
    #[error("incompatible peer: {0}")]
    Incompatible(String),
    /// The message does not belong at this node (a decode request at a prefill leg, …).
    #[error("{node} ({what}) does not accept {body}")]
    Misrouted {
        /// This node.
        node: NodeId,
        /// What this node is.
        what: String,
        /// The message kind.
        body: &'static str,
    },
    /// The node cannot take the message now (draining, or its shell's mailboxes are full).
    #[error("{node} is busy: {detail}")]
    Busy {
        /// This node.
        node: NodeId,
        /// Why.
        detail: String,
    },
}

/// The role that alone may send a message of this kind to a leg.
pub fn sender_role(body: &Body) -> Role {
    match body {
        Body::Prefill { .. } | Body::Decode { .. } | Body::Abort => Role::Router,
        Body::Renew { .. } | Body::Release { .. } => Role::Decode,
        Body::Renewed { .. } => Role::Prefill,
        // Answers go to the router, never to a leg: a leg refuses them as misrouted.
        Body::KvReady(_) | Body::Output(_) | Body::Failed { .. } | Body::Load(_) | Body::Tokens { .. } => {
            Role::Router
        }
    }
}

/// Whether a leg of `role` takes a message of this kind at all.
pub fn leg_accepts(role: Role, body: &Body) -> bool {
    match body {
        Body::Prefill { .. } | Body::Renew { .. } | Body::Release { .. } => role == Role::Prefill,
        Body::Decode { .. } | Body::Renewed { .. } => role == Role::Decode,
        Body::Abort => matches!(role, Role::Prefill | Role::Decode),
        Body::KvReady(_) | Body::Output(_) | Body::Failed { .. } | Body::Load(_) | Body::Tokens { .. } => {
            false
        }
    }
}

/// What the node needs beyond its machines' [`LegConfig`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeConfig {
    /// What the request machines know about the leg.
    pub leg: LegConfig,
    /// Prefill or decode.
    pub role: Role,
    /// Lease of every grant this leg issues.
    pub lease_ms: u64,
    /// Most requests that may wait for free blocks at once; one more fails at once.
    pub wait_queue: usize,
}

/// A message the node sends about a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outbound {
    /// The receiving node.
    pub to: NodeId,
    /// The request.
    pub request: RequestId,
    /// Milliseconds of the request's deadline left now.
    pub budget_ms: u64,
    /// What it says.
    pub body: Body,
}

/// What the node asks its shell to do, drained in order from [`LegNode::poll_output`].
#[derive(Debug, Clone, PartialEq)]
pub enum NodeOutput {
    /// Send a message.
    Send(Outbound),
    /// Blocks were freed, with their new generations: publish them where readers check
    /// generations before carrying out any later output.
    Freed(Vec<FreedBlock>),
    /// Compute the first `tokens` prompt tokens into `lists`; answer with
    /// [`LegNode::handle_computed`].
    Compute {
        /// The request.
        request: RequestId,
        /// Its prompt.
        prompt: Arc<[u32]>,
        /// Its blocks per group.
        lists: Vec<Vec<BlockId>>,
        /// Tokens to compute.
        tokens: u64,
    },
    /// READ the paired blocks from `prefill` under `grant` and check every source's generation
    /// after the copy; answer with [`LegNode::handle_read_done`].
    Read {
        /// The request.
        request: RequestId,
        /// The prefill leg holding the KV.
        prefill: NodeId,
        /// The incarnation of the prefill leg that issued the grant.
        issuer: Incarnation,
        /// The grant.
        grant: GrantId,
        /// Block pairs per group.
        pairing: Pairing,
        /// Generations to verify after the copy.
        checks: Vec<GenerationCheck>,
    },
    /// Recompute the last prompt token and decode up to `max_tokens` tokens; answer with
    /// [`LegNode::handle_generated`]. While it runs, more slots come from [`LegNode::extend`]
    /// and window blocks that fell out of the window go back through
    /// [`LegNode::release_window`].
    Generate {
        /// The request.
        request: RequestId,
        /// Its prompt.
        prompt: Arc<[u32]>,
        /// Its blocks per group.
        lists: Vec<Vec<BlockId>>,
        /// Token slots allocated.
        slots: u64,
        /// Tokens to generate.
        max_tokens: u32,
        /// When to stop, between tokens.
        deadline_ms: u64,
        /// How tokens are chosen and when generation stops early.
        sampling: Sampling,
        /// The router to stream each token to, for a streaming request.
        stream_to: Option<NodeId>,
    },
    /// A grant's lease lapsed and its blocks were unpinned: the reader it was for renewed too
    /// late or never released it (log it; count it).
    LeaseExpired {
        /// The grant.
        grant: GrantId,
        /// Its request.
        request: RequestId,
        /// The peer that held it (`None`: nobody claimed it).
        peer: Option<NodeId>,
    },
    /// Stop the request's generation at its next token and answer
    /// [`LegNode::handle_generated`] then.
    StopGenerating {
        /// The request.
        request: RequestId,
    },
}

/// How a remembered request was seen here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tombstone {
    /// It started here (and may have ended).
    Started,
    /// It was aborted before it started here.
    Aborted,
}

/// Requests a leg remembers, oldest dropped first past [`TOMBSTONES_REMEMBERED`].
#[derive(Debug, Default)]
struct Tombstones {
    order: VecDeque<RequestId>,
    how: HashMap<RequestId, Tombstone>,
}

impl Tombstones {
    /// Remembers how `request` was first seen here: a request that started and was aborted
    /// later stays `Started` (a copy of it is a duplicate, whatever came between).
    fn remember(&mut self, request: RequestId, how: Tombstone) {
        if self.how.contains_key(&request) {
            return;
        }
        self.how.insert(request, how);
        self.order.push_back(request);
        if self.order.len() > TOMBSTONES_REMEMBERED
            && let Some(oldest) = self.order.pop_front()
        {
            self.how.remove(&oldest);
        }
    }

    fn get(&self, request: RequestId) -> Option<Tombstone> {
        self.how.get(&request).copied()
    }
}

#[derive(Debug)]
enum Machine {
    Prefill(PrefillMachine),
    Decode(DecodeMachine),
}

impl Machine {
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

    fn poll_command(&mut self) -> Option<Command> {
        match self {
            Machine::Prefill(machine) => machine.poll_command().map(Command::Prefill),
            Machine::Decode(machine) => machine.poll_command().map(Command::Decode),
        }
    }

    fn handle_abort(&mut self) {
        match self {
            Machine::Prefill(machine) => machine.handle_abort(),
            Machine::Decode(machine) => machine.handle_abort(),
        }
    }

    fn router(&self) -> &NodeId {
        match self {
            Machine::Prefill(machine) => machine.router(),
            Machine::Decode(machine) => machine.router(),
        }
    }

    fn handle_timeout(&mut self, now_ms: u64) {
        match self {
            Machine::Prefill(machine) => machine.handle_timeout(now_ms),
            Machine::Decode(machine) => machine.handle_timeout(now_ms),
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
}

/// One request on this leg: its machine and what the node keeps for it.
#[derive(Debug)]
struct Job {
    machine: Machine,
    prompt: Arc<[u32]>,
    /// The request's blocks per group, as the allocator last listed them.
    lists: Vec<Vec<BlockId>>,
    deadline_ms: u64,
    /// The router to stream generated tokens to (a streaming decode request).
    stream_to: Option<NodeId>,
}

/// One leg: its allocator, grant table, request machines and the rules between them.
#[derive(Debug)]
pub struct LegNode {
    config: NodeConfig,
    allocator: Allocator,
    grants: Arc<Mutex<GrantTable>>,
    /// Ordered by request so a simulation replays the same way (a request id is unique here).
    jobs: BTreeMap<RequestId, Job>,
    tombstones: Tombstones,
    draining: bool,
    outputs: VecDeque<NodeOutput>,
    /// Refusals of the node's own allocator or grant table that the machines' rules say cannot
    /// happen (a request finished twice, an unpin of blocks never pinned): bugs, kept for the
    /// shell to log and the simulation to count as violations. Bounded by [`MAX_ANOMALIES`].
    anomalies: VecDeque<String>,
}

/// Most anomalies a node keeps before the oldest is dropped.
pub const MAX_ANOMALIES: usize = 64;

impl LegNode {
    /// A leg over `allocator` issuing grants into `grants` (shared with whoever checks READs
    /// against it).
    pub fn new(config: NodeConfig, allocator: Allocator, grants: Arc<Mutex<GrantTable>>) -> Self {
        LegNode {
            config,
            allocator,
            grants,
            jobs: BTreeMap::new(),
            tombstones: Tombstones::default(),
            draining: false,
            outputs: VecDeque::new(),
            anomalies: VecDeque::new(),
        }
    }

    /// The next anomaly: a refusal of the node's own allocator or grant table that its rules
    /// say cannot happen (a bug to log, never a peer's fault).
    pub fn poll_anomaly(&mut self) -> Option<String> {
        self.anomalies.pop_front()
    }

    fn anomaly(&mut self, what: String) {
        if self.anomalies.len() >= MAX_ANOMALIES {
            self.anomalies.pop_front();
        }
        self.anomalies.push_back(what);
    }

    /// The leg's name.
    pub fn node(&self) -> &NodeId {
        &self.config.leg.node
    }

    /// The leg's role.
    pub fn role(&self) -> Role {
        self.config.role
    }

    /// What the leg's machines know about it.
    pub fn leg_config(&self) -> &LegConfig {
        &self.config.leg
    }

    /// The one grant table, shared with a network memory server's authorizer.
    pub fn grant_table(&self) -> Arc<Mutex<GrantTable>> {
        self.grants.clone()
    }

    fn table(&self) -> MutexGuard<'_, GrantTable> {
        // A panic while holding the lock cannot leave the table half-changed: every method
        // changes it in one step.
        self.grants.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The next thing the shell must do, in order.
    pub fn poll_output(&mut self) -> Option<NodeOutput> {
        self.outputs.pop_front()
    }

    /// When the shell must call [`Self::handle_timeout`] next: the earliest machine timer or
    /// lease expiry.
    pub fn poll_timeout(&self) -> Option<u64> {
        let machines = self
            .jobs
            .values()
            .filter_map(|job| job.machine.poll_timeout())
            .min();
        let leases = self.table().poll_timeout();
        [machines, leases].into_iter().flatten().min()
    }

    /// Requests running here.
    pub fn num_jobs(&self) -> usize {
        self.jobs.len()
    }

    /// Whether new requests are refused.
    pub fn is_draining(&self) -> bool {
        self.draining
    }

    /// Stop taking new requests: those in flight run to their end; new ones are refused at
    /// once, with a failure the router may retry elsewhere.
    pub fn drain(&mut self) {
        self.draining = true;
    }

    /// How loaded the leg is: what routers are told and leak checks read.
    pub fn load(&self) -> LegLoad {
        let groups = self.config.leg.layout.groups().len();
        LegLoad {
            requests: self.allocator.num_requests() as u64,
            grants: self.table().len() as u64,
            free_blocks: (0..groups)
                .map(|group| self.allocator.free_blocks(group) as u64)
                .collect(),
            capacity: (0..groups)
                .map(|group| u64::from(self.allocator.capacity(group)))
                .collect(),
        }
    }

    /// Whether nothing is held: no request, no grant, every block free.
    pub fn is_idle(&self) -> bool {
        self.jobs.is_empty() && self.allocator.is_idle() && self.table().is_empty()
    }

    /// Current generation of a block (what a reader's check compares against).
    pub fn generation(&self, group: usize, block: BlockId) -> Option<u32> {
        self.allocator.generation(group, block)
    }

    /// A message from `from_role` arrived (its sender already checked by the shell's door).
    /// Starts or feeds the request's machine, answers grant renewals and releases, and refuses
    /// what this leg does not take: the wrong sender or leg, a duplicate or late request, a
    /// request after its abort, a request while draining, a contradictory message.
    pub fn handle_envelope(
        &mut self,
        from_role: Role,
        envelope: Envelope,
        now_ms: u64,
    ) -> Result<(), Refusal> {
        let result = self.receive(from_role, envelope, now_ms);
        self.settle(now_ms);
        result
    }

    fn receive(&mut self, from_role: Role, envelope: Envelope, now_ms: u64) -> Result<(), Refusal> {
        let Envelope {
            request,
            from,
            budget_ms,
            body,
            ..
        } = envelope;
        let expected = sender_role(&body);
        if from_role != expected {
            return Err(Refusal::WrongSender {
                node: from,
                body: body.kind(),
                expected,
            });
        }
        if !leg_accepts(self.config.role, &body) {
            return Err(Refusal::Misrouted {
                node: self.node().clone(),
                what: format!("a {} leg", self.config.role),
                body: body.kind(),
            });
        }
        let deadline_ms = now_ms.saturating_add(budget_ms);
        if matches!(body, Body::Prefill { .. } | Body::Decode { .. }) {
            self.admit(request, &from, budget_ms, &body)?;
        }
        match body {
            Body::Prefill { prompt, decode } => {
                let prompt_arc: Arc<[u32]> = prompt.clone().into();
                let machine = PrefillMachine::new(
                    self.config.leg.clone(),
                    request,
                    from,
                    prompt,
                    decode,
                    deadline_ms,
                    now_ms,
                );
                self.start(
                    request,
                    Machine::Prefill(machine),
                    prompt_arc,
                    deadline_ms,
                    None,
                    now_ms,
                );
                Ok(())
            }
            Body::Decode {
                prompt,
                params,
                max_tokens,
                stream,
                sampling,
            } => {
                let prompt: Arc<[u32]> = prompt.into();
                let stream_to = stream.then(|| from.clone());
                let machine = DecodeMachine::new(
                    self.config.leg.clone(),
                    from,
                    params,
                    prompt.len() as u64,
                    max_tokens,
                    deadline_ms,
                    now_ms,
                )
                .with_sampling(sampling);
                self.start(
                    request,
                    Machine::Decode(machine),
                    prompt,
                    deadline_ms,
                    stream_to,
                    now_ms,
                );
                Ok(())
            }
            Body::Renew { grant, issuer } => {
                self.issued_here(issuer)?;
                let renewed = self.table().renew(grant, &from, now_ms);
                renewed.map_err(|error| self.grant_refusal(error))?;
                let lease_ms = self.config.lease_ms;
                self.outputs.push_back(NodeOutput::Send(Outbound {
                    to: from,
                    request,
                    budget_ms,
                    body: Body::Renewed { grant, lease_ms },
                }));
                Ok(())
            }
            Body::Release { grant, issuer } => {
                self.issued_here(issuer)?;
                let released = self.table().release(grant, &from);
                // A leg's grants admit one reader: its release ends the grant.
                if let Some(grant) = released.map_err(|error| self.grant_refusal(error))? {
                    self.unpin(&grant.blocks);
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
                        node: self.node().clone(),
                        request,
                    });
                };
                if machine.grant() == grant {
                    machine.handle_renewed(lease_ms, now_ms);
                }
                self.drive(request, now_ms);
                Ok(())
            }
            Body::Abort => {
                // A finished prefill's grant outlives its machine: free it here.
                if self.config.role == Role::Prefill {
                    self.revoke_request(request);
                }
                match self.jobs.get_mut(&request) {
                    Some(job) => job.machine.handle_abort(),
                    None => self.tombstones.remember(request, Tombstone::Aborted),
                }
                self.drive(request, now_ms);
                Ok(())
            }
            // `leg_accepts` refused every other kind above.
            Body::KvReady(_)
            | Body::Output(_)
            | Body::Failed { .. }
            | Body::Load(_)
            | Body::Tokens { .. } => Ok(()),
        }
    }

    /// Whether a new request may start here: not while draining, not twice, not after its
    /// abort, not with sampling or parameters that contradict it. A refused request whose
    /// router waits on it is also told so as a failure naming the stage.
    fn admit(
        &mut self,
        request: RequestId,
        from: &NodeId,
        budget_ms: u64,
        body: &Body,
    ) -> Result<(), Refusal> {
        let stage = match body {
            Body::Prefill { .. } => Stage::Prefill,
            _ => Stage::Decode,
        };
        let node = self.node().clone();
        match self.tombstones.get(request) {
            Some(Tombstone::Aborted) => return Err(Refusal::Aborted { node, request }),
            Some(Tombstone::Started) => return Err(Refusal::Duplicate { node, request }),
            // A live job whose tombstone was evicted by 16384 newer requests.
            None if self.jobs.contains_key(&request) => return Err(Refusal::Duplicate { node, request }),
            None => {}
        }
        let refusal = if self.draining {
            let reason = RefusalReason::Draining;
            let failure = Failure::Refused {
                node: node.clone(),
                reason,
            };
            Some((
                failure,
                Refusal::Busy {
                    node,
                    detail: reason.to_string(),
                },
            ))
        } else if let Body::Decode { params, sampling, .. } = body {
            let error = if let Err(error) = sampling.check() {
                Some(ParamsError::Sampling(error))
            } else if params.request != request {
                Some(ParamsError::ForAnotherRequest {
                    params: params.request,
                    message: request,
                })
            } else {
                None
            };
            error.map(|error| {
                let detail = error.to_string();
                (Failure::BadParams(error), Refusal::BadMessage { node, detail })
            })
        } else {
            None
        };
        let Some((failure, refusal)) = refusal else {
            return Ok(());
        };
        self.outputs.push_back(NodeOutput::Send(Outbound {
            to: from.clone(),
            request,
            budget_ms,
            body: Body::Failed {
                stage,
                reason: failure,
            },
        }));
        Err(refusal)
    }

    /// A renewal or release names the incarnation that issued the grant; another one's grant
    /// ids mean nothing here.
    fn issued_here(&self, issuer: Incarnation) -> Result<(), Refusal> {
        let mine = self.config.leg.incarnation;
        if issuer == mine {
            return Ok(());
        }
        Err(Refusal::ForeignGrant {
            node: self.node().clone(),
            issuer,
            mine,
        })
    }

    fn grant_refusal(&self, error: GrantError) -> Refusal {
        Refusal::Grant {
            node: self.node().clone(),
            detail: error.to_string(),
        }
    }

    fn start(
        &mut self,
        request: RequestId,
        machine: Machine,
        prompt: Arc<[u32]>,
        deadline_ms: u64,
        stream_to: Option<NodeId>,
        now_ms: u64,
    ) {
        self.tombstones.remember(request, Tombstone::Started);
        let job = Job {
            machine,
            prompt,
            lists: Vec::new(),
            deadline_ms,
            stream_to,
        };
        self.jobs.insert(request, job);
        self.drive(request, now_ms);
    }

    /// The KV parameters of `request` could not be sent to its router (the link is down or
    /// full): nobody will hear of the grant, so it is revoked now, not at lease end.
    pub fn handle_kv_ready_undeliverable(&mut self, request: RequestId, now_ms: u64) {
        self.revoke_request(request);
        self.settle(now_ms);
    }

    /// The link to `peer` was lost (it stopped, restarted or is cut off). Every grant `peer`
    /// holds is revoked at once, not at lease end (a READ of it still running fails its
    /// generation check, and the router starts the request over). When `peer` is a router, the
    /// requests it asked for are aborted: nobody is left to answer. A request whose other leg is
    /// `peer` runs on: its router decides (it aborts what it lost, and retries), and this leg
    /// cannot tell a dead leg from a link cut between two legs only.
    pub fn handle_peer_lost(&mut self, peer: &NodeId, now_ms: u64) {
        let held = self.table().held_by(peer);
        for grant in held {
            self.revoke(grant);
        }
        let involved: Vec<RequestId> = self
            .jobs
            .iter()
            .filter(|(_, job)| job.machine.router() == peer)
            .map(|(&request, _)| request)
            .collect();
        for request in involved {
            if self.config.role == Role::Prefill {
                self.revoke_request(request);
            }
            if let Some(job) = self.jobs.get_mut(&request) {
                job.machine.handle_abort();
            }
            self.drive(request, now_ms);
        }
        self.settle(now_ms);
    }

    /// The prompt computation of `request` ended.
    pub fn handle_computed(&mut self, request: RequestId, result: Result<(), Failure>, now_ms: u64) {
        self.with_prefill(request, |machine| machine.handle_computed(result, now_ms));
        self.drive(request, now_ms);
        self.settle(now_ms);
    }

    /// The READ of `request` ended: complete and verified, or failed (a partial READ is a
    /// failure).
    pub fn handle_read_done(&mut self, request: RequestId, result: Result<ReadDone, Failure>, now_ms: u64) {
        self.with_decode(request, |machine| machine.handle_read_done(result, now_ms));
        self.drive(request, now_ms);
        self.settle(now_ms);
    }

    /// The generation of `request` ended (or stopped when told to).
    pub fn handle_generated(&mut self, request: RequestId, result: Result<Generated, Failure>, now_ms: u64) {
        self.with_decode(request, |machine| machine.handle_generated(result));
        self.drive(request, now_ms);
        self.settle(now_ms);
    }

    /// A running generation needs `slots` token slots: the request's lists, grown.
    pub fn extend(
        &mut self,
        request: RequestId,
        slots: u64,
        now_ms: u64,
    ) -> Result<Vec<Vec<BlockId>>, AllocError> {
        let result = self.allocator.extend(request, slots).map(<[_]>::to_vec);
        self.keep_lists(request, &result);
        self.settle(now_ms);
        result
    }

    /// A running generation's window moved to `attending_token`: window blocks it no longer
    /// sees are freed; the request's lists come back.
    pub fn release_window(
        &mut self,
        request: RequestId,
        attending_token: u64,
        now_ms: u64,
    ) -> Result<Vec<Vec<BlockId>>, AllocError> {
        let result = self.release_window_lists(request, attending_token);
        self.keep_lists(request, &result);
        self.settle(now_ms);
        result
    }

    fn release_window_lists(
        &mut self,
        request: RequestId,
        attending_token: u64,
    ) -> Result<Vec<Vec<BlockId>>, AllocError> {
        self.allocator.release_window(request, attending_token)?;
        self.allocator
            .blocks(request)
            .map(<[_]>::to_vec)
            .ok_or(AllocError::UnknownRequest(request))
    }

    /// Blocks for a request run on this leg alone, outside the protocol (the reference a P/D
    /// answer is checked against). The caller retries an [`AllocError::OutOfBlocks`] after
    /// blocks are freed, and ends the run with [`Self::finish_direct`].
    pub fn allocate_direct(
        &mut self,
        request: RequestId,
        prompt: &[u32],
        slots: u64,
        now_ms: u64,
    ) -> Result<Allocation, AllocError> {
        if self.jobs.contains_key(&request) {
            return Err(AllocError::DuplicateRequest(request));
        }
        let result = self.allocator.allocate(request, prompt, slots, None);
        self.settle(now_ms);
        result
    }

    /// A direct run is over: its blocks go back.
    pub fn finish_direct(&mut self, request: RequestId, now_ms: u64) -> Result<(), AllocError> {
        if self.jobs.contains_key(&request) {
            return Err(AllocError::UnknownRequest(request));
        }
        let result = self.allocator.finish(request, None);
        self.settle(now_ms);
        result
    }

    /// Time passed: lapsed leases unpin their blocks; machines whose timer is due act (renew a
    /// lease, give up a wait for blocks).
    pub fn handle_timeout(&mut self, now_ms: u64) {
        let expired = self.table().expire(now_ms);
        for grant in expired {
            self.unpin(&grant.blocks);
            self.outputs.push_back(NodeOutput::LeaseExpired {
                grant: grant.id,
                request: grant.request,
                peer: grant.holders.into_iter().next(),
            });
        }
        let due: Vec<RequestId> = self
            .jobs
            .iter()
            .filter(|(_, job)| job.machine.poll_timeout().is_some_and(|at| at <= now_ms))
            .map(|(&request, _)| request)
            .collect();
        for request in due {
            if let Some(job) = self.jobs.get_mut(&request) {
                job.machine.handle_timeout(now_ms);
            }
            self.drive(request, now_ms);
        }
        self.settle(now_ms);
    }

    /// Ends every grant issued for `request` and unpins its blocks.
    fn revoke_request(&mut self, request: RequestId) {
        let grants = self.table().grants_of(request);
        for grant in grants {
            self.revoke(grant);
        }
    }

    fn revoke(&mut self, grant: GrantId) {
        let revoked = self.table().revoke(grant);
        if let Some(grant) = revoked {
            self.unpin(&grant.blocks);
        }
    }

    fn unpin(&mut self, blocks: &[Vec<BlockId>]) {
        // The table only holds lists this allocator pinned; a refusal is a bug, and it leaves
        // the blocks pinned (a leak a leak check shows) rather than freeing live KV.
        if let Err(error) = self.allocator.unpin(blocks) {
            self.anomaly(format!("unpin of granted blocks refused: {error}"));
        }
    }

    /// Carries out what the request's machine asks that the node can do itself, until it asks
    /// for nothing more; forgets a machine that is done.
    fn drive(&mut self, request: RequestId, now_ms: u64) {
        loop {
            let Some(job) = self.jobs.get_mut(&request) else {
                return;
            };
            match job.machine.poll_command() {
                Some(Command::Prefill(command)) => self.prefill_command(request, command, now_ms),
                Some(Command::Decode(command)) => self.decode_command(request, command, now_ms),
                None => break,
            }
        }
        let Some(job) = self.jobs.get_mut(&request) else {
            return;
        };
        if job.machine.is_done() {
            self.jobs.remove(&request);
            return;
        }
        if job.machine.is_waiting_for_blocks() {
            let capacity = self.config.wait_queue;
            let waiting = self
                .jobs
                .values()
                .filter(|job| job.machine.is_waiting_for_blocks())
                .count();
            if waiting > capacity
                && let Some(job) = self.jobs.get_mut(&request)
            {
                job.machine.handle_queue_full(capacity as u64);
                self.drive(request, now_ms);
            }
        }
    }

    /// Publishes blocks freed since the last call and lets every request waiting for blocks try
    /// again, until an attempt frees nothing more (bounded: each round needs a free, and every
    /// woken request either takes blocks or waits again).
    fn settle(&mut self, now_ms: u64) {
        for _ in 0..=self.jobs.len() {
            let freed = self.allocator.poll_freed();
            if freed.is_empty() {
                return;
            }
            self.outputs.push_back(NodeOutput::Freed(freed));
            let waiting: Vec<RequestId> = self
                .jobs
                .iter()
                .filter(|(_, job)| job.machine.is_waiting_for_blocks())
                .map(|(&request, _)| request)
                .collect();
            for request in waiting {
                if let Some(job) = self.jobs.get_mut(&request) {
                    job.machine.handle_blocks_freed();
                }
                self.drive(request, now_ms);
            }
        }
        // Frees from the last round's attempts (cache evictions) still go out.
        let freed = self.allocator.poll_freed();
        if !freed.is_empty() {
            self.outputs.push_back(NodeOutput::Freed(freed));
        }
    }

    fn send(&mut self, request: RequestId, to: NodeId, body: Body, now_ms: u64) {
        let budget_ms = self
            .jobs
            .get(&request)
            .map_or(0, |job| job.deadline_ms.saturating_sub(now_ms));
        self.outputs.push_back(NodeOutput::Send(Outbound {
            to,
            request,
            budget_ms,
            body,
        }));
    }

    /// Keeps the lists the allocator last gave `request`, for the computations it asks for.
    fn keep_lists(&mut self, request: RequestId, lists: &Result<Vec<Vec<BlockId>>, AllocError>) {
        if let (Ok(lists), Some(job)) = (lists, self.jobs.get_mut(&request)) {
            job.lists = lists.clone();
        }
    }

    fn allocate(
        &mut self,
        request: RequestId,
        slots: u64,
        attending_token: Option<u64>,
    ) -> Result<Allocation, AllocError> {
        let prompt = match self.jobs.get(&request) {
            Some(job) => job.prompt.clone(),
            None => return Err(AllocError::UnknownRequest(request)),
        };
        let result = self.allocator.allocate(request, &prompt, slots, attending_token);
        if let (Ok(allocation), Some(job)) = (&result, self.jobs.get_mut(&request)) {
            job.lists = allocation.blocks.clone();
        }
        result
    }

    fn prefill_command(&mut self, request: RequestId, command: PrefillCommand, now_ms: u64) {
        match command {
            PrefillCommand::Allocate { slots } => {
                let result = self.allocate(request, slots, None).map(drop);
                self.with_prefill(request, |machine| machine.handle_allocated(result, now_ms));
            }
            PrefillCommand::Compute { tokens } => {
                if let Some(job) = self.jobs.get(&request) {
                    let output = NodeOutput::Compute {
                        request,
                        prompt: job.prompt.clone(),
                        lists: job.lists.clone(),
                        tokens,
                    };
                    self.outputs.push_back(output);
                }
            }
            PrefillCommand::ReleaseWindow { attending_token } => {
                let lists = self.release_window_lists(request, attending_token);
                self.keep_lists(request, &lists);
                self.with_prefill(request, |machine| machine.handle_window_released(lists));
            }
            PrefillCommand::Grant { lists, peer } => {
                let result = self.grant(request, peer, lists, now_ms);
                self.with_prefill(request, |machine| machine.handle_granted(result, now_ms));
            }
            PrefillCommand::Revoke { grant } => self.revoke(grant),
            PrefillCommand::Finish => {
                if let Err(error) = self.allocator.finish(request, None) {
                    self.anomaly(format!(
                        "prefill finished {request} twice or never allocated it: {error}"
                    ));
                }
            }
            PrefillCommand::Send { to, body } => self.send(request, to, body, now_ms),
        }
    }

    /// Pins `lists` and grants `peer` a READ of them; unpins again if the table refuses.
    fn grant(
        &mut self,
        request: RequestId,
        peer: NodeId,
        lists: Vec<Vec<BlockId>>,
        now_ms: u64,
    ) -> Result<IssuedGrant, Failure> {
        let generations = self.allocator.pin(&lists).map_err(Failure::Alloc)?;
        let lease_ms = self.config.lease_ms;
        let issued = self.table().issue(request, peer, lists.clone(), lease_ms, now_ms);
        match issued {
            Ok(grant) => Ok(IssuedGrant {
                grant,
                generations,
                lease_ms,
            }),
            Err(error) => {
                self.unpin(&lists);
                Err(Failure::Grant(error))
            }
        }
    }

    fn decode_command(&mut self, request: RequestId, command: DecodeCommand, now_ms: u64) {
        match command {
            DecodeCommand::Allocate {
                slots,
                attending_token,
            } => {
                let result = self.allocate(request, slots, Some(attending_token));
                self.with_decode(request, |machine| machine.handle_allocated(result, now_ms));
            }
            DecodeCommand::Read { pairing, checks } => {
                if let Some(Job {
                    machine: Machine::Decode(machine),
                    ..
                }) = self.jobs.get(&request)
                {
                    let output = NodeOutput::Read {
                        request,
                        prefill: machine.prefill_node().clone(),
                        issuer: machine.prefill_incarnation(),
                        grant: machine.grant(),
                        pairing,
                        checks,
                    };
                    self.outputs.push_back(output);
                }
            }
            DecodeCommand::Generate {
                slots,
                max_tokens,
                deadline_ms,
                sampling,
            } => {
                if let Some(job) = self.jobs.get(&request) {
                    let output = NodeOutput::Generate {
                        request,
                        prompt: job.prompt.clone(),
                        lists: job.lists.clone(),
                        slots,
                        max_tokens,
                        deadline_ms,
                        sampling,
                        stream_to: job.stream_to.clone(),
                    };
                    self.outputs.push_back(output);
                }
            }
            DecodeCommand::StopGenerating => self.outputs.push_back(NodeOutput::StopGenerating { request }),
            DecodeCommand::Finish { cache_prompt } => {
                let prompt = self.jobs.get(&request).map(|job| job.prompt.clone());
                let cache = prompt.as_deref().filter(|_| cache_prompt);
                if let Err(error) = self.allocator.finish(request, cache) {
                    self.anomaly(format!(
                        "decode finished {request} twice or never allocated it: {error}"
                    ));
                }
            }
            DecodeCommand::Send { to, body } => self.send(request, to, body, now_ms),
        }
    }

    fn with_prefill(&mut self, request: RequestId, feed: impl FnOnce(&mut PrefillMachine)) {
        if let Some(Job {
            machine: Machine::Prefill(machine),
            ..
        }) = self.jobs.get_mut(&request)
        {
            feed(machine);
        }
    }

    fn with_decode(&mut self, request: RequestId, feed: impl FnOnce(&mut DecodeMachine)) {
        if let Some(Job {
            machine: Machine::Decode(machine),
            ..
        }) = self.jobs.get_mut(&request)
        {
            feed(machine);
        }
    }
}

enum Command {
    Prefill(PrefillCommand),
    Decode(DecodeCommand),
}
