"""Prometheus exposition (prometheus-client), one registry per mount: no global state.

FUSE operations are timed by the adapter; cache, remote and upload figures are read from the
layers' own counters at scrape time, so the hot path pays only for a histogram observation.
"""

from __future__ import annotations

import errno as _errno
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120)


class Metrics:
    def __init__(self, fs: Any) -> None:  # marinfs.core.Filesystem
        self.registry = CollectorRegistry()
        self.op_seconds = Histogram("marinfs_fuse_op_seconds", "FUSE operation latency", ["op"],
                                    registry=self.registry, buckets=_BUCKETS)
        self.op_errors = Counter("marinfs_fuse_op_errors", "FUSE operations that failed", ["op", "errno"],
                                 registry=self.registry)
        self.registry.register(_LayerCollector(fs))
        self._op_seconds: dict[str, Any] = {}  # op -> its histogram: labels() costs more than observe()

    def observe(self, op: str, seconds: float, code: int) -> None:
        child = self._op_seconds.get(op)
        if child is None:
            child = self._op_seconds[op] = self.op_seconds.labels(op)
        child.observe(seconds)
        if code and not (op == "getattr" and code == _errno.ENOENT):
            self.op_errors.labels(op, _errno.errorcode.get(code, str(code))).inc()

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        start_http_server(port, addr=addr, registry=self.registry)


class _LayerCollector(Collector):
    def __init__(self, fs: Any) -> None:
        self.fs = fs

    def collect(self) -> Iterator[Metric]:
        stats = self.fs.stats()
        remote = stats["remote_requests"]
        requests = CounterMetricFamily("marinfs_remote_requests", "Remote requests by kind", labels=["kind"])
        for kind, n in sorted(remote["requests"].items()):
            requests.add_metric([kind], n)
        yield requests
        errors = CounterMetricFamily("marinfs_remote_errors", "Remote calls that failed after retries",
                                     labels=["kind"])
        for kind, n in sorted(remote["errors"].items()):
            errors.add_metric([kind], n)
        yield errors
        moved = CounterMetricFamily("marinfs_remote_bytes", "Bytes moved to and from the remote",
                                    labels=["direction"])
        moved.add_metric(["in"], remote["bytes_in"])
        moved.add_metric(["out"], remote["bytes_out"])
        yield moved
        snap = stats["cache"]
        if snap is not None:
            for name in ("hits", "misses", "evictions", "corrupt", "write_failures"):
                yield CounterMetricFamily(f"marinfs_cache_{name}", f"Chunk cache {name.replace('_', ' ')}",
                                          value=snap[name])
            yield CounterMetricFamily("marinfs_cache_fetched_bytes", "Bytes fetched into the cache",
                                      value=snap["bytes_fetched"])
            yield GaugeMetricFamily("marinfs_cache_used_bytes", "Chunk cache size", value=snap["bytes_used"])
            yield GaugeMetricFamily("marinfs_cache_limit_bytes", "Chunk cache limit", value=snap["bytes_limit"])
        # Chunk bytes by source, and the shared tier (the fetcher's own counters).
        fetcher = getattr(self.fs, "fetcher", None)
        if fetcher is not None and hasattr(fetcher, "sources"):
            by_source = CounterMetricFamily("marinfs_chunk_bytes", "Chunk bytes got, by source", labels=["source"])
            for source, n in sorted(fetcher.sources().items()):
                by_source.add_metric([source], n)
            yield by_source
            shared = fetcher.shared.snapshot() if fetcher.shared is not None else None
            if shared is not None:
                for name in ("hits", "misses", "published", "lease_waits", "lease_timeouts", "leases_broken",
                             "corrupt", "evicted", "timeouts", "errors"):
                    yield CounterMetricFamily(f"marinfs_shared_{name}", f"Shared tier {name.replace('_', ' ')}",
                                              value=shared[name])
                yield GaugeMetricFamily("marinfs_shared_degraded", "1 while the shared tier is skipped or read-only",
                                        value=0 if shared["state"] == "ok" else 1)
        passthrough = stats["passthrough"]
        yield CounterMetricFamily("marinfs_passthrough_opens", "Opens the kernel reads from the cache by itself",
                                  value=passthrough["opens"])
        yield GaugeMetricFamily("marinfs_passthrough_files", "Versions open through passthrough (pinned in the cache)",
                                value=passthrough["files"])
        uploads = stats["uploads"]
        yield GaugeMetricFamily("marinfs_uploads_pending", "Open files with uncommitted bytes",
                                value=len(uploads["pending"]))
        yield GaugeMetricFamily("marinfs_uploads_failed", "Failed commits whose bytes are kept",
                                value=len(uploads["failed"]))
