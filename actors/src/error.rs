//! The error a request fails with, whichever actor it failed in.

use pdkv_core::allocator::AllocError;
use pdkv_core::block::BlockId;
use pdkv_core::exchange::ExchangeError;
use pdkv_core::grant::GrantError;
use pdkv_core::plan::PlanError;
use pdkv_transport::engine::EngineError as ReadEngineError;

use crate::config::PromptTooLong;
use crate::engine::EngineError;

/// Why a request failed. Every variant says which step and what was wrong; none is retried
/// silently, and a decode leg never answers from KV it could not verify.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// A prompt must hold at least one token.
    #[error("empty prompt: at least one token is required")]
    EmptyPrompt,
    /// No node of the cluster can hold the prompt with its lookahead tail.
    #[error(transparent)]
    PromptTooLong(#[from] PromptTooLong),
    /// A prompt plus the leg's lookahead tail does not fit in 64 bits of token slots.
    #[error("{tokens} prompt tokens plus {lookahead_tokens} lookahead tokens overflow the slot count")]
    SlotOverflow {
        /// Prompt tokens the leg computes.
        tokens: u64,
        /// The leg's lookahead.
        lookahead_tokens: u64,
    },
    /// The allocator refused.
    #[error("allocation failed: {0}")]
    Alloc(#[from] AllocError),
    /// No blocks freed up in time.
    #[error("no free blocks within {waited_ms} ms: {last}")]
    AllocTimeout {
        /// How long the request waited.
        waited_ms: u64,
        /// The allocator's last refusal.
        last: AllocError,
    },
    /// Too many requests already wait for blocks on this leg.
    #[error("{leg}: wait queue full ({capacity} requests wait for blocks)")]
    QueueFull {
        /// Leg name.
        leg: String,
        /// Queue capacity.
        capacity: usize,
    },
    /// The exchange refused to pair.
    #[error("exchange failed: {0}")]
    Exchange(#[from] ExchangeError),
    /// The transfer plan could not be built.
    #[error("transfer plan failed: {0}")]
    Plan(#[from] PlanError),
    /// The grant was refused or is gone.
    #[error("grant failed: {0}")]
    Grant(#[from] GrantError),
    /// The READ failed (partial READs fail the request).
    #[error("read failed: {0}")]
    Read(#[from] ReadEngineError),
    /// A block was freed and possibly reused while being read.
    #[error(
        "group {group}: prefill block {block} changed generation during the read ({expected} -> {found})"
    )]
    StaleBlock {
        /// Group index.
        group: usize,
        /// Prefill block id.
        block: BlockId,
        /// Generation at grant time.
        expected: u32,
        /// Generation after the copy.
        found: u32,
    },
    /// The engine could not compute.
    #[error("engine failed: {0}")]
    Engine(#[from] EngineError),
    /// An actor could not be reached or did not answer in time.
    #[error("{actor} unreachable: {detail}")]
    Mailbox {
        /// Which actor.
        actor: &'static str,
        /// Mailbox closed or timed out.
        detail: String,
    },
    /// The whole request ran out of time.
    #[error("request timed out after {after_ms} ms in {stage}")]
    Timeout {
        /// Stage that was running.
        stage: &'static str,
        /// The bound.
        after_ms: u64,
    },
    /// The request names a node the cluster does not know.
    #[error("unknown node {0}")]
    UnknownNode(String),
    /// An in-process cluster on shared memory would map more regions than the kernel allows.
    #[error(
        "read_engine = \"shm\" in one process needs {needed} memory mappings ({decode} decode legs x {prefill} prefill legs x {regions} regions, plus each leg's own {regions}), more than the {usable} that vm.max_map_count = {limit} leaves after {reserved} for the rest of the process: use fewer nodes, read_engine = \"local\", or raise vm.max_map_count"
    )]
    MapLimit {
        /// Mappings the cluster needs.
        needed: u64,
        /// Decode legs.
        decode: u64,
        /// Prefill legs.
        prefill: u64,
        /// Regions per leg (layers and generation tables).
        regions: u64,
        /// `vm.max_map_count`.
        limit: u64,
        /// Mappings kept for libraries, thread stacks and heap.
        reserved: u64,
        /// What is left for KV regions.
        usable: u64,
    },
    /// The OS gave no randomness for a leg's incarnation.
    #[error("no randomness for an incarnation: {0}")]
    NoRandomness(String),
    /// The KV parameters do not fit this decode leg.
    #[error("bad kv params: {0}")]
    BadParams(String),
}

/// Sends `message` to `addr`, mapping mailbox failures to [`RequestError::Mailbox`].
pub async fn ask<A, M>(
    addr: &actix::Addr<A>,
    message: M,
    actor: &'static str,
) -> Result<M::Result, RequestError>
where
    A: actix::Actor + actix::Handler<M>,
    A::Context: actix::dev::ToEnvelope<A, M>,
    M: actix::Message + Send + 'static,
    M::Result: Send,
{
    addr.send(message).await.map_err(|error| RequestError::Mailbox {
        actor,
        detail: error.to_string(),
    })
}
