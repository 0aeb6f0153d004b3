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

use actix::{
    Actor, ActorFutureExt, Addr, AsyncContext, Context, Handler, Message, Recipient, ResponseActFuture,
    WrapFuture,
};
use pdkv_core::wire::{Body, Envelope, Incarnation, NodeId, RequestId, Role};
use pdkv_transport::control::{Hello, check_compat};

use crate::allocator::{AllocatorActor, ReleaseGrant, RenewGrant, RevokeRequest, Stats};
use crate::link::{Admit, Inbound, LinkLost, Peers, Refusal, SetLink, log_refusal};
use crate::transfer::{AddPeer, TransferActor};

/// A message for the scheduler from a peer, already checked by the exchange.
#[derive(Debug, Message)]
#[rtype(result = "Result<(), Refusal>")]
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
        let kind = body.kind();
        let grants = matches!(body, Body::KvReady(_));
        if let Err(error) = self.peers.send(to, request, budget_ms, body) {
            tracing::warn!(node = %self.node(), %to, %request, kind, %error, "message not sent");
            if grants {
                // Nobody will hear of the grant: free its blocks now, not at lease end. (At most
                // one per request, so `do_send` cannot pile messages up past the request rate.)
                self.allocator.do_send(RevokeRequest { request });
            }
        }
    }

    /// A renewal or release names the incarnation that issued the grant; another one's grant
    /// ids mean nothing here.
    fn issued_here(&self, issuer: Incarnation) -> Result<(), Refusal> {
        if issuer == self.hello.incarnation {
            return Ok(());
        }
        Err(Refusal::Grant {
            node: self.hello.node.clone(),
            detail: format!(
                "the grant was issued by incarnation {issuer}, this node is incarnation {}",
                self.hello.incarnation
            ),
        })
    }
}

impl Actor for ExchangeActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.set_mailbox_capacity(self.mailbox);
        ctx.run_interval(LOAD_REPORT_INTERVAL, |actor, ctx| actor.report_load(ctx));
    }
}

/// How often a leg tells the routers linked to it how loaded it is.
pub const LOAD_REPORT_INTERVAL: std::time::Duration = std::time::Duration::from_millis(100);

impl ExchangeActor {
    /// Sends the leg's load (from its allocator's accounting) to every router linked to it.
    fn report_load(&mut self, ctx: &mut Context<Self>) {
        let routers: Vec<NodeId> = self
            .peers
            .hellos()
            .filter(|hello| hello.role == Role::Router)
            .map(|hello| hello.node.clone())
            .collect();
        if routers.is_empty() {
            return;
        }
        ctx.spawn(
            self.allocator
                .send(Stats)
                .into_actor(self)
                .map(move |stats, actor, _| {
                    let Ok(stats) = stats else {
                        return;
                    };
                    let load = stats.load;
                    for router in &routers {
                        // Best effort: a report that cannot go is replaced by the next one.
                        let _ = actor
                            .peers
                            .send(router, RequestId(0), 0, Body::Load(load.clone()));
                    }
                }),
        );
    }
}

impl Handler<Admit> for ExchangeActor {
    type Result = actix::ResponseActFuture<Self, Result<(), Refusal>>;

    fn handle(&mut self, msg: Admit, _ctx: &mut Self::Context) -> Self::Result {
        let (hello, dialed_in) = (msg.hello, msg.dialed_in);
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
                if let Some(old) = actor.peers.admit(hello.clone(), dialed_in) {
                    tracing::warn!(%node, peer = %hello.node, %old, new = %hello.incarnation, "peer restarted");
                } else {
                    tracing::debug!(%node, peer = %hello.node, "peer admitted");
                }
                Ok(())
            }),
        )
    }
}

impl Handler<LinkLost> for ExchangeActor {
    type Result = ();

    fn handle(&mut self, msg: LinkLost, _ctx: &mut Self::Context) -> Self::Result {
        if self.peers.drop_link(&msg.peer, msg.incarnation) {
            tracing::warn!(node = %self.node(), peer = %msg.peer, reason = %msg.reason, "link lost");
        }
    }
}

impl Handler<SetLink> for ExchangeActor {
    type Result = ();

    fn handle(&mut self, msg: SetLink, _ctx: &mut Self::Context) -> Self::Result {
        self.peers.set_link(&msg.peer, msg.link);
    }
}

impl Handler<Inbound> for ExchangeActor {
    type Result = ResponseActFuture<Self, Result<(), Refusal>>;

    fn handle(&mut self, msg: Inbound, ctx: &mut Self::Context) -> Self::Result {
        let (peer, request, kind) = (msg.peer.clone(), msg.envelope.request, msg.envelope.body.kind());
        let answer = match self.route(msg, ctx) {
            Ok(answer) => answer,
            Err(refusal) => Box::pin(actix::fut::ready(Err(refusal))),
        };
        Box::pin(answer.map(move |result, _, _| {
            if let Err(refusal) = &result {
                log_refusal(&peer, request, kind, refusal);
            }
            result
        }))
    }
}

/// The answer to an inbound envelope, once whoever it went to has taken it.
type Answer = ResponseActFuture<ExchangeActor, Result<(), Refusal>>;

impl ExchangeActor {
    /// Checks an inbound envelope and sends it on: grant renewals and releases to the
    /// allocator (answering the renewal), everything else to the scheduler.
    fn route(&mut self, msg: Inbound, ctx: &mut Context<Self>) -> Result<Answer, Refusal> {
        self.peers.check(&msg)?;
        let sender_role = self.peers.hello(&msg.envelope.from).map(|hello| hello.role);
        let expected = expected_sender(&msg.envelope.body);
        if sender_role != Some(expected) {
            return Err(Refusal::WrongSender {
                node: msg.envelope.from.clone(),
                body: msg.envelope.body.kind(),
                expected,
            });
        }
        let envelope = msg.envelope;
        let wrong_leg = match &envelope.body {
            Body::Prefill { .. } | Body::Renew { .. } | Body::Release { .. } => {
                self.hello.role != Role::Prefill
            }
            Body::Decode { .. } | Body::Renewed { .. } => self.hello.role != Role::Decode,
            Body::KvReady(_)
            | Body::Output(_)
            | Body::Failed { .. }
            | Body::Load(_)
            | Body::Tokens { .. } => true,
            Body::Abort => false,
        };
        if wrong_leg {
            return Err(Refusal::Misrouted {
                node: self.hello.node.clone(),
                what: format!("a {} leg", self.hello.role),
                body: envelope.body.kind(),
            });
        }
        let (request, from, budget_ms) = (envelope.request, envelope.from.clone(), envelope.budget_ms);
        let node = self.hello.node.clone();
        let grant_refused = move |error: String| Refusal::Grant {
            node: node.clone(),
            detail: error,
        };
        match envelope.body {
            Body::Renew { grant, issuer } => {
                self.issued_here(issuer)?;
                let renew = RenewGrant {
                    grant,
                    peer: from.clone(),
                };
                let answer = self
                    .allocator
                    .send(renew)
                    .into_actor(self)
                    .map(move |result, actor, _| {
                        let lease_ms = result
                            .map_err(|error| grant_refused(error.to_string()))?
                            .map_err(|error| grant_refused(error.to_string()))?;
                        actor.send(&from, request, budget_ms, Body::Renewed { grant, lease_ms });
                        Ok(())
                    });
                Ok(Box::pin(answer))
            }
            Body::Release { grant, issuer } => {
                self.issued_here(issuer)?;
                let release = ReleaseGrant { grant, peer: from };
                let answer = self
                    .allocator
                    .send(release)
                    .into_actor(self)
                    .map(move |result, _, _| {
                        result
                            .map_err(|error| grant_refused(error.to_string()))?
                            .map_err(|error| grant_refused(error.to_string()))
                    });
                Ok(Box::pin(answer))
            }
            body => {
                if matches!(body, Body::Abort) && self.hello.role == Role::Prefill {
                    // A finished prefill's grant outlives its machine: free it here.
                    ctx.spawn(
                        self.allocator
                            .send(RevokeRequest { request })
                            .into_actor(self)
                            .map(|_, _, _| ()),
                    );
                }
                let deliver = Deliver {
                    envelope: Envelope { body, ..envelope },
                };
                let node = self.hello.node.clone();
                let answer = self
                    .scheduler
                    .send(deliver)
                    .into_actor(self)
                    .map(move |result, _, _| {
                        result.map_err(|error| Refusal::Busy {
                            node,
                            detail: format!("scheduler: {error}"),
                        })?
                    });
                Ok(Box::pin(answer))
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

/// The role that alone may send a message of this kind to a leg.
fn expected_sender(body: &Body) -> Role {
    match body {
        Body::Prefill { .. } | Body::Decode { .. } | Body::Abort => Role::Router,
        Body::Renew { .. } | Body::Release { .. } => Role::Decode,
        Body::Renewed { .. } => Role::Prefill,
        // Answers go to the router, never to a leg: refused as misrouted below.
        Body::KvReady(_) | Body::Output(_) | Body::Failed { .. } | Body::Load(_) | Body::Tokens { .. } => {
            Role::Router
        }
    }
}
