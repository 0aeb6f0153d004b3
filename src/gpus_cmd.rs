//! `pdkv gpus`: the AMD GPUs this host has, with live telemetry.
//!
//! Exit status: 0 when at least one AMD GPU was found, [`NO_GPU`] when none was (the answer
//! printed says so), 1 when the backend failed (the error names the file or the library call).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, ValueEnum};
use pdkv_rocm::{Backend, BackendChoice, Reading, Sysfs, read_gpus};
use serde_json::json;

/// Exit status of `pdkv gpus` when the host has no AMD GPU.
pub const NO_GPU: u8 = 3;

/// Which telemetry source `pdkv gpus` asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BackendArg {
    /// rocm_smi_lib when this pdkv was built with it and it finds a GPU, else sysfs.
    Auto,
    /// AMD's rocm_smi_lib (needs a build with `--features rocm-smi`).
    Smi,
    /// amdgpu's sysfs files.
    Sysfs,
}

/// Arguments of `pdkv gpus`.
#[derive(Debug, Args)]
pub struct GpusArgs {
    /// Telemetry source.
    #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
    pub backend: BackendArg,
    /// sysfs root to read (a container may bind-mount the host's elsewhere).
    #[arg(long, default_value = "/sys")]
    pub sysfs: PathBuf,
    /// Print JSON: `{"backend": ..., "gpus": [{"device": ..., "telemetry": {...}}, ...]}`.
    #[arg(long)]
    pub json: bool,
}

/// Lists GPUs; no GPU exits with [`NO_GPU`].
pub fn run(args: GpusArgs) -> anyhow::Result<ExitCode> {
    let choice = match args.backend {
        BackendArg::Auto => BackendChoice::Auto,
        BackendArg::Smi => BackendChoice::Smi,
        BackendArg::Sysfs => BackendChoice::Sysfs,
    };
    let (backend, readings) = read_gpus(choice, &Sysfs::new(&args.sysfs))?;
    if args.json {
        let gpus: Vec<_> = readings
            .iter()
            .map(|gpu| {
                json!({
                    "device": gpu.device,
                    "card": gpu.card,
                    "pci_slot": gpu.pci_slot,
                    "device_id": format!("{:#06x}", gpu.device_id),
                    "telemetry": gpu.telemetry,
                })
            })
            .collect();
        crate::outln!("{}", json!({ "backend": backend, "gpus": gpus }));
    } else if readings.is_empty() {
        match backend {
            Backend::Sysfs => crate::outln!(
                "no AMD GPUs found under {}",
                args.sysfs.join("class/drm").display()
            ),
            Backend::Smi => crate::outln!("no AMD GPUs found by rocm_smi_lib"),
        }
    } else {
        for gpu in &readings {
            crate::outln!("{}", describe(gpu));
        }
    }
    Ok(if readings.is_empty() {
        ExitCode::from(NO_GPU)
    } else {
        ExitCode::SUCCESS
    })
}

fn describe(gpu: &Reading) -> String {
    let telemetry = &gpu.telemetry;
    let gib = |bytes: Option<u64>| {
        bytes.map_or("-".to_string(), |b| {
            format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64)
        })
    };
    let opt = |value: Option<f64>, unit: &str| value.map_or("-".to_string(), |v| format!("{v:.1} {unit}"));
    format!(
        "{} {} device {:#06x}: VRAM {} / {}, busy {}, edge {}, junction {}, power {}",
        gpu.card.as_deref().unwrap_or("-"),
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
    )
}
