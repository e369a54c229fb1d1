"""mooncake.engine's names, served by mcguard."""

from mcguard.mooncake import GuardedTransferEngine as TransferEngine  # noqa: F401
from mcguard.mooncake import TransferNotify, TransferOpcode  # noqa: F401
