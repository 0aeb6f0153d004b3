//! mori READ throughput on real hardware (two ROCm 7 hosts, or one with two NICs), built with
//! `--features mori`. It cannot run without an RDMA NIC: there it prints the reason mori gave
//! and exits with status 2.
//!
//! On the prefill host:
//!   `cargo run --release -p pdkv-bench --features mori --bin mori_read_throughput -- --serve [MIB] [--host IP] [--gpu N] > source.json`
//! (it prints one JSON line, then serves until its stdin closes). On the decode host, with that
//! line copied over:
//!   `cargo run --release -p pdkv-bench --features mori --bin mori_read_throughput -- [MIB] --source source.json [--host IP] [--gpu N] [--baseline-gbps X]`
//! Without `--source` it starts the serving side itself on this host (loopback through the NIC).
//!
//! For run sizes 4 KiB … 64 MiB it moves the `MIB` MiB (default 256) region as runs of that
//! size, one batch per pass, best of 9 passes after a warm-up, through pdkv's [`MoriEngine`]
//! (the transfer actor's path: bounds checks, run batching, completion thread). The same-run
//! baseline is mori's own `bench_engine` (C++, nixlbench methodology) on the same pair of hosts:
//! pass its GB/s at the same message size as `--baseline-gbps` and the ratio column is pdkv's
//! over mori's. The target: ≥ 90% of mori's published single-pair READ figure, 44.8 GB/s
//! at 64 MB on CX7 400G, for a 61-layer 32k-token request. The destination is checked byte for
//! byte after the last pass.

use std::io::{BufRead, Read, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pdkv_core::plan::ReadRun;
use pdkv_core::wire::GrantId;
use pdkv_transport::engine::{EngineDescriptor, EngineKey, MemoryDescriptor, ReadEngine, ReadOp};
use pdkv_transport::mori::{MoriEngine, MoriSettings};
use pdkv_transport::region::Region;
use serde::{Deserialize, Serialize};

const PASSES: usize = 9;
const RUN_SIZES: [u64; 8] = [
    4 << 10,
    64 << 10,
    256 << 10,
    1 << 20,
    4 << 20,
    16 << 20,
    32 << 20,
    64 << 20,
];

/// What the serving side prints: how to reach its region.
#[derive(Serialize, Deserialize)]
struct Source {
    engine: EngineDescriptor,
    region: MemoryDescriptor,
}

fn value<T: std::str::FromStr>(args: &[String], flag: &str) -> Option<T> {
    args.iter()
        .position(|arg| arg == flag)
        .and_then(|at| args.get(at + 1))
        .and_then(|text| text.parse().ok())
}

fn pattern(total: u64) -> Vec<u8> {
    (0..total).map(|i| (i % 251) as u8).collect()
}

/// A region of `total` bytes in host memory, or on GPU `gpu`.
fn region(total: u64, gpu: Option<u32>) -> Region {
    match gpu {
        Some(device) => Region::gpu(device, total as usize)
            .unwrap_or_else(|error| fail(&format!("GPU {device}: {error}"))),
        None => Region::heap(total as usize),
    }
}

fn engine(name: &str, host: &str) -> MoriEngine {
    MoriEngine::new(EngineKey(name.into()), host, MoriSettings::default())
        .unwrap_or_else(|error| fail(&format!("mori engine: {error}")))
}

fn fail(message: &str) -> ! {
    eprintln!("mori_read_throughput: {message}");
    std::process::exit(2)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    // MIB is the one argument that is neither a flag nor a flag's value.
    let takes_value = ["--host", "--gpu", "--source", "--baseline-gbps"];
    let mib: u64 = args
        .iter()
        .enumerate()
        .filter(|(at, arg)| {
            !arg.starts_with("--") && (*at == 0 || !takes_value.contains(&args[at - 1].as_str()))
        })
        .find_map(|(_, arg)| arg.parse().ok())
        .unwrap_or(256);
    let total = mib << 20;
    let host: String = value(&args, "--host").unwrap_or_else(|| "127.0.0.1".into());
    let gpu: Option<u32> = value(&args, "--gpu");
    if args.iter().any(|arg| arg == "--serve") {
        let prefill = engine("prefill", &host);
        let source = Arc::new(region(total, gpu));
        source
            .write(0, &pattern(total))
            .unwrap_or_else(|error| fail(&format!("fill: {error}")));
        let region = prefill
            .register(0, source)
            .unwrap_or_else(|error| fail(&format!("register: {error}")));
        let line = serde_json::to_string(&Source {
            engine: prefill.descriptor(),
            region,
        })
        .expect("json");
        println!("{line}");
        std::io::stdout().flush().expect("flush");
        let mut sink = Vec::new();
        let _ = std::io::stdin().read_to_end(&mut sink);
        return;
    }
    let mut child = None;
    let source: Source = match value::<String>(&args, "--source") {
        Some(path) => {
            let text =
                std::fs::read_to_string(&path).unwrap_or_else(|error| fail(&format!("{path}: {error}")));
            serde_json::from_str(text.trim()).unwrap_or_else(|error| fail(&format!("{path}: {error}")))
        }
        None => {
            let mut process = std::process::Command::new(std::env::current_exe().expect("exe"))
                .args([mib.to_string(), "--serve".into(), "--host".into(), host.clone()])
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .spawn()
                .expect("serving process");
            let mut line = String::new();
            std::io::BufReader::new(process.stdout.take().expect("stdout"))
                .read_line(&mut line)
                .expect("source line");
            if line.is_empty() {
                let _ = process.wait();
                fail("the serving side exited (its error is above)");
            }
            child = Some(process);
            serde_json::from_str(&line).expect("source")
        }
    };
    let decode = engine("decode", &host);
    let destination = Arc::new(region(total, gpu));
    decode
        .register(0, destination.clone())
        .unwrap_or_else(|error| fail(&format!("register: {error}")));
    decode
        .register_remote(&source.engine, std::slice::from_ref(&source.region))
        .unwrap_or_else(|error| fail(&format!("register remote: {error}")));
    let baseline: Option<f64> = value(&args, "--baseline-gbps");
    println!(
        "mori READ throughput through pdkv's MoriEngine, {mib} MiB per pass, best of {PASSES} (GB/s){}",
        baseline.map_or(String::new(), |gbps| format!(
            "; ratio to mori bench_engine's {gbps:.1} GB/s"
        ))
    );
    for size in RUN_SIZES.into_iter().filter(|&size| size <= total) {
        let runs: Vec<ReadRun> = (0..total / size)
            .map(|index| ReadRun {
                local_offset: index * size,
                remote_offset: index * size,
                len_bytes: size,
            })
            .collect();
        // Contiguous runs would merge into one work request: read every other run so each
        // stays its own message of `size` bytes (half the region per pass).
        let runs: Vec<ReadRun> = runs.into_iter().step_by(2).collect();
        let bytes: u64 = runs.iter().map(|run| run.len_bytes).sum();
        let pass = || {
            let started = Instant::now();
            decode
                .batch_read(vec![ReadOp {
                    grant: GrantId(1),
                    local_region: 0,
                    remote_engine: EngineKey("prefill".into()),
                    remote_region: 0,
                    runs: runs.clone(),
                }])
                .unwrap_or_else(|error| fail(&format!("post: {error}")))
                .wait_blocking(Duration::from_secs(60))
                .unwrap_or_else(|error| fail(&format!("read: {error}")));
            started.elapsed()
        };
        pass();
        let best = (0..PASSES).map(|_| pass()).min().expect("passes");
        let rate = bytes as f64 / best.as_secs_f64() / 1e9;
        println!(
            "{:>8} KiB | {rate:>7.2}{}",
            size >> 10,
            baseline.map_or(String::new(), |gbps| format!(" {:>5.0}%", 100.0 * rate / gbps))
        );
    }
    let expected = pattern(total);
    let mut check = vec![0u8; total as usize];
    destination
        .read(0, &mut check)
        .unwrap_or_else(|error| fail(&format!("read back: {error}")));
    // Every run size read the even runs; the 4 KiB pass covered every even 4 KiB block.
    for (block, (got, want)) in check
        .chunks(4096)
        .zip(expected.chunks(4096))
        .enumerate()
        .step_by(2)
    {
        assert!(got == want, "block {block} differs from the source");
    }
    println!("(destination verified against the source pattern)");
    if let Some(mut child) = child {
        drop(child.stdin.take());
        let _ = child.wait();
    }
}
