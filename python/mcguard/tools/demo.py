"""make demo: the PD stress with injected lag, verify=off beside verify=tail.

verify=off trusts the transport's acknowledgement and must show
mismatches (the bug); verify=tail must show none. Exit 0 only when both
hold.
"""

import argparse
import json
import shlex
import subprocess
import sys

from .cli import prog
from .stress import SUMMARY_COLUMNS, table


def run_stress(verify, seconds, extra):
    cmd = [sys.executable, "-m", "mcguard.tools.stress", "--verify", verify, "--inject", "lag",
           "--seconds", str(seconds), "--json"] + extra
    print("$ " + shlex.join(cmd), file=sys.stderr, flush=True)  # pasteable, interpreter included
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    lines = proc.stdout.strip().splitlines()
    if not lines:
        raise SystemExit("stress run printed nothing (exit %d)" % proc.returncode)
    return json.loads(lines[-1])


def main(argv=None):
    p = argparse.ArgumentParser(prog=prog("demo"))
    p.add_argument("--seconds", type=float, default=5.0)
    a, extra = p.parse_known_args(argv)
    rows = [run_stress(mode, a.seconds, extra) for mode in ("off", "tail")]
    off, tail = rows
    print()
    print("PD stress on loopback with injected lag (writes acknowledged before they land):")
    print(table(rows, SUMMARY_COLUMNS))
    print()
    good = off["mismatches"] > 0 and tail["mismatches"] == 0 and tail["ok"] > 0 and tail["failed"] == 0
    print("verify=off : %d of %d descriptors reported successful held stale bytes at the decoder"
          % (off["mismatches"], off["descriptors"]))
    print("verify=tail: %d of %d mismatched, %d failed, %d polling retries"
          % (tail["mismatches"], tail["descriptors"], tail["failed"], tail["retries"]))
    print("RESULT: %s" % ("ok: the guard closes the hole the lag opens" if good else
                          "UNEXPECTED: off must show mismatches and tail none"))
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
