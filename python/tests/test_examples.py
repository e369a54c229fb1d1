"""The Python example runs as README says, and its two processes agree on
the bytes (the C and C++ examples run under ctest)."""

import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def test_python_prefill_decode_example():
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    env.pop("MC_GUARD_SECRET", None)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "python", "prefill_decode.py")],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "the bytes decode holds are the bytes prefill sent" in out.stdout
