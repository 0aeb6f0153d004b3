//! Fuzzing every parser that takes bytes from outside: control-stream frames, control frames
//! and the hello, wire messages, the data plane's hello and requests, `cluster.toml`, `pdkv plan`
//! scenarios and the completions API's request bodies.
//!
//! Structured random input (the toolchain here is stable Rust, so no coverage-guided engine):
//! each target starts from real, valid inputs — messages captured from the leg protocol's
//! simulation, the shipped cluster.toml and scenarios, frames encoded by the real codecs — and
//! mutates them with a seeded generator (bit flips, interesting integers at random offsets,
//! splices, insertions of target-specific tokens, truncation, pure noise). Every input runs
//! the code a node runs on those bytes; a panic is caught and counted with its input, the
//! slowest input is timed, and the process's peak resident memory is read after the run.
//! `tests/fuzz.rs` runs 100,000 inputs per target; `cargo run --release -p pdkv-bench --bin
//! fuzz` runs any number.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex, Once};
use std::time::{Duration, Instant};

use pdkv_actors::config::{ClusterConfig, DEFAULT_CLUSTER_TOML};
use pdkv_actors::engine::Model;
use pdkv_actors::memory::LegMemory;
use pdkv_core::block::BlockId;
use pdkv_core::codec;
use pdkv_core::grant::GrantTable;
use pdkv_core::testing::{SimConfig, simulate};
use pdkv_core::wire::{Envelope, Incarnation, NodeId, RequestId, Role};
use pdkv_transport::clock::MonotonicClock;
use pdkv_transport::control::Hello;
use pdkv_transport::fuzzing::{DataServerCore, control_frame, control_seeds, data_seeds, frames};
use pdkv_transport::net::{GrantAuthorizer, TicketBook};
use pdkv_transport::region::Region;
use rand_chacha::ChaCha8Rng;
use rand_core::{RngCore, SeedableRng};
use serde::Serialize;

/// A parser that takes outside bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Target {
    /// A control stream's length-prefixed frames, read as the control server reads them.
    Frames,
    /// One control frame (a hello, a ticket request or a wire message), decoded, and a hello
    /// checked against this node's as the handshake does.
    Hello,
    /// A wire message (envelope), decoded; what decodes must encode and decode to itself.
    Wire,
    /// The first frame of a data connection: the hello with its ticket.
    DataHello,
    /// A data-plane request (READ runs or generation words), decoded and answered by a memory
    /// server core over a real grant table.
    DataRequest,
    /// A cluster.toml, parsed and checked.
    ClusterToml,
    /// A `pdkv plan` scenario, parsed, checked and paired.
    Scenario,
    /// A `POST /v1/completions` body, parsed and checked.
    HttpBody,
}

impl Target {
    /// Every target.
    pub const ALL: [Target; 8] = [
        Target::Frames,
        Target::Hello,
        Target::Wire,
        Target::DataHello,
        Target::DataRequest,
        Target::ClusterToml,
        Target::Scenario,
        Target::HttpBody,
    ];

    /// The name used on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Target::Frames => "frames",
            Target::Hello => "hello",
            Target::Wire => "wire",
            Target::DataHello => "data-hello",
            Target::DataRequest => "data-request",
            Target::ClusterToml => "cluster-toml",
            Target::Scenario => "scenario",
            Target::HttpBody => "http-body",
        }
    }
}

/// What a run over one target found.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub target: Target,
    pub inputs: u64,
    /// Inputs the parser accepted (the rest were refused with an error).
    pub accepted: u64,
    /// Inputs that panicked.
    pub panics: u64,
    /// Inputs that broke a property other than "no panic" (a wire message that does not
    /// re-encode to itself).
    pub violations: u64,
    /// The first panic or violation: its message and the input, hex-encoded.
    pub first_failure: Option<String>,
    /// The slowest input's time, in microseconds.
    pub slowest_us: u64,
    pub elapsed_s: f64,
    /// The process's peak resident memory after the run, in KiB (`VmHWM`).
    pub peak_rss_kib: u64,
}

/// Largest input generated (bytes): above every parser's own bound for small messages, far
/// below the 16 MiB frame limit.
const MAX_INPUT: usize = 64 * 1024;

/// The parser of one target with what it needs to run.
enum Harness {
    Frames,
    Hello(Box<Hello>),
    Wire,
    Data {
        core: DataServerCore,
        reader: NodeId,
    },
    ClusterToml,
    Scenario,
    HttpBody {
        /// The vocabulary.
        vocab: u32,
        /// What the embedded cluster holds.
        capacity: Box<crate::openai::Capacity>,
    },
}

/// The shipped scenarios, as seeds.
const SCENARIOS: [&str; 5] = [
    include_str!("../scenarios/prefill-stops-at-n-minus-1.json"),
    include_str!("../scenarios/prefix-hit-dcp.json"),
    include_str!("../scenarios/seed-decode-tail-legacy.json"),
    include_str!("../scenarios/seed-decode-tail.json"),
    include_str!("../scenarios/seed-prefill-tail.json"),
];

/// More cluster.toml seeds: the chaos cluster, and one with every table and key.
const CLUSTER_TOMLS: [&str; 2] = [
    include_str!("../examples/chaos.toml"),
    "[model]\nseed = 1\nd_model = 8\nvocab = 64\nlayer_groups = [0, 1, 2]\n\n[[model.groups]]\nkind = \"full\"\nblock_size = 16\n\n[[model.groups]]\nkind = \"sliding_window\"\nblock_size = 16\nwindow = 48\n\n[[model.groups]]\nkind = \"mamba\"\n\n[exchange]\npairing = \"anchored\"\nmax_decode_tail_blocks = 1\n\n[transport]\nread_engine = \"net\"\nlinks = \"quic\"\n\n[limits]\nrequest_timeout_ms = 1000\nlease_ms = 500\nalloc_wait_ms = 100\nwait_queue = 4\nmax_grants = 8\nmailbox = 8\n\n[failure]\nheartbeat_ms = 50\nheartbeat_misses = 2\nmax_retries = 3\n\n[router]\nhost = \"127.0.0.1\"\ncontrol_port = 7000\nhttp_port = 7001\nselection = \"round_robin\"\n\n[http]\nheader_timeout_ms = 5000\nbody_timeout_ms = 5000\nstall_timeout_ms = 5000\nmax_connections = 64\n\n[logging]\nlevel = \"info\"\nformat = \"json\"\n\n[[nodes]]\nname = \"p\"\nrole = \"prefill\"\nhost = \"127.0.0.1\"\ncontrol_port = 7100\ndata_port = 7101\nadmin_port = 7102\nblocks_per_group = 16\nprefix_caching = true\n\n[[nodes]]\nname = \"d\"\nrole = \"decode\"\nhost = \"127.0.0.2\"\nbind = \"0.0.0.0\"\ncontrol_port = 7200\ndata_port = 7201\nadmin_port = 7202\nblocks_per_group = 16\nlookahead_tokens = 3\nlaunch = \"ssh\"\nssh = \"user@host\"\n",
];

const HTTP_BODIES: [&str; 6] = [
    r#"{"model":"pdkv-reference","prompt":"hello, world","max_tokens":4}"#,
    r#"{"prompt":[1,2,3,250,255],"max_tokens":2,"stream":true,"stream_options":{"include_usage":true}}"#,
    r#"{"prompt":"a","max_tokens":1,"temperature":0,"stop":null,"n":1,"echo":false}"#,
    r#"{"prompt":[0],"max_tokens":1}"#,
    r#"{"prompt":"\n\t","max_tokens":16,"stream":true}"#,
    r#"{"prompt":[1, 2, 3], "max_tokens": 3, "stream": false, "user": "\u00e9\ud83d\ude00"}"#,
];

/// Tokens inserted into text targets.
const TEXT_TOKENS: [&str; 34] = [
    "[",
    "]",
    "{",
    "}",
    "[[nodes]]",
    "[[model.groups]]",
    "[router]",
    "[limits]",
    "=",
    "\"",
    ",",
    ":",
    "\n",
    "-1",
    "0",
    "18446744073709551615",
    "4294967296",
    "1e999",
    "nan",
    "inf",
    "null",
    "true",
    "\\u0000",
    "\"prompt\"",
    "\"max_tokens\"",
    "\"stream\"",
    "role = \"decode\"",
    "kind = \"mamba\"",
    "window = 0",
    "block_size = 0",
    "blocks_per_group = 4294967295",
    "\"block_ids\"",
    "\"num_tokens\"",
    "#",
];

/// Integers that sit on boundaries of the binary encodings: bincode's varint markers, length
/// fields near the limits.
const INTERESTING: [u64; 14] = [
    0,
    1,
    0x7f,
    0x80,
    0xfa,
    0xfb,
    0xfc,
    0xfd,
    0xfe,
    0xff,
    0xffff,
    0xffff_ffff,
    16 << 20,
    u64::MAX,
];

impl Harness {
    /// The harness for `target` and its seed inputs.
    fn new(target: Target) -> (Harness, Vec<Vec<u8>>, bool) {
        let messages = captured_messages();
        match target {
            Target::Frames => {
                let mut seeds: Vec<Vec<u8>> = Vec::new();
                for chunk in messages.chunks(3).take(64) {
                    seeds.push(
                        chunk
                            .iter()
                            .flat_map(|message| pdkv_transport::codec::frame(message))
                            .collect(),
                    );
                }
                (Harness::Frames, seeds, false)
            }
            Target::Hello => {
                let (ours, theirs) = (hello("prefill-0", Role::Prefill), hello("decode-0", Role::Decode));
                let seeds = control_seeds(&theirs, &messages[..messages.len().min(256)]);
                (Harness::Hello(Box::new(ours)), seeds, false)
            }
            Target::Wire => (Harness::Wire, messages, false),
            Target::DataHello | Target::DataRequest => {
                let (core, seeds) = data_core();
                let seeds = match target {
                    Target::DataHello => seeds[..1].to_vec(),
                    _ => seeds[1..].to_vec(),
                };
                let harness = Harness::Data {
                    core,
                    reader: NodeId("decode-0".into()),
                };
                (harness, seeds, false)
            }
            Target::ClusterToml => {
                let seeds = std::iter::once(DEFAULT_CLUSTER_TOML)
                    .chain(CLUSTER_TOMLS)
                    .map(|text| text.as_bytes().to_vec())
                    .collect();
                (Harness::ClusterToml, seeds, true)
            }
            Target::Scenario => (
                Harness::Scenario,
                SCENARIOS.iter().map(|text| text.as_bytes().to_vec()).collect(),
                true,
            ),
            Target::HttpBody => (
                Harness::HttpBody {
                    vocab: 256,
                    capacity: Box::new({
                        let config = ClusterConfig::embedded_default();
                        crate::openai::Capacity {
                            prompt: config.prompt_limit(),
                            context: config.context_limit(),
                        }
                    }),
                },
                HTTP_BODIES.iter().map(|text| text.as_bytes().to_vec()).collect(),
                true,
            ),
        }
    }

    /// Runs one input; `Ok(accepted)`, or `Err` when a property other than "no panic" broke.
    fn run(&self, input: &[u8], target: Target) -> Result<bool, String> {
        match self {
            Harness::Frames => Ok(frames(input).is_ok()),
            Harness::Hello(ours) => Ok(control_frame(input, ours).is_ok()),
            Harness::Wire => match codec::decode::<Envelope>(input) {
                Err(_) => Ok(false),
                Ok(envelope) => {
                    let again = codec::encode(&envelope).map_err(|error| format!("re-encode: {error}"))?;
                    let back: Envelope =
                        codec::decode(&again).map_err(|error| format!("decode of re-encoded: {error}"))?;
                    // Compared as bytes: a float field may hold NaN (refused later, by the
                    // sampling check), which survives the trip bit for bit but is never equal
                    // to itself.
                    let twice = codec::encode(&back).map_err(|error| format!("re-encode: {error}"))?;
                    if twice == again {
                        Ok(true)
                    } else {
                        Err("a decoded message does not survive encode and decode".into())
                    }
                }
            },
            Harness::Data { core, reader } => match target {
                Target::DataHello => Ok(core.hello(input).is_ok()),
                _ => Ok(core.request(reader, input).is_ok()),
            },
            Harness::ClusterToml => {
                let text = String::from_utf8_lossy(input);
                match ClusterConfig::from_toml(&text) {
                    Err(_) => Ok(false),
                    Ok(config) => {
                        let limit = config.prompt_limit();
                        let _ = config.check_prompt_tokens(limit.max_tokens);
                        let _ = config.check_prompt_tokens(limit.max_tokens.saturating_add(1));
                        Ok(true)
                    }
                }
            }
            Harness::Scenario => {
                let text = String::from_utf8_lossy(input);
                match crate::plan_cmd::parse_scenario("fuzz", &text) {
                    Err(_) => Ok(false),
                    Ok(scenario) => Ok(scenario.run().is_ok()),
                }
            }
            Harness::HttpBody { vocab, capacity } => {
                let completion =
                    crate::openai::parse(crate::openai::Endpoint::Completions, input, *vocab, capacity);
                let chat = crate::openai::parse(crate::openai::Endpoint::Chat, input, *vocab, capacity);
                Ok(completion.is_ok() || chat.is_ok())
            }
        }
    }
}

/// Real wire messages of every kind, from the leg protocol's simulation with faults on.
fn captured_messages() -> Vec<Vec<u8>> {
    let mut messages = Vec::new();
    for seed in 0..8 {
        let report = simulate(SimConfig {
            seed,
            requests: 6,
            faults: true,
            capture_messages: true,
            ..SimConfig::default()
        });
        messages.extend(report.messages);
    }
    messages.sort();
    messages.dedup();
    messages
}

/// A hello as a node of the shipped cluster sends it.
fn hello(node: &str, role: Role) -> Hello {
    let config = ClusterConfig::embedded_default();
    let model = Model::new(config.model, config.layout.clone());
    let capacity = vec![8; config.layout.groups().len()];
    let memory = LegMemory::heap(&model, config.nodes[0].shards, &capacity);
    Hello {
        node: NodeId(node.into()),
        role,
        incarnation: Incarnation(0x1234_5678),
        regions: memory.regions,
        protocol_version: pdkv_transport::codec::PROTOCOL_VERSION,
        layout_hash: config.layout.compat_hash(),
        model: config.model_fields(),
        engines: Vec::new(),
        host: "fuzz-host".into(),
    }
}

/// A memory server core over the shipped model's memory (8 blocks per group) with one live
/// grant to `decode-0`, and seeds: a hello, a READ within the grant, a read of words.
fn data_core() -> (DataServerCore, Vec<Vec<u8>>) {
    let config = ClusterConfig::embedded_default();
    let model = Model::new(config.model, config.layout.clone());
    let groups = config.layout.groups().len();
    let memory = LegMemory::heap(&model, config.nodes[0].shards, &vec![8; groups]);
    let reader = NodeId("decode-0".into());
    let mut table = GrantTable::new(16);
    let blocks: Vec<Vec<BlockId>> = (0..groups).map(|_| vec![1, 2, 3]).collect();
    let grant = table
        .issue(RequestId(1), reader.clone(), blocks, u64::MAX / 4, 0)
        .expect("a grant in an empty table");
    let authorizer = GrantAuthorizer::new(
        Arc::new(Mutex::new(table)),
        config.layout.clone(),
        memory.regions.clone(),
        MonotonicClock::new(),
    );
    let regions: HashMap<u32, Arc<Region>> = memory
        .registered_regions()
        .map(|(id, region)| (id, region.clone()))
        .collect();
    let tickets = Arc::new(TicketBook::new(Duration::from_secs(3600), 1 << 20));
    let ticket = tickets.issue(&reader).expect("a ticket");
    let layer = &memory.regions.layers[0];
    let runs = [(
        layer.base_offset + layer.bytes_per_block,
        2 * layer.bytes_per_block,
    )];
    let words_region = memory.regions.generations[0];
    let seeds = data_seeds(
        &reader,
        ticket,
        grant,
        layer.region,
        &runs,
        words_region,
        &[1, 2, 3],
    );
    let core = DataServerCore::new(regions, Arc::new(authorizer), tickets);
    (core, seeds)
}

/// Seeded mutations of seed inputs.
struct Mutator {
    rng: ChaCha8Rng,
    seeds: Vec<Vec<u8>>,
    text: bool,
}

impl Mutator {
    fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.rng.next_u64() % n as u64) as usize
        }
    }

    fn next(&mut self) -> Vec<u8> {
        // One input in 32 is noise.
        if self.below(32) == 0 {
            let len = self.below(512);
            let mut noise = vec![0u8; len];
            self.rng.fill_bytes(&mut noise);
            return noise;
        }
        let pick = self.below(self.seeds.len());
        let mut input = self.seeds[pick].clone();
        let rounds = 1 + self.below(8);
        for _ in 0..rounds {
            self.mutate(&mut input);
        }
        input.truncate(MAX_INPUT);
        input
    }

    fn mutate(&mut self, input: &mut Vec<u8>) {
        let at = self.below(input.len() + 1);
        match self.below(9) {
            // Flip a bit.
            0 if !input.is_empty() => {
                let at = at.min(input.len() - 1);
                input[at] ^= 1 << self.below(8);
            }
            // Overwrite a byte.
            1 if !input.is_empty() => {
                let at = at.min(input.len() - 1);
                input[at] = self.rng.next_u32() as u8;
            }
            // An interesting integer, little-endian, 1 to 8 bytes.
            2 => {
                let value = INTERESTING[self.below(INTERESTING.len())];
                let width = [1, 2, 4, 8][self.below(4)];
                let bytes = &value.to_le_bytes()[..width];
                let end = (at + width).min(input.len());
                input.splice(at..end, bytes.iter().copied());
            }
            // Delete a range.
            3 if !input.is_empty() => {
                let len = 1 + self.below(16.min(input.len() - at.min(input.len() - 1)));
                let start = at.min(input.len() - 1);
                let end = (start + len).min(input.len());
                input.drain(start..end);
            }
            // Duplicate a range.
            4 if !input.is_empty() => {
                let start = at.min(input.len() - 1);
                let end = (start + 1 + self.below(32)).min(input.len());
                let copy = input[start..end].to_vec();
                input.splice(start..start, copy);
            }
            // Splice in part of another seed.
            5 => {
                let pick = self.below(self.seeds.len());
                let other = self.seeds[pick].clone();
                let from = self.below(other.len() + 1);
                let to = (from + self.below(64)).min(other.len());
                input.splice(at..at, other[from..to].iter().copied());
            }
            // Truncate.
            6 => input.truncate(at),
            // A token of the input's language, or a random byte for binary input.
            7 if self.text => {
                let token = TEXT_TOKENS[self.below(TEXT_TOKENS.len())];
                input.splice(at..at, token.bytes());
            }
            _ => {
                let byte = self.rng.next_u32() as u8;
                input.insert(at, byte);
            }
        }
    }
}

thread_local! {
    /// Set while this thread runs fuzz inputs: its panics are recorded, not printed.
    static FUZZING: Cell<bool> = const { Cell::new(false) };
    static LAST_PANIC: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// Installs, once, a panic hook that records panics of fuzzing threads (without printing
/// them) and passes every other thread's panic to the previous hook.
fn install_panic_hook() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if FUZZING.with(Cell::get) {
                LAST_PANIC.with(|last| *last.borrow_mut() = Some(info.to_string()));
            } else {
                previous(info);
            }
        }));
    });
}

/// The process's peak resident memory, in KiB.
fn peak_rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|line| line.strip_prefix("VmHWM:"))
                .and_then(|value| value.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().take(512).map(|byte| format!("{byte:02x}")).collect()
}

/// Runs `inputs` inputs of `target`, generated from `seed`.
pub fn run(target: Target, inputs: u64, seed: u64) -> Report {
    install_panic_hook();
    let (harness, seeds, text) = Harness::new(target);
    assert!(!seeds.is_empty(), "{}: no seed inputs", target.name());
    let mut mutator = Mutator {
        rng: ChaCha8Rng::seed_from_u64(seed ^ (target as u64) << 56),
        seeds,
        text,
    };
    let mut report = Report {
        target,
        inputs,
        accepted: 0,
        panics: 0,
        violations: 0,
        first_failure: None,
        slowest_us: 0,
        elapsed_s: 0.0,
        peak_rss_kib: 0,
    };
    let started = Instant::now();
    FUZZING.with(|fuzzing| fuzzing.set(true));
    for index in 0..inputs {
        // The seeds themselves first: each must run, and (but for spent tickets) be accepted.
        let input = match mutator.seeds.get(index as usize) {
            Some(seed) => seed.clone(),
            None => mutator.next(),
        };
        let begun = Instant::now();
        let result = catch_unwind(AssertUnwindSafe(|| harness.run(&input, target)));
        report.slowest_us = report.slowest_us.max(begun.elapsed().as_micros() as u64);
        match result {
            Ok(Ok(true)) => report.accepted += 1,
            Ok(Ok(false)) => {}
            Ok(Err(violation)) => {
                report.violations += 1;
                report
                    .first_failure
                    .get_or_insert_with(|| format!("{violation}; input {}", hex(&input)));
            }
            Err(_) => {
                report.panics += 1;
                let message = LAST_PANIC
                    .with(|last| last.borrow_mut().take())
                    .unwrap_or_default();
                report
                    .first_failure
                    .get_or_insert_with(|| format!("panic: {message}; input {}", hex(&input)));
            }
        }
    }
    FUZZING.with(|fuzzing| fuzzing.set(false));
    report.elapsed_s = started.elapsed().as_secs_f64();
    report.peak_rss_kib = peak_rss_kib();
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every target's seeds are real inputs its parser accepts (a harness whose seeds all fail
    /// would only ever fuzz the first error path).
    #[test]
    fn every_targets_seeds_are_accepted() {
        for target in Target::ALL {
            let (harness, seeds, _) = Harness::new(target);
            let accepted = seeds
                .iter()
                .filter(|seed| harness.run(seed, target) == Ok(true))
                .count();
            assert_eq!(
                accepted,
                seeds.len(),
                "{}: {accepted}/{} seeds accepted",
                target.name(),
                seeds.len()
            );
        }
    }

    /// The harness catches a panic and reports it with its input, without printing it.
    #[test]
    fn a_panicking_input_is_caught_and_reported() {
        install_panic_hook();
        FUZZING.with(|fuzzing| fuzzing.set(true));
        let caught = catch_unwind(|| panic!("boom"));
        FUZZING.with(|fuzzing| fuzzing.set(false));
        assert!(caught.is_err());
        let message = LAST_PANIC.with(|last| last.borrow_mut().take());
        assert!(message.is_some_and(|message| message.contains("boom")));
    }

    #[test]
    fn a_seed_gives_the_same_inputs() {
        let inputs = |seed| {
            let mut mutator = Mutator {
                rng: ChaCha8Rng::seed_from_u64(seed),
                seeds: vec![b"hello".to_vec(), b"[x]".to_vec()],
                text: true,
            };
            (0..100).map(|_| mutator.next()).collect::<Vec<_>>()
        };
        assert_eq!(inputs(3), inputs(3));
        assert_ne!(inputs(3), inputs(4));
    }
}
