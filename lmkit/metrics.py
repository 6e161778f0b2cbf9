"""Prometheus metrics on an HTTP port (``--metrics-port``; 0 = off), for every service.

Services export their session table (active sessions, sessions opened, rounds)
and compute-queue depth through a collector read at scrape time; the
orchestrator records per-request figures (orchestrator.api.metrics).
"""

from __future__ import annotations

from prometheus_client import REGISTRY, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class ServiceCollector:
    """Reads a servicer's engine at scrape time (no bookkeeping on the hot path)."""

    def __init__(self, service: str, servicer) -> None:
        self._service = service
        self._servicer = servicer

    def collect(self):
        labels = [self._service]
        ready = GaugeMetricFamily("specsplit_ready", "1 once the model is loaded", labels=["service"])
        ready.add_metric(labels, 0.0 if self._servicer.engine is None else 1.0)
        yield ready
        queue = GaugeMetricFamily("specsplit_compute_queue", "model calls waiting for the compute thread",
                                  labels=["service"])
        queue.add_metric(labels, float(self._servicer.compute.queued()))
        yield queue
        if self._servicer.engine is None:
            return
        active, opened, rounds = self._servicer.engine.sessions.stats()
        gauge = GaugeMetricFamily("specsplit_active_sessions", "live sessions", labels=["service"])
        gauge.add_metric(labels, active)
        yield gauge
        for name, value, doc in (("sessions_opened", opened, "sessions opened"), ("rounds", rounds, "rounds served")):
            counter = CounterMetricFamily(f"specsplit_{name}", doc, labels=["service"])
            counter.add_metric(labels, value)
            yield counter
        reserved, budget, unit = self._servicer.engine.sessions.budget()
        for name, value, doc in (
            ("kv_reserved", reserved, "KV the live sessions reserved at their opens (--kv-budget-bytes)"),
            ("kv_budget", budget, "the KV budget the reservations are held against; 0: none"),
        ):
            gauge = GaugeMetricFamily(f"specsplit_{name}", f"{doc}; unit: positions (target) or bytes (draft)",
                                      labels=["service", "unit"])
            gauge.add_metric([*labels, unit], value)
            yield gauge


def serve_metrics(port: int, host: str, service: str, servicer=None) -> None:
    """Start the HTTP exporter (and register the service collector) when ``port`` is set."""
    if servicer is not None:
        REGISTRY.register(ServiceCollector(service, servicer))
    if port:
        start_http_server(port, addr=host)
