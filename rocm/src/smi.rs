//! GPU readings through AMD's rocm_smi_lib (`rocm-smi` feature).
//!
//! On a host with no AMD GPU the library prints to stderr, fails its init and reports zero
//! devices; the crate returns `Ok` with none. That is "no GPU", not an error.

use rocm_smi_lib::{RocmSmi, RsmiTemperatureMetric, RsmiTemperatureType};

use crate::{Reading, RocmError, Telemetry};

/// `dddd:bb:dd.f` from rocm_smi's BDF id (domain in bits 32–63, bus 8–15, device 3–7, function
/// 0–2).
pub(crate) fn pci_slot(bdf: u64) -> String {
    format!(
        "{:04x}:{:02x}:{:02x}.{:x}",
        bdf >> 32,
        (bdf >> 8) & 0xff,
        (bdf >> 3) & 0x1f,
        bdf & 0x7
    )
}

/// `RSMI_STATUS_SUCCESS`.
const SUCCESS: u32 = 0;

/// A `u64` an rsmi query writes, if it succeeds.
///
/// The queries used here exist in every rocm_smi_lib since ROCm 5 (Debian ships 5.2.3); the
/// crate's own wrappers for identifiers and power also call functions added in ROCm 6, which
/// would not link against Debian's library.
fn raw_u64(query: impl FnOnce(*mut u64) -> u32) -> Option<u64> {
    let mut value = 0u64;
    (query(&mut value) == SUCCESS).then_some(value)
}

pub(crate) fn read() -> Result<Vec<Reading>, RocmError> {
    let mut smi = RocmSmi::init().map_err(|error| RocmError::Smi(format!("init: {error:?}")))?;
    let count = smi.get_device_count();
    let mut readings = Vec::with_capacity(count as usize);
    for index in 0..count {
        let memory = smi.get_device_memory_data(index).ok();
        let temperature = |smi: &mut RocmSmi, sensor| {
            smi.get_device_temperature_metric(index, sensor, RsmiTemperatureMetric::Current)
                .ok()
        };
        let telemetry = Telemetry {
            vram_used_bytes: memory.map(|m| m.vram_used),
            vram_total_bytes: memory.map(|m| m.vram_total),
            gpu_busy_percent: smi
                .get_device_busy_percent(index)
                .ok()
                .map(|percent| percent.min(100) as u8),
            mem_busy_percent: memory.map(|m| m.busy_percent.min(100) as u8),
            temperature_edge_celsius: temperature(&mut smi, RsmiTemperatureType::Edge),
            temperature_junction_celsius: temperature(&mut smi, RsmiTemperatureType::Junction),
            temperature_mem_celsius: temperature(&mut smi, RsmiTemperatureType::Memory),
            power_average_watts: raw_u64(|out| {
                // SAFETY: a valid out-pointer; sensor 0 is the board's average power, in µW.
                unsafe { rocm_smi_lib::rsmi_dev_power_ave_get(index, 0, out) }
            })
            .map(|microwatts| microwatts as f64 / 1e6),
        };
        // SAFETY (both): valid out-pointers.
        let slot = raw_u64(|out| unsafe { rocm_smi_lib::rsmi_dev_pci_id_get(index, out) }).map(pci_slot);
        let mut device_id = 0u16;
        // SAFETY: a valid out-pointer.
        if unsafe { rocm_smi_lib::rsmi_dev_id_get(index, &mut device_id) } != SUCCESS {
            device_id = 0;
        }
        readings.push(Reading {
            device: slot.clone().unwrap_or_else(|| format!("smi{index}")),
            card: None,
            pci_slot: slot,
            device_id,
            telemetry,
        });
    }
    Ok(readings)
}

#[cfg(test)]
mod tests {
    #[test]
    fn bdf_ids_print_as_pci_slots() {
        // Domain 0, bus 0xc1, device 0, function 0; and domain 1, bus 3, device 0x1f, function 7.
        assert_eq!(super::pci_slot(0xc1 << 8), "0000:c1:00.0");
        assert_eq!(
            super::pci_slot((1 << 32) | (3 << 8) | (0x1f << 3) | 7),
            "0001:03:1f.7"
        );
    }
}
