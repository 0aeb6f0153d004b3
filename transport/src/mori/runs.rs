//! How a READ's runs become mori work requests, after mori's tuning guide: contiguous runs
//! merged into one (fewer, larger work requests), none larger than the NIC's largest message.

use pdkv_core::plan::ReadRun;

/// The largest message mlx5 and bnxt NICs accept (`max_msg_sz`); a merged run must stay at or
/// below it.
pub const NIC_MAX_MESSAGE_BYTES: u64 = 1 << 31;

/// The runs to post for `runs`, moving exactly the same bytes: empty runs dropped, runs that
/// continue each other on both sides (local and remote) merged, and every run split into pieces
/// of at most `max_message_bytes` (which must be non-zero).
///
/// Runs are taken in order of their local offset, so runs a plan lists out of order still merge.
pub fn batch_runs(runs: &[ReadRun], max_message_bytes: u64) -> Vec<ReadRun> {
    assert!(max_message_bytes > 0, "max_message_bytes must be non-zero");
    let mut sorted: Vec<ReadRun> = runs.iter().copied().filter(|run| run.len_bytes > 0).collect();
    sorted.sort_by_key(|run| (run.local_offset, run.remote_offset));
    let mut merged: Vec<ReadRun> = Vec::with_capacity(sorted.len());
    for run in sorted {
        if let Some(last) = merged.last_mut()
            && last.local_offset.checked_add(last.len_bytes) == Some(run.local_offset)
            && last.remote_offset.checked_add(last.len_bytes) == Some(run.remote_offset)
        {
            last.len_bytes += run.len_bytes;
            continue;
        }
        merged.push(run);
    }
    let mut posted = Vec::with_capacity(merged.len());
    for run in merged {
        let mut done = 0;
        while done < run.len_bytes {
            let len = (run.len_bytes - done).min(max_message_bytes);
            posted.push(ReadRun {
                local_offset: run.local_offset + done,
                remote_offset: run.remote_offset + done,
                len_bytes: len,
            });
            done += len;
        }
    }
    posted
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    fn run(local_offset: u64, remote_offset: u64, len_bytes: u64) -> ReadRun {
        ReadRun {
            local_offset,
            remote_offset,
            len_bytes,
        }
    }

    /// Where each local byte comes from: the definition of what a set of runs moves.
    fn byte_map(runs: &[ReadRun]) -> BTreeMap<u64, u64> {
        let mut map = BTreeMap::new();
        for r in runs {
            for i in 0..r.len_bytes {
                assert!(map.insert(r.local_offset + i, r.remote_offset + i).is_none());
            }
        }
        map
    }

    #[test]
    fn contiguous_runs_merge_and_large_runs_split() {
        // Two blocks contiguous on both sides, then a gap on the remote side.
        let runs = [run(0, 100, 10), run(10, 110, 10), run(20, 200, 5)];
        assert_eq!(batch_runs(&runs, 1 << 20), vec![run(0, 100, 20), run(20, 200, 5)]);
        // Contiguous locally only: not merged.
        assert_eq!(
            batch_runs(&[run(0, 0, 4), run(4, 8, 4)], 1 << 20),
            vec![run(0, 0, 4), run(4, 8, 4)]
        );
        // Split at the message bound, remainder last.
        assert_eq!(
            batch_runs(&[run(0, 1000, 10)], 4),
            vec![run(0, 1000, 4), run(4, 1004, 4), run(8, 1008, 2)]
        );
        // Out of order in, merged out; empty runs vanish.
        assert_eq!(
            batch_runs(&[run(8, 8, 8), run(3, 3, 0), run(0, 0, 8)], 64),
            vec![run(0, 0, 16)]
        );
    }

    #[test]
    fn a_merge_larger_than_a_nic_message_is_split_at_the_nic_bound() {
        let half = NIC_MAX_MESSAGE_BYTES / 2 + 1;
        let posted = batch_runs(&[run(0, 0, half), run(half, half, half)], NIC_MAX_MESSAGE_BYTES);
        assert_eq!(
            posted,
            vec![
                run(0, 0, NIC_MAX_MESSAGE_BYTES),
                run(NIC_MAX_MESSAGE_BYTES, NIC_MAX_MESSAGE_BYTES, 2)
            ]
        );
    }

    proptest! {
        #[test]
        fn batching_moves_the_same_bytes_in_bounded_maximal_runs(
            blocks in proptest::collection::vec((0u64..3, 0u64..40, 1u64..6), 0..24),
            max in 1u64..24,
        ) {
            // Disjoint local blocks of 8 bytes at distinct slots, remote slots from a small range
            // so some runs continue each other.
            let mut runs = Vec::new();
            let mut seen = std::collections::BTreeSet::new();
            for (i, (gap, remote_slot, len)) in blocks.into_iter().enumerate() {
                let local_slot = i as u64 * 2 + gap.min(1);
                if seen.insert(local_slot) {
                    runs.push(run(local_slot * 8, remote_slot * 8, len.min(8)));
                }
            }
            let posted = batch_runs(&runs, max);
            prop_assert_eq!(byte_map(&posted), byte_map(&runs));
            prop_assert!(posted.iter().all(|r| r.len_bytes > 0 && r.len_bytes <= max));
            for pair in posted.windows(2) {
                let (a, b) = (pair[0], pair[1]);
                let continues = a.local_offset + a.len_bytes == b.local_offset
                    && a.remote_offset + a.len_bytes == b.remote_offset;
                // Two posted runs that continue each other exist only because of the bound.
                prop_assert!(!continues || a.len_bytes == max);
            }
        }
    }
}
