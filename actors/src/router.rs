//! The router: sends a request to a prefill leg, then its KV parameters to a decode leg.
//!
//! Legs are picked round-robin per role. The whole request is bounded by
//! `limits.request_timeout_ms`; a request cut short here still releases everything it held on
//! the legs (the decode leg releases its grant; a lapsed lease releases one never read).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use actix::{Actor, Addr, Context, Handler, Message, ResponseFuture};
use pdkv_core::wire::{NodeId, RequestId};

use crate::config::{PromptLimit, PromptTooLong};
use crate::error::{RequestError, ask};
use crate::scheduler::{Decode, Direct, Output, Prefill, Scheduler};

/// Immutable routing state shared by in-flight requests.
pub struct RouterContext {
    prefill: Vec<(NodeId, Addr<Scheduler>)>,
    decode: Vec<(NodeId, Addr<Scheduler>)>,
    next_request: AtomicU64,
    next_prefill: AtomicUsize,
    next_decode: AtomicUsize,
    request_timeout: Duration,
    prompt_limit: PromptLimit,
}

impl RouterContext {
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

    fn pick(legs: &[(NodeId, Addr<Scheduler>)], next: &AtomicUsize) -> Option<(NodeId, Addr<Scheduler>)> {
        if legs.is_empty() {
            return None;
        }
        let index = next.fetch_add(1, Ordering::Relaxed) % legs.len();
        Some(legs[index].clone())
    }

    async fn generate(&self, prompt: Arc<[u32]>, max_tokens: u32) -> Result<Output, RequestError> {
        self.check_prompt(&prompt)?;
        let request = RequestId(self.next_request.fetch_add(1, Ordering::Relaxed));
        let (prefill_node, prefill) = Self::pick(&self.prefill, &self.next_prefill)
            .ok_or_else(|| RequestError::UnknownNode("no prefill leg".into()))?;
        let (decode_node, decode) = Self::pick(&self.decode, &self.next_decode)
            .ok_or_else(|| RequestError::UnknownNode("no decode leg".into()))?;
        let deadline = tokio::time::Instant::now() + self.request_timeout;
        let timeout_ms = self.request_timeout.as_millis() as u64;
        let message = Prefill {
            request,
            prompt,
            peer: decode_node.clone(),
        };
        let params = tokio::time::timeout_at(deadline, ask(&prefill, message, "prefill scheduler"))
            .await
            .map_err(|_| RequestError::Timeout {
                stage: "prefill",
                after_ms: timeout_ms,
            })???;
        tracing::debug!(%request, prefill = %prefill_node, decode = %decode_node, "prefilled");
        let message = Decode { params, max_tokens };
        tokio::time::timeout_at(deadline, ask(&decode, message, "decode scheduler"))
            .await
            .map_err(|_| RequestError::Timeout {
                stage: "decode",
                after_ms: timeout_ms,
            })??
    }

    async fn direct(
        &self,
        prompt: Arc<[u32]>,
        max_tokens: u32,
        node: Option<NodeId>,
    ) -> Result<Output, RequestError> {
        self.check_prompt(&prompt)?;
        let request = RequestId(self.next_request.fetch_add(1, Ordering::Relaxed));
        let scheduler = match node {
            Some(node) => self
                .prefill
                .iter()
                .chain(&self.decode)
                .find(|(name, _)| *name == node)
                .map(|(_, addr)| addr.clone())
                .ok_or_else(|| RequestError::UnknownNode(node.to_string()))?,
            None => {
                Self::pick(&self.prefill, &self.next_prefill)
                    .ok_or_else(|| RequestError::UnknownNode("no prefill leg".into()))?
                    .1
            }
        };
        let message = Direct {
            request,
            prompt,
            max_tokens,
        };
        tokio::time::timeout(self.request_timeout, ask(&scheduler, message, "scheduler"))
            .await
            .map_err(|_| RequestError::Timeout {
                stage: "direct",
                after_ms: self.request_timeout.as_millis() as u64,
            })??
    }
}

/// The router actor.
pub struct Router {
    context: Arc<RouterContext>,
    mailbox: usize,
}

impl Router {
    /// A router over the given legs.
    pub fn new(
        prefill: Vec<(NodeId, Addr<Scheduler>)>,
        decode: Vec<(NodeId, Addr<Scheduler>)>,
        request_timeout: Duration,
        prompt_limit: PromptLimit,
        mailbox: usize,
    ) -> Self {
        Router {
            context: Arc::new(RouterContext {
                prefill,
                decode,
                next_request: AtomicU64::new(1),
                next_prefill: AtomicUsize::new(0),
                next_decode: AtomicUsize::new(0),
                request_timeout,
                prompt_limit,
            }),
            mailbox,
        }
    }
}

impl Actor for Router {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.set_mailbox_capacity(self.mailbox);
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
}

impl Handler<Generate> for Router {
    type Result = ResponseFuture<Result<Output, RequestError>>;

    fn handle(&mut self, msg: Generate, _ctx: &mut Self::Context) -> Self::Result {
        let context = self.context.clone();
        Box::pin(async move { context.generate(msg.prompt, msg.max_tokens).await })
    }
}

/// Serve a request on one leg alone (the reference output).
#[derive(Debug, Message)]
#[rtype(result = "Result<Output, RequestError>")]
pub struct GenerateDirect {
    /// Prompt tokens.
    pub prompt: Arc<[u32]>,
    /// Tokens to generate.
    pub max_tokens: u32,
    /// The leg to run on (default: a prefill leg).
    pub node: Option<NodeId>,
}

impl Handler<GenerateDirect> for Router {
    type Result = ResponseFuture<Result<Output, RequestError>>;

    fn handle(&mut self, msg: GenerateDirect, _ctx: &mut Self::Context) -> Self::Result {
        let context = self.context.clone();
        Box::pin(async move { context.direct(msg.prompt, msg.max_tokens, msg.node).await })
    }
}
