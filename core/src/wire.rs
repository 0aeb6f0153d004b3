//! Wire types: what crosses the network between nodes.
//!
//! These are plain serde types; the transport crate owns their encoding (one codec module) and
//! framing. Everything here is also what the in-process actors exchange, so a cluster in one
//! process and a cluster across hosts run the same protocol.

use serde::{Deserialize, Serialize};

use crate::allocator::AllocError;
use crate::exchange::{ExchangeError, Offer};
use crate::grant::GrantError;
use crate::leg::GenerationCheckError;
use crate::plan::PlanError;
use crate::sampling::{Finish, Sampling, SamplingError, TokenLogprobs};

/// A request's id, unique within a cluster run (assigned by the router).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RequestId(pub u64);

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "req-{}", self.0)
    }
}

/// A node's name as written in `cluster.toml`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct NodeId(pub String);

impl std::fmt::Display for NodeId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Id of a grant: the prefill leg's permission for one decode leg to READ one request's blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct GrantId(pub u64);

/// What the prefill leg hands the router when a request's KV is ready: the offer and the grant
/// under which the decode leg may READ it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvParams {
    /// The request.
    pub request: RequestId,
    /// The prefill node holding the KV.
    pub prefill_node: NodeId,
    /// The incarnation of the prefill node that issued the grant: a restarted node's grant ids
    /// start over, so a READ, renewal or release names the incarnation it means.
    pub prefill_incarnation: Incarnation,
    /// Per-group blocks the decode leg may read.
    pub offer: Offer,
    /// Generation of every offered block when it was granted, parallel to `offer.groups[g].blocks`;
    /// a READ that finds another generation afterwards raced a free and fails.
    pub generations: Vec<Vec<u32>>,
    /// The grant covering those blocks.
    pub grant: GrantId,
    /// How long the grant lives unless renewed, in milliseconds.
    pub lease_ms: u64,
}

/// A random id a node draws at every process start. Messages carry it so a peer can tell a
/// restarted node from the one it knew: nothing promised by an old incarnation (grants, offers,
/// requests in flight) is served by or to the new one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Incarnation(pub u64);

impl std::fmt::Display for Incarnation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// Where a request failed, named in every failure that crosses the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    /// The prefill leg: waiting for blocks, computing, offering, granting.
    Prefill,
    /// The decode leg's READ of the prefill leg's KV.
    Read,
    /// The decode leg: waiting for blocks, pairing, decoding.
    Decode,
    /// The router, between the legs.
    Router,
}

impl Stage {
    /// The stage's name as logs and errors print it.
    pub fn as_str(self) -> &'static str {
        match self {
            Stage::Prefill => "prefill",
            Stage::Read => "read",
            Stage::Decode => "decode",
            Stage::Router => "router",
        }
    }
}

impl std::fmt::Display for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A node's part in the cluster, named the same in `cluster.toml`, the handshake and the
/// exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Computes prompts and grants READs of their KV.
    Prefill,
    /// READs KV and decodes.
    Decode,
    /// Sends requests to legs and answers clients (not a leg: no `[[nodes]]` entry has it).
    Router,
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Router => "router",
        })
    }
}

/// Why a request failed, as it crosses the wire: each variant names the fault, so a router (and
/// its client) can tell a timeout from a full queue from KV that failed verification.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum Failure {
    /// The request's deadline passed.
    #[error("deadline passed")]
    DeadlinePassed,
    /// A prompt must hold at least one token.
    #[error("empty prompt: at least one token is required")]
    EmptyPrompt,
    /// Prompt plus lookahead do not fit in 64 bits of token slots.
    #[error("{tokens} prompt tokens plus {lookahead_tokens} lookahead tokens overflow the slot count")]
    SlotOverflow {
        /// Prompt tokens the leg holds.
        tokens: u64,
        /// The leg's lookahead.
        lookahead_tokens: u64,
    },
    /// No blocks freed up within the leg's wait bound.
    #[error("no free blocks within {waited_ms} ms: {last}")]
    NoFreeBlocks {
        /// The wait bound.
        waited_ms: u64,
        /// The allocator's last refusal.
        last: AllocError,
    },
    /// Too many requests already wait for blocks on the leg.
    #[error("{leg}: wait queue full ({capacity} requests wait for blocks)")]
    QueueFull {
        /// The leg.
        leg: NodeId,
        /// Queue capacity.
        capacity: u64,
    },
    /// The allocator refused for good (the request can never fit, or is malformed).
    #[error("allocation failed: {0}")]
    Alloc(AllocError),
    /// The exchange refused to pair (a needed position missing on either leg, …).
    #[error("exchange failed: {0}")]
    Exchange(ExchangeError),
    /// The transfer plan could not be built.
    #[error("transfer plan failed: {0}")]
    Plan(PlanError),
    /// The grant was refused or is gone.
    #[error("grant failed: {0}")]
    Grant(GrantError),
    /// The READ failed or was partial.
    #[error("read failed: {0}")]
    Read(String),
    /// A source block was freed (and maybe reused) while it was read.
    #[error(
        "group {group}: prefill block {block} changed generation during the read ({expected} -> {found})"
    )]
    StaleBlock {
        /// Group index.
        group: u64,
        /// Prefill block id.
        block: u32,
        /// Generation at grant time.
        expected: u32,
        /// Generation after the copy.
        found: u32,
    },
    /// The engine could not compute.
    #[error("engine failed: {0}")]
    Engine(String),
    /// The KV parameters do not fit the decode leg.
    #[error("bad kv params: {0}")]
    BadParams(ParamsError),
    /// A leg of the request was lost (its link failed, it restarted).
    #[error("leg {0} was lost")]
    LegLost(NodeId),
    /// A message for the request could not be delivered.
    #[error("{to} unreachable: {fault}")]
    Unreachable {
        /// The node.
        to: NodeId,
        /// Why.
        fault: LinkFault,
    },
    /// A node refused the request.
    #[error("refused by {node}: {reason}")]
    Refused {
        /// The refusing node.
        node: NodeId,
        /// Why.
        reason: RefusalReason,
    },
    /// The client cancelled.
    #[error("cancelled by the client")]
    Cancelled,
    /// A leg's request machine was driven out of order (a bug in its shell, never the client's
    /// fault).
    #[error("internal fault: {0}")]
    Internal(InternalFault),
}

impl Failure {
    /// A short stable name for the failure's kind (metric labels, summaries): the typed
    /// allocator, exchange, plan and grant errors name their own variant.
    pub fn kind(&self) -> &'static str {
        match self {
            Failure::DeadlinePassed => "deadline_passed",
            Failure::EmptyPrompt => "empty_prompt",
            Failure::SlotOverflow { .. } => "slot_overflow",
            Failure::NoFreeBlocks { .. } => "no_free_blocks",
            Failure::QueueFull { .. } => "queue_full",
            Failure::Alloc(AllocError::NeverFits { .. }) => "alloc_never_fits",
            Failure::Alloc(_) => "alloc",
            Failure::Exchange(_) => "exchange",
            Failure::Plan(_) => "plan",
            Failure::Grant(GrantError::Expired(_)) => "grant_expired",
            Failure::Grant(GrantError::Revoked(_)) => "grant_revoked",
            Failure::Grant(GrantError::TableFull { .. }) => "grant_table_full",
            Failure::Grant(_) => "grant",
            Failure::Read(_) => "read",
            Failure::StaleBlock { .. } => "stale_block",
            Failure::Engine(_) => "engine",
            Failure::BadParams(_) => "bad_params",
            Failure::LegLost(_) => "leg_lost",
            Failure::Unreachable { .. } => "unreachable",
            Failure::Refused { .. } => "refused",
            Failure::Cancelled => "cancelled",
            Failure::Internal(_) => "internal",
        }
    }
}

/// Why a message could not be handed to the link to its node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum LinkFault {
    /// The sender has no link to the node (never linked, or the link is down).
    #[error("no link")]
    NoLink,
    /// The link has as many messages in flight as it may.
    #[error("the link is full")]
    Full,
    /// The link closed (the node's actors stopped or its connection ended).
    #[error("the link is closed")]
    Closed,
}

/// Why a node refused a request it was sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum RefusalReason {
    /// The leg is draining: it finishes what it has and takes nothing new.
    #[error("draining: the leg is shutting down")]
    Draining,
    /// A router found no leg it had not already failed on.
    #[error("no leg left to try")]
    NoLegLeft,
}

/// Why a decode leg cannot use the KV parameters (or the decode request) it was sent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum ParamsError {
    /// The offer covers another number of prompt tokens than the prompt sent with it.
    #[error("offer is for {offer} tokens, prompt has {prompt}")]
    PromptLength {
        /// Tokens the offer covers.
        offer: u64,
        /// Tokens of the prompt.
        prompt: u64,
    },
    /// The parameters belong to another request than the message carrying them.
    #[error("kv params are for {params}, the message for {message}")]
    ForAnotherRequest {
        /// The request the parameters name.
        params: RequestId,
        /// The request of the message.
        message: RequestId,
    },
    /// The sampling asked for cannot be honoured.
    #[error("sampling: {0}")]
    Sampling(SamplingError),
    /// The parameters cannot say which generation a paired block had.
    #[error("{0}")]
    Checks(GenerationCheckError),
    /// A decode request reached a leg that does not read KV.
    #[error("{0} is a prefill leg and cannot read")]
    NotAReader(NodeId),
}

/// A request machine's input that its state says cannot arrive: the shell that drives it broke
/// the machine's contract.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum InternalFault {
    /// A prefill machine's grant answer arrived before its offer was built.
    #[error("a grant arrived before the offer it covers")]
    GrantedWithoutOffer,
    /// A decode machine was asked to pair before its blocks were allocated.
    #[error("pairing was asked before the blocks were allocated")]
    PairedBeforeAllocating,
    /// A machine gave up waiting for blocks without ever having been refused any.
    #[error("a wait for blocks ended that no refusal started")]
    WaitedWithoutRefusal,
}

/// What a decode leg answers when a request is done.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DecodeOutput {
    /// Generated tokens.
    pub tokens: Vec<u32>,
    /// Digest of every generated step's logits (bitwise), to compare with a one-leg run.
    pub logits_digest: u64,
    /// Bytes the decode leg read.
    pub read_bytes: u64,
    /// READ runs posted.
    pub read_runs: u64,
    /// Prefix-hit blocks the decode leg reused.
    pub cached_blocks: u64,
    /// Why generation ended.
    pub finish: Finish,
    /// Per generated token, when the request asked for log-probabilities (else empty).
    pub logprobs: Vec<TokenLogprobs>,
}

/// Everything that crosses between the router and the legs, or between legs, for one request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Body {
    /// Router → prefill leg: compute `prompt` and grant `decode` a READ of its KV.
    Prefill {
        /// Prompt token ids.
        prompt: Vec<u32>,
        /// The decode leg that will read.
        decode: NodeId,
    },
    /// Prefill leg → router: the KV is ready to READ under the grant in `params`.
    KvReady(KvParams),
    /// Router → decode leg: READ the KV in `params`, recompute the last prompt token, decode.
    Decode {
        /// The prompt's token ids (the decode leg needs them for prefix hits and the last
        /// token); as many as `params.offer.num_prompt_tokens`.
        prompt: Vec<u32>,
        /// What the prefill leg handed back.
        params: KvParams,
        /// Tokens to generate.
        max_tokens: u32,
        /// Send the router each token as it is generated (`Tokens`), for a streaming client.
        stream: bool,
        /// How each token is chosen and when generation stops.
        sampling: Sampling,
    },
    /// Decode leg → prefill leg: still waiting, keep the grant.
    Renew {
        /// The grant.
        grant: GrantId,
        /// The prefill incarnation that issued it.
        issuer: Incarnation,
    },
    /// Prefill leg → decode leg: the lease now runs `lease_ms` from when this was sent.
    Renewed {
        /// The grant.
        grant: GrantId,
        /// Lease length.
        lease_ms: u64,
    },
    /// Decode leg → prefill leg: the READ is over (done or failed), unpin.
    Release {
        /// The grant.
        grant: GrantId,
        /// The prefill incarnation that issued it.
        issuer: Incarnation,
    },
    /// Router → legs: the request is over for the client; free everything it holds now.
    Abort,
    /// Decode leg → router: the request's answer.
    Output(DecodeOutput),
    /// Any node → router or peer: the request failed in `stage`, and why.
    Failed {
        /// Where it failed.
        stage: Stage,
        /// Why.
        reason: Failure,
    },
    /// Leg → router, now and then (about no request): how loaded the leg is, for the router's
    /// choice of legs.
    Load(LegLoad),
    /// Decode leg → router, for a streaming request: tokens just generated, in order. The
    /// `Output` at the end still carries every token; these only let the client see them early.
    Tokens {
        /// The tokens.
        tokens: Vec<u32>,
    },
}

/// What a leg reports of its load.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct LegLoad {
    /// Requests holding or waiting for blocks on the leg.
    pub requests: u64,
    /// Live grants (prefill legs).
    pub grants: u64,
    /// Free blocks per group.
    pub free_blocks: Vec<u64>,
    /// Blocks per group.
    pub capacity: Vec<u64>,
}

impl LegLoad {
    /// Whether nothing is held: free equals capacity in every group, no request, no grant.
    pub fn is_idle(&self) -> bool {
        self.requests == 0
            && self.grants == 0
            && self.free_blocks.len() == self.capacity.len()
            && self
                .free_blocks
                .iter()
                .zip(&self.capacity)
                .all(|(free, capacity)| free == capacity)
    }

    /// Blocks in use over all groups (capacity less free).
    pub fn held_blocks(&self) -> u64 {
        self.free_blocks
            .iter()
            .zip(&self.capacity)
            .map(|(&free, &capacity)| capacity.saturating_sub(free))
            .sum()
    }

    /// The free share of the scarcest group, in 0..=1 (1 when the leg reports no groups).
    pub fn free_share(&self) -> f64 {
        self.free_blocks
            .iter()
            .zip(&self.capacity)
            .filter(|(_, capacity)| **capacity > 0)
            .map(|(&free, &capacity)| free as f64 / capacity as f64)
            .fold(1.0, f64::min)
    }
}

impl Body {
    /// The message's kind, as logs, refusals and fault scripts name it.
    pub fn kind(&self) -> &'static str {
        match self {
            Body::Prefill { .. } => "prefill",
            Body::KvReady(_) => "kv_ready",
            Body::Decode { .. } => "decode",
            Body::Renew { .. } => "renew",
            Body::Renewed { .. } => "renewed",
            Body::Release { .. } => "release",
            Body::Abort => "abort",
            Body::Output(_) => "output",
            Body::Failed { .. } => "failed",
            Body::Load(_) => "load",
            Body::Tokens { .. } => "tokens",
        }
    }
}

/// One message of the leg protocol: which request it is about, who sent it (name and
/// incarnation), how much of the request's time budget was left when it was sent, and the body.
///
/// The budget travels as a duration, not a wall-clock instant, so nodes need no synchronised
/// clocks: a receiver's deadline is its own receive time plus `budget_ms`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Envelope {
    /// The request.
    pub request: RequestId,
    /// The sending node.
    pub from: NodeId,
    /// The sender's incarnation.
    pub incarnation: Incarnation,
    /// Milliseconds of the request's deadline left when sent.
    pub budget_ms: u64,
    /// What it says.
    pub body: Body,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_print_as_logs_show_them() {
        assert_eq!(RequestId(7).to_string(), "req-7");
        assert_eq!(NodeId("decode-0".into()).to_string(), "decode-0");
        assert_eq!(Incarnation(0xab).to_string(), "00000000000000ab");
        assert_eq!(Stage::Read.to_string(), "read");
    }

    #[test]
    fn a_load_is_idle_only_with_every_block_free_and_nothing_running() {
        let idle = LegLoad {
            requests: 0,
            grants: 0,
            free_blocks: vec![64, 32],
            capacity: vec![64, 32],
        };
        assert!(idle.is_idle());
        assert_eq!(idle.held_blocks(), 0);
        let held = LegLoad {
            free_blocks: vec![60, 31],
            ..idle.clone()
        };
        assert!(!held.is_idle());
        assert_eq!(held.held_blocks(), 5);
        assert!(
            !LegLoad {
                requests: 1,
                ..idle.clone()
            }
            .is_idle()
        );
        assert!(
            !LegLoad {
                grants: 1,
                ..idle.clone()
            }
            .is_idle()
        );
        let missing_group = LegLoad {
            free_blocks: vec![64],
            ..idle
        };
        assert!(!missing_group.is_idle(), "a group not reported is not idle");
    }
}
