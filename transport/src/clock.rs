//! A monotonic millisecond clock: the `now_ms` that grants, leases and tickets are measured
//! with, shared by the allocator shell and the memory server so both see the same lease time.

use std::time::Instant;

/// A millisecond clock shared by whoever issues grants and whoever checks them.
#[derive(Debug, Clone, Copy)]
pub struct MonotonicClock {
    epoch: Instant,
}

impl MonotonicClock {
    /// A clock starting now.
    pub fn new() -> Self {
        MonotonicClock {
            epoch: Instant::now(),
        }
    }

    /// Milliseconds since the clock started.
    pub fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}
