"""The GPU device check (scripts/device-check.sh) run here on the CUDA
driver model, with a stand-in for torch: the script's own logic (two
processes, both paths, every mode, the decode side's comparison and
counters) is exercised before it runs on a GPU."""

import json
import os
import subprocess
import sys

import pytest

import models

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("vmm", [False, True])
def test_device_check_runs_on_the_driver_model(tmp_path, vmm):
    """With --expandable-segments the model's device memory is VMM memory
    shareable as a descriptor (MCG_MODEL_VMM), as PyTorch's can be."""
    env = dict(os.environ)
    env["MCGUARD_CUDA_MODEL"] = models.cuda_model_path()
    env["MC_GUARD_CUDA_LIBRARY"] = models.cuda_model_path()
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(HERE, "faketorch"), os.path.dirname(HERE)] +
                                        [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    args = ["--expandable-segments"] if vmm else []
    if vmm:
        env["MCG_MODEL_VMM"] = "1"
    out = subprocess.run([sys.executable, "-m", "mcguard.tools.devicecheck", "--out", str(tmp_path), "--seconds", "0.3",
                          "--blocks", "32", "--block-bytes", "8192", "--batch", "8", *args],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads((tmp_path / "device-check.json").read_text())
    assert result["expandable_segments"] == vmm
    rows = result["modes"]
    assert {(r["path"], r["verify"]) for r in rows} == {(p, m) for p in ("socket", "cuda-ipc")
                                                        for m in ("off", "tail", "sample", "full", "digest")}
    for r in rows:
        assert r["ok"] > 0 and r["failed"] == 0 and r["mismatches"] == 0, r
        assert (r["ipc_bytes"] > 0) == (r["path"] == "cuda-ipc"), r


def test_a_decode_process_that_dies_ends_the_check_at_once(tmp_path):
    """A library that does not load in the decode process (a missing
    libzmq, say) is a failed check within seconds, not a wait for the
    script's timeout."""
    env = dict(os.environ)
    env["MCGUARD_CUDA_MODEL"] = models.cuda_model_path()
    env["MC_GUARD_CUDA_LIBRARY"] = models.cuda_model_path()
    env["MCGUARD_LIBRARY"] = str(tmp_path / "missing" / "libmcguard.so")
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(HERE, "faketorch"), os.path.dirname(HERE)] +
                                        [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    out = subprocess.run([sys.executable, "-m", "mcguard.tools.devicecheck", "--out", str(tmp_path), "--seconds", "0.3"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "the decode process exited" in out.stderr, out.stderr
    assert not (tmp_path / "device-check.json").exists()
