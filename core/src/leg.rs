//! The leg protocol as sans-IO request machines: one [`PrefillMachine`] per request on a prefill
//! leg, one [`DecodeMachine`] per request on a decode leg, one [`RouterMachine`] per request on
//! the router.
//!
//! Each machine decides everything about its request (how long to wait for blocks, when to renew
//! a lease, what to release on every path, when the request is over) and does nothing itself: a
//! shell feeds it what happened through `handle_*`, and carries out what it asks, drained in
//! order from `poll_command`. Time comes in as `now_ms` from any monotonic millisecond clock the
//! shell owns (virtual in the simulation); `poll_timeout` says when the shell must call
//! `handle_timeout` next. As in quinn-proto's `Connection`, the shell calls `handle_*`, then
//! drains `poll_command` until it is empty, then sleeps until `poll_timeout` or the next input.
//!
//! Rules every machine keeps:
//! - A request ends by its deadline: with its output, or with a failure naming the [`Stage`].
//! - Everything a request holds is given back on every path: its blocks ([`PrefillCommand::Finish`],
//!   [`DecodeCommand::Finish`]), and the grant it reads under ([`Body::Release`]) or issued
//!   ([`PrefillCommand::Revoke`]).
//! - A READ in flight is never abandoned: its bytes would land in blocks freed for someone else.
//!   The deadline is enforced once it completes.
//! - A decode leg renews its grant every third of the lease while it waits for blocks or for its
//!   READ, and releases it as soon as the READ is over.
//!
//! Non-goals: moving bytes, computing tokens, holding blocks (the shell's allocator and engines
//! do that), choosing legs (the router's shell does).

use std::collections::{HashMap, VecDeque};

use serde::{Deserialize, Serialize};

use crate::allocator::{AllocError, Allocation};
use crate::block::{BlockId, NULL_BLOCK};
use crate::exchange::{self, Pairing, PairingMode};
use crate::layout::KvLayout;
use crate::sampling::{Finish, Sampling, TokenLogprobs};
use crate::wire::{
    Body, DecodeOutput, Failure, GrantId, Incarnation, InternalFault, KvParams, LinkFault, NodeId,
    ParamsError, RequestId, Stage,
};

/// How much of a prompt a prefill leg computes and keeps.
///
/// The decode leg recomputes the last prompt token either way, so both pair and give the same
/// output; `AllButLast` is how vLLM's hybrid (mamba) prefill behaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PrefillTokens {
    /// Every prompt token; the mamba state is kept as it stood after `N - 1` tokens.
    #[default]
    All,
    /// The first `N - 1` tokens only (none for a one-token prompt).
    AllButLast,
}

impl PrefillTokens {
    /// Tokens a prefill leg computes for a `num_prompt_tokens`-token prompt.
    pub fn computed(self, num_prompt_tokens: u64) -> u64 {
        match self {
            PrefillTokens::All => num_prompt_tokens,
            PrefillTokens::AllButLast => num_prompt_tokens.saturating_sub(1),
        }
    }
}

/// What a leg's machines need to know about the leg.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LegConfig {
    /// This leg's node name (the sender of its messages).
    pub node: NodeId,
    /// This process's incarnation.
    pub incarnation: Incarnation,
    /// The model's KV layout.
    pub layout: KvLayout,
    /// Token slots reserved beyond the prompt.
    pub lookahead_tokens: u64,
    /// How much of a prompt a prefill leg computes.
    pub prefill_tokens: PrefillTokens,
    /// How the decode leg pairs (anchored; legacy for diagnosis).
    pub pairing: PairingMode,
    /// Legacy pairing only: decode tail blocks the head alignment may drop.
    pub max_decode_tail_blocks: u64,
    /// Longest a request waits for free blocks.
    pub alloc_wait_ms: u64,
}

/// A generation a READ source must still have after the copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GenerationCheck {
    /// Group index (selects the prefill leg's generation table).
    pub group: usize,
    /// Prefill block id.
    pub block: BlockId,
    /// Generation at grant time.
    pub generation: u32,
}

/// Why the KV parameters cannot say which generation a paired block had.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum GenerationCheckError {
    /// One generation list per offered group is required.
    #[error("{lists} generation lists for {groups} offered groups")]
    ListCount {
        /// Generation lists given.
        lists: usize,
        /// Groups offered.
        groups: usize,
    },
    /// A group was paired that the offer does not have.
    #[error("group {group} paired but not offered")]
    GroupNotOffered {
        /// Group index.
        group: usize,
    },
    /// A group's generations do not match its offered blocks one to one.
    #[error("group {group}: {generations} generations for {blocks} offered blocks")]
    GenerationCount {
        /// Group index.
        group: usize,
        /// Generations given.
        generations: usize,
        /// Blocks offered.
        blocks: usize,
    },
    /// A pair names a position the offer does not cover.
    #[error("group {group}: paired position {position} outside the offer")]
    PositionOutsideOffer {
        /// Group index.
        group: usize,
        /// The prefill-side position.
        position: u64,
    },
}

/// The generation each paired prefill block had when it was granted, from the KV parameters.
pub fn generation_checks(
    params: &KvParams,
    pairing: &Pairing,
) -> Result<Vec<GenerationCheck>, GenerationCheckError> {
    if params.generations.len() != params.offer.groups.len() {
        return Err(GenerationCheckError::ListCount {
            lists: params.generations.len(),
            groups: params.offer.groups.len(),
        });
    }
    let mut checks = Vec::with_capacity(pairing.num_pairs());
    for (group, pairs) in pairing.groups.iter().enumerate() {
        let list = params
            .offer
            .groups
            .get(group)
            .ok_or(GenerationCheckError::GroupNotOffered { group })?;
        let generations = &params.generations[group];
        if generations.len() != list.blocks.len() {
            return Err(GenerationCheckError::GenerationCount {
                group,
                generations: generations.len(),
                blocks: list.blocks.len(),
            });
        }
        for pair in pairs.iter().filter(|pair| pair.remote != NULL_BLOCK) {
            let index = pair
                .remote_position
                .checked_sub(list.first_position)
                .and_then(|index| usize::try_from(index).ok())
                .filter(|&index| index < generations.len())
                .ok_or(GenerationCheckError::PositionOutsideOffer {
                    group,
                    position: pair.remote_position,
                })?;
            checks.push(GenerationCheck {
                group,
                block: pair.remote,
                generation: generations[index],
            });
        }
    }
    Ok(checks)
}

/// A grant as the prefill leg's allocator issued it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IssuedGrant {
    /// The grant.
    pub grant: GrantId,
    /// Generation of every granted block, parallel to the offered lists.
    pub generations: Vec<Vec<u32>>,
    /// The lease.
    pub lease_ms: u64,
}

/// What a prefill machine asks its shell to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PrefillCommand {
    /// Allocate `slots` token slots for the request; answer with
    /// [`PrefillMachine::handle_allocated`].
    Allocate {
        /// Token slots (computed prompt tokens plus lookahead, at least 1).
        slots: u64,
    },
    /// Compute the first `tokens` prompt tokens into the request's blocks; answer with
    /// [`PrefillMachine::handle_computed`].
    Compute {
        /// Tokens to compute.
        tokens: u64,
    },
    /// Free window blocks that token `attending_token`'s window no longer sees; answer with the
    /// request's lists through [`PrefillMachine::handle_window_released`].
    ReleaseWindow {
        /// The last prompt token, which the decode leg recomputes.
        attending_token: u64,
    },
    /// Pin `lists` and grant `peer` a READ of them; answer with
    /// [`PrefillMachine::handle_granted`].
    Grant {
        /// The offered blocks per group.
        lists: Vec<Vec<BlockId>>,
        /// The decode leg.
        peer: NodeId,
    },
    /// End a grant nobody will read and unpin its blocks.
    Revoke {
        /// The grant.
        grant: GrantId,
    },
    /// The request's own hold on its blocks ends (granted blocks stay pinned).
    Finish,
    /// Send a message to a node.
    Send {
        /// The node.
        to: NodeId,
        /// The message.
        body: Body,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PrefillState {
    Allocating,
    WaitingForBlocks { until_ms: u64 },
    Computing,
    ReleasingWindow,
    Granting,
    Done,
}

/// One request on a prefill leg: allocate, compute, offer, grant, answer the router.
#[derive(Debug)]
pub struct PrefillMachine {
    config: LegConfig,
    request: RequestId,
    router: NodeId,
    decode: NodeId,
    prompt: Vec<u32>,
    deadline_ms: u64,
    alloc_deadline_ms: u64,
    /// Token slots the request asks for (computed tokens plus lookahead, at least 1).
    slots: u64,
    state: PrefillState,
    /// The allocator's last refusal while waiting for blocks.
    last_refusal: Option<AllocError>,
    allocated: bool,
    aborted: bool,
    offer: Option<exchange::Offer>,
    commands: VecDeque<PrefillCommand>,
}

impl PrefillMachine {
    /// The router that asked for the request.
    pub fn router(&self) -> &NodeId {
        &self.router
    }

    /// A machine for `request`, asked by `router` to prefill `prompt` for `decode`, due by
    /// `deadline_ms`.
    pub fn new(
        config: LegConfig,
        request: RequestId,
        router: NodeId,
        prompt: Vec<u32>,
        decode: NodeId,
        deadline_ms: u64,
        now_ms: u64,
    ) -> Self {
        let mut machine = PrefillMachine {
            alloc_deadline_ms: wait_bound(&config, now_ms, deadline_ms),
            config,
            request,
            router,
            decode,
            prompt,
            deadline_ms,
            slots: 0,
            state: PrefillState::Allocating,
            last_refusal: None,
            allocated: false,
            aborted: false,
            offer: None,
            commands: VecDeque::new(),
        };
        if machine.prompt.is_empty() {
            machine.fail(Failure::EmptyPrompt);
        } else if now_ms >= deadline_ms {
            machine.fail_timeout();
        } else {
            let computed = machine.config.prefill_tokens.computed(machine.num_tokens());
            match computed.checked_add(machine.config.lookahead_tokens) {
                Some(slots) => {
                    machine.slots = slots.max(1);
                    machine
                        .commands
                        .push_back(PrefillCommand::Allocate { slots: machine.slots });
                }
                None => machine.fail(Failure::SlotOverflow {
                    tokens: computed,
                    lookahead_tokens: machine.config.lookahead_tokens,
                }),
            }
        }
        machine
    }

    fn num_tokens(&self) -> u64 {
        self.prompt.len() as u64
    }

    /// The request.
    pub fn request(&self) -> RequestId {
        self.request
    }

    /// Whether the machine has nothing more to do.
    pub fn is_done(&self) -> bool {
        self.state == PrefillState::Done && self.commands.is_empty()
    }

    /// The next command for the shell, in order.
    pub fn poll_command(&mut self) -> Option<PrefillCommand> {
        self.commands.pop_front()
    }

    /// When the shell must call [`Self::handle_timeout`] next.
    pub fn poll_timeout(&self) -> Option<u64> {
        match self.state {
            PrefillState::WaitingForBlocks { until_ms } => Some(until_ms),
            _ => None,
        }
    }

    /// The allocator answered [`PrefillCommand::Allocate`].
    pub fn handle_allocated(&mut self, result: Result<(), AllocError>, now_ms: u64) {
        if self.state != PrefillState::Allocating {
            return;
        }
        match result {
            Ok(()) => {
                self.allocated = true;
                if self.aborted {
                    self.finish_quietly();
                } else {
                    self.state = PrefillState::Computing;
                    let tokens = self.config.prefill_tokens.computed(self.num_tokens());
                    self.commands.push_back(PrefillCommand::Compute { tokens });
                }
            }
            Err(error @ AllocError::OutOfBlocks { .. })
                if !self.aborted && now_ms < self.alloc_deadline_ms =>
            {
                self.last_refusal = Some(error);
                self.state = PrefillState::WaitingForBlocks {
                    until_ms: self.alloc_deadline_ms,
                };
            }
            Err(error) if self.aborted => {
                let _ = error;
                self.state = PrefillState::Done;
            }
            Err(error @ AllocError::OutOfBlocks { .. }) => {
                if now_ms >= self.deadline_ms {
                    self.fail_timeout();
                } else {
                    self.fail(Failure::NoFreeBlocks {
                        waited_ms: self.config.alloc_wait_ms,
                        last: error,
                    });
                }
            }
            Err(error) => self.fail(Failure::Alloc(error)),
        }
    }

    /// Whether the request waits for blocks (the shell bounds how many may).
    pub fn is_waiting_for_blocks(&self) -> bool {
        matches!(self.state, PrefillState::WaitingForBlocks { .. })
    }

    /// The leg's wait queue is full: a request that would wait for blocks fails at once.
    pub fn handle_queue_full(&mut self, capacity: u64) {
        if self.is_waiting_for_blocks() {
            self.fail(Failure::QueueFull {
                leg: self.config.node.clone(),
                capacity,
            });
        }
    }

    /// Blocks were freed on this leg: a request waiting for blocks tries again.
    pub fn handle_blocks_freed(&mut self) {
        if let PrefillState::WaitingForBlocks { .. } = self.state {
            self.state = PrefillState::Allocating;
            self.commands
                .push_back(PrefillCommand::Allocate { slots: self.slots });
        }
    }

    /// The engine answered [`PrefillCommand::Compute`].
    pub fn handle_computed(&mut self, result: Result<(), Failure>, now_ms: u64) {
        if self.state != PrefillState::Computing {
            return;
        }
        match result {
            _ if self.aborted => self.finish_quietly(),
            Err(reason) => self.fail(reason),
            Ok(()) if now_ms >= self.deadline_ms => self.fail_timeout(),
            Ok(()) => {
                self.state = PrefillState::ReleasingWindow;
                self.commands.push_back(PrefillCommand::ReleaseWindow {
                    attending_token: self.num_tokens() - 1,
                });
            }
        }
    }

    /// The allocator answered [`PrefillCommand::ReleaseWindow`] with the request's lists.
    pub fn handle_window_released(&mut self, lists: Result<Vec<Vec<BlockId>>, AllocError>) {
        if self.state != PrefillState::ReleasingWindow {
            return;
        }
        if self.aborted {
            return self.finish_quietly();
        }
        let lists = match lists {
            Ok(lists) => lists,
            Err(error) => return self.fail(Failure::Alloc(error)),
        };
        let offer = match self.config.pairing {
            PairingMode::Anchored => exchange::offer(&self.config.layout, self.num_tokens(), &lists),
            PairingMode::Legacy => Ok(exchange::legacy_offer(
                &self.config.layout,
                self.num_tokens(),
                lists,
            )),
        };
        match offer {
            Ok(offer) => {
                let lists = offer.groups.iter().map(|list| list.blocks.clone()).collect();
                self.offer = Some(offer);
                self.state = PrefillState::Granting;
                self.commands.push_back(PrefillCommand::Grant {
                    lists,
                    peer: self.decode.clone(),
                });
            }
            Err(error) => self.fail(Failure::Exchange(error)),
        }
    }

    /// The allocator answered [`PrefillCommand::Grant`]. Past the deadline, or after an abort,
    /// the grant is revoked at once instead of handed out.
    pub fn handle_granted(&mut self, result: Result<IssuedGrant, Failure>, now_ms: u64) {
        if self.state != PrefillState::Granting {
            return;
        }
        let issued = match result {
            Ok(issued) => issued,
            Err(reason) if self.aborted => {
                let _ = reason;
                return self.finish_quietly();
            }
            Err(reason) => return self.fail(reason),
        };
        if self.aborted || now_ms >= self.deadline_ms {
            self.commands
                .push_back(PrefillCommand::Revoke { grant: issued.grant });
            return if self.aborted {
                self.finish_quietly()
            } else {
                self.fail_timeout()
            };
        }
        // The grant now pins what the READ needs; the request's own hold ends.
        self.commands.push_back(PrefillCommand::Finish);
        self.allocated = false;
        let Some(offer) = self.offer.take() else {
            return self.fail(Failure::Internal(InternalFault::GrantedWithoutOffer));
        };
        let params = KvParams {
            request: self.request,
            prefill_node: self.config.node.clone(),
            prefill_incarnation: self.config.incarnation,
            offer,
            generations: issued.generations,
            grant: issued.grant,
            lease_ms: issued.lease_ms,
        };
        self.send_router(Body::KvReady(params));
        self.state = PrefillState::Done;
    }

    /// The router aborted the request: stop and give everything back. A step already asked of
    /// the shell is let finish; what it yields is released.
    pub fn handle_abort(&mut self) {
        if self.state == PrefillState::Done {
            return;
        }
        self.aborted = true;
        if let PrefillState::WaitingForBlocks { .. } = self.state {
            self.state = PrefillState::Done;
        }
    }

    /// Time passed: a request waiting for blocks gives up at its wait bound or deadline.
    pub fn handle_timeout(&mut self, now_ms: u64) {
        if let PrefillState::WaitingForBlocks { until_ms } = self.state
            && now_ms >= until_ms
        {
            if now_ms >= self.deadline_ms {
                self.fail_timeout();
            } else {
                let failure = no_free_blocks(self.config.alloc_wait_ms, &self.last_refusal);
                self.fail(failure);
            }
        }
    }

    fn send_router(&mut self, body: Body) {
        self.commands.push_back(PrefillCommand::Send {
            to: self.router.clone(),
            body,
        });
    }

    fn finish_quietly(&mut self) {
        if self.allocated {
            self.commands.push_back(PrefillCommand::Finish);
            self.allocated = false;
        }
        self.state = PrefillState::Done;
    }

    fn fail(&mut self, reason: Failure) {
        self.finish_quietly();
        self.send_router(Body::Failed {
            stage: Stage::Prefill,
            reason,
        });
    }

    fn fail_timeout(&mut self) {
        self.fail(Failure::DeadlinePassed);
    }
}

/// What a decode machine asks its shell to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DecodeCommand {
    /// Allocate `slots` token slots, window groups null below `attending_token`'s window; answer
    /// with [`DecodeMachine::handle_allocated`].
    Allocate {
        /// Prompt plus lookahead.
        slots: u64,
        /// The last prompt token, which this leg recomputes.
        attending_token: u64,
    },
    /// READ the paired blocks from the prefill leg and check each source's generation after the
    /// copy; answer with [`DecodeMachine::handle_read_done`].
    Read {
        /// Block pairs per group.
        pairing: Pairing,
        /// Generations to verify after the copy.
        checks: Vec<GenerationCheck>,
    },
    /// Recompute the last prompt token and decode `max_tokens` tokens, stopping between tokens
    /// once `deadline_ms` passes; answer with [`DecodeMachine::handle_generated`].
    Generate {
        /// Slots allocated.
        slots: u64,
        /// Tokens to generate.
        max_tokens: u32,
        /// When to stop.
        deadline_ms: u64,
        /// How each token is chosen, and the stops that end generation early.
        sampling: Sampling,
    },
    /// The request was aborted while [`DecodeCommand::Generate`] runs: stop it at the next token
    /// boundary instead of decoding to the end for nobody, and answer with
    /// [`DecodeMachine::handle_generated`] once it has stopped (the blocks stay held until then:
    /// the computation still writes into them).
    StopGenerating,
    /// The request's hold on its blocks ends; with `cache_prompt` its full prompt blocks may be
    /// kept as prefix-cache entries.
    Finish {
        /// Whether the blocks hold verified KV worth caching.
        cache_prompt: bool,
    },
    /// Send a message to a node.
    Send {
        /// The node.
        to: NodeId,
        /// The message.
        body: Body,
    },
}

/// What a finished READ moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ReadDone {
    /// Bytes copied.
    pub bytes: u64,
    /// Runs posted.
    pub runs: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DecodeState {
    Allocating,
    WaitingForBlocks { until_ms: u64 },
    Reading,
    Generating,
    Done,
}

/// One request on a decode leg: allocate, pair, READ (renewing the grant while it waits),
/// release, decode, answer the router.
#[derive(Debug)]
pub struct DecodeMachine {
    config: LegConfig,
    request: RequestId,
    router: NodeId,
    params: KvParams,
    /// Tokens in the prompt (at least one, as many as the offer covers).
    prompt_tokens: u64,
    max_tokens: u32,
    deadline_ms: u64,
    alloc_deadline_ms: u64,
    /// Token slots the request asks for (prompt plus lookahead).
    slots: u64,
    state: DecodeState,
    /// The allocator's last refusal while waiting for blocks.
    last_refusal: Option<AllocError>,
    /// Next lease renewal, while the grant is held.
    renew_at_ms: Option<u64>,
    allocated: Option<Allocation>,
    read: ReadDone,
    aborted: bool,
    /// How tokens are chosen (boxed: most requests are greedy and the machine stays small).
    sampling: Box<Sampling>,
    commands: VecDeque<DecodeCommand>,
}

/// What a finished generation produced.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Generated {
    /// The tokens, in order.
    pub tokens: Vec<u32>,
    /// Digest of every step's logits.
    pub logits_digest: u64,
    /// Why it ended.
    pub finish: Finish,
    /// Per token, when asked for.
    pub logprobs: Vec<TokenLogprobs>,
}

impl From<(Vec<u32>, u64)> for Generated {
    /// `max_tokens` greedy tokens and their digest.
    fn from((tokens, logits_digest): (Vec<u32>, u64)) -> Self {
        Generated {
            tokens,
            logits_digest,
            ..Generated::default()
        }
    }
}

impl DecodeMachine {
    /// The router that asked for the request.
    pub fn router(&self) -> &NodeId {
        &self.router
    }

    /// A machine for the request in `params` over a prompt of `prompt_tokens` tokens, asked by
    /// `router`, due by `deadline_ms`.
    pub fn new(
        config: LegConfig,
        router: NodeId,
        params: KvParams,
        prompt_tokens: u64,
        max_tokens: u32,
        deadline_ms: u64,
        now_ms: u64,
    ) -> Self {
        let mut machine = DecodeMachine {
            alloc_deadline_ms: wait_bound(&config, now_ms, deadline_ms),
            renew_at_ms: Some(now_ms.saturating_add(renew_period(params.lease_ms))),
            config,
            request: params.request,
            router,
            params,
            prompt_tokens,
            max_tokens,
            deadline_ms,
            slots: 0,
            state: DecodeState::Allocating,
            last_refusal: None,
            allocated: None,
            read: ReadDone::default(),
            aborted: false,
            sampling: Box::default(),
            commands: VecDeque::new(),
        };
        let num_tokens = prompt_tokens;
        if num_tokens == 0 {
            machine.fail(Stage::Decode, Failure::EmptyPrompt);
        } else if machine.params.offer.num_prompt_tokens != num_tokens {
            machine.fail(
                Stage::Decode,
                Failure::BadParams(ParamsError::PromptLength {
                    offer: machine.params.offer.num_prompt_tokens,
                    prompt: num_tokens,
                }),
            );
        } else if now_ms >= deadline_ms {
            machine.fail(Stage::Decode, Failure::DeadlinePassed);
        } else {
            match num_tokens.checked_add(machine.config.lookahead_tokens) {
                Some(slots) => {
                    machine.slots = slots;
                    machine.commands.push_back(DecodeCommand::Allocate {
                        slots,
                        attending_token: num_tokens - 1,
                    });
                }
                None => {
                    let lookahead_tokens = machine.config.lookahead_tokens;
                    machine.fail(
                        Stage::Decode,
                        Failure::SlotOverflow {
                            tokens: num_tokens,
                            lookahead_tokens,
                        },
                    )
                }
            }
        }
        machine
    }

    /// The request.
    pub fn request(&self) -> RequestId {
        self.request
    }

    /// The prefill node holding the KV.
    pub fn prefill_node(&self) -> &NodeId {
        &self.params.prefill_node
    }

    /// The incarnation of the prefill node that issued the grant.
    pub fn prefill_incarnation(&self) -> Incarnation {
        self.params.prefill_incarnation
    }

    /// Chooses tokens with `sampling` instead of greedily (set before the READ ends).
    pub fn with_sampling(mut self, sampling: Sampling) -> Self {
        self.sampling = Box::new(sampling);
        self
    }

    /// The grant the READ runs under.
    pub fn grant(&self) -> GrantId {
        self.params.grant
    }

    /// Whether the machine has nothing more to do.
    pub fn is_done(&self) -> bool {
        self.state == DecodeState::Done && self.commands.is_empty()
    }

    /// The next command for the shell, in order.
    pub fn poll_command(&mut self) -> Option<DecodeCommand> {
        self.commands.pop_front()
    }

    /// When the shell must call [`Self::handle_timeout`] next: the next renewal, the end of a
    /// wait for blocks, or the deadline while nothing in flight would notice it.
    pub fn poll_timeout(&self) -> Option<u64> {
        let wait = match self.state {
            DecodeState::WaitingForBlocks { until_ms } => Some(until_ms),
            _ => None,
        };
        [wait, self.renew_at_ms].into_iter().flatten().min()
    }

    /// The allocator answered [`DecodeCommand::Allocate`].
    pub fn handle_allocated(&mut self, result: Result<Allocation, AllocError>, now_ms: u64) {
        if self.state != DecodeState::Allocating {
            return;
        }
        let allocation = match result {
            Ok(allocation) => allocation,
            Err(error @ AllocError::OutOfBlocks { .. })
                if !self.aborted && now_ms < self.alloc_deadline_ms =>
            {
                self.last_refusal = Some(error);
                self.state = DecodeState::WaitingForBlocks {
                    until_ms: self.alloc_deadline_ms,
                };
                return;
            }
            Err(_) if self.aborted => return self.end_quietly(),
            Err(error @ AllocError::OutOfBlocks { .. }) if now_ms < self.deadline_ms => {
                return self.fail(
                    Stage::Decode,
                    Failure::NoFreeBlocks {
                        waited_ms: self.config.alloc_wait_ms,
                        last: error,
                    },
                );
            }
            Err(AllocError::OutOfBlocks { .. }) => return self.fail(Stage::Decode, Failure::DeadlinePassed),
            Err(error) => return self.fail(Stage::Decode, Failure::Alloc(error)),
        };
        self.allocated = Some(allocation);
        if self.aborted {
            return self.end_quietly();
        }
        if now_ms >= self.deadline_ms {
            return self.fail(Stage::Decode, Failure::DeadlinePassed);
        }
        match self.pair() {
            Ok((pairing, checks)) => {
                self.state = DecodeState::Reading;
                self.commands.push_back(DecodeCommand::Read { pairing, checks });
            }
            Err(reason) => self.fail(Stage::Decode, reason),
        }
    }

    fn pair(&self) -> Result<(Pairing, Vec<GenerationCheck>), Failure> {
        let Some(allocation) = &self.allocated else {
            return Err(Failure::Internal(InternalFault::PairedBeforeAllocating));
        };
        let layout = &self.config.layout;
        let offer = &self.params.offer;
        let pairing = match self.config.pairing {
            PairingMode::Anchored => exchange::need(
                layout,
                offer.num_prompt_tokens,
                &allocation.blocks,
                &allocation.cached_blocks,
            )
            .and_then(|need| exchange::pair(layout, offer, &need)),
            PairingMode::Legacy => {
                let remote: Vec<Vec<BlockId>> = offer.groups.iter().map(|list| list.blocks.clone()).collect();
                exchange::legacy_pair(
                    layout,
                    &remote,
                    &allocation.blocks,
                    self.config.max_decode_tail_blocks,
                )
            }
        }
        .map_err(Failure::Exchange)?;
        let checks = generation_checks(&self.params, &pairing)
            .map_err(|error| Failure::BadParams(ParamsError::Checks(error)))?;
        Ok((pairing, checks))
    }

    /// Whether the request waits for blocks (the shell bounds how many may).
    pub fn is_waiting_for_blocks(&self) -> bool {
        matches!(self.state, DecodeState::WaitingForBlocks { .. })
    }

    /// The leg's wait queue is full: a request that would wait for blocks fails at once.
    pub fn handle_queue_full(&mut self, capacity: u64) {
        if self.is_waiting_for_blocks() {
            let leg = self.config.node.clone();
            self.fail(Stage::Decode, Failure::QueueFull { leg, capacity });
        }
    }

    /// Blocks were freed on this leg: a request waiting for blocks tries again.
    pub fn handle_blocks_freed(&mut self) {
        if let DecodeState::WaitingForBlocks { .. } = self.state {
            self.state = DecodeState::Allocating;
            self.commands.push_back(DecodeCommand::Allocate {
                slots: self.slots,
                attending_token: self.prompt_tokens - 1,
            });
        }
    }

    /// The READ engine answered [`DecodeCommand::Read`] (complete and verified, or failed: a
    /// partial READ is a failure). The grant is released either way.
    pub fn handle_read_done(&mut self, result: Result<ReadDone, Failure>, now_ms: u64) {
        if self.state != DecodeState::Reading {
            return;
        }
        self.release_grant();
        match result {
            _ if self.aborted => self.end_quietly(),
            Err(reason) => self.fail(Stage::Read, reason),
            Ok(_) if now_ms >= self.deadline_ms => self.fail(Stage::Read, Failure::DeadlinePassed),
            Ok(done) => {
                self.read = done;
                self.state = DecodeState::Generating;
                self.commands.push_back(DecodeCommand::Generate {
                    slots: self.slots,
                    max_tokens: self.max_tokens,
                    deadline_ms: self.deadline_ms,
                    sampling: (*self.sampling).clone(),
                });
            }
        }
    }

    /// The engine answered [`DecodeCommand::Generate`]: what it generated.
    pub fn handle_generated(&mut self, result: Result<Generated, Failure>) {
        if self.state != DecodeState::Generating {
            return;
        }
        match result {
            _ if self.aborted => self.end_quietly(),
            Err(reason) => self.fail(Stage::Decode, reason),
            Ok(generated) => {
                let cached_blocks = self
                    .allocated
                    .as_ref()
                    .map_or(0, |allocation| allocation.cached_blocks.iter().sum());
                self.commands
                    .push_back(DecodeCommand::Finish { cache_prompt: true });
                self.allocated = None;
                self.state = DecodeState::Done;
                let output = DecodeOutput {
                    tokens: generated.tokens,
                    logits_digest: generated.logits_digest,
                    read_bytes: self.read.bytes,
                    read_runs: self.read.runs,
                    cached_blocks,
                    finish: generated.finish,
                    logprobs: generated.logprobs,
                };
                self.send_router(Body::Output(output));
            }
        }
    }

    /// The prefill leg renewed the grant.
    pub fn handle_renewed(&mut self, lease_ms: u64, now_ms: u64) {
        if self.renew_at_ms.is_some() {
            self.renew_at_ms = Some(now_ms.saturating_add(renew_period(lease_ms)));
        }
    }

    /// The router aborted the request: stop and give everything back. A READ in flight is let
    /// finish first; a generation under way is told to stop at its next token.
    pub fn handle_abort(&mut self) {
        if self.state == DecodeState::Done || self.aborted {
            return;
        }
        self.aborted = true;
        match self.state {
            DecodeState::WaitingForBlocks { .. } => self.end_quietly(),
            DecodeState::Generating => self.commands.push_back(DecodeCommand::StopGenerating),
            DecodeState::Allocating | DecodeState::Reading | DecodeState::Done => {}
        }
    }

    /// Time passed: renew the lease when due; give up a wait for blocks at its bound.
    pub fn handle_timeout(&mut self, now_ms: u64) {
        if let Some(at) = self.renew_at_ms
            && now_ms >= at
            && matches!(
                self.state,
                DecodeState::Allocating | DecodeState::WaitingForBlocks { .. } | DecodeState::Reading
            )
        {
            self.renew_at_ms = Some(now_ms.saturating_add(renew_period(self.params.lease_ms)));
            self.send_prefill(Body::Renew {
                grant: self.params.grant,
                issuer: self.params.prefill_incarnation,
            });
        }
        if let DecodeState::WaitingForBlocks { until_ms } = self.state
            && now_ms >= until_ms
        {
            let reason = if now_ms >= self.deadline_ms {
                Failure::DeadlinePassed
            } else {
                no_free_blocks(self.config.alloc_wait_ms, &self.last_refusal)
            };
            self.fail(Stage::Decode, reason);
        }
    }

    fn release_grant(&mut self) {
        if self.renew_at_ms.take().is_some() {
            self.send_prefill(Body::Release {
                grant: self.params.grant,
                issuer: self.params.prefill_incarnation,
            });
        }
    }

    fn send_prefill(&mut self, body: Body) {
        self.commands.push_back(DecodeCommand::Send {
            to: self.params.prefill_node.clone(),
            body,
        });
    }

    fn send_router(&mut self, body: Body) {
        self.commands.push_back(DecodeCommand::Send {
            to: self.router.clone(),
            body,
        });
    }

    fn end_quietly(&mut self) {
        self.release_grant();
        if self.allocated.take().is_some() {
            self.commands
                .push_back(DecodeCommand::Finish { cache_prompt: false });
        }
        self.state = DecodeState::Done;
    }

    fn fail(&mut self, stage: Stage, reason: Failure) {
        self.end_quietly();
        self.send_router(Body::Failed { stage, reason });
    }
}

/// When a request that starts waiting for blocks at `now_ms` gives up: after `alloc_wait_ms`,
/// and never past its deadline.
/// The failure of a wait for blocks that lasted its whole bound, naming the allocator's last
/// refusal.
fn no_free_blocks(waited_ms: u64, last: &Option<AllocError>) -> Failure {
    match last {
        Some(last) => Failure::NoFreeBlocks {
            waited_ms,
            last: last.clone(),
        },
        None => Failure::Internal(InternalFault::WaitedWithoutRefusal),
    }
}

fn wait_bound(config: &LegConfig, now_ms: u64, deadline_ms: u64) -> u64 {
    now_ms.saturating_add(config.alloc_wait_ms).min(deadline_ms)
}

/// A third of the lease: two renewals may be lost before it lapses.
fn renew_period(lease_ms: u64) -> u64 {
    (lease_ms / 3).max(1)
}

/// How a request ended, as the router tells its client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequestOutcome {
    /// The decode leg's answer.
    Output(DecodeOutput),
    /// The request failed in `stage`.
    Failed {
        /// Where.
        stage: Stage,
        /// Why.
        reason: Failure,
    },
}

/// What a router machine asks its shell to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RouterCommand {
    /// Send a message to a leg.
    Send {
        /// The leg.
        to: NodeId,
        /// The message.
        body: Body,
    },
    /// The request is over: answer the client.
    Complete(RequestOutcome),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RouterState {
    Prefilling,
    Decoding,
    Done,
}

/// One request on the router: prefill on one leg, decode on another, answer by the deadline.
#[derive(Debug)]
pub struct RouterMachine {
    request: RequestId,
    prefill: NodeId,
    decode: NodeId,
    /// The prompt, for the decode leg (the prefill leg has its own copy).
    prompt: Vec<u32>,
    max_tokens: u32,
    /// The client streams: the decode leg sends tokens as it generates them.
    stream: bool,
    /// How the decode leg chooses tokens.
    sampling: Sampling,
    deadline_ms: u64,
    state: RouterState,
    /// Incarnation of each leg when the request started; a message from another is stale.
    incarnations: HashMap<NodeId, Incarnation>,
    commands: VecDeque<RouterCommand>,
}

/// Whether a request that failed in `stage` with `reason` may start over on another prefill
/// leg: only while its prefill had not committed (no KV parameters came back, so nothing was
/// granted that the decode leg could still read), and only when that prefill leg itself was lost,
/// unreachable, or refused the request (a draining leg). A request the prefill leg failed on
/// its own (no blocks, a bad prompt, its deadline) would fail again elsewhere, and is not retried.
pub fn may_retry_prefill(stage: Stage, reason: &Failure, prefill: &NodeId) -> bool {
    stage == Stage::Prefill
        && match reason {
            Failure::LegLost(leg) => leg == prefill,
            Failure::Unreachable { to, .. } => to == prefill,
            Failure::Refused { node, .. } => node == prefill,
            _ => false,
        }
}

/// The leg a failed request may start over without, if any: the prefill leg as
/// [`may_retry_prefill`] allows, or when the decode leg's READ of it failed (the prefill leg
/// died, froze past its lease or could not be reached for data; not when the deadline passed or
/// the client cancelled); or the decode leg, at any stage, when it was lost, unreachable or
/// refused the request. A request started over is computed again from its prompt on other legs
/// (a grant is issued to one decode leg, so another cannot read it): never decoded from KV a
/// failed leg may have half read.
pub fn leg_to_retry_without<'a>(
    stage: Stage,
    reason: &Failure,
    prefill: &'a NodeId,
    decode: &'a NodeId,
) -> Option<&'a NodeId> {
    if may_retry_prefill(stage, reason, prefill) {
        return Some(prefill);
    }
    let names_decode = match reason {
        Failure::LegLost(leg) => leg == decode,
        Failure::Unreachable { to, .. } => to == decode,
        Failure::Refused { node, .. } => node == decode,
        _ => false,
    };
    if names_decode {
        return Some(decode);
    }
    let read_failed = stage == Stage::Read && !matches!(reason, Failure::DeadlinePassed | Failure::Cancelled);
    read_failed.then_some(prefill)
}

impl RouterMachine {
    /// Starts `request`: asks `prefill` to compute `prompt` for `decode`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        request: RequestId,
        prompt: Vec<u32>,
        max_tokens: u32,
        prefill: (NodeId, Incarnation),
        decode: (NodeId, Incarnation),
        deadline_ms: u64,
        now_ms: u64,
    ) -> Self {
        let incarnations = HashMap::from([prefill.clone(), decode.clone()]);
        let mut machine = RouterMachine {
            request,
            prefill: prefill.0,
            decode: decode.0,
            prompt: prompt.clone(),
            max_tokens,
            stream: false,
            sampling: Sampling::default(),
            deadline_ms,
            state: RouterState::Prefilling,
            incarnations,
            commands: VecDeque::new(),
        };
        if now_ms >= deadline_ms {
            machine.complete_failed(Stage::Router, Failure::DeadlinePassed);
        } else {
            machine.commands.push_back(RouterCommand::Send {
                to: machine.prefill.clone(),
                body: Body::Prefill {
                    prompt,
                    decode: machine.decode.clone(),
                },
            });
        }
        machine
    }

    /// The request.
    pub fn request(&self) -> RequestId {
        self.request
    }

    /// Asks the decode leg to choose tokens with `sampling` (greedy by default).
    pub fn with_sampling(mut self, sampling: Sampling) -> Self {
        self.sampling = sampling;
        self
    }

    /// Asks the decode leg to send each token as it is generated (a streaming client).
    pub fn with_streaming(mut self, stream: bool) -> Self {
        self.stream = stream;
        self
    }

    /// The legs the request runs on.
    pub fn legs(&self) -> (&NodeId, &NodeId) {
        (&self.prefill, &self.decode)
    }

    /// Whether the request is over (its outcome handed to the shell).
    pub fn is_done(&self) -> bool {
        self.state == RouterState::Done && self.commands.is_empty()
    }

    /// The next command for the shell, in order.
    pub fn poll_command(&mut self) -> Option<RouterCommand> {
        self.commands.pop_front()
    }

    /// The deadline, while the request is open.
    pub fn poll_timeout(&self) -> Option<u64> {
        (self.state != RouterState::Done).then_some(self.deadline_ms)
    }

    /// Whether the decode leg was asked to decode (the prefill leg's KV parameters arrived)
    /// and the request is still open.
    pub fn is_decoding(&self) -> bool {
        self.state == RouterState::Decoding
    }

    /// A message about this request arrived from `from` (incarnation `incarnation`).
    pub fn handle_message(&mut self, from: &NodeId, incarnation: Incarnation, body: Body) {
        if self.incarnations.get(from) != Some(&incarnation) {
            // A stale or unknown sender: its KV may be gone. Anything it granted is aborted.
            if let Body::KvReady(_) = body {
                self.send(from.clone(), Body::Abort);
            }
            return;
        }
        match (self.state, body) {
            (RouterState::Prefilling, Body::KvReady(params)) if *from == self.prefill => {
                self.state = RouterState::Decoding;
                let prompt = std::mem::take(&mut self.prompt);
                self.send(
                    self.decode.clone(),
                    Body::Decode {
                        prompt,
                        params,
                        max_tokens: self.max_tokens,
                        stream: self.stream,
                        sampling: self.sampling.clone(),
                    },
                );
            }
            (RouterState::Done, Body::KvReady(_)) => {
                // Too late: the request is over. The prefill leg frees the grant now, not at lease end.
                self.send(from.clone(), Body::Abort);
            }
            (RouterState::Decoding, Body::Output(output)) if *from == self.decode => {
                self.state = RouterState::Done;
                self.commands
                    .push_back(RouterCommand::Complete(RequestOutcome::Output(output)));
            }
            (RouterState::Prefilling | RouterState::Decoding, Body::Failed { stage, reason }) => {
                // A failed decode leg releases its grant itself; the abort makes sure the prefill
                // leg frees it even if that release is lost.
                if self.state == RouterState::Decoding {
                    self.send(self.prefill.clone(), Body::Abort);
                }
                self.state = RouterState::Done;
                self.commands
                    .push_back(RouterCommand::Complete(RequestOutcome::Failed { stage, reason }));
            }
            // Duplicates and answers that no longer matter.
            _ => {}
        }
    }

    /// A leg was lost (heartbeats stopped, or it restarted): the request fails closed.
    pub fn handle_peer_lost(&mut self, leg: &NodeId) {
        if self.state == RouterState::Done || (*leg != self.prefill && *leg != self.decode) {
            return;
        }
        let stage = self.stage();
        for other in [self.prefill.clone(), self.decode.clone()] {
            if other != *leg {
                self.send(other, Body::Abort);
            }
        }
        self.complete_failed(stage, Failure::LegLost(leg.clone()));
    }

    /// A message to `to` could not be delivered (its link is down or full): the request fails
    /// at once naming the stage, and the other leg is told to free what it holds.
    pub fn handle_send_failed(&mut self, to: &NodeId, fault: LinkFault) {
        if self.state == RouterState::Done {
            return;
        }
        let stage = self.stage();
        for other in [self.prefill.clone(), self.decode.clone()] {
            if other != *to {
                self.send(other, Body::Abort);
            }
        }
        self.complete_failed(
            stage,
            Failure::Unreachable {
                to: to.clone(),
                fault,
            },
        );
    }

    /// The client went away (disconnect, cancel): both legs are told to free what they hold now,
    /// and the request ends with a failure naming the router.
    pub fn handle_cancel(&mut self) {
        if self.state == RouterState::Done {
            return;
        }
        self.abort_both(Stage::Router, Failure::Cancelled);
    }

    /// Time passed: at the deadline the request fails naming the stage, and both legs are told
    /// to free what they hold.
    pub fn handle_timeout(&mut self, now_ms: u64) {
        if self.state == RouterState::Done || now_ms < self.deadline_ms {
            return;
        }
        self.abort_both(self.stage(), Failure::DeadlinePassed);
    }

    /// The stage an open request is in.
    fn stage(&self) -> Stage {
        match self.state {
            RouterState::Prefilling => Stage::Prefill,
            _ => Stage::Decode,
        }
    }

    /// Tells both legs to free what they hold and ends the request as failed.
    fn abort_both(&mut self, stage: Stage, reason: Failure) {
        self.send(self.prefill.clone(), Body::Abort);
        self.send(self.decode.clone(), Body::Abort);
        self.complete_failed(stage, reason);
    }

    fn send(&mut self, to: NodeId, body: Body) {
        self.commands.push_back(RouterCommand::Send { to, body });
    }

    fn complete_failed(&mut self, stage: Stage, reason: Failure) {
        self.state = RouterState::Done;
        self.commands
            .push_back(RouterCommand::Complete(RequestOutcome::Failed { stage, reason }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grant::GrantError;

    fn node(name: &str) -> NodeId {
        NodeId(name.into())
    }

    /// Which leg a failure lets a request start over without, from the policy's definition.
    #[test]
    fn a_request_starts_over_without_the_leg_that_failed_it_and_only_then() {
        let (p, d) = (node("prefill-0"), node("decode-0"));
        let other = node("prefill-1");
        let retry = |stage, reason: Failure| leg_to_retry_without(stage, &reason, &p, &d).cloned();
        // The prefill leg lost before it committed: start over elsewhere.
        assert_eq!(
            retry(Stage::Prefill, Failure::LegLost(p.clone())),
            Some(p.clone())
        );
        assert_eq!(
            retry(
                Stage::Prefill,
                Failure::Refused {
                    node: p.clone(),
                    reason: crate::wire::RefusalReason::Draining
                }
            ),
            Some(p.clone())
        );
        // Another node's loss is not this prefill's fault.
        assert_eq!(retry(Stage::Prefill, Failure::LegLost(other.clone())), None);
        // A prefill failing on its own would fail again elsewhere.
        assert_eq!(
            retry(
                Stage::Prefill,
                Failure::NoFreeBlocks {
                    waited_ms: 5,
                    last: AllocError::OutOfBlocks {
                        group: 0,
                        kind: crate::layout::GroupKind::Full,
                        needed: 1,
                        free: 0,
                    }
                }
            ),
            None
        );
        // The READ of the prefill's KV failed: recompute on another prefill leg.
        assert_eq!(
            retry(Stage::Read, Failure::Read("connection reset".into())),
            Some(p.clone())
        );
        assert_eq!(
            retry(Stage::Read, Failure::Grant(GrantError::Expired(GrantId(1)))),
            Some(p.clone())
        );
        assert_eq!(
            retry(
                Stage::Read,
                Failure::StaleBlock {
                    group: 0,
                    block: 3,
                    expected: 1,
                    found: 2
                }
            ),
            Some(p.clone())
        );
        // ... but not when time ran out or the client left.
        assert_eq!(retry(Stage::Read, Failure::DeadlinePassed), None);
        assert_eq!(retry(Stage::Read, Failure::Cancelled), None);
        // The decode leg lost at any stage: start over without it.
        assert_eq!(retry(Stage::Read, Failure::LegLost(d.clone())), Some(d.clone()));
        assert_eq!(retry(Stage::Decode, Failure::LegLost(d.clone())), Some(d.clone()));
        assert_eq!(
            retry(
                Stage::Decode,
                Failure::Unreachable {
                    to: d.clone(),
                    fault: LinkFault::Closed
                }
            ),
            Some(d.clone())
        );
        // A decode failing on its own (after its READ) is not retried.
        assert_eq!(retry(Stage::Decode, Failure::Engine("nan".into())), None);
        assert_eq!(retry(Stage::Decode, Failure::Read("late".into())), None);
    }
}
