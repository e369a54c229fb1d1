"""A drop-in for Mooncake's TransferEngine as vLLM's MooncakeConnector uses it.

    # before
    from mooncake.engine import TransferEngine
    # after
    from mcguard.mooncake import GuardedTransferEngine as TransferEngine

Same method names, arguments and return conventions (0 on success, a
negative int on failure); batch_transfer_sync_write returns 0 only after
the bytes were confirmed at the target.

Over mcguard's own data plane (the default) or over Mooncake's engine,
kept as the data plane (engine=):

    from mooncake.engine import TransferEngine
    te = GuardedTransferEngine(engine=TransferEngine())
    te.initialize(host, "P2PHANDSHAKE", "rdma", "mlx5_0")   # Mooncake's initialize, then the guard's

Mooncake then moves every byte and the guard verifies them by reading back
through it; sessions are Mooncake's target names. Digest mode needs the
peer's guard: set_peer_guard(target, its get_guard_endpoint()).
"""

import concurrent.futures
import ctypes
import enum
import itertools
import logging
import socket
import threading

from ..engine import MooncakeEngine
from ..guard import MC_ERR_BAD_HANDLE, MC_ERR_TIMEOUT, Guard, MCGuardError, address_of
from .topology import local_topology

log = logging.getLogger("mcguard.mooncake")


def listen_address(local_hostname):
    """The guard's listen address for Mooncake's local_hostname, in the forms
    Mooncake takes: "host", "host:port", an IPv4 address, an IPv6 address
    bare or bracketed, with or without a port. The port is not used: in P2P
    mode Mooncake picks its own, and so does mcguard."""
    host = (local_hostname or "").strip()
    if host.startswith("["):
        host = host[1:host.find("]")] if "]" in host else host[1:]
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    host = host or "127.0.0.1"
    return ("[%s]:0" if ":" in host else "%s:0") % host


class TransferOpcode(enum.IntEnum):
    """Mooncake's TransferOpcode (engine.TransferOpcode.Read / .Write)."""
    Read = 0
    Write = 1


Read, Write = TransferOpcode.Read, TransferOpcode.Write

# Mooncake's transport_hint names (its TENT build's list). A hint names a
# preference, so one for a transport this guard does not run is ignored, as
# Mooncake's non-TENT build ignores every hint; a name outside the list is
# an error, as in Mooncake's TENT build.
TRANSPORT_HINTS = ("", "unspec", "rdma", "mnnvl", "shm", "nvlink", "gds", "io_uring", "tcp", "ascend",
                   "sunrise_link")

# Async batches waiting for get_batch_transfer_status / transfer_check_status.
# Bounded so that a caller who never collects cannot grow the table forever.
MAX_PENDING_BATCHES = 4096
ASYNC_WORKERS = 8


class TransferNotify:
    """Mooncake's TransferNotify: a name and message the target takes with
    get_notifies after the transfer."""

    def __init__(self, name="", msg=""):
        self.name, self.msg = name, msg

    def __repr__(self):
        return "TransferNotify(name=%r, msg=%r)" % (self.name, self.msg)


class _MooncakeData(MooncakeEngine):
    """Mooncake's engine as the guard's data plane, with the location a
    register_memory call gave (per thread) passed on to Mooncake."""

    def __init__(self, engine):
        super().__init__(engine)
        self.where = threading.local()

    def register(self, addr, length):
        return self.engine.register_memory(addr, length, getattr(self.where, "location", "*"))


class GuardedTransferEngine:
    TransferOpcode = TransferOpcode
    TransferNotify = TransferNotify

    def __init__(self, config=None, engine=None, **settings):
        """engine, if given, is a Mooncake TransferEngine (initialized or
        not) that stays the data plane: the guard verifies through it."""
        self._config = dict(config or {})
        self._config.update(settings)
        self._engine = engine
        self._mooncake = None if engine is None else _MooncakeData(engine)
        self._guard = None
        self._closed = False
        self._local = threading.local()
        self._mu = threading.Lock()
        self._batches = {}  # batch id -> Future
        self._reached = set()  # sessions an async submission found reachable
        self._batch_ids = itertools.count(1)
        self._pool = None
        self._managed = {}  # address -> ctypes view of allocate_managed_buffer's memory (the guard's)

    @property
    def guard(self):
        if self._opened() is None:
            raise MCGuardError(MC_ERR_BAD_HANDLE, self._why_no_guard())
        return self._guard

    def _opened(self):
        """The guard; over an engine its owner initialized, opened on first
        use (listening where the settings say, else on loopback)."""
        if self._guard is None and self._engine is not None and not self._closed:
            with self._mu:
                if self._guard is None:
                    self._open_guard(dict(self._config))
        return self._guard

    def _open_guard(self, cfg):
        if self._mooncake is not None:
            for key in ("transport", "require_rdma"):
                if cfg.pop(key, None) is not None:
                    log.warning("mcguard: %s ignored: Mooncake's engine is the data plane", key)
            self._guard = Guard(cfg, engine=self._mooncake)
        else:
            self._guard = Guard(cfg)

    def _why_no_guard(self):
        return "this engine is closed" if self._closed else "initialize() was not called"

    def initialize(self, local_hostname, metadata_server="P2PHANDSHAKE", protocol="tcp", device_name=""):
        """Start the guard listening on local_hostname; returns 0 or -1.

        protocol "rdma" is the RDMA transport, required: where no device is
        usable this returns -1 and logs why, never falling back to TCP (the
        silent fallback is what hid Mooncake users' corruption). Of a
        device_name list ("mlx5_0,mlx5_1") the first is used. A transport or
        rdma_device given in the engine's own settings wins."""
        if self._engine is not None:
            return self._initialize_engine(local_hostname, metadata_server, protocol, device_name)
        if metadata_server not in ("P2PHANDSHAKE", "", None):
            log.warning("mcguard: metadata server %r ignored: sessions handshake peer to peer", metadata_server)
        cfg = dict(self._config)
        if protocol in ("tcp", "", None):
            cfg.setdefault("transport", "tcp")
        elif protocol == "rdma":
            cfg.setdefault("transport", "rdma")
            devices = [d for d in (device_name or "").split(",") if d.strip()]
            if devices:
                cfg.setdefault("rdma_device", devices[0].strip())
                if len(devices) > 1:
                    log.warning("mcguard: device_name %r: using %s only (one device per guard)", device_name,
                                devices[0].strip())
        else:
            log.error("mcguard: protocol %r is not one mcguard has (tcp, rdma)", protocol)
            return -1
        cfg.setdefault("listen", listen_address(local_hostname))
        try:
            self._open_guard(cfg)
        except MCGuardError as e:
            log.error("mcguard: initialize failed: %s", e)
            return -1
        return 0

    def _initialize_engine(self, local_hostname, metadata_server, protocol, device_name):
        """Mooncake's initialize, as given (any protocol and metadata server
        it takes), then the guard, listening on the same host."""
        ret = self._engine.initialize(local_hostname, metadata_server, protocol, device_name)
        if ret != 0:
            log.error("mcguard: Mooncake's initialize returned %d", ret)
            return ret
        cfg = dict(self._config)
        cfg.setdefault("listen", listen_address(local_hostname))
        try:
            with self._mu:
                self._open_guard(cfg)
        except MCGuardError as e:
            log.error("mcguard: initialize failed: %s", e)
            return -1
        return 0

    def set_peer_guard(self, target_hostname, endpoint):
        """Over Mooncake's engine: the peer Mooncake calls target_hostname has
        its guard at endpoint (that peer's get_guard_endpoint()); digest
        mode's notices go there. 0 or negative."""
        return self._call("set_peer_guard", lambda g: g.set_peer_guard(target_hostname, endpoint))

    def get_guard_endpoint(self):
        """This engine's guard's "host:port", for peers' set_peer_guard."""
        return self.guard.endpoint

    def get_rpc_port(self):
        """The guard's port (over Mooncake's engine: Mooncake's), or -1
        (logged) before initialize or after close."""
        if self._engine is not None and not self._closed:
            return self._engine.get_rpc_port()
        if self._guard is None:
            log.error("mcguard: get_rpc_port: %s", self._why_no_guard())
            return -1
        return self._guard.port

    def get_session_id(self):
        return self.guard.endpoint

    def _call(self, what, fn):
        """fn(guard), as Mooncake reports: 0, or a negative status with the
        reason logged. Bad arguments, calls before initialize and after
        close are failures too, never exceptions."""
        try:
            self._opened()
        except MCGuardError as e:
            log.error("mcguard: %s: the guard over Mooncake's engine did not open: %s", what, e)
            return e.status
        if self._guard is None:
            log.error("mcguard: %s: %s", what, self._why_no_guard())
            return -1
        try:
            fn(self._guard)
            return 0
        except MCGuardError as e:
            return self._failed(what, e)

    @staticmethod
    def _failed(what, e):
        log.error("mcguard: %s failed: %s", what, e)
        return e.status if e.status < 0 else -1

    def initialize_ext(self, local_hostname, metadata_server, protocol, device_name, metadata_type):
        """Mooncake's initialize with the metadata type given apart; sessions
        handshake peer to peer here, so only P2PHANDSHAKE means anything."""
        return self.initialize(local_hostname, metadata_server, protocol, device_name)

    def get_engine(self):
        """Mooncake's engine under this one where it wraps one, else the
        Guard (Mooncake returns its inner engine)."""
        return self._engine.get_engine() if self._engine is not None else self.guard

    def get_engine_ptr(self):
        """Mooncake's engine pointer where it wraps one, else the guard's C
        handle, for code that passes the engine to C/C++ (mc_guard_*
        functions take it)."""
        return self._engine.get_engine_ptr() if self._engine is not None else self.guard._h()

    def _hint(self, transport_hint, what):
        """None when the hint is usable, else a ValueError (Mooncake's TENT
        build raises invalid_argument for unknown names)."""
        hint = transport_hint or ""
        if hint not in TRANSPORT_HINTS:
            raise ValueError("%s: unknown transport_hint %r (valid: %s, or empty for no hint)"
                             % (what, transport_hint, ", ".join(h for h in TRANSPORT_HINTS if h)))
        if hint in ("", "unspec") or self._guard is None:
            return  # no preference (and no stats call on every transfer)
        ours = self._guard.stats().get("transport")
        if hint != ours:
            log.debug("mcguard: %s: transport_hint %r ignored: this guard runs %s", what, hint, ours)

    def register_memory(self, buffer_addr, capacity, location="*"):
        """location (Mooncake's NUMA or device name) goes to Mooncake's
        engine where it wraps one; mcguard's own finds what memory an
        address is."""
        if self._mooncake is not None:
            self._mooncake.where.location = location
        try:
            return self._call("register_memory", lambda g: g.register(buffer_addr, capacity))
        finally:
            if self._mooncake is not None:
                self._mooncake.where.location = "*"

    def unregister_memory(self, buffer_addr):
        return self._call("unregister_memory", lambda g: g.unregister(buffer_addr))

    def batch_register_memory(self, buffer_addresses, capacities, location="*"):
        if len(buffer_addresses) != len(capacities):
            log.error("mcguard: batch_register_memory: %d addresses, %d capacities",
                      len(buffer_addresses), len(capacities))
            return -1
        for addr, cap in zip(buffer_addresses, capacities):
            ret = self.register_memory(addr, cap)
            if ret != 0:
                return ret
        return 0

    def batch_unregister_memory(self, buffer_addresses):
        for addr in buffer_addresses:
            ret = self.unregister_memory(addr)
            if ret != 0:
                return ret
        return 0

    def allocate_managed_buffer(self, length):
        """Page-aligned memory, registered; its address, or 0 (logged).
        It is the guard's shared allocation (Guard.alloc): a same-host
        sender writes into it with memcpy. Freed by free_managed_buffer or
        at close."""
        if self._guard is None:
            log.error("mcguard: allocate_managed_buffer: %s", self._why_no_guard())
            return 0
        try:
            n = address_of(length, "length")
            if n == 0:
                raise ValueError("length is 0")
            addr = self._guard.alloc(n)
        except (MCGuardError, ValueError) as e:
            log.error("mcguard: allocate_managed_buffer(%r): %s", length, e)
            return 0
        with self._mu:
            self._managed[addr] = (ctypes.c_char * n).from_address(addr)
        return addr

    def free_managed_buffer(self, buffer_addr, length):
        """0, or -1 (logged) for an address allocate_managed_buffer did not
        give. Writes sent into it before the call are quiesced first, so a
        late one cannot land in memory the process reuses."""
        with self._mu:
            mem = self._managed.get(buffer_addr)
            if mem is None:
                log.error("mcguard: free_managed_buffer: %r is not a managed buffer of this engine", buffer_addr)
                return -1
            del self._managed[buffer_addr]
        ret = self._call("free_managed_buffer", lambda g: g.free(buffer_addr))
        if ret != 0:
            with self._mu:  # still the guard's: it frees it at close
                self._managed[buffer_addr] = mem
        return ret

    def _managed_range(self, addr, length, what):
        """(mmap, offset, length) of [addr, addr+length) inside a managed
        buffer, else ValueError: the bytes helpers touch only memory this
        engine allocated."""
        try:
            addr, length = address_of(addr, what + " address"), address_of(length, what + " length")
        except MCGuardError as e:
            raise ValueError(str(e)) from None
        with self._mu:
            for base, mem in self._managed.items():
                if base <= addr and addr + length <= base + len(mem):
                    return mem, addr - base, length
        raise ValueError("%s: [%#x, +%d) is not inside a managed buffer of this engine" % (what, addr, length))

    def write_bytes_to_buffer(self, dest_address, src, length):
        """Copy length bytes of src into a managed buffer; 0 or -1 (logged)."""
        try:
            data = bytes(src)
            mem, off, n = self._managed_range(dest_address, length, "write_bytes_to_buffer")
            if n > len(data):
                raise ValueError("write_bytes_to_buffer: length %d is more than the %d bytes given" % (n, len(data)))
            mem[off:off + n] = data[:n]
            return 0
        except (ValueError, TypeError) as e:
            log.error("mcguard: %s", e)
            return -1

    def read_bytes_from_buffer(self, source_address, length):
        """The length bytes at source_address, inside a managed buffer
        (ValueError otherwise)."""
        mem, off, n = self._managed_range(source_address, length, "read_bytes_from_buffer")
        return bytes(mem[off:off + n])

    def transfer_sync_write(self, target_hostname, buffer, peer_buffer_address, length, transport_hint=""):
        return self.batch_transfer_sync_write(target_hostname, [buffer], [peer_buffer_address], [length],
                                              transport_hint)

    def batch_transfer_sync_write(self, target_hostname, buffers, peer_buffer_addresses, lengths,
                                  transport_hint=""):
        """Returns 0 once every descriptor is confirmed at the target, else
        negative. The transfer's id (for the receiver's sync_transfers) is
        then in last_transfer_id, per thread."""
        g = self._guard
        if g is not None and not transport_hint:  # the common call, without _call's closure
            try:
                self._local.result, self._local.failed = g.transfer(target_hostname, buffers,
                                                                    peer_buffer_addresses, lengths), None
                return 0
            except MCGuardError as e:
                self._local.result, self._local.failed = None, e.transfer_id
                return self._failed("batch_transfer_sync_write", e)
        self._hint(transport_hint, "batch_transfer_sync_write")

        def write(g):
            try:
                self._local.result = g.transfer(target_hostname, buffers, peer_buffer_addresses, lengths)
            except MCGuardError as e:
                self._local.failed = e.transfer_id
                raise
        self._local.result, self._local.failed = None, None
        return self._call("batch_transfer_sync_write", write)

    @property
    def last_transfer_id(self):
        """The id of this thread's last successful batch_transfer_sync_write."""
        r = getattr(self._local, "result", None)
        return r.id if r is not None else None

    @property
    def last_failed_transfer_id(self):
        """The id of this thread's last batch_transfer_sync_write if it failed
        once under way (None if it succeeded, or failed before it began)."""
        return getattr(self._local, "failed", None)

    def wait_engine_calls(self, transfer_id=None, timeout_ms=10000):
        """Prefill side over Mooncake's engine (engine=...), after a write
        returned < 0 and before its blocks are written again: returns 0 once
        none of the engine calls made for it is still running (one given up
        at a deadline, writes held by fault injection), negative while one
        is past timeout_ms. transfer_id defaults to this thread's
        last_failed_transfer_id (0 at once when there is none). Slices
        Mooncake still moves after its call returned are beyond it."""
        if transfer_id is None:
            transfer_id = self.last_failed_transfer_id
            if transfer_id is None:
                return 0
        return self._call("wait_engine_calls", lambda g: g.wait_engine_calls(transfer_id, timeout_ms))

    def transfer_sync_read(self, target_hostname, buffer, peer_buffer_address, length, transport_hint=""):
        return self.batch_transfer_sync_read(target_hostname, [buffer], [peer_buffer_address], [length],
                                             transport_hint)

    def batch_transfer_sync_read(self, target_hostname, buffers, peer_buffer_addresses, lengths,
                                 transport_hint=""):
        self._hint(transport_hint, "batch_transfer_sync_read")
        return self._call("batch_transfer_sync_read",
                          lambda g: g.read(target_hostname, buffers, peer_buffer_addresses, lengths))

    def transfer_sync(self, target_hostname, buffer, peer_buffer_address, length, opcode, notify=None,
                      transport_hint=""):
        return self.batch_transfer_sync(target_hostname, [buffer], [peer_buffer_address], [length], opcode,
                                        notify, transport_hint)

    def batch_transfer_sync(self, target_hostname, buffers, peer_buffer_addresses, lengths, opcode,
                            notify=None, transport_hint=""):
        """WRITE or READ by opcode; with notify (a TransferNotify), once the
        transfer succeeded, its name and msg go to the target's get_notifies,
        and the call returns 0 only when the target queued them."""
        if notify is not None and not (isinstance(getattr(notify, "name", None), str)
                                       and isinstance(getattr(notify, "msg", None), (str, bytes))):
            log.error("mcguard: batch_transfer_sync: notify %r is not a TransferNotify(name, msg)", notify)
            return -1
        op = self._opcode(opcode, "batch_transfer_sync")
        if op is None:
            return -1
        if op == Write:
            ret = self.batch_transfer_sync_write(target_hostname, buffers, peer_buffer_addresses, lengths,
                                                 transport_hint)
        else:
            ret = self.batch_transfer_sync_read(target_hostname, buffers, peer_buffer_addresses, lengths,
                                                transport_hint)
        if ret != 0 or notify is None:
            return ret
        return self._call("notify", lambda g: g.notify(target_hostname, notify.name, notify.msg))

    def get_notifies(self):
        """The TransferNotify messages received since the last call, oldest
        first ([] with the reason logged on failure, as Mooncake)."""
        if self._guard is None:
            log.error("mcguard: get_notifies: %s", self._why_no_guard())
            return []
        try:
            return [TransferNotify(name, msg) for name, msg in self._guard.notifies()]
        except MCGuardError as e:
            log.error("mcguard: get_notifies failed: %s", e)
            return []

    @staticmethod
    def _opcode(opcode, what):
        try:
            return TransferOpcode(int(opcode))
        except (ValueError, TypeError):
            log.error("mcguard: %s: opcode %r is neither TransferOpcode.Read nor .Write", what, opcode)
            return None

    # Asynchronous batches: each runs the synchronous call on a small pool;
    # the caller collects it with get_batch_transfer_status or
    # transfer_check_status, which forget it.
    def _submit(self, what, target_hostname, call):
        """A batch id (> 0) for call() running in the background, or None
        (logged) when it cannot start: no guard, too many uncollected
        batches, or a target that cannot be reached (Mooncake opens the
        segment before it hands out a batch id, and returns 0 when that
        fails)."""
        if self._guard is None:
            log.error("mcguard: %s: %s", what, self._why_no_guard())
            return None
        if not self._reachable(target_hostname, what):
            return None
        with self._mu:
            if len(self._batches) >= MAX_PENDING_BATCHES:
                log.error("mcguard: %s: %d batches were never collected (get_batch_transfer_status or "
                          "transfer_check_status)", what, len(self._batches))
                return None
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(ASYNC_WORKERS, "mcguard-async")
            batch_id = next(self._batch_ids)
            self._batches[batch_id] = self._pool.submit(self._settled, what, call)
        return batch_id

    def _reachable(self, target_hostname, what):
        """Whether target_hostname answered send_probe once (per session;
        the set is bounded, emptied when full)."""
        if target_hostname in self._reached:
            return True
        ok = self.send_probe(target_hostname) == 0
        if not ok:
            log.error("mcguard: %s: %r cannot be reached", what, target_hostname)
        else:
            with self._mu:
                if len(self._reached) >= MAX_PENDING_BATCHES:
                    self._reached.clear()
                self._reached.add(target_hostname)
        return ok

    @staticmethod
    def _settled(what, call):
        """call()'s status; an exception (a bug, not a transfer's failure) is
        logged and reported as -1, so status calls never raise."""
        try:
            return call()
        except Exception:  # noqa: BLE001 - reported through the status, with its traceback logged
            log.exception("mcguard: %s raised", what)
            return -1

    def batch_transfer_async(self, target_hostname, buffers, peer_buffer_addresses, lengths, opcode,
                             transport_hint=""):
        """A batch id, or 0 on failure to submit (Mooncake's convention)."""
        what = "batch_transfer_async"
        self._hint(transport_hint, what)
        if not len(buffers) == len(peer_buffer_addresses) == len(lengths):
            log.error("mcguard: %s: buffers, peer_buffer_addresses and lengths have different sizes", what)
            return 0
        op = self._opcode(opcode, what)
        if op is None:
            return 0
        buffers, peers, lengths = list(buffers), list(peer_buffer_addresses), list(lengths)
        batch_id = self._submit(what, target_hostname, lambda: self.batch_transfer_sync(target_hostname, buffers, peers, lengths,
                                                                        op, None, transport_hint))
        return batch_id or 0

    def batch_transfer_async_write(self, target_hostname, buffers, peer_buffer_addresses, lengths,
                                   transport_hint=""):
        return self.batch_transfer_async(target_hostname, buffers, peer_buffer_addresses, lengths, Write,
                                         transport_hint)

    def batch_transfer_async_read(self, target_hostname, buffers, peer_buffer_addresses, lengths,
                                  transport_hint=""):
        return self.batch_transfer_async(target_hostname, buffers, peer_buffer_addresses, lengths, Read,
                                         transport_hint)

    def transfer_submit_write(self, target_hostname, buffer, peer_buffer_address, length, transport_hint=""):
        """A batch id for transfer_check_status, or 0 on failure to submit
        (Mooncake's convention)."""
        self._hint(transport_hint, "transfer_submit_write")
        batch_id = self._submit("transfer_submit_write", target_hostname,
                                lambda: self.batch_transfer_sync_write(target_hostname, [buffer],
                                                                       [peer_buffer_address], [length]))
        return batch_id or 0

    def _take(self, batch_id, what):
        with self._mu:
            fut = self._batches.pop(batch_id, None)
        if fut is None:
            log.error("mcguard: %s: %r is not a pending batch of this engine", what, batch_id)
        return fut

    def get_batch_transfer_status(self, batch_ids):
        """Wait for the batches: 0 when all completed with their bytes
        confirmed, else -1. The ids are forgotten either way."""
        futs = [self._take(b, "get_batch_transfer_status") for b in batch_ids]
        if any(f is None for f in futs):
            return -1
        results = [f.result() for f in futs]
        return 0 if all(r == 0 for r in results) else -1

    def transfer_check_status(self, batch_id):
        """1 completed, 0 still running, -1 failed, -2 timed out; a batch
        is forgotten once it reports 1 or -1 (as in Mooncake)."""
        with self._mu:
            fut = self._batches.get(batch_id)
        if fut is None:
            log.error("mcguard: transfer_check_status: %r is not a pending batch of this engine", batch_id)
            return -1
        if not fut.done():
            return 0
        ret = fut.result()
        if ret == MC_ERR_TIMEOUT:
            return -2
        with self._mu:
            self._batches.pop(batch_id, None)
        return 1 if ret == 0 else -1

    def get_first_buffer_address(self, segment_name):
        """The address of the first region segment_name registered, from a
        fresh handshake (over Mooncake's engine: Mooncake's answer); 0
        (logged) when it has none or cannot be reached."""
        if self._engine is not None:
            return self._engine.get_first_buffer_address(segment_name)
        if self._guard is None:
            log.error("mcguard: get_first_buffer_address: %s", self._why_no_guard())
            return 0
        try:
            regions = self._guard.peer_regions(segment_name)
        except MCGuardError as e:
            log.error("mcguard: get_first_buffer_address(%r) failed: %s", segment_name, e)
            return 0
        return regions[0][0] if regions else 0

    def get_local_topology(self, device_name=None):
        """This machine's NUMA nodes and RDMA devices as Mooncake's discovery
        reports them (a JSON string); works before initialize, as Mooncake's."""
        return local_topology(device_name)

    def send_probe(self, peer_server_name):
        """0 when the peer's guard (over Mooncake's engine: the peer's
        Mooncake) accepts a connection, else -1 (logged); SGLang uses this
        to take a peer off its failed list."""
        if self._engine is not None:
            return self._engine.send_probe(peer_server_name)
        try:
            host, port = peer_server_name.strip().rsplit(":", 1)
            host = host[1:-1] if host.startswith("[") else host
            with socket.create_connection((host, int(port)), timeout=5):
                return 0
        except (ValueError, AttributeError, OSError) as e:
            log.error("mcguard: send_probe(%r): %s", peer_server_name, e)
            return -1

    def warmup_efa_segment(self, segment_name):
        """0: what Mooncake returns where its EFA transport is not installed,
        as it never is here (sessions connect on first use); over Mooncake's
        engine, Mooncake's answer."""
        if self._engine is not None:
            return self._engine.warmup_efa_segment(segment_name)
        log.debug("mcguard: warmup_efa_segment(%r): no EFA transport in mcguard; nothing to warm up",
                  segment_name)
        return 0

    # The receiver's half (decode side), after the prefill's OK: 0 or negative.
    def sync_transfers(self, transfer_ids, stream=0):
        """Wait for the senders' completion notices and check the bytes."""
        return self._call("sync_transfers", lambda g: g.sync_transfers(transfer_ids, stream))

    def sync(self, buffer_addresses, lengths, digests=None, stream=0):
        """Settle ranges the application was told about; compare digests if given."""
        return self._call("sync", lambda g: g.sync(buffer_addresses, lengths, digests, stream))

    def quiesce(self, buffer_addresses, lengths):
        """Decode side, when a request is aborted or its transfer failed,
        before its blocks are freed for reuse: returns 0 once no write into
        them sent before the call can land (late ones are refused)."""
        return self._call("quiesce", lambda g: g.quiesce(buffer_addresses, lengths))

    def quiesce_engine(self, target_hostname, buffer_addresses, lengths):
        """Prefill side over Mooncake's engine: the decode side at
        target_hostname quiesced these ranges of its memory (told over the
        application's channel): returns 0 once no engine call of a write
        that began before can land in them."""
        return self._call("quiesce_engine", lambda g: g.quiesce_engine(target_hostname, buffer_addresses, lengths))

    def cancel(self, target_hostname):
        """Prefill side: cancel the transfers in flight to target_hostname
        (each of their calls returns a negative status)."""
        return self._call("cancel", lambda g: g.cancel(target_hostname))

    def close(self):
        self._closed = True
        with self._mu:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        # Closing the guard fails the batches still running (MC_ERR_CLOSED)
        # instead of waiting for them.
        if self._guard is not None:
            self._guard.close()
            self._guard = None
        if pool is not None:
            pool.shutdown(wait=True)
        with self._mu:  # the guard is closed: nothing can write into them now
            managed, self._managed = self._managed, {}
            self._batches.clear()
        for addr in managed:  # the guard's close freed them
            if self._engine is not None:  # Mooncake's engine outlives us: take them back from it
                self._engine.unregister_memory(addr)


def guarded_mooncake():
    """A TransferEngine class for code that constructs Mooncake's with no
    arguments (vLLM's connector): each instance is a GuardedTransferEngine
    over a new Mooncake TransferEngine. ImportError without Mooncake."""
    from mooncake.engine import TransferEngine as MooncakeTransferEngine

    class GuardedMooncakeTransferEngine(GuardedTransferEngine):
        """GuardedTransferEngine over a new mooncake.engine.TransferEngine."""

        def __init__(self, config=None, **settings):
            super().__init__(config, engine=MooncakeTransferEngine(), **settings)

    return GuardedMooncakeTransferEngine
