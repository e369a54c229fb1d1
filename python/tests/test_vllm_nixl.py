"""mcguard inside vLLM's NixlConnector: prefill and decode in two processes
through vLLM's own pull-mode connector (scheduler and worker halves, its
handshake, its READs, its load-error path), NIXL's real UCX backend, the
plugin switched on by vLLM's plugin loader (vllm_pd/nixl_pd.py); every
block hashed on the decode side. Needs vLLM and NIXL in this interpreter:
`make test-vllm` makes that environment and runs these; `make test` skips
them, saying so (MCGUARD_REQUIRE_VLLM=1 fails instead)."""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PD = os.path.join(HERE, "vllm_pd", "nixl_pd.py")
sys.path.insert(0, HERE)
from pd_common import framework_or_skip, run_case as run_pd  # noqa: E402

framework_or_skip("vllm", "MCGUARD_REQUIRE_VLLM", "vLLM is not installed in this interpreter (about 10 GB): make "
                  "test-vllm installs it in a cache outside the clone and runs these")
framework_or_skip("nixl._api", "MCGUARD_REQUIRE_VLLM", "NIXL is not installed beside vLLM here: make test-vllm "
                  "installs it")


def run_case(case):
    out = run_pd(PD, case)
    blocks = sum(r["blocks"] for r in out["requests"].values())
    good = sum(r["good"] for r in out["requests"].values())
    print("  [%s] vLLM %s: %d requests, %d blocks hashed on the decode side, %d as they must be" % (
        case, out["vllm"], len(out["requests"]), blocks, good))
    return out


@pytest.mark.parametrize("case", ["tail", "digest"])
def test_every_read_is_checked_and_hashes_right(case):
    out = run_case(case)
    for r, x in out["requests"].items():
        assert x["received"] and x["bad"] == 0, (r, x)
    n = len(out["requests"])
    assert out["prefill_stats"]["seals_published"] == n, out["prefill_stats"]
    assert out["decode_stats"]["reads_verified"] >= n and out["decode_stats"]["seal_mismatches"] == 0, out
    assert sorted(out["prefill_finished_sending"]) == sorted("p-%s" % r for r in out["requests"])


@pytest.mark.parametrize("case", ["reuse-tail", "reuse-digest"])
def test_a_read_of_blocks_the_prefill_side_reused_is_a_load_error(case):
    out = run_case(case)
    for r, x in out["requests"].items():
        if x["reused"]:
            assert x["finished"] and not x["received"], (r, x)
            assert len(x["load_errors"]) == x["blocks"], (r, x)
        else:
            assert x["received"] and x["bad"] == 0, (r, x)
    assert out["decode_stats"]["seal_mismatches"] >= 1, out["decode_stats"]


def test_without_the_check_the_same_reuse_is_wrong_bytes_reported_received():
    """The control: MC_GUARD_VERIFY=off leaves the connector as it is."""
    out = run_case("reuse-off")
    x = out["requests"]["0"]
    assert x["received"] and x["bad"] == x["blocks"], x
    assert not out["decode_stats"]["guarded"], out["decode_stats"]


def test_a_prefill_side_without_the_plugin_fails_every_read_rather_than_passing_it_unchecked():
    out = run_case("unsealed-prefill")
    for r, x in out["requests"].items():
        assert x["finished"] and not x["received"] and len(x["load_errors"]) == x["blocks"], (r, x)
