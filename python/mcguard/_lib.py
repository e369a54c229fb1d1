"""Loading libmcguard.so and declaring every export's C signature."""

import ctypes
import os

_HERE = os.path.dirname(os.path.abspath(__file__))


def library_path():
    """MCGUARD_LIBRARY, else libmcguard.so next to this package, else the
    repository's build/libmcguard.so."""
    env = os.environ.get("MCGUARD_LIBRARY")
    if env:
        return env
    for cand in (os.path.join(_HERE, "libmcguard.so"),
                 os.path.join(_HERE, "..", "..", "build", "libmcguard.so")):
        if os.path.exists(cand):
            return os.path.abspath(cand)
    raise OSError("libmcguard.so not found: set MCGUARD_LIBRARY, or run `make build` "
                  "in the mcguard repository")


class TransferOpts(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("verify", ctypes.c_int32),
                ("flags", ctypes.c_uint32), ("reserved", ctypes.c_uint32),
                ("digests", ctypes.POINTER(ctypes.c_uint64)),
                ("transfer_id", ctypes.c_uint64), ("retries", ctypes.c_uint64),
                ("resends", ctypes.c_uint64), ("deadline_ms", ctypes.c_uint64),
                ("abort_state", ctypes.c_int32), ("reserved2", ctypes.c_uint32)]


class SyncOpts(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("reserved", ctypes.c_uint32),
                ("stream", ctypes.c_uint64), ("digests", ctypes.POINTER(ctypes.c_uint64))]


TRANSFER_NO_NOTICE = 1

ABORT_STATES = {0: None, 1: "confirmed", 2: "unconfirmed"}  # MC_ABORT_*


_u64p = ctypes.POINTER(ctypes.c_uint64)
_status = ctypes.c_int32
_handle = ctypes.c_uint64

_SIGNATURES = {
    "mc_guard_open": (_status, [ctypes.c_char_p, ctypes.POINTER(_handle)]),
    "mc_guard_close": (_status, [_handle]),
    "mc_guard_register": (_status, [_handle, ctypes.c_void_p, ctypes.c_size_t]),
    "mc_guard_register_device": (_status, [_handle, ctypes.c_void_p, ctypes.c_size_t]),
    "mc_guard_unregister": (_status, [_handle, ctypes.c_void_p]),
    "mc_guard_transfer": (_status, [_handle, ctypes.c_char_p, _u64p, _u64p, _u64p,
                                    ctypes.c_size_t, ctypes.POINTER(TransferOpts)]),
    "mc_guard_read": (_status, [_handle, ctypes.c_char_p, _u64p, _u64p, _u64p, ctypes.c_size_t]),
    "mc_guard_sync": (_status, [_handle, _u64p, _u64p, ctypes.c_size_t, ctypes.POINTER(SyncOpts)]),
    "mc_guard_sync_transfers": (_status, [_handle, _u64p, ctypes.c_size_t, ctypes.POINTER(SyncOpts)]),
    "mc_guard_cancel": (_status, [_handle, ctypes.c_char_p]),
    "mc_guard_quiesce": (_status, [_handle, _u64p, _u64p, ctypes.c_size_t]),
    "mc_guard_endpoint": (_status, [_handle, ctypes.c_char_p, ctypes.c_size_t]),
    "mc_guard_stats": (_status, [_handle, ctypes.c_char_p, ctypes.c_size_t,
                                 ctypes.POINTER(ctypes.c_size_t)]),
    "mc_guard_last_error": (ctypes.c_size_t, [_handle, ctypes.c_char_p, ctypes.c_size_t]),
    "mc_guard_version": (ctypes.c_char_p, []),
}

_lib = None


def lib():
    """The loaded library, with argtypes and restype set for every export."""
    global _lib
    if _lib is None:
        handle = ctypes.CDLL(library_path())
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(handle, name)
            fn.restype, fn.argtypes = restype, argtypes
        _lib = handle
    return _lib
