//! Watching links break and come back: every node's `/ready` read on a thread of its own, and
//! per fault the moments its links were seen broken (detected) and whole again (recovered).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::schedule::{Fault, FaultKind};
use super::{RECOVERY_BOUND, WATCH_EVERY};
use crate::launch::http_agent;

/// A node's links as its `/ready` showed them: peer → (linked, incarnation).
#[derive(Debug, Clone, Default)]
pub(super) struct Seen {
    pub(super) at: Option<Instant>,
    pub(super) peers: BTreeMap<String, (bool, Option<u64>)>,
}

/// Reads every member's `/ready` every [`WATCH_EVERY`] on a thread of its own (a paused
/// member's probe waits without holding up the others).
pub(super) struct Watcher {
    pub(super) seen: Arc<Mutex<BTreeMap<String, Seen>>>,
    pub(super) stop: Arc<AtomicBool>,
    pub(super) threads: Vec<std::thread::JoinHandle<()>>,
}

impl Watcher {
    pub(super) fn start(members: &[(String, String)]) -> Watcher {
        let seen = Arc::new(Mutex::new(BTreeMap::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let threads = members
            .iter()
            .map(|(name, url)| {
                let (name, url, seen, stop) = (name.clone(), url.clone(), seen.clone(), stop.clone());
                std::thread::spawn(move || {
                    let agent = http_agent(Duration::from_millis(200));
                    while !stop.load(Ordering::Relaxed) {
                        if let Some(peers) = read_peers(&agent, &url) {
                            let update = Seen {
                                at: Some(Instant::now()),
                                peers,
                            };
                            seen.lock()
                                .unwrap_or_else(PoisonError::into_inner)
                                .insert(name.clone(), update);
                        }
                        std::thread::sleep(WATCH_EVERY);
                    }
                })
            })
            .collect();
        Watcher { seen, stop, threads }
    }

    pub(super) fn snapshot(&self) -> BTreeMap<String, Seen> {
        self.seen.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    pub(super) fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        for thread in self.threads {
            let _ = thread.join();
        }
    }
}

pub(super) fn read_peers(agent: &ureq::Agent, url: &str) -> Option<BTreeMap<String, (bool, Option<u64>)>> {
    let mut response = agent.get(format!("{url}/ready")).call().ok()?;
    let body: Value = response.body_mut().read_json().ok()?;
    Some(
        body["peers"]
            .as_object()?
            .iter()
            .map(|(name, peer)| {
                (
                    name.clone(),
                    (peer["linked"] == Value::Bool(true), peer["incarnation"].as_u64()),
                )
            })
            .collect(),
    )
}

/// A fault as it happened.
#[derive(Debug, Clone)]
pub(super) struct Record {
    pub(super) fault: Fault,
    pub(super) started: Instant,
    pub(super) ended: Option<Instant>,
    /// Kill-at-read: when the READ came and the leg was killed.
    pub(super) fired: Arc<Mutex<Option<Instant>>>,
    /// (observer, observed) pairs whose link the fault should break, and the incarnation the
    /// observer saw before it.
    pub(super) watched: Vec<(String, String, Option<u64>)>,
    pub(super) detected: Option<Instant>,
    pub(super) recovered: Option<Instant>,
}

impl Record {
    /// When the fault really began: the kill for kill-at-read, the start otherwise.
    pub(super) fn origin(&self) -> Option<Instant> {
        match self.fault.kind {
            FaultKind::KillAtRead => *self.fired.lock().unwrap_or_else(PoisonError::into_inner),
            _ => Some(self.started),
        }
    }

    /// Looks at the latest `/ready` readings for the link breaking and coming back. A break
    /// counts only until `window` after the fault ended (later ones belong to other faults);
    /// a fault that broke nothing by then was ridden out.
    pub(super) fn observe(&mut self, seen: &BTreeMap<String, Seen>, window: Duration) {
        let Some(origin) = self.origin() else {
            return;
        };
        let replaces = matches!(
            self.fault.kind,
            FaultKind::Kill | FaultKind::Restart | FaultKind::KillAtRead
        );
        // Readings taken after the fault began, per watched link: (when, broken, back).
        let states: Vec<Option<(Instant, bool, bool)>> = self
            .watched
            .iter()
            .map(|(observer, observed, before)| {
                let reading = seen.get(observer)?;
                let at = reading.at?;
                if at <= origin {
                    return None;
                }
                let (linked, incarnation) = *reading.peers.get(observed)?;
                let new_incarnation = incarnation != *before;
                let broken = !linked || (replaces && new_incarnation);
                let back = linked && (!replaces || new_incarnation);
                Some((at, broken, back))
            })
            .collect();
        let ended = self.ended.unwrap_or(origin + self.fault.hold).max(origin);
        if self.detected.is_none() {
            let broken = states
                .iter()
                .flatten()
                .filter(|(_, broken, _)| *broken)
                .map(|(at, ..)| *at)
                .min();
            match broken {
                Some(at) if at <= ended + window => self.detected = Some(at),
                _ => return,
            }
        }
        let healed = self.ended.is_some() || replaces;
        if self.recovered.is_none()
            && healed
            && !states.is_empty()
            && states.iter().all(|state| matches!(state, Some((_, _, true))))
        {
            self.recovered = states.iter().flatten().map(|(at, ..)| *at).max();
        }
    }

    /// Whether there is nothing more to observe: recovered, ridden out, or given up on.
    pub(super) fn settled(&self, window: Duration) -> bool {
        let Some(origin) = self.origin() else {
            return self.ended.is_some();
        };
        let ended = self.ended.unwrap_or(origin + self.fault.hold).max(origin);
        let now = Instant::now();
        self.recovered.is_some()
            || (self.detected.is_none() && now > ended + window)
            || now > ended + RECOVERY_BOUND
    }
}
