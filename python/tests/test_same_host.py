"""Same-host transfers between two processes, hashed on the receiving side:
the sender writes into the receiver itself (process_vm_writev under the
receiver's lease), or with same_host_writer "receiver" the receiver copies
the bytes out of the sender (process_vm_readv); lag (injected at the
receiver, which then copies) is shown by off and caught by tail; a receiver
that cannot read the sender gives the logged fallback or, where required, a
clear error."""

import ctypes
import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest

from linepeer import LinePeer
from mcguard import Guard, MCGuardError

HERE = os.path.dirname(os.path.abspath(__file__))
PEER = os.path.join(HERE, "peer.py")
SIZE = 1 << 20


class Receiver(LinePeer):
    """peer.py: a receiving guard in another process (argv_prefix: how to run Python)."""

    def __init__(self, cfg, argv_prefix=(sys.executable,), alloc=False):
        super().__init__([*argv_prefix, PEER, json.dumps(cfg), str(SIZE)] + (["alloc"] if alloc else []))
        self.endpoint, self.addr = self.hello["endpoint"], self.hello["addr"]

    def hash(self):
        return self.ask("hash")


def send_and_hash(sender_cfg, recv):
    src = ctypes.create_string_buffer(os.urandom(SIZE), SIZE)
    with Guard(sender_cfg) as g:
        g.register(ctypes.addressof(src), SIZE)
        n, block = 64, SIZE // 64
        g.transfer(recv.endpoint, [ctypes.addressof(src) + i * block for i in range(n)],
                   [recv.addr + i * block for i in range(n)], [block] * n)
        return recv.hash() == hashlib.sha1(src.raw).hexdigest(), g.stats()


@pytest.mark.parametrize("writer", ["sender", "receiver"])
@pytest.mark.parametrize("mode", ["off", "tail", "sample", "full"])
def test_two_processes_same_host_in_every_read_back_mode(mode, writer):
    recv = Receiver({"same_host": "required", "same_host_writer": writer})
    try:
        landed, stats = send_and_hash({"verify": mode, "same_host": "required"}, recv)
        assert landed
        assert stats["same_host_pushed_bytes"] == (SIZE if writer == "sender" else 0)
    finally:
        assert recv.close() == 0


@pytest.mark.parametrize("alloc", [False, True])
def test_two_processes_digest_notices_through_the_ring(alloc):
    """Digest mode on one host: the sender writes the bytes and leaves each
    notice in its connection's ring, more of them than a ring holds; the
    receiver's sync_transfers takes them (the rest came on the socket) and
    compares every landed block, and fails a block written again since."""
    recv = Receiver({"same_host": "required"}, alloc=alloc)
    try:
        src = ctypes.create_string_buffer(os.urandom(SIZE), SIZE)
        block, ids = 4096, []
        with Guard({"verify": "digest", "same_host": "required"}) as g:
            g.register(ctypes.addressof(src), SIZE)
            for i in range(SIZE // block):
                r = g.transfer(recv.endpoint, [ctypes.addressof(src) + i * block], [recv.addr + i * block], [block])
                ids.append(r.id)
            ringed = g.stats()["same_host_ringed_notices"]
            assert 0 < ringed < len(ids)
            assert recv.ask("synced " + " ".join(map(str, ids))) == "ok"
            assert recv.hash() == hashlib.sha1(src.raw).hexdigest()
            first = g.transfer(recv.endpoint, [ctypes.addressof(src)], [recv.addr], [block])
            ctypes.memset(src, src.raw[0] ^ 0xFF, 1)  # the block written again with another byte, before the sync
            second = g.transfer(recv.endpoint, [ctypes.addressof(src)], [recv.addr], [block])
            assert recv.ask("synced %d" % second.id) == "ok"
            answer = recv.ask("synced %d" % first.id)
            assert answer.startswith("error"), answer
    finally:
        assert recv.close() == 0


@pytest.mark.parametrize("mode", ["off", "tail", "sample", "full"])
def test_two_processes_same_host_into_allocated_memory_by_memcpy(mode):
    recv = Receiver({"same_host": "required"}, alloc=True)
    try:
        landed, stats = send_and_hash({"verify": mode, "same_host": "required"}, recv)
        assert landed
        assert stats["same_host_pushed_bytes"] == stats["same_host_mapped_bytes"] == SIZE
    finally:
        assert recv.close() == 0


def test_stress_over_same_host_shows_lag_with_off_and_none_with_tail():
    def stress(verify):
        out = subprocess.run([sys.executable, "-m", "mcguard.stress", "--transport", "same-host", "--inject", "lag",
                              "--verify", verify, "--seconds", "2", "--json", "--quiet"],
                             capture_output=True, text=True, timeout=120,
                             env=dict(os.environ, PYTHONPATH=os.path.join(HERE, "..")))
        assert out.returncode in (0, 1), out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])
    off, tail = stress("off"), stress("tail")
    assert off["transport"] == "same-host" and off["ok"] > 0 and off["mismatches"] > 0
    assert tail["ok"] > 0 and tail["mismatches"] == 0


def test_stress_into_allocated_memory_shows_tears_with_off_and_none_with_tail():
    """Two processes, the decode side's KV region from Guard.alloc: the
    prefill side writes it with memcpy, injecting the receiver's tears
    itself; off shows them, tail catches every one."""
    def stress(verify):
        out = subprocess.run([sys.executable, "-m", "mcguard.stress", "--transport", "same-host",
                              "--receive-memory", "allocated", "--inject", "tear", "--inject-rate", "0.02", "--verify", verify,
                              "--seconds", "2", "--json", "--quiet"],
                             capture_output=True, text=True, timeout=120,
                             env=dict(os.environ, PYTHONPATH=os.path.join(HERE, "..")))
        assert out.returncode in (0, 1), out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])
    off, tail = stress("off"), stress("tail")
    for r in (off, tail):
        assert r["receive_memory"] == "allocated" and r["ok"] > 0
        assert r["same_host_mapped_bytes"] > 0 and r["same_host_mapped_bytes"] == r["same_host_pushed_bytes"]
    assert off["mismatches"] > 0
    assert tail["mismatches"] == 0


def as_another_user():
    """argv that runs a Python as uid 65534 (it cannot read our memory), or skip."""
    setpriv, python = shutil.which("setpriv"), "/usr/bin/python3"
    if os.geteuid() != 0 or not setpriv or not os.path.exists(python):
        pytest.skip("needs root, setpriv and /usr/bin/python3 to run a receiver as another user")
    probe = subprocess.run([setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", python, "-c",
                            "import sys; sys.path.insert(0, %r); import mcguard" % os.path.join(HERE, "..")],
                           capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip("a Python run as uid 65534 cannot import mcguard here: %s" % probe.stderr[-300:])
    return (setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", python)


def test_a_receiver_that_cannot_read_the_sender_falls_back_or_fails_clearly():
    recv = Receiver({}, as_another_user())
    try:
        landed, stats = send_and_hash({"verify": "tail"}, recv)
        assert landed, "auto: the bytes went through the socket instead"
        with pytest.raises(MCGuardError) as e:
            send_and_hash({"verify": "tail", "same_host": "required"}, recv)
        assert e.value.name == "MC_ERR_CONFIG"
        assert "same_host is required" in e.value.message and "operation not permitted" in e.value.message
    finally:
        assert recv.close() == 0


@pytest.mark.parametrize("alloc", [False, True], ids=["registered", "allocated"])
def test_a_sender_writing_itself_fails_clearly_once_the_receiver_is_gone(alloc):
    """The sender writes into the receiver's memory itself: once the receiver
    process is killed, the next transfer must fail, never report success
    (nor write into whatever process gets the pid next). Allocated memory
    outlives the receiver in the sender's mapping: a copy into it must
    not count either."""
    recv = Receiver({}, alloc=alloc)
    src = ctypes.create_string_buffer(os.urandom(SIZE), SIZE)
    with Guard({"verify": "tail", "timeout_ms": 2000}) as g:
        g.register(ctypes.addressof(src), SIZE)
        args = ([ctypes.addressof(src)], [recv.addr], [SIZE])
        g.transfer(recv.endpoint, *args)
        assert recv.hash() == hashlib.sha1(src.raw).hexdigest()
        assert g.stats()["same_host_pushed_bytes"] == SIZE
        assert g.stats()["same_host_mapped_bytes"] == (SIZE if alloc else 0)
        recv.proc.kill()
        recv.proc.wait(30)
        with pytest.raises(MCGuardError) as e:
            g.transfer(recv.endpoint, *args)
        assert e.value.name in ("MC_ERR_PEER", "MC_ERR_TIMEOUT"), e.value
        assert g.stats()["same_host_pushed_bytes"] == SIZE, "nothing more was written"
