"""The Guard class: a Pythonic wrapper over libmcguard's C API."""

import array
import ctypes
import json
import operator
import os
import threading

from . import _lib

try:  # mc_guard_transfer and _sync_transfers without ctypes for the plain case (_fastcall.c); ctypes alone without it
    from . import _fastcall
except ImportError:
    _fastcall = None
_fast_transfer = getattr(_fastcall, "transfer", None)
_fast_sync_transfers = getattr(_fastcall, "sync_transfers", None)  # None in a module built before it

from .abi import *  # noqa: F401,F403,E402 - the statuses and modes are mcguard.guard's names too
from .abi import ABORT_STATES, ID_SIZE, LOG_LEVELS, SEAL_MODES, STATUS_NAMES, seal_size, TRANSFER_NO_NOTICE, VERIFY_MODES, SyncOpts, TransferOpts  # noqa: E402
from .callbacks import Callbacks, ensure_unraisable_hook  # noqa: E402 - imported once: an import inside _h cost 1 µs a call

# Callbacks of guards over an engine: live ones, and retired ones kept
# (small: the engine itself is let go) because a late call may return
# through them after close.
_live_callbacks = set()
_retired_callbacks = []


class MCGuardError(Exception):
    """A failed mcguard call: .status (int), .name (MC_ERR_*), .message;
    for a failed transfer, .abort: "confirmed" (the receiver said nothing
    more of it will land), "unconfirmed" (quiesce before reuse) or None,
    and .transfer_id (for Guard.wait_engine_calls; None for other calls)."""

    def __init__(self, status, message, abort=None, transfer_id=None):
        self.status = status
        self.name = STATUS_NAMES.get(status, "status %d" % status)
        self.message = message
        self.abort = abort
        self.transfer_id = transfer_id
        super().__init__("%s: %s" % (self.name, message))


# A child of os.fork() must never call into the Go runtime: it would hang.
# The C entry points refuse too, but this catches it before any call.
_forked_child = False


def _after_fork_in_child():
    global _forked_child
    _forked_child = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _check_not_forked():
    if _forked_child:
        raise MCGuardError(MC_ERR_FORKED,
                           "this process is a child of os.fork(); mcguard cannot be used "
                           "after fork. Use multiprocessing's 'spawn' start method.")


def _name(name):
    """A published seal's name as C bytes, or MCGuardError."""
    if not isinstance(name, str) or "\0" in name:
        raise MCGuardError(MC_ERR_INVALID_ARG, "a seal's name must be a str without NUL, got %r" % (name,))
    return name.encode()


def _read_arrays(local, remote, lengths):
    """A read's three arrays as ctypes, their count and what keeps them
    alive, or MCGuardError when their lengths differ."""
    lp, n1, k1 = u64_array(local)
    rp, n2, k2 = u64_array(remote)
    ln, n3, k3 = u64_array(lengths)
    if not (n1 == n2 == n3):
        raise MCGuardError(MC_ERR_INVALID_ARG, "local, remote and lengths differ in length")
    return lp, rp, ln, n1, (k1, k2, k3)


def _seal_args(seal, mode):
    """A seal as bytes and a mode as MC_VERIFY_*, or MCGuardError."""
    if not isinstance(seal, (bytes, bytearray, memoryview)) or len(seal) == 0:
        raise MCGuardError(MC_ERR_INVALID_ARG, "the seal must be non-empty bytes, got %s" % type(seal).__name__)
    if mode not in SEAL_MODES:
        raise MCGuardError(MC_ERR_INVALID_ARG, "a seal is checked in mode 'digest' or 'tail', not %r" % (mode,))
    return bytes(seal), SEAL_MODES[mode]


def _u64(x, what):
    """x as an int in [0, 2**64), or MCGuardError: ctypes would wrap a larger
    value, truncate a float and take a bool, silently."""
    if isinstance(x, bool) or not isinstance(x, int):
        try:
            if isinstance(x, bool):
                raise TypeError
            x = operator.index(x)  # ints, numpy integers; not floats, strings, bools
        except TypeError:
            raise MCGuardError(MC_ERR_INVALID_ARG, "%s must be a non-negative integer below 2**64, not %s %r"
                               % (what, type(x).__name__, x)) from None
    if x < 0 or x >= 1 << 64:
        raise MCGuardError(MC_ERR_INVALID_ARG, "%s %d is outside [0, 2**64)" % (what, x))
    return x


def address_of(x, what="address"):
    """An address from an int, an object with data_ptr() (a torch tensor),
    or a CUDA stream object with cuda_stream (torch.cuda.Stream)."""
    stream = getattr(x, "cuda_stream", None)
    if isinstance(stream, int) and not isinstance(stream, bool):
        return _u64(stream, what)
    ptr = getattr(x, "data_ptr", None)
    if callable(ptr):
        return _u64(ptr(), what)
    return _u64(x, what)


def _session(session):
    """A session name as bytes for C, or MCGuardError."""
    if not isinstance(session, str):
        raise MCGuardError(MC_ERR_INVALID_ARG, "session must be a str \"host:port\", not %s %r"
                           % (type(session).__name__, session))
    if "\0" in session:
        raise MCGuardError(MC_ERR_INVALID_ARG, "session %r contains a NUL character" % session)
    return session.encode()


_U64_ARRAYS = {}  # n -> ctypes.c_uint64 * n: building the type each call costs as much as filling it
_U64_ONE = ctypes.c_uint64 * 1
_TRANSFER_OPTS_SIZE = ctypes.sizeof(TransferOpts)
_U64_LIMIT = 1 << 64


def _u64_type(n):
    t = _U64_ARRAYS.get(n)
    if t is None:
        t = ctypes.c_uint64 * n
        if len(_U64_ARRAYS) < 4096:
            _U64_ARRAYS[n] = t
    return t


_INT_ONLY = {int}


def u64_array(values, what="address or length"):
    """(ctypes array or pointer, count, keepalive) for a sequence of
    addresses or lengths: a list or tuple, array.array('Q'), a numpy uint64
    array, or a single int. Contiguous unsigned 64-bit buffers are passed
    without copying; anything else is checked element by element. A ctypes
    array of c_uint64 passes for a uint64_t * parameter or field as it is."""
    if type(values) is list or type(values) is tuple:  # the common cases, kept cheap
        n = len(values)
        if n == 1:  # one descriptor: no generator, a cached type
            v = values[0]
            if type(v) is int and 0 <= v < _U64_LIMIT:
                buf = _U64_ONE(v)
                return buf, 1, buf
        elif n:
            # array's C loop range-checks every value (OverflowError, never
            # wrapped); the set of types keeps bools, numpy integers and
            # tensors (whose __index__ array would take for their value) to
            # the checked path below. A fifth of a ctypes array built from
            # the values one by one: 20 against 95 µs for 512.
            try:
                arr = array.array("Q", values)
            except (TypeError, OverflowError, ValueError):
                arr = None  # the checked path says which value is wrong
            if arr is not None and set(map(type, values)) == _INT_ONLY:
                values = arr  # passed as an array('Q') is, below
    if isinstance(values, (str, bytes, dict)) or values is None:
        raise MCGuardError(MC_ERR_INVALID_ARG, "%s: expected a sequence of integers, not %s"
                           % (what, type(values).__name__))
    if isinstance(values, int) or hasattr(values, "data_ptr") and not hasattr(values, "__len__"):
        values = [values]
    if isinstance(values, array.array) and values.typecode in ("Q", "L") and values.itemsize == 8:
        n = len(values)
        if n == 0:
            return None, 0, values
        buf = _u64_type(n).from_buffer(values)
        return buf, n, (values, buf)
    iface = getattr(values, "__array_interface__", None)
    if iface is not None and iface.get("typestr") == "<u8" and iface.get("strides") is None \
            and len(iface.get("shape", ())) == 1:
        n = iface["shape"][0]
        ptr = ctypes.cast(iface["data"][0], ctypes.POINTER(ctypes.c_uint64))
        return (ptr if n else None), n, values
    try:
        items = [address_of(v, what) for v in values]
    except TypeError:
        raise MCGuardError(MC_ERR_INVALID_ARG, "%s: expected a sequence of integers, not %s"
                           % (what, type(values).__name__)) from None
    n = len(items)
    if n == 0:
        return None, 0, None
    buf = _u64_type(n)(*items)
    return buf, n, buf


class TransferResult:
    """id: for sync_transfers at the receiver; digests: the sources' xxh3-64
    (when asked for), to forward to a receiver that syncs by ranges."""
    __slots__ = ("id", "retries", "resends", "digests")

    def __init__(self, id, retries, resends=0, digests=None):
        self.id, self.retries, self.resends, self.digests = id, retries, resends, digests

    def __repr__(self):
        return "TransferResult(id=%#x, retries=%d, resends=%d)" % (self.id, self.retries, self.resends)


class Guard:
    """One mcguard instance. config is a dict or a JSON string (see the
    README's configuration table); keyword arguments are added to it.

    with Guard(verify="tail") as g:
        g.register(addr, size)
        g.transfer("10.0.0.2:4567", src_ptrs, dst_ptrs, lengths)
    """

    def __init__(self, config=None, engine=None, **settings):
        """engine, if given, is the application's own transfer engine
        (mcguard.engine.Engine, e.g. MooncakeEngine(te)): it moves the
        bytes and the guard verifies through it."""
        _check_not_forked()
        self._lib = _lib.lib()
        if isinstance(config, str):
            config = json.loads(config) if config.strip() else {}
        cfg = dict(config or {})
        cfg.update(settings)
        handle = ctypes.c_uint64(0)
        self._handle = 0
        self._closed = False
        self._callbacks = None
        if engine is None:
            self._check(self._lib.mc_guard_open(json.dumps(cfg).encode(), ctypes.byref(handle)), 0)
        else:
            if getattr(engine, "calls_end_on_their_own", False) is True and "engine_inline_calls" not in cfg \
                    and "MC_GUARD_ENGINE_INLINE_CALLS" not in os.environ:
                cfg["engine_inline_calls"] = True  # the engine bounds its calls: no hand-off needed
            try:
                self._callbacks = Callbacks(engine)
            except TypeError as e:
                raise MCGuardError(MC_ERR_INVALID_ARG, str(e)) from None
            _live_callbacks.add(self._callbacks)
            try:
                self._check(self._lib.mc_guard_open_with_transport(json.dumps(cfg).encode(),
                                                                   ctypes.byref(self._callbacks.ops), None,
                                                                   ctypes.byref(handle)), 0)
            except MCGuardError:
                self._retire_callbacks()
                raise
        self._handle = handle.value
        # The plain transfer's and sync's entry points for _fastcall; its
        # statuses go through _check as ctypes' do, which also raises an
        # interrupt an engine's callback caught.
        self._fast_entry = self._fast_sync_entry = 0
        if _fast_transfer is not None and not os.environ.get("MCGUARD_NO_FASTCALL"):
            self._fast_entry = ctypes.cast(self._lib.mc_guard_transfer, ctypes.c_void_p).value or 0
            if _fast_sync_transfers is not None:
                self._fast_sync_entry = ctypes.cast(self._lib.mc_guard_sync_transfers, ctypes.c_void_p).value or 0
        self._lock = threading.Lock()
        buf = ctypes.create_string_buffer(256)
        self._check(self._lib.mc_guard_endpoint(self._handle, buf, len(buf)))
        self.endpoint = buf.value.decode()

    def _check(self, status, handle=None, abort=None, transfer_id=None):
        """Raises MCGuardError for a status other than MC_OK, with the
        library's message (and, given a transfer's abort_state and id,
        .abort and .transfer_id; an id of 0 is none: the call failed before
        the transfer began)."""
        callbacks = getattr(self, "_callbacks", None)
        if callbacks is not None:
            interrupt = callbacks.take_interrupt()
            if interrupt is not None:  # Ctrl-C or exit inside an engine callback: it wins over the status
                raise interrupt
        if status == MC_OK:
            return
        h = self._handle if handle is None else handle
        size = self._lib.mc_guard_last_error(h, None, 0)
        buf = ctypes.create_string_buffer(size + 1)
        self._lib.mc_guard_last_error(h, buf, len(buf))
        raise MCGuardError(status, buf.value.decode(errors="replace"),
                           ABORT_STATES.get(abort) if abort is not None else None,
                           transfer_id or None)

    def _h(self):
        _check_not_forked()
        if self._closed:
            raise MCGuardError(MC_ERR_BAD_HANDLE, "this Guard is closed")
        if self._callbacks is not None:  # the call may run them: see callbacks.ensure_unraisable_hook
            ensure_unraisable_hook()
        return self._handle

    @property
    def port(self):
        """The port of this guard's endpoint (Mooncake's rpc port)."""
        return int(self.endpoint.rsplit(":", 1)[1])

    def register(self, addr, length=None):
        """Register [addr, addr+length) as source and as target memory. addr
        may be a tensor (length then defaults to its size in bytes); a CUDA
        tensor is registered as device memory, which fails clearly with
        MC_ERR_DEVICE where this guard has no usable CUDA driver."""
        if length is None:
            numel, size = getattr(addr, "numel", None), getattr(addr, "element_size", None)
            if not (callable(numel) and callable(size)):
                raise MCGuardError(MC_ERR_INVALID_ARG, "register needs a length for %r" % type(addr).__name__)
            length = numel() * size()
        fn = self._lib.mc_guard_register_device if getattr(addr, "is_cuda", False) else self._lib.mc_guard_register
        self._check(fn(self._h(), address_of(addr), _u64(length, "length")))

    def unregister(self, addr):
        self._check(self._lib.mc_guard_unregister(self._h(), address_of(addr)))

    def alloc(self, length):
        """The address of length bytes (whole pages) of zeroed host memory,
        registered, that a same-host sender maps and writes with memcpy
        (mc_guard_alloc). Freed by free() or close(): do not touch it after."""
        out = ctypes.c_void_p()
        self._check(self._lib.mc_guard_alloc(self._h(), _u64(length, "length"), ctypes.byref(out)))
        return out.value

    def free(self, addr):
        """Quiesce, unregister and free an allocation of alloc()."""
        self._check(self._lib.mc_guard_free(self._h(), address_of(addr)))

    def transfer(self, session, src, dst, lengths, verify=None, digests=False, notice=True, deadline_ms=0):
        """Write len bytes from each local src to each remote dst of session
        and return only once they are confirmed (read-back modes) or fenced
        and announced (digest). digests=True returns the sources' digests;
        notice=False sends no completion notice; deadline_ms > 0 fails it
        with MC_ERR_TIMEOUT past that. Raises MCGuardError, whose .abort says
        whether bytes of a failed transfer may still land."""
        if verify not in VERIFY_MODES:
            raise MCGuardError(MC_ERR_INVALID_ARG, "verify must be one of %s"
                               % sorted(k for k in VERIFY_MODES if k))
        h = self._h()
        if self._fast_entry and not digests and type(deadline_ms) is int and deadline_ms == 0:
            r = _fast_transfer(self._fast_entry, h, session, src, dst, lengths, VERIFY_MODES[verify],
                               0 if notice else TRANSFER_NO_NOTICE)
            if r is not None:  # else not the plain case: the checked path below says what is wrong
                st, tid, retries, resends, abort = r
                self._check(st, abort=abort, transfer_id=tid)
                return TransferResult(tid, retries, resends, None)
        s, ns, ks = u64_array(src, "source address")
        d, nd, kd = u64_array(dst, "destination address")
        ln, nl, kl = u64_array(lengths, "length")
        if not (ns == nd == nl):
            raise MCGuardError(MC_ERR_INVALID_ARG, "src, dst and lengths differ in length (%d, %d, %d)"
                               % (ns, nd, nl))
        opts = TransferOpts(_TRANSFER_OPTS_SIZE, VERIFY_MODES[verify], 0 if notice else TRANSFER_NO_NOTICE)
        if type(deadline_ms) is not int or deadline_ms != 0:  # anything but a plain 0 is checked
            opts.deadline_ms = _u64(deadline_ms, "deadline_ms")
        out = None
        if digests and ns:
            out = (ctypes.c_uint64 * ns)()
            opts.digests = ctypes.cast(out, ctypes.POINTER(ctypes.c_uint64))
        st = self._lib.mc_guard_transfer(h, _session(session), s, d, ln, ns, ctypes.byref(opts))
        del ks, kd, kl
        self._check(st, abort=opts.abort_state, transfer_id=opts.transfer_id)
        return TransferResult(opts.transfer_id, opts.retries, opts.resends,
                              list(out) if out is not None else None)

    def read(self, session, local, remote, lengths):
        """Read len bytes from each remote address of session into local."""
        h = self._h()
        lp, rp, ln, n, keep = _read_arrays(local, remote, lengths)
        st = self._lib.mc_guard_read(h, _session(session), lp, rp, ln, n)
        del keep
        self._check(st)

    def seal(self, addrs, lengths):
        """Producer side of a verified read: seal the registered ranges
        [addrs[i], +lengths[i]) whose bytes are final, and return the seal
        (bytes) for the application to carry to the reader. The bytes must
        not change until every reader has read them."""
        h = self._h()
        a, na, ka = u64_array(addrs)
        ln, nl, kl = u64_array(lengths)
        if na != nl:
            raise MCGuardError(MC_ERR_INVALID_ARG, "addrs and lengths differ in length")
        buf = ctypes.create_string_buffer(seal_size(na) if na else 1)
        size = ctypes.c_size_t(0)
        st = self._lib.mc_guard_seal(h, a, ln, na, buf, len(buf), ctypes.byref(size))
        del ka, kl
        self._check(st)
        return buf.raw[:size.value]

    def read_sealed(self, session, local, remote, lengths, seal, mode=None):
        """Read as read() does, then check the landed bytes against the
        producer's seal: mode "digest" (None: every byte) or "tail" (each
        range's last 16 bytes). Raises MC_ERR_VERIFY naming the ranges that
        differ, MC_ERR_SEAL for a seal that is not this producer's or not
        for these ranges."""
        h = self._h()
        lp, rp, ln, n, keep = _read_arrays(local, remote, lengths)
        sb, m = _seal_args(seal, mode)
        st = self._lib.mc_guard_read_sealed(h, _session(session), lp, rp, ln, n, sb, len(sb), m)
        del keep
        self._check(st)

    def check_seal(self, local, lengths, seal, remote=None, mode=None, producer=None):
        """Check bytes another engine read into [local[i], +lengths[i])
        (registered here) against the producer's seal, as read_sealed does;
        remote, if given, must be the sealed addresses, and producer (the
        producer guard's id, bytes) the producer the seal names."""
        h = self._h()
        lp, n1, k1 = u64_array(local)
        ln, n3, k3 = u64_array(lengths)
        rp, k2 = None, None
        if remote is not None:
            rp, n2, k2 = u64_array(remote)
            if n2 != n1:
                raise MCGuardError(MC_ERR_INVALID_ARG, "local, remote and lengths differ in length")
        if n1 != n3:
            raise MCGuardError(MC_ERR_INVALID_ARG, "local and lengths differ in length")
        sb, m = _seal_args(seal, mode)
        pb = None
        if producer is not None:
            if not isinstance(producer, (bytes, bytearray)) or len(producer) != ID_SIZE:
                raise MCGuardError(MC_ERR_INVALID_ARG, "producer must be the %d bytes of a guard's id" % ID_SIZE)
            pb = bytes(producer)
        st = self._lib.mc_guard_check_seal(h, lp, rp, ln, n1, sb, len(sb), m, pb)
        del k1, k2, k3
        self._check(st)

    def publish(self, name, addrs, lengths):
        """Seal the ranges as seal() does and keep the seal under name (a
        request id, str) for readers to fetch_seal() from this guard."""
        h = self._h()
        a, na, ka = u64_array(addrs)
        ln, nl, kl = u64_array(lengths)
        if na != nl:
            raise MCGuardError(MC_ERR_INVALID_ARG, "addrs and lengths differ in length")
        st = self._lib.mc_guard_publish(h, _name(name), a, ln, na)
        del ka, kl
        self._check(st)

    def withdraw(self, name):
        """Forget the seal published under name (its blocks handed back)."""
        self._check(self._lib.mc_guard_withdraw(self._h(), _name(name)))

    def fetch_seal(self, session, name, timeout_ms=10000):
        """The seal session's guard published under name, waiting up to
        timeout_ms for it (MC_ERR_TIMEOUT)."""
        h = self._h()
        timeout = _u64(timeout_ms, "timeout_ms")
        buf = ctypes.create_string_buffer(1 << 20)  # a published seal's bound
        size = ctypes.c_size_t(0)
        self._check(self._lib.mc_guard_fetch_seal(h, _session(session), _name(name), timeout, buf, len(buf),
                                                  ctypes.byref(size)))
        return buf.raw[:size.value]

    @property
    def id(self):
        """This guard's identity (bytes): the producer its seals name."""
        buf = ctypes.create_string_buffer(ID_SIZE)
        self._check(self._lib.mc_guard_id(self._h(), buf, ID_SIZE))
        return buf.raw

    def sync(self, addrs=(), lengths=(), digests=None, stream=0):
        """Receiver side, for ranges the application was told about: wait
        for writes in flight to them, make them safe to read and, given the
        sender's digests, compare. stream: a CUDA stream handle (int) or 0."""
        h = self._h()
        a, na, ka = u64_array(addrs)
        ln, nl, kl = u64_array(lengths)
        if na != nl:
            raise MCGuardError(MC_ERR_INVALID_ARG, "addrs and lengths differ in length")
        opts = SyncOpts(ctypes.sizeof(SyncOpts), 0, address_of(stream))
        kd = None
        if digests is not None:
            dp, nd, kd = u64_array(digests)
            if nd != na:
                raise MCGuardError(MC_ERR_INVALID_ARG, "%d digests for %d ranges" % (nd, na))
            opts.digests = dp
        st = self._lib.mc_guard_sync(h, a, ln, na, ctypes.byref(opts))
        del ka, kl, kd
        self._check(st)

    def sync_transfers(self, transfer_ids, stream=0):
        """Receiver side, for transfers announced by completion notices:
        wait for each notice, settle its ranges, compare digests (digest
        mode). Raises MC_ERR_TIMEOUT without a notice, MC_ERR_VERIFY on a
        mismatch."""
        h = self._h()
        if self._fast_sync_entry:
            st = _fast_sync_transfers(self._fast_sync_entry, h, transfer_ids, stream)
            if st is not None:  # else not the plain case: the checked path below says what is wrong
                self._check(st)
                return
        ids, n, keep = u64_array(transfer_ids)
        opts = SyncOpts(ctypes.sizeof(SyncOpts), 0, address_of(stream))
        st = self._lib.mc_guard_sync_transfers(h, ids, n, ctypes.byref(opts))
        del keep
        self._check(st)

    def wait_engine_calls(self, transfer_id, timeout_ms=0):
        """Over an engine, after a failed transfer (MCGuardError.transfer_id):
        return once no engine call made for it is still running, held writes
        included, waiting at most timeout_ms (0: only say). Do not write its
        blocks again before. Raises MC_ERR_TIMEOUT while calls still run,
        MC_ERR_INVALID_ARG over mcguard's own data planes (there .abort and
        the receiver's quiesce say it) or for an id this guard did not give."""
        tid = _u64(transfer_id, "transfer_id")
        ms = _u64(timeout_ms, "timeout_ms")
        self._check(self._lib.mc_guard_wait_engine_calls(self._h(), tid, ms))

    def cancel(self, session):
        """Cancel the transfers in flight to session (from other threads):
        each raises MC_ERR_CANCELLED once its writes are cut off."""
        self._check(self._lib.mc_guard_cancel(self._h(), _session(session)))

    def peer_regions(self, session):
        """[(addr, len)] the session has registered, in registration order,
        from a fresh handshake."""
        h, name, n = self._h(), _session(session), ctypes.c_size_t(0)
        while True:
            cap = n.value
            addrs, lens = (ctypes.c_uint64 * max(cap, 1))(), (ctypes.c_uint64 * max(cap, 1))()
            st = self._lib.mc_guard_peer_regions(h, name, addrs, lens, cap, ctypes.byref(n))
            if st == MC_ERR_BUFFER_TOO_SMALL and n.value > cap:
                continue  # it registered more meanwhile
            self._check(st)
            return list(zip(addrs[:n.value], lens[:n.value]))

    def quiesce(self, addrs, lengths):
        """Receiver side, before reusing ranges whose transfer failed or whose
        request was aborted: returns once no write into them sent before the
        call can land any more (late ones are refused)."""
        h = self._h()
        a, na, ka = u64_array(addrs, "address")
        ln, nl, kl = u64_array(lengths, "length")
        if na != nl:
            raise MCGuardError(MC_ERR_INVALID_ARG, "addrs and lengths differ in length")
        st = self._lib.mc_guard_quiesce(h, a, ln, na)
        del ka, kl
        self._check(st)

    def quiesce_engine(self, session, addrs, lengths):
        """Over an engine, sending side: the receiver at session quiesced
        these ranges of its memory (the application brought them here):
        no engine call of a transfer that began before writes there any
        more, and this returns once none to session still runs."""
        h = self._h()
        a, na, ka = u64_array(addrs, "address")
        ln, nl, kl = u64_array(lengths, "length")
        if na != nl:
            raise MCGuardError(MC_ERR_INVALID_ARG, "addrs and lengths differ in length")
        st = self._lib.mc_guard_quiesce_engine(h, _session(session), a, ln, na)
        del ka, kl
        self._check(st)

    def _text(self, fn):
        """The text an export like mc_guard_stats copies out, however long."""
        h = self._h()
        needed = ctypes.c_size_t(0)
        buf = ctypes.create_string_buffer(4096)
        st = fn(h, buf, len(buf), ctypes.byref(needed))
        for _ in range(8):  # notifies may keep arriving between two calls
            if st != MC_ERR_BUFFER_TOO_SMALL:
                break
            buf = ctypes.create_string_buffer(needed.value + 1 + 4096)
            st = fn(h, buf, len(buf), ctypes.byref(needed))
        self._check(st)
        return buf.value.decode()

    def stats(self):
        return json.loads(self._text(self._lib.mc_guard_stats))

    def notify(self, session, name, msg):
        """Send name and msg (str, or UTF-8 bytes for msg) to session's
        notifies; returns once it queued them."""
        if not isinstance(name, str) or "\0" in name:
            raise MCGuardError(MC_ERR_INVALID_ARG, "notify name must be a str without NUL, not %r" % (name,))
        if isinstance(msg, str):
            msg = msg.encode()
        if not isinstance(msg, (bytes, bytearray)):
            raise MCGuardError(MC_ERR_INVALID_ARG, "notify msg must be str or bytes, not %s" % type(msg).__name__)
        self._check(self._lib.mc_guard_notify(self._h(), _session(session), name.encode(), bytes(msg), len(msg)))

    def notifies(self):
        """[(name, msg)] received since the last call, oldest first."""
        return [(n["name"], n["msg"]) for n in json.loads(self._text(self._lib.mc_guard_notifies))]

    def metrics(self):
        """The guard's metrics in the Prometheus text exposition format."""
        return self._text(self._lib.mc_guard_metrics)

    def close(self):
        """Close the guard; idempotent from Python."""
        with self._lock:
            if self._closed or not self._handle:
                return
            self._closed = True
        if _forked_child:
            return  # the parent owns it; a child must not call in
        try:
            self._check(self._lib.mc_guard_close(self._handle))
        finally:
            self._retire_callbacks()

    def _retire_callbacks(self):
        """After close: the engine is no longer called and may go; the
        ctypes callbacks stay alive, since a call a cancelled transfer left
        running may still return through them."""
        if self._callbacks is not None:
            self._callbacks.detach()
            _live_callbacks.discard(self._callbacks)
            _retired_callbacks.append(self._callbacks)
            self._callbacks = None

    def set_peer_guard(self, session, endpoint):
        """For a guard over an engine: the peer that the engine calls session
        has a guard at endpoint ("host:port"), where digest notices go."""
        self._check(self._lib.mc_guard_set_peer_guard(self._h(), _session(session), _session(endpoint)))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            if getattr(self, "_handle", 0) and not getattr(self, "_closed", True) and not _forked_child:
                self.close()
        except Exception:
            pass


def set_log_level(level):
    """The library's log level for the process: "error", "warn" (the
    default), "info" or "debug". Its messages go to logging.getLogger("mcguard")."""
    if level not in LOG_LEVELS:
        raise MCGuardError(MC_ERR_INVALID_ARG, "log level %r is not one of %s" % (level, ", ".join(LOG_LEVELS)))
    st = _lib.lib().mc_guard_set_log(LOG_LEVELS.index(level), _lib._log_sink, None)
    if st != MC_OK:
        raise MCGuardError(st, "mc_guard_set_log failed")


def version():
    return _lib.lib().mc_guard_version().decode()
