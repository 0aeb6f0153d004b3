"""pdkv's exchange from Python, against an oracle written from the definition (docs/ARCHITECTURE.md, "The
exchange"), not from the code under test.

The decode leg recomputes the last prompt token (N-1) itself, so it reads the KV of tokens
0 ..= N-2 (full groups), max(0, N-W) ..= N-2 (window groups) or the tokens of N-1's own chunk
before it (chunked local groups: chunks of C tokens), each block of B*dcp tokens
holding positions p*B*dcp .. (p+1)*B*dcp - 1; a mamba group reads its state (position 0); an
aligned mamba group (vLLM's prefix caching) keeps the state after t tokens at position
(t-1) // B, so it reads the state after N-1 tokens at (N-2) // B (nothing when N = 1).
"""

import itertools
import random

import pytest

import pdkv_vllm
from pdkv_vllm import BlockPair, ExchangeError, Layout

LAYOUTS = {
    "full": [{"kind": "full", "block_size": 16}],
    "full+window": [
        {"kind": "full", "block_size": 16},
        {"kind": "sliding_window", "block_size": 16, "window": 48},
    ],
    "full+window+mamba": [
        {"kind": "full", "block_size": 16},
        {"kind": "sliding_window", "block_size": 8, "window": 20},
        {"kind": "mamba"},
    ],
    # pdkv (like vLLM) supports decode context parallelism on full-attention groups only.
    "dcp2": [{"kind": "full", "block_size": 16, "dcp": 2}, {"kind": "mamba"}],
    "full+mamba_align": [{"kind": "full", "block_size": 16}, {"kind": "mamba_align", "block_size": 32}],
    # Llama 4: chunked local attention beside full; a chunk of 40 is no whole number of blocks.
    "full+chunked": [
        {"kind": "full", "block_size": 16},
        {"kind": "chunked_local", "block_size": 16, "chunk": 40},
    ],
}


def oracle_positions(group: dict, n: int) -> list[int]:
    """Block positions the decode leg reads, token by token from the definition."""
    if group["kind"] == "mamba":
        return [0]
    if group["kind"] == "mamba_align":
        return [(n - 2) // group["block_size"]] if n >= 2 else []
    block_tokens = group["block_size"] * group.get("dcp", 1)
    first = 0
    if group["kind"] == "sliding_window":
        first = max(0, n - group["window"])
    elif group["kind"] == "chunked_local":
        # Token N-1's chunk begins at the multiple of C at or below it.
        first = (n - 1) - (n - 1) % group["chunk"]
    return sorted({token // block_tokens for token in range(first, n - 1)})


def leg_blocks(groups: list[dict], n: int, lookahead: int, rng: random.Random) -> list[list[int]]:
    """A leg's per-group block ids as vLLM lays them out: position-indexed, covering the prompt
    plus the leg's lookahead tail, distinct non-null ids, and null (0) below a window group's
    needed positions (freed blocks)."""
    lists = []
    for group in groups:
        if group["kind"] == "mamba":
            lists.append([rng.randrange(1, 1 << 20)])
            continue
        block_tokens = group["block_size"] * group.get("dcp", 1)
        count = -(-(n + lookahead) // block_tokens)
        ids = rng.sample(range(1, 1 << 20), count)
        needed = oracle_positions(group, n)
        if group["kind"] in ("sliding_window", "chunked_local") and needed:
            for position in range(needed[0]):
                ids[position] = 0
        if group["kind"] == "mamba_align":
            # Below the running state: null, or now and then a cached checkpoint.
            for position in range(needed[0] if needed else 0):
                ids[position] = ids[position] if rng.random() < 0.3 else 0
        lists.append(ids)
    return lists


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_pairs_are_the_oracles_positions_whatever_the_tails(name):
    groups = LAYOUTS[name]
    layout = Layout(groups)
    rng = random.Random(name)
    lengths = list(range(1, 200)) + [255, 256, 257, 383, 384, 385, 1000]
    for n, prefill_tail, decode_tail in itertools.product(lengths, range(3), range(10)):
        prefill = leg_blocks(groups, n, prefill_tail, rng)
        decode = leg_blocks(groups, n, decode_tail, rng)
        pairing = pdkv_vllm.pair(layout, pdkv_vllm.offer(layout, n, prefill), pdkv_vllm.need(layout, n, decode))
        assert len(pairing) == len(groups)
        for g, group in enumerate(groups):
            expected = [BlockPair(p, p, prefill[g][p], decode[g][p]) for p in oracle_positions(group, n)]
            assert pairing[g] == expected, (name, n, prefill_tail, decode_tail, g)
            assert list(layout.needed_positions(g, n)) == oracle_positions(group, n)


def test_a_prefill_that_stops_at_n_minus_1_still_pairs():
    # vLLM's hybrid prefill computes N-1 tokens: its lists cover cdiv(N-1, B) blocks.
    groups = LAYOUTS["full+window"]
    layout = Layout(groups)
    rng = random.Random(7)
    for n in range(2, 200):
        prefill = leg_blocks(groups, n - 1, 0, rng)
        decode = leg_blocks(groups, n, 9, rng)
        for g, group in enumerate(groups):
            needed = oracle_positions(group, n)
            for position in range(needed[0] if needed else 0):
                prefill[g][position] = 0
        pairing = pdkv_vllm.pair(layout, pdkv_vllm.offer(layout, n, prefill), pdkv_vllm.need(layout, n, decode))
        for g, group in enumerate(groups):
            assert [p.remote_block for p in pairing[g]] == [prefill[g][p] for p in oracle_positions(group, n)]


def test_prefix_hits_leave_only_the_suffix_to_read():
    groups = LAYOUTS["full"]
    layout = Layout(groups)
    n = 100
    prefill = [list(range(1, 8))]
    decode = [list(range(101, 108))]
    pairing = pdkv_vllm.pair(layout, pdkv_vllm.offer(layout, n, prefill), pdkv_vllm.need(layout, n, decode, [4]))
    # Tokens 0..=98 sit in positions 0..=6; the decode leg holds 0..=3 already.
    assert [p.local_position for p in pairing[0]] == [4, 5, 6]


def test_a_missing_position_is_an_error_not_a_shift():
    groups = LAYOUTS["full+window"]
    layout = Layout(groups)
    n = 130
    short = [list(range(1, 10)), list(range(20, 22))]  # window group lacks positions 5..8
    with pytest.raises(ExchangeError, match="group 1"):
        pdkv_vllm.offer(layout, n, short)


def test_a_null_block_where_kv_is_needed_is_refused():
    groups = LAYOUTS["full+window"]
    layout = Layout(groups)
    n = 130
    prefill = [list(range(1, 10)), list(range(20, 29))]
    prefill[1][7] = 0
    with pytest.raises(ExchangeError, match="null"):
        pdkv_vllm.offer(layout, n, prefill)


def test_malformed_input_gets_a_clear_error():
    layout = Layout(LAYOUTS["full"])
    need = pdkv_vllm.need(layout, 10, [[1]])
    with pytest.raises(ExchangeError, match="malformed offer"):
        pdkv_vllm.pair(layout, {"groups": "many"}, need)
    with pytest.raises(ExchangeError, match="num_prompt_tokens must be at least 1"):
        pdkv_vllm.offer(layout, 0, [[1]])
    with pytest.raises(ExchangeError):
        Layout([{"kind": "global", "block_size": 16}])
    with pytest.raises(ExchangeError, match="window"):
        Layout([{"kind": "sliding_window", "block_size": 16}])
    with pytest.raises(ExchangeError, match="dcp"):
        Layout([{"kind": "sliding_window", "block_size": 16, "window": 64, "dcp": 2}])
    other = Layout([{"kind": "full", "block_size": 32}])
    with pytest.raises(ExchangeError):
        pdkv_vllm.pair(other, pdkv_vllm.offer(layout, 10, [[1]]), need)
    with pytest.raises(ExchangeError, match="does not exist"):
        layout.needed_positions(3, 10)
    # Block ids past u32 are Python's to refuse, before pdkv sees them.
    with pytest.raises(OverflowError):
        pdkv_vllm.offer(layout, 10, [[1 << 40]])
