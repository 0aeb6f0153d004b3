"""PdkvConnector under vLLM's real scheduler on CPU: P/D lifecycles on both legs, byte-exact KV,
clean failures, no leaked blocks.

Expected values come from the definition (docs/ARCHITECTURE.md, "The exchange"): the decoder recomputes
token N-1, so it must hold the prefill's KV of tokens 0 ..= N-2 (window groups: N-W ..= N-2;
chunked local groups: from the first token of token N-1's chunk) and the mamba state after N-1
tokens. ``oracle_positions`` and the tags are computed here, not by pdkv.
"""

from __future__ import annotations

import json
import os
import socket
import time

import pytest

if os.environ.get("PDKV_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM is not installed (CI installs it: PDKV_REQUIRE_VLLM=1)")

import torch  # noqa: E402

import pdkv_vllm  # noqa: E402
from vllm_harness import (  # noqa: E402
    BLOCK,
    LAYOUTS,
    SWEPT,
    Leg,
    dcp_token,
    first_attended,
    global_head,
    leg_state,
    run_prefill,
    tag,
)

# Prompt lengths: around block edges, (N-1) % B == 0, and lengths where a lookahead tail of k
# blocks exists on one leg only ((N-1) % B >= B - k), the seed's failing class.
LENGTHS = [2, 3, 16, 17, 18, 31, 32, 33, 40, 47, 48, 49, 55, 63, 64, 65, 71, 79, 97, 100, 129, 200]
STEP_BUDGET = 400


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pdkv")
    # Worker i of a leg of TP x PP workers is <leg>-i (i = stage * TP + rank): up to 6.
    workers = [f"{leg}-{index}" for leg in ("p0", "d0") for index in range(1, 6)]
    nodes = ["p0", "d0", *workers, "p1", "d1", "intruder"]
    pdkv_vllm.write_cluster_certs(str(root / "certs"), nodes)
    return root


def oracle_positions(kind: str, block_tokens: int, window: int | None, n: int) -> list[int]:
    if kind == "mamba":
        return [0]
    if kind == "mamba_align":
        # vLLM's align mode: the state after the N - 1 tokens the decoder does not recompute
        # lies with the last of them (preprocess_mamba: (num_computed_tokens - 1) // block_size).
        return [(n - 2) // block_tokens] if n >= 2 else []
    first = first_attended(kind, window, n)
    return sorted({token // block_tokens for token in range(first, n - 1)})


class Pd:
    """A prefill leg (here, or in another process) and a decode leg over vLLM schedulers, with
    checks at every load."""

    def __init__(self, root, layout, p_lookahead=0, d_lookahead=0, p_extra=None, d_extra=None, nodes=("p0", "d0"),
                 prefill=None, prefix_caching=False, kv_layout="LBHNC", alloc="memfd", p_spec=None, d_spec=None,
                 p_tp=None, d_tp=None, kv_heads=None, p_pp=1, d_pp=1, d_layout=None):
        p, d = nodes
        d_layout = d_layout or layout
        memory = {"prefix_caching": prefix_caching, "kv_layout": kv_layout, "alloc": alloc, "kv_heads": kv_heads}
        p_split = (p_tp or LAYOUTS[layout]["dcp"], LAYOUTS[layout]["dcp"], LAYOUTS[layout].get("interleave", 1))
        d_split = (d_tp or LAYOUTS[d_layout]["dcp"], LAYOUTS[d_layout]["dcp"], LAYOUTS[d_layout].get("interleave", 1))
        if p_split != d_split:
            # Legs of different TP or DCP splits: every worker talks to every rank of the other leg.
            p_extra = dict(p_extra or {}, peer_tp=d_split[0], peer_dcp=d_split[1], peer_dcp_interleave=d_split[2])
            d_extra = dict(d_extra or {}, peer_tp=p_split[0], peer_dcp=p_split[1], peer_dcp_interleave=p_split[2])
        if p_pp != d_pp:
            # Legs of different PP sizes: every worker talks to every stage of the other leg.
            p_extra = dict(p_extra or {}, peer_pp=d_pp)
            d_extra = dict(d_extra or {}, peer_pp=p_pp)
        self.prefill = prefill or LocalPrefill(
            Leg(root, "prefill", p, [d], layout, lookahead=p_lookahead, extra=p_extra, speculative_tokens=p_spec,
                tp=p_tp, pp=p_pp, **memory)
        )
        self.decode = Leg(
            root, "decode", d, [p], d_layout, lookahead=d_lookahead, extra=d_extra, speculative_tokens=d_spec,
            tp=d_tp, pp=d_pp, **memory
        )
        # Legs of equal TP and DCP copy each rank's blocks whole; otherwise each decode rank's
        # heads and tokens come from other ranks' blocks, and only the definition says what they
        # hold.
        self.same_ranks = (p_tp or 0) == (d_tp or 0) and p_split == d_split
        self.decode.on_loaded = self.check_loaded
        self.layout = d_layout
        self.expected = {}  # decode request id -> (n, seed, prefill pages per rank/plane/position)
        self.snapshots = {}
        self.checked = set()

    def close(self):
        self.decode.shutdown()
        self.prefill.shutdown()

    def record_decoder_hits(self) -> dict:
        """The tokens the decoder's prefix cache held when vLLM asked the connector about each
        request (its ``num_computed_tokens``), filled in as requests arrive."""
        hits = {}
        scheduler_side = self.decode.scheduler.connector
        original = scheduler_side.get_num_new_matched_tokens

        def spy(request, num_computed_tokens):
            hits[request.request_id] = num_computed_tokens
            return original(request, num_computed_tokens)

        scheduler_side.get_num_new_matched_tokens = spy
        return hits

    def run_longer_prompts_past_prefix_hits(self, hits: dict, seed: int) -> None:
        """Prompts of 100, 131 and 150 tokens sharing their first 70 with a prompt both legs
        cached: the decoder hits at least 64 tokens, reads the rest byte-exact and recomputes
        only the last prompt token."""
        for n in (100, 131, 150):
            did = self.run(f"long{n}", n, seed=seed)
            assert hits[did] >= 64, f"n={n}: the decoder should hit its cached prefix, hit {hits[did]}"
            assert did in self.checked and did not in self.decode.failed_loads
            assert self.decode.computed[did] == 1

    def check_loaded(self, did):
        if did not in self.expected:
            return  # a request the test drives by hand
        n, seed, pages = self.expected[did]
        ids = self.decode.scheduler.kv_cache_manager.get_block_ids(did)
        dcp, interleave = LAYOUTS[self.layout]["dcp"], self.decode.interleave
        # Groups overlay one memory (a block id is one group's at a time): the blocks any group
        # loads are the only ones whose bytes may change, in every layer.
        touched = set()
        for group, (kind, _, window) in enumerate(LAYOUTS[self.layout]["groups"]):
            positions = oracle_positions(kind, self.decode.block_tokens(group), window, n)
            touched |= {ids[group][position] for position in positions}
        for index, ((_, rank), planes) in enumerate(zip(self.decode.ranks, self.decode.planes)):
            for plane in planes:
                kind, _, window = LAYOUTS[self.layout]["groups"][plane.group]
                block_tokens = self.decode.block_tokens(plane.group)
                positions = oracle_positions(kind, block_tokens, window, n)
                for position in positions:
                    block = ids[plane.group][position]
                    got = plane.view[block]
                    # Byte-exact against what the prefill wrote for this position ...
                    assert not self.same_ranks or torch.equal(got, pages[rank, plane.index][position]), (
                        f"{self.layout} n={n} worker {index} plane {plane.index} position {position}"
                    )
                    # ... and against the definition, token by token.
                    if kind in ("mamba", "mamba_align"):
                        assert int(got.flatten()[0]) == tag(seed, plane.index, n - 1), "mamba state not after N-1"
                        continue
                    first = first_attended(kind, window, n)
                    slots, heads = got.shape[0], got.shape[1]
                    for slot in range(slots):
                        token = position * block_tokens + dcp_token(slot, rank % dcp, dcp, interleave)
                        if first <= token <= n - 2:
                            for local in range(heads):
                                head = global_head(self.decode.kv_heads, self.decode.tp, rank, local)
                                assert bool((got[slot, local] == tag(seed, plane.index, token, head)).all()), (
                                    f"{self.layout} n={n} token {token} plane {plane.index} rank {rank} head {head}"
                                )
                # Nothing but the paired blocks changed in the decode's memory.
                before = self.snapshots[did][index, plane.index]
                changed = {
                    b for b in range(before.shape[0]) if not torch.equal(before[b], plane.view[b])
                }
                assert changed <= touched, f"blocks {sorted(changed - touched)} changed outside the pairing"
        self.checked.add(did)

    def run(self, rid, n, seed, max_tokens=3, before_decode=None, params=None):
        """One request through both legs; returns the decode request id."""
        prompt = [(seed * 7 + i) % 997 + 1 for i in range(n)]
        prefill_params, pages = self.prefill.prefill(f"p-{rid}", prompt, seed, n)
        assert prefill_params["do_remote_prefill"] is True
        params = params or prefill_params
        did = f"d-{rid}"
        self.expected[did] = (n, seed, pages)
        self.snapshots[did] = {
            (rank, plane.index): plane.view.clone()
            for rank, planes in enumerate(self.decode.planes)
            for plane in planes
        }
        if before_decode is not None:
            before_decode()
        self.decode.add(did, prompt, max_tokens, params, seed)
        self.drive(did)
        assert len(self.decode.tokens[did]) == max_tokens, "the decoder generated every token"
        return did

    def drive(self, did, unclaimed=None):
        """Steps both legs until ``did`` finished on the decoder and the prefill holds nothing.
        ``unclaimed`` names a prefill request whose hand-off no decoder will claim: it is revoked
        once ``did`` finished, as its lease would end it (on every prefill rank)."""
        deadline = time.monotonic() + 30
        while did not in self.decode.finished or self.prefill.busy():
            assert time.monotonic() < deadline, self.state()
            self.decode.step()
            self.prefill.step()
            if unclaimed is not None and did in self.decode.finished:
                for worker in self.prefill.leg.workers:
                    worker._worker.agent.revoke(unclaimed)

    def state(self):
        return {
            "decode": {r: req.status.name for r, req in self.decode.scheduler.requests.items()},
            "prefill": self.prefill.state(),
        }

    def assert_no_leaks_with_cache(self):
        """With prefix caching, freed blocks stay cached but are free (evictable) all the same."""
        self.assert_no_leaks()

    def assert_no_leaks(self):
        assert not self.decode.scheduler.requests, f"decode still holds {list(self.decode.scheduler.requests)}"
        free = self.decode.num_free_blocks()
        assert free == self.decode.config.num_blocks - 1, f"decode: {free} of {self.decode.config.num_blocks - 1} free"
        self.prefill.assert_no_leaks()


class LocalPrefill:
    """A prefill leg in this process, stepped by the test."""

    def __init__(self, leg):
        self.leg = leg

    def prefill(self, rid, prompt, seed, n):
        return run_prefill(self.leg, rid, prompt, seed, n)

    def step(self):
        self.leg.step()

    def busy(self):
        return bool(self.leg.scheduler.requests)

    def state(self):
        return leg_state(self.leg)

    def live_handoffs(self):
        return sum(worker._worker.agent.live_handoffs() for worker in self.leg.workers)

    def assert_no_leaks(self):
        state = leg_state(self.leg)
        assert not state["requests"], f"prefill still holds {state['requests']}"
        assert state["free"] == self.leg.config.num_blocks - 1, f"prefill: {state['free']} blocks free"
        assert state["handoffs"] == 0

    def shutdown(self):
        self.leg.shutdown()


def sweep(certs, layout, lengths, seed, engine, **legs):
    """Every length through a fresh pair of legs built with ``legs``: byte-exact loads (checked
    in ``Pd.check_loaded``), read with ``engine``, nothing left held."""
    pd = Pd(certs, layout, **legs)
    try:
        for index, n in enumerate(lengths):
            did = pd.run(f"{seed}-{n}", n, seed=seed + index)
            assert did in pd.checked and did not in pd.decode.failed_loads, f"{layout} {legs} n={n}"
        assert pd.decode.workers[0]._worker.agent.engines_in_use() == [engine]
        pd.assert_no_leaks()
    finally:
        pd.close()


@pytest.mark.parametrize("layout", SWEPT)
def test_kv_allocated_by_vllm_itself_is_read_over_the_network(certs, layout):
    """KV caches allocated by vLLM's own worker code (plain memory, not a memfd): the workers
    offer no shared memory, so the automatic choice is the network, byte-exact all the same."""
    for seed, kv_layout in ((900, "LBNHC"), (950, "BLHNC")):
        legs = {"p_lookahead": 1, "d_lookahead": 5, "kv_layout": kv_layout, "alloc": "vllm"}
        sweep(certs, layout, LENGTHS[::3], seed, "net", **legs)


@pytest.mark.parametrize("kv_layout", ["BLNHC", "LBNHC"])
def test_other_kv_layouts_load_byte_exact_kv_through_shared_memory(certs, kv_layout):
    for layout in SWEPT:
        sweep(certs, layout, LENGTHS[1::3], 700, "shm", p_lookahead=2, d_lookahead=3, kv_layout=kv_layout)


def test_a_layout_whose_blocks_are_not_contiguous_is_refused_by_name(certs):
    from pdkv_vllm.connector import ConnectorConfigError

    with pytest.raises(ConnectorConfigError, match="not one contiguous run of memory"):
        Leg(certs, "prefill", "p0", ["d0"], "full", kv_layout="LHBNC")


@pytest.mark.parametrize("layout", SWEPT)
def test_network_reads_load_byte_exact_kv(certs, layout):
    """The decoder reading over the network engine (as across hosts): the prefill's memory
    server serves only the claimed hand-off's blocks to their owner."""
    for seed, (p_lookahead, d_lookahead) in ((500, (0, 9)), (550, (2, 0))):
        legs = {"p_lookahead": p_lookahead, "d_lookahead": d_lookahead, "d_extra": {"read_engine": "net"}}
        sweep(certs, layout, LENGTHS, seed, "net", **legs)


@pytest.mark.parametrize("layout", SWEPT)
@pytest.mark.parametrize("p_lookahead", [0, 1, 2])
def test_every_length_and_lookahead_loads_byte_exact_kv(certs, layout, p_lookahead):
    for d_lookahead in range(10):
        pd = Pd(certs, layout, p_lookahead, d_lookahead)
        try:
            for index, n in enumerate(LENGTHS):
                did = pd.run(f"{d_lookahead}-{n}", n, seed=1000 * d_lookahead + index)
                if n >= 2:
                    assert did in pd.checked or did in pd.decode.loaded, f"n={n}: no load happened"
                assert did not in pd.decode.failed_loads, f"n={n}: the load failed"
            pd.assert_no_leaks()
        finally:
            pd.close()


class RemotePrefill:
    """A prefill leg in another process (it steps itself): the decode maps its memory through
    /proc and reaches it over QUIC, as across real processes."""

    def __init__(self, root, layout, node, peers, extra=None, netns=None):
        import multiprocessing

        from vllm_harness import serve_prefill

        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(
            target=serve_prefill, args=(child, str(root), layout, node, peers, extra, netns), daemon=True
        )
        self.process.start()
        assert self.conn.poll(120), "the prefill process did not start"
        ready, self.pid = self.conn.recv()
        assert ready == "ready" and self.pid != os.getpid()

    def ask(self, *command):
        self.conn.send(command)
        assert self.conn.poll(60), f"the prefill process did not answer {command[0]}"
        return self.conn.recv()

    def prefill(self, rid, prompt, seed, n):
        return self.ask("prefill", rid, prompt, seed, n)

    def step(self):
        pass

    def busy(self):
        return self.process.is_alive() and bool(self.ask("state")["requests"])

    def state(self):
        return self.ask("state") if self.process.is_alive() else "killed"

    def kill(self):
        self.process.kill()
        self.process.join(10)
        assert not self.process.is_alive()

    def assert_no_leaks(self):
        if not self.process.is_alive():
            return  # a killed leg's memory went with it
        state = self.ask("state")
        assert not state["requests"] and state["handoffs"] == 0, state

    def shutdown(self):
        if self.process.is_alive():
            assert self.ask("exit") == "bye"
            self.process.join(10)


@pytest.mark.parametrize("engine", ["shm", "net"])
def test_a_prefill_in_another_process_hands_off_byte_exact_kv_and_a_killed_one_fails_cleanly(certs, engine):
    layout = "full+window+mamba"
    remote = RemotePrefill(certs, layout, "p1", ["d1"])
    pd = Pd(certs, layout, nodes=("p1", "d1"), prefill=remote, d_extra={"read_engine": engine})
    try:
        for index, n in enumerate([17, 55, 63, 100]):
            did = pd.run(f"x{n}", n, seed=50 + index)
            assert did in pd.checked and did not in pd.decode.failed_loads
            assert pd.decode.computed[did] == 1, "the decoder recomputed only the last prompt token"
        assert pd.decode.workers[0]._worker.agent.engines_in_use() == [engine]
        pd.assert_no_leaks()
        # Killed (SIGKILL) after its prefill finished and before the decoder's READ: the READ
        # fails (unreachable), vLLM recomputes the whole prompt, nothing leaks on the decoder.
        did = pd.run("killed", 70, seed=9, before_decode=remote.kill)
        assert did in pd.decode.failed_loads and did not in pd.checked
        assert pd.decode.computed[did] == 70, "the decoder recomputed the prompt"
        pd.assert_no_leaks()
    finally:
        pd.close()


def test_a_lapsed_lease_gives_a_load_error_and_a_recompute(certs):
    # Long enough for a decoder to claim a hand-off on its next step even on a loaded machine
    # (the second request), short enough to wait out (the first).
    pd = Pd(certs, "full+window", p_extra={"lease_ms": 500})

    def lapse():
        # The prefill announces the hand-off on its next step; 500 ms later the lease lapses and
        # the prefill frees the blocks, before any decoder claimed them.
        deadline = time.monotonic() + 10
        while pd.prefill.busy():
            assert time.monotonic() < deadline, "the lease never lapsed"
            pd.prefill.step()
            time.sleep(0.002)

    try:
        did = pd.run("lapsed", 70, seed=3, before_decode=lapse)
        assert did in pd.decode.failed_loads and did not in pd.checked
        assert pd.decode.computed[did] == 70
        # The next request is unaffected.
        ok = pd.run("after", 70, seed=4)
        assert ok in pd.checked and pd.decode.computed[ok] == 1
        pd.assert_no_leaks()
    finally:
        pd.close()


def test_a_restarted_prefill_is_never_read_from(certs):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    extra = {"listen": f"127.0.0.1:{port}"}
    pd = Pd(certs, "full", p_extra=extra)
    try:
        def restart():
            # The leg that computed the KV stops; a new incarnation of it serves the same address.
            pd.prefill.shutdown()
            pd.prefill = LocalPrefill(Leg(certs, "prefill", "p0", ["d0"], "full", extra=extra))

        did = pd.run("restarted", 40, seed=8, before_decode=restart)
        assert did in pd.decode.failed_loads and did not in pd.checked
        assert pd.decode.computed[did] == 40
        pd.assert_no_leaks()
    finally:
        pd.close()


def test_forged_and_foreign_transfers_are_refused_and_recomputed(certs):
    # Nobody claims the real hand-off: its short lease lapses and the prefill frees it.
    pd = Pd(certs, "full", p_extra={"lease_ms": 200}, d_extra={"claim_wait_ms": 50})
    stranger = Pd.__new__(Pd)
    try:
        # A hand-off the prefill never announced (a forged request id): the claim waits its
        # bounded time and fails; the decoder recomputes.
        def forge(params):
            forged = json.loads(json.dumps(params))
            forged["pdkv"]["request"] = "p-never-announced"
            return forged

        prompt_n = 33
        prompt = [(11 * 7 + i) % 997 + 1 for i in range(prompt_n)]
        params, _ = pd.prefill.prefill("p-real", prompt, 11, prompt_n)
        pd.decode.add("d-forged", prompt, 2, forge(params), 11)
        pd.drive("d-forged")
        assert "d-forged" in pd.decode.failed_loads
        assert pd.decode.computed["d-forged"] == prompt_n
        pd.assert_no_leaks()
        # A node the prefill does not admit is refused at the handshake.
        stranger.decode = Leg(certs, "decode", "intruder", ["p0"], "full")
        stranger.decode.add("d-intruder", prompt, 2, params, 11)
        deadline = time.monotonic() + 30
        while "d-intruder" not in stranger.decode.finished:
            assert time.monotonic() < deadline
            stranger.decode.step()
        assert "d-intruder" in stranger.decode.failed_loads
        assert stranger.decode.computed["d-intruder"] == prompt_n
    finally:
        if hasattr(stranger, "decode"):
            stranger.decode.shutdown()
        pd.close()


@pytest.mark.parametrize("layout", ["full", "full+window"])
def test_prefix_hits_on_either_leg_are_read_around(certs, layout):
    pd = Pd(certs, layout, p_lookahead=2, d_lookahead=3, prefix_caching=True)
    hits = pd.record_decoder_hits()
    try:
        first = pd.run("short", 70, seed=21)
        assert hits[first] == 0 and first in pd.checked
        # The same prompt, longer: both legs hold its first blocks in their prefix caches. The
        # decoder reads only the blocks past its hit; every needed block still holds the
        # prefill's bytes for its position.
        pd.run_longer_prompts_past_prefix_hits(hits, seed=21)
        pd.assert_no_leaks_with_cache()
    finally:
        pd.close()


def test_aborts_on_either_leg_leak_nothing(certs):
    from vllm.v1.request import RequestStatus

    pd = Pd(certs, "full+window+mamba")
    try:
        # The decoder aborts a request whose READ was just posted: vLLM keeps its blocks until
        # the load reports back, then frees them; the prefill's hand-off is released or lapses.
        n = 90
        prompt = [(5 * 7 + i) % 997 + 1 for i in range(n)]
        params, _ = pd.prefill.prefill("p-aborted", prompt, 5, n)
        pd.decode.add("d-aborted", prompt, 4, params, 5)
        pd.decode.step()
        assert pd.decode.scheduler.requests["d-aborted"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
        pd.decode.scheduler.finish_requests("d-aborted", RequestStatus.FINISHED_ABORTED)
        deadline = time.monotonic() + 30
        while pd.decode.scheduler.requests or pd.prefill.busy():
            assert time.monotonic() < deadline, pd.state()
            pd.decode.step()
            pd.prefill.step()
        assert pd.decode.computed.get("d-aborted", 0) == 0
        # The prefill aborts mid-prompt: nothing is handed off.
        pd.prefill.leg.add("p-cut", prompt, 1, {"do_remote_decode": True}, 6)
        pd.prefill.leg.scheduler.finish_requests("p-cut", RequestStatus.FINISHED_ABORTED)
        for _ in range(3):
            pd.prefill.step()
        assert pd.prefill.live_handoffs() == 0
        pd.assert_no_leaks()
        # Both legs still serve.
        did = pd.run("after-aborts", 77, seed=7)
        assert did in pd.checked
        pd.assert_no_leaks()
    finally:
        pd.close()


class NetworkNamespace:
    """A network namespace joined to this one by a veth pair: another "host" on this machine
    (its own addresses and host id, so shared memory is not offered), removed on close."""

    def __init__(self):
        import subprocess

        self.run = lambda *args: subprocess.run(args, check=True, capture_output=True)
        tag = f"{os.getpid() % 10000}"
        self.name = f"pdkv-py-{tag}"
        subnet = 100 + os.getpid() % 100
        self.outside, self.inside = f"10.232.{subnet}.1", f"10.232.{subnet}.2"
        self.veth = (f"pvo{tag}", f"pvi{tag}")
        self.run("ip", "netns", "add", self.name)
        try:
            self.run("ip", "link", "add", self.veth[0], "type", "veth", "peer", "name", self.veth[1])
            self.run("ip", "link", "set", self.veth[1], "netns", self.name)
            self.run("ip", "addr", "add", f"{self.outside}/24", "dev", self.veth[0])
            self.run("ip", "link", "set", self.veth[0], "up")
            for args in (
                ("addr", "add", f"{self.inside}/24", "dev", self.veth[1]),
                ("link", "set", self.veth[1], "up"),
                ("link", "set", "lo", "up"),
            ):
                self.run("ip", "netns", "exec", self.name, "ip", *args)
        except BaseException:
            self.close()
            raise

    def close(self):
        import subprocess

        # Deleting the namespace deletes its veth end, and with it the pair.
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)


def test_a_prefill_on_another_host_is_read_over_the_network(certs):
    """The prefill worker runs in its own network namespace (another host as far as pdkv can
    tell): the decoder's automatic engine choice is the network, the READ crosses a veth pair."""
    import shutil

    if os.geteuid() != 0 or shutil.which("ip") is None:
        if os.environ.get("PDKV_REQUIRE_NETNS") == "1":
            pytest.fail("PDKV_REQUIRE_NETNS=1 but not root or no `ip`: the namespace test cannot run")
        pytest.skip("network namespaces need root and iproute2")
    namespace = NetworkNamespace()
    layout = "full+window"
    try:
        remote = RemotePrefill(
            certs, layout, "p1", ["d1"], extra={"listen": f"{namespace.inside}:0"}, netns=namespace.name
        )
        pd = Pd(certs, layout, nodes=("p1", "d1"), prefill=remote)
        try:
            for index, n in enumerate([17, 63, 100, 129]):
                did = pd.run(f"ns{n}", n, seed=70 + index)
                assert did in pd.checked and did not in pd.decode.failed_loads, f"n={n}"
            agent = pd.decode.workers[0]._worker.agent
            assert agent.engines_in_use() == ["net"], "another host is read over the network"
            pd.assert_no_leaks()
        finally:
            pd.close()
    finally:
        namespace.close()


MALFORMED = [
    "not a dict",
    {},
    {"request": 7, "num_prompt_tokens": 33, "offer": {}, "workers": []},
    {"request": "p-x", "num_prompt_tokens": "33", "offer": {}, "workers": []},
    {"request": "p-x", "num_prompt_tokens": 33, "offer": {"groups": "junk"}, "workers": []},
    {"request": "p-x", "num_prompt_tokens": 33, "offer": {}, "workers": [{"node": 1}]},
    {"request": "p-x", "num_prompt_tokens": 33, "offer": {}, "workers": [{"node": "p0", "incarnation": -1}]},
    {"request": "p-x", "num_prompt_tokens": 32, "offer": {}, "workers": []},
]


def test_malformed_transfer_params_are_refused_and_the_prompt_computed_locally(certs):
    pd = Pd(certs, "full+window")
    try:
        prompt = [(3 * 7 + i) % 997 + 1 for i in range(33)]
        for index, ours in enumerate(MALFORMED):
            did = f"d-bad{index}"
            pd.decode.add(did, prompt, 2, {"do_remote_prefill": True, "pdkv": ours}, 3)
            deadline = time.monotonic() + 30
            while did not in pd.decode.finished:
                assert time.monotonic() < deadline, (ours, pd.state())
                pd.decode.step()
            assert pd.decode.computed[did] == 33, f"{ours!r}: the prompt is computed here"
            assert len(pd.decode.tokens[did]) == 2
        # A well-formed offer whose pairing pdkv refuses (its prompt length disagrees with its
        # offer) is a failed load, recomputed.
        params, _ = pd.prefill.prefill("p-real", prompt, 3, 33)
        forged = json.loads(json.dumps(params))
        forged["pdkv"]["offer"]["num_prompt_tokens"] = 34
        pd.decode.add("d-mismatch", prompt, 2, forged, 3)
        pd.drive("d-mismatch", unclaimed="p-real")
        assert "d-mismatch" in pd.decode.failed_loads
        assert pd.decode.computed["d-mismatch"] == 33
        # An offer naming no DCP split a leg can have is refused before anything is read.
        from pdkv_vllm.connector import malformed

        params, _ = pd.prefill.prefill("p-split", prompt, 3, 33)
        assert params["pdkv"]["dcp"] == {"size": 1, "interleave": 1}
        for bad in ({"size": 2, "interleave": 0}, {"size": True, "interleave": 1}, [2, 1]):
            assert "dcp is not" in malformed(dict(params["pdkv"], dcp=bad)), bad
        forged = json.loads(json.dumps(params))
        forged["pdkv"]["dcp"] = {"size": 0, "interleave": 1}
        pd.decode.add("d-split", prompt, 2, forged, 3)
        pd.drive("d-split", unclaimed="p-split")
        assert "d-split" not in pd.decode.loaded and pd.decode.computed["d-split"] == 33
        pd.assert_no_leaks()
    finally:
        pd.close()


@pytest.mark.parametrize(
    "extra, named",
    [
        ({"certs": "/c"}, "node"),
        ({"node": "p0"}, "certs"),
        ({"node": "p0", "certs": "/c", "lease": 5}, "unknown keys ['lease']"),
        ({"node": "p0", "certs": "/c", "lease_ms": 0}, "lease_ms"),
        ({"node": "p0", "certs": "/c", "lease_ms": True}, "lease_ms"),
        ({"node": "p0", "certs": "/c", "lease_ms": 2**64}, "lease_ms"),
        ({"node": "p0", "certs": "/c", "read_timeout_ms": 86_400_001}, "read_timeout_ms"),
        ({"node": "p0", "certs": "/c", "load_threads": 10**6}, "load_threads"),
        ({"node": "p0", "certs": "/c", "max_handoffs": 2**40}, "max_handoffs"),
        ({"node": "p0", "certs": "/c", "peers": "d0"}, "peers"),
        ({"node": "p0", "certs": "/c", "read_engine": "rdma"}, "read_engine"),
        ({"node": "p0", "certs": "/c", "listen": "10.0.0.5"}, "listen"),
        ({"node": "p0", "certs": "/c", "mori_port": 70000}, "mori_port"),
        ({"node": "p0", "certs": "/c", "rank": -1}, "rank"),
        ({"node": "p0", "certs": "/c", "advertise": "10.0.0.5"}, "advertise"),
        ({"node": "p0", "certs": "/c", "data_advertise": 7101}, "data_advertise"),
        ({"node": "p0", "certs": "/c", "peer_dcp": 0}, "peer_dcp"),
        ({"node": "p0", "certs": "/c", "peer_dcp_interleave": "8"}, "peer_dcp_interleave"),
    ],
)
def test_bad_connector_settings_are_refused_by_name(extra, named):
    from pdkv_vllm.connector import ConnectorConfigError, Settings

    with pytest.raises(ConnectorConfigError, match=named.replace("[", r"\[").replace("]", r"\]")):
        Settings.parse(extra)


def test_a_decode_rank_without_a_prefill_peer_fails_the_load(certs):
    """Heterogeneous TP is not supported: transfer params naming fewer prefill workers than the
    decoder has ranks make the load fail (rank 1 has no peer) and vLLM recompute, while rank 0's
    hand-off is still released."""
    pd = Pd(certs, "dcp2")
    try:
        n = 70
        prompt = [(8 * 7 + i) % 997 + 1 for i in range(n)]
        params, _ = pd.prefill.prefill("p-hetero", prompt, 8, n)
        assert len(params["pdkv"]["workers"]) == 2
        params["pdkv"]["workers"] = params["pdkv"]["workers"][:1]
        pd.decode.add("d-hetero", prompt, 2, params, 8)
        # Prefill rank 1's hand-off is never claimed.
        pd.drive("d-hetero", unclaimed="p-hetero")
        assert "d-hetero" in pd.decode.failed_loads
        assert pd.decode.computed["d-hetero"] == n
        pd.assert_no_leaks()
    finally:
        pd.close()


def test_a_one_token_prompt_loads_nothing_and_the_decoder_computes_it(certs):
    """N = 1: the decoder recomputes the only prompt token, so nothing is read. vLLM refuses an
    asynchronous load of 0 tokens (it asserts, and the engine dies), so none is asked for."""
    for layout in ("full", "full+window+mamba"):
        pd = Pd(certs, layout, p_lookahead=1, d_lookahead=3)
        try:
            did = pd.run(f"one-{layout}", 1, seed=41)
            assert did not in pd.decode.loaded and did not in pd.decode.failed_loads, "no load at all"
            assert pd.decode.computed[did] == 1
            pd.assert_no_leaks()
            # The legs serve on.
            did = pd.run(f"after-one-{layout}", 40, seed=42)
            assert did in pd.checked
        finally:
            pd.close()


@pytest.mark.parametrize("layout", ["full", "full+window"])
def test_a_prompt_the_decoder_holds_already_is_not_read_and_its_handoff_is_given_back(certs, layout):
    """The same prompt twice, prefix caching on the decoder: the second time its cache holds the
    first N-1 tokens (N - 1 a multiple of the block size), so nothing is read, and the prefill's
    hand-off is released at once: with an hour-long lease, ``drive`` (which waits for the
    prefill to hold nothing) would time out otherwise."""
    pd = Pd(certs, layout, p_extra={"lease_ms": 3_600_000}, prefix_caching=True)
    try:
        n = 4 * BLOCK + 1
        first = pd.run("held-1", n, seed=51)
        assert first in pd.checked
        again = pd.run("held-2", n, seed=51)
        assert again not in pd.decode.loaded and again not in pd.decode.failed_loads, "nothing read"
        assert pd.decode.computed[again] == 1, "only the last prompt token is computed"
        assert pd.prefill.live_handoffs() == 0
        pd.assert_no_leaks_with_cache()
    finally:
        pd.close()


def test_kv_offered_for_another_prompt_or_model_is_refused_and_never_cached(certs):
    """A decode request carrying another prompt's ``kv_transfer_params`` (same length) is refused
    before any byte moves, and so is one whose offer names another model: the prompt is computed
    here. Its blocks then hold its own KV, so a later request sharing its prefix, which hits
    them in the decoder's prefix cache, still checks byte-exact against the definition."""
    pd = Pd(certs, "full", prefix_caching=True)
    n = 3 * BLOCK + 7
    try:
        other = [(9 * 7 + i) % 997 + 1 for i in range(n)]
        offered, _ = pd.prefill.prefill("p-other", other, 9, n)
        ours = [(12 * 7 + i) % 997 + 1 for i in range(n)]
        pd.decode.add("d-foreign", ours, 2, offered, 12)
        pd.drive("d-foreign", unclaimed="p-other")
        assert "d-foreign" not in pd.decode.loaded and "d-foreign" not in pd.decode.failed_loads, "no load began"
        assert pd.decode.computed["d-foreign"] == n, "the prompt is computed here"
        # An offer that names another model is refused the same way.
        params, _ = pd.prefill.prefill("p-model", ours, 12, n)
        from pdkv_vllm.connector import model_identity

        fields = params["pdkv"]["model_fields"]
        assert model_identity(fields) == params["pdkv"]["model"], "the digest is of the fields sent"
        assert fields["kv_cache_dtype"] == "auto" and fields["groups"], fields
        forged = json.loads(json.dumps(params))
        forged["pdkv"]["model_fields"]["kv_cache_dtype"] = "fp8"
        forged["pdkv"]["model"] = model_identity(forged["pdkv"]["model_fields"])
        pd.decode.add("d-model", ours, 2, forged, 12)
        pd.drive("d-model", unclaimed="p-model")
        assert "d-model" not in pd.decode.loaded and "d-model" not in pd.decode.failed_loads
        counted = pd.decode.scheduler_stats.data
        assert (counted["refused_offers"], counted["recomputed_requests"]) == (2, 2), counted
        # Its first 3 blocks hit the decoder's cache (d-foreign computed them here); the rest is
        # computed here.
        assert pd.decode.computed["d-model"] == n - 3 * BLOCK
        # The same prompt, longer, through P/D: the decoder's cached prefix is this prompt's own
        # KV (check_loaded compares every position with the definition's tags for seed 12).
        longer = pd.run("longer", n + 2 * BLOCK, seed=12)
        assert longer in pd.checked and longer not in pd.decode.failed_loads
        pd.assert_no_leaks_with_cache()
    finally:
        pd.close()


def test_a_model_mismatch_names_each_differing_field_with_both_values():
    """What a decoder logs when it refuses an offer made for another model or layout: every
    field of the identity that differs, with the prefill's value and its own."""
    from pdkv_vllm.connector import identity_differences

    ours = {"kv_cache_dtype": "auto", "tensor_parallel_size": 1, "groups": [{"kind": "full", "block_size": 16}]}
    theirs = {"kv_cache_dtype": "fp8_e4m3", "tensor_parallel_size": 2, "groups": [{"kind": "full", "block_size": 16}]}
    assert identity_differences(theirs, ours) == (
        'kv_cache_dtype: prefill "fp8_e4m3", this leg "auto"; tensor_parallel_size: prefill 2, this leg 1'
    )
    assert identity_differences({**ours, "groups": [{"kind": "full", "block_size": 32}]}, ours) == (
        'groups: prefill [{"kind": "full", "block_size": 32}], this leg [{"kind": "full", "block_size": 16}]'
    )
    assert identity_differences(None, ours) == "the prefill sent no model fields"
    assert identity_differences(ours, ours) == "the fields agree but the digests differ"


def test_a_request_aborted_before_its_load_gives_its_handoff_back(certs):
    """A decode request aborted while it waits to be scheduled never reads its offer: the
    prefill's hand-off is released at once, not when its (here, hour-long) lease lapses."""
    from vllm.v1.request import RequestStatus

    pd = Pd(certs, "full+window", p_extra={"lease_ms": 3_600_000})
    try:
        n = 70
        prompt = [(6 * 7 + i) % 997 + 1 for i in range(n)]
        params, _ = pd.prefill.prefill("p-gone", prompt, 6, n)
        pd.prefill.step()  # the prefill worker announces the hand-off
        assert pd.prefill.live_handoffs() == 1
        pd.decode.add("d-gone", prompt, 2, params, 6)
        pd.decode.scheduler.finish_requests("d-gone", RequestStatus.FINISHED_ABORTED)
        deadline = time.monotonic() + 30
        while pd.prefill.busy() or pd.prefill.live_handoffs():
            assert time.monotonic() < deadline, pd.state()
            pd.decode.step()
            pd.prefill.step()
        assert pd.decode.computed.get("d-gone", 0) == 0
        pd.assert_no_leaks()
    finally:
        pd.close()


def test_a_prefill_worker_of_another_model_is_refused_at_the_handshake_and_the_prompt_recomputed(
    certs, monkeypatch, caplog
):
    """Transfer params that pass the decoder's per-request check (a router that rewrote them, or
    an address that now serves another model) still never move bytes: the decode worker's first
    handshake with the prefill worker compares their model fields, refuses, names each differing
    field with both workers' values, and vLLM recomputes the prompt."""
    import logging

    import pdkv_vllm.connector as connector

    real = connector.model_fields

    def other_model(vllm_config, groups, states=None):
        return {**real(vllm_config, groups, states), "served_model_name": "another-model", "kv_cache_dtype": "fp8"}

    monkeypatch.setattr(connector, "model_fields", other_model)
    prefill = LocalPrefill(Leg(certs, "prefill", "p0", ["d0"], "full+window"))
    monkeypatch.setattr(connector, "model_fields", real)
    pd = Pd(certs, "full+window", prefill=prefill)
    try:
        n = 3 * BLOCK + 5
        prompt = [(13 * 7 + i) % 997 + 1 for i in range(n)]
        params, _ = pd.prefill.prefill("p-other", prompt, 13, n)
        assert params["pdkv"]["model_fields"]["served_model_name"] == "another-model"
        # Rewritten to carry the decoder's own identity: the per-request check passes.
        forged = json.loads(json.dumps(params))
        decoder = pd.decode.scheduler.connector
        forged["pdkv"]["model_fields"] = decoder.model_fields
        forged["pdkv"]["model"] = decoder.model_identity
        with caplog.at_level(logging.WARNING, logger="pdkv_vllm"):
            pd.decode.add("d-other", prompt, 2, forged, 13)
            pd.drive("d-other", unclaimed="p-other")
        assert "d-other" in pd.decode.failed_loads, "the load failed"
        assert "d-other" not in pd.checked, "nothing was read"
        assert pd.decode.computed["d-other"] == n, "the whole prompt is computed here"
        served = decoder.model_fields["served_model_name"]
        refusals = [record.getMessage() for record in caplog.records if "incompatible" in record.getMessage()]
        assert refusals, [record.getMessage() for record in caplog.records]
        assert (
            f'kv_cache_dtype: d0 {decoder.model_fields["kv_cache_dtype"]}, p0 fp8; '
            f"served_model_name: d0 {served}, p0 another-model"
        ) in refusals[0], refusals[0]
        stats = pd.decode.workers[0].get_kv_connector_stats()
        assert stats is not None and stats.data["failed_loads"] == 1, stats
        counted = pd.decode.scheduler_stats.data
        assert (counted["recomputed_requests"], counted["refused_offers"]) == (1, 0), counted
        pd.assert_no_leaks()
    finally:
        pd.close()


def test_mamba_prefix_caching_reads_the_state_past_prefix_hits_on_either_leg(certs):
    """vLLM's mamba prefix caching (mamba_cache_mode "align"): each leg caches a state checkpoint
    at block boundaries; a P/D request whose prefix both legs hold reads only the attention
    blocks past the decoder's hit and the prefill's running state after N - 1 tokens, never a
    checkpoint (checked byte for byte and against the definition in ``Pd.check_loaded``)."""
    layout = "full+window+mamba-align"
    pd = Pd(certs, layout, p_lookahead=2, d_lookahead=3, prefix_caching=True)
    hits = pd.record_decoder_hits()
    try:
        seed = 31
        # The decoder computes a 70-token prompt itself (no P/D): vLLM splits its prefill at the
        # last block boundary, so the state after 64 tokens is cached there.
        prompt = [(seed * 7 + i) % 997 + 1 for i in range(70)]
        pd.decode.add("local", prompt, 2, {}, seed)
        pd.drive("local")
        assert pd.decode.computed["local"] == 70
        # P/D of the same prompt: the prefill computes it (and caches its checkpoints); the
        # decoder's own cache covers 64 tokens, so it reads blocks past them and the state.
        first = pd.run("short", 70, seed=seed)
        assert hits[first] == 64 and first in pd.checked, hits
        assert pd.decode.computed[first] == 1
        # Longer prompts sharing the prefix: both legs hit their caches, the decoder reads the
        # rest and the state after N - 1 tokens.
        pd.run_longer_prompts_past_prefix_hits(hits, seed=seed)
        pd.assert_no_leaks_with_cache()
    finally:
        pd.close()


def test_a_mamba_cache_mode_other_than_none_or_align_is_refused_by_name():
    """vLLM 0.32 and 0.33 keep a mamba group's state in two modes only; a group in any other
    (``"all"``, as older vLLM had) is refused naming the mode and the two pdkv pairs, rather
    than read as if it were one of them. And vLLM itself still has no third mode: when it gains
    one, this fails, and the connector's support must follow."""
    import types

    from pdkv_vllm.connector import ConnectorConfigError, kv_groups
    from vllm.config import CacheConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec

    parallel = types.SimpleNamespace(decode_context_parallel_size=1, prefill_context_parallel_size=1)
    config = types.SimpleNamespace(parallel_config=parallel)

    def groups(mode):
        spec = MambaSpec(block_size=BLOCK, shapes=((4,), (4,)), dtypes=(torch.int32, torch.int32), mamba_cache_mode=mode)
        return kv_groups(config, KVCacheConfig(num_blocks=4, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["m"], spec)]))

    assert groups("none") == [{"kind": "mamba"}]
    assert groups("align") == [{"kind": "mamba_align", "block_size": BLOCK}]
    with pytest.raises(ConnectorConfigError, match=r'KV group 0: mamba_cache_mode \'all\' is not one pdkv pairs \("none" or "align"\)'):
        groups("all")
    with pytest.raises(ValueError, match="mamba_cache_mode"):
        CacheConfig(mamba_cache_mode="all")


@pytest.mark.parametrize("layout", ["full+draft", "full+window"])
def test_speculative_decoding_with_a_different_k_on_each_leg_loads_byte_exact_kv(certs, layout):
    """A speculative config on both legs (a draft model proposing k tokens; vLLM reserves k
    lookahead slots), k different on each leg: the tails never move a needed block and the
    drafter's layer travels like any layer."""
    for seed, (p_spec, d_spec) in ((1300, (1, 4)), (1350, (5, 2))):
        sweep(certs, layout, LENGTHS, seed, "shm", p_spec=p_spec, d_spec=d_spec)


@pytest.mark.parametrize("layout", ["full+window+mamba", "full+mamba+spec"])
def test_speculative_decoding_with_one_k_loads_the_mamba_state_byte_exact(certs, layout):
    """Speculating k tokens, vLLM keeps k scratch blocks after each mamba state: with the same
    k on both legs the state is read, never a scratch block."""
    for seed, k in ((1400, 1), (1450, 4)):
        sweep(certs, layout, LENGTHS, seed, "shm", p_spec=k, d_spec=k)


@pytest.mark.parametrize("layout", ["full+window+mamba", "full+mamba+spec"])
def test_a_mamba_state_from_a_leg_speculating_another_k_is_refused_naming_both_layouts(certs, layout):
    """vLLM's convolution state grows a column per speculative token, so a state page from a leg
    speculating another k is another layout (read across, it was a wrong state: the first token
    of a Qwen3.5 hybrid with MTP k = 1 → 2 was off by up to 1 nat with real engines). The model
    check refuses the offer naming both layouts, and the prompt is recomputed."""
    from vllm_harness import mamba_shapes

    pd = Pd(certs, layout, p_spec=1, d_spec=2)
    try:
        layout_of = lambda k: [{"shapes": [list(shape) for shape in mamba_shapes(k)], "dtypes": ["torch.int32"] * 2}]
        assert_offer_refused_naming(pd, f"spec-{layout}", 13, "mamba_states", layout_of(1), layout_of(2))
    finally:
        pd.close()


def assert_each_length_loads(pd, name, lengths, seed):
    """Each of ``lengths`` through ``pd``: checked against the definition at its load, loaded
    (not recomputed: only the last prompt token is computed), and nothing held after."""
    for index, n in enumerate(lengths):
        did = pd.run(f"{name}-{n}", n, seed=seed + index)
        assert did in pd.checked and did not in pd.decode.failed_loads, f"n={n}"
        assert pd.decode.computed[did] == 1, "only the last prompt token is computed"
    pd.assert_no_leaks()


# (KV heads, prefill TP, decode TP): GQA heads split, merged and regrouped, and a single latent
# every rank replicates (MLA-like), read from one prefill rank per decode rank.
HETEROGENEOUS_TP = [(4, 1, 2), (4, 2, 1), (4, 4, 2), (2, 1, 4), (1, 1, 2), (1, 2, 1), (1, 4, 2)]


@pytest.mark.parametrize("kv_heads,p_tp,d_tp", HETEROGENEOUS_TP)
@pytest.mark.parametrize("kv_layout", ["LBHNC", "LBNHC", "BLHNC", "BLNHC"])
def test_legs_of_different_tensor_parallel_sizes_load_each_rank_its_heads(certs, kv_heads, p_tp, d_tp, kv_layout):
    """Each decode rank ends with exactly the KV heads vLLM gives it (checked per head against
    the definition), read from the prefill ranks holding them; every hand-off ends (the shared
    ones after their last reader, unread replicas given back) and nothing leaks."""
    layout = "full+window"
    pd = Pd(certs, layout, p_tp=p_tp, d_tp=d_tp, kv_heads=kv_heads, kv_layout=kv_layout, p_lookahead=1, d_lookahead=2)
    try:
        assert len(pd.decode.workers) == d_tp and len(pd.prefill.leg.workers) == p_tp
        assert_each_length_loads(pd, f"tp{kv_heads}-{p_tp}-{d_tp}-{kv_layout}", (2, 17, 33, 70, 129), 300)
    finally:
        pd.close()


# (kv_heads, prefill layout, prefill TP, decode layout, decode TP): scheduler blocks of BLOCK
# tokens split over DCP ranks differently on each leg (single tokens, runs of BLOCK / 2, runs of
# 2), or alike over different TP sizes (a prefill rank then meets only some decode DCP ranks),
# with one replicated head (MLA's latent) or GQA heads (vLLM's DCP for GQA replicates each
# head over tp / kv_heads ranks and takes DCP groups within them).
HETEROGENEOUS_DCP = [
    (1, "dcp2-split", 2, "full", 1),
    (1, "full", 1, "dcp2-split", 2),
    (1, "dcp2-split", 2, "full", 2),
    (1, "dcp2-split-runs", 2, "dcp4-split-pairs", 4),
    (1, "dcp4-split-pairs", 4, "dcp2-split", 2),
    (1, "dcp2-split", 4, "dcp2-split", 2),
    (1, "dcp2-split", 2, "dcp2-split", 4),
    (2, "dcp2-split", 4, "full", 2),
    (2, "full", 2, "dcp2-split-runs", 4),
]


@pytest.mark.parametrize("kv_heads,p_layout,p_tp,d_layout,d_tp", HETEROGENEOUS_DCP)
@pytest.mark.parametrize("kv_layout", ["LBHNC", "BLNHC"])
def test_legs_of_different_dcp_splits_load_each_rank_its_tokens(certs, kv_heads, p_layout, p_tp, d_layout, d_tp, kv_layout):
    """Each decode rank ends with exactly the tokens and heads vLLM's slot mapping gives it
    (checked token by token against the definition), read from the prefill ranks holding them;
    every hand-off ends after its last reader and nothing leaks."""
    pd = Pd(certs, p_layout, d_layout=d_layout, p_tp=p_tp, d_tp=d_tp, kv_heads=kv_heads, kv_layout=kv_layout,
            p_lookahead=1, d_lookahead=2)
    try:
        assert not pd.same_ranks
        name = f"dcp{kv_heads}-{p_layout}{p_tp}-{d_layout}{d_tp}-{kv_layout}"
        assert_each_length_loads(pd, name, (2, 9, 17, 33, 70, 129), 700)
    finally:
        pd.close()


def test_an_mla_model_shards_its_latent_as_one_head(tmp_path):
    """vLLM names an MLA model's attention heads as its KV heads (DeepSeek's config), while each
    rank's page holds one latent: resharding across TP or DCP splits must cut one head, or every
    load between such legs fails on the page size."""
    from vllm.config import ModelConfig, VllmConfig

    from pdkv_vllm.connector import model_fields

    config = {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 64,
        "num_attention_heads": 8, "num_key_value_heads": 8, "num_hidden_layers": 2, "intermediate_size": 128,
        "moe_intermediate_size": 32, "vocab_size": 1000, "max_position_embeddings": 2048, "torch_dtype": "float32",
        "kv_lora_rank": 32, "q_lora_rank": None, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32,
        "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = ModelConfig(model=str(tmp_path), skip_tokenizer_init=True, max_model_len=2048, dtype="float32")
    assert model.use_mla and model.get_total_num_kv_heads() == 8
    fields = model_fields(VllmConfig(model_config=model), [{"kind": "full", "block_size": 16, "dcp": 1}])
    assert fields["kv_heads"] == 1
    # Its cache is [blocks, tokens, latent]: one head, which either order cuts alike.
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec

    from pdkv_vllm.connector import page_order

    spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=48, dtype=torch.float32)
    config = KVCacheConfig(num_blocks=4, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    assert page_order(config, {"l0": torch.zeros(4, 16, 48)}) == "tokens_outer"


def test_legs_whose_scheduler_blocks_hold_other_tokens_are_refused_naming_them(certs):
    """DCP 2 with blocks of BLOCK tokens per rank makes scheduler blocks of 2 * BLOCK tokens: no
    decoder with blocks of BLOCK tokens can pair them, so its model check refuses the offer,
    naming both groups, and the prompt is recomputed."""
    pd = Pd(certs, "dcp2", d_layout="full", p_tp=2, d_tp=2, kv_heads=1)
    try:
        assert_offer_refused_naming(
            pd, "dcp-blocks", 11, "groups",
            [{"kind": "full", "block_size": 2 * BLOCK}], [{"kind": "full", "block_size": BLOCK}],
        )
    finally:
        pd.close()


def test_a_recurrent_state_across_tensor_parallel_sizes_is_refused_naming_them(certs):
    """A mamba state is not resharded by heads: its legs must run one TP size, so the offer of a
    prefill with another is refused by the model check, naming both sizes, and recomputed."""
    pd = Pd(certs, "full+window+mamba", p_tp=2, d_tp=1, kv_heads=2)
    try:
        assert_offer_refused_naming(pd, "tp-mamba", 9, "tensor_parallel_size", 2, 1)
    finally:
        pd.close()


@pytest.mark.parametrize("layout,p_tp,d_tp,kv_heads", [
    ("full", None, None, None),
    ("full+window", None, None, None),
    ("full+window", 2, 1, 4),
    ("full+window", 1, 2, 2),
])
def test_pipeline_stages_read_their_own_layers_from_the_prefill_stage_holding_them(certs, layout, p_tp, d_tp, kv_heads):
    """PP = 2 on both legs (each stage holds half of every group's layers, and with TP the stage's
    ranks reshard heads): each decode stage's planes end with the tags of its own layers (planes
    are numbered by their place in the whole model, so a layer read from the other stage fails the
    definition check), and every stage's hand-offs end."""
    pd = Pd(certs, layout, p_pp=2, d_pp=2, p_tp=p_tp, d_tp=d_tp, kv_heads=kv_heads, d_lookahead=1)
    try:
        assert [stage for stage, _ in pd.decode.ranks].count(1) == (d_tp or 1)
        stages = [
            {plane.index for (stage, _), planes in zip(pd.decode.ranks, pd.decode.planes) if stage == s for plane in planes}
            for s in (0, 1)
        ]
        assert stages[0] and stages[1] and not stages[0] & stages[1], f"stages hold disjoint layers: {stages}"
        for index, n in enumerate((2, 17, 40, 97)):
            did = pd.run(f"pp-{layout}-{p_tp}-{d_tp}-{n}", n, seed=500 + index)
            assert did in pd.checked and did not in pd.decode.failed_loads, f"n={n}"
            assert pd.decode.computed[did] == 1
        pd.assert_no_leaks()
    finally:
        pd.close()


@pytest.mark.parametrize("layout,p_pp,d_pp,p_tp,d_tp,kv_heads", [
    ("full", 2, 1, None, None, None),
    ("full", 1, 2, None, None, None),
    ("deep", 2, 3, None, None, None),
    ("deep", 3, 2, None, None, None),
    ("deep", 3, 1, 2, 1, 4),
    ("deep", 2, 3, 1, 2, 2),
])
def test_legs_of_different_pipeline_sizes_read_each_layer_from_the_stage_holding_it(
    certs, layout, p_pp, d_pp, p_tp, d_tp, kv_heads
):
    """The legs split the layers over different numbers of stages (2 -> 1, 1 -> 2, and 2 <-> 3,
    whose boundaries fall at different layers; also with TP resharding inside): each decode
    stage reads every layer it holds from whichever prefill stage holds it, byte-exact against
    the definition (planes are numbered by their place in the whole model), every prefill
    stage's hand-off ends with its last reader, and nothing leaks."""
    pd = Pd(certs, layout, p_pp=p_pp, d_pp=d_pp, p_tp=p_tp, d_tp=d_tp, kv_heads=kv_heads, d_lookahead=1)
    try:
        layers = {plane.index for planes in pd.decode.planes for plane in planes}
        assert layers == {plane.index for planes in pd.prefill.leg.planes for plane in planes}
        for index, n in enumerate((2, 17, 40, 97)):
            did = pd.run(f"pp-{layout}-{p_pp}-{d_pp}-{n}", n, seed=600 + index)
            assert did in pd.checked and did not in pd.decode.failed_loads, f"n={n}"
            assert pd.decode.computed[did] == 1
            assert pd.prefill.live_handoffs() == 0, "every stage's hand-off ended with its last reader"
        counted = pd.decode.scheduler_stats.data
        assert counted.get("recomputed_requests", 0) == 0, counted
        pd.assert_no_leaks()
    finally:
        pd.close()


def test_a_decode_stage_whose_layers_no_prefill_stage_holds_recomputes_naming_the_layer(certs, caplog):
    """Equal PP sizes but another split (as an uneven VLLM_PP_LAYER_PARTITION on one leg would
    make): a decode stage reads only its own stage number, finds a layer that stage does not
    hold, and the load fails naming the layer; vLLM recomputes the prompt, and the hand-offs end
    at once rather than by their leases."""
    import vllm_harness

    pd = Pd(certs, "deep", p_pp=2, d_pp=2, d_lookahead=1)
    try:
        original = vllm_harness.stage_layers
        # The decode leg was built with the standard split; the prefill's boundary is moved by
        # rebuilding it with stage 0 holding two layers of each group.
        vllm_harness.stage_layers = lambda layers, stage, pp: (
            layers if pp == 1 else layers[:2] if stage == 0 else layers[2:]
        )
        try:
            pd.prefill.shutdown()
            pd.prefill = LocalPrefill(
                Leg(certs, "prefill", "p0", ["d0"], "deep", pp=2)
            )
        finally:
            vllm_harness.stage_layers = original
        with caplog.at_level("WARNING", logger="pdkv_vllm.connector"):
            did = pd.run("uneven", 40, seed=77)
        assert did in pd.decode.failed_loads and did not in pd.decode.loaded
        assert pd.decode.computed[did] == 40, "the whole prompt computed here"
        assert any("no prefill worker of the 1 pipeline stages holds it" in record.getMessage() for record in caplog.records), [
            record.getMessage() for record in caplog.records
        ]
        assert pd.prefill.live_handoffs() == 0
        pd.assert_no_leaks()
    finally:
        pd.close()


def assert_offer_refused_naming(pd, name, seed, field, prefill_value, decode_value):
    """A 40-token prompt through ``pd`` whose offer the decoder refuses because the legs differ in
    model field ``field``: nothing is loaded, the whole prompt is computed here, the refusal names
    the field with both values, and nothing leaks."""
    from pdkv_vllm.connector import identity_differences

    n = 40
    prompt = [(seed * 7 + i) % 997 + 1 for i in range(n)]
    params, _ = pd.prefill.prefill(f"p-{name}", prompt, seed, n)
    fields = params["pdkv"]["model_fields"]
    assert fields[field] == prefill_value
    named = identity_differences(fields, pd.decode.scheduler.connector.model_fields)
    assert f"{field}: prefill {json.dumps(prefill_value)}, this leg {json.dumps(decode_value)}" in named, named
    pd.decode.add(f"d-{name}", prompt, 2, params, seed)
    pd.drive(f"d-{name}", unclaimed=f"p-{name}")
    assert f"d-{name}" not in pd.decode.loaded and pd.decode.computed[f"d-{name}"] == n
    assert pd.decode.scheduler_stats.data["refused_offers"] == 1
    pd.assert_no_leaks()
