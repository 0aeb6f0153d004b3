//! `[transport.mori]`: how the mori engine drives the NIC.

use serde::{Deserialize, Serialize};

use super::runs::NIC_MAX_MESSAGE_BYTES;

/// How mori's RDMA backend polls its completion queues.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PollMode {
    /// Worker threads spin on the completion queues (lowest latency; mori's and vLLM's default).
    #[default]
    Polling,
    /// Worker threads sleep until the NIC signals a completion.
    Event,
}

/// Settings of the mori READ engine (defaults follow mori's tuning guide for 400G NICs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MoriSettings {
    /// TCP port of mori's own control plane on the node's host (mori fetches memory keys and
    /// queue-pair endpoints through it; no KV crosses it). 0 (default) picks a free port, which
    /// the handshake carries. A firewall between hosts must let it through.
    pub port: u16,
    /// Queue pairs per transfer. Default 8 (≥ 95% of a 400G link from 1 MiB up).
    pub qp_per_transfer: u32,
    /// Work requests posted per doorbell; -1 (default) lets mori choose.
    pub post_batch_size: i32,
    /// mori backend worker threads. Default 8.
    pub workers: u32,
    /// Completion polling: `polling` (default) or `event`.
    pub poll_mode: PollMode,
    /// READ batches one decode leg may have in flight; more are refused until one completes.
    /// Default 64.
    pub max_outstanding: usize,
    /// Largest single work request in bytes: merged runs are split at it. Default and maximum
    /// 2 GiB (mlx5's and bnxt's `max_msg_sz`).
    pub max_message_bytes: u64,
}

impl Default for MoriSettings {
    fn default() -> Self {
        MoriSettings {
            port: 0,
            qp_per_transfer: 8,
            post_batch_size: -1,
            workers: 8,
            poll_mode: PollMode::Polling,
            max_outstanding: 64,
            max_message_bytes: NIC_MAX_MESSAGE_BYTES,
        }
    }
}

/// A `[transport.mori]` value out of its range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("[transport.mori] {field} = {value} is out of range {range}")]
pub struct MoriSettingsError {
    /// The key.
    pub field: &'static str,
    /// Its value.
    pub value: String,
    /// The accepted range.
    pub range: &'static str,
}

impl MoriSettings {
    /// Checks every value is in range.
    pub fn validate(&self) -> Result<(), MoriSettingsError> {
        let out = |field, value: String, range| Err(MoriSettingsError { field, value, range });
        if !(1..=64).contains(&self.qp_per_transfer) {
            return out("qp_per_transfer", self.qp_per_transfer.to_string(), "1..=64");
        }
        if !(1..=64).contains(&self.workers) {
            return out("workers", self.workers.to_string(), "1..=64");
        }
        if self.post_batch_size != -1 && !(1..=4096).contains(&self.post_batch_size) {
            return out(
                "post_batch_size",
                self.post_batch_size.to_string(),
                "-1 or 1..=4096",
            );
        }
        if !(1..=4096).contains(&self.max_outstanding) {
            return out("max_outstanding", self.max_outstanding.to_string(), "1..=4096");
        }
        if !(4096..=NIC_MAX_MESSAGE_BYTES).contains(&self.max_message_bytes) {
            return out(
                "max_message_bytes",
                self.max_message_bytes.to_string(),
                "4096..=2147483648",
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_each_bound_names_its_key() {
        assert_eq!(MoriSettings::default().validate(), Ok(()));
        let bad = [
            (
                MoriSettings {
                    qp_per_transfer: 0,
                    ..Default::default()
                },
                "qp_per_transfer",
            ),
            (
                MoriSettings {
                    workers: 65,
                    ..Default::default()
                },
                "workers",
            ),
            (
                MoriSettings {
                    post_batch_size: 0,
                    ..Default::default()
                },
                "post_batch_size",
            ),
            (
                MoriSettings {
                    max_outstanding: 0,
                    ..Default::default()
                },
                "max_outstanding",
            ),
            (
                MoriSettings {
                    max_message_bytes: NIC_MAX_MESSAGE_BYTES + 1,
                    ..Default::default()
                },
                "max_message_bytes",
            ),
        ];
        for (settings, field) in bad {
            assert_eq!(settings.validate().unwrap_err().field, field);
        }
    }
}
