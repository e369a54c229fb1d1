"""Prometheus metrics of mcguard guards for a host's /metrics.

    from prometheus_client import REGISTRY
    from mcguard.metrics import Collector
    REGISTRY.register(Collector(guard))          # a Guard, or a GuardedTransferEngine

prometheus_client is an optional dependency: only this module needs it.
The guard writes its metrics in the text exposition format
(mc_guard_metrics); the Collector parses them with prometheus_client's own
parser on every scrape.
"""

from prometheus_client.parser import text_string_to_metric_families


class Collector:
    def __init__(self, guard_or_engine):
        self._source = guard_or_engine

    def _guard(self):
        g = self._source
        return getattr(g, "_guard", g)  # a GuardedTransferEngine holds its Guard

    def collect(self):
        g = self._guard()
        if g is None:
            return
        yield from text_string_to_metric_families(g.metrics())

    def describe(self):
        return []  # families depend on what has happened: collect on scrape
