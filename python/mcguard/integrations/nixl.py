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
  initialize_xfer, or ``set_seal``), and its state is "DONE" only once NIXL
  said DONE and the bytes landed in the reader's memory equal the sealed
  ones; "ERR" when they differ (the producer reused its blocks, the read
  landed only part of them), when the seal is forged, truncated, from
  another producer or not for these ranges, and by default for a READ that
  carries no seal at all. ``xfer_error(handle)`` says why.

NIXL itself checks no bytes and cannot cancel a read; a "DONE" from it
means its backend finished, nothing more. WRITEs pass through unchanged.
"""

import collections
import os

from ..guard import Guard, MCGuardError
from ..abi import ID_SIZE, MC_ERR_INVALID_ARG, MC_ERR_SEAL

# get_agent_metadata's prefix: the producer guard's id and endpoint travel
# with the agent's metadata, so a reader knows whose seals to accept from
# whom, and where to fetch the seals it publishes. Layout: magic, id,
# the endpoint's length (2 bytes, little endian), the endpoint.
_META_MAGIC = b"MCGN\x02"

# How many descriptor lists and transfer handles are remembered before the
# oldest are forgotten (an application that never releases its handles
# must not grow this without bound).
_MAX_REMEMBERED = 65536


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


def ranges_of(descs):
    """[(addr, len)] of descriptors in any form NIXL takes: tuples
    (addr, len, dev[, meta]), an Nx3 numpy array, a tensor or a list of
    tensors. None for a form it cannot read (a NIXL list made elsewhere)."""
    if hasattr(descs, "data_ptr") and hasattr(descs, "numel"):
        return [(int(descs.data_ptr()), int(descs.numel() * descs.element_size()))]
    shape = getattr(descs, "shape", None)
    if shape is not None and len(shape) == 2:
        return [(int(r[0]), int(r[1])) for r in descs]
    try:
        first = descs[0]
    except (TypeError, IndexError, KeyError):
        return None
    if hasattr(first, "data_ptr"):
        return [(int(t.data_ptr()), int(t.numel() * t.element_size())) for t in descs]
    if isinstance(first, (tuple, list)):
        return [(int(d[0]), int(d[1])) for d in descs]
    return None


class _Read:
    """What the guard knows of one READ: the local and remote ranges, the
    producer, the seal, and once checked its verdict."""

    __slots__ = ("local", "remote", "agent", "seal", "state", "error")

    def __init__(self, local, remote, agent, seal):
        self.local, self.remote, self.agent, self.seal = local, remote, agent, seal
        self.state, self.error = None, None


class GuardedNixlAgent:
    """nixl_agent with verified READs. Construct it as nixl_agent
    (name, config); guard is an mcguard Guard to use (else one is opened
    with guard_config, MC_GUARD_SECRET and the other environment settings
    applying); mode is how a read is checked against its seal ("digest":
    every byte; "tail": the last 16 bytes of each range); require_seal
    makes a READ without a seal end "ERR" (the default: a "DONE" here
    always means checked)."""

    def __init__(self, name, config=None, *, guard=None, guard_config=None, mode="digest",
                 require_seal=True, inject_partial=False, agent_class=None):
        if mode not in ("digest", "tail"):
            raise MCGuardError(MC_ERR_INVALID_ARG, "mode must be 'digest' or 'tail', not %r" % (mode,))
        cls = agent_class or nixl_api()[0]
        self._agent = cls(name, config) if config is not None else cls(name)
        self._own_guard = guard is None
        self.guard = guard if guard is not None else Guard(**(guard_config or {"listen": "127.0.0.1:0"}))
        self.name = name
        self.mode, self.require_seal = mode, require_seal
        # Fault injection for tests: each READ posted by initialize_xfer
        # moves only the first half of its last descriptor.
        self._inject_partial = inject_partial or os.environ.get("MCGUARD_NIXL_INJECT") == "partial"
        self._lists = _Bounded()      # id(NIXL descriptor list) -> (list, ranges)
        self._prepped = _Bounded()    # prepped dlist handle -> (agent name, ranges)
        self._reads = _Bounded()      # xfer handle -> _Read
        self._regs = _Bounded()       # id(NIXL registration list) -> (list, [addr])
        self._producers = _Bounded()  # remote agent name -> its guard's id
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
                                                   "(its metadata named no guard)" % (agent_name,))
        return self.guard.fetch_seal(known[1], name, timeout_ms)

    def get_xfer_descs(self, descs, mem_type=None):
        out = self._agent.get_xfer_descs(descs, mem_type)
        ranges = ranges_of(descs)
        if ranges is None and id(descs) in self._lists:
            ranges = self._lists[id(descs)][1]
        if out is not None:
            self._lists[id(out)] = (out, ranges)
        return out

    def _ranges(self, xfer_list):
        known = self._lists.get(id(xfer_list))
        return known[1] if known else ranges_of(xfer_list)

    def prep_xfer_dlist(self, agent_name, xfer_list, mem_type=None, backends=()):
        handle = self._agent.prep_xfer_dlist(agent_name, xfer_list, mem_type, list(backends))
        self._prepped[handle] = (agent_name, self._ranges(xfer_list))
        return handle

    def make_prepped_xfer(self, operation, local_xfer_side, local_indices, remote_xfer_side, remote_indices,
                          notif_msg=b"", backends=(), skip_desc_merge=False, *, seal=None):
        handle = self._agent.make_prepped_xfer(operation, local_xfer_side, local_indices, remote_xfer_side,
                                               remote_indices, notif_msg, list(backends), skip_desc_merge)
        if operation == "READ":
            _, local = self._prepped.get(local_xfer_side, (None, None))
            agent, remote = self._prepped.get(remote_xfer_side, (None, None))
            pick = lambda ranges, idx: None if ranges is None else [ranges[int(i)] for i in idx]  # noqa: E731
            self._reads[handle] = _Read(pick(local, local_indices), pick(remote, remote_indices), agent, seal)
        return handle

    def initialize_xfer(self, operation, local_descs, remote_descs, remote_agent, notif_msg=b"", backends=(),
                        *, seal=None):
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
            self._reads[handle] = _Read(local, remote, remote_agent, seal)
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
        """NIXL's state, unless it is a READ's DONE: then the check's."""
        read = self._reads.get(handle)
        if read is None or state != "DONE":
            return state
        try:
            self._check(read)
            read.state = "DONE"
            self.stats["reads_verified"] += 1
        except MCGuardError as e:
            read.state, read.error = "ERR", e
            self.stats["reads_failed"] += 1
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
        if self._own_guard:
            self.guard.close()
