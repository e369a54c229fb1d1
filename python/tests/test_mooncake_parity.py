"""One script, Mooncake's TransferEngine API used as Mooncake documents it,
gives the same results on Mooncake's own wheel and on GuardedTransferEngine."""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "mooncake_conventions.py")
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
MOONCAKE_PYTHON = os.environ.get("MCGUARD_MOONCAKE_PYTHON",
                                 os.path.join(ROOT, "build", "venv-mooncake", "bin", "python"))

# What Mooncake 0.3.13.post1 (mooncake-transfer-engine-non-cuda) printed.
MOONCAKE_0_3_13 = {
    "initialize": [0, 0], "allocate_nonzero": [True, True], "write_bytes": 0, "read_bytes_back": True,
    "first_buffer_nonzero": True, "transfer_sync_write": 0, "landed": True, "notifies": [["req-1", "done"]],
    "notifies_again": [], "sync_write": 0, "sync_read": 0, "read_matches": True, "batch_sync_read": 0,
    "async_ids_positive": True, "batch_status": 0, "async_read": 0, "async_mismatched": 0, "check_status": 1,
    "send_probe": 0, "async_unknown_peer": 0, "submit_unknown_peer": 0, "probe_unknown_peer_fails": True,
    "warmup_efa_segment": 0, "topology_shape": True, "opcodes": [0, 1], "free": [0, 0],
}

# Mooncake 0.3.13's public TransferEngine methods; the CUDA-stream ones
# (transfer_*_on_cuda) exist only in its CUDA build.
MOONCAKE_METHODS = [
    "TransferOpcode", "allocate_managed_buffer", "batch_register_memory", "batch_transfer_async",
    "batch_transfer_async_read", "batch_transfer_async_write", "batch_transfer_sync", "batch_transfer_sync_read",
    "batch_transfer_sync_write", "batch_unregister_memory", "free_managed_buffer", "get_batch_transfer_status",
    "get_engine", "get_engine_ptr", "get_first_buffer_address", "get_local_topology", "get_notifies",
    "get_rpc_port", "initialize", "initialize_ext", "read_bytes_from_buffer", "register_memory", "send_probe",
    "transfer_check_status", "transfer_submit_write", "transfer_sync", "transfer_sync_read",
    "transfer_sync_write", "unregister_memory", "warmup_efa_segment", "write_bytes_to_buffer",
]


def run(python, which):
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    out = subprocess.run([python, SCRIPT, which], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_guarded_engine_has_every_mooncake_method():
    from mcguard.mooncake import GuardedTransferEngine
    missing = [m for m in MOONCAKE_METHODS if not hasattr(GuardedTransferEngine, m)]
    assert missing == []


def test_guarded_engine_answers_as_mooncake_did():
    assert run(sys.executable, "mcguard") == MOONCAKE_0_3_13


def test_mooncake_itself_still_answers_so():
    if not os.path.exists(MOONCAKE_PYTHON):
        pytest.skip("no Mooncake wheel here (make mooncake-venv installs it into build/venv-mooncake)")
    assert run(MOONCAKE_PYTHON, "mooncake") == MOONCAKE_0_3_13
    listed = subprocess.run([MOONCAKE_PYTHON, "-c", "from mooncake.engine import TransferEngine as T; "
                             "print(' '.join(sorted(a for a in dir(T) if not a.startswith('_'))))"],
                            capture_output=True, text=True, timeout=60).stdout.split()
    assert [m for m in listed if "cuda" not in m] == MOONCAKE_METHODS
