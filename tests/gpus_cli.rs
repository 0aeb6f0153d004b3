//! `pdkv gpus` against a fake amdgpu sysfs tree, and on this machine.

use std::process::Command;

#[test]
fn lists_amd_gpus_from_sysfs() {
    let root = std::env::temp_dir().join(format!("pdkv-gpus-cli-{}", std::process::id()));
    let device = root.join("class/drm/card0/device");
    std::fs::create_dir_all(&device).unwrap();
    std::fs::write(device.join("vendor"), "0x1002\n").unwrap();
    std::fs::write(device.join("device"), "0x74a5\n").unwrap();
    std::fs::write(device.join("mem_info_vram_total"), "206141652992\n").unwrap();
    std::fs::write(device.join("mem_info_vram_used"), "0\n").unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_pdkv"))
        .args(["gpus", "--json", "--sysfs", root.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(output.status.success());
    let json: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(
        json["backend"], "sysfs",
        "auto falls back to sysfs where rocm_smi finds no GPU"
    );
    assert_eq!(json["gpus"][0]["device_id"], "0x74a5");
    assert_eq!(
        json["gpus"][0]["device"], "card0",
        "no PCI slot in the fake uevent: the card names it"
    );
    assert_eq!(json["gpus"][0]["telemetry"]["vram_total_bytes"], 206141652992u64);
    std::fs::remove_dir_all(root).unwrap();

    // On a machine without AMD GPUs (like CI) the answer is "none", with its own exit status
    // (3, documented), not an error.
    let output = Command::new(env!("CARGO_BIN_EXE_pdkv"))
        .args(["gpus", "--backend", "sysfs", "--sysfs", "/nonexistent"])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(3));
    assert!(
        String::from_utf8_lossy(&output.stdout).contains("no AMD GPUs found under /nonexistent/class/drm")
    );
}

#[test]
fn the_smi_backend_answers_or_says_it_was_not_built() {
    let output = Command::new(env!("CARGO_BIN_EXE_pdkv"))
        .args(["gpus", "--backend", "smi"])
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    if cfg!(feature = "rocm-smi") {
        if !std::path::Path::new("/dev/kfd").exists() {
            // rocm_smi_lib runs for real and finds no GPU on this host.
            assert_eq!(output.status.code(), Some(3), "{stdout}{stderr}");
            assert!(stdout.contains("no AMD GPUs found by rocm_smi_lib"), "{stdout}");
        }
    } else {
        assert_eq!(output.status.code(), Some(1), "{stderr}");
        assert!(
            stderr.contains("built without the `rocm-smi` feature"),
            "{stderr}"
        );
    }
}
