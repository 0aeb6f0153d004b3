"""pdkv's transfer figures in vLLM's own stats path: ``PdkvStats`` (a ``KVConnectorStats``) is
collected by each worker and by the scheduler, aggregated by vLLM and exported by
``PdkvPromMetrics`` on vLLM's ``/metrics``, beside NIXL's ``vllm:nixl_*``:

- ``vllm:pdkv_load_seconds``, ``vllm:pdkv_load_bytes``, ``vllm:pdkv_load_runs``: one observation
  per decode worker and completed READ of a request's KV (its ``_count`` counts loads);
- ``vllm:pdkv_failed_loads_total``: loads that failed (the prompt is recomputed);
- ``vllm:pdkv_recomputed_requests_total``: decode requests that came with a prefill's KV but
  computed their prompt here instead (a refused offer or a failed load), counted once per request
  by the decode scheduler;
- ``vllm:pdkv_refused_offers_total``: ``kv_transfer_params`` a decoder refused before reading
  (malformed, another model's, another prompt's);
- ``vllm:pdkv_released_unread_total``: hand-offs a decoder gave back without reading (nothing
  needed: a one-token prompt, a prefix hit covering N-1 tokens);
- ``vllm:pdkv_expired_handoffs_total``: prefill hand-offs whose lease lapsed before a decoder
  released them.

The data is plain lists and integers, so it crosses vLLM's process boundaries.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

#: Observations, one per load.
SERIES = ("load_seconds", "load_bytes", "load_runs")

#: Counts of events.
COUNTS = ("failed_loads", "recomputed_requests", "refused_offers", "released_unread", "expired_handoffs")


@dataclasses.dataclass
class PdkvStats(KVConnectorStats):
    """One interval's transfer figures of one or more workers (and the scheduler)."""

    def __post_init__(self):
        if not self.data:
            self.reset()

    def reset(self):
        self.data = {**{name: [] for name in SERIES}, **{name: 0 for name in COUNTS}}

    def record_load(self, seconds: float, num_bytes: int, runs: int) -> None:
        self.data["load_seconds"].append(seconds)
        self.data["load_bytes"].append(num_bytes)
        self.data["load_runs"].append(runs)

    def count(self, name: str, by: int = 1) -> None:
        self.data[name] += by

    def clone_and_reset(self) -> "PdkvStats":
        old = copy.deepcopy(self)
        self.reset()
        return old

    def is_empty(self) -> bool:
        return not self.data["load_seconds"] and not any(self.data[name] for name in COUNTS)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name in SERIES:
            self.data[name].extend(other.data.get(name, []))
        for name in COUNTS:
            self.data[name] += other.data.get(name, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        loads = len(self.data["load_seconds"])
        seconds = sum(self.data["load_seconds"])
        megabytes = sum(self.data["load_bytes"]) / 2**20
        return {
            "Num loads": loads,
            "Avg load time (ms)": round(seconds / loads * 1e3, 3) if loads else 0,
            "Load throughput (MB/s)": round(megabytes / seconds, 3) if seconds else 0,
            "Num failed loads": self.data["failed_loads"],
            "Num recomputed requests": self.data["recomputed_requests"],
            "Num refused offers": self.data["refused_offers"],
            "Num released unread": self.data["released_unread"],
            "Num expired hand-offs": self.data["expired_handoffs"],
        }


class PdkvPromMetrics(KVConnectorPromMetrics):
    """Registers pdkv's metrics with vLLM's Prometheus registry and records each interval."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        from vllm.v1.metrics.utils import create_metric_per_engine

        def per_engine(metric):
            return create_metric_per_engine(metric, self.per_engine_labelvalues)

        histogram, counter = self._histogram_cls, self._counter_cls
        self.series = {
            "load_seconds": per_engine(
                histogram(
                    name="vllm:pdkv_load_seconds",
                    documentation="Seconds a decode worker took to READ one request's KV (pdkv).",
                    buckets=[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0],
                    labelnames=labelnames,
                )
            ),
            "load_bytes": per_engine(
                histogram(
                    name="vllm:pdkv_load_bytes",
                    documentation="Bytes a decode worker READ for one request's KV (pdkv).",
                    buckets=[2 ** (12 + 2 * i) for i in range(10)],
                    labelnames=labelnames,
                )
            ),
            "load_runs": per_engine(
                histogram(
                    name="vllm:pdkv_load_runs",
                    documentation="Contiguous runs one request's READ took, after coalescing (pdkv).",
                    buckets=[1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096],
                    labelnames=labelnames,
                )
            ),
        }
        documentation = {
            "failed_loads": "KV loads that failed; the prompt was recomputed (pdkv).",
            "recomputed_requests": "Decode requests whose prompt was computed here instead of loaded: refused offer or failed load (pdkv).",
            "refused_offers": "kv_transfer_params refused before reading: malformed, another model's or another prompt's (pdkv).",
            "released_unread": "Hand-offs a decoder gave back without reading: it needed none of the KV (pdkv).",
            "expired_handoffs": "Prefill hand-offs whose lease lapsed before a decoder released them (pdkv).",
        }
        self.counts = {
            name: per_engine(counter(name=f"vllm:pdkv_{name}", documentation=text, labelnames=labelnames))
            for name, text in documentation.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for name, metric in self.series.items():
            for value in transfer_stats_data.get(name, []):
                metric[engine_idx].observe(value)
        for name, metric in self.counts.items():
            value = transfer_stats_data.get(name, 0)
            if value:
                metric[engine_idx].inc(value)
