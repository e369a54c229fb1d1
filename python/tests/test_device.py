"""GPU memory through the software model of the CUDA driver: the real
loader and staging code run against it. Real-GPU checks live in
scripts/device-check.sh, which needs an NVIDIA machine."""

import ctypes
import hashlib
import multiprocessing as mp
import os

import pytest

import mcguard
import models
from mcguard import MCGuardError
from mcguard.tools.devicecheck import serve_pipe

def model_path():
    return models.cuda_model_path()


class Model:
    """The model library as a program allocating GPU memory would use it."""

    def __init__(self, path):
        self.lib = ctypes.CDLL(path)
        self.lib.cuInit(0)
        self.lib.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]

    def alloc(self, n):
        p = ctypes.c_uint64()
        assert self.lib.cuMemAlloc_v2(ctypes.byref(p), n) == 0
        return p.value


class FakeCudaTensor:
    """What the binding reads of a torch CUDA tensor."""
    is_cuda = True

    def __init__(self, ptr, n):
        self.ptr, self.n = ptr, n

    def data_ptr(self):
        return self.ptr

    def numel(self):
        return self.n

    def element_size(self):
        return 1


def receiver_main(conn, path, size, transport, env=None):
    os.environ.update(env or {})
    model = Model(path)
    g = mcguard.Guard(cuda="required", cuda_library=path, **transport)
    dev = model.alloc(size)
    g.register(FakeCudaTensor(dev, size))
    conn.send((g.endpoint, dev))

    def check(transfer_id):
        try:
            g.sync_transfers([transfer_id], stream=0)
        except MCGuardError as e:
            return e.name
        return hashlib.sha1(ctypes.string_at(dev, size)).hexdigest()
    serve_pipe(conn, g, check)
    g.close()


def transport_settings(name):
    if name == "rdma-model":  # GPU memory registered as dmabufs on the software NIC
        from models import nic_model_path
        return {"transport": "rdma", "verbs_library": nic_model_path()}
    return {"transport": "tcp"}


# off over RDMA is the unguarded baseline: a WRITE's completion is not its
# arrival, so not even the receiver's flush makes it safe (over TCP the
# target acknowledges after its own device copy).
@pytest.mark.parametrize("mode,transport", [("off", "tcp"), ("tail", "tcp"), ("digest", "tcp"),
                                            ("tail", "rdma-model"), ("digest", "rdma-model")])
def test_gpu_to_gpu_across_processes(mode, transport):
    path, size = model_path(), 1 << 20
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    p = ctx.Process(target=receiver_main, args=(there, path, size, transport_settings(transport)), daemon=True)
    p.start()
    try:
        assert here.poll(30)
        endpoint, remote = here.recv()
        model = Model(path)
        with mcguard.Guard(cuda="required", cuda_library=path, verify=mode, notify="always",
                           **transport_settings(transport)) as g:
            src = model.alloc(size)
            data = os.urandom(size)
            ctypes.memmove(src, data, size)  # model GPU memory is host memory underneath
            g.register(FakeCudaTensor(src, size))
            assert g.stats()["cuda"].startswith("driver ")
            assert g.stats()["transport"] == transport_settings(transport)["transport"]
            n = 64
            res = g.transfer(endpoint, [src + i * (size // n) for i in range(n)],
                             [remote + i * (size // n) for i in range(n)], [size // n] * n)
            here.send(res.id)
            assert here.recv() == hashlib.sha1(data).hexdigest(), "hashed on the receiver after its sync"
    finally:
        here.send("stop")
        p.join(10)


class Receiver:
    """A receiving process with GPU memory the test can hash and query."""

    def __init__(self, size, env=None, **settings):
        ctx = mp.get_context("spawn")
        self.pipe, there = ctx.Pipe()
        self.proc = ctx.Process(target=receiver_main, args=(there, model_path(), size, settings, env), daemon=True)
        self.proc.start()
        assert self.pipe.poll(30)
        self.endpoint, self.dev = self.pipe.recv()

    def sync_hash(self, transfer_id):
        self.pipe.send(transfer_id)
        return self.pipe.recv()

    def stats(self):
        self.pipe.send("stats")
        return self.pipe.recv()

    def close(self):
        self.pipe.send("stop")
        self.proc.join(10)


def gpu_transfer(g, model, rx, size, n=16):
    """Random bytes in new GPU memory written to rx's GPU memory: their sha1."""
    src = model.alloc(size)
    data = os.urandom(size)
    ctypes.memmove(src, data, size)
    g.register(FakeCudaTensor(src, size))
    res = g.transfer(rx.endpoint, [src + i * (size // n) for i in range(n)],
                     [rx.dev + i * (size // n) for i in range(n)], [size // n] * n)
    return res, hashlib.sha1(data).hexdigest()


# Same host, two processes, GPU memory on both sides: the receiver opens
# the sender's allocation by CUDA IPC and copies device to device; with
# same_host off the bytes are staged through the socket.
@pytest.mark.parametrize("same_host,via_ipc", [("auto", True), ("off", False)])
@pytest.mark.parametrize("mode", ["off", "tail", "digest"])
def test_gpu_same_host_by_cuda_ipc(mode, same_host, via_ipc):
    size = 1 << 20
    rx = Receiver(size, transport="tcp", same_host=same_host)
    try:
        model = Model(model_path())
        with mcguard.Guard(cuda="required", cuda_library=model_path(), verify=mode, notify="always",
                           transport="tcp", same_host=same_host) as g:
            for _ in range(2):
                res, want = gpu_transfer(g, model, rx, size)
                assert rx.sync_hash(res.id) == want, "hashed on the receiver after its sync"
        assert rx.stats()["same_host_ipc_bytes"] == (2 * size if via_ipc else 0)
    finally:
        rx.close()


@pytest.mark.parametrize("mode", ["off", "tail", "digest"])
def test_vmm_gpu_memory_goes_by_its_file_descriptor(mode, monkeypatch):
    """VMM memory created shareable as a file descriptor (PyTorch's expandable
    segments, vLLM's sleep-mode allocator) has no legacy IPC handle: the
    receiver takes the sender's descriptor with pidfd_getfd, imports, maps
    and grants itself access, and copies device to device."""
    monkeypatch.setenv("MCG_MODEL_VMM", "1")  # both processes' device memory
    size = 1 << 20
    rx = Receiver(size, env={"MCG_MODEL_VMM": "1"}, transport="tcp")
    try:
        model = Model(model_path())
        with mcguard.Guard(cuda="required", cuda_library=model_path(), verify=mode, notify="always",
                           transport="tcp") as g:
            for _ in range(2):
                res, want = gpu_transfer(g, model, rx, size)
                assert rx.sync_hash(res.id) == want, "hashed on the receiver after its sync"
        assert rx.stats()["same_host_ipc_bytes"] == 2 * size
    finally:
        rx.close()


def test_gpu_memory_without_an_ipc_handle_is_staged(monkeypatch):
    """Memory with no legacy IPC handle and no shareable one (VMM memory
    created without requestedHandleTypes) goes through the socket, and the
    transfer still succeeds."""
    monkeypatch.setenv("MCG_MODEL_NO_LEGACY_IPC", "1")
    size = 1 << 20
    rx = Receiver(size, transport="tcp")
    try:
        model = Model(model_path())
        with mcguard.Guard(cuda="required", cuda_library=model_path(), verify="tail", notify="always", transport="tcp") as g:
            res, want = gpu_transfer(g, model, rx, size)
            assert rx.sync_hash(res.id) == want
        st = rx.stats()
        assert st["same_host_ipc_bytes"] == 0 and st["same_host_pulled_bytes"] == 0
    finally:
        rx.close()


def test_a_receiver_that_cannot_open_the_handle_fails_clearly_then_stages():
    size = 1 << 20
    rx = Receiver(size, env={"MCG_MODEL_IPC_OPEN_FAILS": "1"}, transport="tcp")
    try:
        model = Model(model_path())
        with mcguard.Guard(cuda="required", cuda_library=model_path(), verify="tail", notify="always", transport="tcp") as g:
            with pytest.raises(MCGuardError) as e:
                gpu_transfer(g, model, rx, size)
            assert "CUDA IPC handle" in str(e.value) and "stage GPU bytes" in str(e.value)
            res, want = gpu_transfer(g, model, rx, size)
            assert rx.sync_hash(res.id) == want, "the retry went through the socket"
        assert rx.stats()["same_host_ipc_bytes"] == 0
    finally:
        rx.close()


def test_cuda_tensor_without_a_driver_is_a_clear_error():
    with mcguard.Guard(cuda_library="/nonexistent/libcuda.so.1") as g:
        assert g.stats()["cuda"].startswith("unavailable: ")
        with pytest.raises(MCGuardError) as e:
            g.register(FakeCudaTensor(0x7000000000, 4096))
        assert e.value.status == mcguard.MC_ERR_DEVICE
        assert "CUDA is unavailable" in e.value.message
    with pytest.raises(MCGuardError) as e:
        mcguard.Guard(cuda="required", cuda_library="/nonexistent/libcuda.so.1")
    assert e.value.status == mcguard.MC_ERR_DEVICE


def test_sync_with_a_stream_object_makes_gpudirect_writes_visible():
    path = model_path()
    model = Model(path)
    lib = model.lib
    # The application's own stream, as torch.cuda.current_stream() would be.
    ctx, stream = ctypes.c_void_p(), ctypes.c_void_p()
    assert lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
    assert lib.cuCtxSetCurrent(ctx) == 0
    assert lib.cuStreamCreate(ctypes.byref(stream), 1) == 0

    class Stream:
        cuda_stream = stream.value

    lib.mcgModelDeferredWrite.argtypes = [ctypes.c_uint64, ctypes.c_char_p, ctypes.c_size_t]
    with mcguard.Guard(cuda="required", cuda_library=path) as g:
        dev = model.alloc(4096)
        g.register(FakeCudaTensor(dev, 4096))
        data = os.urandom(4096)
        assert lib.mcgModelDeferredWrite(dev, data, 4096) == 0  # a NIC's write, not yet visible
        assert ctypes.string_at(dev, 4096) != data
        g.sync([dev], [4096], stream=Stream())
        assert ctypes.string_at(dev, 4096) == data, "sync flushed it and synchronised the stream"
