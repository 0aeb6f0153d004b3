//! A deterministic simulation of the leg protocol over the shipped objects (after quinn-proto's
//! `Pair` and TigerBeetle's VOPR): every leg is a [`LegNode`] (its allocator, grant table,
//! request machines, tombstones, role table, wait queue, draining and lease expiry are the code
//! that ships), and the router is the shipped [`Dispatcher`] (leg choice, attempts, retries,
//! the streamed-token skip, late grants: the actix router is a shell around the same). The
//! simulation itself is only the world: virtual time, the network (messages bincode-encoded in
//! transit, dropped, duplicated, delayed and so reordered), byte arenas that READs copy between,
//! compute and generation with their timing, and kills, freezes, drains and restarts.
//!
//! [`simulate`] runs one scenario from a seed: a topology from 1P1D up to 8P8D (or the one
//! asked for), a layout, a stream of requests with shared prefixes (some streamed, some
//! cancelled), and (optionally) faults on a seeded schedule. After every step it checks the
//! invariants of docs/ARCHITECTURE.md; the run's [`SimReport`] lists any violation with the seed
//! that replays it:
//!
//! - no request's output comes from wrong or partial KV: every value a generation step reads
//!   is compared with what the prompt defines, through the output digest and tokens;
//! - every request ends by its deadline, with output or an error naming the stage;
//! - a streamed request's client sees each token once, in order, even across retries;
//! - a retry never runs on a leg an earlier attempt of the same request failed on;
//! - after quiesce and lease expiry no block is held and no grant lives on any leg;
//! - a READ that touched memory outside a live grant never produced output;
//! - a leg runs a request at most once: a duplicated or late message never starts it again;
//! - a leg's node never reports an anomaly (a refusal its own rules say cannot happen).
//!
//! KV content is a pure function of the prompt: the value of token `p` in group `g` hashes `g`
//! and the prompt's first `p + 1` tokens, as real KV depends on the prefix only; a generated
//! position's value hashes the last prompt token's value and the position. So a prefix hit
//! holds the same values a READ would bring, and the expected output is computable without a
//! model.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use crate::allocator::Allocator;
use crate::block::{BlockId, NULL_BLOCK};
use crate::codec;
use crate::exchange::{Pairing, PairingMode};
use crate::grant::GrantTable;
use crate::layout::{GroupKind, GroupSpec, KvLayout};
use crate::leg::{Generated, GenerationCheck, LegConfig, PrefillTokens, ReadDone, RequestOutcome};
use crate::node::{LegNode, NodeConfig, NodeOutput, Outbound, Refusal};
use crate::proxy::Policy;
use crate::router::{Answer, ClientRequest, Dispatcher, RouterOutput, Ticket};
use crate::wire::{Body, Envelope, Failure, GrantId, Incarnation, NodeId, RequestId, Role, Stage};

/// How many prefill and decode legs a scenario runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Topology {
    /// Prefill legs.
    pub prefills: u32,
    /// Decode legs.
    pub decodes: u32,
}

/// Most legs of one role a scenario may run.
pub const MAX_LEGS_PER_ROLE: u32 = 16;

impl Topology {
    /// Parses `PxD` (`2x3`: two prefill legs, three decode legs), each 1 ..= [`MAX_LEGS_PER_ROLE`].
    pub fn parse(text: &str) -> Result<Topology, String> {
        let (prefills, decodes) = text
            .split_once(['x', 'X'])
            .ok_or_else(|| format!("topology {text:?}: expected PxD, e.g. 2x3"))?;
        let count = |part: &str, role: &str| -> Result<u32, String> {
            let count: u32 = part
                .trim()
                .parse()
                .map_err(|_| format!("topology {text:?}: {role} count {part:?} is not a number"))?;
            if !(1..=MAX_LEGS_PER_ROLE).contains(&count) {
                return Err(format!(
                    "topology {text:?}: {role} count {count} is outside 1..={MAX_LEGS_PER_ROLE}"
                ));
            }
            Ok(count)
        };
        Ok(Topology {
            prefills: count(prefills, "prefill")?,
            decodes: count(decodes, "decode")?,
        })
    }
}

impl std::fmt::Display for Topology {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}x{}", self.prefills, self.decodes)
    }
}

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
    /// The legs to run; `None`: chosen per seed, from 1P1D up to 8P8D.
    pub topology: Option<Topology>,
    /// Times a request may start over on other legs; `None`: chosen per seed (0 without faults).
    pub max_retries: Option<u32>,
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
    /// The receiving decode leg's next READ stops half way (every decode leg's, when the
    /// message goes elsewhere).
    FailNextRead,
    /// The receiving decode leg's next READ takes `by_ms` longer (a slow or congested network).
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
    /// A decode leg is frozen past the grant's lease, so the lease lapses under it.
    LapseLease,
    /// The next READ stops half way with an error.
    FailRead,
    /// A leg restarts with a new incarnation and empty memory.
    Restart,
    /// The client cancels a request in flight.
    Cancel,
    /// A leg drains: it refuses new requests and finishes those it runs.
    Drain,
}

impl Fault {
    /// Every fault kind, for reports.
    pub const ALL: [Fault; 9] = [
        Fault::Drop,
        Fault::Duplicate,
        Fault::Delay,
        Fault::Freeze,
        Fault::LapseLease,
        Fault::FailRead,
        Fault::Restart,
        Fault::Cancel,
        Fault::Drain,
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
            Fault::Drain => "drain",
        }
    }
}

/// What one scenario did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimReport {
    /// The scenario's seed.
    pub seed: u64,
    /// The legs it ran.
    pub topology: Topology,
    /// Requests sent.
    pub requests: u32,
    /// Requests answered with output equal to the expected one.
    pub ok: u32,
    /// Requests that failed cleanly: an error naming the stage, by the deadline.
    pub failed: u32,
    /// Requests that ran more than one attempt.
    pub retried: u32,
    /// Requests whose client was streamed tokens.
    pub streamed: u32,
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
    /// Leases that lapsed (a grant nobody released in time).
    pub expired_leases: u32,
    /// How every request ended, by the client's request id (`1..=requests`).
    pub outcomes: BTreeMap<RequestId, RequestOutcome>,
    /// Requests that failed, by [`Failure::kind`].
    pub failures: BTreeMap<&'static str, u32>,
    /// Messages a node refused, by the refusal's kind ([`refusal_kind`]; a grant refusal is
    /// `renew_refused` or `release_refused`).
    pub refused: BTreeMap<&'static str, u32>,
    /// The encoded messages sent, in order (with [`SimConfig::capture_messages`]).
    pub messages: Vec<Vec<u8>>,
}

/// The name a report counts a refusal under.
pub fn refusal_kind(refusal: &Refusal) -> &'static str {
    match refusal {
        Refusal::UnknownPeer(_) => "unknown_peer",
        Refusal::Impersonation { .. } => "impersonation",
        Refusal::StaleIncarnation { .. } | Refusal::ForeignGrant { .. } => "stale_incarnation",
        Refusal::WrongSender { .. } => "wrong_sender",
        Refusal::Grant { .. } => "grant_refused",
        Refusal::UnknownRequest { .. } => "unknown_request",
        Refusal::BadMessage { .. } => "bad_message",
        Refusal::Aborted { .. } => "after_abort",
        Refusal::Duplicate { .. } => "duplicate",
        Refusal::Incompatible(_) => "incompatible",
        Refusal::Misrouted { .. } => "misrouted",
        Refusal::Busy { .. } => "busy",
    }
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
/// How long the router and the legs take to notice a restarted leg.
const DETECT_MS: u64 = 30;
/// Blocks per group of a prefill leg.
const BLOCKS_PER_GROUP: u32 = 32;
/// Blocks per group of a decode leg: generation grows a request past its allocation without
/// waiting (the shipped generation fails a request whose leg has no block left then, a
/// capacity failure rather than a protocol one), so decode legs get room for every request's
/// tokens.
const DECODE_BLOCKS_PER_GROUP: u32 = 64;
/// Most events one scenario may process before it is declared hung.
const MAX_STEPS: u64 = 400_000;
/// Most tokens a simulated request generates.
const MAX_TOKENS: u64 = 6;

const ROUTER: &str = "router";

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

/// The KV value of any position a decode step writes: the prompt's own value below `N`, a hash
/// of the last prompt token's value and the position past it.
fn value_at(prompt: &[u32], group: usize, position: usize) -> u64 {
    if position < prompt.len() {
        kv_value(prompt, group, position)
    } else {
        mix(kv_value(prompt, group, prompt.len() - 1), position as u64)
    }
}

/// The mamba state after the first `N - 1` tokens of `prompt`.
fn mamba_state(prompt: &[u32], group: usize) -> u64 {
    let prefix = prompt[..prompt.len() - 1]
        .iter()
        .fold(0u64, |hash, &token| mix(hash, u64::from(token)));
    mix(prefix, 1000 + group as u64)
}

/// The positions an attention group's step at `position` attends to.
fn attended(spec: &GroupSpec, position: usize) -> std::ops::RangeInclusive<usize> {
    let first = spec.kind().attended_floor(position as u64).unwrap_or(0) as usize;
    first..=position
}

/// One generation step's digest, from the digest so far and the values the step reads.
fn step_digest(
    layout: &KvLayout,
    digest: u64,
    step: usize,
    prompt: &[u32],
    read: &mut dyn FnMut(usize, usize) -> u64,
) -> u64 {
    let mut digest = digest;
    let position = prompt.len() - 1 + step;
    for (group, spec) in layout.groups().iter().enumerate() {
        match spec.kind() {
            GroupKind::Mamba => {
                if step == 0 && prompt.len() >= 2 {
                    digest = mix(digest, read(group, usize::MAX));
                }
            }
            _ => {
                for attended in attended(spec, position) {
                    digest = mix(digest, read(group, attended));
                }
            }
        }
    }
    digest
}

/// The token a step with this digest chooses.
fn token_of(digest: u64, step: usize) -> u32 {
    (mix(digest, step as u64) & 0xffff) as u32
}

/// What a correct decode leg outputs for `prompt`: its tokens and the digest of every value
/// it read, from the definition alone.
fn expected_output(layout: &KvLayout, prompt: &[u32], max_tokens: u32) -> (Vec<u32>, u64) {
    let mut digest = 0u64;
    let mut tokens = Vec::new();
    for step in 0..max_tokens.max(1) as usize {
        digest = step_digest(layout, digest, step, prompt, &mut |group, position| {
            if position == usize::MAX {
                mamba_state(prompt, group)
            } else {
                value_at(prompt, group, position)
            }
        });
        tokens.push(token_of(digest, step));
    }
    (tokens, digest)
}

fn slots_per_block(spec: &GroupSpec) -> usize {
    match spec.kind() {
        GroupKind::Mamba => 1,
        _ => spec.effective_block_size() as usize,
    }
}

/// The layouts scenarios draw from: hybrid, DCP, window-only plus full, chunked local attention
/// (a chunk that is not a whole number of blocks) beside full, with both prefill-token settings
/// and lookahead tails on either leg.
fn layout_for(choice: u64) -> KvLayout {
    let groups = match choice % 5 {
        4 => vec![GroupSpec::chunked_local(4, 6, 1), GroupSpec::full(4, 1)],
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

/// A topology drawn from a seed: mostly small, sometimes up to 8P8D.
fn topology_for(rng: &mut Rng) -> Topology {
    let mut count = || match rng.below(4) {
        0 | 1 => 1,
        2 => 2 + rng.below(2) as u32,
        _ => 1 + rng.below(8) as u32,
    };
    Topology {
        prefills: count(),
        decodes: count(),
    }
}

/// A simulated timed event.
#[derive(Debug, Clone)]
enum Event {
    /// The router starts a client's request.
    Start { client: RequestId },
    /// An encoded [`Envelope`] reaches a node, which then stops for `freeze_ms` (0: not).
    Deliver {
        to: NodeId,
        bytes: Vec<u8>,
        freeze_ms: u64,
    },
    /// A prefill leg's compute finished.
    Computed {
        leg: usize,
        incarnation: Incarnation,
        request: RequestId,
        prompt: Arc<[u32]>,
        lists: Vec<Vec<BlockId>>,
        tokens: u64,
    },
    /// A decode leg's READ finished (the bytes move now).
    ReadDone {
        leg: usize,
        incarnation: Incarnation,
        request: RequestId,
        prefill: NodeId,
        grant: GrantId,
        issuer: Incarnation,
        pairing: Pairing,
        checks: Vec<GenerationCheck>,
    },
    /// A decode leg's generation takes its next step.
    Step {
        leg: usize,
        incarnation: Incarnation,
        request: RequestId,
    },
    /// A leg is frozen until `until_ms`.
    Freeze { leg: usize, until_ms: u64, fault: Fault },
    /// A leg restarts.
    Restart { leg: usize },
    /// A leg starts draining.
    Drain { leg: usize },
    /// The other nodes notice a leg restarted (heartbeats from a new incarnation).
    Detected { leg: usize, incarnation: Incarnation },
    /// The client cancels a request.
    Cancel { client: RequestId },
}

/// A generation under way on a decode leg.
#[derive(Debug)]
struct Run {
    prompt: Arc<[u32]>,
    lists: Vec<Vec<BlockId>>,
    slots: u64,
    max_tokens: u32,
    deadline_ms: u64,
    stream_to: Option<NodeId>,
    tokens: Vec<u32>,
    digest: u64,
    /// The attending token window groups were last trimmed for.
    windows_released_for: u64,
    /// Told to stop ([`NodeOutput::StopGenerating`]).
    stop: bool,
}

/// One simulated leg: the shipped node and the world around it.
#[derive(Debug)]
struct SimLeg {
    name: NodeId,
    role: Role,
    incarnation: Incarnation,
    config: NodeConfig,
    prefix_caching: bool,
    node: LegNode,
    /// Per group, one `u64` per token slot of every block (id 0 included, never written).
    arena: Vec<Vec<u64>>,
    /// Per group, each block's generation as the shell published it from
    /// [`NodeOutput::Freed`]: what a reader checks after copying.
    generations: Vec<Vec<u32>>,
    /// Incarnation of each peer as this leg's door knows it.
    known: HashMap<NodeId, Incarnation>,
    runs: BTreeMap<RequestId, Run>,
    frozen_until_ms: u64,
    fail_next_read: bool,
    slow_next_read_ms: u64,
}

impl SimLeg {
    fn new(name: NodeId, role: Role, config: NodeConfig, prefix_caching: bool) -> Self {
        let layout = config.leg.layout.clone();
        let blocks = match role {
            Role::Decode => DECODE_BLOCKS_PER_GROUP,
            _ => BLOCKS_PER_GROUP,
        };
        let capacity = vec![blocks; layout.groups().len()];
        let allocator = Allocator::new(&layout, &capacity, prefix_caching).expect("valid capacity");
        let grants = Arc::new(Mutex::new(GrantTable::new(64)));
        SimLeg {
            name,
            role,
            incarnation: config.leg.incarnation,
            node: LegNode::new(config.clone(), allocator, grants),
            arena: layout
                .groups()
                .iter()
                .map(|spec| vec![0u64; (blocks as usize + 1) * slots_per_block(spec)])
                .collect(),
            generations: vec![vec![0u32; blocks as usize + 1]; layout.groups().len()],
            config,
            prefix_caching,
            known: HashMap::new(),
            runs: BTreeMap::new(),
            frozen_until_ms: 0,
            fail_next_read: false,
            slow_next_read_ms: 0,
        }
    }

    fn is_idle(&self) -> bool {
        self.node.is_idle() && self.runs.is_empty()
    }
}

/// What the simulation knows of a client's request, to check the router against.
#[derive(Debug)]
struct Client {
    prompt: Vec<u32>,
    max_tokens: u32,
    deadline_ms: u64,
    /// Legs named by each failed attempt's failure, from the definition (not from the
    /// dispatcher): no later attempt may run on one.
    failed_on: Vec<NodeId>,
    /// The legs of the current attempt.
    legs: Option<(NodeId, NodeId)>,
    /// Tokens the client was streamed, in order.
    received: Vec<u32>,
    /// Attempts that failed and were retried.
    retries: u32,
}

/// One simulated cluster and its clock.
struct Sim {
    rng: Rng,
    seed: u64,
    now_ms: u64,
    seq: u64,
    events: BTreeMap<(u64, u64), Event>,
    layout: KvLayout,
    legs: Vec<SimLeg>,
    by_name: HashMap<NodeId, usize>,
    router: NodeId,
    router_incarnation: Incarnation,
    /// The router's view of each leg's incarnation (its door).
    router_known: HashMap<NodeId, Incarnation>,
    /// The router's rules, as shipped.
    dispatcher: Dispatcher,
    /// Open client requests.
    clients: BTreeMap<RequestId, Client>,
    tickets: HashMap<Ticket, RequestId>,
    prompts: BTreeMap<RequestId, Vec<u32>>,
    outcomes: BTreeMap<RequestId, RequestOutcome>,
    engine: Engine,
    faults_on: bool,
    script: Vec<Scripted>,
    /// Messages sent so far, by kind.
    sent: HashMap<&'static str, u32>,
    capture: bool,
    /// Requests each leg incarnation computed or read, with the kind: a leg runs a request at
    /// most once (a duplicated or late message never starts it again).
    started: std::collections::HashSet<(usize, Incarnation, RequestId, &'static str)>,
    /// A violation made going on pointless (a timer that never stops firing).
    stuck: bool,
    report: SimReport,
}

/// Runs one scenario and checks the invariants after every step.
pub fn simulate(config: SimConfig) -> SimReport {
    let mut rng = Rng(config.seed);
    let layout = layout_for(rng.next());
    let topology = config.topology.unwrap_or_else(|| topology_for(&mut rng));
    let prefill_tokens = if rng.chance(500) {
        PrefillTokens::All
    } else {
        PrefillTokens::AllButLast
    };
    // Without faults no request may fail, so the wait queue has room for every request.
    let wait_queue = if config.faults && rng.chance(300) {
        1 + rng.below(3) as usize
    } else {
        64
    };
    let mut legs = Vec::new();
    for (role, count) in [
        (Role::Prefill, topology.prefills),
        (Role::Decode, topology.decodes),
    ] {
        for index in 0..count {
            let name = NodeId(format!("{role}-{index}"));
            let incarnation = Incarnation(rng.next());
            let lookahead = match role {
                Role::Prefill => rng.below(4),
                _ => rng.below(10),
            };
            let config = NodeConfig {
                leg: LegConfig {
                    node: name.clone(),
                    incarnation,
                    layout: layout.clone(),
                    lookahead_tokens: lookahead,
                    prefill_tokens: if role == Role::Prefill {
                        prefill_tokens
                    } else {
                        PrefillTokens::All
                    },
                    pairing: PairingMode::Anchored,
                    max_decode_tail_blocks: 1,
                    alloc_wait_ms: ALLOC_WAIT_MS,
                },
                role,
                lease_ms: LEASE_MS,
                wait_queue,
            };
            legs.push(SimLeg::new(name, role, config, role == Role::Decode));
        }
    }
    let by_name = legs
        .iter()
        .enumerate()
        .map(|(index, leg)| (leg.name.clone(), index))
        .collect();
    let router_known = legs
        .iter()
        .map(|leg| (leg.name.clone(), leg.incarnation))
        .collect();
    let max_retries = config
        .max_retries
        .unwrap_or_else(|| if config.faults { rng.below(3) as u32 } else { 0 });
    let policy = if rng.chance(500) {
        Policy::LeastLoaded
    } else {
        Policy::RoundRobin
    };
    let mut dispatcher = Dispatcher::new(policy, max_retries, 1 << 32);
    for leg in &legs {
        dispatcher.set_leg(&leg.name, Some((leg.role, leg.incarnation)), 0);
    }
    let mut sim = Sim {
        seed: config.seed,
        now_ms: 0,
        seq: 0,
        events: BTreeMap::new(),
        layout,
        legs,
        by_name,
        router: NodeId(ROUTER.into()),
        router_incarnation: Incarnation(rng.next()),
        router_known,
        dispatcher,
        clients: BTreeMap::new(),
        tickets: HashMap::new(),
        prompts: BTreeMap::new(),
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
        started: std::collections::HashSet::new(),
        stuck: false,
        report: SimReport {
            seed: config.seed,
            topology,
            requests: config.requests,
            ok: 0,
            failed: 0,
            retried: 0,
            streamed: 0,
            faults: BTreeMap::new(),
            violations: Vec::new(),
            steps: 0,
            late_one_sided_reads: 0,
            expired_leases: 0,
            outcomes: BTreeMap::new(),
            failures: BTreeMap::new(),
            refused: BTreeMap::new(),
            messages: Vec::new(),
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
    /// weighted toward 1, short prompts and block boundaries, some streamed; and, with faults,
    /// cancels and a fault schedule.
    fn plan(&mut self, requests: u32) {
        for index in 0..requests {
            let client = RequestId(u64::from(index) + 1);
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
            self.prompts.insert(client, prompt);
            let at = self.rng.below(40 * u64::from(requests).max(1));
            self.schedule(at, Event::Start { client });
            if self.faults_on && self.rng.chance(150) {
                // Cancelled while its READ or decode is likely under way.
                let later = at + 5 + self.rng.below(60);
                self.schedule(later, Event::Cancel { client });
            }
        }
        if !self.faults_on {
            return;
        }
        let horizon = 40 * u64::from(requests).max(1) + BUDGET_MS;
        for _ in 0..1 + self.rng.below(3) {
            let at = self.rng.below(horizon);
            let event = match self.rng.below(11) {
                0 | 1 => Event::Freeze {
                    leg: self.pick_leg(None),
                    until_ms: at + 1 + self.rng.below(2 * LEASE_MS),
                    fault: Fault::Freeze,
                },
                2 | 3 => Event::Freeze {
                    leg: self.pick_leg(Some(Role::Decode)),
                    until_ms: at + 2 * LEASE_MS + self.rng.below(LEASE_MS),
                    fault: Fault::LapseLease,
                },
                4 | 5 => Event::Restart {
                    leg: self.pick_leg(None),
                },
                6 => Event::Drain {
                    leg: self.pick_leg(None),
                },
                _ => {
                    let leg = self.pick_leg(Some(Role::Decode));
                    self.legs[leg].fail_next_read = true;
                    self.count(Fault::FailRead);
                    continue;
                }
            };
            self.schedule(at, event);
        }
    }

    /// A leg at random, of `role` if given.
    fn pick_leg(&mut self, role: Option<Role>) -> usize {
        let candidates: Vec<usize> = (0..self.legs.len())
            .filter(|&index| role.is_none_or(|role| self.legs[index].role == role))
            .collect();
        candidates[self.rng.below(candidates.len() as u64) as usize]
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

    fn role_of(&self, node: &NodeId) -> Role {
        match self.by_name.get(node) {
            Some(&index) => self.legs[index].role,
            None => Role::Router,
        }
    }

    /// Encodes and sends a message, through the faults. Streamed tokens travel reliably and in
    /// order (a QUIC stream): only whole-leg faults cut them.
    fn send(&mut self, from: NodeId, incarnation: Incarnation, out: Outbound) {
        let Outbound {
            to,
            request,
            budget_ms,
            body,
        } = out;
        let reliable = matches!(body, Body::Tokens { .. });
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
        if reliable {
            return self.schedule(
                self.now_ms + 1,
                Event::Deliver {
                    to,
                    bytes,
                    freeze_ms: 0,
                },
            );
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
                    for leg in self.decode_legs_for(&to) {
                        self.legs[leg].fail_next_read = true;
                    }
                }
                ScriptAction::SlowNextRead { by_ms } => {
                    for leg in self.decode_legs_for(&to) {
                        self.legs[leg].slow_next_read_ms = by_ms;
                    }
                }
            }
        }
        if restart_sender {
            self.schedule(at, Event::Deliver { to, bytes, freeze_ms });
            if let Some(&sender) = self.by_name.get(&envelope.from) {
                self.restart(sender);
            }
            return;
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
                let event = Event::Deliver {
                    to: to.clone(),
                    bytes: bytes.clone(),
                    freeze_ms: 0,
                };
                self.schedule(later, event);
            }
        }
        self.schedule(at, Event::Deliver { to, bytes, freeze_ms });
    }

    /// The decode leg a message goes to, or every decode leg when it goes elsewhere.
    fn decode_legs_for(&self, to: &NodeId) -> Vec<usize> {
        match self.by_name.get(to) {
            Some(&leg) if self.legs[leg].role == Role::Decode => vec![leg],
            _ => (0..self.legs.len())
                .filter(|&leg| self.legs[leg].role == Role::Decode)
                .collect(),
        }
    }

    fn run(&mut self) {
        loop {
            if self.report.steps >= MAX_STEPS {
                let open: Vec<_> = self.clients.keys().collect();
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
            if self.stuck {
                return;
            }
        }
        self.quiesce();
    }

    /// The earliest timer of the router, or of any leg that is not frozen.
    fn next_timer(&self) -> Option<u64> {
        let legs = self
            .legs
            .iter()
            .filter_map(|leg| leg.node.poll_timeout().map(|at| at.max(leg.frozen_until_ms)));
        legs.chain(self.dispatcher.poll_timeout()).min()
    }

    fn fire_timers(&mut self) {
        let now = self.now_ms;
        if self.dispatcher.poll_timeout().is_some_and(|at| at <= now) {
            self.dispatcher.handle_timeout(now);
            if self.dispatcher.poll_timeout().is_some_and(|at| at <= now) {
                self.violation(
                    "the router's timer is still due after handle_timeout (the shell would spin)".into(),
                );
                self.stuck = true;
            }
            self.carry_out_router();
        }
        for leg in 0..self.legs.len() {
            let state = &mut self.legs[leg];
            if state.frozen_until_ms > now || state.node.poll_timeout().is_none_or(|at| at > now) {
                continue;
            }
            state.node.handle_timeout(now);
            if state.node.poll_timeout().is_some_and(|at| at <= now) {
                // A timer still due after it was handled would spin the shell's timer forever.
                let name = state.name.clone();
                self.violation(format!(
                    "{name}: a timer is still due after handle_timeout (the shell would spin)"
                ));
                self.stuck = true;
            }
            self.carry_out(leg);
        }
    }

    fn handle(&mut self, event: Event) {
        let now = self.now_ms;
        match event {
            Event::Start { client } => self.start_client(client),
            Event::Deliver { to, bytes, freeze_ms } => {
                if let Some(&leg) = self.by_name.get(&to)
                    && self.legs[leg].frozen_until_ms > now
                {
                    let until = self.legs[leg].frozen_until_ms;
                    return self.schedule(until, Event::Deliver { to, bytes, freeze_ms });
                }
                match codec::decode::<Envelope>(&bytes) {
                    Ok(envelope) => self.receive(&to, envelope),
                    Err(error) => self.violation(format!("a message did not decode: {error}")),
                }
                if freeze_ms > 0
                    && let Some(&leg) = self.by_name.get(&to)
                {
                    self.legs[leg].frozen_until_ms = now + freeze_ms;
                    self.count(Fault::Freeze);
                }
            }
            Event::Computed {
                leg,
                incarnation,
                request,
                prompt,
                lists,
                tokens,
            } => {
                if self.legs[leg].incarnation != incarnation {
                    return;
                }
                if self.legs[leg].frozen_until_ms > now {
                    let until = self.legs[leg].frozen_until_ms;
                    let event = Event::Computed {
                        leg,
                        incarnation,
                        request,
                        prompt,
                        lists,
                        tokens,
                    };
                    return self.schedule(until, event);
                }
                self.write_prefill_kv(leg, &prompt, &lists, tokens);
                self.legs[leg].node.handle_computed(request, Ok(()), now);
                self.carry_out(leg);
            }
            Event::ReadDone {
                leg,
                incarnation,
                request,
                prefill,
                grant,
                issuer,
                pairing,
                checks,
            } => {
                if self.legs[leg].incarnation != incarnation {
                    return;
                }
                // The bytes move whether or not anyone still waits for them.
                let result = self.read(leg, &prefill, grant, issuer, &pairing, &checks);
                self.legs[leg].node.handle_read_done(request, result, now);
                self.carry_out(leg);
            }
            Event::Step {
                leg,
                incarnation,
                request,
            } => {
                if self.legs[leg].incarnation != incarnation {
                    return;
                }
                if self.legs[leg].frozen_until_ms > now {
                    let until = self.legs[leg].frozen_until_ms;
                    let event = Event::Step {
                        leg,
                        incarnation,
                        request,
                    };
                    return self.schedule(until, event);
                }
                self.step(leg, request);
            }
            Event::Freeze { leg, until_ms, fault } => {
                self.count(fault);
                let state = &mut self.legs[leg];
                state.frozen_until_ms = state.frozen_until_ms.max(until_ms);
            }
            Event::Restart { leg } => self.restart(leg),
            Event::Drain { leg } => {
                self.count(Fault::Drain);
                self.legs[leg].node.drain();
            }
            Event::Cancel { client } => {
                if self.dispatcher.cancel(client.0, now) {
                    self.count(Fault::Cancel);
                    self.carry_out_router();
                }
            }
            Event::Detected { leg, incarnation } => {
                let name = self.legs[leg].name.clone();
                self.router_known.insert(name.clone(), incarnation);
                let role = self.legs[leg].role;
                self.dispatcher.set_leg(&name, Some((role, incarnation)), now);
                self.carry_out_router();
                // Every other leg's link to the old incarnation dropped: its shell tells the node.
                let now = self.now_ms;
                for index in 0..self.legs.len() {
                    if index != leg {
                        let other = &mut self.legs[index];
                        other.known.insert(name.clone(), incarnation);
                        other.node.handle_peer_lost(&name, now);
                        self.carry_out(index);
                    }
                }
            }
        }
    }

    /// A client's request arrives at the router, which has just had every leg's load report.
    fn start_client(&mut self, client: RequestId) {
        let Some(prompt) = self.prompts.get(&client).cloned() else {
            return;
        };
        let stream = self.rng.chance(500);
        if stream {
            self.report.streamed += 1;
        }
        let now = self.now_ms;
        for leg in &self.legs {
            let (name, incarnation) = (&leg.name, leg.incarnation);
            let report = Body::Load(leg.node.load());
            self.dispatcher
                .handle_message(name, incarnation, RequestId(0), report, now);
        }
        let request = ClientRequest {
            prompt: prompt.as_slice().into(),
            max_tokens: 1 + self.rng.below(MAX_TOKENS) as u32,
            sampling: crate::sampling::Sampling::default(),
            stream,
            deadline_ms: now + BUDGET_MS,
            client: Some(client.0),
        };
        let state = Client {
            prompt,
            max_tokens: request.max_tokens,
            deadline_ms: request.deadline_ms,
            failed_on: Vec::new(),
            legs: None,
            received: Vec::new(),
            retries: 0,
        };
        self.clients.insert(client, state);
        let ticket = self.dispatcher.submit(request, now);
        self.tickets.insert(ticket, client);
        self.carry_out_router();
    }

    /// The open client request a router ticket stands for.
    fn client_of<'a>(
        tickets: &HashMap<Ticket, RequestId>,
        clients: &'a mut BTreeMap<RequestId, Client>,
        ticket: Ticket,
    ) -> Option<&'a mut Client> {
        tickets.get(&ticket).and_then(|client| clients.get_mut(client))
    }

    /// Carries out what the router's dispatcher asks, checking it against the definitions.
    fn carry_out_router(&mut self) {
        while let Some(output) = self.dispatcher.poll_output() {
            match output {
                RouterOutput::Send(out) => self.send(self.router.clone(), self.router_incarnation, out),
                RouterOutput::Started {
                    ticket,
                    prefill,
                    decode,
                    ..
                } => {
                    let Some(state) = Self::client_of(&self.tickets, &mut self.clients, ticket) else {
                        continue;
                    };
                    let failed = [&prefill, &decode]
                        .into_iter()
                        .find(|leg| state.failed_on.contains(leg))
                        .cloned();
                    state.legs = Some((prefill, decode));
                    if let Some(leg) = failed {
                        let client = self.tickets[&ticket];
                        let message =
                            format!("{client}: an attempt runs on {leg}, which failed an earlier attempt");
                        self.violation(message);
                    }
                }
                RouterOutput::Retrying {
                    ticket,
                    stage,
                    reason,
                    ..
                } => {
                    let Some(state) = Self::client_of(&self.tickets, &mut self.clients, ticket) else {
                        continue;
                    };
                    if let Some((prefill, decode)) = state.legs.take() {
                        state
                            .failed_on
                            .extend(legs_named(stage, &reason, &prefill, &decode));
                    }
                    state.retries += 1;
                    self.report.retried += u32::from(state.retries == 1);
                }
                RouterOutput::Prefilled { .. } | RouterOutput::Probed { .. } => {}
                RouterOutput::Tokens { ticket, tokens } => {
                    if let Some(state) = Self::client_of(&self.tickets, &mut self.clients, ticket) {
                        state.received.extend(tokens);
                    }
                }
                RouterOutput::Done { ticket, answer } => {
                    let Some(client) = self.tickets.remove(&ticket) else {
                        self.violation(format!("{ticket} ended twice"));
                        continue;
                    };
                    let outcome = match answer {
                        Answer::Output { output, .. } => RequestOutcome::Output(output),
                        Answer::Failed { stage, reason } => RequestOutcome::Failed { stage, reason },
                        Answer::NoLeg { .. } => RequestOutcome::Failed {
                            stage: Stage::Router,
                            reason: Failure::Refused {
                                node: self.router.clone(),
                                reason: crate::wire::RefusalReason::NoLegLeft,
                            },
                        },
                    };
                    self.complete(client, outcome);
                }
            }
        }
    }

    fn complete(&mut self, client: RequestId, outcome: RequestOutcome) {
        let Some(state) = self.clients.remove(&client) else {
            return;
        };
        let (prompt, max_tokens, received) = (state.prompt, state.max_tokens, state.received);
        let deadline = state.deadline_ms;
        if self.now_ms > deadline {
            self.violation(format!(
                "{client} ended at {} ms, after its deadline {deadline} ms",
                self.now_ms
            ));
        }
        if self.outcomes.contains_key(&client) {
            self.violation(format!("{client} completed twice"));
        }
        let (expected_tokens, expected_digest) = expected_output(&self.layout, &prompt, max_tokens);
        if !expected_tokens.starts_with(&received) {
            let message = format!(
                "{client}: the client was streamed {received:?}, not a prefix of the answer {expected_tokens:?} (a token repeated or skipped)"
            );
            self.violation(message);
        }
        match &outcome {
            RequestOutcome::Output(output) => {
                if output.logits_digest != expected_digest || output.tokens != expected_tokens {
                    let message = format!(
                        "{client} ({} tokens) answered from wrong or partial KV",
                        prompt.len()
                    );
                    self.violation(message);
                } else {
                    self.report.ok += 1;
                }
            }
            RequestOutcome::Failed { reason, .. } => {
                if reason.to_string().is_empty() {
                    self.violation(format!("{client} failed without a reason"));
                }
                // No fault reaches the exchange: the lists the legs' allocators built must
                // cover what the decode leg needs (a block freed too early fails closed here).
                if matches!(reason, Failure::Exchange(_)) {
                    self.violation(format!(
                        "{client} failed in the exchange, the legs' lists not covering the need: {reason}"
                    ));
                }
                self.report.failed += 1;
                *self.report.failures.entry(reason.kind()).or_default() += 1;
            }
        }
        self.outcomes.insert(client, outcome);
    }

    fn receive(&mut self, to: &NodeId, envelope: Envelope) {
        let now = self.now_ms;
        if *to == self.router {
            return self.router_receive(envelope);
        }
        let Some(&leg) = self.by_name.get(to) else { return };
        // The door's check: adopt the first incarnation a peer says; refuse any other.
        let from = envelope.from.clone();
        let known = if from == self.router {
            self.router_incarnation
        } else {
            *self.legs[leg]
                .known
                .entry(from.clone())
                .or_insert(envelope.incarnation)
        };
        if known != envelope.incarnation {
            return self.refuse("stale_incarnation");
        }
        let kind = envelope.body.kind();
        let role = self.role_of(&from);
        if let Err(refusal) = self.legs[leg].node.handle_envelope(role, envelope, now) {
            let why = match (&refusal, kind) {
                (Refusal::Grant { .. }, "renew") => "renew_refused",
                (Refusal::Grant { .. }, "release") => "release_refused",
                _ => refusal_kind(&refusal),
            };
            if matches!(refusal, Refusal::WrongSender { .. } | Refusal::Misrouted { .. }) {
                self.violation(format!("{to} refused a message the protocol sends: {refusal}"));
            }
            self.refuse(why);
        }
        self.carry_out(leg);
    }

    fn router_receive(&mut self, envelope: Envelope) {
        let Envelope {
            request,
            from,
            incarnation,
            body,
            ..
        } = envelope;
        if self.router_known.get(&from) != Some(&incarnation) {
            // The router's door refuses what a leg's old incarnation says.
            return self.refuse("stale_incarnation");
        }
        self.dispatcher
            .handle_message(&from, incarnation, request, body, self.now_ms);
        self.carry_out_router();
    }

    /// Carries out what a leg's node asks, in order.
    fn carry_out(&mut self, leg: usize) {
        let now = self.now_ms;
        while let Some(output) = self.legs[leg].node.poll_output() {
            let (name, incarnation) = (self.legs[leg].name.clone(), self.legs[leg].incarnation);
            let started = match &output {
                NodeOutput::Compute { request, .. } => Some((*request, "computed")),
                NodeOutput::Read { request, .. } => Some((*request, "read")),
                _ => None,
            };
            if let Some((request, what)) = started
                && !self.started.insert((leg, incarnation, request, what))
            {
                self.violation(format!(
                    "{name} {what} {request} twice (a duplicated or late message started it again)"
                ));
            }
            match output {
                NodeOutput::Send(out) => self.send(name, incarnation, out),
                NodeOutput::Freed(blocks) => {
                    for block in blocks {
                        if let Some(slot) = self.legs[leg]
                            .generations
                            .get_mut(block.group)
                            .and_then(|table| table.get_mut(block.block as usize))
                        {
                            *slot = block.generation;
                        }
                    }
                }
                NodeOutput::Compute {
                    request,
                    prompt,
                    lists,
                    tokens,
                } => {
                    let event = Event::Computed {
                        leg,
                        incarnation,
                        request,
                        prompt,
                        lists,
                        tokens,
                    };
                    self.schedule(now + 1 + tokens / 8, event);
                }
                NodeOutput::Read {
                    request,
                    prefill,
                    issuer,
                    grant,
                    pairing,
                    checks,
                } => {
                    let slow = std::mem::take(&mut self.legs[leg].slow_next_read_ms);
                    let at = now + 1 + self.rng.below(READ_MS) + slow;
                    let event = Event::ReadDone {
                        leg,
                        incarnation,
                        request,
                        prefill,
                        grant,
                        issuer,
                        pairing,
                        checks,
                    };
                    self.schedule(at, event);
                }
                NodeOutput::Generate {
                    request,
                    prompt,
                    lists,
                    slots,
                    max_tokens,
                    deadline_ms,
                    stream_to,
                    ..
                } => {
                    let windows_released_for = prompt.len() as u64 - 1;
                    let run = Run {
                        prompt,
                        lists,
                        slots,
                        max_tokens: max_tokens.max(1),
                        deadline_ms,
                        stream_to,
                        tokens: Vec::new(),
                        digest: 0,
                        windows_released_for,
                        stop: false,
                    };
                    self.legs[leg].runs.insert(request, run);
                    let event = Event::Step {
                        leg,
                        incarnation,
                        request,
                    };
                    self.schedule(now + 1, event);
                }
                NodeOutput::LeaseExpired { grant, .. } => {
                    self.report.expired_leases += 1;
                    if !self.faults_on && self.script.is_empty() {
                        self.violation(format!("{name}: lease of grant {} lapsed with no fault injected (a grant nobody released)", grant.0));
                    }
                }
                NodeOutput::StopGenerating { request } => {
                    if let Some(run) = self.legs[leg].runs.get_mut(&request) {
                        run.stop = true;
                    }
                }
            }
        }
        while let Some(anomaly) = self.legs[leg].node.poll_anomaly() {
            let name = self.legs[leg].name.clone();
            self.violation(format!("{name}: {anomaly}"));
        }
    }

    /// One generation step of `request` on a decode leg: grow the allocation when decoding
    /// passes it, write this position's KV, read every value the step attends to, choose and
    /// stream a token, and give back window blocks the window left, as the shipped generation
    /// does.
    fn step(&mut self, leg: usize, request: RequestId) {
        let now = self.now_ms;
        let Some(mut run) = self.legs[leg].runs.remove(&request) else {
            return;
        };
        let ended = |sim: &mut Sim, result: Result<Generated, Failure>| {
            sim.legs[leg].node.handle_generated(request, result, now);
            sim.carry_out(leg);
        };
        if run.stop {
            return ended(self, Err(Failure::Cancelled));
        }
        if now >= run.deadline_ms {
            return ended(self, Err(Failure::DeadlinePassed));
        }
        let step = run.tokens.len();
        let position = run.prompt.len() - 1 + step;
        if position as u64 >= run.slots {
            run.slots = position as u64 + 1;
            match self.legs[leg].node.extend(request, run.slots, now) {
                Ok(lists) => run.lists = lists,
                Err(error) => return ended(self, Err(Failure::Alloc(error))),
            }
            self.carry_out(leg);
        }
        let layout = self.layout.clone();
        let state = &mut self.legs[leg];
        let mut missing = None;
        for (group, spec) in layout.groups().iter().enumerate() {
            if spec.kind() == GroupKind::Mamba {
                continue;
            }
            let per_block = slots_per_block(spec);
            match run.lists[group].get(position / per_block).copied() {
                Some(block) if block != NULL_BLOCK => {
                    state.arena[group][block as usize * per_block + position % per_block] =
                        value_at(&run.prompt, group, position);
                }
                _ => missing = Some((group, position)),
            }
        }
        let (arena, lists) = (&state.arena, &run.lists);
        let digest = step_digest(&layout, run.digest, step, &run.prompt, &mut |group, attended| {
            let spec = &layout.groups()[group];
            let per_block = slots_per_block(spec);
            if attended == usize::MAX {
                return lists[group]
                    .first()
                    .map_or(0, |&block| arena[group][block as usize]);
            }
            match lists[group].get(attended / per_block).copied() {
                Some(block) if block != NULL_BLOCK => {
                    arena[group][block as usize * per_block + attended % per_block]
                }
                _ => {
                    missing.get_or_insert((group, attended));
                    0
                }
            }
        });
        if let Some((group, position)) = missing {
            let failure = Failure::Engine(format!("group {group}: no block at token {position}"));
            return ended(self, Err(failure));
        }
        run.digest = digest;
        let token = token_of(digest, step);
        run.tokens.push(token);
        if let Some(router) = run.stream_to.clone() {
            let out = Outbound {
                to: router,
                request,
                budget_ms: run.deadline_ms.saturating_sub(now),
                body: Body::Tokens { tokens: vec![token] },
            };
            let (name, incarnation) = (self.legs[leg].name.clone(), self.legs[leg].incarnation);
            self.send(name, incarnation, out);
        }
        if run.tokens.len() >= run.max_tokens as usize {
            let generated = Generated {
                tokens: run.tokens,
                logits_digest: run.digest,
                ..Generated::default()
            };
            return ended(self, Ok(generated));
        }
        let attending = position as u64 + 1;
        if crate::allocator::window_crosses_block(&layout, run.windows_released_for, attending) {
            match self.legs[leg].node.release_window(request, attending, now) {
                Ok(lists) => run.lists = lists,
                Err(error) => return ended(self, Err(Failure::Alloc(error))),
            }
            run.windows_released_for = attending;
            self.carry_out(leg);
        }
        let incarnation = self.legs[leg].incarnation;
        self.legs[leg].runs.insert(request, run);
        self.schedule(
            now + TOKEN_MS,
            Event::Step {
                leg,
                incarnation,
                request,
            },
        );
    }

    /// A prefill leg's engine writes the first `tokens` tokens' KV (and the mamba state after
    /// `N - 1` tokens) into the blocks it was given.
    fn write_prefill_kv(&mut self, leg: usize, prompt: &[u32], lists: &[Vec<BlockId>], tokens: u64) {
        let state = &mut self.legs[leg];
        for (group, spec) in self.layout.groups().iter().enumerate() {
            let per_block = slots_per_block(spec);
            let list = &lists[group];
            if spec.kind() == GroupKind::Mamba {
                if prompt.len() >= 2 && tokens as usize >= prompt.len() - 1 {
                    state.arena[group][list[0] as usize] = mamba_state(prompt, group);
                }
                continue;
            }
            for position in 0..tokens as usize {
                let block = list[position / per_block];
                state.arena[group][block as usize * per_block + position % per_block] =
                    kv_value(prompt, group, position);
            }
        }
    }

    /// Moves the paired blocks from the prefill arena to the decode arena, as the READ engine
    /// does: a served engine refuses blocks outside a live grant; a one-sided one copies and the
    /// generation check after the copy (against the generations the prefill's shell
    /// published) catches a block freed under it. A READ armed to fail stops half way.
    fn read(
        &mut self,
        leg: usize,
        prefill: &NodeId,
        grant: GrantId,
        issuer: Incarnation,
        pairing: &Pairing,
        checks: &[GenerationCheck],
    ) -> Result<ReadDone, Failure> {
        let Some(&source) = self.by_name.get(prefill) else {
            return Err(Failure::Read(format!("{prefill} is not a leg")));
        };
        if issuer != self.legs[source].incarnation {
            return Err(Failure::Read(
                "the prefill leg restarted: its memory is gone".into(),
            ));
        }
        let peer = self.legs[leg].name.clone();
        let now = self.now_ms;
        let fail_half = std::mem::take(&mut self.legs[leg].fail_next_read);
        let mut outside_grant = None;
        {
            let table = self.legs[source].node.grant_table();
            let table = table.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            for (group, pairs) in pairing.groups.iter().enumerate() {
                for pair in pairs.iter().filter(|pair| pair.remote != NULL_BLOCK) {
                    if let Err(error) = table.check_read(grant, &peer, group, pair.remote, now) {
                        outside_grant.get_or_insert(error);
                    }
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
                let values: Vec<u64> = self.legs[source].arena[group][from..from + per_block].to_vec();
                self.legs[leg].arena[group][to..to + per_block].copy_from_slice(&values);
                copied += 1;
                bytes += per_block as u64 * 8;
            }
        }
        if fail_half {
            return Err(Failure::Read(format!("injected fault after {bytes} bytes")));
        }
        for check in checks {
            let found = self.legs[source]
                .generations
                .get(check.group)
                .and_then(|table| table.get(check.block as usize))
                .copied();
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

    fn restart(&mut self, leg: usize) {
        self.count(Fault::Restart);
        let incarnation = Incarnation(self.rng.next());
        let state = &self.legs[leg];
        let mut config = state.config.clone();
        config.leg.incarnation = incarnation;
        let (name, role, prefix_caching) = (state.name.clone(), state.role, state.prefix_caching);
        self.legs[leg] = SimLeg::new(name, role, config, prefix_caching);
        self.schedule(self.now_ms + DETECT_MS, Event::Detected { leg, incarnation });
    }

    fn check_step(&mut self) {
        let now = self.now_ms;
        let late = self
            .clients
            .iter()
            .find(|(_, state)| now > state.deadline_ms)
            .map(|(&client, _)| client);
        if let Some(client) = late {
            self.violation(format!("{client} still open after its deadline"));
        }
    }

    /// After the last request: every request ended, and once leases lapse no block is held and no
    /// grant lives.
    fn quiesce(&mut self) {
        let unended: Vec<RequestId> = self
            .prompts
            .keys()
            .filter(|client| !self.outcomes.contains_key(client))
            .copied()
            .collect();
        for client in unended {
            self.violation(format!("{client} never ended"));
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
        for leg in 0..self.legs.len() {
            self.legs[leg].frozen_until_ms = 0;
            self.legs[leg].node.handle_timeout(self.now_ms);
            self.carry_out(leg);
        }
        for held in self.holding_legs() {
            self.violation(format!("{held} after quiesce and lease expiry"));
        }
    }

    /// What each leg that is not idle still holds, in words.
    fn holding_legs(&self) -> Vec<String> {
        self.legs
            .iter()
            .filter(|leg| !leg.is_idle())
            .map(|leg| {
                let load = leg.node.load();
                format!(
                    "{} holds blocks or grants: free {:?} of {:?}, {} grants, {} requests' blocks, {} machines",
                    leg.name,
                    load.free_blocks,
                    load.capacity,
                    load.grants,
                    load.requests,
                    leg.node.num_jobs()
                )
            })
            .collect()
    }
}

/// The legs a failed attempt's failure names, by the retry policy's definition
/// (docs/ARCHITECTURE.md, "Failure behaviour"): a lost, unreachable or refusing leg; the
/// prefill leg of a READ that failed for a reason other than time or the client.
fn legs_named(stage: Stage, reason: &Failure, prefill: &NodeId, decode: &NodeId) -> Vec<NodeId> {
    let mut named = Vec::new();
    match reason {
        Failure::LegLost(leg) | Failure::Unreachable { to: leg, .. } | Failure::Refused { node: leg, .. }
            if leg == prefill || leg == decode =>
        {
            named.push(leg.clone());
        }
        Failure::DeadlinePassed | Failure::Cancelled => {}
        _ if stage == Stage::Read => named.push(prefill.clone()),
        _ => {}
    }
    named
}
