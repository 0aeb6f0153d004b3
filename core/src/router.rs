//! The router's rules above one attempt: a client request may run as several attempts, each a
//! [`crate::leg::RouterMachine`] under a request id of its own, on other legs than the ones an
//! earlier attempt failed on. [`Attempts`] decides whether a failed attempt starts over and
//! without which leg, and which streamed tokens a client has not seen yet.
//!
//! Leg choice among the legs left is [`crate::proxy::choose`]; the shipped router and the
//! simulation both call these, so the simulation checks the rules that ship.
//!
//! Non-goals: sending, timing, choosing (the shell and `proxy` do).

use crate::leg::leg_to_retry_without;
use crate::wire::{Failure, NodeId, Stage};

/// One client request across its attempts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attempts {
    /// Attempts after the first that may run (`[failure] max_retries`).
    max_retries: u32,
    /// Attempts after the first that did run.
    retries: u32,
    /// Legs an earlier attempt failed on, in the order it did.
    avoid: Vec<NodeId>,
    /// Tokens the client has been streamed, over every attempt.
    streamed: usize,
    /// Tokens of the current attempt not to stream again: an earlier attempt streamed them.
    skip: usize,
}

impl Attempts {
    /// A client request that may start over `max_retries` times.
    pub fn new(max_retries: u32) -> Self {
        Attempts {
            max_retries,
            retries: 0,
            avoid: Vec::new(),
            streamed: 0,
            skip: 0,
        }
    }

    /// Legs the next attempt must not run on.
    pub fn avoid(&self) -> &[NodeId] {
        &self.avoid
    }

    /// Attempts after the first so far.
    pub fn retries(&self) -> u32 {
        self.retries
    }

    /// Tokens the client has been streamed.
    pub fn streamed(&self) -> usize {
        self.streamed
    }

    /// The current attempt's decode leg streamed `tokens` (in order, following what it streamed
    /// before): the part the client has not seen. Generation is deterministic for a request
    /// (greedy, or seeded sampling), so an attempt after a failed one produces the same first
    /// tokens, and the client gets each token once, in order.
    pub fn take_streamed<'a>(&mut self, tokens: &'a [u32]) -> &'a [u32] {
        let skipped = self.skip.min(tokens.len());
        self.skip -= skipped;
        let fresh = &tokens[skipped..];
        self.streamed += fresh.len();
        fresh
    }

    /// The current attempt on `prefill` and `decode` failed in `stage` with `reason`: the leg
    /// to start over without, if the failure allows a retry ([`leg_to_retry_without`]) and
    /// retries are left. The next attempt then avoids that leg and skips the tokens the client
    /// already has.
    pub fn retry_after(
        &mut self,
        stage: Stage,
        reason: &Failure,
        prefill: &NodeId,
        decode: &NodeId,
    ) -> Option<NodeId> {
        if self.retries >= self.max_retries {
            return None;
        }
        let lost = leg_to_retry_without(stage, reason, prefill, decode)?.clone();
        self.retries += 1;
        self.avoid.push(lost.clone());
        self.skip = self.streamed;
        Some(lost)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str) -> NodeId {
        NodeId(name.into())
    }

    /// A retried stream gives the client every token once: the new attempt's first tokens,
    /// which the client already has, are skipped, whatever batches they arrive in.
    #[test]
    fn a_retried_stream_neither_repeats_nor_skips_a_token() {
        let answer: Vec<u32> = (100..110).collect();
        for streamed_before in 0..=answer.len() {
            for batch in 1..=3 {
                let mut attempts = Attempts::new(1);
                let mut client = Vec::new();
                for chunk in answer[..streamed_before].chunks(batch) {
                    client.extend_from_slice(attempts.take_streamed(chunk));
                }
                let (p, d) = (node("prefill-0"), node("decode-0"));
                let lost = attempts.retry_after(Stage::Decode, &Failure::LegLost(d.clone()), &p, &d);
                assert_eq!(lost, Some(d));
                for chunk in answer.chunks(batch) {
                    client.extend_from_slice(attempts.take_streamed(chunk));
                }
                assert_eq!(
                    client, answer,
                    "streamed {streamed_before} before, batches of {batch}"
                );
                assert_eq!(attempts.streamed(), answer.len());
            }
        }
    }

    #[test]
    fn retries_avoid_each_failed_leg_and_stop_at_the_bound() {
        let (p0, p1, d) = (node("prefill-0"), node("prefill-1"), node("decode-0"));
        let mut attempts = Attempts::new(2);
        let lost = Failure::LegLost(p0.clone());
        assert_eq!(
            attempts.retry_after(Stage::Prefill, &lost, &p0, &d),
            Some(p0.clone())
        );
        let refused = Failure::Refused {
            node: p1.clone(),
            reason: crate::wire::RefusalReason::Draining,
        };
        assert_eq!(
            attempts.retry_after(Stage::Prefill, &refused, &p1, &d),
            Some(p1.clone())
        );
        assert_eq!(attempts.avoid(), &[p0.clone(), p1.clone()]);
        assert_eq!(attempts.retries(), 2);
        // No retry left.
        assert_eq!(attempts.retry_after(Stage::Prefill, &lost, &p0, &d), None);
        // A failure the policy does not retry uses none.
        let mut fresh = Attempts::new(3);
        assert_eq!(
            fresh.retry_after(Stage::Decode, &Failure::Cancelled, &p0, &d),
            None
        );
        assert_eq!(fresh.retries(), 0);
        assert!(fresh.avoid().is_empty());
    }
}
