//! The prefill worker's hand-offs: which finished requests' blocks a decode worker may READ, for
//! how long, and when vLLM may free them. A thin layer over pdkv's one grant table
//! ([`GrantTable`]): a hand-off is a grant issued to whoever claims it first, named by vLLM's
//! request id. Sans-IO: time enters as `now_ms`, and what must happen to memory (bump the
//! blocks' generations) comes back as an [`Ended`] the shell acts on before it tells vLLM the
//! request is done.
//!
//! A hand-off is announced when vLLM finishes a prefill and keeps the blocks (delayed free). Its
//! lease starts then, so a decode worker that never comes cannot pin blocks forever. The first
//! decode worker to claim it owns it (claims renew the lease); it ends on that worker's release,
//! on lease expiry, or on revocation (abort, shutdown).

use std::collections::{HashMap, VecDeque};

use pdkv_core::block::{BlockId, NULL_BLOCK};
pub use pdkv_core::grant::Ending;
use pdkv_core::grant::{Grant, GrantError, GrantTable};
use pdkv_core::wire::{GrantId, NodeId, RequestId};

/// A hand-off that ended: bump its blocks' generations, then tell vLLM the request is done.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ended {
    /// vLLM's request id.
    pub request: String,
    /// Its blocks, per group (never the null block).
    pub blocks: Vec<Vec<BlockId>>,
    /// Why it ended.
    pub how: Ending,
}

/// Why a hand-off operation was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandoffError {
    /// The request is already handed off.
    #[error("request {0} is already handed off")]
    Duplicate(String),
    /// The table is full.
    #[error("{max} hand-offs are live already; request {request} is not handed off")]
    Full {
        /// The request refused.
        request: String,
        /// The bound.
        max: usize,
    },
    /// A lease of zero would end before any decode worker could READ.
    #[error("a hand-off lease must be longer than 0 ms")]
    ZeroLease,
    /// Nothing was announced under this request id (yet, or ever).
    #[error("no hand-off of request {0} is known")]
    Unknown(String),
    /// The hand-off ended.
    #[error("the hand-off of request {request} {how}")]
    Ended {
        /// The request.
        request: String,
        /// How.
        how: Ending,
    },
    /// The grant table refused for a reason of its own.
    #[error("request {request}: {source}")]
    Grant {
        /// The request.
        request: String,
        /// The table's refusal.
        source: GrantError,
    },
    /// Another decode worker claimed it first.
    #[error("request {request} is claimed by {owner}, not {peer}")]
    ClaimedByOther {
        /// The request.
        request: String,
        /// Its owner.
        owner: String,
        /// Who asked.
        peer: String,
    },
}

/// A claimed hand-off.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    /// The grant its READs name.
    pub grant: GrantId,
    /// Its blocks per group.
    pub blocks: Vec<Vec<BlockId>>,
    /// When its lease lapses unless claimed again.
    pub expires_at_ms: u64,
}

/// How many ended hand-offs are remembered by name (so a late claim learns why it was refused).
const REMEMBERED_ENDINGS: usize = 4096;

/// The live hand-offs of one prefill worker.
#[derive(Debug)]
pub struct Handoffs {
    table: GrantTable,
    /// Live hand-offs: vLLM's request id → its grant.
    live: HashMap<String, GrantId>,
    /// Live grants → vLLM's request id.
    names: HashMap<GrantId, String>,
    /// Ended hand-offs' last grant by request id, oldest first (bounded), for [`Self::missing`].
    ended: VecDeque<String>,
    ended_grant: HashMap<String, GrantId>,
    /// The grant table's request ids (vLLM's ids are strings; the table's are serials).
    next_request: u64,
    lease_ms: u64,
    max_live: usize,
}

impl Handoffs {
    /// A table of at most `max_live` hand-offs, each leased for `lease_ms` from its announcement
    /// or its last claim.
    pub fn new(lease_ms: u64, max_live: usize) -> Result<Self, HandoffError> {
        if lease_ms == 0 {
            return Err(HandoffError::ZeroLease);
        }
        Ok(Handoffs {
            table: GrantTable::new(max_live),
            live: HashMap::new(),
            names: HashMap::new(),
            ended: VecDeque::new(),
            ended_grant: HashMap::new(),
            next_request: 1,
            lease_ms,
            max_live,
        })
    }

    /// Hands off `request`'s `blocks` (per group; null blocks are dropped, they hold nothing).
    pub fn announce(
        &mut self,
        request: &str,
        blocks: Vec<Vec<BlockId>>,
        now_ms: u64,
    ) -> Result<(), HandoffError> {
        if self.live.contains_key(request) {
            return Err(HandoffError::Duplicate(request.to_string()));
        }
        let blocks: Vec<Vec<BlockId>> = blocks
            .into_iter()
            .map(|group| group.into_iter().filter(|&block| block != NULL_BLOCK).collect())
            .collect();
        let serial = RequestId(self.next_request);
        let grant = match self.table.issue_unclaimed(serial, blocks, self.lease_ms, now_ms) {
            Ok(grant) => grant,
            Err(GrantError::TableFull { .. }) => {
                return Err(HandoffError::Full {
                    request: request.to_string(),
                    max: self.max_live,
                });
            }
            Err(GrantError::ZeroLease) => return Err(HandoffError::ZeroLease),
            Err(source) => {
                return Err(HandoffError::Grant {
                    request: request.to_string(),
                    source,
                });
            }
        };
        self.next_request += 1;
        self.live.insert(request.to_string(), grant);
        self.names.insert(grant, request.to_string());
        Ok(())
    }

    /// `peer` claims `request` as one of `readers` decode workers (several when the legs shard
    /// KV heads over different tensor-parallel sizes): the first claim fixes the readers, each
    /// reader takes a place, and every claim by a reader renews the lease. Returns the grant its
    /// READs name, the blocks and the lease's new end.
    pub fn claim(
        &mut self,
        request: &str,
        peer: &NodeId,
        readers: u32,
        now_ms: u64,
    ) -> Result<Claim, HandoffError> {
        let Some(&grant) = self.live.get(request) else {
            return Err(self.missing(request));
        };
        let expires_at_ms = self
            .table
            .claim_shared(grant, peer, readers, now_ms)
            .map_err(|error| self.refusal(request, grant, peer, error))?;
        let blocks = self
            .table
            .get(grant)
            .map(|live| live.blocks.clone())
            .unwrap_or_default();
        Ok(Claim {
            grant,
            blocks,
            expires_at_ms,
        })
    }

    /// Whether `peer` may READ `block` of `group` under `grant` now: its owner, a live lease,
    /// a block of the hand-off.
    pub fn check_read(
        &self,
        grant: GrantId,
        peer: &NodeId,
        group: usize,
        block: BlockId,
        now_ms: u64,
    ) -> Result<(), GrantError> {
        self.table.check_read(grant, peer, group, block, now_ms)
    }

    /// Whether `peer` may read the generation word of `block` under `grant`: its owner, a block
    /// of the hand-off in any group (vLLM's groups share one block pool, hence one table).
    pub fn check_word(&self, grant: GrantId, peer: &NodeId, block: BlockId) -> Result<(), GrantError> {
        if self.table.held(grant, peer)?.covers_in_any_group(block) {
            Ok(())
        } else {
            Err(GrantError::OutsideGrant {
                id: grant,
                group: 0,
                block,
            })
        }
    }

    /// `peer` is done reading `request` (a reader, or anyone if nobody claimed it). The hand-off
    /// ends, and is returned, when this was its last reader; `None` while others still read.
    pub fn release(&mut self, request: &str, peer: &NodeId) -> Result<Option<Ended>, HandoffError> {
        let Some(&grant) = self.live.get(request) else {
            return Err(self.missing(request));
        };
        let released = self
            .table
            .release(grant, peer)
            .map_err(|error| self.refusal(request, grant, peer, error))?;
        Ok(released.map(|released| self.ended(released, Ending::Released)))
    }

    /// Ends `request`'s hand-off from the prefill side, if it is live.
    pub fn revoke(&mut self, request: &str) -> Option<Ended> {
        let grant = *self.live.get(request)?;
        let revoked = self.table.revoke(grant)?;
        Some(self.ended(revoked, Ending::Revoked))
    }

    /// Ends every live hand-off (shutdown).
    pub fn revoke_all(&mut self) -> Vec<Ended> {
        let revoked = self.table.revoke_all();
        revoked
            .into_iter()
            .map(|grant| self.ended(grant, Ending::Revoked))
            .collect()
    }

    /// Ends every hand-off whose lease lapsed at or before `now_ms`.
    pub fn expire(&mut self, now_ms: u64) -> Vec<Ended> {
        let expired = self.table.expire(now_ms);
        expired
            .into_iter()
            .map(|grant| self.ended(grant, Ending::Expired))
            .collect()
    }

    /// When the next lease lapses, if any is live.
    pub fn poll_timeout(&self) -> Option<u64> {
        self.table.poll_timeout()
    }

    /// Number of live hand-offs.
    pub fn len(&self) -> usize {
        self.live.len()
    }

    /// Forgets an ended grant's name, remembering (bounded) which grant it last was.
    fn ended(&mut self, grant: Grant, how: Ending) -> Ended {
        let request = self.names.remove(&grant.id).unwrap_or_default();
        self.live.remove(&request);
        if self.ended_grant.insert(request.clone(), grant.id).is_none() {
            self.ended.push_back(request.clone());
        }
        while self.ended.len() > REMEMBERED_ENDINGS {
            if let Some(oldest) = self.ended.pop_front() {
                self.ended_grant.remove(&oldest);
            }
        }
        Ended {
            request,
            blocks: grant.blocks,
            how,
        }
    }

    /// A claim or release of the live `grant` the table refused, in hand-off terms.
    fn refusal(&self, request: &str, grant: GrantId, peer: &NodeId, error: GrantError) -> HandoffError {
        match error {
            GrantError::WrongPeer { .. } => HandoffError::ClaimedByOther {
                request: request.to_string(),
                owner: self.table.get(grant).map_or_else(String::new, |live| {
                    let holders: Vec<String> = live.holders.iter().map(ToString::to_string).collect();
                    holders.join(", ")
                }),
                peer: peer.to_string(),
            },
            GrantError::Expired(_) => HandoffError::Ended {
                request: request.to_string(),
                how: Ending::Expired,
            },
            source @ (GrantError::ReadersMismatch { .. } | GrantError::NoReaders(_)) => HandoffError::Grant {
                request: request.to_string(),
                source,
            },
            _ => self.missing(request),
        }
    }

    /// Why `request` names no live hand-off: how it ended, while that is remembered.
    fn missing(&self, request: &str) -> HandoffError {
        let how = self
            .ended_grant
            .get(request)
            .and_then(|&grant| match self.table.missing(grant) {
                GrantError::Released(_) => Some(Ending::Released),
                GrantError::Expired(_) => Some(Ending::Expired),
                GrantError::Revoked(_) => Some(Ending::Revoked),
                _ => None,
            });
        match how {
            Some(how) => HandoffError::Ended {
                request: request.to_string(),
                how,
            },
            None => HandoffError::Unknown(request.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str) -> NodeId {
        NodeId(name.to_string())
    }

    #[test]
    fn a_claimed_handoff_renews_and_ends_on_its_owners_release() {
        let mut table = Handoffs::new(100, 8).unwrap();
        table.announce("r1", vec![vec![3, 0, 4], vec![9]], 1_000).unwrap();
        assert_eq!(table.poll_timeout(), Some(1_100));
        let claim = table.claim("r1", &node("d0"), 1, 1_050).unwrap();
        assert_eq!(
            claim.blocks,
            vec![vec![3, 4], vec![9]],
            "the null block is never handed off"
        );
        assert_eq!(claim.expires_at_ms, 1_150);
        let grant = claim.grant;
        assert_eq!(table.check_read(grant, &node("d0"), 0, 4, 1_149), Ok(()));
        assert_eq!(table.check_word(grant, &node("d0"), 9), Ok(()));
        let outside = GrantError::OutsideGrant {
            id: grant,
            group: 1,
            block: 4,
        };
        assert_eq!(
            table.check_read(grant, &node("d0"), 1, 4, 1_100),
            Err(outside),
            "block 4 is group 0's"
        );
        let stranger = GrantError::WrongPeer {
            id: grant,
            peer: node("d1"),
        };
        assert_eq!(table.check_read(grant, &node("d1"), 0, 4, 1_100), Err(stranger));
        assert_eq!(
            table.check_read(grant, &node("d0"), 0, 4, 1_150),
            Err(GrantError::Expired(grant))
        );
        let null = GrantError::OutsideGrant {
            id: grant,
            group: 0,
            block: 0,
        };
        assert_eq!(table.check_word(grant, &node("d0"), 0), Err(null));
        assert_eq!(table.poll_timeout(), Some(1_150));
        assert_eq!(
            table.claim("r1", &node("d1"), 1, 1_060),
            Err(HandoffError::ClaimedByOther {
                request: "r1".into(),
                owner: "d0".into(),
                peer: "d1".into()
            })
        );
        assert!(matches!(
            table.release("r1", &node("d1")),
            Err(HandoffError::ClaimedByOther { .. })
        ));
        assert!(table.expire(1_149).is_empty(), "the claim moved the deadline");
        let ended = table.release("r1", &node("d0")).unwrap().unwrap();
        assert_eq!(ended.how, Ending::Released);
        assert_eq!(
            table.check_word(grant, &node("d0"), 9),
            Err(GrantError::Released(grant)),
            "a released hand-off's grant says how it ended"
        );
        assert_eq!(ended.blocks, vec![vec![3, 4], vec![9]]);
        assert_eq!(table.len(), 0);
        assert_eq!(table.poll_timeout(), None);
        assert_eq!(
            table.claim("r1", &node("d0"), 1, 1_100),
            Err(HandoffError::Ended {
                request: "r1".into(),
                how: Ending::Released
            })
        );
    }

    #[test]
    fn an_unclaimed_lease_lapses_at_its_deadline_and_late_claims_learn_why() {
        let mut table = Handoffs::new(50, 8).unwrap();
        table.announce("a", vec![vec![1]], 0).unwrap();
        table.announce("b", vec![vec![2]], 10).unwrap();
        assert!(table.expire(49).is_empty());
        let ended = table.expire(50);
        assert_eq!(ended.len(), 1);
        assert_eq!((ended[0].request.as_str(), ended[0].how), ("a", Ending::Expired));
        assert_eq!(
            table.claim("a", &node("d"), 1, 51),
            Err(HandoffError::Ended {
                request: "a".into(),
                how: Ending::Expired
            })
        );
        assert_eq!(
            table.claim("zzz", &node("d"), 1, 51),
            Err(HandoffError::Unknown("zzz".into()))
        );
        assert_eq!(table.expire(60).len(), 1);
        assert_eq!(table.len(), 0);
    }

    #[test]
    fn bounds_duplicates_and_revocation() {
        assert_eq!(Handoffs::new(0, 1).unwrap_err(), HandoffError::ZeroLease);
        let mut table = Handoffs::new(10, 2).unwrap();
        table.announce("a", vec![vec![1]], 0).unwrap();
        assert_eq!(
            table.announce("a", vec![vec![1]], 0),
            Err(HandoffError::Duplicate("a".into()))
        );
        table.announce("b", vec![vec![2]], 0).unwrap();
        assert_eq!(
            table.announce("c", vec![vec![3]], 0),
            Err(HandoffError::Full {
                request: "c".into(),
                max: 2
            })
        );
        assert_eq!(table.revoke("a").map(|ended| ended.how), Some(Ending::Revoked));
        assert_eq!(table.revoke("a"), None);
        let rest = table.revoke_all();
        assert_eq!(rest.len(), 1);
        assert_eq!(table.len(), 0);
        assert!(table.expire(u64::MAX).is_empty(), "nothing left to expire");
        // A request id may be handed off again once its earlier hand-off ended.
        table.announce("a", vec![vec![5]], 20).unwrap();
        let again = table.claim("a", &node("d"), 1, 21).unwrap();
        assert_eq!(again.blocks, vec![vec![5]]);
        assert_eq!(
            table.check_read(again.grant, &node("d"), 0, 5, 22),
            Ok(()),
            "a new grant"
        );
    }
}
