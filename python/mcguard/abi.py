"""The C ABI as Python sees it: statuses, verification modes, abort
states, option structs and callback types, defined once here from
include/mcguard.h (test_header.py checks them against it). _lib declares
the exports with these; guard, callbacks and the tools use them."""

import ctypes

# mc_status
MC_OK = 0
MC_ERR_INVALID_ARG = -1
MC_ERR_BAD_HANDLE = -2
MC_ERR_CONFIG = -3
MC_ERR_NOT_REGISTERED = -4
MC_ERR_SESSION = -5
MC_ERR_TIMEOUT = -6
MC_ERR_PEER = -7
MC_ERR_VERIFY = -8
MC_ERR_CLOSED = -9
MC_ERR_FORKED = -10
MC_ERR_BUFFER_TOO_SMALL = -11
MC_ERR_INTERNAL = -12
MC_ERR_DEVICE = -13
MC_ERR_QUIESCED = -14
MC_ERR_CANCELLED = -15
MC_ERR_NO_MEMORY = -16
MC_ERR_SEAL = -17

STATUS_NAMES = {code: name for name, code in list(globals().items()) if name.startswith("MC_")}

# mc_transfer_opts.verify (None: the guard's own mode)
VERIFY_MODES = {None: -1, "off": 0, "tail": 1, "sample": 2, "full": 3, "digest": 4}

# the modes a seal is checked in (None: digest), and the seal's size
SEAL_MODES = {None: -1, "digest": 4, "tail": 1}
ID_SIZE = 16  # MC_GUARD_ID_SIZE


def seal_size(n):
    """MC_GUARD_SEAL_SIZE(n): the most bytes a seal of n ranges takes."""
    return 40 + 40 * n + 32


ABORT_STATES = {0: None, 1: "confirmed", 2: "unconfirmed"}  # MC_ABORT_*

TRANSFER_NO_NOTICE = 1  # mc_transfer_opts.flags


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


# mc_transport_ops: an engine's callbacks (msg is a char buffer, passed as
# its address so a callback can write into it).
BATCH_FN = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_uint64),
                            ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t,
                            ctypes.c_void_p, ctypes.c_size_t)
REGISTER_FN = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_void_p,
                               ctypes.c_size_t)
UNREGISTER_FN = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t)
FENCE_FN = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t)


class TransportOps(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("reserved", ctypes.c_uint32), ("name", ctypes.c_char_p),
                ("write", BATCH_FN), ("read", BATCH_FN), ("register_memory", REGISTER_FN),
                ("unregister_memory", UNREGISTER_FN), ("fence", FENCE_FN)]


LOG_FN = ctypes.CFUNCTYPE(None, ctypes.c_int32, ctypes.c_char_p, ctypes.c_void_p)
LOG_LEVELS = ["error", "warn", "info", "debug"]  # MC_LOG_*
