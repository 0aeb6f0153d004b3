//! The conductor of a chaos run: starts and ends each scheduled fault, restarts the legs it
//! stopped (and any that exit on their own, which it counts), and feeds the observations to
//! each fault's record.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::Context;
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;

use super::observe::{Record, Seen};
use super::schedule::{Fault, FaultKind};
use super::wiring::Relays;
use crate::launch::Cluster;

/// Sends `signal` to `name`'s process group.
pub(super) fn signal_member(cluster: &Cluster, name: &str, signal: Signal) -> Option<u32> {
    let pid = cluster.members.iter().find(|member| member.name == name)?.pid()?;
    killpg(Pid::from_raw(pid as i32), signal).ok()?;
    Some(pid)
}

/// The conductor's state: what it did to which process, and what it expects next.
pub(super) struct Conductor<'a> {
    pub(super) cluster: &'a mut Cluster,
    pub(super) relays: &'a Relays,
    pub(super) start: Instant,
    /// Node → its current process id, for triggers firing on relay threads.
    pub(super) pids: Arc<Mutex<HashMap<String, u32>>>,
    /// Nodes this run stopped, and when to start them again (None: when they exit).
    pub(super) expected: Arc<Mutex<HashMap<String, Option<Instant>>>>,
    /// Nodes down and waiting for their restart time.
    pub(super) down: HashMap<String, Instant>,
    pub(super) records: Vec<Record>,
    pub(super) active: Vec<usize>,
    pub(super) unexpected: Vec<String>,
    pub(super) restarts: u32,
    pub(super) restart_after: Duration,
    /// How long after a fault ends a broken link still counts as its doing.
    pub(super) detect_window: Duration,
}

impl Conductor<'_> {
    pub(super) fn now_s(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    pub(super) fn refresh_pids(&self) {
        let mut pids = self.pids.lock().unwrap_or_else(PoisonError::into_inner);
        for member in &self.cluster.members {
            match member.pid() {
                Some(pid) => pids.insert(member.name.clone(), pid),
                None => pids.remove(&member.name),
            };
        }
    }

    /// Reaps exited members: expected ones restart at their time, others at once (counted).
    pub(super) fn reap(&mut self) -> anyhow::Result<()> {
        while let Some((index, status)) = self.cluster.exited() {
            let name = self.cluster.members[index].name.clone();
            let expected = self
                .expected
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .remove(&name);
            match expected {
                Some(restart_at) => {
                    self.down.insert(name, restart_at.unwrap_or_else(Instant::now));
                }
                None => {
                    let log = self.cluster.members[index].log.display().to_string();
                    eprintln!(
                        "chaos: {name} exited on its own ({status}) at {:.1} s; log {log}",
                        self.now_s()
                    );
                    self.unexpected.push(format!("{name}: {status}"));
                    self.down.insert(name, Instant::now());
                }
            }
        }
        let now = Instant::now();
        let due: Vec<String> = self
            .down
            .iter()
            .filter(|(_, at)| **at <= now)
            .map(|(name, _)| name.clone())
            .collect();
        for name in due {
            self.down.remove(&name);
            let index = self
                .cluster
                .members
                .iter()
                .position(|member| member.name == name)
                .context("member")?;
            self.cluster.spawn(index)?;
            self.restarts += 1;
        }
        self.refresh_pids();
        Ok(())
    }

    /// The links a fault on `node` (and `peer`) should break, with the incarnation each
    /// observer sees now.
    pub(super) fn watched(
        &self,
        fault: &Fault,
        seen: &BTreeMap<String, Seen>,
    ) -> Vec<(String, String, Option<u64>)> {
        let pairs: Vec<(String, String)> = match &fault.peer {
            Some(peer) if fault.kind != FaultKind::KillAtRead => vec![
                (fault.node.clone(), peer.clone()),
                (peer.clone(), fault.node.clone()),
            ],
            // A process fault: every node linked to it watches it.
            _ => self
                .relays
                .control
                .keys()
                .filter(|(_, to)| *to == fault.node)
                .map(|(from, to)| (from.clone(), to.clone()))
                .collect(),
        };
        pairs
            .into_iter()
            .map(|(observer, observed)| {
                let before = seen
                    .get(&observer)
                    .and_then(|reading| reading.peers.get(&observed))
                    .and_then(|(_, incarnation)| *incarnation);
                (observer, observed, before)
            })
            .collect()
    }

    pub(super) fn begin(&mut self, fault: Fault, seen: &BTreeMap<String, Seen>) {
        let watched = self.watched(&fault, seen);
        let record = Record {
            fault: fault.clone(),
            started: Instant::now(),
            ended: None,
            fired: Arc::new(Mutex::new(None)),
            watched,
            detected: None,
            recovered: None,
        };
        let peer = fault.peer.clone().unwrap_or_default();
        match fault.kind {
            FaultKind::Kill => {
                self.expect_exit(&fault.node, Some(Instant::now() + self.restart_after));
                if signal_member(self.cluster, &fault.node, Signal::SIGKILL).is_none() {
                    self.not_expected(&fault.node);
                }
            }
            FaultKind::Restart => {
                self.expect_exit(&fault.node, None);
                if signal_member(self.cluster, &fault.node, Signal::SIGTERM).is_none() {
                    self.not_expected(&fault.node);
                }
            }
            FaultKind::Pause => {
                let _ = signal_member(self.cluster, &fault.node, Signal::SIGSTOP);
            }
            FaultKind::Partition => {
                for relay in self.relays.between(&fault.node, &peer) {
                    relay.faults.blackhole();
                }
            }
            FaultKind::Delay => {
                for relay in self.relays.between(&fault.node, &peer) {
                    relay.faults.delay(Duration::from_secs_f64(fault.amount / 1000.0));
                }
            }
            FaultKind::Loss => {
                for relay in self.relays.between(&fault.node, &peer) {
                    relay.faults.lose(fault.amount);
                }
            }
            FaultKind::KillAtRead => {
                if let Some(relay) = self.relays.data.get(&(peer.clone(), fault.node.clone())) {
                    let (pids, expected, fired) =
                        (self.pids.clone(), self.expected.clone(), record.fired.clone());
                    let (node, restart_after) = (fault.node.clone(), self.restart_after);
                    relay.faults.arm(Box::new(move || {
                        let pid = pids
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner)
                            .get(&node)
                            .copied();
                        if let Some(pid) = pid {
                            let now = Instant::now();
                            expected
                                .lock()
                                .unwrap_or_else(PoisonError::into_inner)
                                .insert(node.clone(), Some(now + restart_after));
                            if killpg(Pid::from_raw(pid as i32), Signal::SIGKILL).is_ok() {
                                *fired.lock().unwrap_or_else(PoisonError::into_inner) = Some(now);
                            } else {
                                expected
                                    .lock()
                                    .unwrap_or_else(PoisonError::into_inner)
                                    .remove(&node);
                            }
                        }
                    }));
                }
            }
        }
        self.records.push(record);
        self.active.push(self.records.len() - 1);
    }

    pub(super) fn expect_exit(&self, node: &str, restart_at: Option<Instant>) {
        self.expected
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(node.to_string(), restart_at);
    }

    pub(super) fn not_expected(&self, node: &str) {
        self.expected
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(node);
    }

    /// Ends the faults whose hold has passed (all of them with `all`).
    pub(super) fn end_due(&mut self, all: bool) {
        let now = Instant::now();
        let mut still = Vec::new();
        for index in std::mem::take(&mut self.active) {
            let record = &mut self.records[index];
            // A kill-at-read is over once it fired (the restart is the reaper's).
            let fired = record.fault.kind == FaultKind::KillAtRead && record.origin().is_some();
            if !all && !fired && now < record.started + record.fault.hold {
                still.push(index);
                continue;
            }
            record.ended = Some(now);
            let fault = &record.fault;
            let peer = fault.peer.clone().unwrap_or_default();
            match fault.kind {
                FaultKind::Pause => {
                    let _ = signal_member(self.cluster, &fault.node, Signal::SIGCONT);
                }
                FaultKind::Partition | FaultKind::Delay | FaultKind::Loss => {
                    for relay in self.relays.between(&fault.node, &peer) {
                        relay.faults.heal();
                    }
                }
                FaultKind::KillAtRead => {
                    if let Some(relay) = self.relays.data.get(&(peer, fault.node.clone())) {
                        relay.faults.disarm();
                    }
                }
                FaultKind::Kill | FaultKind::Restart => {}
            }
        }
        self.active = still;
    }

    /// Runs the schedule for `duration` from the conductor's start: restarts, begins each fault
    /// at its time, ends those whose hold passed, and records what the watcher sees.
    pub(super) fn run_schedule(
        &mut self,
        faults: &[Fault],
        watcher: &super::observe::Watcher,
        duration: Duration,
    ) -> anyhow::Result<()> {
        let mut next = 0;
        while self.start.elapsed() < duration {
            self.reap()?;
            let seen = watcher.snapshot();
            while next < faults.len() && faults[next].at <= self.start.elapsed() {
                self.begin(faults[next].clone(), &seen);
                next += 1;
            }
            self.end_due(false);
            self.observe(&seen);
            std::thread::sleep(super::TICK);
        }
        Ok(())
    }

    /// Quiesce: every fault ended and healed, then, until `deadline`, waits for the load to stop
    /// (`load_done`) and every leg this run stopped to be started again.
    pub(super) fn settle(
        &mut self,
        watcher: &super::observe::Watcher,
        deadline: Instant,
        load_done: impl Fn() -> bool,
    ) -> anyhow::Result<()> {
        self.end_due(true);
        self.relays.heal_all();
        while (!load_done()
            || !self.down.is_empty()
            || !self
                .expected
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .is_empty())
            && Instant::now() < deadline
        {
            self.reap()?;
            self.observe(&watcher.snapshot());
            std::thread::sleep(super::TICK);
        }
        Ok(())
    }

    pub(super) fn observe(&mut self, seen: &BTreeMap<String, Seen>) {
        for record in &mut self.records {
            if !record.settled(self.detect_window) {
                record.observe(seen, self.detect_window);
            }
        }
    }
}
