//! The error a request fails with, whichever actor it failed in.

use pdkv_core::allocator::AllocError;
use pdkv_core::grant::GrantError;
use pdkv_core::wire::{Failure, Stage};
use pdkv_transport::engine::EngineError as ReadEngineError;

use crate::config::PromptTooLong;

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
    /// The grant was refused or is gone.
    #[error("grant failed: {0}")]
    Grant(#[from] GrantError),
    /// The READ failed (partial READs fail the request).
    #[error("read failed: {0}")]
    Read(#[from] ReadEngineError),
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
    /// No leg of a role is linked (both ways) to the router, besides those this request
    /// already failed on.
    #[error("no {role} leg is linked{}", besides(.avoided))]
    NoLeg {
        /// The role wanted.
        role: pdkv_core::wire::Role,
        /// Legs this request failed on and did not try again.
        avoided: Vec<pdkv_core::wire::NodeId>,
    },
    /// A leg answered the router with a message of another kind than the one asked for.
    #[error("unexpected answer {0}")]
    UnexpectedAnswer(&'static str),
    /// A leg failed the request in `stage`; the failure names the fault.
    #[error("{failure}")]
    Failed {
        /// Where.
        stage: Stage,
        /// What.
        failure: Failure,
    },
}

/// Why a cluster, a node or one of its legs could not start: configuration the machine cannot
/// honour, memory or engines that cannot be had, links that cannot be set up. A request never
/// fails with these; a start that fails with one runs no request at all.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
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
    /// The mori READ engine a node's configuration asks for cannot start.
    #[error("node {node}: the mori READ engine cannot start: {source}")]
    MoriStart {
        /// The node.
        node: String,
        /// What is missing or failed.
        source: pdkv_transport::mori::MoriError,
    },
    /// The GPU memory a node's configuration asks for cannot be had.
    #[error("node {node}: KV memory on GPU {gpu}: {source}")]
    GpuMemory {
        /// The node.
        node: String,
        /// The configured HIP device index.
        gpu: u32,
        /// What is missing or failed.
        source: pdkv_transport::region::RegionError,
    },
    /// A link between nodes could not be set up.
    #[error("link to {peer}: {detail}")]
    Link {
        /// The peer.
        peer: String,
        /// Why.
        detail: String,
    },
    /// A leg's KV memory could not be created.
    #[error("node {node}: KV memory: {source}")]
    Memory {
        /// The node.
        node: String,
        /// What failed.
        source: pdkv_transport::region::RegionError,
    },
    /// The allocator refused the node's configured capacities.
    #[error("allocator: {0}")]
    Allocator(#[from] AllocError),
    /// A READ engine could not be created.
    #[error("READ engine: {0}")]
    Engine(#[from] ReadEngineError),
    /// The configuration names a node the cluster does not have.
    #[error("unknown node {0}")]
    UnknownNode(String),
    /// An actor of a starting leg did not answer.
    #[error("{actor} unreachable while starting: {detail}")]
    Mailbox {
        /// Which actor.
        actor: &'static str,
        /// Mailbox closed or timed out.
        detail: String,
    },
}

impl From<actix::MailboxError> for StartError {
    fn from(error: actix::MailboxError) -> Self {
        StartError::Mailbox {
            actor: "leg",
            detail: error.to_string(),
        }
    }
}

impl RequestError {
    /// How a leg reports this error on the wire.
    pub fn to_failure(&self) -> Failure {
        match self {
            RequestError::EmptyPrompt => Failure::EmptyPrompt,
            RequestError::SlotOverflow {
                tokens,
                lookahead_tokens,
            } => Failure::SlotOverflow {
                tokens: *tokens,
                lookahead_tokens: *lookahead_tokens,
            },
            RequestError::Alloc(error) => Failure::Alloc(error.clone()),
            RequestError::Grant(error) => Failure::Grant(error.clone()),
            RequestError::Read(error) => Failure::Read(error.to_string()),
            RequestError::Timeout { .. } => Failure::DeadlinePassed,
            RequestError::Failed { failure, .. } => failure.clone(),
            other => Failure::Engine(other.to_string()),
        }
    }

    /// The error a client sees for a request that failed in `stage`: a passed deadline names
    /// the request's budget.
    pub fn from_failure(stage: Stage, failure: Failure, budget_ms: u64) -> Self {
        match failure {
            Failure::DeadlinePassed => RequestError::Timeout {
                stage: stage.as_str(),
                after_ms: budget_ms,
            },
            failure => RequestError::Failed { stage, failure },
        }
    }
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

/// `" besides a, b (this request failed there)"`, or nothing.
fn besides(avoided: &[pdkv_core::wire::NodeId]) -> String {
    if avoided.is_empty() {
        return String::new();
    }
    let names: Vec<&str> = avoided.iter().map(|node| node.0.as_str()).collect();
    format!(" besides {} (this request failed there)", names.join(", "))
}
