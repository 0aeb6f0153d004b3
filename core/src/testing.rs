//! A deterministic simulation of the leg protocol: a router, a prefill leg and a decode leg built
//! from the real machines ([`crate::leg`]), the real [`Allocator`] and [`GrantTable`], messages
//! bincode-encoded in transit, a READ engine over byte arenas, and virtual time (after
//! quinn-proto's `Pair` and TigerBeetle's VOPR).
//!
//! [`simulate`] runs one scenario from a seed: a layout, a stream of requests with shared
//! prefixes, and (optionally) faults on a seeded schedule: messages dropped, duplicated or
//! delayed (and so reordered), a leg frozen, a lease lapsed (the decode leg frozen past it), a
//! READ failed half way, a leg restarted with a new incarnation. After every step it checks
//! the invariants of docs/ARCHITECTURE.md; the run's [`SimReport`] lists any violation with the seed that
//! replays it:
//!
//! - no request's output comes from wrong or partial KV: the KV the decode leg read is compared
//!   value by value with what the prompt defines, through the output digest;
//! - every request ends by its deadline, with output or an error naming the stage;
//! - after quiesce and lease expiry no block is held and no grant lives on either leg;
//! - a READ that touched memory outside a live grant never produced output.
//!
//! KV content is a pure function of the prompt: the value of token `p` in group `g` hashes `g`
//! and the prompt's first `p + 1` tokens, as real KV depends on the prefix only. So a prefix hit
//! holds the same values a READ would bring, and the expected output is computable without a
//! model.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::allocator::Allocator;
use crate::block::{BlockId, NULL_BLOCK};
use crate::codec;
use crate::exchange::{Pairing, PairingMode};
use crate::grant::GrantTable;
use crate::layout::{GroupKind, GroupSpec, KvLayout};
use crate::leg::{
    DecodeCommand, DecodeMachine, Generated, GenerationCheck, IssuedGrant, LegConfig, PrefillCommand,
    PrefillMachine, PrefillTokens, ReadDone, RequestOutcome, RouterCommand, RouterMachine,
};
use crate::wire::{Body, Envelope, Failure, Incarnation, NodeId, RequestId};

/// What one simulated scenario runs.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SimConfig {
    /// Seed of everything random in the scenario; the same seed replays the same run.
    pub seed: u64,
    /// Requests the router sends.
    pub requests: u32,
    /// Whether faults are injected on a seeded schedule.
    pub faults: bool,
    /// Faults injected at named messages, for targeted scenarios.
    pub script: Vec<Scripted>,
    /// Keep the encoded bytes of the first [`MAX_CAPTURED`] messages sent, in
    /// [`SimReport::messages`] (real messages of every kind, e.g. to seed a fuzzer).
    pub capture_messages: bool,
}

/// Most encoded messages one scenario keeps when asked to.
pub const MAX_CAPTURED: usize = 10_000;

/// A fault injected at one named message: the `nth` (from 0) message of `kind` (as
/// [`Body::kind`] names it) that any node sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scripted {
    /// The message kind.
    pub kind: &'static str,
    /// Which one of that kind.
    pub nth: u32,
    /// What happens.
    pub action: ScriptAction,
}

/// What a [`Scripted`] fault does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScriptAction {
    /// The message is lost.
    Drop,
    /// The message arrives twice.
    Duplicate,
    /// The message arrives `by_ms` late (after others sent later).
    Delay {
        /// How late.
        by_ms: u64,
    },
    /// The node that receives the message stops for `for_ms` right after handling it.
    FreezeReceiver {
        /// How long.
        for_ms: u64,
    },
    /// The leg that sent the message restarts (new incarnation) right after sending it.
    RestartSender,
    /// The decode leg's next READ stops half way.
    FailNextRead,
    /// The decode leg's next READ takes `by_ms` longer (a slow or congested network).
    SlowNextRead {
        /// How much longer.
        by_ms: u64,
    },
}

/// A fault the simulation injects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Fault {
    /// A message is lost.
    Drop,
    /// A message arrives twice.
    Duplicate,
    /// A message arrives late (and so out of order).
    Delay,
    /// A leg stops processing for a while (SIGSTOP), then resumes.
    Freeze,
    /// The decode leg is frozen past the grant's lease, so the lease lapses under it.
    LapseLease,
    /// The next READ stops half way with an error.
    FailRead,
    /// A leg restarts with a new incarnation and empty memory.
    Restart,
    /// The client cancels a request in flight.
    Cancel,
}

impl Fault {
    /// Every fault kind, for reports.
    pub const ALL: [Fault; 8] = [
        Fault::Drop,
        Fault::Duplicate,
        Fault::Delay,
        Fault::Freeze,
        Fault::LapseLease,
        Fault::FailRead,
        Fault::Restart,
        Fault::Cancel,
    ];

    /// Short name for reports.
    pub fn name(self) -> &'static str {
        match self {
            Fault::Drop => "drop",
            Fault::Duplicate => "duplicate",
            Fault::Delay => "delay",
            Fault::Freeze => "freeze",
            Fault::LapseLease => "lapse_lease",
            Fault::FailRead => "fail_read",
            Fault::Restart => "restart",
            Fault::Cancel => "cancel",
        }
    }
}

/// What one scenario did.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SimReport {
    /// The scenario's seed.
    pub seed: u64,
    /// Requests sent.
    pub requests: u32,
    /// Requests answered with output equal to the expected one.
    pub ok: u32,
    /// Requests that failed cleanly: an error naming the stage, by the deadline.
    pub failed: u32,
    /// Faults injected, by kind.
    pub faults: BTreeMap<Fault, u32>,
    /// Invariant violations (empty when the run is sound), each naming the seed.
    pub violations: Vec<String>,
    /// Events processed.
    pub steps: u64,
    /// READs on a one-sided engine that copied blocks whose grant had already ended (a lapsed
    /// lease): allowed only because the generation check after the copy fails any whose blocks
    /// were freed; an answer from one is checked like any other.
    pub late_one_sided_reads: u32,
    /// How every request ended.
    pub outcomes: BTreeMap<RequestId, RequestOutcome>,
    /// Messages a leg refused or ignored, by why: `stale_incarnation`, `renew_refused`,
    /// `release_refused`, `after_abort`, `duplicate`.
    pub refused: BTreeMap<&'static str, u32>,
    /// The encoded messages sent, in order (with [`SimConfig::capture_messages`]).
    pub messages: Vec<Vec<u8>>,
}

/// How the simulated READ engine treats the prefill leg's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Engine {
    /// Like the network engine: the prefill side checks every block against a live grant before
    /// a byte moves.
    Served,
    /// Like shm or RDMA: the decode side copies by itself; a block freed under it shows in its
    /// generation word after the copy.
    OneSided,
}

/// A grant's lease in the simulated cluster, in virtual milliseconds.
pub const LEASE_MS: u64 = 30;
/// Waits for blocks may run several leases long, so renewals matter even without faults.
const ALLOC_WAIT_MS: u64 = 300;
/// A request's whole time budget in the simulated cluster, in virtual milliseconds.
pub const BUDGET_MS: u64 = 600;
/// Longest a READ takes.
const READ_MS: u64 = 12;
/// Milliseconds a decode leg spends per generated token (holding its blocks).
const TOKEN_MS: u64 = 15;
/// How long the router takes to notice a restarted leg.
const DETECT_MS: u64 = 30;
const BLOCKS_PER_GROUP: u32 = 32;
/// Most events one scenario may process before it is declared hung.
const MAX_STEPS: u64 = 200_000;

const ROUTER: &str = "router";
const PREFILL: &str = "prefill-0";
const DECODE: &str = "decode-0";

/// splitmix64: a tiny seeded generator, so a run depends on nothing but its seed.
#[derive(Debug, Clone)]
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, bound: u64) -> u64 {
        self.next() % bound.max(1)
    }

    /// True with probability `per_mille / 1000`.
    fn chance(&mut self, per_mille: u64) -> bool {
        self.below(1000) < per_mille
    }
}

fn mix(a: u64, b: u64) -> u64 {
    let mut rng = Rng(a ^ b.rotate_left(17) ^ 0xD6E8_FEB8_6659_FD93);
    rng.next()
}

/// The KV value of token `position` of `prompt` in group `group`: a hash of the group and the
/// prompt's first `position + 1` tokens.
fn kv_value(prompt: &[u32], group: usize, position: usize) -> u64 {
    let prefix = prompt[..=position]
        .iter()
        .fold(0u64, |hash, &token| mix(hash, u64::from(token)));
    mix(prefix, group as u64 + 1)
}

/// The mamba state after the first `N - 1` tokens of `prompt`.
fn mamba_state(prompt: &[u32], group: usize) -> u64 {
    let prefix = prompt[..prompt.len() - 1]
        .iter()
        .fold(0u64, |hash, &token| mix(hash, u64::from(token)));
    mix(prefix, 1000 + group as u64)
}

/// The tokens of an attention group a decode leg uses from remote or cached KV.
fn used_tokens(spec: &GroupSpec, num_tokens: usize) -> std::ops::Range<usize> {
    let first = match spec.kind() {
        GroupKind::SlidingWindow { window } => num_tokens.saturating_sub(window as usize),
        _ => 0,
    };
    first..num_tokens.saturating_sub(1)
}

/// What a correct decode leg outputs: a digest of every KV value it uses.
fn expected_digest(layout: &KvLayout, prompt: &[u32]) -> u64 {
    let mut digest = 0u64;
    for (group, spec) in layout.groups().iter().enumerate() {
        match spec.kind() {
            GroupKind::Mamba if prompt.len() >= 2 => digest = mix(digest, mamba_state(prompt, group)),
            GroupKind::Mamba => {}
            _ => {
                for position in used_tokens(spec, prompt.len()) {
                    digest = mix(digest, kv_value(prompt, group, position));
                }
            }
        }
    }
    digest
}

fn slots_per_block(spec: &GroupSpec) -> usize {
    match spec.kind() {
        GroupKind::Mamba => 1,
        _ => spec.effective_block_size() as usize,
    }
}

/// The layouts scenarios draw from: hybrid, DCP, window-only plus full, with both prefill-token
/// settings and lookahead tails on either leg.
fn layout_for(choice: u64) -> KvLayout {
    let groups = match choice % 4 {
        0 => vec![
            GroupSpec::full(4, 1),
            GroupSpec::sliding_window(4, 6, 1),
            Ok(GroupSpec::mamba()),
        ],
        1 => vec![GroupSpec::full(2, 2), Ok(GroupSpec::mamba())],
        2 => vec![GroupSpec::full(8, 1), GroupSpec::sliding_window(3, 5, 1)],
        _ => vec![GroupSpec::sliding_window(2, 1, 1), GroupSpec::full(3, 1)],
    };
    // The specs above are valid by construction.
    let groups: Vec<GroupSpec> = groups
        .into_iter()
        .map(|group| group.expect("valid group"))
        .collect();
    KvLayout::one_layer_per_group(groups).expect("valid layout")
}

/// The requests whose machine's timer is due at `now_ms`, in request order.
fn due<M>(
    machines: &BTreeMap<RequestId, M>,
    timeout: impl Fn(&M) -> Option<u64>,
    now_ms: u64,
) -> Vec<RequestId> {
    machines
        .iter()
        .filter(|(_, machine)| timeout(machine).is_some_and(|at| at <= now_ms))
        .map(|(&request, _)| request)
        .collect()
}

/// A simulated timed event.
#[derive(Debug, Clone)]
enum Event {
    /// The router starts a request.
    Start { request: RequestId },
    /// An encoded [`Envelope`] reaches a node, which then stops for `freeze_ms` (0: not).
    Deliver {
        to: NodeId,
        bytes: Vec<u8>,
        freeze_ms: u64,
    },
    /// A prefill leg's compute finished.
    Computed {
        incarnation: Incarnation,
        request: RequestId,
        tokens: u64,
    },
    /// A decode leg's READ finished (the bytes move now).
    ReadDone {
        incarnation: Incarnation,
        request: RequestId,
        grant: crate::wire::GrantId,
        issuer: Incarnation,
        pairing: Pairing,
        checks: Vec<GenerationCheck>,
    },
    /// A decode leg's generation finished, or stopped early when told to
    /// ([`DecodeCommand::StopGenerating`]).
    Generated {
        incarnation: Incarnation,
        request: RequestId,
        stopped: bool,
    },
    /// A leg is frozen until `until_ms`.
    Freeze {
        leg: NodeId,
        until_ms: u64,
        fault: Fault,
    },
    /// A leg restarts.
    Restart { leg: NodeId },
    /// The other nodes notice a leg restarted (heartbeats from a new incarnation).
    Detected { leg: NodeId, incarnation: Incarnation },
    /// The client cancels a request.
    Cancel { request: RequestId },
}

#[derive(Debug)]
struct Leg {
    name: NodeId,
    incarnation: Incarnation,
    config: LegConfig,
    allocator: Allocator,
    grants: GrantTable,
    /// Per group, one `u64` per token slot of every block (id 0 included, never written).
    arena: Vec<Vec<u64>>,
    prompts: BTreeMap<RequestId, Vec<u32>>,
    prefills: BTreeMap<RequestId, PrefillMachine>,
    decodes: BTreeMap<RequestId, DecodeMachine>,
    /// Requests this incarnation has started or seen aborted, so a duplicated or late message
    /// does not start one.
    seen: BTreeSet<RequestId>,
    /// Requests aborted before this leg started them.
    aborted: BTreeSet<RequestId>,
    /// Incarnation of each peer as this node knows it.
    known: HashMap<NodeId, Incarnation>,
    frozen_until_ms: u64,
    fail_next_read: bool,
    slow_next_read_ms: u64,
}

impl Leg {
    fn new(name: &str, incarnation: Incarnation, config: LegConfig, prefix_caching: bool) -> Self {
        let layout = config.layout.clone();
        let capacity = vec![BLOCKS_PER_GROUP; layout.groups().len()];
        let arena = layout
            .groups()
            .iter()
            .map(|spec| vec![0u64; (BLOCKS_PER_GROUP as usize + 1) * slots_per_block(spec)])
            .collect();
        Leg {
            name: NodeId(name.into()),
            incarnation,
            allocator: Allocator::new(&layout, &capacity, prefix_caching).expect("valid capacity"),
            grants: GrantTable::new(64),
            arena,
            config,
            prompts: BTreeMap::new(),
            prefills: BTreeMap::new(),
            decodes: BTreeMap::new(),
            seen: BTreeSet::new(),
            aborted: BTreeSet::new(),
            known: HashMap::new(),
            frozen_until_ms: 0,
            fail_next_read: false,
            slow_next_read_ms: 0,
        }
    }

    fn is_idle(&self) -> bool {
        self.allocator.is_idle()
            && self.grants.is_empty()
            && self.prefills.is_empty()
            && self.decodes.is_empty()
    }
}

/// One simulated cluster and its clock.
struct Sim {
    rng: Rng,
    seed: u64,
    now_ms: u64,
    seq: u64,
    events: BTreeMap<(u64, u64), Event>,
    layout: KvLayout,
    prefill: Leg,
    decode: Leg,
    router_incarnation: Incarnation,
    /// The router's view of each leg's incarnation.
    router_known: HashMap<NodeId, Incarnation>,
    routes: BTreeMap<RequestId, RouterMachine>,
    prompts: BTreeMap<RequestId, Vec<u32>>,
    deadlines: BTreeMap<RequestId, u64>,
    outcomes: BTreeMap<RequestId, RequestOutcome>,
    engine: Engine,
    faults_on: bool,
    script: Vec<Scripted>,
    /// Messages sent so far, by kind.
    sent: HashMap<&'static str, u32>,
    capture: bool,
    report: SimReport,
}

/// Runs one scenario and checks the invariants after every step.
pub fn simulate(config: SimConfig) -> SimReport {
    let mut rng = Rng(config.seed);
    let layout = layout_for(rng.next());
    let pairing = PairingMode::Anchored;
    let leg_config = |name: &str, incarnation, lookahead, prefill_tokens| LegConfig {
        node: NodeId(name.into()),
        incarnation,
        layout: layout.clone(),
        lookahead_tokens: lookahead,
        prefill_tokens,
        pairing,
        max_decode_tail_blocks: 1,
        alloc_wait_ms: ALLOC_WAIT_MS,
    };
    let prefill_tokens = if rng.chance(500) {
        PrefillTokens::All
    } else {
        PrefillTokens::AllButLast
    };
    let (prefill_incarnation, decode_incarnation) = (Incarnation(rng.next()), Incarnation(rng.next()));
    let prefill = Leg::new(
        PREFILL,
        prefill_incarnation,
        leg_config(PREFILL, prefill_incarnation, rng.below(4), prefill_tokens),
        false,
    );
    let decode = Leg::new(
        DECODE,
        decode_incarnation,
        leg_config(DECODE, decode_incarnation, rng.below(10), PrefillTokens::All),
        true,
    );
    let router_known = HashMap::from([
        (NodeId(PREFILL.into()), prefill_incarnation),
        (NodeId(DECODE.into()), decode_incarnation),
    ]);
    let mut sim = Sim {
        seed: config.seed,
        now_ms: 0,
        seq: 0,
        events: BTreeMap::new(),
        layout,
        prefill,
        decode,
        router_incarnation: Incarnation(rng.next()),
        router_known,
        routes: BTreeMap::new(),
        prompts: BTreeMap::new(),
        deadlines: BTreeMap::new(),
        outcomes: BTreeMap::new(),
        engine: if rng.chance(500) {
            Engine::Served
        } else {
            Engine::OneSided
        },
        faults_on: config.faults,
        script: config.script,
        sent: HashMap::new(),
        capture: config.capture_messages,
        report: SimReport {
            seed: config.seed,
            requests: config.requests,
            ..SimReport::default()
        },
        rng,
    };
    sim.plan(config.requests);
    sim.run();
    sim.report.outcomes = std::mem::take(&mut sim.outcomes);
    sim.report
}

impl Sim {
    fn schedule(&mut self, at_ms: u64, event: Event) {
        self.seq += 1;
        self.events.insert((at_ms, self.seq), event);
    }

    /// Requests with prompts from a few shared-prefix families (so prefix hits happen), lengths
    /// weighted toward 1, short prompts and block boundaries; and, with faults, a fault schedule.
    fn plan(&mut self, requests: u32) {
        for index in 0..requests {
            let request = RequestId(u64::from(index) + 1);
            let family = self.rng.below(3) as u32;
            let len = match self.rng.below(4) {
                0 => 1 + self.rng.below(3),
                1 => 1 + self.rng.below(12),
                _ => 1 + self.rng.below(40),
            } as usize;
            let prompt: Vec<u32> = (0..len)
                .map(|position| {
                    if position < 24 {
                        family * 100 + position as u32
                    } else {
                        self.rng.below(50) as u32
                    }
                })
                .collect();
            self.prompts.insert(request, prompt);
            let at = self.rng.below(40 * u64::from(requests).max(1));
            self.schedule(at, Event::Start { request });
            if self.faults_on && self.rng.chance(150) {
                // Cancelled while its READ or decode is likely under way.
                let later = at + 5 + self.rng.below(60);
                self.schedule(later, Event::Cancel { request });
            }
        }
        if !self.faults_on {
            return;
        }
        let horizon = 40 * u64::from(requests).max(1) + BUDGET_MS;
        for _ in 0..1 + self.rng.below(3) {
            let at = self.rng.below(horizon);
            let event = match self.rng.below(5) {
                0 => Event::Freeze {
                    leg: self.pick_leg(),
                    until_ms: at + 1 + self.rng.below(2 * LEASE_MS),
                    fault: Fault::Freeze,
                },
                1 => Event::Freeze {
                    leg: NodeId(DECODE.into()),
                    until_ms: at + 2 * LEASE_MS + self.rng.below(LEASE_MS),
                    fault: Fault::LapseLease,
                },
                2 => Event::Restart { leg: self.pick_leg() },
                _ => {
                    self.decode.fail_next_read = true;
                    self.count(Fault::FailRead);
                    continue;
                }
            };
            self.schedule(at, event);
        }
    }

    fn pick_leg(&mut self) -> NodeId {
        NodeId(if self.rng.chance(500) { PREFILL } else { DECODE }.into())
    }

    fn refuse(&mut self, why: &'static str) {
        *self.report.refused.entry(why).or_default() += 1;
    }

    fn count(&mut self, fault: Fault) {
        *self.report.faults.entry(fault).or_default() += 1;
    }

    fn violation(&mut self, what: String) {
        self.report
            .violations
            .push(format!("seed {}: t={} ms: {what}", self.seed, self.now_ms));
    }

    fn leg_mut(&mut self, name: &NodeId) -> Option<&mut Leg> {
        if name.0 == PREFILL {
            Some(&mut self.prefill)
        } else if name.0 == DECODE {
            Some(&mut self.decode)
        } else {
            None
        }
    }

    /// Encodes and sends a message, through the faults.
    fn send(&mut self, from: NodeId, incarnation: Incarnation, to: NodeId, request: RequestId, body: Body) {
        let budget_ms = self
            .deadlines
            .get(&request)
            .map_or(0, |deadline| deadline.saturating_sub(self.now_ms));
        let envelope = Envelope {
            request,
            from,
            incarnation,
            budget_ms,
            body,
        };
        let bytes = match codec::encode(&envelope) {
            Ok(bytes) => bytes,
            Err(error) => return self.violation(format!("cannot encode a message: {error}")),
        };
        if self.capture && self.report.messages.len() < MAX_CAPTURED {
            self.report.messages.push(bytes.clone());
        }
        let mut at = self.now_ms + 1 + self.rng.below(2);
        let kind = envelope.body.kind();
        let nth = self.sent.entry(kind).or_default();
        let scripted: Vec<ScriptAction> = self
            .script
            .iter()
            .filter(|rule| rule.kind == kind && rule.nth == *nth)
            .map(|rule| rule.action)
            .collect();
        *nth += 1;
        let mut freeze_ms = 0;
        let mut restart_sender = false;
        for action in scripted {
            match action {
                ScriptAction::Drop => {
                    self.count(Fault::Drop);
                    return;
                }
                ScriptAction::Duplicate => {
                    self.count(Fault::Duplicate);
                    let event = Event::Deliver {
                        to: to.clone(),
                        bytes: bytes.clone(),
                        freeze_ms: 0,
                    };
                    self.schedule(at + 1, event);
                }
                ScriptAction::Delay { by_ms } => {
                    self.count(Fault::Delay);
                    at += by_ms;
                }
                ScriptAction::FreezeReceiver { for_ms } => freeze_ms = for_ms,
                ScriptAction::RestartSender => restart_sender = true,
                ScriptAction::FailNextRead => {
                    self.count(Fault::FailRead);
                    self.decode.fail_next_read = true;
                }
                ScriptAction::SlowNextRead { by_ms } => self.decode.slow_next_read_ms = by_ms,
            }
        }
        if restart_sender {
            self.schedule(at, Event::Deliver { to, bytes, freeze_ms });
            let sender = envelope.from.clone();
            return self.restart(&sender);
        }
        if self.faults_on {
            if self.rng.chance(20) {
                self.count(Fault::Drop);
                return;
            }
            if self.rng.chance(40) {
                self.count(Fault::Delay);
                at += 1 + self.rng.below(LEASE_MS);
            }
            if self.rng.chance(20) {
                self.count(Fault::Duplicate);
                let later = at + self.rng.below(5);
                self.schedule(
                    later,
                    Event::Deliver {
                        to: to.clone(),
                        bytes: bytes.clone(),
                        freeze_ms: 0,
                    },
                );
            }
        }
        self.schedule(at, Event::Deliver { to, bytes, freeze_ms });
    }

    fn run(&mut self) {
        loop {
            if self.report.steps >= MAX_STEPS {
                let open: Vec<_> = self.routes.keys().collect();
                let message = format!("no quiesce within {MAX_STEPS} steps; open requests {open:?}");
                self.violation(message);
                return;
            }
            let next_event = self.events.keys().next().map(|&(at, _)| at);
            let next_timer = self.next_timer();
            let Some(at) = [next_event, next_timer].into_iter().flatten().min() else {
                break;
            };
            self.now_ms = self.now_ms.max(at);
            self.report.steps += 1;
            if next_event == Some(at) {
                let Some((_, event)) = self.events.pop_first() else {
                    break;
                };
                self.handle(event);
            }
            self.fire_timers();
            self.check_step();
        }
        self.quiesce();
    }

    /// The earliest timer of any machine or grant on a leg that is not frozen.
    fn next_timer(&self) -> Option<u64> {
        let mut next = self.routes.values().filter_map(RouterMachine::poll_timeout).min();
        for leg in [&self.prefill, &self.decode] {
            let timers = leg
                .prefills
                .values()
                .filter_map(PrefillMachine::poll_timeout)
                .chain(leg.decodes.values().filter_map(DecodeMachine::poll_timeout))
                .chain(leg.grants.poll_timeout());
            for at in timers {
                let at = at.max(leg.frozen_until_ms);
                next = Some(next.map_or(at, |next: u64| next.min(at)));
            }
        }
        next
    }

    fn fire_timers(&mut self) {
        let now = self.now_ms;
        for request in due(&self.routes, RouterMachine::poll_timeout, now) {
            if let Some(machine) = self.routes.get_mut(&request) {
                machine.handle_timeout(now);
            }
            self.drain_route(request);
        }
        for name in [PREFILL, DECODE] {
            let name = NodeId(name.into());
            let Some(leg) = self.leg_mut(&name) else { continue };
            if leg.frozen_until_ms > now {
                continue;
            }
            for grant in leg.grants.expire(now) {
                leg.allocator.unpin(&grant.blocks).ok();
            }
            let prefills = due(&leg.prefills, PrefillMachine::poll_timeout, now);
            for request in &prefills {
                if let Some(machine) = leg.prefills.get_mut(request) {
                    machine.handle_timeout(now);
                }
            }
            let decodes = due(&leg.decodes, DecodeMachine::poll_timeout, now);
            for request in &decodes {
                if let Some(machine) = leg.decodes.get_mut(request) {
                    machine.handle_timeout(now);
                }
            }
            for request in prefills.into_iter().chain(decodes) {
                self.drain_leg(&name, request);
            }
            self.wake_waiters(&name);
        }
    }

    fn handle(&mut self, event: Event) {
        let now = self.now_ms;
        match event {
            Event::Start { request } => self.start(request),
            Event::Deliver { to, bytes, freeze_ms } => {
                if let Some(leg) = self.leg_mut(&to)
                    && leg.frozen_until_ms > now
                {
                    let until = leg.frozen_until_ms;
                    return self.schedule(until, Event::Deliver { to, bytes, freeze_ms });
                }
                match codec::decode::<Envelope>(&bytes) {
                    Ok(envelope) => self.receive(&to, envelope),
                    Err(error) => self.violation(format!("a message did not decode: {error}")),
                }
                if freeze_ms > 0
                    && let Some(leg) = self.leg_mut(&to)
                {
                    leg.frozen_until_ms = now + freeze_ms;
                    self.count(Fault::Freeze);
                }
            }
            Event::Computed {
                incarnation,
                request,
                tokens,
            } => {
                if self.prefill.incarnation != incarnation {
                    return;
                }
                if self.prefill.frozen_until_ms > now {
                    let until = self.prefill.frozen_until_ms;
                    return self.schedule(
                        until,
                        Event::Computed {
                            incarnation,
                            request,
                            tokens,
                        },
                    );
                }
                self.write_prefill_kv(request, tokens);
                if let Some(machine) = self.prefill.prefills.get_mut(&request) {
                    machine.handle_computed(Ok(()), now);
                }
                self.drain_leg(&NodeId(PREFILL.into()), request);
            }
            Event::ReadDone {
                incarnation,
                request,
                grant,
                issuer,
                pairing,
                checks,
            } => {
                if self.decode.incarnation != incarnation {
                    return;
                }
                // The bytes move whether or not anyone still waits for them.
                let result = self.read(grant, issuer, &pairing, &checks);
                if let Some(machine) = self.decode.decodes.get_mut(&request) {
                    machine.handle_read_done(result, now);
                }
                self.drain_leg(&NodeId(DECODE.into()), request);
            }
            Event::Generated {
                incarnation,
                request,
                stopped,
            } => {
                if self.decode.incarnation != incarnation {
                    return;
                }
                if self.decode.frozen_until_ms > now {
                    let until = self.decode.frozen_until_ms;
                    let event = Event::Generated {
                        incarnation,
                        request,
                        stopped,
                    };
                    return self.schedule(until, event);
                }
                let result = if stopped {
                    Err(Failure::Cancelled)
                } else {
                    self.generate(request).map(Generated::from)
                };
                if let Some(machine) = self.decode.decodes.get_mut(&request) {
                    machine.handle_generated(result);
                }
                self.drain_leg(&NodeId(DECODE.into()), request);
            }
            Event::Freeze { leg, until_ms, fault } => {
                self.count(fault);
                if let Some(leg) = self.leg_mut(&leg) {
                    leg.frozen_until_ms = leg.frozen_until_ms.max(until_ms);
                }
            }
            Event::Restart { leg } => self.restart(&leg),
            Event::Cancel { request } => {
                if let Some(machine) = self.routes.get_mut(&request) {
                    self.report
                        .faults
                        .entry(Fault::Cancel)
                        .and_modify(|n| *n += 1)
                        .or_insert(1);
                    machine.handle_cancel();
                    self.drain_route(request);
                }
            }
            Event::Detected { leg, incarnation } => {
                self.router_known.insert(leg.clone(), incarnation);
                let open: Vec<RequestId> = self.routes.keys().copied().collect();
                for request in open {
                    if let Some(machine) = self.routes.get_mut(&request) {
                        machine.handle_peer_lost(&leg);
                    }
                    self.drain_route(request);
                }
                for other in [PREFILL, DECODE] {
                    if other != leg.0
                        && let Some(other) = self.leg_mut(&NodeId(other.into()))
                    {
                        other.known.insert(leg.clone(), incarnation);
                    }
                }
            }
        }
    }

    fn start(&mut self, request: RequestId) {
        let Some(prompt) = self.prompts.get(&request).cloned() else {
            return;
        };
        let deadline = self.now_ms + BUDGET_MS;
        self.deadlines.insert(request, deadline);
        let prefill = NodeId(PREFILL.into());
        let decode = NodeId(DECODE.into());
        let machine = RouterMachine::new(
            request,
            prompt,
            1 + self.rng.below(3) as u32,
            (prefill.clone(), self.router_known[&prefill]),
            (decode.clone(), self.router_known[&decode]),
            deadline,
            self.now_ms,
        );
        self.routes.insert(request, machine);
        self.drain_route(request);
    }

    /// Carries out a router machine's commands.
    fn drain_route(&mut self, request: RequestId) {
        while let Some(command) = self
            .routes
            .get_mut(&request)
            .and_then(RouterMachine::poll_command)
        {
            match command {
                RouterCommand::Send { to, body } => {
                    let incarnation = self.router_incarnation;
                    self.send(NodeId(ROUTER.into()), incarnation, to, request, body);
                }
                RouterCommand::Complete(outcome) => self.complete(request, outcome),
            }
        }
        if self.routes.get(&request).is_some_and(RouterMachine::is_done) {
            self.routes.remove(&request);
        }
    }

    fn complete(&mut self, request: RequestId, outcome: RequestOutcome) {
        let deadline = self.deadlines.get(&request).copied().unwrap_or(0);
        if self.now_ms > deadline {
            self.violation(format!(
                "{request} ended at {} ms, after its deadline {deadline} ms",
                self.now_ms
            ));
        }
        if self.outcomes.contains_key(&request) {
            self.violation(format!("{request} completed twice"));
        }
        match &outcome {
            RequestOutcome::Output(output) => {
                let prompt = &self.prompts[&request];
                let expected = expected_digest(&self.layout, prompt);
                if output.logits_digest != expected {
                    self.violation(format!(
                        "{request} ({} tokens) answered from wrong or partial KV",
                        prompt.len()
                    ));
                } else {
                    self.report.ok += 1;
                }
            }
            RequestOutcome::Failed { reason, .. } => {
                if reason.to_string().is_empty() {
                    self.violation(format!("{request} failed without a reason"));
                }
                self.report.failed += 1;
            }
        }
        self.outcomes.insert(request, outcome);
    }

    fn receive(&mut self, to: &NodeId, envelope: Envelope) {
        let now = self.now_ms;
        let Envelope {
            request,
            from,
            incarnation,
            budget_ms,
            body,
        } = envelope;
        if to.0 == ROUTER {
            if let Some(machine) = self.routes.get_mut(&request) {
                machine.handle_message(&from, incarnation, body);
                self.drain_route(request);
            } else if let Body::KvReady(_) = body {
                // A grant for a request the router already finished: free it now.
                let router = self.router_incarnation;
                self.send(NodeId(ROUTER.into()), router, from, request, Body::Abort);
            }
            return;
        }
        let router_incarnation = self.router_incarnation;
        let Some(leg) = self.leg_mut(to) else { return };
        // Node-level incarnation check: adopt the first incarnation seen; refuse any other.
        let known = *leg.known.entry(from.clone()).or_insert(incarnation);
        if (known != incarnation && from.0 != ROUTER)
            || (from.0 == ROUTER && incarnation != router_incarnation)
        {
            return self.refuse("stale_incarnation");
        }
        let deadline = now.saturating_add(budget_ms);
        match body {
            Body::Prefill { prompt, decode } => {
                if !leg.seen.insert(request) {
                    let why = if leg.aborted.contains(&request) {
                        "after_abort"
                    } else {
                        "duplicate"
                    };
                    return self.refuse(why);
                }
                leg.prompts.insert(request, prompt.clone());
                let machine =
                    PrefillMachine::new(leg.config.clone(), request, from, prompt, decode, deadline, now);
                leg.prefills.insert(request, machine);
            }
            Body::Decode {
                params, max_tokens, ..
            } => {
                if !leg.seen.insert(request) {
                    let why = if leg.aborted.contains(&request) {
                        "after_abort"
                    } else {
                        "duplicate"
                    };
                    return self.refuse(why);
                }
                leg.prompts.insert(request, params.prompt.clone());
                let machine = DecodeMachine::new(leg.config.clone(), from, params, max_tokens, deadline, now);
                leg.decodes.insert(request, machine);
            }
            Body::Renew { grant, issuer } => {
                if issuer != leg.incarnation {
                    return self.refuse("stale_incarnation");
                }
                if leg.grants.renew(grant, &from, now).is_err() {
                    return self.refuse("renew_refused");
                }
                let (name, mine) = (leg.name.clone(), leg.incarnation);
                let renewed = Body::Renewed {
                    grant,
                    lease_ms: LEASE_MS,
                };
                return self.send(name, mine, from, request, renewed);
            }
            Body::Renewed { lease_ms, .. } => {
                if let Some(machine) = leg.decodes.get_mut(&request) {
                    machine.handle_renewed(lease_ms, now);
                }
            }
            Body::Release { grant, issuer } => {
                if issuer != leg.incarnation {
                    return self.refuse("stale_incarnation");
                }
                match leg.grants.release(grant, &from) {
                    Ok(ended) => {
                        leg.allocator.unpin(&ended.blocks).ok();
                    }
                    Err(_) => return self.refuse("release_refused"),
                }
            }
            Body::Abort => {
                // A tombstone: a request or its parameters arriving after the abort (reordered
                // past it) is not started.
                if leg.seen.insert(request) {
                    leg.aborted.insert(request);
                }
                for grant in leg.grants.grants_of(request) {
                    if let Some(ended) = leg.grants.revoke(grant) {
                        leg.allocator.unpin(&ended.blocks).ok();
                    }
                }
                if let Some(machine) = leg.prefills.get_mut(&request) {
                    machine.handle_abort();
                }
                if let Some(machine) = leg.decodes.get_mut(&request) {
                    machine.handle_abort();
                }
            }
            Body::KvReady(_)
            | Body::Output(_)
            | Body::Failed { .. }
            | Body::Load(_)
            | Body::Tokens { .. } => {
                return;
            }
        }
        let name = to.clone();
        self.drain_leg(&name, request);
        self.wake_waiters(&name);
    }

    /// Carries out a leg machine's commands until it has none.
    fn drain_leg(&mut self, name: &NodeId, request: RequestId) {
        loop {
            let now = self.now_ms;
            let Some(leg) = self.leg_mut(name) else { return };
            if let Some(command) = leg
                .prefills
                .get_mut(&request)
                .and_then(PrefillMachine::poll_command)
            {
                self.prefill_command(request, command, now);
                continue;
            }
            let Some(leg) = self.leg_mut(name) else { return };
            if let Some(command) = leg
                .decodes
                .get_mut(&request)
                .and_then(DecodeMachine::poll_command)
            {
                self.decode_command(request, command, now);
                continue;
            }
            let Some(leg) = self.leg_mut(name) else { return };
            if leg.prefills.get(&request).is_some_and(PrefillMachine::is_done) {
                leg.prefills.remove(&request);
            }
            if leg.decodes.get(&request).is_some_and(DecodeMachine::is_done) {
                leg.decodes.remove(&request);
            }
            return;
        }
    }

    /// Blocks were freed on a leg: every machine waiting for blocks there tries again.
    fn wake_waiters(&mut self, name: &NodeId) {
        let Some(leg) = self.leg_mut(name) else { return };
        if leg.allocator.poll_freed().is_empty() {
            return;
        }
        let mut woken = Vec::new();
        for (&request, machine) in leg.prefills.iter_mut() {
            machine.handle_blocks_freed();
            woken.push(request);
        }
        for (&request, machine) in leg.decodes.iter_mut() {
            machine.handle_blocks_freed();
            woken.push(request);
        }
        for request in woken {
            self.drain_leg(name, request);
        }
    }

    fn prefill_command(&mut self, request: RequestId, command: PrefillCommand, now: u64) {
        let leg = &mut self.prefill;
        let prompt = leg.prompts.get(&request).cloned().unwrap_or_default();
        match command {
            PrefillCommand::Allocate { slots } => {
                let result = leg.allocator.allocate(request, &prompt, slots, None).map(drop);
                if let Some(machine) = leg.prefills.get_mut(&request) {
                    machine.handle_allocated(result, now);
                }
            }
            PrefillCommand::Compute { tokens } => {
                let at = now + 1 + tokens / 8;
                let incarnation = leg.incarnation;
                self.schedule(
                    at,
                    Event::Computed {
                        incarnation,
                        request,
                        tokens,
                    },
                );
            }
            PrefillCommand::ReleaseWindow { attending_token } => {
                let lists = leg
                    .allocator
                    .release_window(request, attending_token)
                    .and_then(|()| {
                        leg.allocator
                            .blocks(request)
                            .map(<[Vec<BlockId>]>::to_vec)
                            .ok_or(crate::allocator::AllocError::UnknownRequest(request))
                    });
                if let Some(machine) = leg.prefills.get_mut(&request) {
                    machine.handle_window_released(lists);
                }
            }
            PrefillCommand::Grant { lists, peer } => {
                let result = match leg.allocator.pin(&lists) {
                    Err(error) => Err(Failure::Grant(error.to_string())),
                    Ok(generations) => match leg.grants.issue(request, peer, lists.clone(), LEASE_MS, now) {
                        Ok(grant) => Ok(IssuedGrant {
                            grant,
                            generations,
                            lease_ms: LEASE_MS,
                        }),
                        Err(error) => {
                            leg.allocator.unpin(&lists).ok();
                            Err(Failure::Grant(error.to_string()))
                        }
                    },
                };
                if let Some(machine) = leg.prefills.get_mut(&request) {
                    machine.handle_granted(result, now);
                }
            }
            PrefillCommand::Revoke { grant } => {
                if let Some(ended) = leg.grants.revoke(grant) {
                    leg.allocator.unpin(&ended.blocks).ok();
                }
            }
            PrefillCommand::Finish => {
                if leg.allocator.finish(request, None).is_err() {
                    self.violation(format!("prefill finished {request} twice or never allocated it"));
                }
                self.prefill.prompts.remove(&request);
            }
            PrefillCommand::Send { to, body } => {
                let (name, incarnation) = (leg.name.clone(), leg.incarnation);
                self.send(name, incarnation, to, request, body);
            }
        }
    }

    fn decode_command(&mut self, request: RequestId, command: DecodeCommand, now: u64) {
        let leg = &mut self.decode;
        let prompt = leg.prompts.get(&request).cloned().unwrap_or_default();
        match command {
            DecodeCommand::Allocate {
                slots,
                attending_token,
            } => {
                let result = leg
                    .allocator
                    .allocate(request, &prompt, slots, Some(attending_token));
                if let Some(machine) = leg.decodes.get_mut(&request) {
                    machine.handle_allocated(result, now);
                }
            }
            DecodeCommand::Read { pairing, checks } => {
                let Some((issuer, grant)) = leg
                    .decodes
                    .get(&request)
                    .map(|machine| (machine.prefill_incarnation(), machine.grant()))
                else {
                    return;
                };
                let slow = std::mem::take(&mut leg.slow_next_read_ms);
                let at = now + 1 + self.rng.below(READ_MS) + slow;
                let incarnation = leg.incarnation;
                self.schedule(
                    at,
                    Event::ReadDone {
                        incarnation,
                        request,
                        grant,
                        issuer,
                        pairing,
                        checks,
                    },
                );
            }
            DecodeCommand::Generate { max_tokens, .. } => {
                let incarnation = leg.incarnation;
                let at = now + 1 + TOKEN_MS * u64::from(max_tokens);
                let event = Event::Generated {
                    incarnation,
                    request,
                    stopped: false,
                };
                self.schedule(at, event);
            }
            DecodeCommand::StopGenerating => {
                // The token under way finishes, then the generation answers; the event it was
                // due to answer with later finds the request gone.
                let event = Event::Generated {
                    incarnation: leg.incarnation,
                    request,
                    stopped: true,
                };
                self.schedule(now + 1 + TOKEN_MS, event);
            }
            DecodeCommand::Finish { cache_prompt } => {
                let cache = cache_prompt.then_some(prompt.as_slice());
                if leg.allocator.finish(request, cache).is_err() {
                    self.violation(format!("decode finished {request} twice or never allocated it"));
                }
                self.decode.prompts.remove(&request);
            }
            DecodeCommand::Send { to, body } => {
                let (name, incarnation) = (leg.name.clone(), leg.incarnation);
                self.send(name, incarnation, to, request, body);
            }
        }
    }

    /// The prefill leg's engine writes the first `tokens` tokens' KV (and the mamba state after
    /// `N - 1` tokens) into the request's blocks.
    fn write_prefill_kv(&mut self, request: RequestId, tokens: u64) {
        let leg = &mut self.prefill;
        let (Some(prompt), Some(lists)) = (leg.prompts.get(&request), leg.allocator.blocks(request)) else {
            return;
        };
        for (group, spec) in leg.config.layout.groups().iter().enumerate() {
            let per_block = slots_per_block(spec);
            let list = &lists[group];
            if spec.kind() == GroupKind::Mamba {
                if prompt.len() >= 2 && tokens as usize >= prompt.len() - 1 {
                    leg.arena[group][list[0] as usize] = mamba_state(prompt, group);
                }
                continue;
            }
            for position in 0..tokens as usize {
                let block = list[position / per_block];
                leg.arena[group][block as usize * per_block + position % per_block] =
                    kv_value(prompt, group, position);
            }
        }
    }

    /// Moves the paired blocks from the prefill arena to the decode arena, as the READ engine
    /// does: a served engine refuses blocks outside a live grant; a one-sided one copies and the
    /// generation check after the copy catches a block freed under it. A READ armed to fail
    /// stops half way.
    fn read(
        &mut self,
        grant: crate::wire::GrantId,
        issuer: Incarnation,
        pairing: &Pairing,
        checks: &[GenerationCheck],
    ) -> Result<ReadDone, Failure> {
        if issuer != self.prefill.incarnation {
            return Err(Failure::Read(
                "the prefill leg restarted: its memory is gone".into(),
            ));
        }
        let peer = self.decode.name.clone();
        let now = self.now_ms;
        let fail_half = std::mem::take(&mut self.decode.fail_next_read);
        let mut outside_grant = None;
        for (group, pairs) in pairing.groups.iter().enumerate() {
            for pair in pairs.iter().filter(|pair| pair.remote != NULL_BLOCK) {
                if let Err(error) = self
                    .prefill
                    .grants
                    .check_read(grant, &peer, group, pair.remote, now)
                {
                    outside_grant.get_or_insert(error);
                }
            }
        }
        if let Some(error) = outside_grant {
            match self.engine {
                Engine::Served => return Err(Failure::Read(format!("remote refused the read: {error}"))),
                Engine::OneSided => self.report.late_one_sided_reads += 1,
            }
        }
        let total: usize = pairing.groups.iter().map(Vec::len).sum();
        let mut copied = 0usize;
        let mut bytes = 0u64;
        for (group, pairs) in pairing.groups.iter().enumerate() {
            let per_block = slots_per_block(&self.layout.groups()[group]);
            for pair in pairs {
                if fail_half && copied * 2 >= total.max(1) {
                    return Err(Failure::Read(format!("injected fault after {bytes} bytes")));
                }
                if pair.remote == NULL_BLOCK {
                    continue;
                }
                let from = pair.remote as usize * per_block;
                let to = pair.local as usize * per_block;
                let source: Vec<u64> = self.prefill.arena[group][from..from + per_block].to_vec();
                self.decode.arena[group][to..to + per_block].copy_from_slice(&source);
                copied += 1;
                bytes += per_block as u64 * 8;
            }
        }
        if fail_half {
            return Err(Failure::Read(format!("injected fault after {bytes} bytes")));
        }
        for check in checks {
            let found = self.prefill.allocator.generation(check.group, check.block);
            if found != Some(check.generation) {
                return Err(Failure::StaleBlock {
                    group: check.group as u64,
                    block: check.block,
                    expected: check.generation,
                    found: found.unwrap_or(0),
                });
            }
        }
        Ok(ReadDone {
            bytes,
            runs: copied as u64,
        })
    }

    /// The decode leg recomputes the last prompt token and "decodes": a digest of every KV value
    /// it uses from its own blocks (read or prefix hits), which equals the expected digest only
    /// if every one is right.
    fn generate(&mut self, request: RequestId) -> Result<(Vec<u32>, u64), Failure> {
        let leg = &mut self.decode;
        let (Some(prompt), Some(lists)) = (leg.prompts.get(&request).cloned(), leg.allocator.blocks(request))
        else {
            return Err(Failure::Engine("request gone".into()));
        };
        let lists = lists.to_vec();
        let mut digest = 0u64;
        for (group, spec) in leg.config.layout.groups().iter().enumerate() {
            let per_block = slots_per_block(spec);
            if spec.kind() == GroupKind::Mamba {
                if prompt.len() >= 2 {
                    digest = mix(digest, leg.arena[group][lists[group][0] as usize]);
                }
                continue;
            }
            for position in used_tokens(spec, prompt.len()) {
                let block = lists[group]
                    .get(position / per_block)
                    .copied()
                    .unwrap_or(NULL_BLOCK);
                if block == NULL_BLOCK {
                    return Err(Failure::Engine(format!(
                        "group {group}: no block at token {position}"
                    )));
                }
                digest = mix(
                    digest,
                    leg.arena[group][block as usize * per_block + position % per_block],
                );
            }
            // The recomputed last token's KV lands in its block (a later prefix hit may use it).
            let last = prompt.len() - 1;
            if let Some(&block) = lists[group].get(last / per_block)
                && block != NULL_BLOCK
            {
                leg.arena[group][block as usize * per_block + last % per_block] =
                    kv_value(&prompt, group, last);
            }
        }
        Ok((vec![(digest & 0xffff) as u32], digest))
    }

    fn restart(&mut self, name: &NodeId) {
        self.count(Fault::Restart);
        let incarnation = Incarnation(self.rng.next());
        let Some(leg) = self.leg_mut(name) else { return };
        let mut config = leg.config.clone();
        config.incarnation = incarnation;
        let prefix_caching = name.0 == DECODE;
        *leg = Leg::new(&name.0, incarnation, config, prefix_caching);
        let at = self.now_ms + DETECT_MS;
        self.schedule(
            at,
            Event::Detected {
                leg: name.clone(),
                incarnation,
            },
        );
    }

    fn check_step(&mut self) {
        let now = self.now_ms;
        let late = self
            .routes
            .keys()
            .find(|request| {
                self.deadlines
                    .get(request)
                    .is_some_and(|&deadline| now > deadline)
            })
            .copied();
        if let Some(request) = late {
            self.violation(format!("{request} still open after its deadline"));
        }
    }

    /// After the last request: every request ended, and once leases lapse no block is held and no
    /// grant lives.
    fn quiesce(&mut self) {
        let unended: Vec<RequestId> = self
            .prompts
            .keys()
            .filter(|request| !self.outcomes.contains_key(request))
            .copied()
            .collect();
        for request in unended {
            self.violation(format!("{request} never ended"));
        }
        // With nothing lost on the way, every grant was released and every block given back by
        // the time the last request ended: nothing may wait for a lease to lapse.
        if !self.faults_on {
            for held in self.holding_legs() {
                self.violation(format!(
                    "{held} after every request ended, with no fault injected"
                ));
            }
        }
        self.now_ms += 2 * LEASE_MS + 1;
        for leg in [&mut self.prefill, &mut self.decode] {
            leg.frozen_until_ms = 0;
            for grant in leg.grants.expire(self.now_ms) {
                leg.allocator.unpin(&grant.blocks).ok();
            }
        }
        for held in self.holding_legs() {
            self.violation(format!("{held} after quiesce and lease expiry"));
        }
    }

    /// What each leg that is not idle still holds, in words.
    fn holding_legs(&self) -> Vec<String> {
        [&self.prefill, &self.decode]
            .into_iter()
            .filter(|leg| !leg.is_idle())
            .map(|leg| {
                let free: Vec<usize> = (0..self.layout.groups().len())
                    .map(|group| leg.allocator.free_blocks(group))
                    .collect();
                format!(
                    "{} holds blocks or grants: free {free:?} of {BLOCKS_PER_GROUP}, {} grants, {} requests' blocks, {} machines",
                    leg.name,
                    leg.grants.len(),
                    leg.allocator.num_requests(),
                    leg.prefills.len() + leg.decodes.len()
                )
            })
            .collect()
    }
}
