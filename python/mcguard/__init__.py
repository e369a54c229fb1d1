"""mcguard: KV-cache transfers that return success only when the bytes are
confirmed at the target. See the repository README."""

from .guard import (Guard, MCGuardError, TransferResult, STATUS_NAMES, version,  # noqa: F401
                    address_of, set_log_level)
from .guard import (MC_OK, MC_ERR_INVALID_ARG, MC_ERR_BAD_HANDLE, MC_ERR_CONFIG,  # noqa: F401
                    MC_ERR_NOT_REGISTERED, MC_ERR_SESSION, MC_ERR_TIMEOUT, MC_ERR_PEER,
                    MC_ERR_VERIFY, MC_ERR_CLOSED, MC_ERR_FORKED, MC_ERR_BUFFER_TOO_SMALL,
                    MC_ERR_INTERNAL, MC_ERR_DEVICE, MC_ERR_QUIESCED, MC_ERR_CANCELLED,
                    MC_ERR_NO_MEMORY, MC_ERR_SEAL)
from .engine import Engine, MooncakeEngine  # noqa: F401,E402 - an application's own engine as the data plane
