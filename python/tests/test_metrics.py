"""Prometheus metrics: mc_guard_metrics's text parses with prometheus_client's
own parser, the Collector serves it to a registry, and the stress tool
serves /metrics during a run."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mcguard.metrics import Collector
from mcguard.mooncake import GuardedTransferEngine
from conftest import Buf


def samples(text):
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_metrics_parse_and_count(pair):
    s, r, src, dst = pair()
    for _ in range(3):
        s.transfer(r.endpoint, [src.addr], [dst.addr], [4096])
    got = samples(s.metrics())
    assert got[("mcguard_transfers_total", (("mode", "tail"), ("outcome", "ok")))] == 3
    assert got[("mcguard_transferred_bytes_total", (("mode", "tail"),))] == 3 * 4096
    assert got[("mcguard_transfer_seconds_count", (("mode", "tail"),))] == 3
    assert samples(r.metrics())[("mcguard_connections", ())] == 1


def test_collector_serves_a_registry():
    engine = GuardedTransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    try:
        registry = CollectorRegistry()
        registry.register(Collector(engine))
        text = generate_latest(registry).decode()
        assert "mcguard_sessions 0.0" in text and "# TYPE mcguard_transfers_total counter" in text
    finally:
        engine.close()


def test_stress_serves_metrics_during_a_run():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    p = subprocess.Popen([sys.executable, "-m", "mcguard.stress", "--json", "--quiet", "--seconds", "3",
                          "--metrics-port", str(port)], cwd=here, stdout=subprocess.PIPE, text=True)
    scraped = None
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and scraped is None:
        try:
            with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=2) as resp:
                text = resp.read().decode()
            if 'outcome="ok"' in text:  # a transfer went through: its samples are there
                scraped = text
        except OSError:
            time.sleep(0.2)
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 0
    assert scraped is not None, "no /metrics during the run"
    ok = sum(s.value for f in text_string_to_metric_families(scraped) for s in f.samples
             if s.name == "mcguard_transfers_total" and s.labels.get("outcome") == "ok")
    assert ok > 0
    assert json.loads(out.strip().splitlines()[-1])["ok"] > 0
