"""mcguard over Mooncake's own engine (its wheel, TCP protocol, P2PHANDSHAKE),
two processes, each wrapping a real mooncake.engine.TransferEngine with
GuardedTransferEngine(engine=...). Run with a Python that has the wheel:

    python mooncake_engine_peer.py sender     # starts the receiver itself

The sender runs every scenario and prints one JSON line of results;
test_mooncake_engine.py checks them. The receiver (role "receiver SIZE")
prints {"session", "addr", "guard"} and answers commands on stdin: "fill"
(random bytes, their SHA-1), "hash" (the buffer's SHA-1, as it is),
"sync ID" (sync_transfers([ID]), then the SHA-1), "quit".
"""

import hashlib
import json
import logging
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mooncake.engine import TransferEngine  # noqa: E402

from linepeer import LinePeer  # noqa: E402
from mcguard import Guard, MCGuardError  # noqa: E402
from mcguard.engine import MooncakeEngine  # noqa: E402
from mcguard.mooncake import GuardedTransferEngine  # noqa: E402

SIZE = 4 << 20
BLOCK = 16 << 10


def receiver(size):
    engine = GuardedTransferEngine(engine=TransferEngine())
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    addr = engine.allocate_managed_buffer(size)
    assert addr != 0
    print(json.dumps({"session": "127.0.0.1:%d" % engine.get_rpc_port(), "addr": addr,
                      "guard": engine.get_guard_endpoint()}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "fill":
            data = os.urandom(size)
            assert engine.write_bytes_to_buffer(addr, data, size) == 0
            print(hashlib.sha1(data).hexdigest(), flush=True)
        elif cmd[0] == "hash":
            print(hashlib.sha1(engine.read_bytes_from_buffer(addr, size)).hexdigest(), flush=True)
        elif cmd[0] == "sync":
            ret = engine.sync_transfers([int(cmd[1])])
            print(ret, hashlib.sha1(engine.read_bytes_from_buffer(addr, size)).hexdigest(), flush=True)
        elif cmd[0] == "quit":
            break
    engine.close()


class Receiver(LinePeer):
    def __init__(self):
        super().__init__([sys.executable, __file__, "receiver", str(SIZE)])
        self.session, self.addr, self.guard = self.hello["session"], self.hello["addr"], self.hello["guard"]

    def ask(self, cmd):
        return super().ask(cmd).split()


class LogCapture(logging.Handler):
    def __init__(self):
        super().__init__(logging.ERROR)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())

    def take(self):
        out, self.messages = " | ".join(self.messages), []
        return out


def sender():
    logs = LogCapture()
    logging.getLogger("mcguard").addHandler(logs)
    recv = Receiver()
    out = {}
    n = SIZE // BLOCK
    dsts = [recv.addr + i * BLOCK for i in range(n)]
    for mode in ("off", "tail", "sample", "full", "digest"):
        te = GuardedTransferEngine(engine=TransferEngine(), verify=mode)
        assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        src = te.allocate_managed_buffer(SIZE)
        if mode == "digest":
            assert te.set_peer_guard(recv.session, recv.guard) == 0
        data = os.urandom(SIZE)
        te.write_bytes_to_buffer(src, data, SIZE)
        ret = te.batch_transfer_sync_write(recv.session, [src + i * BLOCK for i in range(n)], dsts, [BLOCK] * n)
        if mode == "digest":
            synced, got = recv.ask("sync %d" % te.last_transfer_id)
            ret = ret or int(synced)
        else:
            got = recv.ask("hash")[0]
        stats = te.guard.stats()
        out[mode] = {"ret": ret, "landed": got == hashlib.sha1(data).hexdigest(), "transport": stats["transport"],
                     "slice_bytes": stats["slice_bytes"], "probed": stats["probed_bytes"] > 0,
                     "joined": stats["joined_descriptors"]}
        if mode == "tail":
            # Errors: each is a status, with the reason logged.
            logs.take()
            out["unregistered"] = [te.transfer_sync_write(recv.session, src, recv.addr + SIZE, 4096), logs.take()]
            # Before the failed write's blocks are reused: none of its engine
            # calls runs any more (Mooncake returned its error).
            out["failed_settled"] = [te.last_failed_transfer_id is not None, te.wait_engine_calls(),
                                     te.wait_engine_calls(te.last_failed_transfer_id, 0)]
            out["dead_peer"] = [te.transfer_sync_write("127.0.0.1:1", src, recv.addr, 4096), logs.take()]
            out["mismatched"] = [te.batch_transfer_sync_write(recv.session, [src], [recv.addr, recv.addr], [64]),
                                 logs.take()]
            out["read"] = te.transfer_sync_read(recv.session, src, recv.addr, SIZE)
            out["read_landed"] = hashlib.sha1(te.read_bytes_from_buffer(src, SIZE)).hexdigest() == recv.ask("hash")[0]
            out["first_buffer"] = te.get_first_buffer_address(recv.session) == recv.addr
        te.close()

    # A transfer past its deadline, its engine calls handed to the library's
    # threads: it returns at the deadline, saying the bytes may still land.
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    with Guard(verify="tail", engine=MooncakeEngine(te), engine_inline_calls=False) as g:
        buf = (SIZE * b"x")
        import ctypes
        cbuf = ctypes.create_string_buffer(buf, SIZE)
        g.register(ctypes.addressof(cbuf), SIZE)
        try:
            g.transfer(recv.session, [ctypes.addressof(cbuf)] * 16, [recv.addr] * 16, [SIZE] * 16, deadline_ms=1)
            out["deadline"] = "succeeded"
        except MCGuardError as e:
            out["deadline"] = [e.name, e.message, e.abort]
            try:  # the call given up at the deadline still runs until Mooncake returns it
                g.wait_engine_calls(e.transfer_id, 10000)
                out["deadline_settled"] = "ok"
            except MCGuardError as w:
                out["deadline_settled"] = [w.name, w.message]
        g.close()
    # Called on this thread (the default over Mooncake, which ends its calls
    # itself): the transfer fails once Mooncake's call returned, and no call
    # of it runs any more.
    with Guard(verify="tail", engine=MooncakeEngine(te)) as g:
        inline_buf = ctypes.create_string_buffer(buf, SIZE)  # Mooncake keeps the first one registered
        g.register(ctypes.addressof(inline_buf), SIZE)
        out["inline"] = g.stats()["engine_inline_calls"]
        try:
            g.transfer(recv.session, [ctypes.addressof(inline_buf)] * 16, [recv.addr] * 16, [SIZE] * 16,
                       deadline_ms=1)
            out["inline_deadline"] = "succeeded"
        except MCGuardError as e:
            g.wait_engine_calls(e.transfer_id, 0)  # raises MC_ERR_TIMEOUT while a call of it runs
            out["inline_deadline"] = [e.name, e.message, "settled"]
    out["receiver_exit"] = recv.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "receiver":
        receiver(int(sys.argv[2]))
    else:
        sender()
