"""A drop-in for Mooncake's TransferEngine as vLLM's MooncakeConnector uses it.

    # before
    from mooncake.engine import TransferEngine
    # after
    from mcguard.mooncake import GuardedTransferEngine as TransferEngine

Same method names, arguments and return conventions (0 on success, a
negative int on failure); batch_transfer_sync_write returns 0 only after
the bytes were confirmed at the target.
"""

import logging
import threading

from .guard import MC_ERR_BAD_HANDLE, Guard, MCGuardError

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


class GuardedTransferEngine:
    def __init__(self, config=None, **settings):
        self._config = dict(config or {})
        self._config.update(settings)
        self._guard = None
        self._closed = False
        self._local = threading.local()

    @property
    def guard(self):
        if self._guard is None:
            raise MCGuardError(MC_ERR_BAD_HANDLE, self._why_no_guard())
        return self._guard

    def _why_no_guard(self):
        return "this engine is closed" if self._closed else "initialize() was not called"

    def initialize(self, local_hostname, metadata_server="P2PHANDSHAKE", protocol="tcp", device_name=""):
        """Start the guard listening on local_hostname; returns 0 or -1.

        protocol "rdma" is the RDMA transport, required: where no device is
        usable this returns -1 and logs why, never falling back to TCP (the
        silent fallback is what hid Mooncake users' corruption). Of a
        device_name list ("mlx5_0,mlx5_1") the first is used. A transport or
        rdma_device given in the engine's own settings wins."""
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
            self._guard = Guard(cfg)
        except MCGuardError as e:
            log.error("mcguard: initialize failed: %s", e)
            return -1
        return 0

    def get_rpc_port(self):
        """The guard's port, or -1 (logged) before initialize or after close."""
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
        if self._guard is None:
            log.error("mcguard: %s: %s", what, self._why_no_guard())
            return -1
        try:
            fn(self._guard)
            return 0
        except MCGuardError as e:
            log.error("mcguard: %s failed: %s", what, e)
            return e.status if e.status < 0 else -1

    def register_memory(self, buffer_addr, capacity):
        return self._call("register_memory", lambda g: g.register(buffer_addr, capacity))

    def unregister_memory(self, buffer_addr):
        return self._call("unregister_memory", lambda g: g.unregister(buffer_addr))

    def batch_register_memory(self, buffer_addresses, capacities):
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

    def transfer_sync_write(self, target_hostname, buffer, peer_buffer_address, length):
        return self.batch_transfer_sync_write(target_hostname, [buffer], [peer_buffer_address], [length])

    def batch_transfer_sync_write(self, target_hostname, buffers, peer_buffer_addresses, lengths):
        """Returns 0 once every descriptor is confirmed at the target, else
        negative. The transfer's id (for the receiver's sync_transfers) is
        then in last_transfer_id, per thread."""
        def write(g):
            self._local.result = g.transfer(target_hostname, buffers, peer_buffer_addresses, lengths)
        self._local.result = None
        return self._call("batch_transfer_sync_write", write)

    @property
    def last_transfer_id(self):
        """The id of this thread's last successful batch_transfer_sync_write."""
        r = getattr(self._local, "result", None)
        return r.id if r is not None else None

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

    def cancel(self, target_hostname):
        """Prefill side: cancel the transfers in flight to target_hostname
        (each of their calls returns a negative status)."""
        return self._call("cancel", lambda g: g.cancel(target_hostname))

    def transfer_sync_read(self, target_hostname, buffer, peer_buffer_address, length):
        return self.batch_transfer_sync_read(target_hostname, [buffer], [peer_buffer_address], [length])

    def batch_transfer_sync_read(self, target_hostname, buffers, peer_buffer_addresses, lengths):
        return self._call("batch_transfer_sync_read",
                          lambda g: g.read(target_hostname, buffers, peer_buffer_addresses, lengths))

    def close(self):
        self._closed = True
        if self._guard is not None:
            self._guard.close()
            self._guard = None
