//! `pdkv sim` as a user runs it: a summary, exit status 0 only without violations, and a seed
//! that replays exactly.

use std::process::Command;

use serde_json::Value;

fn sim(args: &[&str]) -> (i32, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_pdkv"))
        .arg("sim")
        .args(args)
        .output()
        .expect("pdkv runs");
    (
        output.status.code().expect("exit code"),
        String::from_utf8(output.stdout).unwrap(),
    )
}

#[test]
fn a_run_summarises_requests_faults_and_violations() {
    let (code, stdout) = sim(&["--seeds", "300", "--json"]);
    assert_eq!(code, 0, "{stdout}");
    let summary: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(summary["scenarios"], 300);
    assert_eq!(summary["requests"], 300 * 8);
    let ok = summary["ok"].as_u64().unwrap();
    let failed = summary["failed_cleanly"].as_u64().unwrap();
    assert_eq!(ok + failed, 300 * 8, "every request ended one way or the other");
    assert_eq!(summary["violations"], 0);
    let faults = summary["faults"].as_object().unwrap();
    for kind in [
        "drop",
        "duplicate",
        "delay",
        "freeze",
        "lapse_lease",
        "fail_read",
        "restart",
    ] {
        assert!(
            faults.get(kind).and_then(Value::as_u64).unwrap_or(0) > 0,
            "{kind} never injected: {faults:?}"
        );
    }
    let (code, stdout) = sim(&["--seeds", "50", "--no-faults"]);
    assert_eq!(code, 0);
    assert!(
        stdout.starts_with("50 scenarios, 400 requests: 400 ok, 0 failed cleanly"),
        "{stdout}"
    );
}

#[test]
fn a_seed_replays_exactly() {
    let (_, first) = sim(&["--seed", "10081", "--json"]);
    let (_, again) = sim(&["--seed", "10081", "--json"]);
    let strip = |text: &str| {
        let mut value: Value = serde_json::from_str(text).unwrap();
        let object = value.as_object_mut().unwrap();
        object.remove("elapsed_s");
        object.remove("scenarios_per_s");
        value
    };
    assert_eq!(strip(&first), strip(&again));
    let (code, _) = sim(&["--seed", "1", "--seeds", "5"]);
    assert_eq!(code, 2, "--seed and --seeds conflict");
}

/// The last seeds there are run like any other; a range past them is refused by name, never
/// run as an empty range that reports no violations.
#[test]
fn the_last_seed_runs_and_a_range_past_it_is_refused() {
    let last = u64::MAX.to_string();
    let (code, stdout) = sim(&["--seed", &last, "--json"]);
    assert_eq!(code, 0, "{stdout}");
    let summary: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(summary["scenarios"], 1);
    let second_last = (u64::MAX - 1).to_string();
    let (code, stdout) = sim(&["--first-seed", &second_last, "--seeds", "2", "--json"]);
    assert_eq!(code, 0, "{stdout}");
    let summary: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(summary["scenarios"], 2);
    let output = Command::new(env!("CARGO_BIN_EXE_pdkv"))
        .args(["sim", "--first-seed", &second_last, "--seeds", "3"])
        .output()
        .expect("pdkv runs");
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert!(
        stderr.contains(&format!(
            "--first-seed {second_last} with --seeds 3 runs past the last seed"
        )),
        "{stderr}"
    );
}

/// `--topology PxD` runs that many legs of each role and the summary says so, with retried and
/// streamed requests counted; a topology outside 1..=16 legs per role is refused by name.
#[test]
fn a_topology_runs_as_asked_and_a_bad_one_is_refused_by_name() {
    let (code, stdout) = sim(&[
        "--seeds",
        "40",
        "--topology",
        "8x8",
        "--max-retries",
        "2",
        "--json",
    ]);
    assert_eq!(code, 0, "{stdout}");
    let summary: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(summary["topologies"]["8x8"], 40, "{summary}");
    assert_eq!(summary["topologies"].as_object().unwrap().len(), 1, "{summary}");
    assert!(summary["streamed"].as_u64().unwrap() > 0, "{summary}");
    assert!(summary["retried"].as_u64().is_some(), "{summary}");
    assert!(summary["refused"].is_object(), "{summary}");
    for (topology, detail) in [
        ("0x3", "prefill count 0 is outside 1..=16"),
        ("3x17", "decode count 17 is outside 1..=16"),
        ("3", "expected PxD"),
        ("ax2", "prefill count \"a\" is not a number"),
    ] {
        let output = Command::new(env!("CARGO_BIN_EXE_pdkv"))
            .args(["sim", "--seeds", "1", "--topology", topology])
            .output()
            .expect("pdkv runs");
        assert_eq!(output.status.code(), Some(2), "{topology}");
        let stderr = String::from_utf8(output.stderr).unwrap();
        assert!(stderr.contains(detail), "{topology}: {stderr}");
    }
}
