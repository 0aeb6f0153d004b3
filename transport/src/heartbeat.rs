//! The heartbeat check of control connections: a peer that has sent nothing for the idle
//! timeout (`heartbeat_ms` × `heartbeat_misses`) is taken for down, and its connection closed.
//!
//! QUIC's own idle timer cannot be trusted with this alone. RFC 9000 §10.1 (and quinn) stretch
//! it to at least three probe timeouts, and the probe timeout grows with the round-trip
//! estimate. A connection whose handshake waited on a stalled peer — a dialler's Initial queued
//! while the peer was paused, answered when it resumed — starts with a round-trip estimate as
//! long as the stall, so its idle timer runs for seconds: a peer that resumed for a moment and
//! stalled again was shown linked for the whole second stall (`pdkv chaos`, two pauses 11 ms
//! apart). Every live peer sends within a heartbeat (QUIC keep-alives, or acknowledgements of
//! ours), so counting the datagrams it sends is the check; QUIC's timer stays as the backstop.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::time::{Instant, MissedTickBehavior};

use crate::control::CLOSE_SILENT;

/// The check of one connection, running until the connection closes or this is dropped (the
/// check holds a handle to the connection, and quinn keeps a connection open while any handle
/// lives: an owner that drops it, say after a failed hello, must not leave it open).
#[derive(Debug)]
pub struct Watch {
    /// Why the check closed the connection, once it has (a local close reads only "closed").
    reason: Arc<OnceLock<String>>,
    task: tokio::task::AbortHandle,
}

impl Watch {
    /// The reason, if the check closed the connection.
    pub fn reason(&self) -> Option<&str> {
        self.reason.get().map(String::as_str)
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Watches `connection` until it closes, closing it once the peer has sent no datagram for
/// `idle_timeout`; looks every `idle_timeout / 4` (so a silent peer is taken for down within
/// 1.25 × `idle_timeout`). Spawns on the current tokio runtime.
pub fn watch(connection: quinn::Connection, idle_timeout: Duration) -> Watch {
    let reason = Arc::new(OnceLock::new());
    let found = reason.clone();
    let task = tokio::spawn(async move {
        let mut ticks = tokio::time::interval((idle_timeout / 4).max(Duration::from_millis(1)));
        ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut received = connection.stats().udp_rx.datagrams;
        let mut last_heard = Instant::now();
        loop {
            tokio::select! {
                _ = connection.closed() => return,
                _ = ticks.tick() => {}
            }
            let now_received = connection.stats().udp_rx.datagrams;
            if now_received != received {
                received = now_received;
                last_heard = Instant::now();
                continue;
            }
            let silent = last_heard.elapsed();
            if silent >= idle_timeout {
                let reason = format!("peer silent for {} ms (heartbeats missed)", silent.as_millis());
                tracing::warn!(remote = %connection.remote_address(), %reason, "closing control connection");
                let _ = found.set(reason.clone());
                connection.close(CLOSE_SILENT.into(), reason.as_bytes());
                return;
            }
        }
    });
    Watch {
        reason,
        task: task.abort_handle(),
    }
}
