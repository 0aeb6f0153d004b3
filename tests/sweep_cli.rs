//! `pdkv demo` and `pdkv sweep` as a user runs them: real processes, the shipped cluster.toml.

use std::process::Command;

use serde_json::Value;

fn pdkv(args: &[&str]) -> (i32, String, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_pdkv"))
        .args(args)
        .output()
        .expect("pdkv runs");
    (
        output.status.code().expect("exit code"),
        String::from_utf8(output.stdout).unwrap(),
        String::from_utf8(output.stderr).unwrap(),
    )
}

/// The README's first command: the shipped cluster as processes, every length through the
/// router's HTTP API.
#[test]
fn demo_matches_on_all_102_lengths() {
    let (code, stdout, stderr) = pdkv(&["demo"]);
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    assert!(
        stdout.contains("102/102 match (anchored pairing, processes over QUIC"),
        "{stdout}"
    );
    assert!(!stdout.contains("LEAK"), "{stdout}");
}

/// The same lengths with the whole actor cluster in this process, on both link kinds.
#[test]
fn demo_in_process_matches_on_all_102_lengths() {
    for links in ["local", "quic"] {
        let (code, stdout, stderr) = pdkv(&["demo", "--in-process", "--links", links]);
        assert_eq!(code, 0, "{stdout}\n{stderr}");
        assert!(
            stdout.contains(&format!(
                "102/102 match (anchored pairing, in one process, {links} links"
            )),
            "{stdout}"
        );
    }
}

/// The legacy sweep fails exactly where `N > 128` and `(N - 1) % 64 >= 55`, and nowhere else.
#[test]
fn legacy_sweep_fails_exactly_on_the_seed_condition() {
    let (code, stdout, _) = pdkv(&[
        "sweep",
        "--lengths",
        "120..330",
        "--pairing",
        "legacy",
        "--json",
        "--max-tokens",
        "2",
    ]);
    assert_eq!(code, 1, "mismatches exit non-zero");
    let lines: Vec<Value> = stdout
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    let (rows, summary) = lines.split_at(lines.len() - 1);
    assert_eq!(rows.len(), 210);
    for row in rows {
        let n = row["prompt_tokens"].as_u64().unwrap();
        let predicted = n > 128 && (n - 1) % 64 >= 55;
        assert_eq!(row["match"].as_bool().unwrap(), !predicted, "N = {n}");
        assert!(row["error"].is_null());
    }
    assert_eq!(summary[0]["summary"]["legs_idle"], Value::Bool(true));
    let (code, stdout, _) = pdkv(&["sweep", "--lengths", "251,377,440", "--json"]);
    assert_eq!(code, 0, "{stdout}");
    assert!(stdout.contains(r#""matched":3"#), "{stdout}");
}

#[test]
fn bad_inputs_are_refused_with_the_key_named() {
    let dir = std::env::temp_dir().join(format!("pdkv-sweep-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("cluster.toml");
    let shipped = std::fs::read_to_string("cluster.toml").unwrap();
    std::fs::write(
        &bad,
        shipped.replacen("blocks_per_group = 64", "blocks_per_group = 0", 1),
    )
    .unwrap();
    let (code, _, stderr) = pdkv(&["sweep", "--config", bad.to_str().unwrap(), "--lengths", "5"]);
    assert_eq!(code, 1);
    assert!(
        stderr.contains("nodes[0].blocks_per_group: must be at least 1"),
        "{stderr}"
    );
    let (code, _, stderr) = pdkv(&["sweep", "--lengths", "9..3"]);
    assert_eq!(code, 1);
    assert!(stderr.contains("--lengths: range \"9..3\" is empty"), "{stderr}");
    let (code, _, stderr) = pdkv(&["sweep"]);
    assert_eq!(code, 1);
    assert!(stderr.contains("--lengths is required"), "{stderr}");
    let (code, _, stderr) = pdkv(&["sweep", "--lengths", "5", "--max-tokens", "0"]);
    assert_eq!(code, 2, "clap refuses the value");
    assert!(stderr.contains("--max-tokens"), "{stderr}");
    // vLLM-only flags on the reference engine: refused by name, not ignored.
    let (code, _, stderr) = pdkv(&["sweep", "--lengths", "5", "--last-token", "decode"]);
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("--last-token are for vLLM legs"), "{stderr}");
    let (code, _, stderr) = pdkv(&["sweep", "--lengths", "5", "--last-token", "middle"]);
    assert_eq!(code, 2, "clap refuses the value");
    assert!(stderr.contains("--last-token"), "{stderr}");
    let (code, _, stderr) = pdkv(&["demo", "--config", "does/not/exist.toml"]);
    assert_eq!(code, 1);
    assert!(
        stderr.contains("cannot read cluster config does/not/exist.toml"),
        "{stderr}"
    );
    std::fs::remove_dir_all(dir).ok();
}

/// Lengths no leg can hold are refused before the cluster starts or a prompt is built (they
/// used to panic with `capacity overflow` or grow past 10 GB), and a spec's cap is on the total.
#[test]
fn absurd_lengths_are_refused_before_any_work() {
    for length in [
        "18446744073709551615",
        "9223372036854775807",
        "2305843009213693952",
        "1000000000",
        "100000000",
        "4088",
    ] {
        let (code, stdout, stderr) = pdkv(&["sweep", "--lengths", length]);
        assert_eq!(code, 1, "{length}: {stdout}\n{stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert!(
            stderr.contains(&format!(
                "--lengths: prompt of {length} tokens is longer than the cluster's limit of 4087 tokens: node decode-0 holds 4096 token slots (64 blocks of 64 tokens in group 0) and reserves 9 for lookahead"
            )),
            "{stderr}"
        );
        assert!(stdout.is_empty(), "nothing ran: {stdout}");
    }
    let spec = vec!["1..1000001"; 300].join(",");
    let (code, _, stderr) = pdkv(&["sweep", "--lengths", &spec]);
    assert_eq!(code, 1);
    assert!(
        stderr.contains("--lengths: the spec names more than 1000000 lengths in all"),
        "{stderr}"
    );
}

/// Logs written to a pipe or file carry no ANSI colour codes.
#[test]
fn logs_to_a_pipe_are_plain_text() {
    let output = Command::new(env!("CARGO_BIN_EXE_pdkv"))
        .args(["sweep", "--in-process", "--lengths", "5"])
        .env("RUST_LOG", "pdkv_actors=debug")
        .output()
        .expect("pdkv runs");
    assert_eq!(output.status.code(), Some(0));
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert!(stderr.contains("prefilled"), "debug logs reach stderr: {stderr}");
    assert!(!stderr.contains('\u{1b}'), "colour codes in {stderr:?}");
}

/// One leg's split: tensor-parallel size and DCP size.
type Split = (u32, u32);

/// The shipped cluster.toml with `heads` query and `kv_heads` KV heads, the prefill leg split as
/// `prefill` (tp, dcp) and the decode leg as `decode`, written to a file of its own.
fn sharded_config(
    heads: u32,
    kv_heads: u32,
    prefill: Split,
    decode: Split,
    engine: &str,
) -> std::path::PathBuf {
    let shipped = include_str!("../cluster.toml");
    let split = |(tp, dcp): Split| format!("tp = {tp}\ndcp = {dcp}\n");
    let text = shipped
        .replacen(
            "vocab = 256\n",
            &format!("vocab = 256\nheads = {heads}\nkv_heads = {kv_heads}\n"),
            1,
        )
        .replacen(
            "role = \"prefill\"\n",
            &format!("role = \"prefill\"\n{}", split(prefill)),
            1,
        )
        .replacen(
            "role = \"decode\"\n",
            &format!("role = \"decode\"\n{}", split(decode)),
            1,
        )
        .replacen("read_engine = \"shm\"", &format!("read_engine = \"{engine}\""), 1);
    assert_eq!(text.matches("dcp = ").count(), 2, "one leg of each role");
    let path = std::env::temp_dir().join(format!(
        "pdkv-sweep-{}-h{heads}-kv{kv_heads}-p{}x{}-d{}x{}-{engine}.toml",
        std::process::id(),
        prefill.0,
        prefill.1,
        decode.0,
        decode.1
    ));
    std::fs::write(&path, text).unwrap();
    path
}

/// Lengths around the block (64) and window (128) edges of the shipped layout.
const EDGE_LENGTHS: &str = "1,2,63,64,65,127,128,129,130,191,192,193,255,256,257,377,440,511,640";

/// Legs split differently over tensor-parallel and DCP ranks (`[[nodes]] tp`, `dcp`) over a
/// model with KV heads: P/D equals direct at every length for GQA TP 1→2, 2→1, 4→2, MLA-like
/// replicated KV (one KV head) 1→4, 4→2, 2→1, and DCP 1→2 and 2→1 (MLA-like and GQA, alone and
/// beside TP); the decode leg reads each head of each head group, each token once: its bytes
/// are those of an unsharded read times (head groups × heads per group) / KV heads.
#[test]
fn legs_of_different_tensor_parallel_and_dcp_sizes_match_direct() {
    let read_bytes = |config: &std::path::Path, links: &str| -> Vec<u64> {
        let path = config.to_str().unwrap();
        let (code, stdout, stderr) = pdkv(&[
            "sweep",
            "--config",
            path,
            "--in-process",
            "--links",
            links,
            "--lengths",
            EDGE_LENGTHS,
            "--json",
        ]);
        assert_eq!(code, 0, "{path}: {stdout}\n{stderr}");
        let lines: Vec<Value> = stdout
            .lines()
            .map(|line| serde_json::from_str(line).unwrap())
            .collect();
        let summary = &lines.last().unwrap()["summary"];
        assert_eq!(summary["matched"], summary["lengths"], "{path}: {stdout}");
        assert_eq!(summary["legs_idle"], true, "{path}: {stdout}");
        lines[..lines.len() - 1]
            .iter()
            .map(|line| line["read_bytes"].as_u64().unwrap())
            .collect()
    };
    for (heads, kv_heads, prefill, decode, links) in [
        (4, 2, (1, 1), (2, 1), "local"),
        (4, 2, (2, 1), (1, 1), "quic"),
        (8, 4, (4, 1), (2, 1), "local"),
        (4, 1, (1, 1), (4, 1), "local"),
        (4, 1, (4, 1), (2, 1), "quic"),
        (4, 1, (2, 1), (1, 1), "local"),
        (4, 1, (1, 1), (2, 2), "local"),
        (4, 1, (2, 2), (1, 1), "quic"),
        (4, 2, (2, 1), (4, 2), "local"),
        (4, 2, (4, 2), (2, 1), "local"),
    ] {
        let unsharded = sharded_config(heads, kv_heads, (1, 1), (1, 1), "shm");
        let config = sharded_config(heads, kv_heads, prefill, decode, "shm");
        let base = read_bytes(&unsharded, "local");
        let read = read_bytes(&config, links);
        let groups = decode.0 / decode.1;
        let held = groups * (kv_heads / groups).max(1);
        let expected: Vec<u64> = base
            .iter()
            .map(|bytes| bytes * u64::from(held) / u64::from(kv_heads))
            .collect();
        assert_eq!(
            read, expected,
            "{heads}/{kv_heads} heads, {prefill:?} -> {decode:?}"
        );
        for path in [unsharded, config] {
            std::fs::remove_file(path).unwrap();
        }
    }
}

/// The same as processes, reading over the network engine, whose memory server checks every
/// range against the grant through the rank-major placement.
#[test]
fn processes_of_different_splits_match_direct_over_the_network() {
    let config = sharded_config(8, 2, (4, 2), (1, 1), "net");
    let path = config.to_str().unwrap();
    let (code, stdout, stderr) = pdkv(&["sweep", "--config", path, "--lengths", EDGE_LENGTHS]);
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    assert!(
        stdout.contains("19/19 match (anchored pairing, processes over QUIC"),
        "{stdout}"
    );
    assert!(!stdout.contains("LEAK"), "{stdout}");
    std::fs::remove_file(config).unwrap();
}

/// A reader that leaves early (`pdkv sweep --json | head -1`) stops the sweep: no panic, the
/// cluster shut down as usual, and a failing exit status (not every length was compared).
#[test]
fn a_reader_that_leaves_early_stops_the_sweep_without_a_panic() {
    use std::io::{BufRead, BufReader};
    let mut child = Command::new(env!("CARGO_BIN_EXE_pdkv"))
        .args(["sweep", "--in-process", "--lengths", "1..400", "--json"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("pdkv runs");
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    let line: Value = serde_json::from_str(&first).unwrap();
    assert_eq!(line["prompt_tokens"], 1, "{first}");
    // The reader is dropped here: the pipe closes.
    let output = child.wait_with_output().unwrap();
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}
