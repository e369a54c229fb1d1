"""make bench-read's tool runs end to end (one round, two shapes): every
engine's landing is hashed against the producer's bytes, progress goes to
stderr, and the summary has every row with its ratio."""

import os
import subprocess

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
VENV_PYTHON = os.path.join(ROOT, "build", "venv-mooncake", "bin", "python")


def test_readbench_runs_and_checks_every_landing(tmp_path):
    if not os.path.exists(VENV_PYTHON) or subprocess.run([VENV_PYTHON, "-c", "import nixl_cu12"],
                                                         capture_output=True).returncode != 0:
        pytest.skip("NIXL's wheel is not installed here (make nixl-venv installs it; make test does)")
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    out = subprocess.run([VENV_PYTHON, "-m", "mcguard.tools.readbench", "--rounds", "1", "--shapes", "64x256KiB",
                          "512x16KiB", "--json", str(tmp_path / "read.json")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    rows = [line.split("|")[1:3] for line in out.stdout.splitlines() if line.startswith("| 64x256KiB")]
    engines = {e.strip() for _, e in rows}
    assert {"nixl", "nixl-tail", "nixl-digest", "mcguard-socket", "mcguard-socket-digest", "mcguard-tail",
            "producer's seal"} <= engines
    assert "64x256KiB: round 1 of 1" in out.stderr
    assert (tmp_path / "read.json").exists()
