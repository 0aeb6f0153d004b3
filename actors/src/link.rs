//! Links: how one node's wire messages reach another, in one process or across hosts.
//!
//! A node (a leg's exchange actor, or the router) is a *door*: it admits peers from their
//! [`Hello`] and receives [`Inbound`] envelopes, each tagged with the peer the link
//! authenticated. Two kinds of [`Link`] carry envelopes to a door:
//! - [`LocalLink`]: the peer's mailbox in this process (`try_send`: a full mailbox refuses at
//!   once, it never queues without bound).
//! - [`QuicLink`]: the control plane under mutual TLS, one long-lived stream of frames per link;
//!   at most `in_flight` envelopes queued per link.
//!
//! Either way, delivery is best effort: the leg protocol survives a lost message through leases
//! and deadlines (the simulation in `pdkv_core::testing` checks it). [`Peers`] is the door's
//! table of admitted peers: it refuses an envelope whose sender is not the link's peer, or whose
//! incarnation is not the one the peer said hello with.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use actix::{Message, Recipient};
use pdkv_core::wire::{Body, Envelope, Incarnation, LinkFault, NodeId, RequestId};
use pdkv_transport::control::{ControlError, ControlService, FrameSender, Hello};

/// An envelope that arrived at a door over a link from `peer` (the name the link
/// authenticated, not the one the envelope claims).
#[derive(Debug, Message)]
#[rtype(result = "Result<(), Refusal>")]
pub struct Inbound {
    /// Who the link says sent it.
    pub peer: NodeId,
    /// The message.
    pub envelope: Envelope,
}

/// A peer said hello (at connection setup, or again after a restart).
#[derive(Debug, Message)]
#[rtype(result = "Result<(), Refusal>")]
pub struct Admit {
    /// The peer's hello.
    pub hello: Hello,
    /// The peer dialled this node (so its link to this node is up), rather than this node
    /// dialling it.
    pub dialed_in: bool,
}

/// A door's link to a peer went down: its connection closed (heartbeats missed, or the peer went
/// away). Requests that depend on that incarnation of the peer fail now, not at their deadline.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct LinkLost {
    /// The peer.
    pub peer: NodeId,
    /// The incarnation the link led to.
    pub incarnation: Incarnation,
    /// Why (the connection's close reason).
    pub reason: String,
}

/// Sets a door's link to an admitted peer (after dialling it, or in-process wiring).
#[derive(Message)]
#[rtype(result = "()")]
pub struct SetLink {
    /// The peer.
    pub peer: NodeId,
    /// The link.
    pub link: Arc<dyn Link>,
}

/// Why a door refused a peer or an envelope: the node's own type, so a refusal by the door
/// (link checks) and by the leg's rules (`pdkv_core::node`) read alike.
pub use pdkv_core::node::Refusal;

/// Why a link could not take an envelope.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LinkError {
    /// The node has no link to that peer.
    #[error("no link to {0}")]
    NoLink(NodeId),
    /// Too many envelopes are in flight (or queued) on the link.
    #[error("link to {to} is full")]
    Full {
        /// The peer.
        to: NodeId,
    },
    /// The peer is gone (its actors stopped, its connection closed).
    #[error("link to {to} is closed: {detail}")]
    Closed {
        /// The peer.
        to: NodeId,
        /// Why.
        detail: String,
    },
}

impl LinkError {
    /// What went wrong, as the wire names it.
    pub fn fault(&self) -> LinkFault {
        match self {
            LinkError::NoLink(_) => LinkFault::NoLink,
            LinkError::Full { .. } => LinkFault::Full,
            LinkError::Closed { .. } => LinkFault::Closed,
        }
    }
}

/// Logs a door's refusal of an envelope: a link's sender does not wait for the answer, so this
/// line is where a refusal shows.
pub fn log_refusal(peer: &NodeId, request: RequestId, kind: &'static str, refusal: &Refusal) {
    tracing::warn!(%peer, %request, kind, %refusal, "refused a message");
}

/// Carries envelopes to one peer.
pub trait Link: Send + Sync + 'static {
    /// Hands `envelope` to the link without waiting for delivery; refuses at once when the link
    /// is full or closed.
    fn send(&self, envelope: Envelope) -> Result<(), LinkError>;
}

/// A link to a door in this process: its mailbox.
pub struct LocalLink {
    from: NodeId,
    to: NodeId,
    inbox: Recipient<Inbound>,
}

impl LocalLink {
    /// A link from node `from` to the door `inbox` of node `to`.
    pub fn new(from: NodeId, to: NodeId, inbox: Recipient<Inbound>) -> Self {
        LocalLink { from, to, inbox }
    }
}

impl Link for LocalLink {
    fn send(&self, envelope: Envelope) -> Result<(), LinkError> {
        let message = Inbound {
            peer: self.from.clone(),
            envelope,
        };
        self.inbox.try_send(message).map_err(|error| match error {
            actix::prelude::SendError::Full(_) => LinkError::Full { to: self.to.clone() },
            actix::prelude::SendError::Closed(_) => LinkError::Closed {
                to: self.to.clone(),
                detail: "its actors stopped".into(),
            },
        })
    }
}

/// A link over an admitted QUIC connection: one long-lived stream of frames. A send takes a
/// place among at most `in_flight` and writes its frame from the sender's own thread, in order
/// (the stream sits behind a fair lock): at once when the stream can take it, else from a task
/// on that thread; quinn's driver (on the node's thread, or the transport runtime with
/// `control_thread = "transport"`) puts it on the wire. The peer's door
/// takes frames in order without answering them; a refusal is logged on its side (the
/// protocol's deadlines cover it).
pub struct QuicLink {
    to: NodeId,
    frames: Arc<tokio::sync::Mutex<FrameSender>>,
    in_flight: Arc<tokio::sync::Semaphore>,
    timeout: Duration,
}

impl QuicLink {
    /// A link writing to `frames` (a stream opened on the connection to `to`), at most
    /// `in_flight` envelopes outstanding, each write bounded by `timeout`.
    pub fn new(to: NodeId, frames: FrameSender, in_flight: usize, timeout: Duration) -> Self {
        QuicLink {
            to,
            frames: Arc::new(tokio::sync::Mutex::new(frames)),
            in_flight: Arc::new(tokio::sync::Semaphore::new(in_flight.max(1))),
            timeout,
        }
    }
}

impl Link for QuicLink {
    fn send(&self, envelope: Envelope) -> Result<(), LinkError> {
        let permit = self
            .in_flight
            .clone()
            .try_acquire_owned()
            .map_err(|_| LinkError::Full { to: self.to.clone() })?;
        let (to, request, kind) = (self.to.clone(), envelope.request, envelope.body.kind());
        let telemetry = matches!(envelope.body, Body::Load(_));
        let locked = self.frames.clone().lock_owned();
        let mut write: Pin<Box<dyn Future<Output = Result<(), ControlError>>>> =
            Box::pin(async move { locked.await.send(envelope).await });
        // Polled once here: the frame takes its place in the (fair) lock's queue in send order,
        // and when no earlier frame is still being written and the stream has credit, it is
        // written now, with no task to spawn and no wake-up. A later poll registers its own
        // waker in place of the no-op one.
        if let Poll::Ready(written) = write.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
            report_write(&to, request, kind, telemetry, Ok(written));
            return Ok(());
        }
        let timeout = self.timeout;
        tokio::task::spawn_local(async move {
            let _permit = permit;
            let written = tokio::time::timeout(timeout, write).await;
            report_write(&to, request, kind, telemetry, written);
        });
        Ok(())
    }
}

/// Logs a frame the link could not put on its stream (the protocol's deadlines cover its loss).
/// A lost load report or heartbeat is routine when a peer goes away (its loss is logged as such),
/// so only a request's messages are warned about.
fn report_write(
    to: &NodeId,
    request: RequestId,
    kind: &'static str,
    telemetry: bool,
    written: Result<Result<(), ControlError>, tokio::time::error::Elapsed>,
) {
    let failure = match written {
        Ok(Ok(())) => return,
        Ok(Err(error)) => error.to_string(),
        Err(_) => "the write timed out".to_string(),
    };
    if telemetry {
        tracing::debug!(%to, kind, %failure, "message not delivered");
    } else {
        tracing::warn!(%to, %request, kind, %failure, "message not delivered");
    }
}

/// Told the hello of every peer a control server admits (a node's dialer uses it to dial back
/// at once, and its readiness to know the peer has dialled in).
pub type OnAdmit = Arc<dyn Fn(&Hello) + Send + Sync>;

/// The control-plane service of a node: admits peers and hands their envelopes to its door,
/// awaiting the door's answer.
pub struct DoorService {
    admit: Recipient<Admit>,
    inbound: Recipient<Inbound>,
    on_admit: Option<OnAdmit>,
}

impl DoorService {
    /// A service for the door behind `admit` and `inbound`.
    pub fn new(admit: Recipient<Admit>, inbound: Recipient<Inbound>) -> Self {
        DoorService {
            admit,
            inbound,
            on_admit: None,
        }
    }

    /// Also calls `on_admit` with every peer admitted.
    pub fn with_on_admit(mut self, on_admit: OnAdmit) -> Self {
        self.on_admit = Some(on_admit);
        self
    }
}

impl ControlService for DoorService {
    type Request = Envelope;
    type Response = ();

    async fn admit(&self, hello: &Hello) -> Result<(), String> {
        let message = Admit {
            hello: hello.clone(),
            dialed_in: true,
        };
        match self.admit.send(message).await {
            Ok(Ok(())) => {
                if let Some(on_admit) = &self.on_admit {
                    on_admit(hello);
                }
                Ok(())
            }
            Ok(Err(refusal)) => Err(refusal.to_string()),
            Err(error) => Err(format!("node unavailable: {error}")),
        }
    }

    async fn handle(&self, peer: &NodeId, envelope: Envelope) -> Result<(), String> {
        let message = Inbound {
            peer: peer.clone(),
            envelope,
        };
        match self.inbound.send(message).await {
            Ok(result) => result.map_err(|refusal| refusal.to_string()),
            Err(error) => Err(format!("node unavailable: {error}")),
        }
    }

    /// Hands a link's frame to the door without awaiting its answer (the door logs a refusal
    /// itself), so the transport thread need not wake again for it; waits only while the door's
    /// mailbox is full.
    async fn deliver(&self, peer: &NodeId, envelope: Envelope) {
        let message = Inbound {
            peer: peer.clone(),
            envelope,
        };
        let unavailable = match self.inbound.try_send(message) {
            Ok(()) => return,
            Err(actix::prelude::SendError::Full(message)) => match self.inbound.send(message).await {
                Ok(_) => return,
                Err(error) => error.to_string(),
            },
            Err(actix::prelude::SendError::Closed(_)) => "its actors stopped".to_string(),
        };
        tracing::warn!(%peer, reason = %unavailable, "message not taken: node unavailable");
    }
}

struct Peer {
    hello: Hello,
    link: Option<Arc<dyn Link>>,
    /// This incarnation dialled us: it has a link here.
    dialed_in: bool,
}

/// A door's admitted peers and its links to them.
pub struct Peers {
    node: NodeId,
    incarnation: Incarnation,
    peers: HashMap<NodeId, Peer>,
}

impl Peers {
    /// An empty table for node `node` of incarnation `incarnation`.
    pub fn new(node: NodeId, incarnation: Incarnation) -> Self {
        Peers {
            node,
            incarnation,
            peers: HashMap::new(),
        }
    }

    /// This node.
    pub fn node(&self) -> &NodeId {
        &self.node
    }

    /// This node's incarnation.
    pub fn incarnation(&self) -> Incarnation {
        self.incarnation
    }

    /// Admits (or re-admits) a peer; `dialed_in` when it dialled this node. Returns the
    /// incarnation it replaces, if the peer restarted: everything promised by the old one is
    /// void.
    pub fn admit(&mut self, hello: Hello, dialed_in: bool) -> Option<Incarnation> {
        let node = hello.node.clone();
        match self.peers.get_mut(&node) {
            Some(peer) => {
                let old = peer.hello.incarnation;
                if old != hello.incarnation {
                    // A new process: the old links went with the old connections.
                    peer.link = None;
                    peer.dialed_in = false;
                }
                peer.dialed_in |= dialed_in;
                peer.hello = hello;
                (old != peer.hello.incarnation).then_some(old)
            }
            None => {
                let peer = Peer {
                    hello,
                    link: None,
                    dialed_in,
                };
                self.peers.insert(node, peer);
                None
            }
        }
    }

    /// Forgets the link to `node` if it still leads to `incarnation`; whether it did.
    pub fn drop_link(&mut self, node: &NodeId, incarnation: Incarnation) -> bool {
        match self.peers.get_mut(node) {
            Some(peer) if peer.hello.incarnation == incarnation && peer.link.is_some() => {
                peer.link = None;
                true
            }
            _ => false,
        }
    }

    /// Sets the link to an admitted peer.
    pub fn set_link(&mut self, node: &NodeId, link: Arc<dyn Link>) {
        if let Some(peer) = self.peers.get_mut(node) {
            peer.link = Some(link);
        }
    }

    /// The hello of an admitted peer.
    pub fn hello(&self, node: &NodeId) -> Option<&Hello> {
        self.peers.get(node).map(|peer| &peer.hello)
    }

    /// Every admitted peer's hello.
    pub fn hellos(&self) -> impl Iterator<Item = &Hello> {
        self.peers.values().map(|peer| &peer.hello)
    }

    /// The hellos of admitted peers linked both ways: this node has a link to them and they
    /// dialled this node (they can answer).
    pub fn linked_hellos(&self) -> impl Iterator<Item = &Hello> {
        self.peers
            .values()
            .filter(|peer| peer.link.is_some() && peer.dialed_in)
            .map(|peer| &peer.hello)
    }

    /// Checks that an envelope really comes from an admitted incarnation of the link's peer.
    pub fn check(&self, inbound: &Inbound) -> Result<(), Refusal> {
        let envelope = &inbound.envelope;
        if envelope.from != inbound.peer {
            return Err(Refusal::Impersonation {
                peer: inbound.peer.clone(),
                claimed: envelope.from.clone(),
            });
        }
        let peer = self
            .peers
            .get(&envelope.from)
            .ok_or_else(|| Refusal::UnknownPeer(envelope.from.clone()))?;
        if peer.hello.incarnation != envelope.incarnation {
            return Err(Refusal::StaleIncarnation {
                node: envelope.from.clone(),
                got: envelope.incarnation,
                known: peer.hello.incarnation,
            });
        }
        Ok(())
    }

    /// Sends `body` about `request` to `to`, with `budget_ms` of the request's time left.
    pub fn send(&self, to: &NodeId, request: RequestId, budget_ms: u64, body: Body) -> Result<(), LinkError> {
        let link = self
            .peers
            .get(to)
            .and_then(|peer| peer.link.as_ref())
            .ok_or_else(|| LinkError::NoLink(to.clone()))?;
        link.send(Envelope {
            request,
            from: self.node.clone(),
            incarnation: self.incarnation,
            budget_ms,
            body,
        })
    }
}

#[cfg(test)]
mod tests {
    use pdkv_core::plan::RegionLayout;

    use super::*;

    struct Dropped;

    impl Link for Dropped {
        fn send(&self, _envelope: Envelope) -> Result<(), LinkError> {
            Ok(())
        }
    }

    fn hello(node: &str, incarnation: u64) -> Hello {
        Hello {
            node: NodeId(node.into()),
            role: pdkv_core::wire::Role::Prefill,
            incarnation: Incarnation(incarnation),
            regions: RegionLayout::default(),
            protocol_version: 1,
            layout_hash: 0,
            model: pdkv_core::identity::ModelFields::default(),
            engines: Vec::new(),
            host: String::new(),
        }
    }

    fn linked(peers: &Peers) -> Vec<String> {
        let mut names: Vec<String> = peers.linked_hellos().map(|hello| hello.node.0.clone()).collect();
        names.sort();
        names
    }

    /// A peer is chosen for requests only once both directions are up: this node's link to it,
    /// and its own dial here (its way to answer). A restart needs both again.
    #[test]
    fn only_peers_linked_both_ways_take_requests() {
        let mut peers = Peers::new(NodeId("router".into()), Incarnation(1));
        let p = NodeId("p".into());
        assert_eq!(peers.admit(hello("p", 7), false), None);
        peers.set_link(&p, Arc::new(Dropped));
        assert!(
            linked(&peers).is_empty(),
            "p never dialled in: it could not answer"
        );
        assert_eq!(peers.admit(hello("p", 7), true), None);
        assert_eq!(linked(&peers), ["p"]);
        // Admitted again from our own dial: still linked both ways.
        assert_eq!(peers.admit(hello("p", 7), false), None);
        assert_eq!(linked(&peers), ["p"]);
        // A new incarnation: both directions are gone until re-established.
        assert_eq!(peers.admit(hello("p", 8), true), Some(Incarnation(7)));
        assert!(linked(&peers).is_empty(), "no link to the new process yet");
        peers.set_link(&p, Arc::new(Dropped));
        assert_eq!(linked(&peers), ["p"]);
        assert_eq!(peers.admit(hello("p", 9), false), Some(Incarnation(8)));
        peers.set_link(&p, Arc::new(Dropped));
        assert!(
            linked(&peers).is_empty(),
            "the new process has not dialled in yet"
        );
    }
}
