//! The exchange actor: a leg's door to its peers.
//!
//! It owns the leg's links and its table of admitted peers ([`Peers`]): it admits a peer from its
//! hello (checking compatibility, and telling the transfer actor where a prefill leg's blocks
//! sit), refuses envelopes from unknown senders, on another's link or from unknown incarnations,
//! and hands every other envelope to the scheduler with the role its sender said hello as: which
//! message a leg takes from whom, grant renewals and releases included, is the leg's node's
//! rule (`pdkv_core::node`). The scheduler's outgoing messages leave through it.

use actix::{
    Actor, ActorFutureExt, Addr, AsyncContext, Context, Handler, Message, ResponseActFuture, WrapFuture,
};
use pdkv_core::wire::{Body, NodeId, RequestId, Role};
use pdkv_transport::control::{Hello, check_compat};

use crate::link::{Admit, Inbound, LinkLost, Peers, Refusal, SetLink, log_refusal};
use crate::scheduler::{Deliver, PeerLost, Scheduler, Stats};
use crate::transfer::{AddPeer, TransferActor};

/// The exchange actor of one leg.
pub struct ExchangeActor {
    hello: Hello,
    peers: Peers,
    scheduler: Addr<Scheduler>,
    transfer: Option<Addr<TransferActor>>,
    mailbox: usize,
}

impl ExchangeActor {
    /// The door of the leg that says `hello`.
    pub fn new(
        hello: Hello,
        scheduler: Addr<Scheduler>,
        transfer: Option<Addr<TransferActor>>,
        mailbox: usize,
    ) -> Self {
        ExchangeActor {
            peers: Peers::new(hello.node.clone(), hello.incarnation),
            hello,
            scheduler,
            transfer,
            mailbox,
        }
    }

    fn node(&self) -> &NodeId {
        &self.hello.node
    }

    /// Sends `body` to `to`; whether the link took it.
    fn send(&self, to: &NodeId, request: RequestId, budget_ms: u64, body: Body) -> bool {
        let kind = body.kind();
        match self.peers.send(to, request, budget_ms, body) {
            Ok(()) => true,
            Err(error) => {
                tracing::warn!(node = %self.node(), %to, %request, kind, %error, "message not sent");
                false
            }
        }
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
    /// Sends the leg's load (from its node's accounting) to every router linked to it.
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
            self.scheduler
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
            // Rare, and never to be dropped: past the mailbox bound is fine.
            self.scheduler.do_send(PeerLost { peer: msg.peer });
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

/// The answer to an inbound envelope, once the scheduler has taken it.
type Answer = ResponseActFuture<ExchangeActor, Result<(), Refusal>>;

impl ExchangeActor {
    /// Checks who sent an inbound envelope and hands it to the scheduler with the sender's role.
    fn route(&mut self, msg: Inbound, _ctx: &mut Context<Self>) -> Result<Answer, Refusal> {
        self.peers.check(&msg)?;
        let from_role = self
            .peers
            .hello(&msg.envelope.from)
            .map(|hello| hello.role)
            .ok_or_else(|| Refusal::UnknownPeer(msg.envelope.from.clone()))?;
        let deliver = Deliver {
            envelope: msg.envelope,
            from_role,
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

/// The scheduler sends a message to a peer; answers whether the link took it.
#[derive(Debug, Message)]
#[rtype(result = "bool")]
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
    type Result = bool;

    fn handle(&mut self, msg: Outbound, _ctx: &mut Self::Context) -> Self::Result {
        self.send(&msg.to, msg.request, msg.budget_ms, msg.body)
    }
}
