"""mcguard inside vLLM: prefill and decode in two processes through vLLM's
own MooncakeConnector worker, mcguard switched in by vLLM's plugin loader
(vllm_pd/pd.py), every block hashed on the decode side. Needs vLLM in
this interpreter: `make test-vllm` makes that environment and runs these;
`make test` skips them, saying so (MCGUARD_REQUIRE_VLLM=1 fails instead)."""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PD = os.path.join(HERE, "vllm_pd", "pd.py")
sys.path.insert(0, os.path.dirname(PD))
import pd  # noqa: E402
from pd_common import framework_or_skip, run_case as run_pd  # noqa: E402

framework_or_skip("vllm", "MCGUARD_REQUIRE_VLLM", "vLLM is not installed in this interpreter (about 10 GB): make "
                  "test-vllm installs it in a cache outside the clone and runs these")


def run_case(case):
    out = run_pd(PD, case)
    blocks = sum(r["blocks"] for r in out["requests"].values())
    good = sum(r["good"] for r in out["requests"].values())
    print("  [%s] vLLM %s: %d requests, %d blocks hashed on the decode side, %d as they must be" % (
        case, out["vllm"], len(out["requests"]), blocks, good))
    return out


@pytest.mark.parametrize("case,data_plane", [("tail", "tcp"), ("digest", "tcp"), ("tail-socket", "tcp"),
                                             ("digest-socket", "tcp"), ("mooncake-tail", "engine"),
                                             ("mooncake-digest", "engine")])
def test_every_request_arrives_and_hashes_right(case, data_plane):
    out = run_case(case)
    assert out["prefill_transport"] == data_plane
    for r, x in out["requests"].items():
        assert x["received"] and x["bad"] == 0, (r, x)
    assert out["decode_stats"]["syncs"] >= 1, "the decode side's sync never ran"
    assert sorted(out["prefill_finished_sending"]) == sorted("p-%s" % r for r in out["requests"])


@pytest.mark.parametrize("case", ["drop-tail", "drop-digest"])
def test_a_dropped_write_is_a_load_error_for_exactly_its_blocks(case):
    out = run_case(case)
    for r, x in out["requests"].items():
        assert x["finished"] and not x["received"], (r, x)
        assert x["load_errors"] == sorted(pd.decode_blocks(int(r), x["blocks"])), (r, x)
    if case == "drop-digest":
        # The prefill side's write returned success (digest mode checks at
        # the receiver): only the decode side's sync caught it.
        assert out["prefill_finished_sending"], out
        assert out["decode_stats"]["sync_failures"] >= 1, out


def test_without_verification_the_same_drop_is_wrong_bytes_reported_received():
    """The control: the harness sees the fault when nothing checks."""
    out = run_case("drop-off")
    assert any(x["received"] and x["bad"] > 0 for x in out["requests"].values()), out


# Where the quiesce is kept: the decode guard over mcguard's data plane,
# the prefill's guard over Mooncake's engine (told over vLLM's side channel).
ABORTS = [("abort", "decode_stats"), ("mooncake-abort", "prefill_stats")]


@pytest.mark.parametrize("case,kept_by", ABORTS)
def test_an_aborted_requests_late_write_does_not_land_in_the_reused_blocks(case, kept_by):
    out = run_case(case)
    x = out["requests"]["0"]
    assert x["finished"] and not x["received"] and x["owner"] == 100, x
    assert x["bad"] == 0, "the old request's held write overwrote the new request's blocks: %s" % x
    assert out[kept_by]["quiesces"] >= 1, out


@pytest.mark.parametrize("case,kept_by", ABORTS)
def test_without_the_plugins_quiesce_the_late_write_corrupts_the_reused_blocks(case, kept_by):
    """The control of the abort case: MC_GUARD_VLLM_QUIESCE=0."""
    out = run_case(case + "-no-quiesce")
    x = out["requests"]["0"]
    assert x["finished"] and x["owner"] == 100, x
    assert x["bad"] > 0, "the held write did not land: the abort case proves nothing here: %s" % x
    assert out[kept_by]["quiesces"] == 0, out


def test_a_failed_send_lands_nothing_after_it_was_reported():
    """The prefill's write fails at its deadline while held at the decode
    side, which does not quiesce: nothing of it lands afterwards."""
    out = run_case("failed-send")
    x = out["requests"]["0"]
    assert x["finished"] and not x["received"] and x["load_errors"], x
    assert x["good"] == 0, "the failed write landed after vLLM was told it failed: %s" % x
    assert out["decode_stats"]["quiesces"] == 0, out

