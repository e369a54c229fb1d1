"""An Engine as the C library's mc_transport_ops: the ctypes callbacks a
guard over an engine hands to the library, which turn every outcome of
the engine's methods, an exception included, into a status."""

import ctypes
import logging
import sys
import threading
import weakref

from .abi import BATCH_FN, FENCE_FN, MC_ERR_PEER, MC_OK, REGISTER_FN, STATUS_NAMES, UNREGISTER_FN, TransportOps
from .engine import EngineError

log = logging.getLogger("mcguard.engine")


def _put_message(msg, msg_len, text):
    """Write text, truncated, and a NUL into the callback's message buffer."""
    if not msg or not msg_len:
        return
    data = text.encode(errors="replace")[:msg_len - 1]
    ctypes.memmove(msg, data, len(data))
    ctypes.memset(msg + len(data), 0, 1)


# A callback on a thread Python did not start (the library's) gets a
# Python thread state that ctypes makes as the callback is entered and
# deletes as it returns: about 30 µs per engine call on a 2-core
# VM. Entering once more, never left, keeps the thread's state for the
# thread's life (one per library thread that ever called back); on a
# thread Python started it changes nothing.
_thread_kept = threading.local()
_gil_ensure = getattr(getattr(ctypes, "pythonapi", None), "PyGILState_Ensure", None)
if _gil_ensure is not None:
    _gil_ensure.restype = ctypes.c_int
    _gil_ensure.argtypes = []


def _keep_thread_state():
    _thread_kept.done = True
    if _gil_ensure is not None:
        _gil_ensure()


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
        self.ops = TransportOps(struct_size=ctypes.sizeof(TransportOps), name=self.name.encode())
        self.ops.write = BATCH_FN(self._own(self._batch("write")))
        self.ops.read = BATCH_FN(self._own(self._batch("read")))
        if callable(getattr(engine, "register", None)):
            self.ops.register_memory = REGISTER_FN(self._own(
                lambda _ctx, addr, n, msg, msg_len: self._call("register", (addr, n), msg, msg_len)))
        if callable(getattr(engine, "unregister", None)):
            self.ops.unregister_memory = UNREGISTER_FN(self._own(
                lambda _ctx, addr, msg, msg_len: self._call("unregister", (addr,), msg, msg_len)))
        if callable(getattr(engine, "fence", None)):
            self.ops.fence = FENCE_FN(self._own(
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
        if not getattr(_thread_kept, "done", False):
            _keep_thread_state()
        engine = self.engine
        if engine is None:
            _put_message(msg, msg_len, "the guard over this engine was closed")
            return MC_ERR_PEER
        try:
            ret = getattr(engine, method)(*args)
        except EngineError as e:
            _put_message(msg, msg_len, str(e))
            return MC_ERR_PEER
        except BaseException as e:  # noqa: BLE001 - a callback must return a status, never unwind into C
            if not isinstance(e, Exception):
                self.interrupted(e)
            else:
                log.error("mcguard: %s engine's %s raised", self.name, method, exc_info=True)
            _put_message(msg, msg_len, "%s.%s raised %s: %s" % (self.name, method, type(e).__name__, e))
            return MC_ERR_PEER
        if ret is None or (isinstance(ret, int) and not isinstance(ret, bool) and ret == 0):
            return MC_OK
        _put_message(msg, msg_len, "%s.%s returned %r" % (self.name, method, ret))
        if isinstance(ret, int) and not isinstance(ret, bool) and ret in STATUS_NAMES:
            return ret
        return MC_ERR_PEER

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
