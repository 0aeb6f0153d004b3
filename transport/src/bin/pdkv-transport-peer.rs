//! `pdkv-transport-peer`: a prefill-side node for transport tests and benches.
//!
//! It registers KV regions in shared memory (filled with a known pattern) with a shared-memory
//! engine and a network memory server, serves the mutually authenticated QUIC control plane
//! (handshake, tickets, grant requests), prints `READY <control address>` and runs until its
//! standard input closes (or 120 s pass).
//!
//! Usage: `pdkv-transport-peer --certs DIR --name NODE --cluster NODE,NODE,...`

use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use pdkv_core::grant::GrantTable;
use pdkv_core::plan::RegionLayout;
use pdkv_core::wire::{NodeId, RequestId, Role};
use pdkv_transport::clock::MonotonicClock;
use pdkv_transport::codec::PROTOCOL_VERSION;
use pdkv_transport::control::{
    ControlLimits, ControlServer, ControlService, EngineAdvert, Hello, ServerSetup, TransportRuntime,
    new_incarnation,
};
use pdkv_transport::engine::{EngineKey, ReadEngine};
use pdkv_transport::mapped::MappedEngine;
use pdkv_transport::net::{GrantAuthorizer, MemoryServer, MemoryServerLimits, NetEngine, TicketBook};
use pdkv_transport::region::Region;
use pdkv_transport::tls::NodeIdentity;

#[path = "../../tests/support/peer_protocol.rs"]
mod peer_protocol;

use peer_protocol::{BLOCK_BYTES, BLOCKS, LAYERS, PeerRequest, PeerResponse, layout, pattern_byte};

struct PeerService {
    grants: Arc<Mutex<GrantTable>>,
    clock: MonotonicClock,
    layers: Vec<Arc<Region>>,
    generations: Arc<Region>,
    next_request: Mutex<u64>,
}

impl ControlService for PeerService {
    type Request = PeerRequest;
    type Response = PeerResponse;

    async fn handle(&self, peer: &NodeId, request: PeerRequest) -> Result<PeerResponse, String> {
        match request {
            PeerRequest::Grant { blocks, lease_ms } => {
                let mut next = self.next_request.lock().unwrap_or_else(PoisonError::into_inner);
                *next += 1;
                let generations = blocks
                    .iter()
                    .map(|&block| self.generations.load_u32(block as usize))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|error| error.to_string())?;
                let grant = self
                    .grants
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .issue(
                        RequestId(*next),
                        peer.clone(),
                        vec![blocks],
                        lease_ms,
                        self.clock.now_ms(),
                    )
                    .map_err(|error| error.to_string())?;
                Ok(PeerResponse::Granted { grant, generations })
            }
            PeerRequest::Release { grant } => {
                self.grants
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .release(grant, peer)
                    .map_err(|error| error.to_string())?;
                Ok(PeerResponse::Released)
            }
            PeerRequest::Reuse { block } => {
                let generation = self
                    .generations
                    .load_u32(block as usize)
                    .map_err(|error| error.to_string())?
                    + 1;
                self.generations
                    .store_u32(block as usize, generation)
                    .map_err(|error| error.to_string())?;
                for layer in &self.layers {
                    layer
                        .write(u64::from(block) * BLOCK_BYTES, &vec![0xEE; BLOCK_BYTES as usize])
                        .map_err(|error| error.to_string())?;
                }
                Ok(PeerResponse::Reused { generation })
            }
        }
    }
}

fn argument(args: &[String], name: &str) -> Result<String, String> {
    args.iter()
        .position(|arg| arg == name)
        .and_then(|index| args.get(index + 1))
        .cloned()
        .ok_or_else(|| format!("missing {name} (usage: --certs DIR --name NODE --cluster NODE,NODE,...)"))
}

fn run() -> Result<(), String> {
    let args: Vec<String> = std::env::args().collect();
    let certs = argument(&args, "--certs")?;
    let name = argument(&args, "--name")?;
    let cluster: Vec<NodeId> = argument(&args, "--cluster")?
        .split(',')
        .map(|node| NodeId(node.to_string()))
        .collect();
    let identity =
        NodeIdentity::load(std::path::Path::new(&certs), &name).map_err(|error| error.to_string())?;
    let runtime = TransportRuntime::new(2).map_err(|error| error.to_string())?;
    let region_bytes = (u64::from(BLOCKS) + 1) * BLOCK_BYTES;
    let mut layers = Vec::new();
    for layer in 0..LAYERS {
        let region = Region::shared(&format!("{name}-layer{layer}"), region_bytes as usize)
            .map_err(|e| e.to_string())?;
        let bytes: Vec<u8> = (0..region_bytes)
            .map(|offset| pattern_byte(layer, offset))
            .collect();
        region.write(0, &bytes).map_err(|error| error.to_string())?;
        layers.push(Arc::new(region));
    }
    let generations = Arc::new(
        Region::shared(&format!("{name}-generations"), (BLOCKS as usize + 1) * 4)
            .map_err(|e| e.to_string())?,
    );
    let mut all: Vec<Arc<Region>> = layers.clone();
    all.push(generations.clone());

    let shm = MappedEngine::shm(EngineKey(name.clone())).map_err(|error| error.to_string())?;
    let grants = Arc::new(Mutex::new(GrantTable::new(64)));
    let clock = MonotonicClock::new();
    let regions =
        RegionLayout::region_per_layer(&[BLOCK_BYTES; LAYERS], BLOCKS + 1).with_generation_tables(1);
    let authorizer = Arc::new(GrantAuthorizer::new(
        grants.clone(),
        layout(),
        regions.clone(),
        clock,
    ));
    let tickets = Arc::new(TicketBook::new(Duration::from_secs(10), 64));
    let served: HashMap<u32, Arc<Region>> = all
        .iter()
        .enumerate()
        .map(|(id, region)| (id as u32, region.clone()))
        .collect();
    let bind: SocketAddr = "127.0.0.1:0"
        .parse()
        .map_err(|_| "bad bind address".to_string())?;
    let memory_server = MemoryServer::start(
        &runtime.handle(),
        bind,
        served,
        authorizer,
        tickets.clone(),
        MemoryServerLimits::default(),
    )
    .map_err(|error| error.to_string())?;
    let net = NetEngine::new(
        EngineKey(name.clone()),
        runtime.handle(),
        memory_server.local_addr().to_string(),
    );
    let mut shm_regions = Vec::new();
    let mut net_regions = Vec::new();
    for (id, region) in all.iter().enumerate() {
        shm_regions.push(
            shm.register(id as u32, region.clone())
                .map_err(|error| error.to_string())?,
        );
        net_regions.push(
            net.register(id as u32, region.clone())
                .map_err(|error| error.to_string())?,
        );
    }
    let hello = Hello {
        node: NodeId(name.clone()),
        role: Role::Prefill,
        incarnation: new_incarnation().map_err(|error| error.to_string())?,
        regions: regions.clone(),
        protocol_version: PROTOCOL_VERSION,
        layout_hash: layout().compat_hash(),
        model: pdkv_core::identity::ModelFields::new(layout().identity_fields()).unwrap(),
        engines: vec![
            EngineAdvert {
                engine: shm.descriptor(),
                regions: shm_regions,
            },
            EngineAdvert {
                engine: net.descriptor(),
                regions: net_regions,
            },
        ],
        host: pdkv_transport::host::host_id(),
    };
    let service = Arc::new(PeerService {
        grants,
        clock,
        layers,
        generations,
        next_request: Mutex::new(0),
    });
    let setup = ServerSetup {
        cluster,
        hello,
        service,
        tickets: Some(tickets),
        limits: ControlLimits::default(),
    };
    let server =
        ControlServer::start(&runtime.handle(), bind, &identity, setup).map_err(|error| error.to_string())?;
    let address = server.local_addr().map_err(|error| error.to_string())?;
    println!("READY {address}");
    std::io::stdout().flush().map_err(|error| error.to_string())?;
    // Run until the parent closes our stdin, bounded so a lost parent cannot leave us running.
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            if line.is_err() {
                break;
            }
        }
        let _ = done_tx.send(());
    });
    let _ = done_rx.recv_timeout(Duration::from_secs(120));
    server.close();
    drop(memory_server);
    Ok(())
}

fn main() {
    if let Err(error) = run() {
        eprintln!("error: {error}");
        std::process::exit(1);
    }
}
