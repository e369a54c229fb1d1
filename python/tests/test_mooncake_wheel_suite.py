"""Mooncake's own initiator tests (mooncake-wheel/tests/
transfer_engine_initiator_test.py in Mooncake's repository), unchanged,
against Mooncake's wheel and against GuardedTransferEngine: every test that
passes on Mooncake passes on mcguard.

Mooncake's wheel does not ship its tests, so the file is not here: set
MCGUARD_MOONCAKE_TESTS to the folder that holds it (a checkout's
mooncake-wheel/tests). The target side is ours (mooncake_target.py), since
Mooncake's target names a port that P2P handshake mode does not bind.
"""

import json
import os
import subprocess
import sys

import pytest

from test_mooncake_parity import MOONCAKE_PYTHON, ROOT

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.environ.get("MCGUARD_MOONCAKE_TESTS", "")
INITIATOR = "transfer_engine_initiator_test"
SHIM = os.path.join(HERE, "mooncake_shim")


# Runs the file's tests with unittest and prints each test's outcome as one
# JSON line last (the tests print their own lines before it).
RUNNER = """
import json, sys, unittest

class Outcomes(unittest.TestResult):
    def __init__(self):
        super().__init__()
        self.outcome = {}
    def startTest(self, test):
        super().startTest(test)
        self.outcome[test.id().rsplit(".", 1)[1]] = "ok"
    def _bad(self, test, err):
        self.outcome[test.id().rsplit(".", 1)[1]] = "failed"
        print(self._exc_info_to_string(err, test), file=sys.stderr)
    addFailure = addError = _bad

result = Outcomes()
unittest.defaultTestLoader.loadTestsFromName(sys.argv[1]).run(result)
print(json.dumps(result.outcome))
"""


def run_suite(python, pythonpath):
    """{test name: "ok" | "failed"} and the run's stderr."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(pythonpath))
    target = subprocess.Popen([python, os.path.join(HERE, "mooncake_target.py")], env=env, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        name = target.stdout.readline().strip()
        assert name, "the target did not start"
        env.update(MC_METADATA_SERVER="P2PHANDSHAKE", TARGET_SERVER_NAME=name,
                   INITIATOR_SERVER_NAME="127.0.0.1:0", CIRCLE="200")
        out = subprocess.run([python, "-c", RUNNER, INITIATOR], cwd=TESTS, env=env,
                             capture_output=True, text=True, timeout=300)
    finally:
        target.stdin.close()
        target.wait(timeout=30)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


@pytest.mark.skipif(not os.path.isfile(os.path.join(TESTS, INITIATOR + ".py")),
                    reason="Mooncake's initiator test file is not shipped in its wheel: set "
                           "MCGUARD_MOONCAKE_TESTS to a Mooncake checkout's mooncake-wheel/tests")
def test_mooncake_initiator_tests_pass_on_the_guarded_engine():
    if not os.path.exists(MOONCAKE_PYTHON):
        pytest.skip("Mooncake's wheel is not installed (make mooncake-venv)")
    mooncake, mooncake_log = run_suite(MOONCAKE_PYTHON, [])
    ours, our_log = run_suite(sys.executable, [SHIM, os.path.join(ROOT, "python")])
    assert mooncake and set(ours) == set(mooncake), (mooncake_log[-3000:], our_log[-3000:])
    worse = [t for t, r in mooncake.items() if r == "ok" and ours[t] != "ok"]
    assert worse == [], our_log[-6000:]
    assert all(r == "ok" for r in ours.values()), our_log[-6000:]
