"""Keep your engine: a transfer engine the application already runs as a
guard's data plane. The engine moves every byte; the guard serialises each
session, verifies by reading back through the same engine (into scratch it
registers with the engine), resends, and sends digest notices.

    from mooncake.engine import TransferEngine
    from mcguard import Guard
    from mcguard.engine import MooncakeEngine

    te = TransferEngine()
    te.initialize("10.0.0.1", "P2PHANDSHAKE", "rdma", "mlx5_0")
    g = Guard(verify="tail", engine=MooncakeEngine(te))
    g.register(kv_ptr, kv_bytes)            # with the guard and with te
    g.transfer("10.0.0.2:%d" % peer_rpc_port, src, dst, lengths)

The callbacks run on the library's threads, several at once for different
sessions. An engine method reports failure by raising or by returning a
non-zero int; the transfer then fails with MC_ERR_PEER (or the MC_ERR_*
the method returned) and the reason in its message. Nothing a callback
does can make a transfer look verified.
"""

import ctypes
import logging
import sys
import threading
import weakref

from . import _lib
from .guard import STATUS_NAMES

log = logging.getLogger("mcguard.engine")

_MC_OK, _MC_ERR_PEER = 0, -7


class Engine:
    """What a guard needs of an engine. write and read move n ranges,
    lengths[i] bytes between local[i] (this process) and remote[i] at
    session (the engine's own name for the peer), and return once the
    engine reports them complete. register, unregister and fence are
    optional (leave them None): register makes memory the engine's (every
    Guard.register, and the guard's read-back scratch), fence waits until
    the engine's completed writes to session are in place."""

    name = "python"
    register = None
    unregister = None
    fence = None

    def write(self, session, local, remote, lengths):
        raise NotImplementedError

    def read(self, session, local, remote, lengths):
        raise NotImplementedError


class MooncakeEngine(Engine):
    """Mooncake's TransferEngine (mooncake.engine), initialized by its
    owner: sessions are Mooncake's target names ("host:rpc_port" under
    P2PHANDSHAKE). Its batch_transfer_sync_write and _read move the bytes;
    register_memory makes the guard's scratch Mooncake's."""

    name = "mooncake"

    def __init__(self, engine):
        self.engine = engine

    def write(self, session, local, remote, lengths):
        self._check(self.engine.batch_transfer_sync_write(session, local, remote, lengths),
                    "batch_transfer_sync_write", session, " Mooncake does not cancel a failed or timed-out "
                    "batch's slices: bytes of it may still land")

    def read(self, session, local, remote, lengths):
        self._check(self.engine.batch_transfer_sync_read(session, local, remote, lengths),
                    "batch_transfer_sync_read", session)

    def register(self, addr, length):
        self._check(self.engine.register_memory(addr, length), "register_memory", "%#x+%d" % (addr, length))

    def unregister(self, addr):
        self._check(self.engine.unregister_memory(addr), "unregister_memory", "%#x" % addr)

    @staticmethod
    def _check(ret, call, what, consequence=""):
        """Mooncake answers -1 for every failure (its log says which): an
        EngineError, never one of mcguard's statuses."""
        if ret != 0:
            raise EngineError("Mooncake's %s (%s) returned %r; Mooncake's log says why.%s"
                              % (call, what, ret, consequence))


class EngineError(Exception):
    """An engine's call failed; the message is the transfer's."""


def _put_message(msg, msg_len, text):
    """Write text, truncated, and a NUL into the callback's message buffer."""
    if not msg or not msg_len:
        return
    data = text.encode(errors="replace")[:msg_len - 1]
    ctypes.memmove(msg, data, len(data))
    ctypes.memset(msg + len(data), 0, 1)


class Callbacks:
    """An Engine as mc_transport_ops: ctypes callbacks that call it and
    turn every outcome, an exception included, into a status. detach()
    (after the guard closed) leaves them answering MC_ERR_PEER without
    touching the engine, so the engine can go."""

    def __init__(self, engine):
        if not callable(getattr(engine, "write", None)) or not callable(getattr(engine, "read", None)):
            raise TypeError("an engine needs write and read methods, not %r" % type(engine).__name__)
        self.engine = engine
        self.name = str(getattr(engine, "name", type(engine).__name__))
        self.ops = _lib.TransportOps(struct_size=ctypes.sizeof(_lib.TransportOps), name=self.name.encode())
        self.ops.write = _lib.BATCH_FN(self._own(self._batch("write")))
        self.ops.read = _lib.BATCH_FN(self._own(self._batch("read")))
        if callable(getattr(engine, "register", None)):
            self.ops.register_memory = _lib.REGISTER_FN(self._own(
                lambda _ctx, addr, n, msg, msg_len: self._call("register", (addr, n), msg, msg_len)))
        if callable(getattr(engine, "unregister", None)):
            self.ops.unregister_memory = _lib.UNREGISTER_FN(self._own(
                lambda _ctx, addr, msg, msg_len: self._call("unregister", (addr,), msg, msg_len)))
        if callable(getattr(engine, "fence", None)):
            self.ops.fence = _lib.FENCE_FN(self._own(
                lambda _ctx, session, msg, msg_len: self._call("fence", (session.decode(),), msg, msg_len)))
        # KeyboardInterrupt or SystemExit raised inside a callback (a signal
        # handler runs in whatever Python code the main thread is in, and
        # SystemExit may come from anywhere): kept, and raised again by the
        # next Guard call to end. Callbacks run on the library's threads,
        # not the caller's, so the slot is the guard's, not a thread's.
        self._interrupt_lock = threading.Lock()
        self._interrupt = None

    def _own(self, fn):
        """fn, marked as one of this object's callbacks for _unraisable."""
        fn._mcguard_callbacks = weakref.ref(self)
        return fn

    def _batch(self, method):
        def cb(_ctx, session, local, remote, lengths, n, msg, msg_len):
            # Slicing a ctypes pointer copies the n values in C: no per-byte work.
            return self._call(method, (session.decode(errors="replace"), local[:n], remote[:n], lengths[:n]),
                              msg, msg_len)
        return cb

    def _call(self, method, args, msg, msg_len):
        engine = self.engine
        if engine is None:
            _put_message(msg, msg_len, "the guard over this engine was closed")
            return _MC_ERR_PEER
        try:
            ret = getattr(engine, method)(*args)
        except EngineError as e:
            _put_message(msg, msg_len, str(e))
            return _MC_ERR_PEER
        except BaseException as e:  # noqa: BLE001 - a callback must return a status, never unwind into C
            if not isinstance(e, Exception):
                self.interrupted(e)
            else:
                log.error("mcguard: %s engine's %s raised", self.name, method, exc_info=True)
            _put_message(msg, msg_len, "%s.%s raised %s: %s" % (self.name, method, type(e).__name__, e))
            return _MC_ERR_PEER
        if ret is None or (isinstance(ret, int) and not isinstance(ret, bool) and ret == 0):
            return _MC_OK
        _put_message(msg, msg_len, "%s.%s returned %r" % (self.name, method, ret))
        if isinstance(ret, int) and not isinstance(ret, bool) and ret in STATUS_NAMES:
            return ret
        return _MC_ERR_PEER

    def interrupted(self, exc):
        """Keep exc (the first one) for take_interrupt."""
        with self._interrupt_lock:
            if self._interrupt is None:
                self._interrupt = exc

    def take_interrupt(self):
        """The KeyboardInterrupt or SystemExit a callback caught since it
        was last taken, or None."""
        with self._interrupt_lock:
            exc, self._interrupt = self._interrupt, None
        return exc

    def detach(self):
        self.engine = None


# A signal handler can raise as a callback is entered, before the try in
# _call: ctypes then reports the exception as unraisable and hands C an
# undefined status, which may read as MC_OK. This hook keeps such an
# exception for the Guard call that made the callback, which raises it
# instead of any result: that call never looks like a success. (Seen with
# SIGTERM under load: a write callback interrupted at entry, and the
# transfer went on as though the engine had written.) A guard over an
# engine puts it in front of whatever hook is set before each call into
# the library (ensure_unraisable_hook), so an application's or a test
# runner's hook set later does not take its place.
def ensure_unraisable_hook():
    current = sys.unraisablehook
    if getattr(current, "_mcguard", False):
        return

    def hook(u):
        ref = getattr(u.object, "_mcguard_callbacks", None)
        owner = ref() if ref is not None else None
        if owner is None:
            current(u)
            return
        owner.interrupted(u.exc_value)
    hook._mcguard = True
    sys.unraisablehook = hook
