"""PD stress on loopback: python3 -m mcguard.stress [--verify off|tail] [--inject none|lag] ...

Decode processes (one per session) each open a guard, register a KV-like
region of blocks and, when told a batch is complete, sync and hash every
destination block. One prefill process writes batches of fresh random
blocks from several threads to the sessions through its own guard, and
after every successful transfer asks the decode side to check it. A
mismatch is a descriptor reported successful whose destination hash
differs from the source's hash taken after the transfer (src_hash_post).

Shows progress while running and ends with a summary table; with --json
the last line is one JSON object. Exit status 1 when mismatches > 0.
"""

import argparse
import ctypes
import hashlib
import json
import multiprocessing as mp
import os
import random
import sys
import threading
import time
from multiprocessing.connection import Client, Listener

from .guard import Guard, MCGuardError

AUTHKEY = b"mcguard-stress"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python3 -m mcguard.stress", description=__doc__.splitlines()[0])
    p.add_argument("--verify", choices=["off", "tail"], default="tail")
    p.add_argument("--inject", choices=["none", "lag"], default="none")
    p.add_argument("--lag-max-ms", type=float, default=20.0, help="lag: the longest delay before a write lands")
    p.add_argument("--transport", choices=["tcp"], default="tcp")
    p.add_argument("--sessions", type=int, default=2, help="decode processes, one session each")
    p.add_argument("--threads", type=int, default=4, help="prefill threads")
    p.add_argument("--blocks", type=int, default=256, help="KV blocks per session")
    p.add_argument("--block-bytes", type=int, default=64 << 10)
    p.add_argument("--batch", type=int, default=32, help="descriptors per transfer")
    p.add_argument("--seconds", type=float, default=5.0, help="run time")
    p.add_argument("--batches", type=int, default=0, help="stop each thread after this many batches (0: no limit)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true", help="end with one JSON line")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    a = p.parse_args(argv)
    for name in ("sessions", "threads", "blocks", "block_bytes", "batch"):
        if getattr(a, name) < 1:
            p.error("--%s must be at least 1" % name.replace("_", "-"))
    if a.blocks < a.threads * a.batch:
        p.error("--blocks (%d) must be at least --threads x --batch (%d) so threads own disjoint blocks"
                % (a.blocks, a.threads * a.batch))
    if a.seconds <= 0 and a.batches <= 0:
        p.error("give --seconds > 0 or --batches > 0")
    return a


def block_hash(view):
    return hashlib.sha1(view).digest()


POOL_BYTES = 8 << 20


class BlockFiller:
    """Fresh contents for source blocks, cheaply: each block is a copy from
    a random offset of a pool of random bytes, and its last 8 bytes are a
    sequence number unique to the process, so no block ever repeats the
    tail of an earlier one (a tail check must see every new write)."""

    def __init__(self, rnd, block_bytes, thread):
        self.rnd, self.bb = rnd, block_bytes
        self.pool = ctypes.create_string_buffer(rnd.randbytes(POOL_BYTES + block_bytes), POOL_BYTES + block_bytes)
        self.pool_addr = ctypes.addressof(self.pool)
        self.seq = thread << 48

    def fill(self, view, addr, off):
        self.seq += 1
        ctypes.memmove(addr, self.pool_addr + self.rnd.randrange(POOL_BYTES), self.bb)
        view[off + self.bb - 8:off + self.bb] = self.seq.to_bytes(8, "little")


# ---- decode side -------------------------------------------------------

def decode_main(parent, index, args):
    guard = Guard(listen="127.0.0.1:0", inject=args.inject, inject_lag_max_ms=args.lag_max_ms,
                  inject_seed=args.seed * 101 + index)
    size = args.blocks * args.block_bytes
    region = (ctypes.c_char * size)()
    base = ctypes.addressof(region)
    view = memoryview(region).cast("B")
    guard.register(base, size)
    listener = Listener(("127.0.0.1", 0), authkey=AUTHKEY)
    parent.send({"session": guard.endpoint, "base": base, "check": listener.address})

    def serve(conn):
        bb = args.block_bytes
        with conn:
            while True:
                try:
                    blocks, hashes = conn.recv()
                except (EOFError, OSError):
                    return
                # The receiver's half: after the notice, sync, then read.
                guard.sync([base + b * bb for b in blocks], [bb] * len(blocks))
                bad = sum(1 for b, h in zip(blocks, hashes) if block_hash(view[b * bb:(b + 1) * bb]) != h)
                conn.send(bad)

    def accept():
        while True:
            try:
                conn = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        parent.recv()  # "stop", or EOF when the parent dies
    except EOFError:
        pass
    listener.close()
    guard.close()


# ---- prefill side ------------------------------------------------------

class Counters:
    FIELDS = ("transfers", "ok", "failed", "descriptors", "bytes", "mismatches", "retries")

    def __init__(self):
        self.lock = threading.Lock()
        for f in self.FIELDS:
            setattr(self, f, 0)
        self.errors = {}

    def add(self, **kw):
        with self.lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)

    def error(self, e):
        with self.lock:
            self.errors[e.name] = self.errors.get(e.name, 0) + 1
            self.first_error = getattr(self, "first_error", str(e))

    def snapshot(self):
        with self.lock:
            return {f: getattr(self, f) for f in self.FIELDS}


def prefill_main(parent, sessions, args):
    guard = Guard(verify=args.verify)
    bb, batch = args.block_bytes, args.batch
    size = args.threads * batch * bb
    region = (ctypes.c_char * size)()
    base = ctypes.addressof(region)
    view = memoryview(region).cast("B")
    guard.register(base, size)
    counters = Counters()
    stop = threading.Event()
    start = time.monotonic()

    def worker(t):
        rnd = random.Random(args.seed * 1000 + t)
        mine = [b for b in range(args.blocks) if b % args.threads == t]
        checkers = [Client(tuple(s["check"]), authkey=AUTHKEY) for s in sessions]
        src0 = base + t * batch * bb
        srcs = [src0 + i * bb for i in range(batch)]
        lens = [bb] * batch
        filler = BlockFiller(rnd, bb, t)
        off = t * batch * bb
        n = 0
        try:
            while not stop.is_set() and (args.batches <= 0 or n < args.batches):
                s = sessions[n % len(sessions)]
                checker = checkers[n % len(sessions)]
                n += 1
                blocks = rnd.sample(mine, batch)
                for i in range(batch):
                    filler.fill(view, srcs[i], off + i * bb)
                dsts = [s["base"] + b * bb for b in blocks]
                try:
                    res = guard.transfer(s["session"], srcs, dsts, lens)
                except MCGuardError as e:
                    counters.add(transfers=1, failed=1)
                    counters.error(e)
                    continue
                hashes = [block_hash(view[off + i * bb:off + (i + 1) * bb]) for i in range(batch)]
                checker.send((blocks, hashes))
                bad = checker.recv()
                counters.add(transfers=1, ok=1, descriptors=batch, bytes=batch * bb,
                             mismatches=bad, retries=res.retries)
        finally:
            for c in checkers:
                c.close()

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(args.threads)]
    for th in threads:
        th.start()
    deadline = start + args.seconds if args.seconds > 0 else float("inf")
    next_report = start + 1.0
    while any(th.is_alive() for th in threads):
        now = time.monotonic()
        if now >= deadline:
            stop.set()
        if now >= next_report and not args.quiet:
            c = counters.snapshot()
            print("[%5.1fs] transfers %6d  ok %6d  failed %4d  mismatches %5d  retries %6d  %6.2f Gbit/s"
                  % (now - start, c["transfers"], c["ok"], c["failed"], c["mismatches"], c["retries"],
                     c["bytes"] * 8 / 1e9 / (now - start)), file=sys.stderr, flush=True)
            next_report += 1.0
        for th in threads:
            th.join(timeout=0.05)
    elapsed = time.monotonic() - start
    result = counters.snapshot()
    result["seconds"] = round(elapsed, 3)
    result["errors"] = dict(counters.errors)
    result["first_error"] = getattr(counters, "first_error", "")
    guard.close()
    parent.send(result)


# ---- driver ------------------------------------------------------------

def run(args):
    """Run one stress and return its result dict."""
    ctx = mp.get_context("spawn")  # never fork: a forked child cannot use the library
    decoders, pipes = [], []
    try:
        for i in range(args.sessions):
            here, there = ctx.Pipe()
            p = ctx.Process(target=decode_main, args=(there, i, args), daemon=True)
            p.start()
            decoders.append(p)
            pipes.append(here)
        sessions = []
        for p, pipe in zip(decoders, pipes):
            if not pipe.poll(60):
                raise RuntimeError("a decode process did not start (exit code %s)" % p.exitcode)
            sessions.append(pipe.recv())
        here, there = ctx.Pipe()
        prefill = ctx.Process(target=prefill_main, args=(there, sessions, args), daemon=True)
        prefill.start()
        limit = (args.seconds if args.seconds > 0 else 3600) + 120
        if not here.poll(limit):
            prefill.terminate()
            raise RuntimeError("the prefill process did not finish (exit code %s)" % prefill.exitcode)
        result = here.recv()
        prefill.join(30)
    finally:
        for pipe in pipes:
            try:
                pipe.send("stop")
            except (OSError, BrokenPipeError):
                pass
        for p in decoders:
            p.join(30)
            if p.is_alive():
                p.terminate()
    seconds = result["seconds"] or 1e-9
    out = {
        "verify": args.verify, "inject": args.inject, "transport": args.transport,
        "transfers": result["transfers"], "descriptors": result["descriptors"], "bytes": result["bytes"],
        "ok": result["ok"], "failed": result["failed"], "mismatches": result["mismatches"],
        "retries": result["retries"], "seconds": seconds,
        "gbps": round(result["bytes"] * 8 / 1e9 / seconds, 3),
    }
    if result["errors"]:
        out["errors"] = result["errors"]
        out["first_error"] = result["first_error"]
    return out


def table(rows, columns):
    """A plain text table of dicts."""
    cells = [[str(c) for c in columns]] + [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


SUMMARY_COLUMNS = ("verify", "inject", "transport", "transfers", "ok", "failed", "descriptors",
                   "mismatches", "retries", "seconds", "gbps")


def main(argv=None):
    args = parse_args(argv)
    if not args.quiet:
        print("mcguard stress: verify=%s inject=%s sessions=%d threads=%d batch=%d x %d B, %s"
              % (args.verify, args.inject, args.sessions, args.threads, args.batch, args.block_bytes,
                 "%d batches/thread" % args.batches if args.batches > 0 else "%gs" % args.seconds),
              file=sys.stderr, flush=True)
    out = run(args)
    print(table([out], SUMMARY_COLUMNS))
    if out.get("errors"):
        print("errors: %s (first: %s)" % (out["errors"], out["first_error"]))
    if args.json:
        print(json.dumps(out))
    return 1 if out["mismatches"] > 0 else 0


if __name__ == "__main__":
    sys.exit(main())
