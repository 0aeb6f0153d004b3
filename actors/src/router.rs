//! The router: sends a request to a prefill leg, then its KV parameters to a decode leg.
//!
//! Legs are picked round-robin per role. The whole request is bounded by
//! `limits.request_timeout_ms`, a deadline both legs are told: a prefill leg hands out no grant
//! after it, a decode leg stops waiting and releases by then. A request cut short here releases
//! what it held at once: a grant that arrives after the router gave up on the prefill stage is
//! released by the router itself, not left to its lease.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use actix::{Actor, Addr, Context, Handler, Message, Recipient, ResponseFuture};
use pdkv_core::wire::{NodeId, RequestId};

use crate::allocator::ReleaseGrant;
use crate::config::{PromptLimit, PromptTooLong};
use crate::error::{RequestError, ask};
use crate::scheduler::{Deadline, Decode, Direct, Output, Prefill, Scheduler};

/// A prefill leg as the router sees it.
#[derive(Clone)]
pub struct PrefillRoute {
    /// Its name.
    pub node: NodeId,
    /// Its scheduler.
    pub scheduler: Addr<Scheduler>,
    /// Where to release a grant nobody will read.
    pub release: Recipient<ReleaseGrant>,
}

/// Immutable routing state shared by in-flight requests.
pub struct RouterContext {
    prefill: Vec<PrefillRoute>,
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

    fn pick<T: Clone>(legs: &[T], next: &AtomicUsize) -> Option<T> {
        if legs.is_empty() {
            return None;
        }
        let index = next.fetch_add(1, Ordering::Relaxed) % legs.len();
        Some(legs[index].clone())
    }

    async fn generate(&self, prompt: Arc<[u32]>, max_tokens: u32) -> Result<Output, RequestError> {
        self.check_prompt(&prompt)?;
        let request = RequestId(self.next_request.fetch_add(1, Ordering::Relaxed));
        let route = Self::pick(&self.prefill, &self.next_prefill)
            .ok_or_else(|| RequestError::UnknownNode("no prefill leg".into()))?;
        let (decode_node, decode) = Self::pick(&self.decode, &self.next_decode)
            .ok_or_else(|| RequestError::UnknownNode("no decode leg".into()))?;
        let deadline = Deadline::after(self.request_timeout);
        let message = Prefill {
            request,
            prompt,
            peer: decode_node.clone(),
            deadline,
        };
        // Spawned, so that an answer arriving after the deadline is still seen (and released).
        let scheduler = route.scheduler.clone();
        let mut prefill = actix::spawn(async move { ask(&scheduler, message, "prefill scheduler").await });
        let params = match tokio::time::timeout_at(deadline.at.into(), &mut prefill).await {
            Ok(joined) => joined.map_err(|error| RequestError::Mailbox {
                actor: "prefill scheduler",
                detail: error.to_string(),
            })???,
            Err(_) => {
                release_late_grant(prefill, route.release.clone(), decode_node, request);
                return Err(deadline.passed("prefill"));
            }
        };
        tracing::debug!(%request, prefill = %route.node, decode = %decode_node, "prefilled");
        let message = Decode {
            params,
            max_tokens,
            deadline,
        };
        tokio::time::timeout_at(deadline.at.into(), ask(&decode, message, "decode scheduler"))
            .await
            .map_err(|_| deadline.passed("decode"))??
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
                .map(|route| (&route.node, &route.scheduler))
                .chain(self.decode.iter().map(|(name, addr)| (name, addr)))
                .find(|(name, _)| **name == node)
                .map(|(_, addr)| addr.clone())
                .ok_or_else(|| RequestError::UnknownNode(node.to_string()))?,
            None => {
                Self::pick(&self.prefill, &self.next_prefill)
                    .ok_or_else(|| RequestError::UnknownNode("no prefill leg".into()))?
                    .scheduler
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

/// Waits (in the background) for a prefill the router stopped waiting for, and releases the
/// grant it hands back, so blocks are not pinned until the lease lapses. The prefill leg itself
/// grants nothing past the deadline, so this covers an answer already on its way.
fn release_late_grant(
    prefill: tokio::task::JoinHandle<Result<Result<pdkv_core::wire::KvParams, RequestError>, RequestError>>,
    release: Recipient<ReleaseGrant>,
    peer: NodeId,
    request: RequestId,
) {
    actix::spawn(async move {
        let Ok(Ok(Ok(params))) = prefill.await else {
            return;
        };
        let message = ReleaseGrant {
            grant: params.grant,
            peer,
        };
        match release.send(message).await {
            Ok(Ok(())) => tracing::debug!(%request, "released a grant that arrived after the deadline"),
            Ok(Err(error)) => tracing::warn!(%request, %error, "late grant release refused"),
            Err(error) => tracing::warn!(%request, %error, "late grant release not delivered"),
        }
    });
}

/// The router actor.
pub struct Router {
    context: Arc<RouterContext>,
    mailbox: usize,
}

impl Router {
    /// A router over the given legs.
    pub fn new(
        prefill: Vec<PrefillRoute>,
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
