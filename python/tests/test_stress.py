"""The main job end to end: two or more processes on loopback, every
successful descriptor hashed at the decode side."""

import json
import os
import subprocess
import sys

import pytest


PKG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def stress(*flags):
    p = subprocess.run([sys.executable, "-m", "mcguard.stress", "--json", "--quiet", "--seconds", "30",
                        "--batches", "12", "--threads", "2", "--batch", "16", "--blocks", "64",
                        "--block-bytes", "16384"] + list(flags),
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120, cwd=PKG_DIR)
    return p.returncode, json.loads(p.stdout.strip().splitlines()[-1]), p.stdout


def test_off_under_lag_shows_mismatches():
    rc, out, text = stress("--verify", "off", "--inject", "lag")
    assert out["mismatches"] > 0
    assert rc == 1
    assert "mismatches" in text.splitlines()[0], "a summary table precedes the JSON"


def test_tail_under_lag_shows_none():
    rc, out, _ = stress("--verify", "tail", "--inject", "lag")
    assert rc == 0
    assert out["ok"] == 24 and out["failed"] == 0 and out["mismatches"] == 0
    assert out["descriptors"] == 24 * 16 and out["bytes"] == 24 * 16 * 16384
    for key in ("verify", "inject", "transport", "transfers", "descriptors", "bytes", "ok", "failed",
                "mismatches", "retries", "seconds", "gbps"):
        assert key in out


def test_arguments_are_checked():
    p = subprocess.run([sys.executable, "-m", "mcguard.stress", "--blocks", "4", "--threads", "4",
                        "--batch", "4"], cwd=PKG_DIR, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.returncode == 2 and "must be at least" in p.stderr


# consecutive: each batch is a run of blocks, joined into one write, so a
# fault's rate applies per batch, not per descriptor: more batches at a
# higher rate, so that off still meets every fault (a cell's 32 writes
# all spared: 0.7^32).
# max_batch 2: each batch of 8 goes in four chunks, each chunk's writes
# posted while the chunk before it is checked.
@pytest.mark.parametrize("layout,more", [("scattered", ["--batches", "4"]),
                                         ("consecutive", ["--batches", "16", "--inject-rate", "0.3"]),
                                         ("scattered", ["--batches", "4", "--max-batch", "2"])])
def test_matrix_comes_out_as_documented(layout, more):
    p = subprocess.run([sys.executable, "-m", "mcguard.stress", "--matrix", "--json", "--quiet",
                        "--sessions", "1", "--threads", "2", "--batch", "8", "--blocks", "32",
                        "--block-bytes", "16384", "--seconds", "30", "--layout", layout] + more,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600, cwd=PKG_DIR)
    matrix = json.loads(p.stdout.strip().splitlines()[-1])["matrix"]
    assert len(matrix) == 25
    for cell in matrix:
        assert cell["as_expected"], cell
        if cell["verify"] == "off":
            assert cell["mismatches"] > 0
        if cell["verify"] in ("full", "digest", "sample"):
            assert cell["mismatches"] == 0
        if "--max-batch" in more and cell["verify"] in ("tail", "sample", "full"):
            # reorder: the target's fence no longer says every earlier
            # write is applied, so the sender polls, and posts nothing
            # ahead (a later poll would read the next chunk's bytes too)
            assert (cell["pipelined_chunks"] > 0) == (cell["inject"] != "reorder"), cell
    assert p.returncode == 0


def test_transport_rdma_without_a_device_fails_with_the_reason():
    p = subprocess.run([sys.executable, "-m", "mcguard.stress", "--transport", "rdma", "--seconds", "1"],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120, cwd=PKG_DIR)
    assert p.returncode != 0
    assert "transport rdma was required, and it is not usable" in p.stderr


def test_rdma_model_off_under_lag_shows_mismatches_and_tail_none():
    """The RDMA transport on the software NIC, decode and prefill in separate
    processes: a completed WRITE is not yet visible, and the READ-fenced
    read-back closes that."""
    rc, off, _ = stress("--transport", "rdma-model", "--verify", "off", "--inject", "lag")
    assert off["transport"] == "rdma-model" and off["mismatches"] > 0 and rc == 1
    rc, tail, _ = stress("--transport", "rdma-model", "--verify", "tail", "--inject", "lag")
    assert rc == 0 and tail["ok"] == 24 and tail["failed"] == 0 and tail["mismatches"] == 0


def test_rdma_model_striped_over_four_queue_pairs():
    """Four queue pairs per session, each lagging on its own: off shows
    mismatches, tail (every stripe fenced before the read-backs) none."""
    rc, off, _ = stress("--transport", "rdma-model", "--rdma-qps", "4", "--verify", "off", "--inject", "lag")
    assert off["rdma_qps"] == 4 and off["mismatches"] > 0 and rc == 1
    rc, tail, _ = stress("--transport", "rdma-model", "--rdma-qps", "4", "--verify", "tail", "--inject", "lag")
    assert rc == 0 and tail["ok"] == 24 and tail["failed"] == 0 and tail["mismatches"] == 0 and tail["retries"] == 0


def abort_stress(*flags):
    p = subprocess.run([sys.executable, "-m", "mcguard.stress", "--abort", "--json", "--quiet", "--seconds", "3",
                        "--verify", "tail", "--blocks", "2048", "--block-bytes", "16384"] + list(flags),
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120, cwd=PKG_DIR)
    return p.returncode, json.loads(p.stdout.strip().splitlines()[-1])


def test_abort_without_quiesce_corrupts_reused_blocks_and_with_it_none():
    """Requests aborted at random on both sides, their blocks reused at once:
    an aborted request's late bytes overwrite the next request's, unless the
    decode side quiesced the blocks before reusing them. Over TCP (the hold
    fault) and the NIC model (posted writes), two processes each."""
    for transport in ("tcp", "rdma-model"):
        rc, off = abort_stress("--transport", transport, "--quiesce", "off")
        assert off["corrupted_blocks"] > 0 and rc == 1, (transport, off)
        rc, on = abort_stress("--transport", transport, "--quiesce", "on")
        assert on["reused_blocks"] > 0 and on["quiesces"] > 0, (transport, on)
        assert on["corrupted_blocks"] == 0 and rc == 0, (transport, on)
