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
    assert_eq!(json["gpus"][0]["device_id"], "0x74a5");
    assert_eq!(json["gpus"][0]["telemetry"]["vram_total_bytes"], 206141652992u64);
    std::fs::remove_dir_all(root).unwrap();

    // On a machine without AMD GPUs (like CI) the answer is "none", not an error.
    let output = Command::new(env!("CARGO_BIN_EXE_pdkv"))
        .args(["gpus", "--sysfs", "/nonexistent"])
        .output()
        .unwrap();
    assert!(output.status.success());
    assert!(String::from_utf8_lossy(&output.stdout).contains("no AMD GPUs found"));
}
