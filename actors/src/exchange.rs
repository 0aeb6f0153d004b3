//! The exchange actor: a thin shell around `pdkv_core::exchange` and `pdkv_core::plan`.
//!
//! On a prefill leg it turns the request's lists into an offer (trim, clip, anchor). On a decode
//! leg it pairs its own lists with the offer, builds the coalesced transfer plan against the
//! prefill leg's region layout, and lists the generation each READ source must still have after
//! the copy. With `pairing = "legacy"` it reproduces vLLM MoRIIO's old pairing instead.

use std::collections::HashMap;

use actix::{Actor, Context, Handler, Message};
use pdkv_core::block::BlockId;
use pdkv_core::exchange::{self, ExchangeError, Offer, Pairing, PairingMode};
use pdkv_core::layout::KvLayout;
pub use pdkv_core::leg::{GenerationCheck, generation_checks};
use pdkv_core::plan::{self, RegionLayout, TransferPlan};
use pdkv_core::wire::{KvParams, NodeId};

use crate::config::ExchangeConfig;
use crate::error::RequestError;

/// The exchange actor of one leg.
pub struct ExchangeActor {
    layout: KvLayout,
    config: ExchangeConfig,
    local_regions: RegionLayout,
    /// Region layouts of the prefill legs this leg reads from (learned at handshake).
    remote_regions: HashMap<NodeId, RegionLayout>,
    mailbox: usize,
}

impl ExchangeActor {
    /// An exchange actor for a leg whose memory is placed as `local_regions`.
    pub fn new(
        layout: KvLayout,
        config: ExchangeConfig,
        local_regions: RegionLayout,
        remote_regions: HashMap<NodeId, RegionLayout>,
        mailbox: usize,
    ) -> Self {
        ExchangeActor {
            layout,
            config,
            local_regions,
            remote_regions,
            mailbox,
        }
    }
}

impl Actor for ExchangeActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.set_mailbox_capacity(self.mailbox);
    }
}

/// Prefill leg: build the offer for a computed request.
#[derive(Debug, Message)]
#[rtype(result = "Result<Offer, ExchangeError>")]
pub struct MakeOffer {
    /// Prompt length.
    pub num_prompt_tokens: u64,
    /// The request's full position-indexed lists.
    pub lists: Vec<Vec<BlockId>>,
}

impl Handler<MakeOffer> for ExchangeActor {
    type Result = Result<Offer, ExchangeError>;

    fn handle(&mut self, msg: MakeOffer, _ctx: &mut Self::Context) -> Self::Result {
        match self.config.pairing {
            PairingMode::Anchored => exchange::offer(&self.layout, msg.num_prompt_tokens, &msg.lists),
            PairingMode::Legacy => Ok(exchange::legacy_offer(
                &self.layout,
                msg.num_prompt_tokens,
                msg.lists,
            )),
        }
    }
}

/// What a decode leg reads for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadSpec {
    /// Block pairs per group.
    pub pairing: Pairing,
    /// Coalesced byte ranges per layer.
    pub plan: TransferPlan,
    /// Generations to verify after the copy.
    pub checks: Vec<GenerationCheck>,
}

/// Decode leg: pair local lists with the offer in `params`.
#[derive(Debug, Message)]
#[rtype(result = "Result<ReadSpec, RequestError>")]
pub struct PairWithOffer {
    /// The prefill leg's parameters.
    pub params: std::sync::Arc<KvParams>,
    /// The decode leg's full position-indexed lists.
    pub lists: Vec<Vec<BlockId>>,
    /// Leading positions per group the decode leg holds already.
    pub cached_blocks: Vec<u64>,
}

impl Handler<PairWithOffer> for ExchangeActor {
    type Result = Result<ReadSpec, RequestError>;

    fn handle(&mut self, msg: PairWithOffer, _ctx: &mut Self::Context) -> Self::Result {
        let params = &msg.params;
        let offer = &params.offer;
        let pairing = match self.config.pairing {
            PairingMode::Anchored => {
                let need = exchange::need(
                    &self.layout,
                    offer.num_prompt_tokens,
                    &msg.lists,
                    &msg.cached_blocks,
                )?;
                exchange::pair(&self.layout, offer, &need)?
            }
            PairingMode::Legacy => {
                let remote: Vec<Vec<BlockId>> = offer.groups.iter().map(|list| list.blocks.clone()).collect();
                exchange::legacy_pair(
                    &self.layout,
                    &remote,
                    &msg.lists,
                    self.config.max_decode_tail_blocks,
                )?
            }
        };
        let remote_regions = self
            .remote_regions
            .get(&params.prefill_node)
            .ok_or_else(|| RequestError::UnknownNode(params.prefill_node.to_string()))?;
        let plan = plan::plan(&self.layout, &pairing, &self.local_regions, remote_regions)?;
        let checks = generation_checks(params, &pairing).map_err(RequestError::BadParams)?;
        Ok(ReadSpec {
            pairing,
            plan,
            checks,
        })
    }
}
