//! The seeded fault schedule of a chaos run: which fault, on which node or link, when, and for
//! how long. Pure: the same seed, duration, kinds and cluster give the same schedule, so a
//! failing run is replayed by its seed.

use std::fmt;
use std::time::Duration;

use rand_chacha::ChaCha8Rng;
use rand_core::{RngCore, SeedableRng};
use serde::Serialize;

/// A kind of fault `pdkv chaos` injects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum FaultKind {
    /// SIGKILL a leg; the launcher starts it again (a new incarnation).
    Kill,
    /// SIGSTOP a leg past the prefill lease, then SIGCONT.
    Pause,
    /// Blackhole both directions of a link, then heal.
    Partition,
    /// Delay every packet of a link both ways, then heal.
    Delay,
    /// Lose a share of a link's packets both ways, then heal.
    Loss,
    /// SIGTERM a leg (it drains and exits), then start it again.
    Restart,
    /// SIGKILL a prefill leg the moment a decode leg posts its next READ to it (network READ
    /// engine only): vLLM's hardest case.
    KillAtRead,
}

impl FaultKind {
    /// Every kind, in report order.
    pub const ALL: [FaultKind; 7] = [
        FaultKind::Kill,
        FaultKind::Pause,
        FaultKind::Partition,
        FaultKind::Delay,
        FaultKind::Loss,
        FaultKind::Restart,
        FaultKind::KillAtRead,
    ];

    /// The name used on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::Kill => "kill",
            FaultKind::Pause => "pause",
            FaultKind::Partition => "partition",
            FaultKind::Delay => "delay",
            FaultKind::Loss => "loss",
            FaultKind::Restart => "restart",
            FaultKind::KillAtRead => "kill-at-read",
        }
    }

    /// Whether it acts on a link (two nodes) rather than on one process.
    pub fn on_link(self) -> bool {
        matches!(
            self,
            FaultKind::Partition | FaultKind::Delay | FaultKind::Loss | FaultKind::KillAtRead
        )
    }
}

impl fmt::Display for FaultKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What the schedule may act on.
#[derive(Debug, Clone, Default)]
pub struct Topology {
    /// Legs (the router is never killed or paused: it is the clients' only door).
    pub legs: Vec<String>,
    /// Pairs of nodes that hold a link (router included).
    pub links: Vec<(String, String)>,
    /// (decode leg, prefill leg) pairs whose READs cross a relay (network READ engine).
    pub reads: Vec<(String, String)>,
}

/// The cluster's timing, which sizes the faults.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// Mean pause between the end of one fault and the start of the next.
    pub mean_gap: Duration,
    /// The prefill lease (`[limits] lease_ms`): a pause outlasts it.
    pub lease: Duration,
    /// How long a silent peer takes to be declared down (`heartbeat_ms × heartbeat_misses`).
    pub detect: Duration,
    /// Quiet time at the start (load only) and at the end (recovery before quiesce).
    pub margin: Duration,
}

/// One scheduled fault.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Fault {
    /// When it starts, from the start of the load.
    #[serde(serialize_with = "as_seconds")]
    pub at: Duration,
    pub kind: FaultKind,
    /// The node it acts on (for a link: one end; for kill-at-read: the prefill leg killed).
    pub node: String,
    /// The other end of a link (for kill-at-read: the decode leg whose READ triggers it).
    pub peer: Option<String>,
    /// How long it lasts before it is healed (kill and restart: how long the trigger or the
    /// drain may take).
    #[serde(serialize_with = "as_seconds")]
    pub hold: Duration,
    /// Delay faults: the added one-way delay in milliseconds; loss faults: the share lost.
    pub amount: f64,
}

fn as_seconds<S: serde::Serializer>(value: &Duration, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_f64(value.as_secs_f64())
}

/// A uniform draw in `[low, high)`.
fn uniform(rng: &mut ChaCha8Rng, low: f64, high: f64) -> f64 {
    low + (high - low) * (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64
}

fn pick<'a, T>(rng: &mut ChaCha8Rng, items: &'a [T]) -> &'a T {
    &items[(rng.next_u64() % items.len() as u64) as usize]
}

/// The kinds among `kinds` that `topology` gives something to act on.
pub fn applicable(kinds: &[FaultKind], topology: &Topology) -> Vec<FaultKind> {
    kinds
        .iter()
        .copied()
        .filter(|kind| match kind {
            FaultKind::KillAtRead => !topology.reads.is_empty(),
            kind if kind.on_link() => !topology.links.is_empty(),
            _ => !topology.legs.is_empty(),
        })
        .collect()
}

/// The schedule for a run of `duration`: faults one after another, each drawn from `kinds`
/// (those `topology` allows), separated by exponential gaps of mean `timing.mean_gap`, none
/// before `timing.margin` nor lasting past `duration − timing.margin`.
pub fn plan(
    seed: u64,
    duration: Duration,
    kinds: &[FaultKind],
    topology: &Topology,
    timing: Timing,
) -> Vec<Fault> {
    let kinds = applicable(kinds, topology);
    let mut faults = Vec::new();
    if kinds.is_empty() {
        return faults;
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let end = duration.saturating_sub(timing.margin);
    let mut at = timing.margin;
    let detect = timing.detect.as_secs_f64();
    loop {
        // Exponential gap (inverse transform of a uniform draw in (0, 1]).
        let gap = -timing.mean_gap.as_secs_f64() * (1.0 - uniform(&mut rng, 0.0, 1.0)).ln();
        at += Duration::from_secs_f64(gap);
        let kind = *pick(&mut rng, &kinds);
        let (node, peer) = match kind {
            FaultKind::KillAtRead => {
                let (decode, prefill) = pick(&mut rng, &topology.reads).clone();
                (prefill, Some(decode))
            }
            kind if kind.on_link() => {
                let (a, b) = pick(&mut rng, &topology.links).clone();
                (a, Some(b))
            }
            _ => (pick(&mut rng, &topology.legs).clone(), None),
        };
        let (hold, amount) = match kind {
            // Long enough to be noticed by the restart; the launcher restarts at once.
            FaultKind::Kill | FaultKind::Restart => (detect.max(0.5), 0.0),
            FaultKind::Pause => (timing.lease.as_secs_f64() * uniform(&mut rng, 1.1, 1.5), 0.0),
            // From shorter than detection (ridden out) to several times it (links drop).
            FaultKind::Partition => (detect * uniform(&mut rng, 0.3, 3.0), 0.0),
            FaultKind::Delay => (uniform(&mut rng, 0.5, 3.0), uniform(&mut rng, 5.0, 100.0).round()),
            FaultKind::Loss => (
                uniform(&mut rng, 0.5, 3.0),
                (uniform(&mut rng, 0.05, 0.5) * 100.0).round() / 100.0,
            ),
            // How long the trigger waits for a READ before it is disarmed.
            FaultKind::KillAtRead => (uniform(&mut rng, 1.0, 3.0), 0.0),
        };
        let hold = Duration::from_secs_f64(hold);
        if at + hold > end {
            return faults;
        }
        faults.push(Fault {
            at,
            kind,
            node,
            peer,
            hold,
            amount,
        });
        at += hold;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn topology() -> Topology {
        Topology {
            legs: vec!["prefill-0".into(), "decode-0".into()],
            links: vec![
                ("router".into(), "prefill-0".into()),
                ("router".into(), "decode-0".into()),
                ("prefill-0".into(), "decode-0".into()),
            ],
            reads: vec![("decode-0".into(), "prefill-0".into())],
        }
    }

    fn timing() -> Timing {
        Timing {
            mean_gap: Duration::from_millis(500),
            lease: Duration::from_millis(1000),
            detect: Duration::from_millis(300),
            margin: Duration::from_secs(1),
        }
    }

    #[test]
    fn a_seed_gives_one_schedule_and_another_seed_another() {
        let duration = Duration::from_secs(60);
        let first = plan(11, duration, &FaultKind::ALL, &topology(), timing());
        assert_eq!(first, plan(11, duration, &FaultKind::ALL, &topology(), timing()));
        assert_ne!(first, plan(12, duration, &FaultKind::ALL, &topology(), timing()));
    }

    #[test]
    fn faults_follow_one_another_inside_the_margins_and_use_only_the_kinds_asked() {
        let duration = Duration::from_secs(120);
        let kinds = [FaultKind::Pause, FaultKind::Loss, FaultKind::KillAtRead];
        let faults = plan(5, duration, &kinds, &topology(), timing());
        assert!(faults.len() > 20, "{} faults in 120 s", faults.len());
        let mut free_from = timing().margin;
        for fault in &faults {
            assert!(kinds.contains(&fault.kind), "{fault:?}");
            assert!(fault.at >= free_from, "{fault:?} overlaps the previous fault");
            free_from = fault.at + fault.hold;
            match fault.kind {
                FaultKind::Pause => {
                    assert!(
                        fault.hold > timing().lease,
                        "a pause outlasts the lease: {fault:?}"
                    );
                    assert!(topology().legs.contains(&fault.node) && fault.peer.is_none());
                }
                FaultKind::Loss => {
                    assert!((0.05..=0.5).contains(&fault.amount), "{fault:?}");
                    let (a, b) = (fault.node.clone(), fault.peer.clone().expect("a link"));
                    assert!(topology().links.contains(&(a, b)));
                }
                FaultKind::KillAtRead => {
                    assert_eq!(fault.node, "prefill-0");
                    assert_eq!(fault.peer.as_deref(), Some("decode-0"));
                }
                _ => unreachable!(),
            }
        }
        assert!(free_from <= duration - timing().margin);
        for kind in kinds {
            assert!(
                faults.iter().any(|fault| fault.kind == kind),
                "no {kind} in 120 s"
            );
        }
    }

    #[test]
    fn kinds_without_a_target_are_left_out() {
        let mut shm = topology();
        shm.reads.clear();
        assert_eq!(
            applicable(&[FaultKind::Kill, FaultKind::KillAtRead], &shm),
            vec![FaultKind::Kill]
        );
        let faults = plan(
            3,
            Duration::from_secs(30),
            &[FaultKind::KillAtRead],
            &shm,
            timing(),
        );
        assert!(faults.is_empty());
    }
}
