//! The router's front door as strangers and real OpenAI clients meet it, against `pdkv launch`
//! of the shipped 1P1D cluster: idle and slow connections cannot lock clients out under a 1024
//! open-files limit; a request that cannot fit is refused before any leg works; streams carry
//! only chunks with choices and whole characters; errors are JSON; every metric is described.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

mod support;

use support::{Launched, agent, cluster_toml, get, launch_command, sample, temp_dir};

/// The open-files limit the cluster runs under in the lock-out test.
const FILE_LIMIT: u64 = 1024;

/// Idle connections a stranger opens: more than the limit allows.
const IDLE_CONNECTIONS: usize = 1100;

/// How long a real client may wait while strangers hold connections.
const SERVED_WITHIN: Duration = Duration::from_secs(2);

/// A cluster whose HTTP servers time out headers after 4 s and bodies after 3 s.
fn bounded_cluster(dir: &Path) -> std::path::PathBuf {
    let config = dir.join("cluster.toml");
    let text = format!(
        "{}\n[http]\nheader_timeout_ms = 4000\nbody_timeout_ms = 3000\n",
        cluster_toml(1, 1)
    );
    std::fs::write(&config, text).unwrap();
    config
}

/// A completion of 2 tokens on a new connection, answered 200 within [`SERVED_WITHIN`].
fn served(base: &str, what: &str) {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(SERVED_WITHIN))
        .build()
        .into();
    let started = Instant::now();
    let response = agent
        .post(format!("{base}/v1/completions"))
        .header("content-type", "application/json")
        .send(r#"{"prompt": "ping", "max_tokens": 2}"#);
    let elapsed = started.elapsed();
    match response {
        Ok(response) => assert_eq!(response.status().as_u16(), 200, "{what}"),
        Err(error) => panic!("{what}: a real client was not served within {SERVED_WITHIN:?}: {error}"),
    }
    assert!(elapsed < SERVED_WITHIN, "{what}: served in {elapsed:?}");
    let started = Instant::now();
    let live = agent.get(format!("{base}/live")).call();
    assert!(
        live.is_ok_and(|response| response.status().as_u16() == 200) && started.elapsed() < SERVED_WITHIN,
        "{what}: /live"
    );
}

/// Reads what the server sends until it closes (at most `bound`): the text, and whether it closed.
fn read_until_closed(stream: &mut TcpStream, bound: Duration) -> (String, bool) {
    stream.set_read_timeout(Some(bound)).unwrap();
    let mut bytes = Vec::new();
    let closed = loop {
        let mut buffer = [0u8; 4096];
        match stream.read(&mut buffer) {
            Ok(0) => break true,
            Ok(read) => bytes.extend_from_slice(&buffer[..read]),
            Err(error) if error.kind() == std::io::ErrorKind::ConnectionReset => break true,
            Err(_) => break false,
        }
    };
    (String::from_utf8_lossy(&bytes).into_owned(), closed)
}

#[test]
fn idle_and_slow_clients_cannot_lock_real_clients_out_under_a_1024_file_limit() {
    // This process holds the idle connections: it needs more files than the cluster gets.
    rlimit::increase_nofile_limit(u64::MAX).unwrap();
    let dir = temp_dir("front-door-lockout");
    let config = bounded_cluster(&dir);
    let mut command = launch_command(&config, &dir.join("run"), &[]);
    // SAFETY: setrlimit is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        command.pre_exec(|| rlimit::setrlimit(rlimit::Resource::NOFILE, FILE_LIMIT, FILE_LIMIT));
    }
    let launched = Launched::start_command(command, &dir.join("run"), Duration::from_secs(60));
    let base = launched.router.clone();
    let address = base.trim_start_matches("http://").to_string();
    served(&base, "before any stranger");

    // 1100 idle connections, more than the router's file limit allows.
    let idle: Vec<TcpStream> = (0..IDLE_CONNECTIONS)
        .map(|_| TcpStream::connect(&address).unwrap())
        .collect();
    for round in 0..3 {
        served(
            &base,
            &format!("with {IDLE_CONNECTIONS} idle connections open, round {round}"),
        );
    }
    let (_, metrics) = get(&format!("{base}/metrics"));
    let evicted = sample(
        &metrics,
        r#"pdkv_http_connections_evicted_total{server="router"}"#,
    )
    .unwrap();
    assert!(
        evicted >= (IDLE_CONNECTIONS - 1000) as f64,
        "idle connections made room: {metrics}"
    );
    assert_eq!(
        sample(
            &metrics,
            r#"pdkv_http_connections_refused_total{server="router"}"#
        ),
        Some(0.0),
        "no real client was refused"
    );
    // The idle ones still open are closed by the header bound (4 s), not held forever.
    let mut last = idle.into_iter().last().unwrap();
    let (_, closed) = read_until_closed(&mut last, Duration::from_secs(15));
    assert!(closed, "an idle connection outlived the header bound");

    // A header trickled a byte every 100 ms: cut off at the header bound, others served meanwhile.
    let mut slow = TcpStream::connect(&address).unwrap();
    slow.write_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
        .unwrap();
    let started = Instant::now();
    let trickle = std::thread::spawn(move || {
        for byte in b"x-slow: aaaa".iter().cycle().take(200) {
            if slow.write_all(&[*byte]).is_err() {
                return Some(started.elapsed());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        None
    });
    served(&base, "while a header trickles");
    let cut = trickle.join().unwrap();
    assert!(
        cut.is_some_and(|after| after < Duration::from_secs(10)),
        "the trickled header was cut at {cut:?}"
    );

    // A body that stops half way, by length and chunked: 408 at the body bound.
    for (head, part) in [
        ("content-length: 100\r\n", "{\"prompt\": \"x\""),
        ("transfer-encoding: chunked\r\n", "5\r\n{\"pro\r\n"),
    ] {
        let mut slow = TcpStream::connect(&address).unwrap();
        write!(
            slow,
            "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n{head}\r\n{part}"
        )
        .unwrap();
        let started = Instant::now();
        served(&base, &format!("while a body ({head:?}) stalls"));
        let (text, _) = read_until_closed(&mut slow, Duration::from_secs(15));
        assert!(text.starts_with("HTTP/1.1 408"), "{head:?}: {text}");
        assert!(text.contains("not received within 3000 ms"), "{head:?}: {text}");
        assert!(started.elapsed() < Duration::from_secs(10), "{head:?}");
    }
    assert_eq!(launched.interrupt(), 0);
    std::fs::remove_dir_all(dir).ok();
}

/// Every family of a `/metrics` page has `# HELP` and `# TYPE` (read with a Prometheus text
/// parser), and each of `present` has a sample.
fn check_metrics(page: &str, present: &[&str]) {
    let present: Vec<&str> = present.to_vec();
    let scrape = prometheus_parse::Scrape::parse(page.lines().map(|line| Ok(line.to_string())))
        .expect("a Prometheus text page");
    let typed: std::collections::HashSet<&str> = page
        .lines()
        .filter_map(|line| line.strip_prefix("# TYPE "))
        .filter_map(|rest| rest.split_whitespace().next())
        .collect();
    assert!(!scrape.samples.is_empty(), "{page}");
    for sample in &scrape.samples {
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|suffix| {
                sample
                    .metric
                    .strip_suffix(suffix)
                    .filter(|base| typed.contains(base))
            })
            .unwrap_or(&sample.metric);
        assert!(typed.contains(family), "{family} has no # TYPE: {page}");
        assert!(scrape.docs.contains_key(family), "{family} has no # HELP: {page}");
    }
    for key in present {
        assert!(sample(page, key).is_some(), "{key} is missing: {page}");
    }
}

/// The events of a streamed answer, `[DONE]` checked and dropped.
fn events(text: &str) -> Vec<Value> {
    let data: Vec<&str> = text
        .split("\n\n")
        .filter(|event| !event.is_empty())
        .map(|event| event.strip_prefix("data: ").expect("SSE data lines"))
        .collect();
    assert_eq!(data.last(), Some(&"[DONE]"), "{text}");
    data[..data.len() - 1]
        .iter()
        .map(|event| serde_json::from_str(event).unwrap())
        .collect()
}

fn post(base: &str, path: &str, body: &str) -> (u16, String) {
    let mut response = agent()
        .post(format!("{base}{path}"))
        .header("content-type", "application/json")
        .send(body)
        .unwrap();
    (
        response.status().as_u16(),
        response.body_mut().read_to_string().unwrap(),
    )
}

#[test]
fn the_api_answers_as_openai_clients_expect() {
    let dir = temp_dir("front-door-openai");
    let config = bounded_cluster(&dir);
    let launched = Launched::start(&config, &dir.join("run"));
    let base = launched.router.clone();
    let decode = launched.admin("decode-0").to_string();
    let prefill = launched.admin("prefill-0").to_string();

    // Metrics before any request: described, the documented counters at 0.
    let (_, router_page) = get(&format!("{base}/metrics"));
    check_metrics(
        &router_page,
        &[
            r#"pdkv_requests_total{outcome="ok"}"#,
            r#"pdkv_requests_total{outcome="bad_request"}"#,
            "pdkv_retries_total",
            "process_resident_memory_bytes",
            "process_open_fds",
            &format!(r#"pdkv_build_info{{version="{}"}}"#, env!("CARGO_PKG_VERSION")),
        ],
    );
    assert_eq!(sample(&router_page, "pdkv_retries_total"), Some(0.0));
    let (_, leg_page) = get(&format!("{decode}/metrics"));
    check_metrics(
        &leg_page,
        &[
            "pdkv_lease_expired_total",
            r#"pdkv_kv_transfer_failures_total{reason="read"}"#,
            r#"pdkv_leg_requests_total{stage="decode"}"#,
            "pdkv_generated_tokens_total",
        ],
    );
    assert_eq!(sample(&leg_page, "pdkv_lease_expired_total"), Some(0.0));

    // Prompt plus max_tokens past the decode leg's 64 x 64 - 9 = 4087 token slots: 400 naming
    // max_tokens, and no leg started anything.
    let prompt = vec![7u32; 100];
    let (status, text) = post(
        &base,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 3988}).to_string(),
    );
    assert_eq!(status, 400, "{text}");
    let error: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(error["error"]["param"], "max_tokens", "{text}");
    let message = error["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("4087") && message.contains("decode-0"),
        "{message}"
    );
    for leg in [&decode, &prefill] {
        let (_, page) = get(&format!("{leg}/metrics"));
        for stage in ["prefill", "decode"] {
            let key = format!(r#"pdkv_leg_requests_total{{stage="{stage}"}}"#);
            assert_eq!(sample(&page, &key), Some(0.0), "{leg} {stage}: {page}");
        }
    }
    // One token less fits; without max_tokens a request gets what fits.
    let (status, text) = post(
        &base,
        "/v1/completions",
        &json!({"prompt": vec![7u32; 4080]}).to_string(),
    );
    assert_eq!(status, 200, "{text}");
    let answer: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(answer["usage"]["completion_tokens"], 4087 - 4080, "{text}");

    // 200 prompts with multi-byte characters, every other one sampled with a stop string:
    // streamed text equals unstreamed text, and every chunk has a choice.
    let mut multi_byte_answers = 0;
    let mut stopped_answers = 0;
    for index in 0..200 {
        let prompt = format!("{index}: ünïcödé → 漢字 {}", "é".repeat(index % 7));
        let body = |stream: bool| {
            let mut body = json!({"prompt": prompt, "max_tokens": 16, "stream": stream});
            if index % 2 == 1 {
                body["temperature"] = json!(0.9);
                body["seed"] = json!(index);
                body["stop"] = json!(["e", "\u{7f}"]);
            }
            body.to_string()
        };
        let (status, whole) = post(&base, "/v1/completions", &body(false));
        assert_eq!(status, 200, "{whole}");
        let whole: Value = serde_json::from_str(&whole).unwrap();
        let (status, streamed) = post(&base, "/v1/completions", &body(true));
        assert_eq!(status, 200, "{streamed}");
        let chunks = events(&streamed);
        let mut text = String::new();
        for chunk in &chunks {
            let choices = chunk["choices"].as_array().unwrap();
            assert_eq!(choices.len(), 1, "a chunk without choices: {chunk}");
            text.push_str(choices[0]["text"].as_str().unwrap());
        }
        assert_eq!(text, whole["choices"][0]["text"].as_str().unwrap(), "{prompt:?}");
        let last = chunks.last().unwrap();
        let finish = whole["choices"][0]["finish_reason"].as_str().unwrap();
        assert_eq!(last["choices"][0]["finish_reason"], finish);
        assert_eq!(last["pdkv"]["logits_digest"], whole["pdkv"]["logits_digest"]);
        if finish == "stop" {
            stopped_answers += 1;
            assert!(
                !text.contains('e') && !text.contains('\u{7f}'),
                "the stop string is left out: {text:?}"
            );
            assert!(whole["usage"]["completion_tokens"].as_u64().unwrap() <= 16);
        }
        if text
            .chars()
            .any(|c| c.len_utf8() > 1 && c != char::REPLACEMENT_CHARACTER)
        {
            multi_byte_answers += 1;
        }
    }
    assert!(multi_byte_answers > 0, "no answer held a multi-byte character");
    assert!(stopped_answers > 0, "no sampled answer met its stop string");

    // A seeded sampled request repeats itself; its log-probabilities come with it.
    let sampled =
        json!({"prompt": "sample me", "max_tokens": 8, "temperature": 1.0, "seed": 42, "logprobs": 2})
            .to_string();
    let (status, first) = post(&base, "/v1/completions", &sampled);
    assert_eq!(status, 200, "{first}");
    let (_, second) = post(&base, "/v1/completions", &sampled);
    let (first, second): (Value, Value) = (
        serde_json::from_str(&first).unwrap(),
        serde_json::from_str(&second).unwrap(),
    );
    assert_eq!(
        first["choices"][0]["token_ids"],
        second["choices"][0]["token_ids"]
    );
    let logprobs = &first["choices"][0]["logprobs"];
    assert_eq!(
        logprobs["token_logprobs"].as_array().unwrap().len(),
        8,
        "{logprobs}"
    );
    assert!(
        logprobs["top_logprobs"][0].as_object().unwrap().len() >= 2,
        "{logprobs}"
    );

    // A usage chunk (no choices) only when asked for, last before [DONE].
    let (_, streamed) = post(
        &base,
        "/v1/completions",
        r#"{"prompt": "usage", "max_tokens": 3, "stream": true, "stream_options": {"include_usage": true}}"#,
    );
    let chunks = events(&streamed);
    let (tail, rest) = chunks.split_last().unwrap();
    assert_eq!(tail["choices"], json!([]));
    assert_eq!(tail["usage"]["completion_tokens"], 3);
    assert!(
        rest.iter()
            .all(|chunk| chunk["choices"].as_array().unwrap().len() == 1)
    );

    // Chat, whole and streamed.
    let messages = json!([{"role": "user", "content": "hello"}]);
    let (status, text) = post(
        &base,
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 8}).to_string(),
    );
    assert_eq!(status, 200, "{text}");
    let chat: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(chat["object"], "chat.completion");
    assert_eq!(chat["choices"][0]["message"]["role"], "assistant");
    assert_eq!(
        chat["usage"]["prompt_tokens"],
        "<|user|>\nhello\n<|assistant|>\n".len()
    );
    let (_, streamed) = post(
        &base,
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 8, "stream": true}).to_string(),
    );
    let chunks = events(&streamed);
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let content: String = chunks
        .iter()
        .map(|chunk| {
            chunk["choices"][0]["delta"]["content"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(
        content,
        chat["choices"][0]["message"]["content"].as_str().unwrap()
    );

    // Errors are JSON, trailing data is refused, probes answer.
    let (status, text) = get(&format!("{base}/no/such/route"));
    assert_eq!(status, 404);
    let error: Value = serde_json::from_str(&text).unwrap();
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("/no/such/route")
    );
    let (status, text) = get(&format!("{base}/v1/completions"));
    assert_eq!(status, 405, "{text}");
    assert!(serde_json::from_str::<Value>(&text).is_ok(), "{text}");
    let (status, text) = post(&base, "/v1/completions", r#"{"prompt":"a"}{"prompt":"b"}"#);
    assert_eq!(status, 400);
    assert!(text.contains("data after the JSON object"), "{text}");
    let (status, text) = post(
        &base,
        "/v1/completions",
        r#"{"prompt":"a","presence_penalty":0.5}"#,
    );
    assert_eq!(status, 400);
    assert!(text.contains(r#""param":"presence_penalty""#), "{text}");
    assert_eq!(get(&format!("{base}/health")).0, 200);
    let (status, text) = get(&format!("{base}/version"));
    assert_eq!(status, 200);
    assert!(text.contains(env!("CARGO_PKG_VERSION")), "{text}");

    // The openai Python package, where CI's venv has it.
    match openai_python() {
        Some(python) => {
            let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/openai_client.py");
            let output = std::process::Command::new(&python)
                .arg(&script)
                .arg(format!("{base}/v1"))
                .output()
                .unwrap();
            assert!(
                output.status.success()
                    && String::from_utf8_lossy(&output.stdout).contains("openai client: ok"),
                "{}\n{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            );
        }
        None => {
            assert!(
                std::env::var_os("PDKV_REQUIRE_OPENAI").is_none(),
                "PDKV_REQUIRE_OPENAI is set but no python with the openai package was found"
            );
            eprintln!("skipped the openai package's client: set PDKV_OPENAI_PYTHON");
        }
    }
    assert_eq!(launched.interrupt(), 0);
    std::fs::remove_dir_all(dir).ok();
}

/// A python that imports `openai`: `$PDKV_OPENAI_PYTHON`, else `$PDKV_VLLM_PYTHON` (vLLM
/// depends on it).
fn openai_python() -> Option<std::ffi::OsString> {
    ["PDKV_OPENAI_PYTHON", "PDKV_VLLM_PYTHON"]
        .iter()
        .filter_map(std::env::var_os)
        .find(|python| {
            std::process::Command::new(python)
                .args(["-c", "import openai"])
                .output()
                .is_ok_and(|output| output.status.success())
        })
}
