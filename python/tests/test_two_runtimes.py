"""Two Go runtimes in one process (libmcguard.so beside the libetcd_wrapper.so
that Mooncake's wheel loads), which Go does not support officially: what
was tried, and held. See README's process rules."""

import json
import os
import signal
import subprocess
import time

from test_mooncake_engine import MOONCAKE_PYTHON, ROOT, last_json, run_with_mooncake

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "two_runtimes.py")


def test_both_go_runtimes_are_loaded():
    assert last_json(run_with_mooncake(SCRIPT, "load"))["libraries"] == ["libetcd_wrapper.so", "libmcguard.so"]


def test_concurrent_transfers_through_both_under_gc_pressure_profiling_and_signals():
    env_before = os.environ.get("GOGC")
    os.environ["GOGC"] = "5"  # both Go collectors run all the time
    try:
        r = last_json(run_with_mooncake(SCRIPT, "concurrent", "6"))
    finally:
        if env_before is None:
            del os.environ["GOGC"]
        else:
            os.environ["GOGC"] = env_before
    assert r["libraries"] == ["libetcd_wrapper.so", "libmcguard.so"]
    assert r["errors"] == []
    for kind in ("raw", "tcp", "engine"):
        assert r["counts"][kind]["ok"] > 0, kind
        assert r["counts"][kind]["bad"] == 0, "a success whose destination differs: %s" % kind
    assert r["raised"] > 0 and r["counts"]["engine"]["failed"] == r["raised"], \
        "each exception raised in a callback failed its transfer, and only those"
    assert r["sigprof"] > 0 and r["sigint"] > 0 and r["gogc"] == "5"


def sigterm(scenario):
    if not os.path.exists(MOONCAKE_PYTHON):
        run_with_mooncake(SCRIPT, "load")  # skips with the reason
    proc = subprocess.Popen([MOONCAKE_PYTHON, SCRIPT, scenario], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env=dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python")))
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.5)  # transfers under way
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    return proc.returncode, out


def test_sigterm_mid_transfer_ends_the_process_promptly():
    code, _ = sigterm("sigterm")
    assert code == -signal.SIGTERM


def test_a_python_sigterm_handler_closes_the_guard_and_exits_cleanly():
    code, out = sigterm("sigterm-handled")
    assert code == 0
    r = json.loads(out.strip().splitlines()[-1])
    assert r["closed"] and r["transfers"] > 0
