"""mcguard.metrics, the name applications import Collector by: the very
module mcguard.integrations.metrics."""

import sys

from .integrations import metrics as _module

sys.modules[__name__] = _module
