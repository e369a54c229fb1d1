"""mcguard._fastcall: mc_guard_transfer and mc_guard_sync_transfers
without ctypes for plain lists of ints. It must move the same bytes as the ctypes path, hand everything
else to that path (which says what is wrong), and report failures with
the same status, message and abort state."""

import array
import ctypes
import hashlib
import os
import sysconfig

import pytest

import mcguard
from mcguard import MCGuardError, guard as guard_module
from conftest import Buf

HAVE_HEADERS = os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))


def sha(b):
    return hashlib.sha1(b).hexdigest()


def test_the_extension_is_built_where_python_headers_are():
    if not HAVE_HEADERS:
        pytest.skip("no Python.h here: make build cannot build _fastcall, ctypes serves alone")
    assert guard_module._fast_transfer is not None, "make build builds python/mcguard/_fastcall"


@pytest.fixture
def fast_pair(pair):
    if guard_module._fast_transfer is None:
        pytest.skip("_fastcall is not built here")
    s, r, src, dst = pair({"verify": "tail"})
    assert s._fast_entry, "a guard not over an engine takes the fast path"
    return s, r, src, dst


@pytest.mark.parametrize("n", [1, 16, 17, 600])  # on the stack, just past it, malloc'd and chunked
def test_fast_and_ctypes_paths_move_the_same_bytes(fast_pair, n):
    s, r, src, dst = fast_pair
    size = (1 << 20) // 1024
    srcs = [src.addr + i * size for i in range(n)]
    dsts = [dst.addr + (n - 1 - i) * size for i in range(n)]  # reversed: each block's place matters
    fast = s.transfer(r.endpoint, srcs, dsts, [size] * n)
    got = [dst.bytes(d - dst.addr, size) for d in dsts]
    assert [sha(b) for b in got] == [sha(src.bytes(a - src.addr, size)) for a in srcs]
    assert fast.id > 0 and fast.digests is None

    ctypes.memset(dst.addr, 0, dst.size)
    entry, s._fast_entry = s._fast_entry, 0
    try:
        slow = s.transfer(r.endpoint, srcs, dsts, [size] * n)
    finally:
        s._fast_entry = entry
    assert slow.id not in (0, fast.id), "a transfer of its own"
    assert [sha(dst.bytes(d - dst.addr, size)) for d in dsts] == [sha(b) for b in got]


def test_what_is_not_plain_goes_the_checked_way(fast_pair):
    """Each of these makes _fastcall return None; the ctypes path then
    takes or refuses it, never a wrapped or truncated value."""
    s, r, src, dst = fast_pair
    fast = guard_module._fast_transfer
    e, h = s._fast_entry, s._handle
    for args in [
        (e, h, r.endpoint, [src.addr], [dst.addr], [True], 1, 0),       # a bool
        (e, h, r.endpoint, [src.addr], [dst.addr], [-1], 1, 0),         # negative
        (e, h, r.endpoint, [src.addr], [dst.addr], [2 ** 64], 1, 0),    # too large
        (e, h, r.endpoint, [src.addr], [dst.addr], [16.0], 1, 0),       # a float
        (e, h, r.endpoint, (src.addr,), [dst.addr], [16], 1, 0),        # a tuple
        (e, h, r.endpoint, [src.addr], [dst.addr, dst.addr], [16], 1, 0),
        (e, h, r.endpoint, [], [], [], 1, 0),
        (e, h, r.endpoint + "\0x", [src.addr], [dst.addr], [16], 1, 0),
        (e, h, b"127.0.0.1:1", [src.addr], [dst.addr], [16], 1, 0),
        (0, h, r.endpoint, [src.addr], [dst.addr], [16], 1, 0),         # no entry point
        (e, h, r.endpoint, [src.addr], [dst.addr], [16]),               # too few arguments
    ]:
        assert fast(*args) is None, args
    assert dst.bytes() == b"\0" * dst.size, "none of them called the library"

    ok = s.transfer(r.endpoint, array.array("Q", [src.addr]), [dst.addr], [4096])  # checked, and taken
    assert ok.id > 0 and dst.bytes(0, 4096) == src.bytes(0, 4096)


def test_failures_carry_status_message_and_abort(fast_pair, guards):
    s, r, src, dst = fast_pair
    with pytest.raises(MCGuardError) as e:
        s.transfer(r.endpoint, [src.addr], [dst.addr + dst.size], [4096])  # beyond the receiver's region
    assert e.value.status == mcguard.MC_ERR_NOT_REGISTERED
    assert "descriptor 0" in e.value.message
    with pytest.raises(MCGuardError) as e:
        s.transfer(r.endpoint, [src.addr], [dst.addr], [0])
    assert e.value.status == mcguard.MC_ERR_INVALID_ARG and e.value.message

    gone = guards()
    endpoint = gone.endpoint
    gone.close()
    with pytest.raises(MCGuardError) as e:
        s.transfer(endpoint, [src.addr], [dst.addr], [4096], deadline_ms=0)
    assert e.value.status in (mcguard.MC_ERR_SESSION, mcguard.MC_ERR_PEER, mcguard.MC_ERR_TIMEOUT)
    assert e.value.abort in (None, "confirmed", "unconfirmed")


def test_off_by_environment(monkeypatch, guards):
    monkeypatch.setenv("MCGUARD_NO_FASTCALL", "1")
    g = guards()
    assert g._fast_entry == 0 and g._fast_sync_entry == 0



@pytest.fixture
def digest_pair(pair):
    if guard_module._fast_sync_transfers is None:
        pytest.skip("_fastcall is not built here")
    s, r, src, dst = pair({"verify": "digest"}, {"sync_timeout_ms": 200})
    assert r._fast_sync_entry, "a guard not over an engine syncs by the fast path"
    return s, r, src, dst


def test_fast_and_ctypes_syncs_settle_the_same(digest_pair):
    s, r, src, dst = digest_pair
    for fast in (True, False):
        entry = r._fast_sync_entry
        if not fast:
            r._fast_sync_entry = 0
        try:
            ids = [s.transfer(r.endpoint, [src.addr + i * 4096], [dst.addr + i * 4096], [4096]).id for i in range(20)]
            r.sync_transfers(ids)  # 20: past the ids kept on the stack
            r.sync_transfers([s.transfer(r.endpoint, [src.addr], [dst.addr], [4096]).id], stream=0)
        finally:
            r._fast_sync_entry = entry
        assert dst.bytes(0, 20 * 4096) == src.bytes(0, 20 * 4096)
        assert r.stats()["sync_failures"] == 0


def test_what_is_not_plain_syncs_the_checked_way(digest_pair):
    """Each of these makes the fast sync return None, without calling the
    library (the notice stays to be synced); the ctypes path then takes or
    refuses it."""
    s, r, src, dst = digest_pair
    fast = guard_module._fast_sync_transfers
    e, h = r._fast_sync_entry, r._handle
    tid = s.transfer(r.endpoint, [src.addr], [dst.addr], [4096]).id
    for args in [
        (e, h, [True], 0),          # a bool
        (e, h, [-1], 0),            # negative
        (e, h, [2 ** 64], 0),       # too large
        (e, h, [float(tid)], 0),    # a float
        (e, h, (tid,), 0),          # a tuple
        (e, h, [], 0),
        (e, h, [tid], -1),          # a negative stream
        (e, h, [tid], 2 ** 64),
        (e, h, [tid], True),
        (0, h, [tid], 0),           # no entry point
        (e, h, [tid]),              # too few arguments
    ]:
        assert fast(*args) is None, args
    assert r.stats()["syncs"] == 0, "none of them called the library"

    for bad, status in [((tid,), None), ([tid], mcguard.MC_ERR_TIMEOUT), ([True], mcguard.MC_ERR_INVALID_ARG),
                        ([-1], mcguard.MC_ERR_INVALID_ARG), ([], mcguard.MC_ERR_INVALID_ARG)]:
        if status is None:
            r.sync_transfers(bad)  # a tuple: checked, and taken (the notice is consumed)
            continue
        with pytest.raises(MCGuardError) as err:  # the same id again: its notice was consumed
            r.sync_transfers(bad)
        assert err.value.status == status and err.value.message, bad
    with pytest.raises(MCGuardError) as err:
        r.sync_transfers([tid], stream=-1)
    assert err.value.status == mcguard.MC_ERR_INVALID_ARG


def test_fast_sync_failures_carry_status_and_message(digest_pair):
    s, r, src, dst = digest_pair
    with pytest.raises(MCGuardError) as err:
        r.sync_transfers([12345])  # no such transfer: no notice comes
    assert err.value.status == mcguard.MC_ERR_TIMEOUT
    assert err.value.message


def test_a_module_built_before_the_fast_sync_leaves_sync_to_ctypes(monkeypatch, pair):
    """An older _fastcall (transfer only) still serves transfers; syncs
    then take ctypes."""
    monkeypatch.setattr(guard_module, "_fast_sync_transfers", None)
    s, r, src, dst = pair({"verify": "digest"})
    assert r._fast_sync_entry == 0
    r.sync_transfers([s.transfer(r.endpoint, [src.addr], [dst.addr], [4096]).id])
    assert dst.bytes(0, 4096) == src.bytes(0, 4096)
