"""Bad input on every export, called through ctypes as a C user would:
each returns a named status and a message, never a crash or a hang."""

import ctypes
import json

import pytest

import mcguard
from mcguard import _lib, abi
from conftest import Buf

L = _lib.lib()
U64P = ctypes.POINTER(ctypes.c_uint64)


def last_error(h):
    n = L.mc_guard_last_error(h, None, 0)
    buf = ctypes.create_string_buffer(n + 1)
    assert L.mc_guard_last_error(h, buf, len(buf)) == n
    return buf.value.decode()


def arr(*v):
    return ctypes.cast((ctypes.c_uint64 * len(v))(*v), U64P)


@pytest.fixture
def raw():
    """(sender handle, receiver endpoint, src, dst) opened through the raw ABI."""
    hs, hr = ctypes.c_uint64(), ctypes.c_uint64()
    assert L.mc_guard_open(b'{"connect_timeout_ms": 300, "timeout_ms": 500}', ctypes.byref(hs)) == 0
    assert L.mc_guard_open(None, ctypes.byref(hr)) == 0
    src, dst = Buf(4096, b"s" * 4096), Buf(4096)
    assert L.mc_guard_register(hs.value, src.addr, 4096) == 0
    assert L.mc_guard_register(hr.value, dst.addr, 4096) == 0
    ep = ctypes.create_string_buffer(64)
    assert L.mc_guard_endpoint(hr.value, ep, 64) == 0
    yield hs.value, ep.value, src, dst
    L.mc_guard_close(hs.value)
    L.mc_guard_close(hr.value)


def test_version():
    assert L.mc_guard_version() == b"0.3.3" == mcguard.version().encode()


def test_open_errors():
    h = ctypes.c_uint64()
    assert L.mc_guard_open(b"{}", None) == mcguard.MC_ERR_INVALID_ARG
    assert "out is NULL" in last_error(0)
    for cfg, want in [(b"{", "one object"), (b'{"verify": "sometimes"}', "verify"),
                      (b'{"max_batch": 0}', "max_batch"), (b'{"listen": "nohost"}', "listen"),
                      (b'{"what": 1}', 'unknown config key "what"'),
                      (b'{"listen": "256.1.1.1:0", "allow_insecure": true}', "cannot listen"),
                      (b'{"listen": "0.0.0.0:0"}', "no secret"),
                      (b'{"secret": "short"}', "at least 16 bytes")]:
        assert L.mc_guard_open(cfg, ctypes.byref(h)) == mcguard.MC_ERR_CONFIG, cfg
        assert want in last_error(0), cfg


@pytest.mark.parametrize("handle", [0, 999999, 2**64 - 1])
def test_bogus_handles(handle):
    one = arr(1)
    buf = ctypes.create_string_buffer(64)
    calls = [
        lambda: L.mc_guard_close(handle),
        lambda: L.mc_guard_register(handle, 4096, 10),
        lambda: L.mc_guard_unregister(handle, 4096),
        lambda: L.mc_guard_alloc(handle, 4096, ctypes.byref(ctypes.c_void_p())),
        lambda: L.mc_guard_free(handle, 4096),
        lambda: L.mc_guard_transfer(handle, b"127.0.0.1:1", one, one, one, 1, None),
        lambda: L.mc_guard_read(handle, b"127.0.0.1:1", one, one, one, 1),
        lambda: L.mc_guard_sync(handle, one, one, 1, None),
        lambda: L.mc_guard_endpoint(handle, buf, 64),
        lambda: L.mc_guard_stats(handle, buf, 64, None),
    ]
    for call in calls:
        assert call() == mcguard.MC_ERR_BAD_HANDLE
        assert "not a guard handle" in last_error(handle)


def test_closed_handle():
    h = ctypes.c_uint64()
    assert L.mc_guard_open(None, ctypes.byref(h)) == 0
    assert L.mc_guard_close(h.value) == 0
    assert L.mc_guard_close(h.value) == mcguard.MC_ERR_BAD_HANDLE
    assert "is closed" in last_error(h.value)
    assert L.mc_guard_stats(h.value, ctypes.create_string_buffer(64), 64, None) == mcguard.MC_ERR_BAD_HANDLE


def test_transfer_bad_arguments(raw):
    h, ep, src, dst = raw
    s, d, n1 = arr(src.addr), arr(dst.addr), arr(64)
    cases = [
        ((h, None, s, d, n1, 1, None), mcguard.MC_ERR_INVALID_ARG, "session is NULL"),
        ((h, ep, None, d, n1, 1, None), mcguard.MC_ERR_INVALID_ARG, "must not be NULL"),
        ((h, ep, s, None, n1, 1, None), mcguard.MC_ERR_INVALID_ARG, "must not be NULL"),
        ((h, ep, s, d, None, 1, None), mcguard.MC_ERR_INVALID_ARG, "must not be NULL"),
        ((h, ep, s, d, n1, 0, None), mcguard.MC_ERR_INVALID_ARG, "n is 0"),
        ((h, ep, s, d, n1, 2**40, None), mcguard.MC_ERR_INVALID_ARG, "MC_GUARD_MAX_DESCRIPTORS"),
        ((h, ep, s, d, n1, 2**64 - 1, None), mcguard.MC_ERR_INVALID_ARG, "MC_GUARD_MAX_DESCRIPTORS"),
        ((h, ep, s, d, arr(0), 1, None), mcguard.MC_ERR_INVALID_ARG, "length 0"),
        ((h, ep, arr(src.addr + 4096), d, n1, 1, None), mcguard.MC_ERR_NOT_REGISTERED, "descriptor 0 local side"),
        ((h, ep, s, arr(dst.addr + 4090), n1, 1, None), mcguard.MC_ERR_NOT_REGISTERED, "descriptor 0 remote side"),
        ((h, ep, s, d, arr(2**64 - 1), 1, None), mcguard.MC_ERR_NOT_REGISTERED, "local side"),
        ((h, b"not-a-session", s, d, n1, 1, None), mcguard.MC_ERR_INVALID_ARG, "host:port"),
        ((h, b"127.0.0.1:0", s, d, n1, 1, None), mcguard.MC_ERR_INVALID_ARG, "host:port"),
    ]
    for args, status, text in cases:
        assert L.mc_guard_transfer(*args) == status, text
        assert text in last_error(h), (text, last_error(h))
    bad = abi.TransferOpts(struct_size=4)
    assert L.mc_guard_transfer(h, ep, s, d, n1, 1, ctypes.byref(bad)) == mcguard.MC_ERR_INVALID_ARG
    assert "struct_size" in last_error(h)
    bad = abi.TransferOpts(struct_size=ctypes.sizeof(abi.TransferOpts), verify=42)
    assert L.mc_guard_transfer(h, ep, s, d, n1, 1, ctypes.byref(bad)) == mcguard.MC_ERR_INVALID_ARG
    assert "MC_VERIFY" in last_error(h)
    # Nothing was written by any refusal; a good call still works.
    assert dst.bytes() == b"\0" * 4096
    ok = abi.TransferOpts(struct_size=ctypes.sizeof(abi.TransferOpts), verify=1)
    assert L.mc_guard_transfer(h, ep, s, d, n1, 1, ctypes.byref(ok)) == 0
    assert ok.transfer_id > 0
    assert dst.bytes(0, 64) == b"s" * 64 and dst.bytes(64) == b"\0" * 4032


def test_refused_session_fails_at_once_and_a_silent_one_times_out(raw):
    import socket
    import time
    h, ep, src, dst = raw
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    start = time.monotonic()
    st = L.mc_guard_transfer(h, b"127.0.0.1:%d" % port, arr(src.addr), arr(dst.addr), arr(8), 1, None)
    assert st == mcguard.MC_ERR_PEER and "connection refused" in last_error(h)
    assert time.monotonic() - start < 0.5, "refused is said at once"
    sock.listen(1)  # something listens there, but it is no guard
    st = L.mc_guard_transfer(h, b"127.0.0.1:%d" % port, arr(src.addr), arr(dst.addr), arr(8), 1, None)
    assert st == mcguard.MC_ERR_TIMEOUT
    assert "did not answer the handshake" in last_error(h)
    sock.close()


def test_register_errors(raw):
    h, ep, src, dst = raw
    assert L.mc_guard_register(h, None, 10) == mcguard.MC_ERR_INVALID_ARG
    assert L.mc_guard_register(h, src.addr, 0) == mcguard.MC_ERR_INVALID_ARG
    assert L.mc_guard_register(h, src.addr + 10, 10) == mcguard.MC_ERR_INVALID_ARG
    assert "overlaps" in last_error(h)
    assert L.mc_guard_register(h, 2**64 - 16, 32) == mcguard.MC_ERR_INVALID_ARG
    assert L.mc_guard_unregister(h, src.addr + 1) == mcguard.MC_ERR_NOT_REGISTERED
    assert L.mc_guard_unregister(h, src.addr) == 0
    assert L.mc_guard_unregister(h, src.addr) == mcguard.MC_ERR_NOT_REGISTERED


def test_sync_errors(raw):
    h, ep, src, dst = raw
    assert L.mc_guard_sync(h, None, None, 0, None) == 0
    assert L.mc_guard_sync(h, None, arr(1), 1, None) == mcguard.MC_ERR_INVALID_ARG
    assert L.mc_guard_sync(h, arr(src.addr), arr(1), 2**63, None) == mcguard.MC_ERR_INVALID_ARG
    assert L.mc_guard_sync(h, arr(src.addr), arr(4097), 1, None) == mcguard.MC_ERR_NOT_REGISTERED
    bad = abi.SyncOpts(1, 0, 0)
    assert L.mc_guard_sync(h, arr(src.addr), arr(1), 1, ctypes.byref(bad)) == mcguard.MC_ERR_INVALID_ARG


def test_sync_transfers_errors(raw):
    h, ep, src, dst = raw
    assert L.mc_guard_sync_transfers(h, None, 1, None) == mcguard.MC_ERR_INVALID_ARG
    assert L.mc_guard_sync_transfers(h, arr(1), 0, None) == mcguard.MC_ERR_INVALID_ARG
    assert L.mc_guard_sync_transfers(h, arr(1), 2**40, None) == mcguard.MC_ERR_INVALID_ARG
    assert L.mc_guard_sync_transfers(h, arr(1), 1, ctypes.byref(abi.SyncOpts(2, 0, 0))) == mcguard.MC_ERR_INVALID_ARG
    assert L.mc_guard_sync_transfers(424242, arr(1), 1, None) == mcguard.MC_ERR_BAD_HANDLE


def test_read_errors(raw):
    h, ep, src, dst = raw
    assert L.mc_guard_read(h, ep, None, arr(1), arr(1), 1) == mcguard.MC_ERR_INVALID_ARG
    assert L.mc_guard_read(h, ep, arr(src.addr), arr(dst.addr), arr(1), 0) == mcguard.MC_ERR_INVALID_ARG
    assert L.mc_guard_read(h, ep, arr(src.addr), arr(dst.addr + 8192), arr(1), 1) == mcguard.MC_ERR_NOT_REGISTERED


def test_output_buffers(raw):
    h, ep, src, dst = raw
    small = ctypes.create_string_buffer(4)
    assert L.mc_guard_endpoint(h, small, 4) == mcguard.MC_ERR_BUFFER_TOO_SMALL
    assert L.mc_guard_endpoint(h, None, 0) == mcguard.MC_ERR_INVALID_ARG
    needed = ctypes.c_size_t()
    assert L.mc_guard_stats(h, small, 4, ctypes.byref(needed)) == mcguard.MC_ERR_BUFFER_TOO_SMALL
    assert needed.value > 4
    big = ctypes.create_string_buffer(needed.value + 1)
    assert L.mc_guard_stats(h, big, len(big), None) == 0
    assert json.loads(big.value)["regions"] == 1
    # last_error truncates and always NUL-terminates.
    msg = last_error(h)
    assert len(msg) > 8
    tiny = ctypes.create_string_buffer(b"\xff" * 8, 8)
    assert L.mc_guard_last_error(h, tiny, 8) == len(msg)
    assert tiny.raw == msg[:7].encode() + b"\0"
    assert L.mc_guard_last_error(h, tiny, 0) == len(msg)


def test_library_links_neither_cuda_nor_verbs():
    import shutil
    import subprocess
    if not shutil.which("ldd"):
        pytest.skip("needs ldd")
    out = subprocess.run(["ldd", _lib.library_path()], stdout=subprocess.PIPE, text=True).stdout
    for name in ("libcuda", "libcudart", "libibverbs"):
        assert name not in out, out
    exported = subprocess.run(["nm", "-D", "--defined-only", _lib.library_path()], stdout=subprocess.PIPE,
                              text=True).stdout.split()
    names = [w for w in exported if w.startswith("mc_")]
    assert {"mc_guard_open", "mc_guard_transfer", "mc_guard_sync"} <= set(names)
    assert all(w.startswith("mc_guard_") for w in names)
