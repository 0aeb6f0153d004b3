//! `pdkv gpus`: the AMD GPUs this host has, with live telemetry.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use pdkv_rocm::Sysfs;
use serde_json::json;

/// Arguments of `pdkv gpus`.
#[derive(Debug, Args)]
pub struct GpusArgs {
    /// sysfs root to read (a container may bind-mount the host's elsewhere).
    #[arg(long, default_value = "/sys")]
    pub sysfs: PathBuf,
    /// Print JSON: `{"gpus": [{"card": ..., "telemetry": {...}}, ...]}`.
    #[arg(long)]
    pub json: bool,
}

/// Lists GPUs; no GPU is a normal answer (exit 0).
pub fn run(args: GpusArgs) -> anyhow::Result<ExitCode> {
    let sysfs = Sysfs::new(&args.sysfs);
    let gpus = sysfs.discover()?;
    let mut rows = Vec::with_capacity(gpus.len());
    for gpu in &gpus {
        rows.push((gpu, sysfs.telemetry(gpu)?));
    }
    if args.json {
        let gpus: Vec<_> = rows
            .iter()
            .map(|(gpu, telemetry)| json!({"card": gpu.card, "pci_slot": gpu.pci_slot, "device_id": format!("{:#06x}", gpu.device_id), "telemetry": telemetry}))
            .collect();
        println!("{}", json!({ "gpus": gpus }));
        return Ok(ExitCode::SUCCESS);
    }
    if rows.is_empty() {
        println!(
            "no AMD GPUs found under {}",
            args.sysfs.join("class/drm").display()
        );
    }
    for (gpu, telemetry) in rows {
        let gib = |bytes: Option<u64>| {
            bytes.map_or("-".to_string(), |b| {
                format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64)
            })
        };
        let opt =
            |value: Option<f64>, unit: &str| value.map_or("-".to_string(), |v| format!("{v:.1} {unit}"));
        println!(
            "{} {} device {:#06x}: VRAM {} / {}, busy {}, edge {}, junction {}, power {}",
            gpu.card,
            gpu.pci_slot.as_deref().unwrap_or("?"),
            gpu.device_id,
            gib(telemetry.vram_used_bytes),
            gib(telemetry.vram_total_bytes),
            telemetry
                .gpu_busy_percent
                .map_or("-".to_string(), |p| format!("{p}%")),
            opt(telemetry.temperature_edge_celsius, "C"),
            opt(telemetry.temperature_junction_celsius, "C"),
            opt(telemetry.power_average_watts, "W"),
        );
    }
    Ok(ExitCode::SUCCESS)
}
