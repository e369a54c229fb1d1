"""mcguard.nixl, the name applications import GuardedNixlAgent by: the very
module mcguard.integrations.nixl."""

import sys

from .integrations import nixl as _module

sys.modules[__name__] = _module
