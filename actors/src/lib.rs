//! pdkv-actors: the actix actors of a P/D cluster, and the reference engine they serve.
//!
//! Per leg: a [`scheduler::Scheduler`] (drives requests), an [`allocator::AllocatorActor`]
//! (blocks, prefix cache, grants and leases), an [`exchange::ExchangeActor`] (offers, pairing,
//! plans) and, on decode legs, a [`transfer::TransferActor`] (READs through a READ engine). A
//! [`router::Router`] sends each request to a prefill leg, then its KV parameters to a decode
//! leg. [`cluster::LocalCluster`] runs a whole cluster in one process from `cluster.toml`
//! ([`config`]); [`sweep`] compares P/D output with one-leg output over many prompt lengths.
//!
//! Actors are thin shells: the decisions live in `pdkv_core` (exchange, allocator, grants, plans)
//! and the math in [`engine`]; [`memory`] holds a leg's KV regions. Bulk bytes never pass through a mailbox; every mailbox is bounded
//! and every wait has a deadline.
#![warn(missing_docs)]

pub mod allocator;
pub mod cluster;
pub mod config;
pub mod engine;
pub mod error;
pub mod exchange;
pub mod memory;
pub mod router;
pub mod scheduler;
pub mod sweep;
pub mod transfer;
