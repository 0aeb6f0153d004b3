//! Clusters of real processes: `pdkv launch`, `pdkv node`, `pdkv router` and the router's HTTP
//! API, on loopback. (Across network namespaces: `tests/netns.rs`.)

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::Child;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

mod support;

use support::{
    Launched, agent, certs_init, cluster_toml, fixed_ports_cluster, fixed_ports_toml, free_ports, get, pdkv,
    process_alive, sample, sweep_running, temp_dir,
};

/// POSTs `body` to the completions endpoint: (status, X-Request-Id, body text).
fn post(base: &str, body: &str, request_id: Option<&str>) -> (u16, Option<String>, String) {
    let mut request = agent()
        .post(format!("{base}/v1/completions"))
        .header("content-type", "application/json");
    if let Some(id) = request_id {
        request = request.header("x-request-id", id);
    }
    let mut response = request.send(body).unwrap();
    let id = response
        .headers()
        .get("x-request-id")
        .map(|value| value.to_str().unwrap().to_string());
    let status = response.status().as_u16();
    (status, id, response.body_mut().read_to_string().unwrap())
}

/// POSTs `body` on a raw connection, ignoring a server that stops reading early (it may answer
/// an oversized body before taking all of it): (status, raw response).
fn post_raw(base: &str, body: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let address = base.trim_start_matches("http://");
    let mut stream = std::net::TcpStream::connect(address).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let _ = stream.write_all(head.as_bytes());
    let _ = stream.write_all(body.as_bytes());
    let mut response = Vec::new();
    let _ = stream.read_to_end(&mut response);
    let text = String::from_utf8_lossy(&response).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or(0);
    (status, text)
}

/// The router's HTTP API on a launched 1P1D cluster: streamed and plain answers are equal,
/// `X-Request-Id` is echoed, bad bodies get a 4xx naming the field, probes and metrics answer;
/// Ctrl-C on the launcher stops every process it started.
#[test]
fn http_api_answers_like_openai_and_ctrl_c_leaves_no_process() {
    let dir = temp_dir("http");
    let config = dir.join("cluster.toml");
    std::fs::write(&config, cluster_toml(1, 1)).unwrap();
    let launched = Launched::start(&config, &dir.join("run"));
    let base = launched.router.clone();
    assert_eq!(launched.members.len(), 3, "two legs and the router");

    let prompt = "The quick brown fox jumps over the lazy dog, again and again.";
    let body = json!({"model": "pdkv-reference", "prompt": prompt, "max_tokens": 5}).to_string();
    let (status, id, text) = post(&base, &body, Some("req-42"));
    assert_eq!(status, 200, "{text}");
    assert_eq!(id.as_deref(), Some("req-42"));
    let plain: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(plain["id"], "cmpl-req-42");
    assert_eq!(plain["object"], "text_completion");
    assert_eq!(plain["usage"]["prompt_tokens"], prompt.len());
    assert_eq!(plain["usage"]["completion_tokens"], 5);
    assert_eq!(plain["usage"]["total_tokens"], prompt.len() + 5);
    let tokens = plain["choices"][0]["token_ids"].as_array().unwrap().clone();
    assert_eq!(tokens.len(), 5);
    assert!(
        plain["pdkv"]["read_bytes"].as_u64().unwrap() > 0,
        "the decode leg read KV"
    );

    // The same prompt as token ids, streamed: the same tokens, chunk by chunk, then [DONE].
    let ids: Vec<u32> = prompt.bytes().map(u32::from).collect();
    let body =
        json!({"prompt": ids, "max_tokens": 5, "stream": true, "stream_options": {"include_usage": true}})
            .to_string();
    let (status, id, text) = post(&base, &body, None);
    assert_eq!(status, 200, "{text}");
    assert!(
        id.is_some_and(|id| !id.is_empty()),
        "a request id is made up when none is sent"
    );
    let events: Vec<&str> = text
        .split("\n\n")
        .filter(|event| !event.is_empty())
        .map(|event| event.strip_prefix("data: ").expect("SSE data lines"))
        .collect();
    assert_eq!(events.last(), Some(&"[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|event| serde_json::from_str(event).unwrap())
        .collect();
    let streamed: Vec<Value> = chunks
        .iter()
        .flat_map(|chunk| chunk["choices"].as_array().unwrap().clone())
        .flat_map(|choice| choice["token_ids"].as_array().unwrap().clone())
        .collect();
    assert_eq!(streamed, tokens, "streamed and plain answers are equal");
    // The usage chunk (no choices) comes last, after the one that finishes with pdkv's figures.
    let (usage, rest) = chunks.split_last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 5);
    let finished = rest.last().unwrap();
    assert_eq!(finished["choices"][0]["finish_reason"], "length");
    assert_eq!(finished["pdkv"]["logits_digest"], plain["pdkv"]["logits_digest"]);

    // A long streamed answer arrives token by token, not all at the end: the first token comes
    // long before the last (the decode leg sends each as it is generated).
    let body = json!({"prompt": "stream me", "max_tokens": 1500, "stream": true}).to_string();
    let started = Instant::now();
    let response = agent()
        .post(format!("{base}/v1/completions"))
        .header("content-type", "application/json")
        .send(body.as_str())
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);
    let (mut first, mut tokens, mut done) = (None, 0usize, None);
    for line in BufReader::new(response.into_body().into_reader()).lines() {
        let line = line.unwrap();
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            done = Some(started.elapsed());
            break;
        }
        let chunk: Value = serde_json::from_str(data).unwrap();
        let count = chunk["choices"][0]["token_ids"].as_array().map_or(0, Vec::len);
        if count > 0 && first.is_none() {
            first = Some(started.elapsed());
        }
        tokens += count;
    }
    let (first, done) = (first.unwrap(), done.unwrap());
    assert_eq!(tokens, 1500);
    assert!(
        first * 3 < done,
        "first token at {first:?}, the end at {done:?}: not streamed"
    );

    // Bad bodies: 4xx, JSON error naming the field, the request id still echoed.
    for (body, status, param) in [
        (r#"{"prompt": [1, 999]}"#, 400, "prompt[1]"),
        (r#"{"prompt": "x", "max_tokens": "many"}"#, 400, "max_tokens"),
        (r#"{"prompt": ""}"#, 400, "prompt"),
        (r#"{"max_tokens": 3}"#, 400, "prompt"),
        (r#"{"prompt": "x", "model": "other"}"#, 404, "model"),
        ("{not json", 400, "body"),
    ] {
        let (got, id, text) = post(&base, body, Some("bad-1"));
        assert_eq!(got, status, "{body}: {text}");
        assert_eq!(id.as_deref(), Some("bad-1"));
        let error: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(error["error"]["param"], param, "{body}: {text}");
    }
    let huge = format!(r#"{{"prompt": "{}"}}"#, "a".repeat(2 << 20));
    let (got, text) = post_raw(&base, &huge);
    assert_eq!(got, 413, "{text}");
    assert!(text.contains(r#""param":"body""#), "{text}");
    let too_long = json!({"prompt": vec![1; 5000]}).to_string();
    let (got, _, text) = post(&base, &too_long, None);
    assert_eq!(got, 400, "{text}");
    assert!(text.contains("longer than the cluster's limit"), "{text}");
    let (got, _, _) = post(
        &base,
        r#"{"prompt": "x", "stream": true, "max_tokens": 0}"#,
        Some("bad id"),
    );
    assert_eq!(got, 400, "a request id with a space is refused");

    // Probes and metrics.
    let (status, text) = get(&format!("{base}/v1/models"));
    assert_eq!(status, 200);
    assert!(text.contains("pdkv-reference"));
    assert_eq!(get(&format!("{base}/live")).0, 200);
    let (status, text) = get(&format!("{base}/ready"));
    assert_eq!(status, 200, "{text}");
    let ready: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(ready["peers"]["prefill-0"]["linked"], true);
    assert_eq!(ready["peers"]["decode-0"]["linked"], true);
    let (_, metrics) = get(&format!("{base}/metrics"));
    assert_eq!(
        sample(&metrics, r#"pdkv_requests_total{outcome="ok"}"#),
        Some(3.0),
        "{metrics}"
    );
    assert!(
        sample(&metrics, r#"pdkv_requests_total{outcome="bad_request"}"#).unwrap() >= 8.0,
        "{metrics}"
    );
    assert!(
        metrics.contains("pdkv_request_seconds_bucket{stage=\"prefill\",outcome=\"ok\",le=\"0.001\"}"),
        "{metrics}"
    );
    let (_, leg) = get(&format!("{}/metrics", launched.admin("decode-0")));
    assert_eq!(sample(&leg, "pdkv_kv_transfer_seconds_count"), Some(3.0), "{leg}");
    assert!(
        leg.contains("pdkv_kv_transfer_bytes_bucket{le=\"65536\"}"),
        "{leg}"
    );
    assert_eq!(
        sample(&leg, r#"pdkv_peer_up{peer="prefill-0"}"#),
        Some(1.0),
        "{leg}"
    );
    assert_eq!(
        sample(&leg, r#"pdkv_blocks_free{group="0"}"#),
        Some(64.0),
        "{leg}"
    );

    // `pdkv load` against the running router: every request answered, a plot drawn.
    let plot = dir.join("load.svg");
    let output = pdkv()
        .args([
            "load",
            "--router",
            &base,
            "--concurrency",
            "2",
            "--duration",
            "1",
            "--lengths",
            "8..200",
            "--json",
        ])
        .arg("--plot")
        .arg(&plot)
        .output()
        .unwrap();
    assert_eq!(
        output.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let report: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert!(report["requests"].as_u64().unwrap() > 0, "{report}");
    assert_eq!(report["errors"], 0, "{report}");
    assert!(report["ttft_ms"]["p50"].as_f64().unwrap() > 0.0, "{report}");
    assert!(report["kv_read_gb_per_s"].as_f64().unwrap() > 0.0, "{report}");
    assert!(std::fs::read_to_string(&plot).unwrap().starts_with("<svg"));

    // A sampled workload over a shared prefix is served as well; a bad temperature is refused
    // before any request is sent.
    let sampled = pdkv()
        .args(["load", "--router", &base, "--concurrency", "2", "--duration", "1"])
        .args([
            "--lengths",
            "8..64",
            "--shared-prefix",
            "16",
            "--temperature",
            "0.8",
        ])
        .args(["--top-p", "0.9", "--json"])
        .output()
        .unwrap();
    assert_eq!(
        sampled.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&sampled.stderr)
    );
    let report: Value = serde_json::from_slice(&sampled.stdout).unwrap();
    assert!(report["requests"].as_u64().unwrap() > 0, "{report}");
    assert_eq!(report["errors"], 0, "{report}");
    let refused = pdkv()
        .args(["load", "--router", &base, "--duration", "1", "--temperature=-1"])
        .output()
        .unwrap();
    assert_eq!(refused.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("--temperature"), "{stderr}");

    // Ctrl-C: every process the launcher started is gone afterwards.
    let pids: Vec<u32> = launched.members.iter().map(|member| member.1).collect();
    assert!(pids.iter().all(|&pid| process_alive(pid)));
    let run_dir = launched.run_dir.clone();
    assert_eq!(launched.interrupt(), 0);
    for pid in pids {
        assert!(!process_alive(pid), "process {pid} outlived the launcher");
    }
    // Every node drained and exited 0 (its log says so, and no panic).
    for name in ["prefill-0", "decode-0", "router"] {
        let log = std::fs::read_to_string(run_dir.join(format!("{name}.log"))).unwrap();
        assert!(log.contains("READY node="), "{name}: {log}");
        assert!(!log.contains("panicked"), "{name}: {log}");
    }
    std::fs::remove_dir_all(dir).ok();
}

/// 2P2D on loopback: every length matches direct, the router spreads requests over all four
/// legs, and every leg's blocks are back to capacity afterwards (read from `/metrics`). The
/// nodes keep QUIC on their transport runtimes and the router's API has threads of its own (the
/// other tests run the defaults: both on the node's own thread).
#[test]
fn two_prefill_two_decode_spreads_requests_and_leaks_nothing() {
    let dir = temp_dir("2p2d");
    let config = dir.join("cluster.toml");
    let text = cluster_toml(2, 2).replacen("[transport]", "[transport]\ncontrol_thread = \"transport\"", 1)
        + "[router]\nhttp_threads = 2\n";
    assert!(text.contains("control_thread"));
    std::fs::write(&config, text).unwrap();
    let launched = Launched::start(&config, &dir.join("run"));
    let legs: Vec<String> = ["prefill-0", "prefill-1", "decode-0", "decode-1"]
        .iter()
        .map(|name| format!("{name}={}", launched.admin(name)))
        .collect();
    let summary = sweep_running(
        &config,
        &launched.router,
        &legs,
        "1..=40,63..=66,127..=130,500,1000",
    );
    assert_eq!(summary["summary"]["matched"], 50, "{summary}");
    assert_eq!(summary["summary"]["legs_idle"], true);
    let mut served_by_role = [0.0; 2];
    for name in ["prefill-0", "prefill-1", "decode-0", "decode-1"] {
        let (_, metrics) = get(&format!("{}/metrics", launched.admin(name)));
        let stage = if name.starts_with("prefill") {
            "prefill"
        } else {
            "decode"
        };
        let served =
            sample(&metrics, &format!("pdkv_leg_requests_total{{stage=\"{stage}\"}}")).unwrap_or(0.0);
        // 50 requests, one at a time, over two legs of each role: equally loaded legs are taken
        // in turn, and load reports (taken mid-request, up to 100 ms old) tip some choices, so
        // each leg serves a share, not exactly half.
        assert!(served >= 5.0, "{name} served {served}: {metrics}");
        served_by_role[usize::from(stage == "decode")] += served;
        for group in 0..2 {
            assert_eq!(
                sample(&metrics, &format!("pdkv_blocks_free{{group=\"{group}\"}}")),
                Some(64.0),
                "{name}"
            );
        }
        assert_eq!(sample(&metrics, "pdkv_grants_active"), Some(0.0), "{name}");
    }
    assert_eq!(
        served_by_role,
        [50.0, 50.0],
        "every request ran on one leg of each role"
    );
    assert_eq!(launched.interrupt(), 0);
    std::fs::remove_dir_all(dir).ok();
}

/// A node whose certificate comes from another CA is refused at every handshake: the launcher's
/// readiness gate fails in time, naming a node, the reason and its log file.
#[test]
fn a_node_from_another_ca_is_refused_and_the_gate_names_it() {
    let dir = temp_dir("wrong-ca");
    let certs = dir.join("certs");
    let other = dir.join("other");
    let config = dir.join("cluster.toml");
    std::fs::write(
        &config,
        format!("{}\n[tls]\ndir = \"{}\"\n", cluster_toml(1, 1), certs.display()),
    )
    .unwrap();
    for out in [&certs, &other] {
        certs_init(&config, out);
    }
    for file in ["decode-0.pem", "decode-0.key"] {
        std::fs::copy(other.join(file), certs.join(file)).unwrap();
    }
    let started = Instant::now();
    let output = pdkv()
        .args(["launch", "--ready-timeout", "4", "--config"])
        .arg(&config)
        .arg("--run-dir")
        .arg(dir.join("run"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "bounded by the readiness timeout"
    );
    assert!(stderr.contains("not ready after 4.0 s"), "{stderr}");
    assert!(stderr.contains("decode-0"), "the refused node is named: {stderr}");
    assert!(stderr.contains(".log"), "its log file is named: {stderr}");
    // The router's log says why it could not link decode-0.
    let log = std::fs::read_to_string(dir.join("run").join("router.log")).unwrap();
    assert!(log.contains("decode-0") && log.contains("dial failed"), "{log}");
    std::fs::remove_dir_all(dir).ok();
}

/// A prefill leg started from a file that splits a mamba model over another TP size than the
/// decode leg's: the model is the same (the router admits both), but the decode leg refuses the
/// prefill leg's hello because a state cannot be resharded, and says why on its `/ready`.
#[test]
fn a_decode_leg_refuses_a_prefill_leg_whose_split_it_cannot_reshard() {
    let dir = temp_dir("split");
    let ports = free_ports(8);
    let text = fixed_ports_cluster(&dir, &ports)
        .replacen(
            "kind = \"sliding_window\"\nblock_size = 64\nwindow = 128",
            "kind = \"mamba\"",
            1,
        )
        .replacen("vocab = 256\n", "vocab = 256\nheads = 2\n", 1);
    assert!(
        text.contains("heads = 2"),
        "the shipped model has a vocabulary of 256"
    );
    assert!(
        text.contains("kind = \"mamba\""),
        "the shipped layout has a window group"
    );
    let good = dir.join("cluster.toml");
    std::fs::write(&good, &text).unwrap();
    let bad = dir.join("other-split.toml");
    // A file valid on its own: both legs at TP 2.
    let split = text
        .replacen("role = \"prefill\"\n", "role = \"prefill\"\ntp = 2\n", 1)
        .replacen("role = \"decode\"\n", "role = \"decode\"\ntp = 2\n", 1);
    std::fs::write(&bad, split).unwrap();
    certs_init(&good, &dir.join("certs"));
    let children = Children(vec![
        spawn_logged(&["router"], &good, &dir.join("router.log")),
        spawn_logged(&["node", "--node", "decode-0"], &good, &dir.join("decode.log")),
        spawn_logged(&["node", "--node", "prefill-0"], &bad, &dir.join("prefill.log")),
    ]);
    let ready_url = format!("http://127.0.0.1:{}/ready", ports[5]);
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut last = Value::Null;
    let reason = loop {
        assert!(
            Instant::now() < deadline,
            "decode-0 never reported prefill-0's refusal: {last}"
        );
        if let Ok(mut response) = agent().get(&ready_url).call() {
            let ready: Value = response.body_mut().read_json().unwrap();
            last = ready.clone();
            let peer = &ready["peers"]["prefill-0"];
            // Earlier errors may be dials before prefill-0 listened.
            if let Some(error) = peer["last_error"].as_str()
                && error.contains("recurrent")
            {
                assert_eq!(peer["linked"], false, "{ready}");
                break error.to_string();
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        reason.contains(
            "group 1 is a recurrent state: a prefill leg of tp 2 dcp 1 and a decode leg of tp 1 dcp 1"
        ),
        "{reason}"
    );
    let codes = children.terminate();
    assert_eq!(
        codes,
        [Some(0); 3],
        "router, decode-0, prefill-0: SIGTERM drains and exits 0"
    );
    std::fs::remove_dir_all(dir).ok();
}

/// Starts `pdkv <args> --config config`, its output (info logs) in `log`.
fn spawn_logged(args: &[&str], config: &Path, log: &Path) -> Child {
    let log = std::fs::File::create(log).unwrap();
    pdkv()
        .args(args)
        .arg("--config")
        .arg(config)
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .env("RUST_LOG", "info")
        .spawn()
        .unwrap()
}

/// Processes a test started: killed if the test ends (or fails) before [`Children::terminate`].
struct Children(Vec<Child>);

impl Children {
    /// Sends SIGTERM to every child, then waits for each: their exit codes.
    fn terminate(mut self) -> Vec<Option<i32>> {
        for child in &mut self.0 {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(child.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
        }
        std::mem::take(&mut self.0)
            .into_iter()
            .map(|mut child| child.wait().unwrap().code())
            .collect()
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A prefill leg started with another KV layout is refused at handshake: the router's `/ready`
/// stays 503 and names the leg and the reason.
#[test]
fn a_leg_with_another_layout_shows_in_the_routers_ready() {
    let dir = temp_dir("wrong-layout");
    let ports = free_ports(8);
    let text = fixed_ports_cluster(&dir, &ports);
    let good = dir.join("cluster.toml");
    std::fs::write(&good, &text).unwrap();
    // Same nodes and ports, another window: another layout.
    let bad = dir.join("other-layout.toml");
    std::fs::write(&bad, text.replace("window = 128", "window = 192")).unwrap();
    certs_init(&good, &dir.join("certs"));
    let children = Children(vec![
        spawn_logged(&["router"], &good, &dir.join("router.log")),
        spawn_logged(&["node", "--node", "decode-0"], &good, &dir.join("decode.log")),
        spawn_logged(&["node", "--node", "prefill-0"], &bad, &dir.join("prefill.log")),
    ]);
    let ready_url = format!("http://127.0.0.1:{}/ready", ports[7]);
    let deadline = Instant::now() + Duration::from_secs(30);
    let reason = loop {
        assert!(
            Instant::now() < deadline,
            "the router never reported prefill-0's refusal"
        );
        if let Ok(mut response) = agent().get(&ready_url).call() {
            let status = response.status().as_u16();
            let ready: Value = response.body_mut().read_json().unwrap();
            let peer = &ready["peers"]["prefill-0"];
            // A dial that found prefill-0 not yet listening (a timeout) is an error of its own;
            // the next dial meets the node and its refusal.
            let refused = peer["last_error"]
                .as_str()
                .is_some_and(|error| error.contains("model differs"));
            if ready["peers"]["decode-0"]["linked"] == true && refused {
                assert_eq!(status, 503, "{ready}");
                assert_eq!(ready["ready"], false);
                assert_eq!(peer["linked"], false);
                break peer["last_error"].as_str().unwrap().to_string();
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    // The refusal names the field that differs with both nodes' values, not two hashes.
    assert!(
        reason.contains("model differs between router and prefill-0: kv_groups: router ")
            && reason.contains("sliding_window(128)")
            && reason.contains("prefill-0 full block 64 dcp 1, sliding_window(192)"),
        "{reason}"
    );
    for code in children.terminate() {
        assert_eq!(code, Some(0), "SIGTERM drains and exits 0");
    }
    let log = std::fs::read_to_string(dir.join("router.log")).unwrap();
    // Whichever side dialled first, the router logs the refusal with the field named: as the
    // refusing server or as the refused dialler.
    assert!(
        (log.contains("refusing control peer") || log.contains("dial failed peer=prefill-0"))
            && log.contains("model differs between router and prefill-0"),
        "{log}"
    );
    std::fs::remove_dir_all(dir).ok();
}

/// A node that cannot bind its control port says so and exits 1: no panic (dropping its
/// transport runtime inside the actor system used to panic and hide the cause).
#[test]
fn a_node_whose_port_is_taken_exits_with_the_reason() {
    let dir = temp_dir("port-taken");
    let taken = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let ports = free_ports(7);
    let text = fixed_ports_toml(
        &dir,
        [port, ports[0], ports[1]],
        [ports[4], ports[5], ports[6]],
        [ports[2], ports[3]],
    );
    let config = dir.join("cluster.toml");
    std::fs::write(&config, &text).unwrap();
    certs_init(&config, &dir.join("certs"));
    let output = pdkv()
        .args(["node", "--node", "prefill-0", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(
        stderr.contains("control server") && stderr.contains(&port.to_string()),
        "the error names the control server and its port: {stderr}"
    );
    drop(taken);
    std::fs::remove_dir_all(dir).ok();
}

/// A taken admin port (a node) or HTTP port (the router): exit 1 naming the server and the
/// address, never a panic.
#[test]
fn a_taken_http_or_admin_port_exits_1_naming_the_address() {
    let dir = temp_dir("http-port-taken");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let ports = free_ports(7);
    for (command, ports, server) in [
        (
            vec!["node", "--node", "prefill-0"],
            (
                [ports[0], ports[1], port],
                [ports[2], ports[3], ports[4]],
                [ports[5], ports[6]],
            ),
            "admin HTTP server",
        ),
        (
            vec!["router"],
            (
                [ports[0], ports[1], ports[2]],
                [ports[3], ports[4], ports[5]],
                [ports[6], port],
            ),
            "router HTTP server",
        ),
    ] {
        let text = fixed_ports_toml(&dir, ports.0, ports.1, ports.2);
        let config = dir.join("cluster.toml");
        std::fs::write(&config, &text).unwrap();
        if !dir.join("certs").exists() {
            certs_init(&config, &dir.join("certs"));
        }
        let output = pdkv()
            .args(&command)
            .arg("--config")
            .arg(&config)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{command:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{command:?}: {stderr}");
        assert!(
            stderr.contains(server)
                && stderr.contains(&format!("127.0.0.1:{port}"))
                && stderr.contains("in use"),
            "{command:?}: the error names the server, its address and the reason: {stderr}"
        );
    }
    drop(taken);
    std::fs::remove_dir_all(dir).ok();
}

/// An IPv6 cluster (every node and the router on ::1) serves end to end; one that mixes IPv4 and
/// IPv6 hosts is refused at load, naming both keys.
#[test]
fn an_ipv6_cluster_serves_and_a_mixed_one_is_refused_at_load() {
    let dir = temp_dir("ipv6");
    let mixed = format!("{}\n[router]\nhost = \"::1\"\n", cluster_toml(1, 1));
    let config = dir.join("mixed.toml");
    std::fs::write(&config, &mixed).unwrap();
    let output = pdkv()
        .args(["launch", "--config"])
        .arg(&config)
        .arg("--run-dir")
        .arg(dir.join("mixed-run"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("router.host: ::1 is IPv6 but nodes[0].host is 127.0.0.1"),
        "{stderr}"
    );
    if std::net::TcpListener::bind("[::1]:0").is_err() {
        eprintln!("SKIPPED the IPv6 cluster: this host has no IPv6 loopback (::1)");
        return;
    }
    let six = cluster_toml(1, 1).replace(
        "blocks_per_group = 64\n",
        "blocks_per_group = 64\nhost = \"::1\"\n",
    ) + "\n[router]\nhost = \"::1\"\n";
    let config = dir.join("six.toml");
    std::fs::write(&config, &six).unwrap();
    let launched = Launched::start(&config, &dir.join("six-run"));
    assert!(
        launched.router.starts_with("http://[::1]:"),
        "{}",
        launched.router
    );
    let (status, _, text) = post(
        &launched.router,
        r#"{"prompt": "over IPv6", "max_tokens": 4}"#,
        None,
    );
    assert_eq!(status, 200, "{text}");
    let answer: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(answer["usage"]["completion_tokens"], 4);
    assert!(answer["pdkv"]["read_bytes"].as_u64().unwrap() > 0);
    assert_eq!(launched.interrupt(), 0);
    std::fs::remove_dir_all(dir).ok();
}

/// `pdkv load` against a router nobody listens on: exit 1 saying it is unreachable, after a
/// handful of attempts spaced by a growing pause (not thousands in a tight loop).
#[test]
fn load_against_an_unreachable_router_backs_off_and_says_so() {
    let port = free_ports(1)[0];
    let output = pdkv()
        .args([
            "load",
            "--router",
            &format!("http://127.0.0.1:{port}"),
            "--concurrency",
            "2",
            "--duration",
            "1",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("is unreachable"), "{stderr}");
    // Two clients, 1 s: pauses of 50, 100, 200, 400 ms allow about five attempts each.
    let attempts: u64 = stderr
        .rsplit_once('(')
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .and_then(|count| count.parse().ok())
        .unwrap_or_else(|| panic!("no attempt count: {stderr}"));
    assert!((2..=20).contains(&attempts), "{attempts} attempts: {stderr}");
}
