//! Entry points for pdkv's fuzz harness (`pdkv fuzz`): each runs the code a node runs on bytes a
//! peer sent — the frame reader, the control server's frame decoding and handshake check, the
//! memory server's hello and request handling — without the socket around it, so millions of
//! inputs run in seconds. Nothing here is a second implementation: the functions call the
//! same private code the servers call.

use std::collections::HashMap;
use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use pdkv_core::wire::{Envelope, GrantId, NodeId};

use crate::codec::{self, MAX_FRAME_BYTES, PROTOCOL_VERSION};
use crate::control::{Frame, Hello, check_compat};
use crate::net::{
    Answer, DataHello, DataRequest, MAX_HELLO_BYTES, MAX_REQUEST_BYTES, MemoryServerLimits, ReadAuthorizer,
    ServerState, Ticket, TicketBook, answer,
};
use crate::region::Region;

/// Polls a future that reads only from memory to its end; a future that is still pending after
/// a bound of polls is an error (reading from a slice never waits).
fn run_in_memory<T>(future: impl Future<Output = T>) -> Result<T, String> {
    let mut future = pin!(future);
    let mut context = Context::from_waker(Waker::noop());
    for _ in 0..1024 {
        if let Poll::Ready(value) = future.as_mut().poll(&mut context) {
            return Ok(value);
        }
    }
    Err("a read from memory did not finish".into())
}

/// Reads `stream` as a peer's stream of length-prefixed frames, as a control stream is read,
/// until it ends or a frame is refused; returns the frames read.
pub fn frames(stream: &[u8]) -> Result<usize, String> {
    let mut reader = stream;
    let mut count = 0;
    loop {
        match run_in_memory(codec::read_next_frame(&mut reader, MAX_FRAME_BYTES))? {
            Ok(Some(payload)) => {
                count += 1;
                // Each frame of a control stream is then decoded.
                let _ = codec::decode::<Frame<Envelope>>(&payload);
            }
            Ok(None) => return Ok(count),
            Err(error) => return Err(error.to_string()),
        }
    }
}

/// Decodes `payload` as the control server decodes a frame of a peer's stream — a hello, a
/// ticket request or a wire message — and checks a hello against `ours` as the handshake does.
/// Returns what it was.
pub fn control_frame(payload: &[u8], ours: &Hello) -> Result<&'static str, String> {
    match codec::decode::<Frame<Envelope>>(payload).map_err(|error| error.to_string())? {
        Frame::Hello(theirs) => {
            check_compat(ours, &theirs).map_err(|error| error.to_string())?;
            Ok("hello")
        }
        Frame::Ticket => Ok("ticket"),
        Frame::Request(envelope) => Ok(envelope.body.kind()),
    }
}

/// Valid control frames to start from: `ours` as a hello, a ticket request, and each of
/// `messages` (encoded wire envelopes) as a request.
pub fn control_seeds(ours: &Hello, messages: &[Vec<u8>]) -> Vec<Vec<u8>> {
    let mut seeds = Vec::new();
    for frame in [Frame::<Envelope>::Hello(ours.clone()), Frame::Ticket] {
        seeds.extend(codec::encode(&frame).ok());
    }
    for message in messages {
        if let Ok(envelope) = codec::decode::<Envelope>(message) {
            seeds.extend(codec::encode(&Frame::Request(envelope)).ok());
        }
    }
    seeds
}

/// A memory server's handling of hellos and requests, without its socket.
pub struct DataServerCore {
    state: ServerState,
}

impl DataServerCore {
    /// Serves `regions` as `authorizer` allows, redeeming tickets from `tickets`.
    pub fn new(
        regions: HashMap<u32, Arc<Region>>,
        authorizer: Arc<dyn ReadAuthorizer>,
        tickets: Arc<TicketBook>,
    ) -> Self {
        DataServerCore {
            state: ServerState {
                regions,
                authorizer,
                tickets,
                limits: MemoryServerLimits::default(),
            },
        }
    }

    /// Reads `stream` as the first frame of a data connection (the hello, bounded as the
    /// server bounds it), checks its protocol version and redeems its ticket; returns the
    /// node it names.
    pub fn hello(&self, stream: &[u8]) -> Result<NodeId, String> {
        let mut reader = stream;
        let hello: DataHello = run_in_memory(codec::read_message(&mut reader, MAX_HELLO_BYTES))?
            .map_err(|error| error.to_string())?;
        if hello.protocol_version != PROTOCOL_VERSION {
            return Err(format!("protocol version {}", hello.protocol_version));
        }
        self.state
            .tickets
            .redeem(&hello.ticket, &hello.node)
            .map_err(|error| error.to_string())?;
        Ok(hello.node)
    }

    /// Reads `stream` as one request frame from `peer` and answers it as the server does; for
    /// a READ, touches every byte the answer would send. Returns the bytes answered.
    pub fn request(&self, peer: &NodeId, stream: &[u8]) -> Result<u64, String> {
        let mut reader = stream;
        let request: DataRequest = run_in_memory(codec::read_message(&mut reader, MAX_REQUEST_BYTES))?
            .map_err(|error| error.to_string())?;
        match answer(&self.state, peer, request) {
            Answer::Refused(reason) => Err(reason),
            Answer::Words(words) => Ok(4 * words.len() as u64),
            Answer::Data { memory, runs } => {
                let mut total = 0u64;
                for (offset, len) in runs {
                    // SAFETY: nothing writes the fuzzer's regions.
                    let bytes =
                        unsafe { memory.bytes(offset, len as usize) }.map_err(|error| error.to_string())?;
                    std::hint::black_box(bytes);
                    total += len;
                }
                Ok(total)
            }
        }
    }
}

/// Valid data-plane frames to start from: a hello from `node` with `ticket`, READs of `runs`
/// of `region` and a read of generation words `indices` of `words_region`, under `grant`.
pub fn data_seeds(
    node: &NodeId,
    ticket: Ticket,
    grant: GrantId,
    region: u32,
    runs: &[(u64, u64)],
    words_region: u32,
    indices: &[u32],
) -> Vec<Vec<u8>> {
    let hello = DataHello {
        node: node.clone(),
        protocol_version: PROTOCOL_VERSION,
        ticket,
    };
    let mut seeds: Vec<Vec<u8>> = codec::encode(&hello)
        .ok()
        .map(|bytes| codec::frame(&bytes))
        .into_iter()
        .collect();
    let requests = [
        DataRequest::Read {
            grant,
            region,
            runs: runs.to_vec(),
        },
        DataRequest::Words {
            grant,
            region: words_region,
            indices: indices.to_vec(),
        },
    ];
    for request in requests {
        seeds.extend(codec::encode(&request).ok().map(|bytes| codec::frame(&bytes)));
    }
    seeds
}
