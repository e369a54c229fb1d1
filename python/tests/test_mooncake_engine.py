"""mcguard over Mooncake's own engine, its real wheel (make mooncake-venv
installs the pinned mooncake-transfer-engine-non-cuda into
build/venv-mooncake): two processes, TCP protocol, P2PHANDSHAKE, each
wrapping a mooncake.engine.TransferEngine with GuardedTransferEngine(engine=...),
the destination hashed on the receiving side in every mode."""

import json
import os
import subprocess

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
MOONCAKE_PYTHON = os.environ.get("MCGUARD_MOONCAKE_PYTHON",
                                 os.path.join(ROOT, "build", "venv-mooncake", "bin", "python"))


def run_with_mooncake(*args, timeout=300, check=True, env=None):
    """Run python args with the Mooncake wheel's interpreter and mcguard on
    its path (env: more environment); with check, its exit status must be 0."""
    if not os.path.exists(MOONCAKE_PYTHON):
        pytest.skip("Mooncake's wheel is not installed here (make mooncake-venv installs it; make test does)")
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"), **(env or {}))
    out = subprocess.run([MOONCAKE_PYTHON, *args], env=env, capture_output=True, text=True, timeout=timeout)
    if check:
        assert out.returncode == 0, "stdout:\n%s\nstderr:\n%s" % (out.stdout[-4000:], out.stderr[-3000:])
    return out


def last_json(out):
    return json.loads(out.stdout.strip().splitlines()[-1])


SMALL_STRESS = ("--sessions", "1", "--threads", "2", "--blocks", "64", "--batch", "8", "--block-bytes", "16384",
                "--lag-max-ms", "5", "--json", "--quiet")


@pytest.fixture(scope="module")
def results():
    return last_json(run_with_mooncake(os.path.join(HERE, "mooncake_engine_peer.py"), "sender"))


@pytest.mark.parametrize("mode", ["off", "tail", "sample", "full", "digest"])
def test_every_mode_moves_hash_checked_bytes_over_mooncake(results, mode):
    r = results[mode]
    assert r["ret"] == 0
    assert r["landed"], "the receiver's hash of its buffer equals the source's"
    assert r["transport"] == "engine"
    assert r["slice_bytes"] == 65536, "Mooncake's slice size (MC_SLICE_SIZE unset)"
    assert r["probed"] == (mode in ("tail", "sample", "full")), "read-back modes read back through Mooncake"


def test_consecutive_blocks_join_into_mooncake_slices_where_the_peers_guard_is_known(results):
    # 256 blocks of 16 KiB, consecutive at both ends: four to a 64 KiB
    # request once the receiver's region table is known (digest mode sets
    # the peer's guard), one request each without it; hashed either way.
    assert results["digest"]["joined"] == 256 - 64
    assert results["digest"]["landed"]
    assert all(results[m]["joined"] == 0 for m in ("off", "tail", "sample", "full"))


def test_errors_over_mooncake_are_statuses_with_reasons(results):
    ret, why = results["unregistered"]
    assert ret < 0 and "returned -1" in why and "may still land" in why
    ret, why = results["dead_peer"]
    assert ret < 0 and "127.0.0.1:1" in why
    ret, why = results["mismatched"]
    assert ret < 0 and "differ in length" in why


def test_a_failed_writes_engine_calls_can_be_waited_for(results):
    known, waited, now = results["failed_settled"]
    assert known, "the failed write's id is kept for this thread"
    assert waited == 0 and now == 0, "Mooncake returned its error: nothing of it runs"
    assert results["deadline_settled"] == "ok", "the call given up at its deadline returned within 10 s"


def test_reads_and_the_peers_first_buffer_come_from_mooncake(results):
    assert results["read"] == 0 and results["read_landed"]
    assert results["first_buffer"]


def test_a_transfer_past_its_deadline_says_its_bytes_may_still_land(results):
    name, message, abort = results["deadline"]
    assert name == "MC_ERR_TIMEOUT"
    assert "may still land" in message
    assert abort == "unconfirmed"
    assert results["receiver_exit"] == 0


def test_over_mooncake_calls_run_inline_and_a_late_one_still_fails(results):
    assert results["inline"] is True, "Mooncake's sync calls end on their own: no hand-off by default"
    name, message, settled = results["inline_deadline"]
    assert name == "MC_ERR_TIMEOUT" and "while the engine moved its bytes" in message
    assert settled == "settled", "the call had returned: nothing of the transfer runs"


def test_stress_over_mooncake_shows_lag_with_off_and_catches_it_with_tail():
    def stress(verify):
        out = run_with_mooncake("-m", "mcguard.stress", "--transport", "mooncake", "--inject", "lag",
                                "--verify", verify, "--seconds", "3", *SMALL_STRESS, timeout=240, check=False)
        assert out.returncode in (0, 1), out.stderr[-4000:]  # 1: mismatches
        return last_json(out)
    off = stress("off")
    assert off["transport"] == "mooncake" and off["ok"] > 0
    assert off["mismatches"] > 0, "writes acknowledged before Mooncake moved them: off reports success for old bytes"
    tail = stress("tail")
    assert tail["ok"] > 0 and tail["mismatches"] == 0, tail


def test_detection_matrix_over_mooncake():
    out = run_with_mooncake("-m", "mcguard.stress", "--transport", "mooncake", "--matrix", "--seconds", "1",
                            *SMALL_STRESS, timeout=600, check=False)
    assert out.returncode in (0, 1), out.stderr[-4000:]  # 1: a cell not as expected, named below
    rows = last_json(out)["matrix"]
    assert len(rows) == 25, "lag, drop, tear, reorder, lie x five modes (stale needs the destination's bytes)"
    lie = {r["verify"]: r for r in rows if r["inject"] == "lie"}
    assert all(lie[m]["mismatches"] == 0 for m in ("tail", "sample", "full", "digest")), \
        "a lying engine fools no check the peer's guard answers from its own memory"
    assert all(r["as_expected"] for r in rows), [r for r in rows if not r["as_expected"]]
    assert all(r["ok"] > 0 for r in rows if r["verify"] != "digest"), rows


def test_a_lying_engine_fools_read_backs_through_it():
    """Read back through the engine itself (engine_peer_checks off), every
    read-back mode trusts its read path, and the receiver's digests do not."""
    for mode, fooled in (("tail", True), ("digest", False)):
        out = run_with_mooncake("-m", "mcguard.stress", "--transport", "mooncake", "--inject", "lie",
                                "--inject-rate", "1", "--verify", mode, "--seconds", "1", *SMALL_STRESS,
                                env={"MC_GUARD_ENGINE_PEER_CHECKS": "false"}, check=False)
        r = last_json(out)
        assert r["peer_checked"] == 0
        assert (r["mismatches"] > 0) == fooled, r
