"""python3 -m mcguard.stress, the PD stress by the name its users run it
by: mcguard.tools.stress, run, or the very module when imported."""

import sys

from .tools import stress as _module

if __name__ == "__main__":
    sys.exit(_module.main())
elif __name__ == "mcguard.stress":
    sys.modules[__name__] = _module
