"""GuardedTransferEngine keeps Mooncake's TransferEngine conventions."""

import hashlib
import os

from mcguard.mooncake import GuardedTransferEngine
from conftest import Buf


def test_drop_in_engine_round_trip():
    send, recv = GuardedTransferEngine(), GuardedTransferEngine()
    try:
        assert send.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert recv.initialize("127.0.0.1", "P2PHANDSHAKE", "", "") == 0
        port = recv.get_rpc_port()
        assert isinstance(port, int) and port > 0
        session = "127.0.0.1:%d" % port
        src, kv = [Buf(1 << 16, os.urandom(1 << 16)) for _ in range(2)], [Buf(1 << 16) for _ in range(2)]
        assert send.batch_register_memory([b.addr for b in src], [b.size for b in src]) == 0
        assert recv.batch_register_memory([b.addr for b in kv], [b.size for b in kv]) == 0
        assert send.batch_transfer_sync_write(session, [b.addr for b in src], [b.addr for b in kv],
                                              [b.size for b in src]) == 0
        for s, d in zip(src, kv):
            assert hashlib.sha1(d.bytes()).digest() == hashlib.sha1(s.bytes()).digest()
        assert send.transfer_sync_write(session, src[0].addr, kv[0].addr + 100, 50) == 0
        back = Buf(1 << 16)
        assert send.register_memory(back.addr, back.size) == 0
        assert send.batch_transfer_sync_read(session, [back.addr], [kv[1].addr], [1 << 16]) == 0
        assert back.bytes() == src[1].bytes()
        # Failures are negative return values, never exceptions or success.
        assert send.batch_transfer_sync_write(session, [src[0].addr], [kv[0].addr + (1 << 16)], [8]) < 0
        assert send.batch_transfer_sync_write(session, [], [], []) < 0
        assert send.batch_register_memory([1, 2], [3]) == -1
        assert send.register_memory(src[0].addr, 10) < 0, "overlapping registration"
        assert send.unregister_memory(back.addr) == 0
        assert send.batch_unregister_memory([b.addr for b in src]) == 0
        assert send.batch_transfer_sync_write(session, [src[0].addr], [kv[0].addr], [8]) < 0
    finally:
        send.close()
        recv.close()


def test_protocol_rdma_is_the_rdma_transport_and_never_falls_back(caplog):
    e = GuardedTransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "mlx5_0") == -1, "no RDMA device here"
    assert "transport rdma was required, and it is not usable" in caplog.text
    assert GuardedTransferEngine().initialize("127.0.0.1", "P2PHANDSHAKE", "nvlink", "") == -1
    assert "not one mcguard has" in caplog.text
    from models import nic_model_path
    send = GuardedTransferEngine(verbs_library=nic_model_path())
    recv = GuardedTransferEngine(verbs_library=nic_model_path())
    try:
        assert send.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "mcgnic0,mcgnic1") == 0
        assert recv.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "mcgnic0") == 0
        assert send.guard.stats()["transport"] == "rdma"
        assert "rdma on mcgnic0 port 1" in send.guard.stats()["rdma"]
        src, kv = Buf(1 << 16, os.urandom(1 << 16)), Buf(1 << 16)
        assert send.register_memory(src.addr, src.size) == 0
        assert recv.register_memory(kv.addr, kv.size) == 0
        session = "127.0.0.1:%d" % recv.get_rpc_port()
        assert send.batch_transfer_sync_write(session, [src.addr], [kv.addr], [src.size]) == 0
        assert hashlib.sha1(kv.bytes()).digest() == hashlib.sha1(src.bytes()).digest()
    finally:
        send.close()
        recv.close()


def test_initialize_failure_returns_minus_one():
    e = GuardedTransferEngine(max_batch=0)
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == -1


def test_initialize_takes_the_host_forms_mooncake_takes():
    """vLLM passes its host's address, which may be IPv6 or a name."""
    from mcguard.mooncake import listen_address
    assert listen_address("10.0.0.2") == "10.0.0.2:0"
    assert listen_address("10.0.0.2:17000") == "10.0.0.2:0"
    assert listen_address("::1") == "[::1]:0"
    assert listen_address("[::1]") == "[::1]:0"
    assert listen_address("[::1]:17000") == "[::1]:0"
    assert listen_address("localhost") == "localhost:0"
    assert listen_address("") == "127.0.0.1:0"
    for host, session_host in [("::1", "[::1]"), ("[::1]", "[::1]"), ("localhost", "localhost")]:
        send, recv = GuardedTransferEngine(), GuardedTransferEngine()
        try:
            assert recv.initialize(host, "P2PHANDSHAKE", "tcp", "") == 0, host
            assert send.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
            src, kv = Buf(4096, os.urandom(4096)), Buf(4096)
            assert send.register_memory(src.addr, src.size) == 0
            assert recv.register_memory(kv.addr, kv.size) == 0
            session = "%s:%d" % (session_host, recv.get_rpc_port())
            assert send.batch_transfer_sync_write(session, [src.addr], [kv.addr], [4096]) == 0, session
            assert kv.bytes() == src.bytes()
        finally:
            send.close()
            recv.close()
