"""Faults across a network: the receiver in a network namespace this test
creates (veth pair, its own addresses), a partition, a slow link, and the
receiver killed mid-batch. Needs root and iproute2; skips with the reason
otherwise. Only addresses inside the namespaces made here are used."""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

import mcguard
from conftest import Buf
from pd_common import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
SECRET = "netns test secret, not for production"
HOST_IP, PEER_IP = "10.213.77.1", "10.213.77.2"


def sh(*cmd, check=True):
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, check=check)


@pytest.fixture
def netns():
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("needs root and iproute2 to create a network namespace")
    tag = "%d" % (os.getpid() % 100000)
    ns, host_if, peer_if = "mcg-" + tag, "mcgA" + tag, "mcgB" + tag
    try:
        sh("ip", "netns", "add", ns)
    except subprocess.CalledProcessError as e:
        pytest.skip("cannot create a network namespace here: %s" % e.stderr.strip())
    try:
        sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", peer_if)
        sh("ip", "link", "set", peer_if, "netns", ns)
        sh("ip", "addr", "add", HOST_IP + "/24", "dev", host_if)
        sh("ip", "link", "set", host_if, "up")
        sh("ip", "netns", "exec", ns, "ip", "addr", "add", PEER_IP + "/24", "dev", peer_if)
        sh("ip", "netns", "exec", ns, "ip", "link", "set", peer_if, "up")
        sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
    except subprocess.CalledProcessError as e:
        sh("ip", "netns", "del", ns, check=False)
        sh("ip", "link", "del", host_if, check=False)
        pytest.skip("cannot set up a veth pair here: %s" % e.stderr.strip())
    yield {"ns": ns, "host_if": host_if}
    sh("ip", "link", "del", host_if, check=False)
    sh("ip", "netns", "del", ns, check=False)


class Peer:
    """peer.py running inside the namespace."""

    def __init__(self, ns, port, size):
        cfg = {"listen": "%s:%d" % (PEER_IP, port), "secret": SECRET, "timeout_ms": 1000}
        env = dict(os.environ, PYTHONPATH=os.path.join(HERE, ".."))
        self.proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, os.path.join(HERE, "peer.py"),
                                      json.dumps(cfg), str(size)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline()
        assert line, "the peer did not start"
        info = json.loads(line)
        self.endpoint, self.addr = info["endpoint"], info["addr"]

    def hash(self):
        self.proc.stdin.write("hash\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            self.proc.wait(10)


def sender(guards, size, **cfg):
    # The bytes must cross the links these tests cut and shape: another
    # network namespace is still this host, where same-host copies bypass it.
    cfg.setdefault("same_host", "off")
    g = guards(listen=HOST_IP + ":0", secret=SECRET, timeout_ms=1000, connect_timeout_ms=1000, **cfg)
    src = Buf(size, os.urandom(size))
    g.register(src.addr, size)
    return g, src


def batch(src, peer, size, n=64):
    step = size // n
    return ([src.addr + i * step for i in range(n)], [peer.addr + i * step for i in range(n)], [step] * n)


def test_authenticated_transfer_across_namespaces(netns, guards):
    size = 1 << 20
    peer = Peer(netns["ns"], free_port(), size)
    try:
        g, src = sender(guards, size)
        g.transfer(peer.endpoint, *batch(src, peer, size), verify="sample")
        assert peer.hash() == hashlib.sha1(src.bytes()).hexdigest()
        other = guards(listen=HOST_IP + ":0", allow_insecure=True)
        buf = Buf(4096)
        other.register(buf.addr, 4096)
        with pytest.raises(mcguard.MCGuardError) as e:
            other.transfer(peer.endpoint, [buf.addr], [peer.addr], [4096])
        assert e.value.status == mcguard.MC_ERR_SESSION and "requires authentication" in e.value.message
    finally:
        peer.close()


def test_partition_errors_within_deadline_then_recovers(netns, guards):
    size = 1 << 20
    peer = Peer(netns["ns"], free_port(), size)
    try:
        g, src = sender(guards, size)
        g.transfer(peer.endpoint, *batch(src, peer, size))
        sh("ip", "link", "set", netns["host_if"], "down")
        start = time.monotonic()
        with pytest.raises(mcguard.MCGuardError) as e:
            g.transfer(peer.endpoint, *batch(src, peer, size))
        assert e.value.status in (mcguard.MC_ERR_TIMEOUT, mcguard.MC_ERR_PEER)
        assert time.monotonic() - start < 4, "an error within the deadline, not a hang"
        sh("ip", "link", "set", netns["host_if"], "up")
        time.sleep(0.5)
        src.write(0, os.urandom(size))
        g.transfer(peer.endpoint, *batch(src, peer, size))
        assert peer.hash() == hashlib.sha1(src.bytes()).hexdigest(), "after the partition heals, successes verify"
    finally:
        sh("ip", "link", "set", netns["host_if"], "up", check=False)
        peer.close()


def shape(netns, *qdisc):
    r = sh("tc", "qdisc", "add", "dev", netns["host_if"], "root", *qdisc, check=False)
    return r.returncode == 0, r.stderr.strip()


def slow_link(netns):
    """Shapes the link to 40 Mbit/s (tbf), or skips the test."""
    if not shutil.which("tc"):
        pytest.skip("needs tc")
    ok, why = shape(netns, "tbf", "rate", "40mbit", "burst", "64kb", "latency", "100ms")
    if not ok:
        pytest.skip("cannot shape the link here: %s" % why)


def test_slow_link_succeeds_verified_or_errors_in_time(netns, guards):
    slow_link(netns)
    size = 4 << 20
    peer = Peer(netns["ns"], free_port(), size)
    try:
        g, src = sender(guards, size, verify="full")
        start = time.monotonic()
        try:
            g.transfer(peer.endpoint, *batch(src, peer, size))
        except mcguard.MCGuardError as e:
            assert e.status in (mcguard.MC_ERR_TIMEOUT, mcguard.MC_ERR_PEER)
        else:
            assert peer.hash() == hashlib.sha1(src.bytes()).hexdigest()
        assert time.monotonic() - start < 30
    finally:
        peer.close()


def test_chunk_posted_ahead_on_a_slow_link_gets_the_full_timeout_per_write(netns, guards):
    """16 MiB over 40 Mbit/s in two chunks of 8 MiB (max_batch 16): the
    second chunk, posted while the first is checked, takes longer to send
    than timeout_ms (1 s); each of its writes gets the full timeout, as a
    chunk written on its own does, so the transfer succeeds."""
    slow_link(netns)
    size = 16 << 20
    peer = Peer(netns["ns"], free_port(), size)
    try:
        g, src = sender(guards, size, verify="tail", max_batch=16)
        start = time.monotonic()
        g.transfer(peer.endpoint, *batch(src, peer, size, n=32))
        took = time.monotonic() - start
        assert took > 2, "each chunk took longer than timeout_ms to send (%.1f s in all)" % took
        assert g.stats()["pipelined_chunks"] == 1
        assert peer.hash() == hashlib.sha1(src.bytes()).hexdigest()
    finally:
        peer.close()


def test_lossy_delayed_link(netns, guards):
    if not shutil.which("tc"):
        pytest.skip("needs tc")
    ok, why = shape(netns, "netem", "delay", "20ms", "5ms", "loss", "2%")
    if not ok:
        pytest.skip("tc netem is not available in this kernel (%s); the tbf slow-link test covers rate limits" % why)
    size = 1 << 20
    peer = Peer(netns["ns"], free_port(), size)
    try:
        g, src = sender(guards, size, verify="tail")
        for _ in range(3):
            try:
                g.transfer(peer.endpoint, *batch(src, peer, size))
            except mcguard.MCGuardError as e:
                assert e.status in (mcguard.MC_ERR_TIMEOUT, mcguard.MC_ERR_PEER)
                continue
            assert peer.hash() == hashlib.sha1(src.bytes()).hexdigest()
    finally:
        peer.close()


def test_receiver_killed_mid_batch(netns, guards):
    ok, why = shape(netns, "tbf", "rate", "80mbit", "burst", "64kb", "latency", "100ms")
    if not ok:
        pytest.skip("cannot shape the link, so a batch cannot be caught mid-flight: %s" % why)
    size = 32 << 20  # about 3 s at 80 Mbit/s
    port = free_port()
    peer = Peer(netns["ns"], port, size)
    g, src = sender(guards, size)
    result = {}

    def push():
        start = time.monotonic()
        try:
            g.transfer(peer.endpoint, *batch(src, peer, size, n=512))
            result["ok"] = True
        except mcguard.MCGuardError as e:
            result["error"] = e
        result["seconds"] = time.monotonic() - start

    t = threading.Thread(target=push)
    t.start()
    time.sleep(1.0)
    peer.kill()
    t.join(30)
    assert not t.is_alive(), "the transfer hung"
    assert "error" in result, "a batch cut off by a killed receiver must not succeed"
    assert result["seconds"] > 0.9, "the receiver died mid-batch"
    assert result["seconds"] < 1.0 + 3, "the error came within the deadline (timeout_ms 1000)"
    assert result["error"].status in (mcguard.MC_ERR_TIMEOUT, mcguard.MC_ERR_PEER)
    sh("tc", "qdisc", "del", "dev", netns["host_if"], "root", check=False)
    peer = Peer(netns["ns"], port, size)
    try:
        g.transfer(peer.endpoint, *batch(src, peer, size, n=512))
        assert peer.hash() == hashlib.sha1(src.bytes()).hexdigest(), "the restarted receiver gets verified bytes"
    finally:
        peer.close()
