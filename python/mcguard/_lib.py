"""Loading libmcguard.so and declaring every export's C signature."""

import atexit
import ctypes
import logging
import os

from .abi import LOG_FN, SyncOpts, TransferOpts, TransportOps

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


_PY_LEVELS = [logging.ERROR, logging.WARNING, logging.INFO, logging.DEBUG]

_u64p = ctypes.POINTER(ctypes.c_uint64)
_status = ctypes.c_int32
_handle = ctypes.c_uint64

_SIGNATURES = {
    "mc_guard_open": (_status, [ctypes.c_char_p, ctypes.POINTER(_handle)]),
    "mc_guard_open_with_transport": (_status, [ctypes.c_char_p, ctypes.POINTER(TransportOps), ctypes.c_void_p,
                                               ctypes.POINTER(_handle)]),
    "mc_guard_set_peer_guard": (_status, [_handle, ctypes.c_char_p, ctypes.c_char_p]),
    "mc_guard_close": (_status, [_handle]),
    "mc_guard_register": (_status, [_handle, ctypes.c_void_p, ctypes.c_size_t]),
    "mc_guard_register_device": (_status, [_handle, ctypes.c_void_p, ctypes.c_size_t]),
    "mc_guard_unregister": (_status, [_handle, ctypes.c_void_p]),
    "mc_guard_alloc": (_status, [_handle, ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p)]),
    "mc_guard_free": (_status, [_handle, ctypes.c_void_p]),
    "mc_guard_transfer": (_status, [_handle, ctypes.c_char_p, _u64p, _u64p, _u64p,
                                    ctypes.c_size_t, ctypes.POINTER(TransferOpts)]),
    "mc_guard_read": (_status, [_handle, ctypes.c_char_p, _u64p, _u64p, _u64p, ctypes.c_size_t]),
    "mc_guard_seal": (_status, [_handle, _u64p, _u64p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t,
                                ctypes.POINTER(ctypes.c_size_t)]),
    "mc_guard_read_sealed": (_status, [_handle, ctypes.c_char_p, _u64p, _u64p, _u64p, ctypes.c_size_t,
                                       ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int32]),
    "mc_guard_check_seal": (_status, [_handle, _u64p, _u64p, _u64p, ctypes.c_size_t, ctypes.c_char_p,
                                      ctypes.c_size_t, ctypes.c_int32, ctypes.c_char_p]),
    "mc_guard_id": (_status, [_handle, ctypes.c_char_p, ctypes.c_size_t]),
    "mc_guard_publish": (_status, [_handle, ctypes.c_char_p, _u64p, _u64p, ctypes.c_size_t]),
    "mc_guard_withdraw": (_status, [_handle, ctypes.c_char_p]),
    "mc_guard_fetch_seal": (_status, [_handle, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_uint64, ctypes.c_char_p,
                                      ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]),
    "mc_guard_sync": (_status, [_handle, _u64p, _u64p, ctypes.c_size_t, ctypes.POINTER(SyncOpts)]),
    "mc_guard_sync_transfers": (_status, [_handle, _u64p, ctypes.c_size_t, ctypes.POINTER(SyncOpts)]),
    "mc_guard_cancel": (_status, [_handle, ctypes.c_char_p]),
    "mc_guard_wait_engine_calls": (_status, [_handle, ctypes.c_uint64, ctypes.c_uint64]),
    "mc_guard_quiesce": (_status, [_handle, _u64p, _u64p, ctypes.c_size_t]),
    "mc_guard_quiesce_engine": (_status, [_handle, ctypes.c_char_p, _u64p, _u64p, ctypes.c_size_t]),
    "mc_guard_endpoint": (_status, [_handle, ctypes.c_char_p, ctypes.c_size_t]),
    "mc_guard_stats": (_status, [_handle, ctypes.c_char_p, ctypes.c_size_t,
                                 ctypes.POINTER(ctypes.c_size_t)]),
    "mc_guard_last_error": (ctypes.c_size_t, [_handle, ctypes.c_char_p, ctypes.c_size_t]),
    "mc_guard_version": (ctypes.c_char_p, []),
    "mc_guard_set_log": (_status, [ctypes.c_int32, LOG_FN, ctypes.c_void_p]),
    "mc_guard_metrics": (_status, [_handle, ctypes.c_char_p, ctypes.c_size_t,
                                   ctypes.POINTER(ctypes.c_size_t)]),
    "mc_guard_notify": (_status, [_handle, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]),
    "mc_guard_notifies": (_status, [_handle, ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]),
    "mc_guard_peer_regions": (_status, [_handle, ctypes.c_char_p, _u64p, _u64p, ctypes.c_size_t,
                                        ctypes.POINTER(ctypes.c_size_t)]),
}

_lib = None


def _to_logging(level, message, _ctx):
    log = logging.getLogger("mcguard")
    py = _PY_LEVELS[level] if 0 <= level < len(_PY_LEVELS) else logging.ERROR
    if log.isEnabledFor(py):
        log.log(py, message.decode(errors="replace"))


_log_sink = LOG_FN(_to_logging)  # kept: the library calls it from its own threads


def _stop_logging():
    # No callback into an interpreter that is shutting down: back to stderr.
    if _lib is not None:
        _lib.mc_guard_set_log(-1, LOG_FN(), None)


def lib():
    """The loaded library, with argtypes and restype set for every export,
    its messages routed into logging.getLogger("mcguard")."""
    global _lib
    if _lib is None:
        handle = ctypes.CDLL(library_path())
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(handle, name)
            fn.restype, fn.argtypes = restype, argtypes
        handle.mc_guard_set_log(-1, _log_sink, None)
        _lib = handle
        atexit.register(_stop_logging)
    return _lib
