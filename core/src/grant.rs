//! Grants: a prefill leg's permission for one peer to READ one request's blocks, for a while.
//!
//! The prefill leg pins a finished request's blocks and issues a grant with a lease. The decode
//! leg renews the lease while it waits and releases the grant when its READ is done; a lease that
//! lapses revokes the grant and the shell unpins its blocks. Time comes in as `now_ms` (any
//! monotonic millisecond clock the shell owns); [`GrantTable::poll_timeout`] says when the next
//! lease lapses so the shell knows when to call [`GrantTable::expire`].
//!
//! A served READ asks [`GrantTable::check_read`] whether a block lies inside a live grant held by
//! the asking peer; anything else is refused before a byte moves.

use std::collections::{BTreeMap, HashMap, VecDeque};

use serde::{Deserialize, Serialize};

use crate::block::{BlockId, NULL_BLOCK};
use crate::wire::{GrantId, NodeId, RequestId};

/// One live grant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// The grant's id.
    pub id: GrantId,
    /// The request whose blocks it covers.
    pub request: RequestId,
    /// The peers allowed to read under it that have not released it; empty until the first
    /// claim of a grant issued to whoever claims it first ([`GrantTable::issue_unclaimed`]).
    pub holders: Vec<NodeId>,
    /// How many peers it admits, fixed by the first claim (0 while unclaimed): a hand-off whose
    /// heads several decode ranks read ends after the last of them releases it.
    pub readers: u32,
    /// Holders that released it so far.
    pub released: u32,
    /// Pinned blocks per group (the null block is never granted).
    pub blocks: Vec<Vec<BlockId>>,
    /// Lease length, re-applied on every renewal.
    pub lease_ms: u64,
    /// When the lease lapses unless renewed.
    pub expires_at_ms: u64,
    /// `blocks`, each group sorted, so a check costs a binary search (a grant may hold 10^5 blocks).
    sorted: Vec<Vec<BlockId>>,
}

impl Grant {
    /// Whether `peer` holds the grant.
    pub fn is_held_by(&self, peer: &NodeId) -> bool {
        self.holders.contains(peer)
    }

    /// Whether nobody claimed it yet.
    pub fn is_unclaimed(&self) -> bool {
        self.readers == 0
    }

    /// Whether the grant covers `block` in any group (a block id names one block in every group
    /// when the groups share one pool, as vLLM's do).
    pub fn covers_in_any_group(&self, block: BlockId) -> bool {
        (0..self.sorted.len()).any(|group| self.covers(group, block))
    }

    /// Whether the grant covers `block` of `group` (never the null block).
    pub fn covers(&self, group: usize, block: BlockId) -> bool {
        block != NULL_BLOCK
            && self
                .sorted
                .get(group)
                .is_some_and(|list| list.binary_search(&block).is_ok())
    }
}

/// How a grant ended, remembered for a while so a late reader learns why it was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// Its peer released it.
    Released,
    /// Its lease lapsed.
    Expired,
    /// The prefill leg revoked it (local failure handling, shutdown).
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

/// How many ended grants a table remembers per live-grant slot (at least [`MIN_ENDED`]).
const ENDED_PER_SLOT: usize = 4;

/// Fewest ended grants a table remembers.
const MIN_ENDED: usize = 1024;

/// The live grants of one prefill leg.
#[derive(Debug, Clone)]
pub struct GrantTable {
    grants: HashMap<GrantId, Grant>,
    /// Expiry index: (expires_at_ms, id).
    deadlines: BTreeMap<(u64, GrantId), ()>,
    /// Recently ended grants, oldest first, bounded by `ended_capacity`.
    ended: VecDeque<GrantId>,
    ended_how: HashMap<GrantId, Ending>,
    ended_capacity: usize,
    next_id: u64,
    max_grants: usize,
}

impl GrantTable {
    /// A table that holds at most `max_grants` live grants (each pins blocks, so the bound is a
    /// memory bound too).
    pub fn new(max_grants: usize) -> Self {
        GrantTable {
            grants: HashMap::new(),
            deadlines: BTreeMap::new(),
            ended: VecDeque::new(),
            ended_how: HashMap::new(),
            ended_capacity: max_grants.saturating_mul(ENDED_PER_SLOT).max(MIN_ENDED),
            next_id: 1,
            max_grants,
        }
    }

    /// Issues a grant for `blocks` (already pinned by the caller) to `peer`.
    pub fn issue(
        &mut self,
        request: RequestId,
        peer: NodeId,
        blocks: Vec<Vec<BlockId>>,
        lease_ms: u64,
        now_ms: u64,
    ) -> Result<GrantId, GrantError> {
        self.insert(request, Some(peer), blocks, lease_ms, now_ms)
    }

    /// Issues a grant for `blocks` to whichever peer [`claim`](Self::claim)s it first (a vLLM
    /// prefill worker hands KV off before it knows which decode worker will read it). Until then
    /// no peer may read under it, and any peer may release it.
    pub fn issue_unclaimed(
        &mut self,
        request: RequestId,
        blocks: Vec<Vec<BlockId>>,
        lease_ms: u64,
        now_ms: u64,
    ) -> Result<GrantId, GrantError> {
        self.insert(request, None, blocks, lease_ms, now_ms)
    }

    /// `peer` claims grant `id`: the first claim of an unclaimed grant makes `peer` its holder;
    /// every claim by the holder renews the lease as [`renew`](Self::renew) does. Returns the
    /// lease's new end.
    pub fn claim(&mut self, id: GrantId, peer: &NodeId, now_ms: u64) -> Result<u64, GrantError> {
        self.claim_shared(id, peer, 1, now_ms)
    }

    /// `peer` claims grant `id` as one of `readers` peers: the first claim of an unclaimed grant
    /// fixes how many peers it admits, each further peer takes one of the places left, and every
    /// claim by a holder renews the lease. The grant ends when all `readers` released it (or its
    /// lease lapses). Every claim must name the same `readers`.
    pub fn claim_shared(
        &mut self,
        id: GrantId,
        peer: &NodeId,
        readers: u32,
        now_ms: u64,
    ) -> Result<u64, GrantError> {
        if readers == 0 {
            return Err(GrantError::NoReaders(id));
        }
        let missing = self.missing(id);
        let grant = self.grants.get_mut(&id).ok_or(missing)?;
        if now_ms >= grant.expires_at_ms {
            // Lapsed but not yet swept: too late to claim.
            return Err(GrantError::Expired(id));
        }
        if !grant.is_held_by(peer) {
            if grant.is_unclaimed() {
                grant.readers = readers;
            } else if grant.readers != readers {
                return Err(GrantError::ReadersMismatch {
                    id,
                    asked: readers,
                    admitted: grant.readers,
                });
            }
            if grant.holders.len() as u32 + grant.released >= grant.readers {
                return Err(GrantError::WrongPeer {
                    id,
                    peer: peer.clone(),
                });
            }
            grant.holders.push(peer.clone());
        }
        self.renew(id, peer, now_ms)
    }

    fn insert(
        &mut self,
        request: RequestId,
        holder: Option<NodeId>,
        blocks: Vec<Vec<BlockId>>,
        lease_ms: u64,
        now_ms: u64,
    ) -> Result<GrantId, GrantError> {
        if self.grants.len() >= self.max_grants {
            return Err(GrantError::TableFull {
                max_grants: self.max_grants,
            });
        }
        if lease_ms == 0 {
            return Err(GrantError::ZeroLease);
        }
        let id = GrantId(self.next_id);
        self.next_id += 1;
        let expires_at_ms = now_ms.saturating_add(lease_ms);
        self.deadlines.insert((expires_at_ms, id), ());
        let sorted = blocks
            .iter()
            .map(|list| {
                let mut list = list.clone();
                list.sort_unstable();
                list
            })
            .collect();
        self.grants.insert(
            id,
            Grant {
                id,
                request,
                readers: u32::from(holder.is_some()),
                holders: holder.into_iter().collect(),
                released: 0,
                blocks,
                lease_ms,
                expires_at_ms,
                sorted,
            },
        );
        Ok(id)
    }

    /// Extends a grant's lease to `now_ms + lease_ms`; only its peer may renew it.
    pub fn renew(&mut self, id: GrantId, peer: &NodeId, now_ms: u64) -> Result<u64, GrantError> {
        let missing = self.missing(id);
        let grant = self.grants.get_mut(&id).ok_or(missing)?;
        if !grant.is_held_by(peer) {
            return Err(GrantError::WrongPeer {
                id,
                peer: peer.clone(),
            });
        }
        if now_ms >= grant.expires_at_ms {
            // Lapsed but not yet swept: too late to renew.
            return Err(GrantError::Expired(id));
        }
        self.deadlines.remove(&(grant.expires_at_ms, id));
        grant.expires_at_ms = now_ms.saturating_add(grant.lease_ms);
        self.deadlines.insert((grant.expires_at_ms, id), ());
        Ok(grant.expires_at_ms)
    }

    /// `peer` is done with a grant: the grant ends, and is returned for the caller to unpin
    /// its blocks, when this was the last of its readers (any peer ends it while nobody claimed
    /// it); `None` while other readers still hold it. Only a holder may release it.
    pub fn release(&mut self, id: GrantId, peer: &NodeId) -> Result<Option<Grant>, GrantError> {
        let missing = self.missing(id);
        let grant = self.grants.get_mut(&id).ok_or(missing)?;
        if !grant.is_unclaimed() {
            let Some(index) = grant.holders.iter().position(|holder| holder == peer) else {
                return Err(GrantError::WrongPeer {
                    id,
                    peer: peer.clone(),
                });
            };
            grant.holders.remove(index);
            grant.released += 1;
            if grant.released < grant.readers {
                return Ok(None);
            }
        }
        Ok(self.remove(id, Ending::Released))
    }

    /// Ends a grant regardless of peer (local failure handling, shutdown).
    pub fn revoke(&mut self, id: GrantId) -> Option<Grant> {
        self.remove(id, Ending::Revoked)
    }

    /// Removes and returns every grant whose lease lapsed at or before `now_ms`.
    pub fn expire(&mut self, now_ms: u64) -> Vec<Grant> {
        let due: Vec<GrantId> = self
            .deadlines
            .range(..=(now_ms, GrantId(u64::MAX)))
            .map(|(&(_, id), _)| id)
            .collect();
        due.into_iter()
            .filter_map(|id| self.remove(id, Ending::Expired))
            .collect()
    }

    /// The earliest lease expiry, if any grant lives.
    pub fn poll_timeout(&self) -> Option<u64> {
        self.deadlines.keys().next().map(|&(at, _)| at)
    }

    /// Whether `peer` may read `block` of `group` under `id` at `now_ms`.
    pub fn check_read(
        &self,
        id: GrantId,
        peer: &NodeId,
        group: usize,
        block: BlockId,
        now_ms: u64,
    ) -> Result<(), GrantError> {
        let grant = self.held(id, peer)?;
        if now_ms >= grant.expires_at_ms {
            return Err(GrantError::Expired(id));
        }
        if !grant.covers(group, block) {
            return Err(GrantError::OutsideGrant { id, group, block });
        }
        Ok(())
    }

    /// The live grant `id`, if `peer` holds it.
    pub fn held(&self, id: GrantId, peer: &NodeId) -> Result<&Grant, GrantError> {
        let grant = self.grants.get(&id).ok_or_else(|| self.missing(id))?;
        if !grant.is_held_by(peer) {
            return Err(GrantError::WrongPeer {
                id,
                peer: peer.clone(),
            });
        }
        Ok(grant)
    }

    /// Ends every live grant (shutdown); the caller unpins the returned blocks.
    pub fn revoke_all(&mut self) -> Vec<Grant> {
        let ids = self.live_ids(|_| true);
        ids.into_iter().filter_map(|id| self.revoke(id)).collect()
    }

    /// The live grants issued for `request` (an abort revokes them all), in id order.
    pub fn grants_of(&self, request: RequestId) -> Vec<GrantId> {
        self.live_ids(|grant| grant.request == request)
    }

    /// The live grants `peer` holds, in id order.
    pub fn held_by(&self, peer: &NodeId) -> Vec<GrantId> {
        self.live_ids(|grant| grant.is_held_by(peer))
    }

    /// The ids of the live grants `keep` accepts, in id order.
    fn live_ids(&self, keep: impl Fn(&Grant) -> bool) -> Vec<GrantId> {
        let mut ids: Vec<GrantId> = self
            .grants
            .values()
            .filter(|grant| keep(grant))
            .map(|grant| grant.id)
            .collect();
        ids.sort_unstable();
        ids
    }

    /// A live grant.
    pub fn get(&self, id: GrantId) -> Option<&Grant> {
        self.grants.get(&id)
    }

    /// Number of live grants.
    pub fn len(&self) -> usize {
        self.grants.len()
    }

    /// Whether no grant lives.
    pub fn is_empty(&self) -> bool {
        self.grants.is_empty()
    }

    /// Why `id` names no live grant: never issued, or how it ended if that is still remembered.
    pub fn missing(&self, id: GrantId) -> GrantError {
        if id.0 == 0 || id.0 >= self.next_id {
            return GrantError::NeverIssued(id);
        }
        match self.ended_how.get(&id) {
            Some(Ending::Released) => GrantError::Released(id),
            Some(Ending::Expired) => GrantError::Expired(id),
            Some(Ending::Revoked) => GrantError::Revoked(id),
            None => GrantError::Unknown(id),
        }
    }

    fn remove(&mut self, id: GrantId, ending: Ending) -> Option<Grant> {
        let grant = self.grants.remove(&id)?;
        self.deadlines.remove(&(grant.expires_at_ms, id));
        if self.ended.len() >= self.ended_capacity
            && let Some(oldest) = self.ended.pop_front()
        {
            self.ended_how.remove(&oldest);
        }
        self.ended.push_back(id);
        self.ended_how.insert(id, ending);
        Some(grant)
    }
}

/// Why a grant operation was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum GrantError {
    /// No live grant has this id, and it ended too long ago to say how.
    #[error("grant {} is not live (ended long ago)", .0.0)]
    Unknown(GrantId),
    /// No grant with this id was ever issued here.
    #[error("grant {} is not live: it was never issued", .0.0)]
    NeverIssued(GrantId),
    /// Its peer released the grant.
    #[error("grant {} is not live: it was released", .0.0)]
    Released(GrantId),
    /// The prefill leg revoked the grant.
    #[error("grant {} is not live: it was revoked", .0.0)]
    Revoked(GrantId),
    /// The grant belongs to another peer.
    #[error("grant {} does not belong to peer {peer}", id.0)]
    WrongPeer {
        /// Grant id.
        id: GrantId,
        /// The asking peer.
        peer: NodeId,
    },
    /// The lease lapsed.
    #[error("grant {} is not live: its lease expired", .0.0)]
    Expired(GrantId),
    /// The block is not part of the grant.
    #[error("grant {} does not cover block {block} of group {group}", id.0)]
    OutsideGrant {
        /// Grant id.
        id: GrantId,
        /// Group index.
        group: usize,
        /// Block id.
        block: BlockId,
    },
    /// Too many live grants.
    #[error("grant table full ({max_grants} live grants)")]
    TableFull {
        /// The table's bound.
        max_grants: usize,
    },
    /// A lease must last.
    #[error("lease_ms must be at least 1")]
    ZeroLease,
    /// A claim for no readers at all.
    #[error("a claim of grant {} must admit at least one reader", .0.0)]
    NoReaders(GrantId),
    /// A claim disagrees with the first claim on how many peers read the grant.
    #[error("grant {} admits {admitted} readers, a claim asked for {asked}", id.0)]
    ReadersMismatch {
        /// Grant id.
        id: GrantId,
        /// Readers the claim named.
        asked: u32,
        /// Readers the first claim fixed.
        admitted: u32,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(name: &str) -> NodeId {
        NodeId(name.to_string())
    }

    #[test]
    fn reads_inside_a_live_grant_pass_and_everything_else_is_refused() {
        let mut table = GrantTable::new(4);
        let id = table
            .issue(RequestId(1), peer("d0"), vec![vec![3, 4], vec![0, 7]], 100, 1_000)
            .unwrap();
        assert_eq!(table.check_read(id, &peer("d0"), 0, 4, 1_050), Ok(()));
        assert_eq!(
            table
                .check_read(id, &peer("d0"), 0, 5, 1_050)
                .unwrap_err()
                .to_string(),
            "grant 1 does not cover block 5 of group 0"
        );
        assert!(matches!(
            table.check_read(id, &peer("d0"), 1, 0, 1_050),
            Err(GrantError::OutsideGrant { .. })
        ));
        assert_eq!(
            table
                .check_read(id, &peer("d1"), 0, 4, 1_050)
                .unwrap_err()
                .to_string(),
            "grant 1 does not belong to peer d1"
        );
        assert_eq!(
            table.check_read(id, &peer("d0"), 0, 4, 1_100),
            Err(GrantError::Expired(id))
        );
    }

    #[test]
    fn renewal_moves_the_deadline_and_expiry_revokes() {
        let mut table = GrantTable::new(4);
        let id = table
            .issue(RequestId(1), peer("d0"), vec![vec![3]], 100, 0)
            .unwrap();
        assert_eq!(table.poll_timeout(), Some(100));
        assert_eq!(table.renew(id, &peer("d0"), 90), Ok(190));
        assert!(table.expire(150).is_empty());
        let expired = table.expire(190);
        assert_eq!(expired.len(), 1);
        assert_eq!(expired[0].blocks, vec![vec![3]]);
        assert!(table.is_empty());
        assert_eq!(
            table.check_read(id, &peer("d0"), 0, 3, 0),
            Err(GrantError::Expired(id))
        );
        assert_eq!(table.renew(id, &peer("d0"), 200), Err(GrantError::Expired(id)));
    }

    #[test]
    fn the_table_counts_and_finds_live_grants() {
        let mut table = GrantTable::new(4);
        assert!(table.is_empty());
        let id = table
            .issue(RequestId(7), peer("d0"), vec![vec![3]], 100, 0)
            .unwrap();
        assert_eq!(table.len(), 1);
        assert!(!table.is_empty());
        assert_eq!(table.get(id).map(|grant| grant.request), Some(RequestId(7)));
        assert_eq!(table.grants_of(RequestId(7)), vec![id]);
        assert_eq!(table.grants_of(RequestId(9)), vec![]);
        table
            .issue(RequestId(8), peer("d0"), vec![vec![4]], 100, 0)
            .unwrap();
        assert_eq!(table.len(), 2);
        table.release(id, &peer("d0")).unwrap();
        assert_eq!(table.get(id), None);
        assert_eq!(table.len(), 1);
    }

    /// A grant past its lease but not yet swept cannot be renewed back to life.
    #[test]
    fn a_renewal_after_the_lease_lapsed_is_refused() {
        let mut table = GrantTable::new(4);
        let id = table
            .issue(RequestId(1), peer("d0"), vec![vec![3]], 100, 0)
            .unwrap();
        assert_eq!(table.renew(id, &peer("d0"), 100), Err(GrantError::Expired(id)));
        assert_eq!(table.expire(100).len(), 1);
    }

    /// Released, expired, revoked and never-issued grants are refused with distinct errors, and
    /// the memory of ended grants is bounded.
    #[test]
    fn an_ended_grant_says_how_it_ended() {
        let mut table = GrantTable::new(4);
        let issue = |table: &mut GrantTable| {
            table
                .issue(RequestId(1), peer("d0"), vec![vec![3]], 100, 0)
                .unwrap()
        };
        let (released, expired, revoked) = (issue(&mut table), issue(&mut table), issue(&mut table));
        table.release(released, &peer("d0")).unwrap();
        table.revoke(revoked).unwrap();
        table.renew(released, &peer("d0"), 10).unwrap_err();
        assert_eq!(table.expire(100).len(), 1);
        let read = |table: &GrantTable, id| table.check_read(id, &peer("d0"), 0, 3, 50).unwrap_err();
        assert_eq!(read(&table, released), GrantError::Released(released));
        assert_eq!(read(&table, expired), GrantError::Expired(expired));
        assert_eq!(read(&table, revoked), GrantError::Revoked(revoked));
        assert_eq!(read(&table, GrantId(99)), GrantError::NeverIssued(GrantId(99)));
        assert_eq!(read(&table, GrantId(0)), GrantError::NeverIssued(GrantId(0)));
        assert_eq!(
            read(&table, released).to_string(),
            "grant 1 is not live: it was released"
        );
        assert_eq!(
            read(&table, expired).to_string(),
            "grant 2 is not live: its lease expired"
        );
        assert_eq!(
            table.release(released, &peer("d0")).unwrap_err(),
            GrantError::Released(released)
        );
        // Past MIN_ENDED more endings, the first is forgotten (bounded memory).
        for _ in 0..MIN_ENDED {
            let id = issue(&mut table);
            table.release(id, &peer("d0")).unwrap();
        }
        assert_eq!(read(&table, released), GrantError::Unknown(released));
        assert_eq!(table.ended.len(), MIN_ENDED);
        assert_eq!(table.ended_how.len(), MIN_ENDED);
    }

    #[test]
    fn release_is_the_peers_alone_and_the_table_is_bounded() {
        let mut table = GrantTable::new(1);
        let id = table
            .issue(RequestId(1), peer("d0"), vec![vec![3]], 100, 0)
            .unwrap();
        assert!(matches!(
            table.release(id, &peer("d1")),
            Err(GrantError::WrongPeer { .. })
        ));
        assert_eq!(
            table
                .issue(RequestId(2), peer("d0"), vec![vec![4]], 100, 0)
                .unwrap_err()
                .to_string(),
            "grant table full (1 live grants)"
        );
        assert_eq!(
            table.release(id, &peer("d0")).unwrap().unwrap().request,
            RequestId(1)
        );
        assert!(table.release(id, &peer("d0")).is_err());
    }

    /// A grant issued to its first claimant: nobody reads under it before the claim, the first
    /// claim binds it, later claims by others are refused, and a lapsed lease cannot be claimed.
    #[test]
    fn an_unclaimed_grant_belongs_to_its_first_claimant() {
        let mut table = GrantTable::new(4);
        let id = table
            .issue_unclaimed(RequestId(1), vec![vec![3, 4]], 100, 0)
            .unwrap();
        assert!(table.get(id).unwrap().holders.is_empty());
        assert_eq!(
            table.check_read(id, &peer("d0"), 0, 3, 10),
            Err(GrantError::WrongPeer { id, peer: peer("d0") }),
            "nobody reads before a claim"
        );
        assert_eq!(
            table.renew(id, &peer("d0"), 10),
            Err(GrantError::WrongPeer { id, peer: peer("d0") })
        );
        assert_eq!(table.claim(id, &peer("d0"), 50), Ok(150));
        assert_eq!(table.check_read(id, &peer("d0"), 0, 3, 60), Ok(()));
        assert_eq!(
            table.claim(id, &peer("d1"), 60),
            Err(GrantError::WrongPeer { id, peer: peer("d1") })
        );
        assert_eq!(
            table.claim(id, &peer("d0"), 120),
            Ok(220),
            "the holder's claim renews"
        );
        assert!(table.release(id, &peer("d1")).is_err());
        assert!(table.held(id, &peer("d0")).unwrap().covers_in_any_group(4));
        assert!(!table.held(id, &peer("d0")).unwrap().covers_in_any_group(5));

        let lapsed = table
            .issue_unclaimed(RequestId(2), vec![vec![5]], 100, 0)
            .unwrap();
        assert_eq!(
            table.claim(lapsed, &peer("d0"), 100),
            Err(GrantError::Expired(lapsed))
        );
        assert!(
            table.get(lapsed).unwrap().is_unclaimed(),
            "a refused claim binds nobody"
        );

        let unclaimed = table
            .issue_unclaimed(RequestId(3), vec![vec![6]], 100, 0)
            .unwrap();
        assert_eq!(
            table
                .release(unclaimed, &peer("anyone"))
                .map(|grant| grant.map(|grant| grant.blocks)),
            Ok(Some(vec![vec![6]])),
            "an unclaimed grant has no holder to protect it"
        );
        let all = table.revoke_all();
        assert_eq!(
            all.iter().map(|grant| grant.id).collect::<Vec<_>>(),
            vec![id, lapsed]
        );
        assert!(table.is_empty());
        assert_eq!(table.claim(id, &peer("d0"), 130), Err(GrantError::Revoked(id)));
    }

    /// A hand-off read by several decode ranks: the first claim fixes the readers, each takes a
    /// place, a stranger beyond them is refused, and only the last release ends the grant.
    #[test]
    fn a_shared_grant_ends_with_its_last_readers_release() {
        let mut table = GrantTable::new(4);
        let id = table
            .issue_unclaimed(RequestId(1), vec![vec![3, 4]], 100, 0)
            .unwrap();
        assert_eq!(
            table.claim_shared(id, &peer("d0"), 0, 10),
            Err(GrantError::NoReaders(id))
        );
        assert_eq!(table.claim_shared(id, &peer("d0"), 2, 10), Ok(110));
        assert_eq!(
            table.claim_shared(id, &peer("d1"), 3, 20),
            Err(GrantError::ReadersMismatch {
                id,
                asked: 3,
                admitted: 2
            })
        );
        assert_eq!(table.claim_shared(id, &peer("d1"), 2, 20), Ok(120));
        assert_eq!(table.check_read(id, &peer("d1"), 0, 4, 30), Ok(()));
        assert_eq!(table.check_read(id, &peer("d0"), 0, 3, 30), Ok(()));
        assert_eq!(
            table.claim_shared(id, &peer("d2"), 2, 30),
            Err(GrantError::WrongPeer { id, peer: peer("d2") }),
            "two readers admitted, both places taken"
        );
        assert_eq!(table.release(id, &peer("d0")), Ok(None), "d1 still reads");
        assert_eq!(
            table.check_read(id, &peer("d0"), 0, 3, 40),
            Err(GrantError::WrongPeer { id, peer: peer("d0") }),
            "a reader that released reads no more"
        );
        assert_eq!(
            table.claim_shared(id, &peer("d0"), 2, 40),
            Err(GrantError::WrongPeer { id, peer: peer("d0") }),
            "nor claims again"
        );
        assert_eq!(table.check_read(id, &peer("d1"), 0, 4, 40), Ok(()));
        let ended = table.release(id, &peer("d1")).unwrap().unwrap();
        assert_eq!(ended.blocks, vec![vec![3, 4]]);
        assert!(table.is_empty());
        assert_eq!(table.release(id, &peer("d1")), Err(GrantError::Released(id)));
    }
}
