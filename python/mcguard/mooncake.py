"""mcguard.mooncake, the name applications import GuardedTransferEngine by:
the very module mcguard.integrations.mooncake."""

import sys

from .integrations import mooncake as _module

sys.modules[__name__] = _module
