"""A guard over NIXL's Python agent: verified reads for the pull model.

GuardedNixlAgent has the surface of nixl._api.nixl_agent (what vLLM's
NixlConnector calls: agent metadata, add_remote_agent, register_memory,
get_xfer_descs, prep_xfer_dlist, make_prepped_xfer, initialize_xfer,
transfer, check_xfer_state, the release calls, notifications) and passes
every call to a real agent: NIXL moves the bytes. What it adds:

- a producer seals the blocks it serves once their bytes are final
  (``seal(descs)``: digests and tails taken by its mcguard guard, a MAC
  under the shared secret) and forwards the seal with its own metadata;
- or it publishes the seal under the request's id in its guard
  (``publish``) and the reader fetches it from there (``fetch_seal``);
- a reader's READ carries that seal (``seal=`` on make_prepped_xfer or
  initialize_xfer, or ``set_seal``), or names the seal the producer
  published (``seal_name=``, or inside ``sealed_by(name)``: fetched in the
  background while NIXL reads), and its state is "DONE" only once NIXL
  said DONE and the bytes landed in the reader's memory equal the sealed
  ones; "ERR" when they differ (the producer reused its blocks, the read
  landed only part of them), when the seal is forged, truncated, from
  another producer or not for these ranges, and by default for a READ that
  carries no seal at all. ``xfer_error(handle)`` says why.

NIXL itself checks no bytes and cannot cancel a read; a "DONE" from it
means its backend finished, nothing more. WRITEs pass through unchanged.
"""

import bisect
import collections
import concurrent.futures
import contextlib
import logging
import os
import threading

from ..guard import Guard, MCGuardError
from ..abi import ID_SIZE, MC_ERR_INVALID_ARG, MC_ERR_SEAL

# get_agent_metadata's prefix: the producer guard's id and endpoint travel
# with the agent's metadata, so a reader knows whose seals to accept from
# whom, and where to fetch the seals it publishes. Layout: magic, id,
# the endpoint's length (2 bytes, little endian), the endpoint.
_META_MAGIC = b"MCGN\x02"

log = logging.getLogger("mcguard.nixl")

# How many descriptor lists and transfer handles are remembered before the
# oldest are forgotten (an application that never releases its handles
# must not grow this without bound).
_MAX_REMEMBERED = 65536

# How long a READ named by its seal's name waits for the producer to
# publish that seal (after which it ends "ERR"), and how many fetches run
# at once.
SEAL_WAIT_MS = 10000
_FETCHERS = 4


def nixl_api():
    """NIXL's agent class and config, from the meta package or its CUDA 12
    build."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError:
        from nixl_cu12._api import nixl_agent, nixl_agent_config
    return nixl_agent, nixl_agent_config


class _Bounded(collections.OrderedDict):
    """A dict that forgets its oldest entries past a bound."""

    def __init__(self, bound=_MAX_REMEMBERED):
        super().__init__()
        self.bound = bound

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        while len(self) > self.bound:
            self.popitem(last=False)


def _rows_of(descs):
    """Rows (addr, len, stride, count) of descriptors in any form NIXL
    takes: tuples (addr, len, dev[, meta]), an Nx3 numpy array, NIXL's
    strided Nx5 array (addr, len, dev, stride, count: count blocks of len
    bytes, stride apart), a tensor or a list of tensors. None for a form it
    cannot read (a NIXL list made elsewhere)."""
    if hasattr(descs, "data_ptr") and hasattr(descs, "numel"):
        return [(int(descs.data_ptr()), int(descs.numel() * descs.element_size()), 0, 1)]
    shape = getattr(descs, "shape", None)
    if shape is not None and len(shape) == 2:
        if shape[1] == 5:
            return [(int(r[0]), int(r[1]), int(r[3]), int(r[4])) for r in descs]
        return [(int(r[0]), int(r[1]), 0, 1) for r in descs]
    try:
        first = descs[0]
    except (TypeError, IndexError, KeyError):
        return None
    if hasattr(first, "data_ptr"):
        return [(int(t.data_ptr()), int(t.numel() * t.element_size()), 0, 1) for t in descs]
    if isinstance(first, (tuple, list)):
        return [(int(d[0]), int(d[1]), 0, 1) for d in descs]
    return None


class _Descs:
    """A descriptor list's ranges, kept as its rows (a strided row of a
    whole KV region stays one row): descriptor i is block i of the rows
    laid end to end, as NIXL indexes them."""

    __slots__ = ("rows", "starts", "total")

    def __init__(self, rows):
        self.rows, self.starts, n = rows, [], 0
        for row in rows:
            self.starts.append(n)
            n += row[3]
        self.total = n

    @classmethod
    def of(cls, descs):
        rows = _rows_of(descs)
        return None if rows is None else cls(rows)

    def __len__(self):
        return self.total

    def pick(self, indices):
        """[(addr, len)] of descriptors indices (ints, any iterable)."""
        out = []
        for i in indices:
            i = int(i)
            if not 0 <= i < self.total:
                raise MCGuardError(MC_ERR_INVALID_ARG, "descriptor %d of a list of %d" % (i, self.total))
            r = bisect.bisect_right(self.starts, i) - 1
            addr, n, stride, _ = self.rows[r]
            out.append((addr + (i - self.starts[r]) * stride, n))
        return out

    def all(self):
        return self.pick(range(self.total))


def ranges_of(descs):
    """[(addr, len)] of descriptors in any form NIXL takes (see _rows_of),
    strided rows expanded; None for a form it cannot read."""
    table = _Descs.of(descs)
    return None if table is None else table.all()


class _Read:
    """What the guard knows of one READ: the local and remote ranges, the
    producer, the seal, and once checked its verdict."""

    __slots__ = ("local", "remote", "agent", "seal", "fetch", "state", "error")

    def __init__(self, local, remote, agent, seal, fetch=None):
        self.local, self.remote, self.agent, self.seal = local, remote, agent, seal
        self.fetch = fetch  # a Future of the seal, where the READ named it
        self.state, self.error = None, None


class GuardedNixlAgent:
    """nixl_agent with verified READs. Construct it as nixl_agent
    (name, config); guard is an mcguard Guard to use (else one is opened
    with guard_config, MC_GUARD_SECRET and the other environment settings
    applying); mode is how a read is checked against its seal ("digest":
    every byte; "tail": the last 16 bytes of each range); require_seal
    makes a READ without a seal end "ERR" (the default: a "DONE" here
    always means checked); seal_wait_ms is how long a READ named by its
    seal's name waits for the producer to publish it."""

    def __init__(self, name, config=None, *, guard=None, guard_config=None, mode="digest",
                 require_seal=True, inject_partial=False, agent_class=None, seal_wait_ms=SEAL_WAIT_MS):
        if mode not in ("digest", "tail"):
            raise MCGuardError(MC_ERR_INVALID_ARG, "mode must be 'digest' or 'tail', not %r" % (mode,))
        cls = agent_class or nixl_api()[0]
        self._agent = cls(name, config) if config is not None else cls(name)
        self._own_guard = guard is None
        self.guard = guard if guard is not None else Guard(**(guard_config or {"listen": "127.0.0.1:0"}))
        self.name = name
        self.mode, self.require_seal, self.seal_wait_ms = mode, require_seal, seal_wait_ms
        # Fault injection for tests: each READ posted by initialize_xfer
        # moves only the first half of its last descriptor.
        self._inject_partial = inject_partial or os.environ.get("MCGUARD_NIXL_INJECT") == "partial"
        self._lists = _Bounded()      # id(NIXL descriptor list) -> (list, _Descs)
        self._prepped = _Bounded()    # prepped dlist handle -> (agent name, _Descs)
        self._reads = _Bounded()      # xfer handle -> _Read
        self._regs = _Bounded()       # id(NIXL registration list) -> (list, [addr])
        self._producers = _Bounded()  # remote agent name -> its guard's id
        self._fetches = _Bounded(4096)  # (agent name, seal name) -> Future of the seal
        self._fetcher = None
        self._mu = threading.Lock()
        self._seal_name = threading.local()
        self.stats = collections.Counter()

    def __getattr__(self, attr):  # everything not guarded is NIXL's
        if attr == "_agent":
            raise AttributeError(attr)
        return getattr(self._agent, attr)

    # -- identity -----------------------------------------------------

    def get_agent_metadata(self):
        endpoint = self.guard.endpoint.encode()
        return (_META_MAGIC + self.guard.id + len(endpoint).to_bytes(2, "little") + endpoint +
                self._agent.get_agent_metadata())

    def add_remote_agent(self, metadata):
        producer = None
        metadata = bytes(metadata)
        if metadata[:len(_META_MAGIC)] == _META_MAGIC:
            at = len(_META_MAGIC)
            producer = metadata[at:at + ID_SIZE]
            n = int.from_bytes(metadata[at + ID_SIZE:at + ID_SIZE + 2], "little")
            endpoint = metadata[at + ID_SIZE + 2:at + ID_SIZE + 2 + n].decode()
            metadata = metadata[at + ID_SIZE + 2 + n:]
        name = self._agent.add_remote_agent(metadata)
        if isinstance(name, bytes):
            name = name.decode()
        if producer is not None:
            self._producers[name] = (producer, endpoint)
        return name

    # -- memory -------------------------------------------------------

    def get_reg_descs(self, descs, mem_type=None):
        out = self._agent.get_reg_descs(descs, mem_type)
        self._regs[id(out)] = (out, ranges_of(descs), mem_type)
        return out

    def register_memory(self, reg_list, mem_type=None, backends=()):
        known = self._regs.get(id(reg_list))
        ranges, kind = (known[1], known[2]) if known else (ranges_of(reg_list), mem_type)
        out = self._agent.register_memory(reg_list, mem_type, list(backends))
        done = []
        try:
            for addr, n in ranges or ():
                if kind == "VRAM":
                    self.guard.register_device(addr, n)
                else:
                    self.guard.register(addr, n)
                done.append(addr)
        except MCGuardError:
            for addr in done:
                self.guard.unregister(addr)
            self._agent.deregister_memory(out)
            raise
        self._regs[id(out)] = (out, ranges, kind)
        return out

    def deregister_memory(self, dereg_list, backends=()):
        known = self._regs.pop(id(dereg_list), None)
        self._agent.deregister_memory(dereg_list, list(backends))
        for addr, _ in (known[1] or ()) if known else ():
            try:
                self.guard.unregister(addr)
            except MCGuardError:
                pass  # never registered with the guard (a range it refused)

    # -- producer -----------------------------------------------------

    def seal(self, descs):
        """Seal the registered blocks descs (any form get_xfer_descs takes)
        whose bytes are final; returns the seal (bytes) for the reader.
        They must not change until every reader has read them."""
        ranges = ranges_of(descs)
        if ranges is None:
            raise MCGuardError(MC_ERR_INVALID_ARG, "seal: cannot read the descriptors (pass tuples, an Nx3 array or tensors)")
        return self.guard.seal([a for a, _ in ranges], [n for _, n in ranges])

    def publish(self, name, descs):
        """Seal descs as seal() does and keep the seal under name (a request
        id) in this agent's guard, for readers to fetch_seal()."""
        ranges = ranges_of(descs)
        if ranges is None:
            raise MCGuardError(MC_ERR_INVALID_ARG, "publish: cannot read the descriptors (pass tuples, an Nx3 "
                                                   "array or tensors)")
        self.guard.publish(name, [a for a, _ in ranges], [n for _, n in ranges])

    def publish_prepped(self, name, dlist_handle, indices):
        """Seal the descriptors indices of a local list prepped here
        (prep_xfer_dlist("NIXL_INIT_AGENT", ...)), as a reader's READ of
        them names them, and publish the seal under name."""
        _, table = self._prepped.get(dlist_handle, (None, None))
        if table is None:
            raise MCGuardError(MC_ERR_INVALID_ARG, "publish_prepped: not a descriptor list prepped by this agent "
                                                   "in a form it can read")
        ranges = table.pick(indices)
        self.guard.publish(name, [a for a, _ in ranges], [n for _, n in ranges])

    def withdraw(self, name):
        """Forget the seal published under name (its blocks handed back)."""
        self.guard.withdraw(name)

    # -- reader -------------------------------------------------------

    def fetch_seal(self, agent_name, name, timeout_ms=10000):
        """The seal remote agent agent_name's guard published under name,
        waiting up to timeout_ms for it; pass it as seal= to the READ."""
        known = self._producers.get(agent_name)
        if known is None:
            raise MCGuardError(MC_ERR_INVALID_ARG, "fetch_seal: %r is not a guarded remote agent of this one "
                                                   "(its metadata named no guard: does the producer run mcguard?)"
                                   % (agent_name,))
        return self.guard.fetch_seal(known[1], name, timeout_ms)

    @contextlib.contextmanager
    def sealed_by(self, name):
        """Within it, each READ this thread makes without seal= is checked
        against the seal its producer published under name."""
        before = getattr(self._seal_name, "name", None)
        self._seal_name.name = name
        try:
            yield
        finally:
            self._seal_name.name = before

    def _fetch_later(self, agent_name, name):
        """A Future of the seal agent_name's guard published under name,
        one per pair however many READs name it."""
        key = (agent_name, name)
        with self._mu:
            future = self._fetches.get(key)
            if future is None or (future.done() and future.exception() is not None):
                if self._fetcher is None:
                    self._fetcher = concurrent.futures.ThreadPoolExecutor(_FETCHERS, "mcguard-seal-fetch")
                future = self._fetcher.submit(self.fetch_seal, agent_name, name, self.seal_wait_ms)
                future.mcguard_key = key
                self._fetches[key] = future
        return future

    def get_xfer_descs(self, descs, mem_type=None):
        out = self._agent.get_xfer_descs(descs, mem_type)
        table = _Descs.of(descs)
        if table is None and id(descs) in self._lists:
            table = self._lists[id(descs)][1]
        if out is not None:
            self._lists[id(out)] = (out, table)
        return out

    def _table(self, xfer_list):
        known = self._lists.get(id(xfer_list))
        return known[1] if known else _Descs.of(xfer_list)

    def _ranges(self, xfer_list):
        table = self._table(xfer_list)
        return None if table is None else table.all()

    def prep_xfer_dlist(self, agent_name, xfer_list, mem_type=None, backends=()):
        handle = self._agent.prep_xfer_dlist(agent_name, xfer_list, mem_type, list(backends))
        self._prepped[handle] = (agent_name, self._table(xfer_list))
        return handle

    def _read(self, local, remote, agent, seal, seal_name):
        """What the guard keeps of a READ: its seal, or the fetch of the
        one published under seal_name (or the name of sealed_by)."""
        if seal is None and seal_name is None:
            seal_name = getattr(self._seal_name, "name", None)
        fetch = None if seal is not None or seal_name is None else self._fetch_later(agent, seal_name)
        return _Read(local, remote, agent, seal, fetch)

    def make_prepped_xfer(self, operation, local_xfer_side, local_indices, remote_xfer_side, remote_indices,
                          notif_msg=b"", backends=(), skip_desc_merge=False, *, seal=None, seal_name=None):
        handle = self._agent.make_prepped_xfer(operation, local_xfer_side, local_indices, remote_xfer_side,
                                               remote_indices, notif_msg, list(backends), skip_desc_merge)
        if operation == "READ":
            _, local = self._prepped.get(local_xfer_side, (None, None))
            agent, remote = self._prepped.get(remote_xfer_side, (None, None))
            try:
                self._reads[handle] = self._read(None if local is None else local.pick(local_indices),
                                                 None if remote is None else remote.pick(remote_indices),
                                                 agent, seal, seal_name)
            except MCGuardError:
                self._agent.release_xfer_handle(handle)
                raise
        return handle

    def initialize_xfer(self, operation, local_descs, remote_descs, remote_agent, notif_msg=b"", backends=(),
                        *, seal=None, seal_name=None):
        local, remote = self._ranges(local_descs), self._ranges(remote_descs)
        posted = local_descs
        if operation == "READ" and self._inject_partial and local:
            posted = self._agent.get_xfer_descs(
                [(a, n, 0) for a, n in local[:-1]] + [(local[-1][0], max(1, local[-1][1] // 2), 0)], "DRAM")
            remote_descs = self._agent.get_xfer_descs(
                [(a, n, 0) for a, n in remote[:-1]] + [(remote[-1][0], max(1, remote[-1][1] // 2), 0)], "DRAM")
        handle = self._agent.initialize_xfer(operation, posted, remote_descs, remote_agent, notif_msg,
                                             list(backends))
        if operation == "READ":
            self._reads[handle] = self._read(local, remote, remote_agent, seal, seal_name)
        return handle

    def set_seal(self, handle, seal):
        """The seal a READ's bytes are checked against (before its state
        is asked)."""
        read = self._reads.get(handle)
        if read is None:
            raise MCGuardError(MC_ERR_INVALID_ARG, "set_seal: not a READ handle of this agent")
        read.seal = seal

    def transfer(self, handle, notif_msg=b""):
        return self._verdict(handle, self._agent.transfer(handle, notif_msg))

    def check_xfer_state(self, handle):
        read = self._reads.get(handle)
        if read is not None and read.state is not None:
            return read.state
        return self._verdict(handle, self._agent.check_xfer_state(handle))

    def xfer_error(self, handle):
        """Why a READ ended "ERR" here (an MCGuardError), or None."""
        read = self._reads.get(handle)
        return read.error if read is not None else None

    def release_xfer_handle(self, handle):
        self._reads.pop(handle, None)
        return self._agent.release_xfer_handle(handle)

    def release_dlist_handle(self, handle):
        self._prepped.pop(handle, None)
        return self._agent.release_dlist_handle(handle)

    def _verdict(self, handle, state):
        """NIXL's state, unless it is a READ's DONE: then the check's
        ("PROC" while the READ's seal is still being fetched)."""
        read = self._reads.get(handle)
        if read is None or state != "DONE":
            return state
        if read.seal is None and read.fetch is not None:
            if not read.fetch.done():
                return "PROC"
            with self._mu:  # a later READ of the name fetches anew (it may be published again)
                if self._fetches.get(read.fetch.mcguard_key) is read.fetch:
                    del self._fetches[read.fetch.mcguard_key]
            try:
                read.seal = read.fetch.result()
            except Exception as e:  # noqa: BLE001 - any failure to get the seal fails the READ
                read.state = "ERR"
                read.error = MCGuardError(getattr(e, "status", MC_ERR_SEAL),
                                          "the READ's seal: %s" % getattr(e, "message", e))
                self.stats["reads_failed"] += 1
                log.warning("mcguard: a READ from %s failed: %s", read.agent, read.error)
                return read.state
        try:
            self._check(read)
            read.state = "DONE"
            self.stats["reads_verified"] += 1
        except MCGuardError as e:
            read.state, read.error = "ERR", e
            self.stats["reads_failed"] += 1
        if read.state == "ERR":
            log.warning("mcguard: a READ from %s failed its check: %s", read.agent, read.error)
        return read.state

    def _check(self, read):
        if read.seal is None:
            if self.require_seal:
                raise MCGuardError(MC_ERR_SEAL, "READ without a seal: nothing to check its bytes against "
                                        "(pass seal=, or require_seal=False to let it through unchecked)")
            self.stats["reads_unchecked"] += 1
            return
        if read.local is None:
            raise MCGuardError(MC_ERR_INVALID_ARG, "the READ's local descriptors were made outside this agent: cannot check them")
        self.guard.check_seal([a for a, _ in read.local], [n for _, n in read.local], read.seal,
                              remote=None if read.remote is None else [a for a, _ in read.remote],
                              mode=self.mode, producer=self._producers.get(read.agent, (None,))[0])

    def close(self):
        """Close the guard this agent opened (NIXL's agent goes with the
        object)."""
        if self._fetcher is not None:
            self._fetcher.shutdown(wait=False, cancel_futures=True)
        if self._own_guard:
            self.guard.close()
