//! A node asked for mori or GPU memory on a host without them (like CI) refuses to start with one
//! error naming what is missing, whichever features the binary was built with; nothing panics.

use std::path::Path;

mod support;

use support::{certs_init, fixed_ports_cluster, free_ports, pdkv, temp_dir};

/// Starts `node` of a one-prefill, one-decode cluster with fixed ports whose `[transport]` is
/// `transport`; its exit code and stderr. Certificates are made when the file is valid.
fn node_exit(name: &str, transport: &str, node: &str) -> (Option<i32>, String) {
    let dir = temp_dir(name);
    let ports = free_ports(8);
    let text = fixed_ports_cluster(&dir, &ports).replace("[transport]\nread_engine = \"shm\"", transport);
    assert!(text.contains(transport), "the shipped [transport] section moved");
    let config = dir.join("cluster.toml");
    std::fs::write(&config, text).unwrap();
    if !transport.contains("kv_memory = \"gpu\"") || transport.contains("\"mori\"") {
        certs_init(&config, &dir.join("certs"));
    }
    let output = pdkv()
        .args(["node", "--node", node, "--config"])
        .arg(&config)
        .output()
        .unwrap();
    std::fs::remove_dir_all(&dir).ok();
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

fn rocm_7_present() -> bool {
    [
        "/opt/rocm/lib/libamdhip64.so.7",
        "/usr/lib/x86_64-linux-gnu/libamdhip64.so.7",
    ]
    .iter()
    .any(|path| Path::new(path).exists())
}

#[test]
fn a_mori_node_without_mori_exits_naming_what_is_missing() {
    for node in ["prefill-0", "decode-0"] {
        let (code, stderr) = node_exit(
            &format!("mori-{node}"),
            "[transport]\nread_engine = \"mori\"\n\n[transport.mori]\nqp_per_transfer = 4",
            node,
        );
        assert_eq!(code, Some(1), "{stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert!(
            stderr.contains(&format!("node {node}: the mori READ engine cannot start")),
            "{stderr}"
        );
        if !cfg!(feature = "mori") {
            assert!(
                stderr.contains("needs a pdkv built with `--features mori`"),
                "{stderr}"
            );
        } else if !rocm_7_present() {
            // The shim loads mori, which needs ROCm 7's HIP runtime: the loader names it.
            assert!(
                stderr.contains("libamdhip64.so.7 (ROCm's HIP runtime) is missing"),
                "{stderr}"
            );
        } else {
            assert!(stderr.contains("no RDMA NIC"), "{stderr}");
        }
    }
}

#[test]
fn a_gpu_memory_node_without_a_gpu_exits_naming_what_is_missing() {
    let (code, stderr) = node_exit(
        "gpu-memory",
        "[transport]\nread_engine = \"mori\"\nkv_memory = \"gpu\"",
        "prefill-0",
    );
    assert_eq!(code, Some(1), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(
        stderr.contains("node prefill-0: KV memory on GPU 0: "),
        "{stderr}"
    );
    if cfg!(feature = "hip") {
        // Debian's or ROCm's HIP runtime, asked for real, finds no device.
        assert!(
            stderr.contains("no AMD GPU: hipGetDeviceCount: hipErrorNoDevice"),
            "{stderr}"
        );
    } else {
        assert!(
            stderr.contains("needs a pdkv built with `--features hip`"),
            "{stderr}"
        );
    }
}

#[test]
fn gpu_memory_with_an_engine_that_cannot_read_it_is_refused_at_load() {
    let (code, stderr) = node_exit(
        "gpu-shm",
        "[transport]\nread_engine = \"shm\"\nkv_memory = \"gpu\"",
        "prefill-0",
    );
    assert_ne!(code, Some(0), "{stderr}");
    assert!(stderr.contains("transport.kv_memory"), "{stderr}");
    assert!(
        stderr.contains("\"gpu\" needs read_engine = \"mori\""),
        "{stderr}"
    );
}

/// A leg exports its host's GPU telemetry on `/metrics`, labelled by device; here from a fake
/// amdgpu sysfs tree (`PDKV_SYSFS_ROOT`) with one MI300X-like GPU.
#[test]
fn a_leg_exports_gpu_telemetry_on_its_metrics() {
    use support::{get, sample, start_node};

    let dir = temp_dir("gpu-metrics");
    let sysfs = dir.join("sys");
    let device = sysfs.join("class/drm/card0/device");
    let hwmon = device.join("hwmon/hwmon2");
    std::fs::create_dir_all(&hwmon).unwrap();
    for (file, text) in [
        ("vendor", "0x1002\n"),
        ("device", "0x74a1\n"),
        ("uevent", "DRIVER=amdgpu\nPCI_SLOT_NAME=0000:c1:00.0\n"),
        ("mem_info_vram_total", "206141652992\n"),
        ("mem_info_vram_used", "2147483648\n"),
        ("gpu_busy_percent", "25\n"),
        ("hwmon/hwmon2/temp1_input", "45000\n"),
        ("hwmon/hwmon2/temp1_label", "edge\n"),
        ("hwmon/hwmon2/power1_average", "300000000\n"),
    ] {
        std::fs::write(device.join(file), text).unwrap();
    }
    let ports = free_ports(8);
    let config = dir.join("cluster.toml");
    std::fs::write(&config, fixed_ports_cluster(&dir, &ports)).unwrap();
    certs_init(&config, &dir.join("certs"));
    let (mut child, line) = start_node(&config, "prefill-0", &[("PDKV_SYSFS_ROOT", sysfs.as_os_str())]);
    assert!(line.starts_with("READY node=prefill-0"), "{line}");
    let (status, metrics) = get(&format!("http://127.0.0.1:{}/metrics", ports[2]));
    child.kill().unwrap();
    child.wait().unwrap();
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(status, 200);
    // Values from the files above: 2 GiB used, 25 % busy, 300 W, edge 45 C.
    let device = "device=\"0000:c1:00.0\"";
    for (key, value) in [
        (format!("pdkv_gpu_vram_used_bytes{{{device}}}"), 2147483648.0),
        (format!("pdkv_gpu_vram_total_bytes{{{device}}}"), 206141652992.0),
        (format!("pdkv_gpu_busy_ratio{{{device}}}"), 0.25),
        (format!("pdkv_gpu_power_watts{{{device}}}"), 300.0),
        (
            format!("pdkv_gpu_temperature_celsius{{{device},sensor=\"edge\"}}"),
            45.0,
        ),
    ] {
        assert_eq!(sample(&metrics, &key), Some(value), "{key} in\n{metrics}");
    }
    assert!(
        !metrics.contains("sensor=\"junction\""),
        "no junction file, no junction gauge"
    );
}

/// A mori prefill leg serves no network data port: mori reads its registered memory directly.
/// (The node runs on the loopback stand-in of the mori shim; it starts and reads nothing.)
#[cfg(feature = "mori")]
#[test]
fn a_mori_prefill_leg_opens_no_network_data_port() {
    use support::start_node;

    let dir = temp_dir("mori-no-data-port");
    let ports = free_ports(8);
    let text = fixed_ports_cluster(&dir, &ports).replace(
        "[transport]\nread_engine = \"shm\"",
        "[transport]\nread_engine = \"mori\"",
    );
    let config = dir.join("cluster.toml");
    std::fs::write(&config, text).unwrap();
    certs_init(&config, &dir.join("certs"));
    let (mut child, line) = start_node(
        &config,
        "prefill-0",
        &[(
            "PDKV_MORI_SHIM",
            std::ffi::OsStr::new(pdkv_transport::mori::LOOPBACK_SHIM),
        )],
    );
    let data_port_free = std::net::TcpListener::bind(("127.0.0.1", ports[1])).is_ok();
    child.kill().unwrap();
    child.wait().unwrap();
    std::fs::remove_dir_all(&dir).ok();
    assert!(line.starts_with("READY node=prefill-0"), "{line}");
    assert!(!line.contains(" data="), "{line}");
    assert!(data_port_free, "nothing listens on the configured data port");
}
