"""The rest of Mooncake's TransferEngine API on GuardedTransferEngine, used
as Mooncake documents it, against a receiver in another process."""

import hashlib
import json
import os
import socket
import sys
import time

import pytest

from linepeer import LinePeer
from mcguard import Guard
from mcguard.mooncake import MAX_PENDING_BATCHES, GuardedTransferEngine, TransferNotify, TransferOpcode

SIZE = 1 << 20
PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mooncake_peer.py")


class Receiver(LinePeer):
    """mooncake_peer.py: a decode-side engine with one managed buffer."""

    def __init__(self):
        super().__init__([sys.executable, PEER, str(SIZE)])
        self.session, self.addr = self.hello["session"], self.hello["addr"]

    def close(self):
        assert super().close() == 0


@pytest.fixture
def pair():
    recv = Receiver()
    send = GuardedTransferEngine()
    assert send.initialize_ext("127.0.0.1", "P2PHANDSHAKE", "tcp", "", "p2p") == 0
    src = send.allocate_managed_buffer(SIZE)
    assert src != 0
    try:
        yield send, src, recv
    finally:
        send.close()
        recv.close()


def fill(engine, addr, n=SIZE):
    data = os.urandom(n)
    assert engine.write_bytes_to_buffer(addr, data, n) == 0
    return data


def sha1(data):
    return hashlib.sha1(data).hexdigest()


def test_sync_calls_with_opcode_and_hint(pair):
    send, src, recv = pair
    data = fill(send, src)
    assert send.read_bytes_from_buffer(src, SIZE) == data
    assert send.transfer_sync(recv.session, src, recv.addr, SIZE, TransferOpcode.Write, transport_hint="tcp") == 0
    assert recv.ask("hash") == sha1(data)
    # Read back half of what the receiver now holds, into the second half.
    want = recv.ask("fill")
    assert send.batch_transfer_sync(recv.session, [src], [recv.addr], [SIZE], GuardedTransferEngine.TransferOpcode.Read) == 0
    assert sha1(send.read_bytes_from_buffer(src, SIZE)) == want
    assert send.transfer_sync_read(recv.session, src, recv.addr, SIZE, transport_hint="") == 0
    assert send.transfer_sync_write(recv.session, src, recv.addr, 4096, transport_hint="rdma") == 0, \
        "a hint for a transport not running is only a preference"
    with pytest.raises(ValueError, match="unknown transport_hint"):
        send.transfer_sync_write(recv.session, src, recv.addr, 8, transport_hint="carrier-pigeon")
    assert send.transfer_sync(recv.session, src, recv.addr, 8, 7) == -1, "not an opcode"
    assert send.transfer_sync(recv.session, src, recv.addr, 8, TransferOpcode.Write, notify=object()) == -1


def test_failed_write_ids_and_waiting_for_engine_calls_over_tcp(pair):
    send, src, recv = pair
    fill(send, src)
    assert send.wait_engine_calls() == 0, "no write failed: nothing to wait for"
    assert send.transfer_sync_write(recv.session, src, recv.addr + SIZE, 4096) < 0, "outside the peer's buffer"
    assert send.last_failed_transfer_id is None, "refused before it began: nothing was sent"
    assert send.transfer_sync_write("127.0.0.1:1", src, recv.addr, 4096) < 0
    assert send.last_failed_transfer_id is None
    assert send.transfer_sync_write(recv.session, src, recv.addr, 4096) == 0
    assert send.last_failed_transfer_id is None and send.last_transfer_id
    # Over mcguard's own TCP there are no engine calls: a failed write's
    # abort state and the receiver's quiesce say what may land.
    assert send.wait_engine_calls(send.last_transfer_id) < 0


def test_notify_reaches_get_notifies(pair):
    send, src, recv = pair
    data = fill(send, src)
    assert recv.ask("notifies") == "[]"
    assert send.transfer_sync(recv.session, src, recv.addr, SIZE, TransferOpcode.Write,
                              notify=TransferNotify("req-1", "kv ready")) == 0
    assert send.batch_transfer_sync(recv.session, [src], [recv.addr], [8], TransferOpcode.Write,
                                    GuardedTransferEngine.TransferNotify(name="req-2", msg="caf\u00e9 " * 100)) == 0
    assert recv.ask("hash") == sha1(data)
    assert json.loads(recv.ask("notifies")) == [["req-1", "kv ready"], ["req-2", "caf\u00e9 " * 100]]
    assert recv.ask("notifies") == "[]", "taken once"
    # A transfer that fails sends no notify.
    assert send.transfer_sync(recv.session, src, recv.addr + SIZE, 8, TransferOpcode.Write,
                              notify=TransferNotify("req-3", "never")) < 0
    assert send.transfer_sync(recv.session, src, recv.addr, 8, TransferOpcode.Write,
                              notify=TransferNotify("n" * 300, "")) < 0, "name too long"
    assert recv.ask("notifies") == "[]"


def test_async_batches_and_their_status(pair):
    send, src, recv = pair
    data = fill(send, src)
    quarter = SIZE // 4
    ids = [send.batch_transfer_async_write(recv.session, [src + i * quarter], [recv.addr + i * quarter], [quarter])
           for i in range(4)]
    assert all(isinstance(b, int) and b > 0 for b in ids) and len(set(ids)) == 4
    assert send.get_batch_transfer_status(ids) == 0
    assert recv.ask("hash") == sha1(data)
    assert send.get_batch_transfer_status(ids) == -1, "collected batches are forgotten"
    # A failing batch (outside the receiver's buffer) reports -1.
    bad = send.batch_transfer_async_write(recv.session, [src], [recv.addr + SIZE], [8])
    assert bad > 0 and send.get_batch_transfer_status([bad]) == -1
    assert send.batch_transfer_async_write(recv.session, [src], [recv.addr], [8, 8]) == 0, "sizes differ"
    want = recv.ask("fill")
    rid = send.batch_transfer_async(recv.session, [src], [recv.addr], [SIZE], TransferOpcode.Read)
    assert send.get_batch_transfer_status([rid]) == 0
    assert sha1(send.read_bytes_from_buffer(src, SIZE)) == want
    rid = send.batch_transfer_async_read(recv.session, [src], [recv.addr], [SIZE])
    assert send.get_batch_transfer_status([rid]) == 0


def poll(send, batch_id):
    deadline = time.monotonic() + 30
    while True:
        ret = send.transfer_check_status(batch_id)
        if ret != 0 or time.monotonic() > deadline:
            return ret
        time.sleep(0.001)


def test_submit_and_check_status(pair):
    send, src, recv = pair
    data = fill(send, src)
    batch_id = send.transfer_submit_write(recv.session, src, recv.addr, SIZE)
    assert batch_id > 0
    assert poll(send, batch_id) == 1
    assert recv.ask("hash") == sha1(data)
    assert send.transfer_check_status(batch_id) == -1, "a completed batch is forgotten"
    bad = send.transfer_submit_write(recv.session, src, recv.addr + 1, SIZE)
    assert poll(send, bad) == -1


def test_pending_batches_are_bounded(pair, monkeypatch):
    send, src, recv = pair
    import mcguard.mooncake as mooncake
    monkeypatch.setattr(mooncake, "MAX_PENDING_BATCHES", 2)
    ids = [send.batch_transfer_async_write(recv.session, [src], [recv.addr], [64]) for _ in range(2)]
    assert send.batch_transfer_async_write(recv.session, [src], [recv.addr], [64]) == 0, "never collected"
    assert send.transfer_submit_write(recv.session, src, recv.addr, 64) == 0
    assert send.get_batch_transfer_status(ids) == 0
    assert send.batch_transfer_async_write(recv.session, [src], [recv.addr], [64]) > 0
    assert MAX_PENDING_BATCHES >= 1024


def test_async_submission_to_an_unreachable_peer_returns_zero(pair):
    """Mooncake opens the segment before it hands out a batch id: a peer
    that cannot be reached gets 0 at once, not an id that fails later."""
    send, src, recv = pair
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    closed = "127.0.0.1:%d" % s.getsockname()[1]
    s.close()
    for peer in ("unreachable_peer:9", closed):
        assert send.batch_transfer_async_write(peer, [0], [0], [16]) == 0
        assert send.transfer_submit_write(peer, 0, 0, 16) == 0
    batch_id = send.batch_transfer_async_write(recv.session, [src], [recv.addr], [64])
    assert batch_id > 0 and send.get_batch_transfer_status([batch_id]) == 0


def test_probe_engine_and_efa(pair):
    send, src, recv = pair
    assert send.send_probe(recv.session) == 0
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    closed = "127.0.0.1:%d" % s.getsockname()[1]
    s.close()
    assert send.send_probe(closed) == -1
    assert send.send_probe("no-port") == -1
    assert send.warmup_efa_segment(recv.session) == 0
    assert send.get_first_buffer_address(recv.session) == recv.addr
    assert send.guard.peer_regions(recv.session) == [(recv.addr, SIZE)]
    assert send.get_first_buffer_address(closed) == 0, "unreachable"
    assert send.get_first_buffer_address(42) == 0, "not a session name"
    assert isinstance(send.get_engine(), Guard)
    assert isinstance(send.get_engine_ptr(), int) and send.get_engine_ptr() > 0
    assert int(TransferOpcode.Read) == 0 and int(TransferOpcode.Write) == 1


def test_managed_buffers(pair):
    send, src, recv = pair
    other = send.allocate_managed_buffer(4096)
    assert other != 0 and other % 4096 == 0
    assert send.write_bytes_to_buffer(other + 4000, b"x" * 200, 200) == -1, "runs past the buffer"
    assert send.write_bytes_to_buffer(other, b"abc", 5) == -1, "more than given"
    assert send.write_bytes_to_buffer(12345, b"abc", 3) == -1, "not a managed buffer"
    assert send.write_bytes_to_buffer(other, b"abc", -1) == -1
    assert send.write_bytes_to_buffer(other + 10, b"abc", 3) == 0
    assert send.read_bytes_from_buffer(other + 10, 3) == b"abc"
    assert send.transfer_sync_write(recv.session, other, recv.addr, 4096) == 0
    assert send.free_managed_buffer(other, 4096) == 0
    assert send.free_managed_buffer(other, 4096) == -1, "freed twice"
    with pytest.raises(ValueError):
        send.read_bytes_from_buffer(other, 3)
    assert send.transfer_sync_write(recv.session, other, recv.addr, 8) < 0, "no longer registered"
    for bad in (0, -1, 1.5, True, 1 << 64):
        assert send.allocate_managed_buffer(bad) == 0


def test_calls_before_initialize_fail_cleanly():
    e = GuardedTransferEngine()
    assert e.allocate_managed_buffer(4096) == 0
    assert e.batch_transfer_async_write("127.0.0.1:1", [1], [1], [1]) == 0
    assert e.transfer_submit_write("127.0.0.1:1", 1, 1, 1) == 0
    assert e.transfer_check_status(1) == -1
    assert e.get_batch_transfer_status([1]) == -1
    assert e.free_managed_buffer(1, 1) == -1


def test_close_with_batches_in_flight_fails_them_without_waiting(pair):
    send, src, recv = pair
    fill(send, src)
    ids = [send.batch_transfer_async_write(recv.session, [src], [recv.addr], [SIZE]) for _ in range(32)]
    assert all(i > 0 for i in ids)
    t = time.monotonic()
    send.close()
    assert time.monotonic() - t < 30
    assert send.get_batch_transfer_status(ids) == -1, "forgotten at close"
    assert send.batch_transfer_async_write(recv.session, [src], [recv.addr], [8]) == 0, "closed"
