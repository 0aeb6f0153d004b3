//! The rules of a router in front of engine legs that speak vLLM's P/D request protocol over
//! HTTP (vLLM instances with `PdkvConnector`): which leg next, what to do when a stage fails,
//! and how a stream started over on other legs continues without repeating or skipping what the
//! client already has. Sans-IO: the shell (pdkv's router) does the HTTP and tells
//! [`ProxyRequest`] what happened; [`ProxyRequest`] says what to do next.
//!
//! A request goes to a prefill leg (`max_tokens: 1`, `kv_transfer_params: {"do_remote_decode":
//! true}`), then to a decode leg with the parameters the prefill answered; the decode's answer
//! is the client's. The prefill's own token never reaches the client: for window and mamba
//! models the prefill computes N-1 tokens, so its token is not the first output token.
//!
//! Failures (each start over counts against `max_retries`):
//! - the prefill fails or times out: another prefill leg; when none is left (or retries are
//!   spent), the decode leg computes the prompt itself (no `kv_transfer_params`);
//! - the decode fails before its first byte reached the client: another decode leg with the
//!   same parameters (the connector reads the hand-off if nobody claimed it, else recomputes);
//! - the decode fails mid-stream: the request starts over from the prompt on other legs, and
//!   the new stream's first chunks are checked against those the client has ([`Replay`]): equal,
//!   they are skipped; different (an unseeded sample), the stream ends with an error;
//! - a leg answering 4xx rejected the request itself: that answer goes to the client.
//!
//! Non-goals: HTTP, JSON, time (deadlines come in as values).

use serde::{Deserialize, Serialize};

/// How legs are chosen (`[router] selection` in cluster.toml: `least_loaded`, `round_robin`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    /// The least loaded leg (requests there, then the share of its KV in use), ties in turn.
    #[default]
    LeastLoaded,
    /// Each leg in turn.
    RoundRobin,
}

/// What the router knows of one leg: its health and load as seen from the router (the leg's own
/// report, [`crate::wire::LegLoad`], is one input to it).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct LegView {
    /// The leg answers its health checks.
    pub healthy: bool,
    /// Requests this router has in flight there.
    pub in_flight: u32,
    /// Requests running or waiting there, from the leg's last metrics (all routers').
    pub reported: u32,
    /// Share of the leg's KV cache in use, 0..=1, from its last metrics.
    pub kv_usage: f64,
}

impl LegView {
    /// The ordering key of `least_loaded`: requests (the larger of ours and the leg's count),
    /// then KV in use in thousandths.
    fn key(&self) -> (u32, u64) {
        let usage = (self.kv_usage.clamp(0.0, 1.0) * 1000.0) as u64;
        (self.in_flight.max(self.reported), usage)
    }
}

/// Chooses a leg among `loads` (indexed by leg), skipping unhealthy legs and those in `avoid`.
/// `turn` rotates the start so ties (and `round_robin`) go to each leg in turn; it advances by
/// one per call. `None` when no leg is eligible.
pub fn choose(loads: &[LegView], avoid: &[usize], policy: Policy, turn: &mut usize) -> Option<usize> {
    let eligible: Vec<usize> = (0..loads.len())
        .filter(|leg| loads[*leg].healthy && !avoid.contains(leg))
        .collect();
    if eligible.is_empty() {
        return None;
    }
    let start = *turn % eligible.len();
    *turn = turn.wrapping_add(1);
    let rotated = (0..eligible.len()).map(|offset| eligible[(start + offset) % eligible.len()]);
    match policy {
        Policy::RoundRobin => Some(eligible[start]),
        // `min_by_key` keeps the first of equals: the rotation breaks ties.
        Policy::LeastLoaded => rotated.min_by_key(|leg| loads[*leg].key()),
    }
}

/// How a stage ended badly.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StageFailure {
    /// The leg could not be reached, the connection broke, or it answered 5xx.
    Lost(String),
    /// The stage's bound passed.
    TimedOut,
    /// The leg refused the request itself (4xx): status and body go to the client.
    Rejected {
        /// HTTP status.
        status: u16,
        /// Its body, as answered.
        body: String,
    },
}

/// The next thing to do for a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Send the prefill request to prefill leg `leg`.
    Prefill {
        /// Index of the prefill leg.
        leg: usize,
    },
    /// Send the request to decode leg `leg`, with the prefill's `kv_transfer_params` when
    /// `with_params`, else as a plain request the leg computes in full.
    Decode {
        /// Index of the decode leg.
        leg: usize,
        /// Whether the prefill's parameters go along.
        with_params: bool,
    },
    /// Give up: `stage` failed for `reason`.
    Fail {
        /// `prefill` or `decode`.
        stage: &'static str,
        /// What happened, for the client's error.
        reason: String,
        /// A leg's own 4xx answer to pass on, if that is what ended it.
        rejected: Option<(u16, String)>,
    },
}

/// Where a request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Start,
    Prefilling(usize),
    Decoding { leg: usize, with_params: bool },
    Done,
}

/// One client request's path through the legs. Inputs: `prefilled`, `prefill_failed`,
/// `decode_failed` (with whether the client already got bytes of this attempt), each answered
/// with the next [`Step`]; `start` gives the first. The shell supplies the legs' loads at each
/// call, so every choice sees the loads of that moment.
#[derive(Debug, Clone)]
pub struct ProxyRequest {
    stage: Stage,
    policy: Policy,
    retries_left: u32,
    avoid_prefill: Vec<usize>,
    avoid_decode: Vec<usize>,
    retries: u32,
}

/// The legs' loads a step is chosen from, and the rotation counters.
#[derive(Debug)]
pub struct Loads<'a> {
    /// Prefill legs.
    pub prefill: &'a [LegView],
    /// Decode legs.
    pub decode: &'a [LegView],
    /// Rotation of prefill choices.
    pub prefill_turn: &'a mut usize,
    /// Rotation of decode choices.
    pub decode_turn: &'a mut usize,
}

impl ProxyRequest {
    /// A request that may start over `max_retries` times.
    pub fn new(policy: Policy, max_retries: u32) -> Self {
        ProxyRequest {
            stage: Stage::Start,
            policy,
            retries_left: max_retries,
            avoid_prefill: Vec::new(),
            avoid_decode: Vec::new(),
            retries: 0,
        }
    }

    /// Times the request started a stage over on another leg.
    pub fn retries(&self) -> u32 {
        self.retries
    }

    /// The first step.
    pub fn start(&mut self, loads: Loads<'_>) -> Step {
        self.prefill_or_local(loads)
    }

    /// The prefill answered with parameters: decode with them.
    pub fn prefilled(&mut self, loads: Loads<'_>) -> Step {
        self.decode(loads, true)
    }

    /// The prefill answered without parameters (it handed nothing off, e.g. its only token
    /// stopped it): the decode leg computes the prompt.
    pub fn prefilled_without_params(&mut self, loads: Loads<'_>) -> Step {
        self.decode(loads, false)
    }

    /// The prefill stage failed.
    pub fn prefill_failed(&mut self, failure: StageFailure, loads: Loads<'_>) -> Step {
        let Stage::Prefilling(leg) = self.stage else {
            return self.fail("prefill", "a prefill result came for no prefill".into(), None);
        };
        if let StageFailure::Rejected { status, body } = failure {
            return self.fail(
                "prefill",
                format!("prefill leg rejected the request ({status})"),
                Some((status, body)),
            );
        }
        self.avoid_prefill.push(leg);
        if self.retries_left == 0 {
            // No start over left: the decode leg computes the prompt (no retry is spent).
            return self.decode(loads, false);
        }
        self.spend_retry();
        self.prefill_or_local(loads)
    }

    /// The decode stage failed; `client_has_bytes` says whether any byte of this attempt's
    /// answer reached the client (a stream had begun).
    pub fn decode_failed(&mut self, failure: StageFailure, client_has_bytes: bool, loads: Loads<'_>) -> Step {
        let Stage::Decoding { leg, with_params } = self.stage else {
            return self.fail("decode", "a decode result came for no decode".into(), None);
        };
        let reason = match failure {
            StageFailure::Rejected { status, body } => {
                return self.fail(
                    "decode",
                    format!("decode leg rejected the request ({status})"),
                    Some((status, body)),
                );
            }
            StageFailure::Lost(reason) => reason,
            StageFailure::TimedOut => "timed out".to_string(),
        };
        self.avoid_decode.push(leg);
        if self.retries_left == 0 {
            return self.fail("decode", reason, None);
        }
        self.spend_retry();
        if client_has_bytes {
            // The stream restarts from the prompt: the KV is computed again (the lost leg may
            // hold the hand-off), on other legs where there are any.
            return self.prefill_or_local(loads);
        }
        self.decode(loads, with_params)
    }

    /// The decode answered in full.
    pub fn finished(&mut self) {
        self.stage = Stage::Done;
    }

    fn spend_retry(&mut self) {
        self.retries_left -= 1;
        self.retries += 1;
    }

    fn prefill_or_local(&mut self, loads: Loads<'_>) -> Step {
        match choose(
            loads.prefill,
            &self.avoid_prefill,
            self.policy,
            loads.prefill_turn,
        ) {
            Some(leg) => {
                self.stage = Stage::Prefilling(leg);
                Step::Prefill { leg }
            }
            // No prefill leg to take it: the decode leg computes the prompt itself.
            None => self.decode(loads, false),
        }
    }

    fn decode(&mut self, loads: Loads<'_>, with_params: bool) -> Step {
        // A leg avoided for this request is tried again only when no other decode leg is up:
        // a second chance on a leg that recovered beats failing the request.
        let leg = choose(loads.decode, &self.avoid_decode, self.policy, loads.decode_turn)
            .or_else(|| choose(loads.decode, &[], self.policy, loads.decode_turn));
        match leg {
            Some(leg) => {
                self.stage = Stage::Decoding { leg, with_params };
                Step::Decode { leg, with_params }
            }
            None => self.fail("decode", "no decode leg is up".into(), None),
        }
    }

    fn fail(&mut self, stage: &'static str, reason: String, rejected: Option<(u16, String)>) -> Step {
        self.stage = Stage::Done;
        Step::Fail {
            stage,
            reason,
            rejected,
        }
    }
}

/// The client's view of a stream that may start over: the content chunks it was sent, and,
/// during a new attempt, how far the new stream has caught up with them.
#[derive(Debug, Clone, Default)]
pub struct Replay {
    sent: Vec<String>,
    /// Content chunks of the current attempt seen so far.
    seen: usize,
}

/// What to do with one chunk of a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChunkAction {
    /// Send it to the client.
    Forward,
    /// The client has it already (an earlier attempt sent it): drop it.
    Skip,
    /// It differs from what the client was sent at this place: end the stream with an error.
    Diverged,
}

impl Replay {
    /// A new attempt begins: its chunks are checked against those sent.
    pub fn restart(&mut self) {
        self.seen = 0;
    }

    /// A chunk of the current attempt; `content` is the text it adds (`None` for chunks that
    /// add none: a role header, usage, a finish marker).
    pub fn chunk(&mut self, content: Option<&str>) -> ChunkAction {
        let caught_up = self.seen >= self.sent.len();
        let Some(content) = content else {
            // Text-less chunks before the catch-up point repeat what the client has.
            return if caught_up {
                ChunkAction::Forward
            } else {
                ChunkAction::Skip
            };
        };
        if caught_up {
            self.sent.push(content.to_string());
            self.seen += 1;
            return ChunkAction::Forward;
        }
        let expected = &self.sent[self.seen];
        self.seen += 1;
        if expected == content {
            ChunkAction::Skip
        } else {
            ChunkAction::Diverged
        }
    }

    /// Whether the client has any content of this request.
    pub fn has_content(&self) -> bool {
        !self.sent.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn up(in_flight: u32, reported: u32, kv_usage: f64) -> LegView {
        LegView {
            healthy: true,
            in_flight,
            reported,
            kv_usage,
        }
    }

    #[test]
    fn least_loaded_takes_fewest_requests_then_least_kv_and_rotates_ties() {
        let loads = [up(2, 0, 0.0), up(0, 1, 0.9), up(0, 1, 0.1), LegView::default()];
        let mut turn = 0;
        // Leg 3 is down; legs 1 and 2 carry one request each (reported), leg 2 less KV.
        assert_eq!(choose(&loads, &[], Policy::LeastLoaded, &mut turn), Some(2));
        assert_eq!(choose(&loads, &[2], Policy::LeastLoaded, &mut turn), Some(1));
        // Equal legs are taken in turn.
        let equal = [up(0, 0, 0.0); 3];
        let picks: Vec<_> = (0..3)
            .map(|_| choose(&equal, &[], Policy::LeastLoaded, &mut turn).unwrap())
            .collect();
        let mut sorted = picks.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, vec![0, 1, 2], "{picks:?}");
        assert_eq!(
            choose(&[LegView::default()], &[], Policy::LeastLoaded, &mut turn),
            None
        );
        assert_eq!(choose(&equal, &[0, 1, 2], Policy::RoundRobin, &mut turn), None);
    }

    #[test]
    fn round_robin_ignores_load() {
        let loads = [up(9, 9, 1.0), up(0, 0, 0.0)];
        let mut turn = 0;
        let picks: Vec<_> = (0..4)
            .map(|_| choose(&loads, &[], Policy::RoundRobin, &mut turn).unwrap())
            .collect();
        assert_eq!(picks, vec![0, 1, 0, 1]);
    }

    struct World {
        prefill: Vec<LegView>,
        decode: Vec<LegView>,
        turns: (usize, usize),
    }

    impl World {
        fn new(prefill: usize, decode: usize) -> Self {
            World {
                prefill: vec![up(0, 0, 0.0); prefill],
                decode: vec![up(0, 0, 0.0); decode],
                turns: (0, 0),
            }
        }

        fn loads(&mut self) -> Loads<'_> {
            Loads {
                prefill: &self.prefill,
                decode: &self.decode,
                prefill_turn: &mut self.turns.0,
                decode_turn: &mut self.turns.1,
            }
        }
    }

    fn lost() -> StageFailure {
        StageFailure::Lost("connection refused".into())
    }

    #[test]
    fn a_failed_prefill_moves_to_another_then_to_a_local_prefill() {
        let mut world = World::new(2, 1);
        let mut request = ProxyRequest::new(Policy::LeastLoaded, 1);
        let Step::Prefill { leg: first } = request.start(world.loads()) else {
            panic!("starts with a prefill")
        };
        let Step::Prefill { leg: second } = request.prefill_failed(StageFailure::TimedOut, world.loads())
        else {
            panic!("another prefill")
        };
        assert_ne!(first, second);
        assert_eq!(request.retries(), 1);
        // The retry is spent: the decode leg computes the prompt itself.
        assert_eq!(
            request.prefill_failed(lost(), world.loads()),
            Step::Decode {
                leg: 0,
                with_params: false
            }
        );
    }

    #[test]
    fn without_a_prefill_leg_the_decode_leg_computes_the_prompt() {
        let mut world = World::new(1, 1);
        world.prefill[0].healthy = false;
        let mut request = ProxyRequest::new(Policy::LeastLoaded, 1);
        assert_eq!(
            request.start(world.loads()),
            Step::Decode {
                leg: 0,
                with_params: false
            }
        );
    }

    #[test]
    fn a_decode_lost_before_its_first_byte_moves_to_another_decode_with_the_same_params() {
        let mut world = World::new(1, 2);
        let mut request = ProxyRequest::new(Policy::RoundRobin, 1);
        assert_eq!(request.start(world.loads()), Step::Prefill { leg: 0 });
        let Step::Decode {
            leg,
            with_params: true,
        } = request.prefilled(world.loads())
        else {
            panic!("decodes with the params")
        };
        let again = request.decode_failed(lost(), false, world.loads());
        assert_eq!(
            again,
            Step::Decode {
                leg: 1 - leg,
                with_params: true
            }
        );
        // Retries spent: the request fails, naming the stage.
        assert!(matches!(
            request.decode_failed(lost(), false, world.loads()),
            Step::Fail {
                stage: "decode",
                rejected: None,
                ..
            }
        ));
    }

    #[test]
    fn a_decode_lost_mid_stream_starts_over_from_the_prompt() {
        let mut world = World::new(1, 2);
        let mut request = ProxyRequest::new(Policy::LeastLoaded, 2);
        assert_eq!(request.start(world.loads()), Step::Prefill { leg: 0 });
        let Step::Decode { leg, .. } = request.prefilled(world.loads()) else {
            panic!("decodes")
        };
        assert_eq!(
            request.decode_failed(lost(), true, world.loads()),
            Step::Prefill { leg: 0 }
        );
        let Step::Decode {
            leg: next,
            with_params: true,
        } = request.prefilled(world.loads())
        else {
            panic!("decodes again")
        };
        assert_ne!(next, leg, "not on the leg that was lost");
    }

    #[test]
    fn a_leg_rejecting_the_request_is_passed_on_and_not_retried() {
        let mut world = World::new(2, 1);
        let mut request = ProxyRequest::new(Policy::LeastLoaded, 3);
        request.start(world.loads());
        let rejected = StageFailure::Rejected {
            status: 400,
            body: "{\"error\": \"too long\"}".into(),
        };
        assert_eq!(
            request.prefill_failed(rejected, world.loads()),
            Step::Fail {
                stage: "prefill",
                reason: "prefill leg rejected the request (400)".into(),
                rejected: Some((400, "{\"error\": \"too long\"}".into())),
            }
        );
        assert_eq!(request.retries(), 0);
    }

    #[test]
    fn no_decode_leg_fails_the_request() {
        let mut world = World::new(1, 1);
        world.decode[0].healthy = false;
        let mut request = ProxyRequest::new(Policy::LeastLoaded, 1);
        request.start(world.loads());
        assert!(matches!(
            request.prefilled(world.loads()),
            Step::Fail { stage: "decode", .. }
        ));
    }

    #[test]
    fn a_restarted_stream_skips_what_the_client_has_and_stops_where_it_differs() {
        let mut replay = Replay::default();
        for text in ["a", "b"] {
            assert_eq!(replay.chunk(Some(text)), ChunkAction::Forward);
        }
        assert_eq!(replay.chunk(None), ChunkAction::Forward);
        replay.restart();
        assert_eq!(replay.chunk(None), ChunkAction::Skip, "a header the client has");
        assert_eq!(replay.chunk(Some("a")), ChunkAction::Skip);
        assert_eq!(replay.chunk(Some("b")), ChunkAction::Skip);
        assert_eq!(replay.chunk(Some("c")), ChunkAction::Forward);
        assert_eq!(replay.chunk(None), ChunkAction::Forward);
        replay.restart();
        assert_eq!(replay.chunk(Some("a")), ChunkAction::Skip);
        assert_eq!(replay.chunk(Some("x")), ChunkAction::Diverged);
        assert!(replay.has_content());
    }
}
