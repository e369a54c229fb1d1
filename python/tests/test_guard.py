"""The guard's behaviours, through the Python binding. Every success is
checked by comparing the destination's bytes with the source's."""

import array
import ctypes
import hashlib
import threading
import time

import pytest

import mcguard
from mcguard import MCGuardError
from conftest import Buf


def h(b):
    return hashlib.sha1(b).hexdigest()


def descs(src, dst, n, size, src_off=0, dst_off=0):
    return ([src.addr + src_off + i * size for i in range(n)],
            [dst.addr + dst_off + i * size for i in range(n)],
            [size] * n)


@pytest.mark.parametrize("verify", ["off", "tail"])
def test_transfer_delivers_bytes(pair, verify):
    s, r, src, dst = pair({"verify": verify})
    res = s.transfer(r.endpoint, *descs(src, dst, 16, 64 << 10))
    assert res.id > 0
    assert h(dst.bytes()) == h(src.bytes())


def test_verification_passes_when_bytes_arrive_late(pair):
    s, r, src, dst = pair({"verify": "tail"}, {"inject": "reorder", "inject_lag_max_ms": 30})
    res = s.transfer(r.endpoint, *descs(src, dst, 32, 4096))
    assert res.retries > 0, "late writes made the guard poll"
    assert h(dst.bytes(0, 32 * 4096)) == h(src.bytes(0, 32 * 4096))


def test_fence_flushes_lag(pair):
    s, r, src, dst = pair({"verify": "tail"}, {"inject": "lag", "inject_lag_max_ms": 30})
    res = s.transfer(r.endpoint, *descs(src, dst, 32, 4096))
    assert res.retries == 0, "the fence waited for the lagging writes"
    assert h(dst.bytes(0, 32 * 4096)) == h(src.bytes(0, 32 * 4096))


@pytest.mark.parametrize("mode", ["tail", "sample", "full", "digest"])
@pytest.mark.parametrize("fault", ["drop", "tear", "reorder", "stale"])
def test_no_mode_but_tail_under_stale_reports_wrong_bytes(guards, mode, fault):
    """Each mode under each fault at unit level: a success (transfer and,
    for the receiver, sync) always means the destination equals the source."""
    n, size = 16, 4096
    s = guards(verify=mode, max_retries=10, retry_sleep_s=0.001, on_mismatch="resend", max_resends=5)
    r = guards(inject=fault, inject_rate=0.3, inject_lag_max_ms=5, inject_seed=2)
    src, dst = Buf(n * size), Buf(n * size)
    s.register(src.addr, n * size)
    r.register(dst.addr, n * size)
    wrong = 0
    for _ in range(4):
        data = bytearray(__import__("os").urandom(n * size))
        if fault == "stale":
            for i in range(n):
                data[(i + 1) * size - 512:(i + 1) * size] = bytes(512)
        src.write(0, bytes(data))
        try:
            res = s.transfer(r.endpoint, *descs(src, dst, n, size))
            if mode == "digest":
                r.sync_transfers([res.id])
            else:
                r.sync(*descs(dst, dst, n, size)[1:])
        except MCGuardError as e:
            assert e.status == mcguard.MC_ERR_VERIFY, e
            time.sleep(0.01)
            continue
        wrong += sum(dst.bytes(i * size, size) != src.bytes(i * size, size) for i in range(n))
    if mode == "tail" and fault == "stale":
        assert wrong > 0, "tail's blind spot: a lost write whose tail already matched"
    else:
        assert wrong == 0


def test_sync_with_digests_from_the_application(pair):
    s, r, src, dst = pair({"verify": "digest", "notify": "never"})
    a, b, ln = descs(src, dst, 8, 4096)
    res = s.transfer(r.endpoint, a, b, ln, digests=True)
    assert len(res.digests) == 8
    r.sync(b, ln, digests=res.digests)
    dst.write(3 * 4096 + 5, b"\xff\x00")
    with pytest.raises(MCGuardError) as e:
        r.sync(b, ln, digests=res.digests)
    assert e.value.status == mcguard.MC_ERR_VERIFY
    assert "range 3" in e.value.message


def test_sync_transfers_by_notice(pair):
    s, r, src, dst = pair({"verify": "digest"})
    res = s.transfer(r.endpoint, *descs(src, dst, 8, 4096))
    r.sync_transfers([res.id])
    assert dst.bytes(0, 8 * 4096) == src.bytes(0, 8 * 4096)
    assert s.stats()["notices_sent"] == 1 and r.stats()["notices_received"] == 1


def test_sync_without_notice_times_out(guards):
    r = guards(sync_timeout_ms=100)
    start = time.monotonic()
    with pytest.raises(MCGuardError) as e:
        r.sync_transfers([424242])
    assert e.value.status == mcguard.MC_ERR_TIMEOUT
    assert time.monotonic() - start < 2


def test_per_call_mode_override(pair):
    s, r, src, dst = pair({"verify": "off"})
    probed = {}
    for mode in ("off", "tail", "sample", "full"):
        before = s.stats()["probed_bytes"]
        s.transfer(r.endpoint, *descs(src, dst, 4, 4096), verify=mode)
        probed[mode] = s.stats()["probed_bytes"] - before
    # tail: 64 B each; sample: head, tail and 4 stripes of 64 B, those that
    # overlap read once; full: all of it
    assert probed["off"] == 0 and probed["tail"] == 4 * 64 and probed["full"] == 4 * 4096
    assert 4 * (64 + 64 + 64) <= probed["sample"] <= 4 * (64 + 64 + 4 * 64)
    with pytest.raises(MCGuardError):
        s.transfer(r.endpoint, *descs(src, dst, 4, 4096), verify="maybe")


def test_off_under_lag_reports_success_for_missing_bytes(pair):
    """The regression check: without verification the lag's corruption shows."""
    s, r, src, dst = pair({"verify": "off"}, {"inject": "lag", "inject_lag_max_ms": 50})
    s.transfer(r.endpoint, *descs(src, dst, 32, 4096))
    assert dst.bytes(0, 32 * 4096) != src.bytes(0, 32 * 4096)


def test_verification_fails_when_bytes_never_arrive(pair):
    s, r, src, dst = pair({"max_retries": 3, "retry_sleep_s": 0.001},
                          {"inject": "drop", "inject_rate": 1})
    start = time.monotonic()
    with pytest.raises(MCGuardError) as e:
        s.transfer(r.endpoint, *descs(src, dst, 8, 1024))
    assert e.value.status == mcguard.MC_ERR_VERIFY
    # The TCP target's fence is final: no polling after it.
    assert "8 descriptor(s) differ at the target after a fence" in e.value.message
    assert time.monotonic() - start < 2
    assert s.stats()["verify_failures"] == 1


def test_chunking_above_512_descriptors(pair):
    n, size = 1300, 512
    s, r, src, dst = pair(size=n * size)
    s.transfer(r.endpoint, *descs(src, dst, n, size))
    assert h(dst.bytes()) == h(src.bytes())
    st = s.stats()
    assert st["max_batch"] == 512
    assert st["descriptors"] == n
    assert st["probed_bytes"] == n * 64


def test_chunking_with_small_max_batch_under_lag(pair):
    n, size = 700, 256
    s, r, src, dst = pair({"max_batch": 64}, {"inject": "lag", "inject_lag_max_ms": 5}, size=n * size)
    s.transfer(r.endpoint, *descs(src, dst, n, size))
    assert h(dst.bytes()) == h(src.bytes())


def test_batches_to_one_session_are_serialised(guards):
    """Two threads write whole-region patterns to one session at once; if
    batches interleaved the region would end up a mixture."""
    n, size = 64, 1024
    s, r = guards(verify="off"), guards()
    dst = Buf(n * size)
    r.register(dst.addr, n * size)
    srcs = [Buf(n * size, bytes([65 + i]) * (n * size)) for i in range(2)]
    for b in srcs:
        s.register(b.addr, n * size)
    for _ in range(20):
        errors = []

        def push(b):
            try:
                s.transfer(r.endpoint, *descs(b, dst, n, size))
            except Exception as e:  # pragma: no cover - reported below
                errors.append(e)

        threads = [threading.Thread(target=push, args=(b,)) for b in srcs]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert not errors
        data = dst.bytes()
        assert data in (srcs[0].bytes(), srcs[1].bytes()), "batches interleaved"


def test_concurrent_sessions_do_not_share_scratch(guards):
    """Sessions verifying at the same time (the vLLM guard's shared-scratch
    race) all succeed with the right bytes."""
    k, n, size = 4, 32, 8192
    s = guards()
    src = Buf(k * n * size, bytes(range(256)) * (k * n * size // 256))
    src.write(0, __import__("os").urandom(k * n * size))
    s.register(src.addr, k * n * size)
    recvs = [guards(inject="lag", inject_lag_max_ms=5) for _ in range(k)]
    dsts = [Buf(n * size) for _ in range(k)]
    for g, d in zip(recvs, dsts):
        g.register(d.addr, n * size)
    errors = []

    def push(i):
        try:
            for _ in range(5):
                s.transfer(recvs[i].endpoint, *descs(src, dsts[i], n, size, src_off=i * n * size))
        except Exception as e:  # pragma: no cover
            errors.append(e)

    threads = [threading.Thread(target=push, args=(i,)) for i in range(k)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors
    for i in range(k):
        assert h(dsts[i].bytes()) == h(src.bytes(i * n * size, n * size))
    assert s.stats()["sessions"] == k


def test_address_forms(pair):
    class Tensor:  # what torch tensors offer
        def __init__(self, p):
            self.p = p

        def data_ptr(self):
            return self.p

    s, r, src, dst = pair()
    a, b, ln = descs(src, dst, 4, 1024)
    s.transfer(r.endpoint, array.array("Q", a), tuple(b), array.array("Q", ln))
    s.transfer(r.endpoint, [Tensor(x) for x in a], [Tensor(x) for x in b], ln)
    s.transfer(r.endpoint, a[0], b[0], ln[0])
    assert dst.bytes(0, 4096) == src.bytes(0, 4096)
    with pytest.raises(MCGuardError) as e:
        s.transfer(r.endpoint, ["nope"], b[:1], ln[:1])
    assert e.value.status == mcguard.MC_ERR_INVALID_ARG


def test_a_list_of_many_values_is_checked_value_by_value():
    """Lists of several values take the quick conversion (array's C loop)
    only when every one is a plain int in [0, 2**64): a bool, a float, a
    value out of range or a string anywhere is refused, an object with
    __index__ or data_ptr goes the checked way, and nothing is wrapped."""
    from mcguard.guard import u64_array

    class Index:  # numpy integers
        def __init__(self, v):
            self.v = v

        def __index__(self):
            return self.v

    class Tensor:  # torch tensors: data_ptr, and __index__ for their value
        def data_ptr(self):
            return 0x7000

        def __index__(self):
            return 5

    buf, n, keep = u64_array([1, 2 ** 64 - 1, 0, 4096])
    assert n == 4 and list(buf) == [1, 2 ** 64 - 1, 0, 4096]
    buf, n, keep = u64_array((5, 6))
    assert n == 2 and list(buf) == [5, 6]
    buf, n, keep = u64_array([1, Index(7), 3])
    assert list(buf) == [1, 7, 3]
    buf, n, keep = u64_array([1, Tensor(), 3])
    assert list(buf) == [1, 0x7000, 3], "a tensor is its address, not its value"
    for bad in [2 ** 64, 2 ** 64 + 4096, -1, 16.9, True, False, "16", None, b"16"]:
        for values in ([4096, bad, 8192], (4096, bad)):
            with pytest.raises(MCGuardError) as e:
                u64_array(values)
            assert e.value.status == mcguard.MC_ERR_INVALID_ARG, bad


def test_read_back(pair):
    s, r, src, dst = pair()
    remote = Buf(8192, bytes(range(256)) * 32)
    r.register(remote.addr, 8192)
    before = src.bytes(4096, 904)
    s.read(r.endpoint, [src.addr, src.addr + 5000], [remote.addr + 1, remote.addr + 5000], [4096, 3000])
    assert src.bytes(0, 4096) == remote.bytes(1, 4096)
    assert src.bytes(5000, 3000) == remote.bytes(5000, 3000)
    assert src.bytes(4096, 904) == before, "bytes between the ranges are untouched"


def test_sync(pair):
    s, r, src, dst = pair()
    r.sync([dst.addr], [dst.size])
    r.sync()
    with pytest.raises(MCGuardError) as e:
        r.sync([dst.addr + dst.size - 10], [100])
    assert e.value.status == mcguard.MC_ERR_NOT_REGISTERED


def test_env_is_read_when_opened(monkeypatch, guards):
    """Variables set after the library loaded still count (the live C env)."""
    monkeypatch.setenv("VLLM_MOONCAKE_TRANSFER_VERIFY", "false")
    monkeypatch.setenv("VLLM_MOONCAKE_TRANSFER_VERIFY_MAX_RETRIES", "9")
    assert guards().stats()["verify"] == "off"
    assert guards(verify="tail").stats()["verify"] == "tail", "JSON wins over env"
    monkeypatch.setenv("MC_GUARD_TAIL_BYTES", "zero")
    with pytest.raises(MCGuardError) as e:
        guards()
    assert e.value.status == mcguard.MC_ERR_CONFIG
    assert "MC_GUARD_TAIL_BYTES" in e.value.message


def test_context_manager_closes():
    with mcguard.Guard() as g:
        assert g.port > 0
    with pytest.raises(MCGuardError) as e:
        g.stats()
    assert e.value.status == mcguard.MC_ERR_BAD_HANDLE
    g.close()  # idempotent from Python


def test_python_never_wraps_a_value_silently(guards):
    """ctypes would wrap 2**64 + 4096 to 4096, truncate 16.9 to 16 and take
    True as 1: each is refused with MC_ERR_INVALID_ARG before any call."""
    s, r = guards(), guards()
    src, dst = Buf(8192, b"x" * 8192), Buf(8192)
    s.register(src.addr, src.size)
    r.register(dst.addr, dst.size)
    bad_lengths = [2 ** 64 + 4096, -1, 16.9, "16", True, None, {"n": 16}, b"16"]
    for bad in bad_lengths:
        with pytest.raises(MCGuardError) as e:
            s.register(src.addr + 4096, bad)
        assert e.value.status == mcguard.MC_ERR_INVALID_ARG, bad
        with pytest.raises(MCGuardError) as e:
            s.transfer(r.endpoint, [src.addr], [dst.addr], [bad])
        assert e.value.status == mcguard.MC_ERR_INVALID_ARG, bad
        with pytest.raises(MCGuardError) as e:
            s.transfer(r.endpoint, [bad], [dst.addr], [16])
        assert e.value.status == mcguard.MC_ERR_INVALID_ARG, bad
    for bad in [None, b"127.0.0.1:1", 5, "127.0.0.1:1\0junk"]:
        with pytest.raises(MCGuardError) as e:
            s.transfer(bad, [src.addr], [dst.addr], [16])
        assert e.value.status == mcguard.MC_ERR_INVALID_ARG, bad
    for bad in ["16", {"a": 1}, None]:
        with pytest.raises(MCGuardError) as e:
            s.transfer(r.endpoint, bad, [dst.addr], [16])
        assert e.value.status == mcguard.MC_ERR_INVALID_ARG, bad
    assert dst.bytes() == b"\0" * 8192, "nothing was written by a refused call"
    s.close()
    with pytest.raises(MCGuardError) as e:
        s.transfer(r.endpoint, [src.addr], [dst.addr], [16])
    assert e.value.status == mcguard.MC_ERR_BAD_HANDLE and "closed" in e.value.message


def test_alloc_and_free(guards):
    """alloc gives zeroed registered memory, refuses what ctypes would wrap,
    and free takes back only what alloc gave, once."""
    g = guards()
    for bad in [0, -1, 2 ** 64, 2 ** 62, 16.9, True, None, "4096"]:
        with pytest.raises(MCGuardError) as e:
            g.alloc(bad)
        assert e.value.status == mcguard.MC_ERR_INVALID_ARG, bad
    addr = g.alloc(5000)
    assert addr % 4096 == 0 and ctypes.string_at(addr, 5000) == b"\0" * 5000
    for bad in [addr + 1, 4096]:
        with pytest.raises(MCGuardError) as e:
            g.free(bad)
        assert e.value.status == mcguard.MC_ERR_INVALID_ARG and "not an allocation" in e.value.message
    g.free(addr)
    with pytest.raises(MCGuardError) as e:
        g.free(addr)
    assert e.value.status == mcguard.MC_ERR_INVALID_ARG


def test_mooncake_adapter_refuses_bad_values_with_minus_one(caplog):
    from mcguard.mooncake import GuardedTransferEngine
    e = GuardedTransferEngine()
    assert e.register_memory(4096, 4096) == -1, "before initialize"
    assert "initialize() was not called" in caplog.text
    assert e.get_rpc_port() == -1
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    src = Buf(8192, b"y" * 8192)
    assert e.register_memory(src.addr, 2 ** 64 + 4096) < 0
    assert e.register_memory(src.addr, 16.9) < 0
    assert e.batch_transfer_sync_write(None, [src.addr], [src.addr], [8]) < 0
    assert e.batch_transfer_sync_write("127.0.0.1:1", [src.addr], [src.addr], [True]) < 0
    e.close()
    caplog.clear()
    assert e.register_memory(src.addr, 4096) == -1
    assert "closed" in caplog.text


HOLD = {"inject": "hold", "inject_rate": 1, "inject_lag_max_ms": 300}


def test_cancel_and_deadline_say_whether_bytes_may_still_land(pair):
    s, r, src, dst = pair({"verify": "off"}, HOLD, size=4096)
    timer = threading.Timer(0.05, s.cancel, args=(r.endpoint,))
    timer.start()
    with pytest.raises(MCGuardError) as e:
        s.transfer(r.endpoint, [src.addr], [dst.addr], [4096])
    timer.join()
    assert e.value.status == mcguard.MC_ERR_CANCELLED and e.value.abort == "confirmed"
    with pytest.raises(MCGuardError) as e:
        s.transfer(r.endpoint, [src.addr], [dst.addr], [4096], deadline_ms=50)
    assert e.value.status == mcguard.MC_ERR_TIMEOUT and e.value.abort == "confirmed"
    dst.write(0, b"\x5a" * 4096)
    time.sleep(0.4)
    assert dst.bytes() == b"\x5a" * 4096, "nothing of the aborted transfers landed"
    for bad in (-1, 1.5, True, None, 0.0, 1 << 64):  # never wrapped, truncated or taken as 0
        with pytest.raises(MCGuardError) as e:
            s.transfer(r.endpoint, [src.addr], [dst.addr], [4096], deadline_ms=bad)
        assert e.value.status == mcguard.MC_ERR_INVALID_ARG, bad


def test_quiesce(pair):
    s, r, src, dst = pair()
    s.transfer(r.endpoint, [src.addr], [dst.addr], [4096])
    r.quiesce([dst.addr], [4096])
    s.transfer(r.endpoint, [src.addr], [dst.addr], [4096])  # sent after: taken
    assert dst.bytes(0, 4096) == src.bytes(0, 4096)
    with pytest.raises(MCGuardError) as e:
        r.quiesce([dst.addr + (1 << 30)], [8])
    assert e.value.status == mcguard.MC_ERR_NOT_REGISTERED
    with pytest.raises(MCGuardError) as e:
        r.quiesce([dst.addr], [8, 8])
    assert e.value.status == mcguard.MC_ERR_INVALID_ARG
    assert r.stats()["quiesces"] == 1


def test_a_write_still_on_its_way_is_refused_after_a_quiesce(pair):
    s, r, src, dst = pair({"verify": "off"}, HOLD, size=4096)
    result = {}

    def send():
        try:
            s.transfer(r.endpoint, [src.addr], [dst.addr], [4096])
        except MCGuardError as e:
            result["error"] = e

    t = threading.Thread(target=send)
    t.start()
    time.sleep(0.05)  # the write is in the receiver's hands, held
    r.quiesce([dst.addr], [4096])
    dst.write(0, b"\x5a" * 4096)  # the next request's bytes
    t.join()
    e = result["error"]
    assert e.status == mcguard.MC_ERR_QUIESCED and e.abort == "confirmed"
    time.sleep(0.1)
    assert dst.bytes() == b"\x5a" * 4096


def test_messages_go_to_pythons_logging(guards, caplog):
    from models import nic_model_path
    caplog.set_level("DEBUG", logger="mcguard")
    guards(inject="lag")
    assert any("FAULT INJECTION ON" in r.message and r.levelname == "WARNING" for r in caplog.records)
    tcp_only = guards(transport="tcp")
    rdma = guards(transport="rdma", verbs_library=nic_model_path(), connect_timeout_ms=500)

    src = Buf(4096)
    rdma.register(src.addr, 4096)
    caplog.clear()
    with pytest.raises(MCGuardError):
        rdma.transfer(tcp_only.endpoint, [src.addr], [src.addr], [8])
    assert not [r for r in caplog.records if "refused a handshake" in r.message], "info is not shown by default"
    mcguard.set_log_level("info")
    try:
        with pytest.raises(MCGuardError):
            rdma.transfer(tcp_only.endpoint, [src.addr], [src.addr], [8])
        infos = [r for r in caplog.records if "refused a handshake" in r.message]
        assert infos and infos[0].levelname == "INFO" and 'does not serve transport "rdma"' in infos[0].message
    finally:
        mcguard.set_log_level("warn")
    with pytest.raises(MCGuardError) as e:
        mcguard.set_log_level("loud")
    assert e.value.status == mcguard.MC_ERR_INVALID_ARG
