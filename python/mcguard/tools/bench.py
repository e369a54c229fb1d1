"""make bench: stress throughput of verify=off and verify=tail, side by side.

Runs the two modes alternately, the same flags each time, for --rounds
rounds, and reports each mode's median Gbit/s and tail/off ratio. The
ratio from alternating runs in one session is what to compare across
machines; the absolute figures depend on the machine's load.
"""

import argparse
import json
import statistics
import sys

from .cli import prog
from .stress import parse_args, run, table


def main(argv=None):
    p = argparse.ArgumentParser(prog=prog("bench"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--inject", default="none")
    a, extra = p.parse_known_args(argv)
    gbps = {"off": [], "tail": []}
    rows = []
    for r in range(a.rounds):
        for mode in ("off", "tail"):
            args = parse_args(["--verify", mode, "--inject", a.inject, "--seconds", str(a.seconds),
                               "--quiet"] + extra)
            out = run(args)
            if out["mismatches"] or out["failed"]:
                print("round %d %s: mismatches %d failed %d" % (r, mode, out["mismatches"], out["failed"]),
                      file=sys.stderr)
            gbps[mode].append(out["gbps"])
            out["round"] = r
            rows.append(out)
            print("round %d/%d  verify=%-4s  %.3f Gbit/s" % (r + 1, a.rounds, mode, out["gbps"]),
                  file=sys.stderr, flush=True)
    print(table(rows, ("round", "verify", "inject", "transfers", "ok", "failed", "mismatches",
                       "retries", "seconds", "gbps")))
    med = {m: statistics.median(v) for m, v in gbps.items()}
    summary = {"off_gbps": med["off"], "tail_gbps": med["tail"],
               "tail_over_off": round(med["tail"] / med["off"], 3) if med["off"] else None,
               "rounds": a.rounds, "seconds": a.seconds, "flags": extra}
    print("median: off %.3f Gbit/s, tail %.3f Gbit/s, tail/off = %s"
          % (med["off"], med["tail"], summary["tail_over_off"]))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
