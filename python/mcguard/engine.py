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
sessions, or on the thread that called transfer where the engine ends
its calls itself (calls_end_on_their_own, as Mooncake's do). An engine
method reports failure by raising or by returning a non-zero int; the
transfer then fails with MC_ERR_PEER (or the MC_ERR_* the method
returned) and the reason in its message. Read-back modes trust what the
engine reads back (an engine that answers reads from its own copy passes
them); digest mode with the receiver's sync does not.
"""


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
    # True where write and read always return within the engine's own time
    # limit (a hung peer fails them, it never holds them forever): the
    # guard then calls them on the caller's thread unless
    # engine_inline_calls says otherwise: handing each call to a library
    # thread, so that the transfer can return at its deadline whatever the
    # call does, costs tens of µs per call (docs/PERFORMANCE.md).
    calls_end_on_their_own = False

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
    # batch_transfer_sync_write and _read give up after MC_TRANSFER_TIMEOUT
    # (30 s by default) plus a second per GiB of the batch, returning -1.
    calls_end_on_their_own = True

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
