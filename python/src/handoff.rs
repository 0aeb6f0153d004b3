//! The prefill worker's hand-offs: which finished requests' blocks a decode worker may READ, for
//! how long, and when vLLM may free them. Sans-IO: time enters as `now_ms`, and what must happen
//! to memory (bump the blocks' generations) comes back as an [`Ended`] the shell acts on before it
//! tells vLLM the request is done.
//!
//! A hand-off is announced when vLLM finishes a prefill and keeps the blocks (delayed free). Its
//! lease starts then, so a decode worker that never comes cannot pin blocks forever. The first
//! decode worker to claim it owns it (claims renew the lease); it ends on that worker's release,
//! on lease expiry, or on revocation (abort, shutdown).

use std::collections::{BTreeMap, HashMap, VecDeque};

use pdkv_core::block::{BlockId, NULL_BLOCK};
use pdkv_core::grant::GrantError;
use pdkv_core::wire::{GrantId, NodeId};

/// How a hand-off ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// Its decode worker released it after reading.
    Released,
    /// Nobody released it before its lease lapsed.
    Expired,
    /// The prefill side gave it up (abort, shutdown).
    Revoked,
}

impl std::fmt::Display for Ending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Ending::Released => "was released",
            Ending::Expired => "expired (its lease lapsed)",
            Ending::Revoked => "was revoked by the prefill side",
        })
    }
}

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

#[derive(Debug)]
struct Handoff {
    grant: GrantId,
    blocks: Vec<Vec<BlockId>>,
    /// `blocks`, each group sorted, so a served READ's check is a binary search.
    sorted: Vec<Vec<BlockId>>,
    owner: Option<NodeId>,
    expires_at_ms: u64,
}

impl Handoff {
    fn covers(&self, group: usize, block: BlockId) -> bool {
        self.sorted
            .get(group)
            .is_some_and(|list| list.binary_search(&block).is_ok())
    }
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

/// How many ended hand-offs are remembered (so a late claim learns why it was refused).
const REMEMBERED_ENDINGS: usize = 4096;

/// The live hand-offs of one prefill worker.
#[derive(Debug)]
pub struct Handoffs {
    live: HashMap<String, Handoff>,
    by_grant: HashMap<GrantId, String>,
    next_grant: u64,
    deadlines: BTreeMap<(u64, String), ()>,
    ended: VecDeque<String>,
    ended_how: HashMap<String, Ending>,
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
            live: HashMap::new(),
            by_grant: HashMap::new(),
            next_grant: 1,
            deadlines: BTreeMap::new(),
            ended: VecDeque::new(),
            ended_how: HashMap::new(),
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
        if self.live.len() >= self.max_live {
            return Err(HandoffError::Full {
                request: request.to_string(),
                max: self.max_live,
            });
        }
        let blocks: Vec<Vec<BlockId>> = blocks
            .into_iter()
            .map(|group| group.into_iter().filter(|&block| block != NULL_BLOCK).collect())
            .collect();
        let sorted = blocks
            .iter()
            .map(|group| {
                let mut group = group.clone();
                group.sort_unstable();
                group
            })
            .collect();
        let expires_at_ms = now_ms.saturating_add(self.lease_ms);
        let grant = GrantId(self.next_grant);
        self.next_grant += 1;
        self.forget_ending(request);
        self.deadlines.insert((expires_at_ms, request.to_string()), ());
        self.by_grant.insert(grant, request.to_string());
        self.live.insert(
            request.to_string(),
            Handoff {
                grant,
                blocks,
                sorted,
                owner: None,
                expires_at_ms,
            },
        );
        Ok(())
    }

    /// `peer` claims `request`: the first claim makes it the owner; every claim by the owner
    /// renews the lease. Returns the grant its READs name, the blocks and the lease's new end.
    pub fn claim(&mut self, request: &str, peer: &NodeId, now_ms: u64) -> Result<Claim, HandoffError> {
        let lease_ms = self.lease_ms;
        let Some(handoff) = self.live.get_mut(request) else {
            return Err(self.missing(request));
        };
        match &handoff.owner {
            Some(owner) if owner != peer => {
                return Err(HandoffError::ClaimedByOther {
                    request: request.to_string(),
                    owner: owner.to_string(),
                    peer: peer.to_string(),
                });
            }
            Some(_) => {}
            None => handoff.owner = Some(peer.clone()),
        }
        let old = (handoff.expires_at_ms, request.to_string());
        handoff.expires_at_ms = now_ms.saturating_add(lease_ms).max(handoff.expires_at_ms);
        let renewed = (handoff.expires_at_ms, request.to_string());
        let claim = Claim {
            grant: handoff.grant,
            blocks: handoff.blocks.clone(),
            expires_at_ms: handoff.expires_at_ms,
        };
        self.deadlines.remove(&old);
        self.deadlines.insert(renewed, ());
        Ok(claim)
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
        let handoff = self.owned(grant, peer)?;
        if now_ms >= handoff.expires_at_ms {
            return Err(GrantError::Expired(grant));
        }
        if !handoff.covers(group, block) {
            return Err(GrantError::OutsideGrant {
                id: grant,
                group,
                block,
            });
        }
        Ok(())
    }

    /// Whether `peer` may read the generation word of `block` under `grant`: its owner, a block
    /// of the hand-off in any group (vLLM's groups share one block pool, hence one table).
    pub fn check_word(&self, grant: GrantId, peer: &NodeId, block: BlockId) -> Result<(), GrantError> {
        let handoff = self.owned(grant, peer)?;
        if (0..handoff.sorted.len()).any(|group| handoff.covers(group, block)) {
            Ok(())
        } else {
            Err(GrantError::OutsideGrant {
                id: grant,
                group: 0,
                block,
            })
        }
    }

    fn owned(&self, grant: GrantId, peer: &NodeId) -> Result<&Handoff, GrantError> {
        let handoff = self
            .by_grant
            .get(&grant)
            .and_then(|request| self.live.get(request))
            .ok_or(GrantError::Unknown(grant))?;
        if handoff.owner.as_ref() != Some(peer) {
            return Err(GrantError::WrongPeer {
                id: grant,
                peer: peer.clone(),
            });
        }
        Ok(handoff)
    }

    /// `peer` is done reading `request` (its owner, or anyone if nobody claimed it).
    pub fn release(&mut self, request: &str, peer: &NodeId) -> Result<Ended, HandoffError> {
        let Some(handoff) = self.live.get(request) else {
            return Err(self.missing(request));
        };
        if let Some(owner) = handoff.owner.as_ref().filter(|owner| *owner != peer) {
            return Err(HandoffError::ClaimedByOther {
                request: request.to_string(),
                owner: owner.to_string(),
                peer: peer.to_string(),
            });
        }
        Ok(self.end(request, Ending::Released).expect("checked live above"))
    }

    /// Ends `request`'s hand-off from the prefill side, if it is live.
    pub fn revoke(&mut self, request: &str) -> Option<Ended> {
        self.end(request, Ending::Revoked)
    }

    /// Ends every live hand-off (shutdown).
    pub fn revoke_all(&mut self) -> Vec<Ended> {
        let requests: Vec<String> = self.live.keys().cloned().collect();
        requests
            .iter()
            .filter_map(|request| self.revoke(request))
            .collect()
    }

    /// Ends every hand-off whose lease lapsed at or before `now_ms`.
    pub fn expire(&mut self, now_ms: u64) -> Vec<Ended> {
        let due: Vec<String> = self
            .deadlines
            .keys()
            .take_while(|(at, _)| *at <= now_ms)
            .map(|(_, request)| request.clone())
            .collect();
        due.iter()
            .filter_map(|request| self.end(request, Ending::Expired))
            .collect()
    }

    /// When the next lease lapses, if any is live.
    pub fn poll_timeout(&self) -> Option<u64> {
        self.deadlines.keys().next().map(|(at, _)| *at)
    }

    /// Number of live hand-offs.
    pub fn len(&self) -> usize {
        self.live.len()
    }

    fn end(&mut self, request: &str, how: Ending) -> Option<Ended> {
        let handoff = self.live.remove(request)?;
        self.by_grant.remove(&handoff.grant);
        self.deadlines
            .remove(&(handoff.expires_at_ms, request.to_string()));
        self.ended.push_back(request.to_string());
        self.ended_how.insert(request.to_string(), how);
        while self.ended.len() > REMEMBERED_ENDINGS {
            if let Some(oldest) = self.ended.pop_front() {
                self.ended_how.remove(&oldest);
            }
        }
        Some(Ended {
            request: request.to_string(),
            blocks: handoff.blocks,
            how,
        })
    }

    fn forget_ending(&mut self, request: &str) {
        if self.ended_how.remove(request).is_some() {
            self.ended.retain(|ended| ended != request);
        }
    }

    fn missing(&self, request: &str) -> HandoffError {
        match self.ended_how.get(request) {
            Some(&how) => HandoffError::Ended {
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
        let claim = table.claim("r1", &node("d0"), 1_050).unwrap();
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
            table.claim("r1", &node("d1"), 1_060),
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
        let ended = table.release("r1", &node("d0")).unwrap();
        assert_eq!(ended.how, Ending::Released);
        assert_eq!(
            table.check_word(grant, &node("d0"), 9),
            Err(GrantError::Unknown(grant))
        );
        assert_eq!(ended.blocks, vec![vec![3, 4], vec![9]]);
        assert_eq!(table.len(), 0);
        assert_eq!(table.poll_timeout(), None);
        assert_eq!(
            table.claim("r1", &node("d0"), 1_100),
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
            table.claim("a", &node("d"), 51),
            Err(HandoffError::Ended {
                request: "a".into(),
                how: Ending::Expired
            })
        );
        assert_eq!(
            table.claim("zzz", &node("d"), 51),
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
        let again = table.claim("a", &node("d"), 21).unwrap();
        assert_eq!(again.blocks, vec![vec![5]]);
        assert_eq!(
            table.check_read(again.grant, &node("d"), 0, 5, 22),
            Ok(()),
            "a new grant"
        );
    }
}
