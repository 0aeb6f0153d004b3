//! Judging a chaos run: each request against the direct output, the faults' detection and
//! recovery times, what the legs hold after quiesce; printed, as JSON, and as a plot.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::observe::Record;
use super::schedule::FaultKind;
use super::{ChaosArgs, Reference};
use crate::load_cmd::{Sample, quantile};

/// What became of one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Outcome {
    Ok,
    CleanError,
    Hung,
    Wrong,
    Broken,
}

impl Outcome {
    pub(super) fn name(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::CleanError => "clean_error",
            Outcome::Hung => "hung",
            Outcome::Wrong => "wrong",
            Outcome::Broken => "broken",
        }
    }
}

/// Classifies `sample` against `reference`: the answer's tokens and logits digest must equal
/// the direct run's; an error must be the router's and arrive by `deadline`.
pub(super) fn classify(sample: &Sample, reference: &Reference, deadline: Duration) -> Outcome {
    let late = sample.latency_s > deadline.as_secs_f64();
    match &sample.error {
        None if late => Outcome::Hung,
        None => {
            if sample.token_ids == reference.tokens && sample.logits_digest == Some(reference.logits_digest) {
                Outcome::Ok
            } else {
                Outcome::Wrong
            }
        }
        Some(_) if late => Outcome::Hung,
        Some(_) if sample.answered => Outcome::CleanError,
        Some(_) => Outcome::Broken,
    }
}

/// Everything a report is made from.
pub(super) struct Report<'a> {
    pub(super) args: &'a ChaosArgs,
    pub(super) config_name: &'a str,
    pub(super) heartbeat_ms: u64,
    pub(super) detect: Duration,
    pub(super) samples: &'a [(usize, Sample)],
    pub(super) outcomes: &'a [Outcome],
    pub(super) records: &'a [Record],
    pub(super) run_start: Instant,
    pub(super) load_elapsed: Duration,
    pub(super) ready: Option<String>,
    /// Requests sent one by one after recovery.
    pub(super) probes: &'a [(Outcome, Sample)],
    pub(super) stats: anyhow::Result<Vec<pdkv_actors::scheduler::LegStats>>,
    pub(super) retries: u64,
    pub(super) restarts: u32,
    pub(super) unexpected: &'a [String],
    pub(super) relay_counts: (u64, u64),
}

/// An error message with its numbers blanked, so errors of one kind count together.
pub(super) fn error_kind(message: &str) -> String {
    let mut kind = String::new();
    let mut in_number = false;
    for character in message.chars() {
        if character.is_ascii_digit() {
            if !in_number {
                kind.push('N');
            }
            in_number = true;
        } else {
            in_number = false;
            kind.push(character);
        }
    }
    kind.chars().take(100).collect()
}

pub(super) fn millis(values: &mut [f64]) -> Value {
    json!({
        "count": values.len(),
        "p50": (quantile(values, 0.5) * 1e3).round(),
        "p99": (quantile(values, 0.99) * 1e3).round(),
        "max": (quantile(values, 1.0) * 1e3).round(),
    })
}

impl Report<'_> {
    /// Seconds from the run's start of `at`.
    pub(super) fn at(&self, at: Instant) -> f64 {
        at.saturating_duration_since(self.run_start).as_secs_f64()
    }

    /// Time windows (seconds) in which a fault was acting or the cluster recovering from it.
    pub(super) fn windows(&self) -> Vec<(f64, f64)> {
        self.records
            .iter()
            .map(|record| {
                let end = [record.ended, record.recovered]
                    .into_iter()
                    .flatten()
                    .max()
                    .unwrap_or(record.started + record.fault.hold);
                (self.at(record.started), self.at(end))
            })
            .collect()
    }

    pub(super) fn build(self) -> Value {
        let count = |outcome: Outcome| self.outcomes.iter().filter(|seen| **seen == outcome).count();
        let mut errors: BTreeMap<String, usize> = BTreeMap::new();
        for ((_, sample), outcome) in self.samples.iter().zip(self.outcomes) {
            if *outcome != Outcome::Ok {
                let message = sample
                    .error
                    .as_deref()
                    .unwrap_or("answer differs from the direct run");
                *errors
                    .entry(format!("{}: {}", outcome.name(), error_kind(message)))
                    .or_default() += 1;
            }
        }
        let windows = self.windows();
        let (mut steady, mut faulted) = (Vec::new(), Vec::new());
        for ((_, sample), outcome) in self.samples.iter().zip(self.outcomes) {
            let (Outcome::Ok, Some(ttft)) = (outcome, sample.ttft_s) else {
                continue;
            };
            let (start, end) = (sample.start_s, sample.start_s + sample.latency_s);
            if windows.iter().any(|(from, to)| start < *to && end > *from) {
                faulted.push(ttft);
            } else {
                steady.push(ttft);
            }
        }
        let mut by_kind: BTreeMap<&str, usize> = BTreeMap::new();
        let mut detect_by_kind: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
        let mut recover_by_kind: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
        let mut fault_log = Vec::new();
        for record in self.records {
            let kind = record.fault.kind.name();
            *by_kind.entry(kind).or_default() += 1;
            let origin = record.origin();
            let since = |at: Option<Instant>| match (origin, at) {
                (Some(origin), Some(at)) => Some(at.saturating_duration_since(origin).as_secs_f64()),
                _ => None,
            };
            let (detect, recover) = (since(record.detected), since(record.recovered));
            if let Some(detect) = detect {
                detect_by_kind.entry(kind).or_default().push(detect);
            }
            if let Some(recover) = recover {
                recover_by_kind.entry(kind).or_default().push(recover);
            }
            fault_log.push(json!({
                "at_s": self.at(record.started),
                "kind": kind,
                "node": record.fault.node,
                "peer": record.fault.peer,
                "hold_s": record.fault.hold.as_secs_f64(),
                "amount": record.fault.amount,
                "fired_s": origin.filter(|_| record.fault.kind == FaultKind::KillAtRead).map(|at| self.at(at)),
                "detect_ms": detect.map(|seconds| (seconds * 1e3).round()),
                "recover_ms": recover.map(|seconds| (seconds * 1e3).round()),
            }));
        }
        let fired = self
            .records
            .iter()
            .filter(|record| record.fault.kind == FaultKind::KillAtRead && record.origin().is_some())
            .count();
        let summarize = |table: BTreeMap<&str, Vec<f64>>| -> Value {
            table
                .into_iter()
                .map(|(kind, mut values)| (kind.to_string(), millis(&mut values)))
                .collect::<serde_json::Map<String, Value>>()
                .into()
        };
        let (held, capacity, grants, active, stats_error) = match &self.stats {
            Ok(stats) => (
                stats.iter().map(|leg| leg.load.held_blocks()).sum::<u64>(),
                stats
                    .iter()
                    .map(|leg| leg.load.capacity.iter().sum::<u64>())
                    .sum::<u64>(),
                stats.iter().map(|leg| leg.load.grants).sum::<u64>(),
                stats.iter().map(|leg| leg.load.requests).sum::<u64>(),
                None,
            ),
            Err(error) => (0, 0, 0, 0, Some(format!("{error:#}"))),
        };
        let probes_ok = self
            .probes
            .iter()
            .filter(|(outcome, _)| *outcome == Outcome::Ok)
            .count();
        let mut after: Vec<f64> = self
            .probes
            .iter()
            .filter_map(|(_, sample)| sample.ttft_s)
            .collect();
        let mut failures = Vec::new();
        for outcome in [Outcome::Wrong, Outcome::Hung, Outcome::Broken] {
            if count(outcome) > 0 {
                failures.push(format!("{} {} requests", count(outcome), outcome.name()));
            }
        }
        if held > 0 || grants > 0 || active > 0 {
            failures.push(format!(
                "leaked after quiesce: {held} blocks, {grants} grants, {active} requests"
            ));
        }
        if let Some(error) = &stats_error {
            failures.push(format!("cannot read the legs' metrics: {error}"));
        }
        if !self.unexpected.is_empty() {
            failures.push(format!(
                "nodes exited on their own: {}",
                self.unexpected.join("; ")
            ));
        }
        if let Some(error) = &self.ready {
            failures.push(format!("not ready after the faults: {error}"));
        }
        if probes_ok < self.probes.len() {
            failures.push(format!(
                "{probes_ok}/{} requests after recovery succeeded",
                self.probes.len()
            ));
        }
        if self.samples.is_empty() {
            failures.push("no request was sent".into());
        }
        json!({
            "seed": self.args.seed,
            "config": self.config_name,
            "read_engine": format!("{:?}", self.args.read_engine).to_lowercase(),
            "duration_s": self.load_elapsed.as_secs_f64(),
            "concurrency": self.args.concurrency,
            "requests": {
                "total": self.samples.len(),
                "ok": count(Outcome::Ok),
                "clean_error": count(Outcome::CleanError),
                "hung": count(Outcome::Hung),
                "wrong": count(Outcome::Wrong),
                "broken": count(Outcome::Broken),
            },
            "errors": errors,
            "faults": {
                "total": self.records.len(),
                "by_kind": by_kind,
                "kill_at_read_fired": fired,
            },
            "heartbeat_ms": self.heartbeat_ms,
            "detect_bound_ms": self.detect.as_millis() as u64,
            "detect_ms": summarize(detect_by_kind),
            "recover_ms": summarize(recover_by_kind),
            "ttft_ms": {
                "steady": millis(&mut steady),
                "during_faults": millis(&mut faulted),
                "after_recovery": millis(&mut after),
            },
            "retries": self.retries,
            "restarts": self.restarts,
            "unexpected_exits": self.unexpected,
            "after_quiesce": {
                "blocks_held": held,
                "blocks_capacity": capacity,
                "grants": grants,
                "requests": active,
            },
            "probes": self.probes.len(),
            "recovered_probes": probes_ok,
            "relays": {"forwarded": self.relay_counts.0, "dropped": self.relay_counts.1},
            "fault_log": fault_log,
            "failures": failures,
            "pass": failures.is_empty(),
        })
    }
}

pub(super) fn print_report(report: &Value) {
    let requests = &report["requests"];
    crate::outln!(
        "chaos seed {} over {:.1} s ({} clients, {} READs): {} requests: {} ok, {} clean errors, {} hung, {} wrong, {} broken",
        report["seed"],
        report["duration_s"].as_f64().unwrap_or(0.0),
        report["concurrency"],
        report["read_engine"].as_str().unwrap_or(""),
        requests["total"],
        requests["ok"],
        requests["clean_error"],
        requests["hung"],
        requests["wrong"],
        requests["broken"],
    );
    let faults = &report["faults"];
    crate::outln!(
        "faults: {} ({}); kill-at-read fired {}; node restarts {}; router retries {}",
        faults["total"],
        faults["by_kind"]
            .as_object()
            .map(|kinds| kinds
                .iter()
                .map(|(kind, count)| format!("{kind} {count}"))
                .collect::<Vec<_>>()
                .join(", "))
            .unwrap_or_default(),
        faults["kill_at_read_fired"],
        report["restarts"],
        report["retries"],
    );
    for (label, key) in [("detect", "detect_ms"), ("recover", "recover_ms")] {
        if let Some(kinds) = report[key].as_object() {
            for (kind, figures) in kinds {
                crate::outln!(
                    "{label:<8} {kind:<13} n={:<4} p50 {} ms, max {} ms",
                    figures["count"],
                    figures["p50"],
                    figures["max"]
                );
            }
        }
    }
    crate::outln!(
        "heartbeat {} ms; a silent peer is down after {} ms",
        report["heartbeat_ms"],
        report["detect_bound_ms"]
    );
    for (label, key) in [
        ("steady", "steady"),
        ("during faults", "during_faults"),
        ("after recovery (one at a time)", "after_recovery"),
    ] {
        let figures = &report["ttft_ms"][key];
        crate::outln!(
            "TTFT {label}: n={} p50 {} ms, p99 {} ms",
            figures["count"],
            figures["p50"],
            figures["p99"]
        );
    }
    let quiesce = &report["after_quiesce"];
    crate::outln!(
        "after quiesce: {}/{} blocks held, {} grants, {} requests; requests after recovery {}/{} ok",
        quiesce["blocks_held"],
        quiesce["blocks_capacity"],
        quiesce["grants"],
        quiesce["requests"],
        report["recovered_probes"],
        report["probes"],
    );
    if let Some(errors) = report["errors"].as_object() {
        for (kind, count) in errors {
            crate::outln!("  x{count} {kind}");
        }
    }
    match report["failures"].as_array() {
        Some(failures) if !failures.is_empty() => {
            for failure in failures {
                crate::outln!("FAIL: {}", failure.as_str().unwrap_or(""));
            }
        }
        _ => crate::outln!("PASS: 0 wrong, 0 hung, 0 leaked"),
    }
}

/// Requests by send time and latency, coloured by outcome (top), and faults on a time line,
/// one row per kind, with the moments they were detected (black) and recovered (green).
pub(super) fn plot(
    samples: &[(usize, Sample)],
    outcomes: &[Outcome],
    records: &[Record],
    run_start: Instant,
    path: &Path,
) -> anyhow::Result<()> {
    use plotters::prelude::*;
    let fail = |error: &dyn std::fmt::Display| anyhow::anyhow!("{error}");
    let root = SVGBackend::new(path, (1100, 700)).into_drawing_area();
    root.fill(&WHITE).map_err(|error| fail(&error))?;
    let (top, bottom) = root.split_vertically(400);
    let at = |instant: Instant| instant.saturating_duration_since(run_start).as_secs_f64();
    let end_s = samples
        .iter()
        .map(|(_, sample)| sample.start_s + sample.latency_s)
        .chain(
            records
                .iter()
                .map(|record| at(record.ended.unwrap_or(record.started))),
        )
        .fold(1.0, f64::max);
    let max_ms = samples
        .iter()
        .map(|(_, sample)| sample.latency_s * 1e3)
        .fold(1.0, f64::max)
        * 1.1;
    // Both panels share the time axis and the width of the label area, so they line up.
    let label_area = 110;
    let mut requests = ChartBuilder::on(&top)
        .caption("requests by send time", ("sans-serif", 15))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(label_area)
        .build_cartesian_2d(0.0..end_s, 0.0..max_ms)
        .map_err(|error| fail(&error))?;
    requests
        .configure_mesh()
        .x_desc("time since start (s)")
        .y_desc("latency (ms)")
        .draw()
        .map_err(|error| fail(&error))?;
    let orange = RGBColor(230, 140, 0);
    for (label, color, wanted) in [
        ("ok", BLUE, &[Outcome::Ok][..]),
        ("clean error", orange, &[Outcome::CleanError][..]),
        (
            "hung, wrong or broken",
            RED,
            &[Outcome::Hung, Outcome::Wrong, Outcome::Broken][..],
        ),
    ] {
        requests
            .draw_series(
                samples
                    .iter()
                    .zip(outcomes)
                    .filter(|(_, outcome)| wanted.contains(outcome))
                    .map(|((_, sample), _)| {
                        Circle::new((sample.start_s, sample.latency_s * 1e3), 2, color.filled())
                    }),
            )
            .map_err(|error| fail(&error))?
            .label(label)
            .legend(move |(x, y)| Circle::new((x + 5, y), 3, color.filled()));
    }
    requests
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|error| fail(&error))?;
    let rows = FaultKind::ALL.len() as f64;
    let mut timeline = ChartBuilder::on(&bottom)
        .caption("faults", ("sans-serif", 15))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(label_area)
        .build_cartesian_2d(0.0..end_s, -0.5..rows - 0.5)
        .map_err(|error| fail(&error))?;
    timeline
        .configure_mesh()
        .x_desc("time since start (s)")
        .y_desc("fault kind")
        .y_labels(FaultKind::ALL.len())
        .y_label_formatter(&|row| {
            FaultKind::ALL
                .get(row.round() as usize)
                .map_or(String::new(), |kind| kind.name().to_string())
        })
        .draw()
        .map_err(|error| fail(&error))?;
    let row = |kind: FaultKind| {
        FaultKind::ALL
            .iter()
            .position(|candidate| *candidate == kind)
            .unwrap_or(0) as f64
    };
    let held = RGBColor(200, 60, 60).mix(0.5);
    timeline
        .draw_series(records.iter().map(|record| {
            let y = row(record.fault.kind);
            let (from, to) = (at(record.started), at(record.ended.unwrap_or(record.started)));
            Rectangle::new([(from, y - 0.35), (to.max(from + 0.05), y + 0.35)], held.filled())
        }))
        .map_err(|error| fail(&error))?
        .label("fault held")
        .legend(move |(x, y)| Rectangle::new([(x, y - 4), (x + 10, y + 4)], held.filled()));
    timeline
        .draw_series(records.iter().filter_map(|record| {
            Some(Circle::new(
                (at(record.detected?), row(record.fault.kind)),
                3,
                BLACK.filled(),
            ))
        }))
        .map_err(|error| fail(&error))?
        .label("detected")
        .legend(|(x, y)| Circle::new((x + 5, y), 3, BLACK.filled()));
    timeline
        .draw_series(records.iter().filter_map(|record| {
            Some(Circle::new(
                (at(record.recovered?), row(record.fault.kind)),
                3,
                GREEN.filled(),
            ))
        }))
        .map_err(|error| fail(&error))?
        .label("recovered")
        .legend(|(x, y)| Circle::new((x + 5, y), 3, GREEN.filled()));
    timeline
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|error| fail(&error))?;
    root.present().map_err(|error| fail(&error))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(
        latency_s: f64,
        tokens: Vec<u32>,
        digest: Option<u64>,
        error: Option<&str>,
        answered: bool,
    ) -> Sample {
        Sample {
            start_s: 0.0,
            latency_s,
            ttft_s: None,
            gaps_s: Vec::new(),
            prompt_tokens: 3,
            tokens: tokens.len(),
            token_ids: tokens,
            logits_digest: digest,
            read_bytes: 0,
            error: error.map(String::from),
            answered,
        }
    }

    #[test]
    fn answers_are_judged_against_the_direct_run_and_errors_by_who_gave_them_and_when() {
        let reference = Reference {
            sampling: pdkv_core::sampling::Sampling::default(),
            prompt: vec![1, 2, 3],
            tokens: vec![4, 5],
            logits_digest: 0xabc,
        };
        let deadline = Duration::from_secs(2);
        let judge = |sample: Sample| classify(&sample, &reference, deadline);
        assert_eq!(
            judge(sample(0.1, vec![4, 5], Some(0xabc), None, false)),
            Outcome::Ok
        );
        assert_eq!(
            judge(sample(0.1, vec![4, 6], Some(0xabc), None, false)),
            Outcome::Wrong
        );
        assert_eq!(
            judge(sample(0.1, vec![4, 5], Some(0xabd), None, false)),
            Outcome::Wrong,
            "same tokens, other logits"
        );
        assert_eq!(
            judge(sample(0.1, vec![4, 5], None, None, false)),
            Outcome::Wrong,
            "no digest to check"
        );
        assert_eq!(
            judge(sample(0.1, vec![4], Some(0xabc), None, false)),
            Outcome::Wrong,
            "a short answer"
        );
        assert_eq!(
            judge(sample(1.0, vec![], None, Some("503: no prefill leg"), true)),
            Outcome::CleanError
        );
        assert_eq!(
            judge(sample(1.0, vec![], None, Some("connection reset"), false)),
            Outcome::Broken
        );
        assert_eq!(
            judge(sample(2.5, vec![], None, Some("504: timed out"), true)),
            Outcome::Hung,
            "an error after the deadline"
        );
        assert_eq!(
            judge(sample(5.0, vec![], None, Some("timeout"), false)),
            Outcome::Hung
        );
        assert_eq!(
            judge(sample(2.5, vec![4, 5], Some(0xabc), None, false)),
            Outcome::Hung,
            "a right answer, too late"
        );
    }

    #[test]
    fn error_kinds_blank_numbers() {
        assert_eq!(
            error_kind("no free blocks within 5000 ms for request 17"),
            "no free blocks within N ms for request N"
        );
    }
}
