"""Across processes: a target in another process, a dead peer, fork."""

import ctypes
import hashlib
import multiprocessing as mp
import os
import signal
import time

import pytest

import mcguard
from mcguard import _lib
from conftest import Buf
from pd_common import free_port


def receiver_main(conn, size, listen):
    """A receiving guard in its own process: reports (endpoint, addr), then
    answers hash requests until told to stop."""
    g = mcguard.Guard(listen=listen)
    buf = ctypes.create_string_buffer(size)
    g.register(ctypes.addressof(buf), size)
    conn.send((g.endpoint, ctypes.addressof(buf)))
    while True:
        msg = conn.recv()
        if msg == "stop":
            break
        g.sync([ctypes.addressof(buf)], [size])
        conn.send(hashlib.sha1(ctypes.string_at(ctypes.addressof(buf), size)).hexdigest())
    g.close()


def start_receiver(size, listen="127.0.0.1:0"):
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    p = ctx.Process(target=receiver_main, args=(there, size, listen), daemon=True)
    p.start()
    assert here.poll(30), "receiver did not start"
    ep, addr = here.recv()
    return p, here, ep, addr


def test_transfer_to_another_process_is_hashed_there(guards):
    size = 1 << 20
    p, conn, ep, addr = start_receiver(size)
    try:
        g = guards()
        src = Buf(size, os.urandom(size))
        g.register(src.addr, size)
        n = 64
        g.transfer(ep, [src.addr + i * (size // n) for i in range(n)],
                   [addr + i * (size // n) for i in range(n)], [size // n] * n)
        conn.send("check")
        assert conn.recv() == hashlib.sha1(src.bytes()).hexdigest()
    finally:
        conn.send("stop")
        p.join(10)


def test_receiver_killed_gives_error_within_deadline_then_recovers(guards):
    listen = "127.0.0.1:%d" % free_port()
    size = 64 << 10
    p, conn, ep, addr = start_receiver(size, listen)
    g = guards(timeout_ms=1000, connect_timeout_ms=1000)
    src = Buf(size, os.urandom(size))
    g.register(src.addr, size)
    g.transfer(ep, [src.addr], [addr], [size])
    os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    start = time.monotonic()
    with pytest.raises(mcguard.MCGuardError) as e:
        g.transfer(ep, [src.addr], [addr], [size])
    assert e.value.status in (mcguard.MC_ERR_PEER, mcguard.MC_ERR_TIMEOUT)
    assert time.monotonic() - start < 3
    p2, conn2, ep2, addr2 = start_receiver(size, listen)
    try:
        assert ep2 == ep
        g.transfer(ep, [src.addr], [addr2], [size])
        conn2.send("check")
        assert conn2.recv() == hashlib.sha1(src.bytes()).hexdigest()
    finally:
        conn2.send("stop")
        p2.join(10)


def forked_child_body(g):
    """Runs in a child of os.fork(): every use of the guard must fail fast."""
    code = 0
    try:
        g.stats()
        code = 10
    except mcguard.MCGuardError as e:
        if e.status != mcguard.MC_ERR_FORKED:
            code = 11
    # The C entry points refuse too, without entering the Go runtime.
    L = _lib.lib()
    if L.mc_guard_stats(g._handle, ctypes.create_string_buffer(8), 8, None) != mcguard.MC_ERR_FORKED:
        code = 12
    buf = ctypes.create_string_buffer(256)
    L.mc_guard_last_error(g._handle, buf, 256)
    if b"fork" not in buf.value:
        code = 13
    h = ctypes.c_uint64()
    if L.mc_guard_open(None, ctypes.byref(h)) != mcguard.MC_ERR_FORKED:
        code = 14
    try:
        mcguard.Guard()
        code = 15
    except mcguard.MCGuardError as e:
        if e.status != mcguard.MC_ERR_FORKED:
            code = 16
    return code


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_gets_clear_error_not_hang(guards):
    g = guards()
    g.stats()  # the Go runtime is running
    pid = os.fork()
    if pid == 0:
        os._exit(forked_child_body(g))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, "child exit %d" % os.WEXITSTATUS(status)
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        pytest.fail("the forked child hung")
    assert g.stats()["transfers"] == 0, "the parent's guard still works"
