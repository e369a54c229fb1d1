"""mcguard inside SGLang: prefill and decode in two processes through
SGLang's own Mooncake KV manager, mcguard switched in by SGLang's plugin
loader (sglang_pd/pd.py), every page and metadata slot hashed on the
decode side. Needs SGLang in this interpreter: `make test-sglang` makes
that environment and runs these; `make test` skips them, saying so
(MCGUARD_REQUIRE_SGLANG=1 fails instead)."""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PD = os.path.join(HERE, "sglang_pd", "pd.py")
sys.path.insert(0, HERE)
from pd_common import framework_or_skip, run_case as run_pd  # noqa: E402

framework_or_skip("sglang", "MCGUARD_REQUIRE_SGLANG", "SGLang is not installed in this interpreter (about 11 GB): "
                  "make test-sglang installs it in a cache outside the clone and runs these")


def run_case(case):
    out = run_pd(PD, case)
    regions = sum(r["regions"] for r in out["rooms"].values())
    good = sum(r["good"] for r in out["rooms"].values())
    pages = sum(r["pages"] for r in out["rooms"].values())
    print("  [%s] SGLang %s: %d rooms, %d pages and %d slots (%d regions) hashed on the decode side, %d as they "
          "must be" % (case, out["sglang"], len(out["rooms"]), pages, len(out["rooms"]), regions, good))
    return out


@pytest.mark.parametrize("case,data_plane", [("tail", "tcp"), ("digest", "tcp"), ("tail-socket", "tcp"),
                                             ("digest-socket", "tcp"), ("mooncake-tail", "engine"),
                                             ("mooncake-digest", "engine")])
def test_every_room_arrives_and_hashes_right(case, data_plane):
    out = run_case(case)
    assert out["prefill_transport"] == data_plane
    for r, x in out["rooms"].items():
        assert x["status"] == "Success" and x["bad"] == 0 and x["slot_good"], (r, x)
        assert out["prefill_status"][r] == "Success", out
    assert out["decode_stats"]["syncs"] >= len(out["rooms"]), "the decode side's check did not run per room"


@pytest.mark.parametrize("case", ["drop-tail", "drop-digest"])
def test_a_dropped_write_fails_the_room(case):
    out = run_case(case)
    for r, x in out["rooms"].items():
        assert x["status"] == "Failed", (r, x)
    if case == "drop-digest":
        # The prefill's writes returned success (digest mode checks at the
        # receiver): only the decode side's check caught it.
        assert all(s == "Success" for s in out["prefill_status"].values()), out
        assert out["decode_stats"]["sync_failures"] >= 1, out


def test_without_verification_the_same_drop_is_wrong_bytes_reported_a_success():
    """The control: the harness sees the fault when nothing checks."""
    out = run_case("drop-off")
    assert any(x["status"] == "Success" and x["bad"] > 0 for x in out["rooms"].values()), out


# Where the quiesce is kept: the decode guard over mcguard's data plane,
# the prefill's guard over Mooncake's engine (told over SGLang's channel).
ABORTS = [("abort", "decode_stats"), ("mooncake-abort", "prefill_stats")]


@pytest.mark.parametrize("case,kept_by", ABORTS)
def test_an_aborted_rooms_late_write_does_not_land_in_the_reused_pages(case, kept_by):
    out = run_case(case)
    x = out["rooms"]["0"]
    assert x["status"] == "Failed" and x["released"] and x["owner"] == 100, x
    assert x["bad"] == 0, "the aborted room's held write overwrote the new request's pages: %s" % x
    assert out[kept_by]["quiesces"] >= 1, out


def test_a_deferred_release_frees_at_once_and_the_late_write_still_does_not_land():
    """SGLang's deferred release (SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE)
    would hold the pages for every prefill rank's acknowledgement; with the
    decode guard keeping the quiesce they are freed at once."""
    out = run_case("abort-deferred")
    x = out["rooms"]["0"]
    assert x["status"] == "Failed" and x["released"] and x["owner"] == 100, x
    assert x["bad"] == 0, "the aborted room's held write overwrote the new request's pages: %s" % x
    assert out["decode_stats"]["quiesces"] >= 1, out


@pytest.mark.parametrize("case,kept_by", ABORTS)
def test_without_the_plugins_quiesce_the_late_write_corrupts_the_reused_pages(case, kept_by):
    """The control of the abort case: MC_GUARD_SGLANG_QUIESCE=0."""
    out = run_case(case + "-no-quiesce")
    x = out["rooms"]["0"]
    assert x["status"] == "Failed" and x["released"] and x["owner"] == 100, x
    assert x["bad"] > 0, "the held write did not land: the abort case proves nothing here: %s" % x
    assert out[kept_by]["quiesces"] == 0, out


def test_a_failed_send_lands_nothing_after_it_was_reported():
    """The prefill's write fails at its deadline while held at the decode
    side, which does not quiesce: nothing of it lands afterwards."""
    out = run_case("failed-send")
    x = out["rooms"]["0"]
    assert x["status"] == "Failed" and out["prefill_status"]["0"] == "Failed", out
    assert x["good"] == 0, "the failed write landed after SGLang was told it failed: %s" % x
    assert out["decode_stats"]["quiesces"] == 0, out
