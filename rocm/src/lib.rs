//! pdkv-rocm: AMD GPU discovery and telemetry.
//!
//! The default source is the amdgpu driver's sysfs files, the same data rocm-smi reads, so pdkv
//! needs no ROCm install to see GPUs: `/sys/class/drm/card<N>/device` with PCI vendor `0x1002`,
//! its `mem_info_vram_{total,used}`, `gpu_busy_percent`, `mem_busy_percent` and the hwmon
//! temperature and power files. [`Sysfs`] takes the sysfs root as a parameter so tests (and
//! containers with a bind-mounted sysfs) can point it elsewhere.
//!
//! A machine with no AMD GPU (or no `/sys/class/drm` at all) has zero GPUs: that is an answer,
//! not an error. A file that exists but holds garbage is an error naming the file.
//!
//! With the `rocm-smi` feature, [`read_gpus`] can ask AMD's rocm_smi_lib instead (the crate the
//! design calls rocm-smi-rs); both backends give the same [`Reading`]s, and [`gauges`] turns
//! them into the metrics every node exports.
//!
//! Non-goals: setting clocks or power, anything that needs root.
#![warn(missing_docs)]

use std::fs;
use std::path::{Path, PathBuf};

use serde::Serialize;

#[cfg(feature = "rocm-smi")]
mod smi;

/// PCI vendor id of AMD.
pub const AMD_PCI_VENDOR: u16 = 0x1002;

/// One AMD GPU as the driver exposes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Gpu {
    /// DRM card name, e.g. `card1`.
    pub card: String,
    /// PCI slot, e.g. `0000:c1:00.0`, from the device's `uevent`.
    pub pci_slot: Option<String>,
    /// PCI device id (e.g. `0x74a1` for MI300X).
    pub device_id: u16,
    /// Total VRAM in bytes, if the driver reports it.
    pub vram_total_bytes: Option<u64>,
    /// The sysfs device directory (telemetry is read from here).
    pub device_dir: PathBuf,
}

/// A GPU's live readings; a field the driver does not expose is `None`.
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct Telemetry {
    /// VRAM in use, bytes.
    pub vram_used_bytes: Option<u64>,
    /// VRAM in all, bytes.
    pub vram_total_bytes: Option<u64>,
    /// Graphics engine busy, percent.
    pub gpu_busy_percent: Option<u8>,
    /// Memory controller busy, percent.
    pub mem_busy_percent: Option<u8>,
    /// Edge temperature, °C.
    pub temperature_edge_celsius: Option<f64>,
    /// Junction (hotspot) temperature, °C.
    pub temperature_junction_celsius: Option<f64>,
    /// Memory temperature, °C.
    pub temperature_mem_celsius: Option<f64>,
    /// Average board power, W.
    pub power_average_watts: Option<f64>,
}

/// amdgpu's sysfs, rooted at `root` (normally `/sys`).
#[derive(Debug, Clone)]
pub struct Sysfs {
    root: PathBuf,
}

impl Sysfs {
    /// The machine's own sysfs.
    pub fn system() -> Self {
        Sysfs::new("/sys")
    }

    /// A sysfs tree rooted elsewhere.
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Sysfs { root: root.into() }
    }

    /// Every AMD GPU, ordered by card number.
    pub fn discover(&self) -> Result<Vec<Gpu>, RocmError> {
        let drm = self.root.join("class/drm");
        let entries = match fs::read_dir(&drm) {
            Ok(entries) => entries,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(error) => return Err(RocmError::Io(drm, error.to_string())),
        };
        let mut gpus = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|error| RocmError::Io(drm.clone(), error.to_string()))?;
            let card = entry.file_name().to_string_lossy().into_owned();
            // `card0` is a GPU; `card0-DP-1` is one of its connectors; `renderD128` a render node.
            let Some(number) = card
                .strip_prefix("card")
                .filter(|n| n.chars().all(|c| c.is_ascii_digit()) && !n.is_empty())
            else {
                continue;
            };
            let number: u32 = number
                .parse()
                .map_err(|_| RocmError::Parse(entry.path(), card.clone()))?;
            let device_dir = entry.path().join("device");
            let Some(vendor) = read_optional(&device_dir.join("vendor"))? else {
                continue;
            };
            if parse_hex_u16(&device_dir.join("vendor"), &vendor)? != AMD_PCI_VENDOR {
                continue;
            }
            let device_id = match read_optional(&device_dir.join("device"))? {
                Some(text) => parse_hex_u16(&device_dir.join("device"), &text)?,
                None => 0,
            };
            let pci_slot = read_optional(&device_dir.join("uevent"))?.and_then(|uevent| {
                uevent
                    .lines()
                    .find_map(|line| line.strip_prefix("PCI_SLOT_NAME=").map(str::to_string))
            });
            let vram_total_bytes = read_number(&device_dir.join("mem_info_vram_total"))?;
            gpus.push((
                number,
                Gpu {
                    card,
                    pci_slot,
                    device_id,
                    vram_total_bytes,
                    device_dir,
                },
            ));
        }
        gpus.sort_by_key(|(number, _)| *number);
        Ok(gpus.into_iter().map(|(_, gpu)| gpu).collect())
    }

    /// Reads a GPU's live telemetry.
    pub fn telemetry(&self, gpu: &Gpu) -> Result<Telemetry, RocmError> {
        let device = &gpu.device_dir;
        let percent = |file: &str| -> Result<Option<u8>, RocmError> {
            read_number(&device.join(file))?
                .map(|value| {
                    u8::try_from(value.min(100))
                        .map_err(|_| RocmError::Parse(device.join(file), value.to_string()))
                })
                .transpose()
        };
        let mut telemetry = Telemetry {
            vram_used_bytes: read_number(&device.join("mem_info_vram_used"))?,
            vram_total_bytes: read_number(&device.join("mem_info_vram_total"))?,
            gpu_busy_percent: percent("gpu_busy_percent")?,
            mem_busy_percent: percent("mem_busy_percent")?,
            ..Telemetry::default()
        };
        let hwmon_root = device.join("hwmon");
        if let Ok(entries) = fs::read_dir(&hwmon_root) {
            let mut hwmons: Vec<PathBuf> = entries
                .filter_map(|entry| entry.ok().map(|entry| entry.path()))
                .collect();
            hwmons.sort();
            if let Some(hwmon) = hwmons.first() {
                for index in 1..=3 {
                    let Some(millidegrees) = read_number(&hwmon.join(format!("temp{index}_input")))? else {
                        continue;
                    };
                    let celsius = Some(millidegrees as f64 / 1000.0);
                    let label = read_optional(&hwmon.join(format!("temp{index}_label")))?;
                    match label.as_deref().map(str::trim) {
                        Some("junction") => telemetry.temperature_junction_celsius = celsius,
                        Some("mem") => telemetry.temperature_mem_celsius = celsius,
                        _ => telemetry.temperature_edge_celsius = celsius,
                    }
                }
                telemetry.power_average_watts =
                    read_number(&hwmon.join("power1_average"))?.map(|microwatts| microwatts as f64 / 1e6);
            }
        }
        Ok(telemetry)
    }
}

/// The most a sysfs attribute may hold: the kernel serves at most a page per attribute, so
/// anything longer (a file linked to `/dev/zero`, a log) is not one.
pub const MAX_ATTRIBUTE_BYTES: u64 = 4096;

fn read_optional(path: &Path) -> Result<Option<String>, RocmError> {
    use std::io::Read;
    let file = match fs::File::open(path) {
        Ok(file) => file,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(error) => return Err(RocmError::Io(path.to_path_buf(), error.to_string())),
    };
    let mut bytes = Vec::new();
    file.take(MAX_ATTRIBUTE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|error| RocmError::Io(path.to_path_buf(), error.to_string()))?;
    if bytes.len() as u64 > MAX_ATTRIBUTE_BYTES {
        return Err(RocmError::Io(
            path.to_path_buf(),
            format!("longer than {MAX_ATTRIBUTE_BYTES} bytes: not a sysfs attribute"),
        ));
    }
    String::from_utf8(bytes)
        .map(Some)
        .map_err(|_| RocmError::Io(path.to_path_buf(), "not text".into()))
}

fn read_number(path: &Path) -> Result<Option<u64>, RocmError> {
    read_optional(path)?
        .map(|text| {
            text.trim()
                .parse::<u64>()
                .map_err(|_| RocmError::Parse(path.to_path_buf(), text.trim().to_string()))
        })
        .transpose()
}

fn parse_hex_u16(path: &Path, text: &str) -> Result<u16, RocmError> {
    let trimmed = text.trim();
    u16::from_str_radix(trimmed.trim_start_matches("0x"), 16)
        .map_err(|_| RocmError::Parse(path.to_path_buf(), trimmed.to_string()))
}

/// Where GPU readings come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Backend {
    /// AMD's rocm_smi_lib (the `rocm-smi` feature).
    Smi,
    /// amdgpu's sysfs files, read directly.
    Sysfs,
}

/// Which backend to ask.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendChoice {
    /// rocm_smi_lib when built with it and it finds a GPU, else sysfs.
    Auto,
    /// rocm_smi_lib only.
    Smi,
    /// sysfs only.
    Sysfs,
}

/// One GPU and its readings, whichever backend read them.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Reading {
    /// The label metrics use: the PCI slot when known, else the DRM card or SMI index.
    pub device: String,
    /// DRM card name (sysfs only).
    pub card: Option<String>,
    /// PCI slot, e.g. `0000:c1:00.0`.
    pub pci_slot: Option<String>,
    /// PCI device id.
    pub device_id: u16,
    /// Live readings.
    pub telemetry: Telemetry,
}

/// Every AMD GPU with its readings, from the backend `choice` picks; the backend that answered.
pub fn read_gpus(choice: BackendChoice, sysfs: &Sysfs) -> Result<(Backend, Vec<Reading>), RocmError> {
    match choice {
        BackendChoice::Sysfs => Ok((Backend::Sysfs, read_sysfs(sysfs)?)),
        BackendChoice::Smi => Ok((Backend::Smi, read_smi()?)),
        BackendChoice::Auto => match read_smi() {
            Ok(readings) if !readings.is_empty() => Ok((Backend::Smi, readings)),
            _ => Ok((Backend::Sysfs, read_sysfs(sysfs)?)),
        },
    }
}

fn read_sysfs(sysfs: &Sysfs) -> Result<Vec<Reading>, RocmError> {
    let mut readings = Vec::new();
    for gpu in sysfs.discover()? {
        let telemetry = sysfs.telemetry(&gpu)?;
        readings.push(Reading {
            device: gpu.pci_slot.clone().unwrap_or_else(|| gpu.card.clone()),
            card: Some(gpu.card),
            pci_slot: gpu.pci_slot,
            device_id: gpu.device_id,
            telemetry,
        });
    }
    Ok(readings)
}

#[cfg(feature = "rocm-smi")]
fn read_smi() -> Result<Vec<Reading>, RocmError> {
    smi::read()
}

#[cfg(not(feature = "rocm-smi"))]
fn read_smi() -> Result<Vec<Reading>, RocmError> {
    Err(RocmError::SmiNotBuilt)
}

/// One gauge of GPU telemetry as `/metrics` exports it.
#[derive(Debug, Clone, PartialEq)]
pub struct Gauge {
    /// Metric name.
    pub name: &'static str,
    /// Labels: `device`, plus `sensor` for temperatures.
    pub labels: Vec<(&'static str, String)>,
    /// Value.
    pub value: f64,
}

/// The gauges for `readings`: `pdkv_gpu_vram_used_bytes`, `pdkv_gpu_vram_total_bytes`,
/// `pdkv_gpu_busy_ratio` (0–1), `pdkv_gpu_power_watts` and `pdkv_gpu_temperature_celsius`
/// (`sensor` = edge, junction or mem), each labelled by `device`; a reading the GPU does not
/// give is left out rather than exported as zero.
pub fn gauges(readings: &[Reading]) -> Vec<Gauge> {
    let mut gauges = Vec::new();
    for reading in readings {
        let t = &reading.telemetry;
        let device = || vec![("device", reading.device.clone())];
        let mut push = |name, labels, value: Option<f64>| {
            if let Some(value) = value {
                gauges.push(Gauge { name, labels, value });
            }
        };
        push(
            "pdkv_gpu_vram_used_bytes",
            device(),
            t.vram_used_bytes.map(|b| b as f64),
        );
        push(
            "pdkv_gpu_vram_total_bytes",
            device(),
            t.vram_total_bytes.map(|b| b as f64),
        );
        push(
            "pdkv_gpu_busy_ratio",
            device(),
            t.gpu_busy_percent.map(|p| f64::from(p) / 100.0),
        );
        push("pdkv_gpu_power_watts", device(), t.power_average_watts);
        for (sensor, value) in [
            ("edge", t.temperature_edge_celsius),
            ("junction", t.temperature_junction_celsius),
            ("mem", t.temperature_mem_celsius),
        ] {
            let mut labels = device();
            labels.push(("sensor", sensor.to_string()));
            push("pdkv_gpu_temperature_celsius", labels, value);
        }
    }
    gauges
}

/// Why GPU discovery or telemetry failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RocmError {
    /// A sysfs file or directory could not be read.
    #[error("cannot read {path}: {detail}", path = .0.display(), detail = .1)]
    Io(PathBuf, String),
    /// A sysfs file holds something the driver never writes there.
    #[error("{path}: unexpected value {value:?}", path = .0.display(), value = .1)]
    Parse(PathBuf, String),
    /// `--backend smi` on a pdkv built without the `rocm-smi` feature.
    #[error(
        "this pdkv was built without the `rocm-smi` feature: use --backend sysfs, or build with --features rocm-smi"
    )]
    SmiNotBuilt,
    /// rocm_smi_lib failed a query.
    #[error("rocm_smi_lib: {0}")]
    Smi(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake sysfs with an MI300X-like GPU, an Intel GPU, a connector and a render node.
    fn fake_sysfs() -> PathBuf {
        let root = std::env::temp_dir().join(format!(
            "pdkv-rocm-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = fs::remove_dir_all(&root);
        let write = |path: &str, text: &str| {
            let path = root.join(path);
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(path, text).unwrap();
        };
        write("class/drm/card1/device/vendor", "0x1002\n");
        write("class/drm/card1/device/device", "0x74a1\n");
        write(
            "class/drm/card1/device/uevent",
            "DRIVER=amdgpu\nPCI_SLOT_NAME=0000:c1:00.0\n",
        );
        write("class/drm/card1/device/mem_info_vram_total", "206141652992\n");
        write("class/drm/card1/device/mem_info_vram_used", "1073741824\n");
        write("class/drm/card1/device/gpu_busy_percent", "37\n");
        write("class/drm/card1/device/hwmon/hwmon4/temp1_input", "41000\n");
        write("class/drm/card1/device/hwmon/hwmon4/temp1_label", "edge\n");
        write("class/drm/card1/device/hwmon/hwmon4/temp2_input", "52500\n");
        write("class/drm/card1/device/hwmon/hwmon4/temp2_label", "junction\n");
        write(
            "class/drm/card1/device/hwmon/hwmon4/power1_average",
            "156000000\n",
        );
        write("class/drm/card0/device/vendor", "0x8086\n");
        write("class/drm/card1-DP-1/status", "disconnected\n");
        write("class/drm/renderD128/dev", "226:128\n");
        root
    }

    #[test]
    fn discovers_amd_gpus_only_and_reads_their_telemetry() {
        let root = fake_sysfs();
        let sysfs = Sysfs::new(&root);
        let gpus = sysfs.discover().unwrap();
        assert_eq!(gpus.len(), 1);
        let gpu = &gpus[0];
        assert_eq!((gpu.card.as_str(), gpu.device_id), ("card1", 0x74a1));
        assert_eq!(gpu.pci_slot.as_deref(), Some("0000:c1:00.0"));
        assert_eq!(gpu.vram_total_bytes, Some(206_141_652_992));
        let telemetry = sysfs.telemetry(gpu).unwrap();
        assert_eq!(telemetry.vram_used_bytes, Some(1 << 30));
        assert_eq!(telemetry.gpu_busy_percent, Some(37));
        assert_eq!(telemetry.mem_busy_percent, None);
        assert_eq!(telemetry.temperature_edge_celsius, Some(41.0));
        assert_eq!(telemetry.temperature_junction_celsius, Some(52.5));
        assert_eq!(telemetry.power_average_watts, Some(156.0));
        fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn an_attribute_linked_to_an_endless_file_is_refused_not_read_whole() {
        let root = fake_sysfs();
        let used = root.join("class/drm/card1/device/mem_info_vram_used");
        fs::remove_file(&used).unwrap();
        std::os::unix::fs::symlink("/dev/zero", &used).unwrap();
        let sysfs = Sysfs::new(&root);
        let gpus = sysfs.discover().unwrap();
        match sysfs.telemetry(&gpus[0]) {
            Err(RocmError::Io(path, message)) => {
                assert_eq!(path, used);
                assert!(message.contains("longer than 4096 bytes"), "{message}");
            }
            other => panic!("{other:?}"),
        }
        fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn sysfs_readings_become_gauges_labelled_by_pci_slot() {
        let root = fake_sysfs();
        let (backend, readings) = read_gpus(BackendChoice::Sysfs, &Sysfs::new(&root)).unwrap();
        assert_eq!(backend, Backend::Sysfs);
        let device = || ("device", "0000:c1:00.0".to_string());
        let gauge = |name, mut labels: Vec<(&'static str, String)>, value| {
            labels.insert(0, device());
            Gauge { name, labels, value }
        };
        // Values from the fake files: 1 GiB used of 206141652992, 37 % busy, 156 W, edge 41 C,
        // junction 52.5 C; no memory temperature file, so no gauge for it.
        assert_eq!(
            gauges(&readings),
            vec![
                gauge("pdkv_gpu_vram_used_bytes", vec![], 1073741824.0),
                gauge("pdkv_gpu_vram_total_bytes", vec![], 206141652992.0),
                gauge("pdkv_gpu_busy_ratio", vec![], 0.37),
                gauge("pdkv_gpu_power_watts", vec![], 156.0),
                gauge(
                    "pdkv_gpu_temperature_celsius",
                    vec![("sensor", "edge".into())],
                    41.0
                ),
                gauge(
                    "pdkv_gpu_temperature_celsius",
                    vec![("sensor", "junction".into())],
                    52.5
                ),
            ]
        );
        fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn smi_answers_when_built_and_auto_falls_back_to_sysfs() {
        let root = fake_sysfs();
        let sysfs = Sysfs::new(&root);
        let smi = read_gpus(BackendChoice::Smi, &sysfs);
        if cfg!(feature = "rocm-smi") {
            // rocm_smi_lib really runs: on a host with no AMD GPU it finds none.
            let (backend, readings) = smi.unwrap();
            assert_eq!(backend, Backend::Smi);
            if !Path::new("/dev/kfd").exists() {
                assert_eq!(readings, vec![]);
            }
        } else {
            assert_eq!(smi.unwrap_err(), RocmError::SmiNotBuilt);
        }
        if !Path::new("/dev/kfd").exists() {
            let (backend, readings) = read_gpus(BackendChoice::Auto, &sysfs).unwrap();
            assert_eq!((backend, readings.len()), (Backend::Sysfs, 1));
        }
        fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn no_drm_directory_means_no_gpus() {
        let sysfs = Sysfs::new("/nonexistent/pdkv/sysfs");
        assert_eq!(sysfs.discover().unwrap(), vec![]);
    }

    #[test]
    fn garbage_in_a_driver_file_names_the_file() {
        let root = fake_sysfs();
        fs::write(root.join("class/drm/card1/device/mem_info_vram_total"), "lots\n").unwrap();
        let error = Sysfs::new(&root).discover().unwrap_err().to_string();
        assert!(
            error.ends_with("card1/device/mem_info_vram_total: unexpected value \"lots\""),
            "{error}"
        );
        fs::remove_dir_all(root).unwrap();
    }
}
