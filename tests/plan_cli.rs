//! `pdkv plan` end to end: the shipped scenarios, and malformed scenarios refused with a clear
//! error and a non-zero exit, never a panic.

use std::io::Write;
use std::process::{Command, Stdio};

use serde_json::Value;

fn plan(args: &[&str], stdin: Option<&str>) -> (i32, String, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_pdkv"))
        .arg("plan")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("pdkv runs");
    let mut input = child.stdin.take().expect("stdin is piped");
    input
        .write_all(stdin.unwrap_or("").as_bytes())
        .expect("stdin accepts the scenario");
    drop(input);
    let output = child.wait_with_output().expect("pdkv exits");
    (
        output
            .status
            .code()
            .expect("pdkv exits with a code, not a signal"),
        String::from_utf8(output.stdout).expect("utf-8 stdout"),
        String::from_utf8(output.stderr).expect("utf-8 stderr"),
    )
}

/// Runs `pdkv plan --json ARGS`, which must succeed, and parses its output.
fn plan_json(args: &[&str]) -> Value {
    let mut all = vec!["--json"];
    all.extend_from_slice(args);
    let (code, stdout, stderr) = plan(&all, None);
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    serde_json::from_str(&stdout).unwrap()
}

fn pairs_of(json: &Value, group: usize) -> Vec<(u64, u64)> {
    json["groups"][group]["pairs"]
        .as_array()
        .expect("pairs array")
        .iter()
        .map(|pair| (pair[0].as_u64().unwrap(), pair[1].as_u64().unwrap()))
        .collect()
}

#[test]
fn shipped_seed_scenario_pairs_the_window_by_position() {
    let json = plan_json(&["scenarios/seed-decode-tail.json"]);
    assert_eq!(
        pairs_of(&json, 0),
        (0..7).map(|p| (10 + p, 100 + p)).collect::<Vec<_>>()
    );
    assert_eq!(pairs_of(&json, 1), vec![(14, 104), (15, 105), (16, 106)]);
    assert_eq!(pairs_of(&json, 2), vec![(7, 9)]);
}

#[test]
fn shipped_legacy_scenario_shows_the_shift() {
    let json = plan_json(&["scenarios/seed-decode-tail-legacy.json"]);
    assert_eq!(pairs_of(&json, 1), vec![(14, 105), (15, 106), (16, 107)]);
    let json = plan_json(&["--pairing", "anchored", "scenarios/seed-decode-tail-legacy.json"]);
    assert_eq!(pairs_of(&json, 1), vec![(14, 104), (15, 105), (16, 106)]);
    let (code, table, _) = plan(&["scenarios/seed-decode-tail-legacy.json"], None);
    assert_eq!(code, 0);
    assert!(table.contains("<- shifted"), "{table}");
}

#[test]
fn shipped_prefill_tail_and_prefix_hit_scenarios_pair() {
    let json = plan_json(&["scenarios/seed-prefill-tail.json"]);
    assert_eq!(
        pairs_of(&json, 0),
        (0..7).map(|p| (10 + p, 100 + p)).collect::<Vec<_>>()
    );
    assert_eq!(pairs_of(&json, 1), vec![(14, 104), (15, 105), (16, 106)]);
    let json = plan_json(&["scenarios/prefix-hit-dcp.json"]);
    assert_eq!(pairs_of(&json, 0), vec![(4, 43), (5, 44)]);
    assert_eq!(pairs_of(&json, 1).len(), 7);
}

/// N = 449: the decode leg reads tokens 0..=447 (blocks 0..=6, window blocks 5..=6), so a prefill
/// leg that computed only 448 tokens (7 blocks) pairs with one holding 8.
#[test]
fn shipped_prefill_that_stopped_at_n_minus_1_pairs() {
    let json = plan_json(&["scenarios/prefill-stops-at-n-minus-1.json"]);
    assert_eq!(
        pairs_of(&json, 0),
        (1..=7).map(|p| (p, 100 + p)).collect::<Vec<_>>()
    );
    assert_eq!(pairs_of(&json, 1), vec![(6, 106), (7, 107)]);
    assert_eq!(pairs_of(&json, 2), vec![(9, 20)]);
}

#[test]
fn scenario_from_stdin_matches_scenario_from_file() {
    let text = std::fs::read_to_string("scenarios/seed-decode-tail.json").unwrap();
    let (code, from_stdin, _) = plan(&["--json"], Some(&text));
    assert_eq!(code, 0);
    let (_, from_file, _) = plan(&["--json", "scenarios/seed-decode-tail.json"], None);
    assert_eq!(from_stdin, from_file);
}

/// Each malformed scenario gives `{"error": ...}` naming what is wrong and exits 1.
#[test]
fn malformed_scenarios_are_refused_with_a_clear_error() {
    let base = r#"{"groups": [{"kind": "full", "block_size": 4}, {"kind": "sliding_window", "block_size": 4, "window": 8}],
                  "num_prompt_tokens": 10,
                  "prefill": {"blocks": [[1,2,3], [7,2,3]]},
                  "decode": {"blocks": [[4,5,6], [8,5,6]]}}"#;
    let with = |from: &str, to: &str| {
        assert!(base.contains(from), "{from}");
        base.replacen(from, to, 1)
    };
    let cases = vec![
        (
            with(r#""blocks": [[1,2,3], [7,2,3]]"#, r#""blocks": [[1,2,3]]"#),
            "prefill leg gave 1 group lists, the layout has 2",
        ),
        (
            with(r#""kind": "full""#, r#""kind": "fuller""#),
            r#"groups[0]: unknown kind "fuller""#,
        ),
        (
            with(r#""block_size": 4}"#, r#""block_size": -4}"#),
            "groups[0].block_size: invalid value: integer `-4`, expected u32",
        ),
        (
            with(r#""block_size": 4}"#, r#""block_size": 0}"#),
            "groups[0]: block_size must be at least 1, got 0",
        ),
        (
            with(r#""window": 8"#, r#""window": 0"#),
            "groups[1]: sliding_window window must be at least 1 token, got 0",
        ),
        (
            with(r#", "window": 8"#, ""),
            "groups[1]: sliding_window group needs a window",
        ),
        (
            with(r#", "block_size": 4}"#, "}"),
            "groups[0]: full group needs a block_size",
        ),
        (
            with(r#""num_prompt_tokens": 10,"#, ""),
            "missing field `num_prompt_tokens`",
        ),
        (
            with(r#""num_prompt_tokens": 10"#, r#""num_prompt_tokens": 0"#),
            "num_prompt_tokens must be at least 1, got 0",
        ),
        (
            with(r#""num_prompt_tokens": 10"#, r#""num_prompt_tokens": 100"#),
            "group 0 (full): prefill leg holds 3 blocks, the exchange needs 25",
        ),
        (
            with(
                r#"[[4,5,6], [8,5,6]]}"#,
                r#"[[4,5,6], [8,5,6]], "cached_blocks": [4, 0]}"#,
            ),
            "group 0: cached_blocks 4 exceeds the decode list's 3 blocks",
        ),
        (
            with(r#"[[1,2,3], [7,2,3]]"#, r#"[[1,2,3], [7,0,3]]"#),
            "group 1 (sliding_window): prefill leg holds the null block at needed position 1",
        ),
        (
            with(
                r#""num_prompt_tokens""#,
                r#""pairing": "sideways", "num_prompt_tokens""#,
            ),
            "pairing: unknown variant `sideways`",
        ),
        (
            with(r#""num_prompt_tokens""#, r#""surprise": 1, "num_prompt_tokens""#),
            "unknown field `surprise`",
        ),
        (
            with(r#""block_size": 4}"#, r#""block_size": 4, "dcp": 0}"#),
            "groups[0]: dcp must be at least 1, got 0",
        ),
        (
            with(r#"[[1,2,3], [7,2,3]]"#, r#"[[1,2,2], [7,2,3]]"#),
            "prefill.blocks[0]: block 2 appears at both index 1 and 2",
        ),
        (
            with(r#"[[4,5,6], [8,5,6]]"#, r#"[[4,5,6], [8,8,6]]"#),
            "decode.blocks[1]: block 8 appears at both index 0 and 1",
        ),
        (format!("{base} {{}}"), "after the scenario: trailing characters"),
        (
            format!("{base}garbage"),
            "after the scenario: trailing characters",
        ),
        ("{not json".to_string(), "key must be a string"),
        (String::new(), "EOF while parsing"),
    ];
    // White space after the scenario is fine.
    assert_eq!(plan(&["--json"], Some(&format!("{base}\n\n"))).0, 0);
    for (scenario, expected) in cases {
        let (code, stdout, stderr) = plan(&["--json"], Some(&scenario));
        assert_eq!(code, 1, "{scenario}\nstdout: {stdout}\nstderr: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
        let json: Value =
            serde_json::from_str(&stdout).unwrap_or_else(|_| panic!("JSON error for {scenario}: {stdout}"));
        let error = json["error"].as_str().expect("error string");
        assert!(error.contains(expected), "{error:?} should contain {expected:?}");
    }
}

#[test]
fn missing_file_is_a_clear_error_without_json() {
    let (code, stdout, stderr) = plan(&["scenarios/does-not-exist.json"], None);
    assert_eq!(code, 1);
    assert!(stdout.is_empty());
    assert!(
        stderr.contains("cannot read scenario scenarios/does-not-exist.json"),
        "{stderr}"
    );
}

/// An error's cause is printed once, not once per layer of the error chain.
#[test]
fn errors_print_their_text_once() {
    let scenario = r#"{"groups": [{"kind": "full", "block_size": 4, "dcp": 0}], "num_prompt_tokens": 4,
                       "prefill": {"blocks": [[1]]}, "decode": {"blocks": [[2]]}}"#;
    let (code, stdout, _) = plan(&["--json"], Some(scenario));
    assert_eq!(code, 1);
    let json: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(
        json["error"],
        "<stdin>: invalid scenario: groups[0]: dcp must be at least 1, got 0"
    );
    let (code, _, stderr) = plan(&[], Some(scenario));
    assert_eq!(code, 1);
    assert_eq!(
        stderr.trim_end(),
        "error: <stdin>: invalid scenario: groups[0]: dcp must be at least 1, got 0"
    );
}

/// A 100 KB value quoted back by the parser is cut, not echoed whole.
#[test]
fn errors_do_not_echo_huge_inputs() {
    let kind = "z".repeat(100_000);
    let scenario = format!(
        r#"{{"groups": [{{"kind": "{kind}", "block_size": 4}}], "num_prompt_tokens": 4,
             "prefill": {{"blocks": [[1]]}}, "decode": {{"blocks": [[2]]}}}}"#
    );
    let (code, stdout, stderr) = plan(&["--json"], Some(&scenario));
    assert_eq!(code, 1, "{stderr}");
    let json: Value = serde_json::from_str(&stdout).unwrap();
    let error = json["error"].as_str().unwrap();
    assert!(
        error.starts_with("<stdin>: invalid scenario: groups[0]: unknown kind \"zzz"),
        "{}",
        &error[..80]
    );
    assert!(error.len() < 1200, "{} bytes", error.len());
    assert!(
        error.ends_with("more bytes not shown)"),
        "{}",
        &error[error.len() - 60..]
    );
}

/// More than 64 MiB on standard input is refused with the limit named, not cut silently.
#[test]
fn oversized_standard_input_is_refused() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_pdkv"))
        .args(["plan", "--json"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("pdkv runs");
    let mut input = child.stdin.take().expect("stdin is piped");
    // A valid scenario followed by white space up to one byte past the limit: only the size is
    // wrong. pdkv may stop reading and exit before all is written, so write errors are expected.
    let writer = std::thread::spawn(move || {
        let head = std::fs::read("scenarios/seed-decode-tail.json").unwrap();
        let _ = input.write_all(&head);
        let chunk = vec![b' '; 1 << 20];
        let mut left = (64u64 << 20) + 1 - head.len() as u64;
        while left > 0 {
            let len = left.min(chunk.len() as u64) as usize;
            if input.write_all(&chunk[..len]).is_err() {
                return;
            }
            left -= len as u64;
        }
    });
    let output = child.wait_with_output().expect("pdkv exits");
    writer.join().unwrap();
    assert_eq!(output.status.code(), Some(1));
    let json: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(
        json["error"],
        "cannot read scenario from standard input: scenario is larger than 67108864 bytes (64 MiB), the most pdkv plan reads"
    );
}

/// vLLM's mamba prefix caching: N = 40, B = 16. The prefill holds a cached checkpoint at
/// position 0, the running state after 39 tokens at (40 - 2) / 16 = 2 and a scratch block; the
/// decoder hit its first full block and holds its state slot at 2 and a scratch block. Only the
/// running state is read, never the checkpoint or a scratch block.
#[test]
fn shipped_mamba_prefix_caching_scenario_pairs_only_the_running_state() {
    let json = plan_json(&["scenarios/mamba-prefix-caching.json"]);
    assert_eq!(pairs_of(&json, 0), vec![(2, 102), (3, 103)]);
    assert_eq!(pairs_of(&json, 1), vec![(6, 26)]);
}
