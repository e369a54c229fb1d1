"""Just enough of torch for mcguard.tools.devicecheck on the CUDA driver model:
2-D uint8 "CUDA" tensors in the model's device memory (host memory
underneath), seeded random blocks, copies and row comparisons. It lets
the device check run here before it runs on a GPU; it is not torch."""

import ctypes
import os
import random

__version__ = "fake (mcguard tests)"
uint8 = "uint8"

_lib = ctypes.CDLL(os.environ["MCGUARD_CUDA_MODEL"])
_lib.cuInit(0)
_lib.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]


def _alloc(n):
    p = ctypes.c_uint64()
    if _lib.cuMemAlloc_v2(ctypes.byref(p), n) != 0:
        raise RuntimeError("cuMemAlloc failed")
    return p.value


class Tensor:
    is_cuda = True

    def __init__(self, ptr, rows, cols):
        self.ptr, self.rows, self.cols = ptr, rows, cols

    def data_ptr(self):
        return self.ptr

    def numel(self):
        return self.rows * self.cols

    def element_size(self):
        return 1

    def bytes(self):
        return ctypes.string_at(self.ptr, self.numel())

    def __getitem__(self, i):
        if isinstance(i, slice):
            start, stop, _ = i.indices(self.rows)
            return Tensor(self.ptr + start * self.cols, stop - start, self.cols)
        return Tensor(self.ptr + i * self.cols, 1, self.cols)

    def copy_(self, other):
        ctypes.memmove(self.ptr, other.ptr, self.numel())
        return self

    def __ne__(self, other):
        a, b = self.bytes(), other.bytes()
        return _Rows([a[r * self.cols:(r + 1) * self.cols] != b[r * self.cols:(r + 1) * self.cols]
                      for r in range(self.rows)])


class _Rows:
    """A per-row comparison: .any(dim=1).sum().item() counts rows that differ."""

    def __init__(self, differs):
        self.differs = differs

    def any(self, dim):
        assert dim == 1
        return self

    def sum(self):
        return self

    def item(self):
        return sum(self.differs)


class Generator:
    def __init__(self, device=None):
        self.rng = random.Random()

    def manual_seed(self, seed):
        self.rng.seed(seed)


def _tensor(shape):
    rows, cols = shape
    return Tensor(_alloc(rows * cols), rows, cols)


def zeros(shape, dtype=None, device=None):
    return _tensor(shape)  # model device memory starts zeroed


def empty(shape, dtype=None, device=None):
    return _tensor(shape)


def randint(low, high, shape, dtype=None, device=None, generator=None):
    assert (low, high) == (0, 256)
    t = _tensor(shape)
    ctypes.memmove(t.ptr, generator.rng.randbytes(t.numel()), t.numel())
    return t


class _Cuda:
    @staticmethod
    def is_available():
        return True

    @staticmethod
    def set_device(i):
        assert i == 0

    @staticmethod
    def synchronize():
        pass

    @staticmethod
    def current_stream():
        return 0  # the default stream

    @staticmethod
    def get_device_name(i):
        return "mcguard CUDA driver model"


cuda = _Cuda()
