"""Prometheus metrics of `flowrl serve` (GET /metrics; docs/serving.md lists them).

The engine's own counters (forwards, rows, the rows-per-forward histogram, samples finished and
failed, images per second, policy version) are read from `engine.stats()` at scrape time, so the
engine needs no Prometheus code; the server adds its queue (flowrl.server.admission) and per-
endpoint request counts and latencies (`RequestMetrics`, an ASGI middleware). Each app has its own
registry, so several servers in one process (tests) do not share counters.
"""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300, 600)
CLIENT_CLOSED = 499  # the status recorded for a request whose client went away (nginx's convention)


def _row_buckets(max_batch_rows: int) -> list[int]:
    """Powers of two below max_batch_rows, then max_batch_rows itself."""
    buckets, size = [], 1
    while size < max_batch_rows:
        buckets.append(size)
        size *= 2
    return buckets + [max_batch_rows]


class _EngineCollector:
    """Engine and queue gauges, read when Prometheus scrapes."""

    def __init__(self, engine, admission):
        self.engine, self.admission = engine, admission

    def collect(self):
        stats = self.engine.stats()
        admission = self.admission
        running = len(self.engine.scheduler.running)
        queued = admission.num_waiting + max(0, admission.num_in_flight - running)
        yield GaugeMetricFamily(
            "flowrl_queue_depth", "Samples accepted and not yet running in the engine.", value=queued
        )
        yield GaugeMetricFamily(
            "flowrl_samples_in_flight", "Samples accepted and not finished.", value=admission.num_in_flight
        )
        histogram = stats["rows_per_forward_hist"]
        cumulative = [
            (str(le), sum(n for rows, n in histogram.items() if rows <= le))
            for le in _row_buckets(stats["max_batch_rows"])
        ]
        yield HistogramMetricFamily(
            "flowrl_rows_per_forward",
            "Transformer rows per forward (a CFG sample counts two).",
            buckets=cumulative + [("+Inf", stats["num_forwards"])],
            sum_value=stats["num_rows"],
        )
        for name, key, doc in (
            ("flowrl_forwards", "num_forwards", "Transformer forwards run."),
            ("flowrl_rows", "num_rows", "Transformer rows computed."),
            ("flowrl_samples_finished", "num_samples_finished", "Samples returned."),
            ("flowrl_samples_failed", "num_samples_failed", "Samples failed."),
        ):
            yield CounterMetricFamily(name, doc, value=stats[key])
        yield GaugeMetricFamily(
            "flowrl_images_per_second",
            "Images finished per second of engine busy time.",
            value=stats["images_per_second"],
        )
        yield GaugeMetricFamily(
            "flowrl_policy_version", "Policy version of the served weights.", value=stats["policy_version"]
        )
        yield GaugeMetricFamily(
            "flowrl_admission_paused", "1 while admission is paused.", value=float(admission.is_paused)
        )


class ServerMetrics:
    def __init__(self, engine, admission, endpoints: set[str]):
        self.registry = CollectorRegistry()
        self.endpoints = endpoints
        self.requests = Counter(
            "flowrl_requests", "Requests by endpoint and status code.", ["endpoint", "status"], registry=self.registry
        )
        self.latency = Histogram(
            "flowrl_request_latency_seconds",
            "Seconds from request to answer, by endpoint.",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(engine, admission))

    def observe(self, path: str, status: int, seconds: float) -> None:
        endpoint = path if path in self.endpoints else "other"  # bounded label values
        self.requests.labels(endpoint, str(status)).inc()
        self.latency.labels(endpoint).observe(seconds)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestMetrics:
    """ASGI middleware recording each HTTP request's endpoint, status and latency (a plain ASGI
    wrapper: it leaves `receive` alone, so handlers still see their client disconnect)."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = [CLIENT_CLOSED]

        async def send_and_record(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            self.metrics.observe(scope["path"], status[0], time.perf_counter() - start)
