//! pdkv-actors: the actix actors of a P/D cluster, and the reference engine they serve.
//!
//! Per leg: a [`scheduler::Scheduler`] (drives the leg's node, `pdkv_core::node::LegNode`:
//! its request machines, blocks and prefix cache, the one grant table and its leases, and the
//! rules between them), an [`exchange::ExchangeActor`] (the leg's door: links, admitted peers)
//! and, on decode legs, a [`transfer::TransferActor`] (plans and READs through a READ engine). The reference engine computes on a bounded [`compute::ComputePool`],
//! never on the arbiter. A [`router::Router`] drives one router machine per request. Nodes talk
//! over [`link`]s: actor mailboxes in one process, or QUIC with mutual TLS.
//! [`cluster::LocalCluster`] runs a whole cluster in one process from `cluster.toml` ([`config`])
//! on either link kind; [`sweep`] compares P/D output with one-leg output over many lengths.
//!
//! Actors are thin shells: the decisions live in `pdkv_core` (leg machines, exchange, allocator,
//! grants, plans) and the math in [`engine`]; [`memory`] holds a leg's KV regions. Bulk bytes
//! never pass through a mailbox; every mailbox and link is bounded and every wait has a deadline.
#![warn(missing_docs)]

pub mod cluster;
pub mod compute;
pub mod config;
pub mod deployment;
pub mod engine;
pub mod engines;
pub mod error;
pub mod exchange;
mod hardware;
pub mod link;
pub mod memory;
pub mod node;
pub mod router;
pub mod scheduler;
pub mod sweep;
pub mod timer;
pub mod transfer;

/// Stops the actor that receives it (a cluster shutting down).
#[derive(Debug, Clone, Copy, actix::Message)]
#[rtype(result = "()")]
pub struct Stop;

/// Implements [`Stop`] for actors with a plain `Context`.
macro_rules! stoppable {
    ($($actor:ty),* $(,)?) => {
        $(
            impl actix::Handler<crate::Stop> for $actor {
                type Result = ();

                fn handle(&mut self, _msg: crate::Stop, ctx: &mut Self::Context) {
                    actix::ActorContext::stop(ctx);
                }
            }
        )*
    };
}

stoppable!(
    exchange::ExchangeActor,
    router::Router,
    scheduler::Scheduler,
    transfer::TransferActor,
);
