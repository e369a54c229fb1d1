"""mcguard inside SGLang: prefill and decode in two processes through
SGLang's own Mooncake KV manager, mcguard switched in by SGLang's plugin
loader (sglang_pd/pd.py), every page and metadata slot hashed on the
decode side. Needs SGLang in this interpreter: `make test-sglang` makes
that environment and runs these; `make test` skips them, saying so
(MCGUARD_REQUIRE_SGLANG=1 fails instead)."""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PD = os.path.join(HERE, "sglang_pd", "pd.py")

try:
    import sglang  # noqa: F401
    HAVE_SGLANG = True
except ImportError:
    HAVE_SGLANG = False

if not HAVE_SGLANG:
    if os.environ.get("MCGUARD_REQUIRE_SGLANG") == "1":
        raise RuntimeError("MCGUARD_REQUIRE_SGLANG=1 and SGLang is not importable by %s" % sys.executable)
    pytest.skip("SGLang is not installed in this interpreter (about 11 GB): make test-sglang installs it in a cache "
                "outside the clone and runs these", allow_module_level=True)


def run_case(case):
    p = subprocess.run([sys.executable, PD, case], capture_output=True, text=True, timeout=420)
    lines = [line for line in p.stdout.splitlines() if line.startswith("  [")]
    print("\n".join(lines))
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-8000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
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


def test_an_aborted_rooms_late_write_does_not_land_in_the_reused_pages():
    out = run_case("abort")
    x = out["rooms"]["0"]
    assert x["status"] == "Failed" and x["released"] and x["owner"] == 100, x
    assert x["bad"] == 0, "the aborted room's held write overwrote the new request's pages: %s" % x
    assert out["decode_stats"]["quiesces"] >= 1, out


def test_without_the_plugins_quiesce_the_late_write_corrupts_the_reused_pages():
    """The control of the abort case: MC_GUARD_SGLANG_QUIESCE=0."""
    out = run_case("abort-no-quiesce")
    x = out["rooms"]["0"]
    assert x["status"] == "Failed" and x["released"] and x["owner"] == 100, x
    assert x["bad"] > 0, "the held write did not land: the abort case proves nothing here: %s" % x
    assert out["decode_stats"]["quiesces"] == 0, out


def test_a_failed_send_lands_nothing_after_it_was_reported():
    """The prefill's write fails at its deadline while held at the decode
    side, which does not quiesce: nothing of it lands afterwards."""
    out = run_case("failed-send")
    x = out["rooms"]["0"]
    assert x["status"] == "Failed" and out["prefill_status"]["0"] == "Failed", out
    assert x["good"] == 0, "the failed write landed after SGLang was told it failed: %s" % x
    assert out["decode_stats"]["quiesces"] == 0, out
