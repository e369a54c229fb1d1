"""Verified reads beside unverified ones, in one run: NIXL's READ alone
against GuardedNixlAgent's READ checked in digest and tail mode, and
mcguard's own read against its sealed read (over sockets and on one host),
two processes (a producer and this reader), rounds interleaved, medians
and ratios to the unverified read of the same run. Every engine's last
landing is hashed against the producer's bytes.

Run with the interpreter that has NIXL's wheel (make bench-read does).
"""

import argparse
import base64
import ctypes
import hashlib
import json
import mmap
import os
import statistics
import subprocess
import sys
import time

from ..guard import Guard
from .cli import prog
from ..integrations.nixl import GuardedNixlAgent, nixl_api

REGION = 64 << 20
SHAPES = {"64x256KiB": (64, 256 << 10), "512x16KiB": (512, 16 << 10), "1x64MiB": (1, 64 << 20),
          "4096x4KiB": (4096, 4 << 10)}
ENGINES = ["nixl", "nixl-tail", "nixl-digest", "mcguard-socket", "mcguard-socket-tail", "mcguard-socket-digest",
           "mcguard", "mcguard-tail", "mcguard-digest"]
BASE = {"nixl": "nixl", "mcguard-socket": "mcguard-socket", "mcguard": "mcguard"}  # each row's unverified read


def new_region():
    mem = mmap.mmap(-1, REGION)
    return mem, ctypes.addressof(ctypes.c_char.from_buffer(mem))


def serve():
    """The producer: a GuardedNixlAgent (its UCX progress thread answers
    reads) whose guard also serves mcguard's reads; seals a shape's blocks
    on request."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # NIXL logs to standard output
    _, cfg = nixl_api()
    agent = GuardedNixlAgent("producer-%d" % os.getpid(), cfg(enable_prog_thread=True, backends=["UCX"]))
    mem, addr = new_region()
    mem[:] = os.urandom(REGION)
    agent.register_memory([(addr, REGION, 0, "")], "DRAM")
    print(json.dumps({"meta": base64.b64encode(agent.get_agent_metadata()).decode(), "addr": addr,
                      "guard": agent.guard.endpoint}), file=out, flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "seal":
            count, size = int(cmd[1]), int(cmd[2])
            start = time.perf_counter()
            seal = agent.seal([(addr + i * size, size, 0) for i in range(count)])
            took = time.perf_counter() - start
            sha = hashlib.sha256(mem[:count * size]).hexdigest()
            print(json.dumps({"seal": base64.b64encode(seal).decode(), "seal_s": took, "sha": sha}), file=out,
                  flush=True)
        elif cmd[0] == "quit":
            break
    out.flush()
    os._exit(0)  # NIXL's UCX backend can crash in static destructors at exit


class Reader:
    """This process's side: a GuardedNixlAgent (its _agent is NIXL's own,
    the unverified baseline) and two guards, one reading over the socket,
    one on this host."""

    def __init__(self, peer):
        _, cfg = nixl_api()
        self.agent = GuardedNixlAgent("reader-%d" % os.getpid(), cfg(enable_prog_thread=False, backends=["UCX"]))
        self.mem, self.addr = new_region()
        self.agent.register_memory([(self.addr, REGION, 0, "")], "DRAM")
        self.remote_agent = self.agent.add_remote_agent(base64.b64decode(peer["meta"]))
        self.remote = peer["addr"]
        self.session = peer["guard"]
        self.guards = {"mcguard-socket": Guard(listen="127.0.0.1:0", same_host="off"),
                       "mcguard": Guard(listen="127.0.0.1:0")}
        for g in self.guards.values():
            g.register(self.addr, REGION)
        self.handles = {}

    def nixl_read(self, count, size, mode, seal):
        key = (count, size)
        if key not in self.handles:
            local = self.agent.get_xfer_descs([(self.addr + i * size, size, 0) for i in range(count)], "DRAM")
            remote = self.agent.get_xfer_descs([(self.remote + i * size, size, 0) for i in range(count)], "DRAM")
            self.handles[key] = (self.agent.prep_xfer_dlist("", local),
                                 self.agent.prep_xfer_dlist(self.remote_agent, remote))
        local, remote = self.handles[key]
        idx = list(range(count))
        agent = self.agent._agent if mode is None else self.agent
        if mode is None:
            h = agent.make_prepped_xfer("READ", local, idx, remote, idx)
        else:
            self.agent.mode = mode
            h = agent.make_prepped_xfer("READ", local, idx, remote, idx, seal=seal)
        st = agent.transfer(h)
        while st == "PROC":
            st = agent.check_xfer_state(h)
        agent.release_xfer_handle(h)
        if st != "DONE":
            raise RuntimeError("nixl READ ended %s" % st)

    def mcguard_read(self, guard, count, size, mode, seal):
        local = [self.addr + i * size for i in range(count)]
        remote = [self.remote + i * size for i in range(count)]
        if mode is None:
            guard.read(self.session, local, remote, [size] * count)
        else:
            guard.read_sealed(self.session, local, remote, [size] * count, seal, mode=mode)

    def read(self, engine, count, size, seal):
        mode = "tail" if engine.endswith("-tail") else "digest" if engine.endswith("-digest") else None
        row = engine[:-len("-" + mode)] if mode else engine
        if row == "nixl":
            return self.nixl_read(count, size, mode, seal)
        return self.mcguard_read(self.guards[row], count, size, mode, seal)


def run(args):
    env = dict(os.environ, UCX_TLS=args.nixl_tls)
    producer = subprocess.Popen([sys.executable, "-m", "mcguard.tools.readbench", "--serve"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env=env)
    os.environ["UCX_TLS"] = args.nixl_tls
    peer = json.loads(producer.stdout.readline())
    reader = Reader(peer)
    results = {}
    try:
        for shape in args.shapes:
            count, size = SHAPES[shape]
            producer.stdin.write("seal %d %d\n" % (count, size))
            producer.stdin.flush()
            sealed = json.loads(producer.stdout.readline())
            seal = base64.b64decode(sealed["seal"])
            times = {e: [] for e in args.engines}
            for r in range(args.rounds):
                for e in args.engines:
                    start = time.perf_counter()
                    reader.read(e, count, size, seal)
                    times[e].append(time.perf_counter() - start)
                if not args.quiet:
                    print("%s: round %d of %d" % (shape, r + 1, args.rounds), file=sys.stderr, flush=True)
            for e in args.engines:  # every engine's landing hashed against the producer's bytes
                ctypes.memset(reader.addr, 0, count * size)
                reader.read(e, count, size, seal)
                got = hashlib.sha256(reader.mem[:count * size]).hexdigest()
                if got != sealed["sha"]:
                    raise RuntimeError("%s %s: landed bytes differ from the producer's" % (e, shape))
            total = count * size
            results[shape] = {"seal_us": sealed["seal_s"] * 1e6, "engines": {
                e: {"median_gbps": total / statistics.median(t) / 1e9, "min_gbps": total / max(t) / 1e9,
                    "max_gbps": total / min(t) / 1e9, "median_us": statistics.median(t) * 1e6} for e, t in times.items()}}
    finally:
        producer.stdin.write("quit\n")
        producer.stdin.flush()
        producer.wait(timeout=30)
    return results


def table(results, engines):
    lines = ["| shape | engine | GB/s median (min-max) | µs median | ratio to the unverified read |", "|---|---|---|---|---|"]
    for shape, res in results.items():
        for e in engines:
            r = res["engines"][e]
            base = BASE[e.replace("-tail", "").replace("-digest", "")]
            ratio = r["median_gbps"] / res["engines"][base]["median_gbps"] if base in res["engines"] else float("nan")
            lines.append("| %s | %s | %.2f (%.2f-%.2f) | %.0f | %.2f |" % (
                shape, e, r["median_gbps"], r["min_gbps"], r["max_gbps"], r["median_us"], ratio))
        lines.append("| %s | producer's seal | | %.0f | |" % (shape, res["seal_us"]))
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog=prog("readbench"), description=__doc__.split("\n\n")[0])
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--engines", nargs="+", default=ENGINES, choices=ENGINES)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--nixl-tls", default="tcp", help="UCX_TLS for NIXL (default tcp; 'cma' or 'sm' on one host)")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    if args.serve:
        return serve()
    results = run(args)
    print(table(results, args.engines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": args.rounds, "nixl_tls": args.nixl_tls, "results": results}, f, indent=1)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
