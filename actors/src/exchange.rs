//! The exchange actor: a leg's door to its peers.
//!
//! It owns the leg's links and its table of admitted peers ([`Peers`]): it admits a peer from its
//! hello (checking compatibility, and telling the transfer actor where a prefill leg's blocks
//! sit), refuses envelopes from unknown senders or unknown incarnations, answers grant renewals
//! and releases itself (through the allocator's one grant table), and hands every other message
//! to the scheduler. The scheduler's outgoing messages leave through it.
//!
//! The trimming, clipping and pairing of block lists are pure functions of `pdkv_core::exchange`
//! that the request machines call; nothing about a peer is known here but what its hello said.

use actix::{Actor, ActorFutureExt, Addr, AsyncContext, Context, Handler, Message, Recipient, WrapFuture};
use pdkv_core::wire::{Body, Envelope, NodeId, RequestId, Role};
use pdkv_transport::control::{Hello, check_compat};

use crate::allocator::{AllocatorActor, ReleaseGrant, RenewGrant, RevokeRequest};
use crate::link::{Admit, Inbound, Peers, Refusal, SetLink, body_kind};
use crate::transfer::{AddPeer, TransferActor};

/// A message for the scheduler from a peer, already checked by the exchange.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct Deliver {
    /// The envelope.
    pub envelope: Envelope,
}

/// The exchange actor of one leg.
pub struct ExchangeActor {
    hello: Hello,
    peers: Peers,
    scheduler: Recipient<Deliver>,
    allocator: Addr<AllocatorActor>,
    transfer: Option<Addr<TransferActor>>,
    mailbox: usize,
}

impl ExchangeActor {
    /// The door of the leg that says `hello`.
    pub fn new(
        hello: Hello,
        scheduler: Recipient<Deliver>,
        allocator: Addr<AllocatorActor>,
        transfer: Option<Addr<TransferActor>>,
        mailbox: usize,
    ) -> Self {
        ExchangeActor {
            peers: Peers::new(hello.node.clone(), hello.incarnation),
            hello,
            scheduler,
            allocator,
            transfer,
            mailbox,
        }
    }

    fn node(&self) -> &NodeId {
        &self.hello.node
    }

    fn send(&self, to: &NodeId, request: RequestId, budget_ms: u64, body: Body) {
        let kind = body_kind(&body);
        if let Err(error) = self.peers.send(to, request, budget_ms, body) {
            tracing::warn!(node = %self.node(), %to, %request, kind, %error, "message not sent");
        }
    }

    /// A renewal or release names the incarnation that issued the grant; another one's grant
    /// ids mean nothing here.
    fn issued_here(&self, issuer: pdkv_core::wire::Incarnation, from: &NodeId) -> bool {
        if issuer == self.hello.incarnation {
            return true;
        }
        tracing::warn!(node = %self.node(), %from, %issuer, "grant of another incarnation refused");
        false
    }
}

impl Actor for ExchangeActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.set_mailbox_capacity(self.mailbox);
    }
}

impl Handler<Admit> for ExchangeActor {
    type Result = actix::ResponseActFuture<Self, Result<(), Refusal>>;

    fn handle(&mut self, msg: Admit, _ctx: &mut Self::Context) -> Self::Result {
        let hello = msg.hello;
        if let Err(error) = check_compat(&self.hello, &hello) {
            return Box::pin(actix::fut::ready(Err(Refusal::Incompatible(error.to_string()))));
        }
        let reads_from = self.hello.role == Role::Decode && hello.role == Role::Prefill;
        let learn = match (&self.transfer, reads_from) {
            (Some(transfer), true) => Some(transfer.send(AddPeer { hello: hello.clone() })),
            _ => None,
        };
        let node = self.node().clone();
        Box::pin(
            async move {
                if let Some(learn) = learn {
                    let refused = |detail: String| Refusal::Incompatible(detail);
                    learn
                        .await
                        .map_err(|error| refused(error.to_string()))?
                        .map_err(|failure| refused(failure.to_string()))?;
                }
                Ok(())
            }
            .into_actor(self)
            .map(move |result, actor, _ctx| {
                result?;
                if let Some(old) = actor.peers.admit(hello.clone()) {
                    tracing::warn!(%node, peer = %hello.node, %old, new = %hello.incarnation, "peer restarted");
                } else {
                    tracing::debug!(%node, peer = %hello.node, "peer admitted");
                }
                Ok(())
            }),
        )
    }
}

impl Handler<SetLink> for ExchangeActor {
    type Result = ();

    fn handle(&mut self, msg: SetLink, _ctx: &mut Self::Context) -> Self::Result {
        self.peers.set_link(&msg.peer, msg.link);
    }
}

impl Handler<Inbound> for ExchangeActor {
    type Result = Result<(), Refusal>;

    fn handle(&mut self, msg: Inbound, ctx: &mut Self::Context) -> Self::Result {
        self.peers.check(&msg)?;
        let Envelope {
            request,
            from,
            incarnation,
            budget_ms,
            body,
        } = msg.envelope;
        let misrouted = |body: &Body| Refusal::Misrouted {
            node: self.hello.node.clone(),
            what: format!("a {} leg", self.hello.role),
            body: body_kind(body),
        };
        match body {
            Body::Renew { grant, issuer } => {
                if self.hello.role != Role::Prefill {
                    return Err(misrouted(&Body::Renew { grant, issuer }));
                }
                if !self.issued_here(issuer, &from) {
                    return Ok(());
                }
                let renew = RenewGrant {
                    grant,
                    peer: from.clone(),
                };
                ctx
                    .spawn(self.allocator.send(renew).into_actor(self).map(
                    move |result, actor, _ctx| match result {
                        Ok(Ok(lease_ms)) => {
                            actor.send(&from, request, budget_ms, Body::Renewed { grant, lease_ms });
                        }
                        Ok(Err(error)) => {
                            tracing::warn!(node = %actor.node(), %from, %request, %error, "renewal refused");
                        }
                        Err(error) => tracing::error!(node = %actor.node(), %error, "allocator unreachable"),
                    },
                ));
                Ok(())
            }
            Body::Release { grant, issuer } => {
                if self.hello.role != Role::Prefill {
                    return Err(misrouted(&Body::Release { grant, issuer }));
                }
                if !self.issued_here(issuer, &from) {
                    return Ok(());
                }
                let release = ReleaseGrant { grant, peer: from };
                ctx.spawn(self.allocator.send(release).into_actor(self).map(
                    move |result, actor, _ctx| match result {
                        Ok(Ok(())) => {}
                        Ok(Err(error)) => {
                            tracing::debug!(node = %actor.node(), %request, %error, "release of an ended grant")
                        }
                        Err(error) => tracing::error!(node = %actor.node(), %error, "allocator unreachable"),
                    },
                ));
                Ok(())
            }
            body => {
                let wrong_leg = match &body {
                    Body::Prefill { .. } => self.hello.role != Role::Prefill,
                    Body::Decode { .. } | Body::Renewed { .. } => self.hello.role != Role::Decode,
                    Body::KvReady(_) | Body::Output(_) | Body::Failed { .. } => true,
                    _ => false,
                };
                if wrong_leg {
                    return Err(misrouted(&body));
                }
                if matches!(body, Body::Abort) && self.hello.role == Role::Prefill {
                    // A finished prefill's grant outlives its machine: free it here.
                    ctx.spawn(
                        self.allocator
                            .send(RevokeRequest { request })
                            .into_actor(self)
                            .map(|_, _, _| ()),
                    );
                }
                let envelope = Envelope {
                    request,
                    from,
                    incarnation,
                    budget_ms,
                    body,
                };
                self.scheduler
                    .try_send(Deliver { envelope })
                    .map_err(|error| Refusal::Busy {
                        node: self.hello.node.clone(),
                        detail: format!("scheduler: {error}"),
                    })
            }
        }
    }
}

/// The scheduler sends a message to a peer.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct Outbound {
    /// The peer.
    pub to: NodeId,
    /// The request.
    pub request: RequestId,
    /// Milliseconds of the request's deadline left.
    pub budget_ms: u64,
    /// The message.
    pub body: Body,
}

impl Handler<Outbound> for ExchangeActor {
    type Result = ();

    fn handle(&mut self, msg: Outbound, _ctx: &mut Self::Context) -> Self::Result {
        self.send(&msg.to, msg.request, msg.budget_ms, msg.body);
    }
}
