"""A guard over an engine written in Python (mcguard.engine.Engine): the
callbacks, their failures and exceptions, and the verification on top.
The real Mooncake engine is in test_mooncake_engine.py."""

import ctypes
import hashlib
import os
import threading
import time

import pytest

from mcguard import Guard, MCGuardError
from mcguard.engine import Engine


class LoopEngine(Engine):
    """An in-process engine over this process's memory: "peers" are named
    segments. With lag_s, a write is acknowledged at once and lands later."""

    name = "loop"

    def __init__(self, lag_s=0.0):
        self.lag_s = lag_s
        self.local, self.segments = {}, {}
        self.calls = {"write": 0, "read": 0, "register": 0, "unregister": 0}
        self.timers = []

    def _inside(self, regions, addr, n):
        return any(a <= addr and addr + n <= a + size for a, size in regions.items())

    def _check(self, session, local, remote, lengths):
        if session not in self.segments:
            raise KeyError("no segment named %s" % session)
        for i, (l, r, n) in enumerate(zip(local, remote, lengths)):
            if not self._inside(self.local, l, n) or not self._inside(self.segments[session], r, n):
                return -4  # MC_ERR_NOT_REGISTERED
        return 0

    def write(self, session, local, remote, lengths):
        self.calls["write"] += 1
        ret = self._check(session, local, remote, lengths)
        if ret:
            return ret
        for l, r, n in zip(local, remote, lengths):
            if self.lag_s:
                data = ctypes.string_at(l, n)
                t = threading.Timer(self.lag_s, ctypes.memmove, args=(r, data, n))
                self.timers.append(t)
                t.start()
            else:
                ctypes.memmove(r, l, n)

    def read(self, session, local, remote, lengths):
        self.calls["read"] += 1
        ret = self._check(session, local, remote, lengths)
        if ret:
            return ret
        for l, r, n in zip(local, remote, lengths):
            ctypes.memmove(l, r, n)

    def register(self, addr, length):
        self.calls["register"] += 1
        self.local[addr] = length

    def unregister(self, addr):
        self.calls["unregister"] += 1
        self.local.pop(addr, None)


BLOCK, N = 4096, 16


@pytest.fixture
def pd():
    """A guard over a LoopEngine and a peer segment "decode:7"."""
    engines = []

    def make(lag_s=0.0, **settings):
        eng = LoopEngine(lag_s)
        src, dst = ctypes.create_string_buffer(BLOCK * N), ctypes.create_string_buffer(BLOCK * N)
        eng.segments["decode:7"] = {ctypes.addressof(dst): BLOCK * N}
        g = Guard(engine=eng, **settings)
        g.register(ctypes.addressof(src), BLOCK * N)
        engines.append((g, eng, src, dst))  # the buffers outlive late writes
        srcs = [ctypes.addressof(src) + i * BLOCK for i in range(N)]
        dsts = [ctypes.addressof(dst) + i * BLOCK for i in range(N)]
        return g, eng, src, dst, srcs, dsts
    yield make
    for g, eng, _src, _dst in engines:
        g.close()
        for t in eng.timers:
            t.join()


def test_tail_over_a_lagging_engine_returns_once_the_bytes_landed(pd):
    g, eng, src, dst, srcs, dsts = pd(lag_s=0.01, verify="tail")
    for _ in range(3):
        src.raw = os.urandom(BLOCK * N)
        res = g.transfer("decode:7", srcs, dsts, [BLOCK] * N)
        assert hashlib.sha1(dst.raw).digest() == hashlib.sha1(src.raw).digest()
        assert res.retries > 0, "it polled while the engine delivered"
    assert eng.calls["register"] >= 2, "the source and the session's read-back scratch"
    assert g.stats()["transport"] == "engine"


def test_off_over_a_lagging_engine_returns_before_the_bytes_land(pd):
    g, eng, src, dst, srcs, dsts = pd(lag_s=0.05, verify="off")
    src.raw = os.urandom(BLOCK * N)
    g.transfer("decode:7", srcs, dsts, [BLOCK] * N)
    assert dst.raw != src.raw


def test_engine_failures_come_back_as_statuses_with_the_reason(pd):
    g, eng, src, dst, srcs, dsts = pd(verify="tail")
    with pytest.raises(MCGuardError) as e:
        g.transfer("nobody:1", srcs, dsts, [BLOCK] * N)
    assert e.value.name == "MC_ERR_PEER"
    assert "loop.write raised KeyError" in e.value.message and "no segment named nobody:1" in e.value.message
    assert e.value.abort == "unconfirmed"
    with pytest.raises(MCGuardError) as e:
        g.transfer("decode:7", srcs[:1], [dsts[0] + BLOCK * N], [BLOCK])
    assert e.value.name == "MC_ERR_NOT_REGISTERED", "the engine's own status"
    assert "loop.write returned -4" in e.value.message

    def boom(*_):
        raise ZeroDivisionError("even this")
    eng.write = boom
    with pytest.raises(MCGuardError) as e:
        g.transfer("decode:7", srcs, dsts, [BLOCK] * N)
    assert e.value.name == "MC_ERR_PEER" and "raised ZeroDivisionError: even this" in e.value.message
    eng.write = lambda *_: True
    with pytest.raises(MCGuardError) as e:
        g.transfer("decode:7", srcs, dsts, [BLOCK] * N)
    assert "returned True" in e.value.message, "only 0 or None is success"


def test_wait_engine_calls_waits_for_a_failed_transfers_own_calls(pd):
    g, eng, src, dst, srcs, dsts = pd(verify="tail")
    released, entered = threading.Event(), threading.Event()
    write = eng.write

    def stuck(*args):
        entered.set()
        released.wait(10)
        return write(*args)
    eng.write = stuck
    src.raw = os.urandom(BLOCK * N)
    with pytest.raises(MCGuardError) as e:
        g.transfer("decode:7", srcs, dsts, [BLOCK] * N, deadline_ms=100)
    assert e.value.name == "MC_ERR_TIMEOUT" and entered.is_set()
    tid = e.value.transfer_id
    assert tid, "a failed transfer's id comes with its error"
    with pytest.raises(MCGuardError) as w:
        g.wait_engine_calls(tid, 0)
    assert w.value.name == "MC_ERR_TIMEOUT" and "1 engine call(s)" in w.value.message
    assert g.stats()["engine_calls_in_flight"] == 1
    released.set()
    g.wait_engine_calls(tid, 5000)  # the write returned: its bytes are in, nothing more comes
    assert dst.raw == src.raw
    eng.write = write
    res = g.transfer("decode:7", srcs, dsts, [BLOCK] * N)
    g.wait_engine_calls(res.id)  # a transfer that succeeded left nothing running

    for bad in (-1, 1.5, "1", True, 1 << 64):
        with pytest.raises(MCGuardError) as w:
            g.wait_engine_calls(bad)
        assert w.value.name == "MC_ERR_INVALID_ARG"
    with pytest.raises(MCGuardError) as w:
        g.wait_engine_calls(0)
    assert w.value.name == "MC_ERR_INVALID_ARG" and "not given by this guard" in w.value.message
    with pytest.raises(MCGuardError) as w:
        g.wait_engine_calls(tid, 25 * 3600 * 1000)
    assert w.value.name == "MC_ERR_INVALID_ARG" and "over a day" in w.value.message
    with pytest.raises(MCGuardError) as e:
        g.transfer("decode:7", srcs[:1], dsts[:1], [0])
    assert e.value.name == "MC_ERR_INVALID_ARG" and e.value.transfer_id is None, "refused before it began"


def test_wait_engine_calls_is_for_guards_over_an_engine():
    g = Guard()
    try:
        with pytest.raises(MCGuardError) as w:
            g.wait_engine_calls(1)
        assert w.value.name == "MC_ERR_INVALID_ARG" and "quiesce" in w.value.message
    finally:
        g.close()


def test_a_closed_guard_lets_its_engine_go(pd):
    g, eng, src, dst, srcs, dsts = pd(verify="tail")
    cb = g._callbacks
    g.close()
    assert cb.engine is None


def test_bad_engines_and_settings_are_refused():
    with pytest.raises(MCGuardError) as e:
        Guard(engine=object())
    assert e.value.name == "MC_ERR_INVALID_ARG"
    with pytest.raises(MCGuardError) as e:
        Guard({"transport": "tcp"}, engine=LoopEngine())
    assert e.value.name == "MC_ERR_CONFIG"


def test_slice_bytes_over_mooncake_follows_mc_slice_size(monkeypatch):
    class Named(LoopEngine):
        name = "mooncake"
    monkeypatch.setenv("MC_SLICE_SIZE", "131072")
    with Guard(engine=Named()) as g:
        assert g.stats()["slice_bytes"] == 131072


def test_an_engine_that_ends_its_calls_itself_is_called_inline(monkeypatch):
    """Mooncake's sync calls give up on their own (MC_TRANSFER_TIMEOUT):
    no thread hand-off per call unless the settings or the environment
    ask for one; an engine that may hang keeps the hand-off."""
    class Bounded(LoopEngine):
        calls_end_on_their_own = True
    monkeypatch.delenv("MC_GUARD_ENGINE_INLINE_CALLS", raising=False)
    from mcguard.engine import MooncakeEngine
    assert MooncakeEngine.calls_end_on_their_own
    for engine, settings, inline in ((Bounded(), {}, True), (LoopEngine(), {}, False),
                                     (Bounded(), {"engine_inline_calls": False}, False)):
        with Guard(engine=engine, **settings) as g:
            assert g.stats()["engine_inline_calls"] is inline, (type(engine).__name__, settings)
    monkeypatch.setenv("MC_GUARD_ENGINE_INLINE_CALLS", "false")
    with Guard(engine=Bounded()) as g:
        assert g.stats()["engine_inline_calls"] is False, "the environment's choice stands"


def test_an_inline_call_runs_on_the_callers_thread(pd):
    g, eng, src, dst, srcs, dsts = pd(verify="tail", engine_inline_calls=True)
    threads = set()
    write = eng.write

    def noting(*args):
        threads.add(threading.get_ident())
        return write(*args)
    eng.write = noting
    src.raw = os.urandom(BLOCK * N)
    g.transfer("decode:7", srcs, dsts, [BLOCK] * N)
    assert threads == {threading.get_ident()}
    assert hashlib.sha1(dst.raw).digest() == hashlib.sha1(src.raw).digest()


def test_keyboard_interrupt_inside_a_callback_comes_out_of_the_call(pd):
    """A signal handler runs in whatever Python code the main thread is in,
    a callback included: the interrupt must not be swallowed into a status."""
    g, eng, src, dst, srcs, dsts = pd(verify="tail")

    def interrupted(*_):
        raise KeyboardInterrupt
    eng.write = interrupted
    with pytest.raises(KeyboardInterrupt):
        g.transfer("decode:7", srcs, dsts, [BLOCK] * N)
    del eng.write
    g.transfer("decode:7", srcs, dsts, [BLOCK] * N)  # and the guard goes on
    assert dst.raw == src.raw


def interrupted_transfer(pd, monkeypatch, path, batch):
    """An off-mode transfer over callbacks made by batch(self, method, real)
    in place of Callbacks._batch (real: the original), calling the library
    through _fastcall ("fast", which a guard over a Python engine takes for
    plain lists) or through ctypes. Returns the SystemExit it raised, the
    guard and the two buffers."""
    from mcguard import callbacks as callbacks_module, guard as guard_module
    real = callbacks_module.Callbacks._batch
    monkeypatch.setattr(callbacks_module.Callbacks, "_batch", lambda self, method: batch(self, method, real))
    g, eng, src, dst, srcs, dsts = pd(verify="off")
    if path == "fast":
        if guard_module._fast_transfer is None:
            pytest.skip("_fastcall is not built here")
        assert g._fast_entry, "a guard over a Python engine takes the fast path"
    else:
        g._fast_entry = 0
    src.raw = os.urandom(BLOCK * N)
    with pytest.raises(SystemExit) as e:
        g.transfer("decode:7", srcs, dsts, [BLOCK] * N)
    return e.value, g, src, dst


@pytest.mark.parametrize("path", ["fast", "ctypes"])
def test_an_interrupt_as_a_callback_is_entered_comes_out_of_the_call(pd, monkeypatch, path):
    """A signal handler can raise at the callback's first line, before its
    try: ctypes then reports it as unraisable and hands C an undefined
    status, which may read as MC_OK. In off mode nothing would catch the
    bytes that never moved; the call must raise the interrupt instead, on
    either path into the library."""
    def entered(self, method, real):
        def cb(*_):  # stands for a handler run at cb's entry
            raise SystemExit(3)
        return cb if method == "write" else real(self, method)
    exc, g, src, dst = interrupted_transfer(pd, monkeypatch, path, entered)
    assert exc.code == 3
    assert dst.raw != src.raw, "the write never ran"
    assert g._callbacks.take_interrupt() is None, "raised once, then gone"


@pytest.mark.parametrize("path", ["fast", "ctypes"])
def test_an_interrupt_kept_during_a_call_that_succeeded_still_comes_out(pd, monkeypatch, path):
    """The status C got can read as MC_OK although a callback was
    interrupted (above: the undefined status of an unraisable one). The
    kept interrupt wins over the status on either path."""
    def kept(self, method, real):
        inner = real(self, method)

        def cb(*args):
            st = inner(*args)
            if method == "write":
                self.interrupted(SystemExit(4))
            return st
        return cb
    exc, g, src, dst = interrupted_transfer(pd, monkeypatch, path, kept)
    assert exc.code == 4
    assert dst.raw == src.raw, "the engine wrote: only the interrupt says otherwise"


def test_a_library_thread_keeps_its_python_thread_state_between_callbacks(pd):
    """ctypes makes a thread state for a callback on a thread Python did not
    start and deletes it as the callback returns, unless the thread's state
    is kept: thread-local values then last from one callback to the next."""
    g, eng, src, dst, srcs, dsts = pd(verify="off")
    here = threading.local()
    seen = {}  # thread ident: the callbacks that thread's local value counted
    write = eng.write

    def counting(*args):
        here.n = getattr(here, "n", 0) + 1
        seen[threading.get_ident()] = here.n
        return write(*args)
    eng.write = counting
    for _ in range(50):
        g.transfer("decode:7", srcs, dsts, [BLOCK] * N)
    assert threading.get_ident() not in seen, "the calls ran on the library's threads"
    assert sum(seen.values()) == 50, seen
    assert dst.raw == src.raw
