import ctypes
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import mcguard  # noqa: E402
import models  # noqa: E402

# What make exports, for a pytest run without it: the package for child
# processes, and the software models the tools run on.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (os.path.abspath(os.path.join(os.path.dirname(__file__), "..")), os.environ.get("PYTHONPATH")) if p)
for _var, _find in (("MCGUARD_NIC_MODEL", models.nic_model_path), ("MCGUARD_CUDA_MODEL", models.cuda_model_path)):
    if not os.environ.get(_var):
        try:
            os.environ[_var] = _find()
        except FileNotFoundError:
            pass


# Buffers stay alive until the guards that registered them are closed:
# registered memory must outlive its registration (a lagging target may
# still write into it until close).
_alive = []


class Buf:
    """A ctypes buffer with its address, as a KV region would be."""

    def __init__(self, size, fill=None):
        _alive.append(self)
        self.raw = ctypes.create_string_buffer(size)
        self.addr = ctypes.addressof(self.raw)
        self.size = size
        if fill is not None:
            ctypes.memmove(self.addr, fill, size)

    def bytes(self, off=0, n=None):
        return ctypes.string_at(self.addr + off, self.size - off if n is None else n)

    def write(self, off, data):
        ctypes.memmove(self.addr + off, data, len(data))


@pytest.fixture
def guards():
    opened = []

    def make(**cfg):
        g = mcguard.Guard(**cfg)
        opened.append(g)
        return g

    yield make
    for g in opened:
        g.close()
    _alive.clear()


@pytest.fixture
def pair(guards):
    """(sender, receiver, src, dst) with 1 MiB registered on each side."""
    def make(send_cfg=None, recv_cfg=None, size=1 << 20):
        s, r = guards(**(send_cfg or {})), guards(**(recv_cfg or {}))
        src, dst = Buf(size, os.urandom(size)), Buf(size)
        s.register(src.addr, size)
        r.register(dst.addr, size)
        return s, r, src, dst
    return make
