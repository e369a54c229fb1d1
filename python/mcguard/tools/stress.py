"""PD stress on loopback: python3 -m mcguard.stress [--verify MODE] [--inject FAULT] [--matrix] ...

Decode processes (one per session) each open a guard, register a KV-like
region of blocks and, when told a batch is complete, sync and hash every
destination block. One prefill process writes batches of fresh random
blocks from several threads to the sessions through its own guard, and
after every successful transfer asks the decode side to check it. A
mismatch is a descriptor reported successful whose destination hash
differs from the source's hash taken after the transfer (src_hash_post).

verify=off is the unguarded baseline on both sides: the sender trusts the
transport and the decoder reads without mc_guard_sync. Other modes sync
first (digest mode by transfer id, comparing digests: a failed sync counts
as a failed transfer, not a success).

--matrix runs every (inject, verify) pair and ends with one JSON line
{"matrix": [...]}; its exit status is 0 when every cell came out as
docs/VERIFICATION.md expects.

--abort aborts requests at random on both sides and reuses their blocks at
once: the prefill side gives a fraction of transfers a short deadline, the
decode side gives up on a fraction of requests while their transfer is on
its way. Either way the decode side then (with --quiesce on) quiesces the
blocks, writes the next request's bytes into them, and hashes them again
later: a block whose bytes changed was corrupted by the aborted request's
late bytes. The fault that makes the race is the hold fault over TCP
(writes delivered --lag-max-ms late), lag on the NIC model.

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

from . import texttable
from .cli import prog
from ..guard import STATUS_NAMES, VERIFY_MODES, Guard, MCGuardError


def _status_of(name):
    return next((code for code, n in STATUS_NAMES.items() if n == name), -1)

AUTHKEY = b"mcguard-stress"
MODES = [m for m in VERIFY_MODES if m is not None]  # the header's order
FAULTS = ["none", "lag", "drop", "tear", "reorder", "stale", "hold", "lie"]
DELIVERY_FAULTS = FAULTS[1:6]  # what verification must catch; hold makes the abort race
# Over an engine (--transport mooncake): stale needs the destination's
# bytes, which the callbacks do not see; lie is the engine's own fault
# (its reads answered from a copy of writes it never made).
ENGINE_DELIVERY_FAULTS = [f for f in DELIVERY_FAULTS if f != "stale"] + ["lie"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog=prog("stress"), description=__doc__.splitlines()[0])
    p.add_argument("--verify", choices=MODES, default="tail")
    p.add_argument("--inject", choices=FAULTS, default="none")
    p.add_argument("--inject-rate", type=float, default=0.1, help="drop, tear, stale, lie: fraction of writes hit")
    p.add_argument("--lag-max-ms", type=float, default=20.0, help="lag, reorder: the longest delay before a write lands")
    p.add_argument("--zero-tail", type=int, default=None,
                   help="zero the last N bytes of every block, as padded KV pages are "
                        "(default 0; block-bytes/16 under --inject stale, the fault's precondition)")
    p.add_argument("--max-retries", type=int, default=None, help="verification polling rounds (guard default 500)")
    p.add_argument("--on-mismatch", choices=["fail", "resend"], default=None,
                   help="what the sender does when read-back never matches (default fail; resend with --matrix)")
    p.add_argument("--matrix", action="store_true", help="run every (inject, verify) pair")
    p.add_argument("--abort", action="store_true", help="abort requests at random on both sides, reuse their blocks")
    p.add_argument("--quiesce", choices=["on", "off"], default="on",
                   help="--abort: the decode side quiesces aborted blocks before it reuses them")
    p.add_argument("--abort-rate", type=float, default=0.2,
                   help="--abort: fraction of requests each side aborts")
    p.add_argument("--transport", choices=["tcp", "same-host", "rdma", "auto", "rdma-model", "mooncake"], default="tcp",
                   help="rdma fails with the reason where there is no usable RDMA device; rdma-model runs "
                        "the RDMA transport on the software NIC (tests/nicmodel), where --inject lag "
                        "delays the visibility of completed WRITEs; tcp sends the bytes through the socket, "
                        "same-host moves them within the machine without the socket (the sender writes into the "
                        "receiver with process_vm_writev; under --inject the receiver copies them out of "
                        "the sender, so its faults apply; an error where neither can); mooncake moves the bytes with Mooncake's "
                        "own engine (its wheel, TCP, P2PHANDSHAKE) under the guard, faults injected at the "
                        "guard's callbacks into it")
    p.add_argument("--receive-memory", choices=["registered", "allocated"], default="registered",
                   help="decode side's KV region: memory it registers, or Guard.alloc's shared memory, which a "
                        "same-host sender maps and writes with memcpy")
    p.add_argument("--rdma-qps", type=int, default=1,
                   help="RDMA: queue pairs per session that each batch's writes are striped over (1 to 16)")
    p.add_argument("--sessions", type=int, default=2, help="decode processes, one session each")
    p.add_argument("--threads", type=int, default=4, help="prefill threads")
    p.add_argument("--blocks", type=int, default=256, help="KV blocks per session")
    p.add_argument("--block-bytes", type=int, default=64 << 10)
    p.add_argument("--batch", type=int, default=32, help="descriptors per transfer")
    p.add_argument("--max-batch", type=int, default=None,
                   help="the sender's max_batch: a batch of more descriptors goes in chunks, each chunk's "
                        "writes posted while the one before it is checked (guard default 512)")
    p.add_argument("--layout", choices=["scattered", "consecutive"], default="scattered",
                   help="which destination blocks a batch writes: scattered (a random sample of the thread's "
                        "blocks, each descriptor a write of its own) or consecutive (a run of the thread's "
                        "blocks from a random start, which mcguard's TCP and RDMA data planes join into one "
                        "write, faults and all)")
    p.add_argument("--seconds", type=float, default=None, help="run time (default 5; 2 per cell with --matrix)")
    p.add_argument("--batches", type=int, default=0, help="stop each thread after this many batches (0: no limit)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true", help="end with one JSON line")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="serve the prefill guard's Prometheus metrics on this port during the run (needs prometheus_client)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    a = p.parse_args(argv)
    for name in ("sessions", "threads", "blocks", "block_bytes", "batch"):
        if getattr(a, name) < 1:
            p.error("--%s must be at least 1" % name.replace("_", "-"))
    if a.blocks < a.threads * a.batch:
        p.error("--blocks (%d) must be at least --threads x --batch (%d) so threads own disjoint blocks"
                % (a.blocks, a.threads * a.batch))
    if not 1 <= a.rdma_qps <= 16:
        p.error("--rdma-qps must be 1 to 16")
    if a.inject == "lie" and a.transport != "mooncake":
        p.error("--inject lie is an engine's fault (reads answered from its own copy): use it with --transport mooncake")
    if a.transport == "rdma-model" and a.inject not in ("none", "lag"):
        p.error("--transport rdma-model injects only lag (the NIC model's delayed visibility)")
    if a.transport == "mooncake":
        if a.inject == "stale":
            p.error("--transport mooncake: stale needs the destination's bytes, which the callbacks into "
                    "Mooncake do not see; use lag, drop, tear, reorder or hold")
        if a.abort:
            p.error("--transport mooncake: --abort needs the receiver's quiesce, which cannot stop "
                    "Mooncake's own writes")
    if a.abort and a.inject == "none":
        # The race needs bytes that arrive late: held writes over TCP, the
        # NIC model's posted writes over RDMA.
        a.inject = "lag" if a.transport == "rdma-model" else "hold"
        a.inject_rate = 0.03 if a.inject == "hold" else a.inject_rate
        a.lag_max_ms = max(a.lag_max_ms, 100.0)
    if a.seconds is None:
        a.seconds = 2.0 if a.matrix else 5.0
    # The matrix repairs what read-back finds, so its cells show successes
    # that were checked rather than a stall per lost write.
    if a.on_mismatch is None:
        a.on_mismatch = "resend" if a.matrix else "fail"
    if a.max_retries is None and a.matrix:
        a.max_retries = 20
    if a.seconds <= 0 and a.batches <= 0:
        p.error("give --seconds > 0 or --batches > 0")
    a.zero_tail_given = a.zero_tail is not None
    if a.zero_tail is None:
        a.zero_tail = a.block_bytes // 16 if a.inject == "stale" else 0
    if not 0 <= a.zero_tail <= a.block_bytes - 16:
        p.error("--zero-tail must be in [0, block-bytes - 16]")
    return a


def block_picker(args, t, rnd):
    """Thread t's choice of the destination blocks of its next batch, as
    --layout says: a random sample of its blocks (every threads-th one), or
    a run from a random start in its own stretch of them."""
    if args.layout == "consecutive":
        per = args.blocks // args.threads
        mine = list(range(t * per, (t + 1) * per))

        def run():
            first = rnd.randrange(len(mine) - args.batch + 1)
            return mine[first:first + args.batch]
        return run
    mine = [b for b in range(args.blocks) if b % args.threads == t]
    return lambda: rnd.sample(mine, args.batch)


def transport_config(args):
    """The guard settings that select args.transport."""
    if args.transport == "mooncake":
        return {}  # the data plane is the engine handed to the guard
    if args.transport == "rdma-model":
        return {"transport": "rdma", "verbs_library": args.nic_model, "rdma_qps": args.rdma_qps}
    if args.transport == "tcp":
        return {"transport": "tcp", "same_host": "off"}
    if args.transport == "same-host":
        return {"transport": "tcp", "same_host": "required"}
    return {"transport": args.transport, "rdma_qps": args.rdma_qps}


def open_guard(args, cfg):
    """(guard, the name peers give its session): over mcguard's own data
    plane its endpoint; over Mooncake the Mooncake engine's, which the
    guard wraps."""
    if args.transport != "mooncake":
        g = Guard(cfg)
        return g, g.endpoint
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        raise MCGuardError(_status_of("MC_ERR_CONFIG"),
                           "--transport mooncake needs Mooncake's wheel (%s): pip install "
                           "mooncake-transfer-engine-non-cuda, or run build/venv-mooncake/bin/python -m "
                           "mcguard.stress after make mooncake-venv" % e) from None
    from ..engine import MooncakeEngine
    te = TransferEngine()
    if te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise MCGuardError(_status_of("MC_ERR_CONFIG"), "Mooncake's initialize failed (its log says why)")
    g = Guard(cfg, engine=MooncakeEngine(te))
    g.mooncake = te  # kept alive as long as the guard
    return g, "127.0.0.1:%d" % te.get_rpc_port()


def block_hash(view):
    return hashlib.sha1(view).digest()


POOL_BYTES = 8 << 20
SETTLE_LIMIT_S = 10.0  # the longest a worker waits for a failed transfer's engine calls to end


class BlockFiller:
    """Fresh contents for source blocks, cheaply: each block is a copy from
    a random offset of a pool of random bytes, and its last 8 bytes are a
    sequence number unique to the process, so no block ever repeats the
    tail of an earlier one (a tail check must see every new write). With
    zero_tail, the last zero_tail bytes are zeros instead (the stamp moves
    in front of them): every block then ends alike, as padded KV pages do."""

    def __init__(self, rnd, block_bytes, thread, zero_tail=0):
        self.rnd, self.bb, self.zero = rnd, block_bytes, zero_tail
        self.pool = ctypes.create_string_buffer(rnd.randbytes(POOL_BYTES + block_bytes), POOL_BYTES + block_bytes)
        self.pool_addr = ctypes.addressof(self.pool)
        self.seq = thread << 48

    def fill(self, view, addr, off):
        self.seq += 1
        ctypes.memmove(addr, self.pool_addr + self.rnd.randrange(POOL_BYTES), self.bb)
        end = off + self.bb - self.zero
        view[end - 8:end] = self.seq.to_bytes(8, "little")
        if self.zero:
            ctypes.memset(addr + self.bb - self.zero, 0, self.zero)


# ---- decode side -------------------------------------------------------

def decode_main(parent, index, args):
    try:
        # The NIC model lags instead; over Mooncake the prefill's callbacks do.
        tcp_inject = "none" if args.transport in ("rdma-model", "mooncake") else args.inject
        guard, session = open_guard(args, dict(listen="127.0.0.1:0", inject=tcp_inject, inject_lag_max_ms=args.lag_max_ms,
                                               inject_rate=args.inject_rate, inject_seed=args.seed * 101 + index,
                                               **transport_config(args)))
    except MCGuardError as e:
        parent.send({"error": str(e)})
        return
    size = args.blocks * args.block_bytes
    if args.receive_memory == "allocated":
        base = guard.alloc(size)  # the guard's: freed by its close
        region = (ctypes.c_char * size).from_address(base)
    else:
        region = (ctypes.c_char * size)()
        base = ctypes.addressof(region)
        guard.register(base, size)
    view = memoryview(region).cast("B")
    listener = Listener(("127.0.0.1", 0), authkey=AUTHKEY)
    parent.send({"session": session, "guard": guard.endpoint, "base": base, "check": listener.address})

    reuse = Reuser(guard, base, view, args)

    def serve(conn):
        bb = args.block_bytes
        with conn:
            while True:
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    return
                if msg[0] in ("start", "aborted"):
                    conn.send(reuse.handle(*msg))
                    continue
                blocks, hashes, transfer_id = msg
                # The receiver's half: after the notice, sync, then read.
                try:
                    if args.verify == "digest":
                        guard.sync_transfers([transfer_id])
                    elif args.verify != "off":
                        guard.sync([base + b * bb for b in blocks], [bb] * len(blocks))
                except MCGuardError as e:
                    conn.send(("failed", e.name))
                    continue
                bad = sum(1 for b, h in zip(blocks, hashes) if block_hash(view[b * bb:(b + 1) * bb]) != h)
                conn.send(("ok", bad))

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
        parent.send(reuse.report())
    except (EOFError, OSError):
        pass
    listener.close()
    guard.close()


class Reuser:
    """The decode side of --abort: it gives up on requests at random and
    reuses the blocks of every aborted request at once (after a quiesce,
    with --quiesce on): the next request's bytes go in, and a while later
    (past the longest a late write takes) every block is hashed again. A
    block that changed, with no request of its own since, was overwritten
    by an aborted request's late bytes."""

    def __init__(self, guard, base, view, args):
        self.guard, self.base, self.view, self.args = guard, base, view, args
        self.rnd = random.Random(args.seed * 7919 + base % 1000)
        self.lock = threading.Lock()
        self.version = {}  # block -> requests started on it
        self.counts = {"decode_aborts": 0, "reused_blocks": 0, "corrupted_blocks": 0, "quiesces": 0, "never_began": 0}

    def handle(self, kind, blocks, stamps=None):
        with self.lock:
            if kind == "start":
                for b in blocks:
                    self.version[b] = self.version.get(b, 0) + 1
                if self.rnd.random() >= self.args.abort_rate:
                    return ("go", False)
                self.counts["decode_aborts"] += 1
            owned = {b: self.version.get(b, 0) for b in blocks}  # the aborted request's blocks, as of now
        if kind == "start":
            # Given up while its transfer is on its way: once one of its own
            # blocks landed (its stamp is there: it began before the
            # quiesce), after a while.
            delay = self.rnd.uniform(0, self.args.lag_max_ms / 2000)
            threading.Thread(target=self.reuse, args=(owned, dict(zip(blocks, stamps)), delay), daemon=True).start()
            return ("go", True)
        threading.Thread(target=self.reuse, args=(owned,), daemon=True).start()
        return ("reused", True)

    def reuse(self, owned, stamps=None, delay=0):
        bb = self.args.block_bytes
        blocks = list(owned)
        if stamps is not None:
            end = bb - self.args.zero_tail
            give_up = time.monotonic() + 2
            while not any(bytes(self.view[b * bb + end - 8:b * bb + end]) == st for b, st in stamps.items()):
                if time.monotonic() > give_up:
                    with self.lock:
                        self.counts["never_began"] += 1
                    return  # it never began: nothing in flight to race
                time.sleep(0.001)
            time.sleep(delay)
        if self.args.quiesce == "on":
            self.guard.quiesce([self.base + b * bb for b in blocks], [bb] * len(blocks))
            with self.lock:
                self.counts["quiesces"] += 1
        expect = {}
        with self.lock:
            for b in blocks:
                if self.version.get(b, 0) != owned[b]:
                    continue  # a newer request has it already: not ours to reuse
                self.view[b * bb:(b + 1) * bb] = os.urandom(bb)  # the next request's bytes
                expect[b] = (owned[b], block_hash(self.view[b * bb:(b + 1) * bb]))
        threading.Timer(self.args.lag_max_ms / 1000 + 0.2, self.check, args=(expect,)).start()

    def check(self, expect):
        bb = self.args.block_bytes
        with self.lock:
            for b, (version, h) in expect.items():
                if self.version.get(b, 0) != version:
                    continue  # a newer request writes it now
                self.counts["reused_blocks"] += 1
                if block_hash(self.view[b * bb:(b + 1) * bb]) != h:
                    self.counts["corrupted_blocks"] += 1

    def report(self):
        time.sleep(self.args.lag_max_ms / 1000 + 0.3)  # the last checks
        with self.lock:
            return dict(self.counts)


# ---- prefill side ------------------------------------------------------

class Counters:
    FIELDS = ("transfers", "ok", "failed", "descriptors", "bytes", "mismatches", "retries", "resends", "settles_late",
              "settle_timeouts")

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
    cfg = dict(verify=args.verify, on_mismatch=args.on_mismatch, **transport_config(args))
    if args.max_retries is not None:
        cfg["max_retries"] = args.max_retries
    if args.max_batch is not None:
        cfg["max_batch"] = args.max_batch
    if args.transport == "mooncake":  # faults at the callbacks into Mooncake
        cfg.update(inject=args.inject, inject_lag_max_ms=args.lag_max_ms, inject_rate=args.inject_rate,
                   inject_seed=args.seed * 7)
    try:
        guard, _ = open_guard(args, cfg)
        if args.transport == "mooncake":
            for s in sessions:  # where digest notices go
                guard.set_peer_guard(s["session"], s["guard"])
    except MCGuardError as e:
        parent.send({"error": str(e)})
        return
    if args.metrics_port:
        from prometheus_client import CollectorRegistry, start_http_server
        from ..integrations.metrics import Collector
        registry = CollectorRegistry()
        registry.register(Collector(guard))
        start_http_server(args.metrics_port, addr="127.0.0.1", registry=registry)
    bb, batch = args.block_bytes, args.batch
    size = args.threads * batch * bb
    region = (ctypes.c_char * size)()
    base = ctypes.addressof(region)
    view = memoryview(region).cast("B")
    guard.register(base, size)
    counters = Counters()
    stop = threading.Event()
    start = time.monotonic()

    def settle_engine(transfer_id):
        # Over an engine nothing can refuse a failed transfer's writes that
        # are still on their way (quiesce cannot stop the engine's own
        # writes), so, as the guard's docs tell an application, its blocks
        # are not written again until the engine can no longer deliver
        # them: until none of that transfer's engine calls is running, held
        # writes included (wait_engine_calls; other workers' transfers go on
        # meanwhile). The fault's longest delay is not enough on its own: a
        # held write still goes through the engine, and Python, after it.
        # Over TCP the receiver's sync waits for them instead.
        if args.transport != "mooncake" or args.inject not in ("lag", "reorder", "hold"):
            return
        time.sleep(args.lag_max_ms / 1000)
        if engine_calls_ended(transfer_id, 0):
            return
        counters.add(settles_late=1)
        if not engine_calls_ended(transfer_id, int(SETTLE_LIMIT_S * 1000)):
            counters.add(settle_timeouts=1)  # the run ends: its blocks cannot be reused safely
            stop.set()

    def engine_calls_ended(transfer_id, timeout_ms):
        """Whether none of the transfer's engine calls runs any more, waiting
        at most timeout_ms (MC_ERR_TIMEOUT: some still do)."""
        try:
            guard.wait_engine_calls(transfer_id, timeout_ms)
            return True
        except MCGuardError as e:
            if e.name != "MC_ERR_TIMEOUT":
                raise
            return False

    def worker(t):
        rnd = random.Random(args.seed * 1000 + t)
        pick = block_picker(args, t, rnd)
        checkers = [Client(tuple(s["check"]), authkey=AUTHKEY) for s in sessions]
        src0 = base + t * batch * bb
        srcs = [src0 + i * bb for i in range(batch)]
        lens = [bb] * batch
        filler = BlockFiller(rnd, bb, t, args.zero_tail)
        off = t * batch * bb
        n = 0
        try:
            while not stop.is_set() and (args.batches <= 0 or n < args.batches):
                s = sessions[n % len(sessions)]
                checker = checkers[n % len(sessions)]
                n += 1
                blocks = pick()
                for i in range(batch):
                    filler.fill(view, srcs[i], off + i * bb)
                dsts = [s["base"] + b * bb for b in blocks]
                decode_aborts, deadline = False, 0
                if args.abort:
                    end = bb - args.zero_tail  # each source block's stamp: its own, unique
                    stamps = [bytes(view[off + i * bb + end - 8:off + i * bb + end]) for i in range(batch)]
                    checker.send(("start", blocks, stamps))
                    _, decode_aborts = checker.recv()
                    if rnd.random() < args.abort_rate:
                        deadline = max(1, int(args.lag_max_ms / 4))  # shorter than a held write
                try:
                    res = guard.transfer(s["session"], srcs, dsts, lens, deadline_ms=deadline)
                except MCGuardError as e:
                    counters.add(transfers=1, failed=1)
                    counters.error(e)
                    if args.abort and not decode_aborts:  # the decode side frees the request's blocks
                        checker.send(("aborted", blocks))
                        checker.recv()
                    if e.transfer_id is not None:  # else nothing was sent
                        settle_engine(e.transfer_id)
                    continue
                if decode_aborts:  # gone at the decode side: nothing to read
                    counters.add(transfers=1, ok=1)
                    continue
                hashes = [block_hash(view[off + i * bb:off + (i + 1) * bb]) for i in range(batch)]
                checker.send((blocks, hashes, res.id))
                verdict, detail = checker.recv()
                if verdict == "failed":  # the receiver's sync caught it
                    counters.add(transfers=1, failed=1, retries=res.retries, resends=res.resends)
                    counters.error(MCGuardError(_status_of(detail), "receiver sync failed"))
                    settle_engine(res.id)
                    continue
                counters.add(transfers=1, ok=1, descriptors=batch, bytes=batch * bb,
                             mismatches=detail, retries=res.retries, resends=res.resends)
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
    stats = guard.stats()
    result["same_host_pushed_bytes"] = stats.get("same_host_pushed_bytes", 0)
    result["same_host_mapped_bytes"] = stats.get("same_host_mapped_bytes", 0)
    result["pipelined_chunks"] = stats.get("pipelined_chunks", 0)
    result["peer_checked"] = stats.get("peer_checked", 0)
    guard.close()
    parent.send(result)


# ---- driver ------------------------------------------------------------

def nic_model_path():
    """The RDMA NIC model (tests/nicmodel in mcguard's repository, built by
    make build), which the rdma-model transport runs on: MCGUARD_NIC_MODEL
    names it (make exports it)."""
    path = os.environ.get("MCGUARD_NIC_MODEL", "")
    if not os.path.exists(path):
        raise SystemExit("--transport rdma-model: the NIC model is not at MCGUARD_NIC_MODEL=%r: run make build in "
                         "mcguard's repository and set MCGUARD_NIC_MODEL to its build/libnicmodel.so" % path)
    return path


def run(args):
    """Run one stress and return its result dict."""
    if args.transport == "rdma-model":
        args.nic_model = nic_model_path()
        # The model reads its knobs in each process when the guard opens.
        os.environ["MCG_NIC_LAG_US"] = str(int(args.lag_max_ms * 1000)) if args.inject == "lag" else "0"
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
            info = pipe.recv()
            if "error" in info:
                raise RuntimeError("the decode process could not open its guard: " + info["error"])
            sessions.append(info)
        here, there = ctx.Pipe()
        prefill = ctx.Process(target=prefill_main, args=(there, sessions, args), daemon=True)
        prefill.start()
        limit = (args.seconds if args.seconds > 0 else 3600) + 120
        if not here.poll(limit):
            prefill.terminate()
            raise RuntimeError("the prefill process did not finish (exit code %s)" % prefill.exitcode)
        result = here.recv()
        prefill.join(30)
        if "error" in result:
            raise RuntimeError("the prefill process could not open its guard: " + result["error"])
    finally:
        decoded = []
        for pipe in pipes:
            try:
                pipe.send("stop")
                decoded.append(pipe.recv() if pipe.poll(10) else {})
            except (OSError, BrokenPipeError, EOFError):
                pass
        for p in decoders:
            p.join(30)
            if p.is_alive():
                p.terminate()
    seconds = result["seconds"] or 1e-9
    out = {
        "verify": args.verify, "inject": args.inject, "transport": args.transport, "rdma_qps": args.rdma_qps,
        "transfers": result["transfers"], "descriptors": result["descriptors"], "bytes": result["bytes"],
        "ok": result["ok"], "failed": result["failed"], "mismatches": result["mismatches"],
        "retries": result["retries"], "resends": result["resends"],
        "settles_late": result["settles_late"], "settle_timeouts": result["settle_timeouts"], "seconds": seconds,
        "gbps": round(result["bytes"] * 8 / 1e9 / seconds, 3),
        "receive_memory": args.receive_memory,
        "same_host_pushed_bytes": result["same_host_pushed_bytes"],
        "same_host_mapped_bytes": result["same_host_mapped_bytes"],
        "pipelined_chunks": result["pipelined_chunks"],
        "peer_checked": result["peer_checked"],
    }
    if result["errors"]:
        out["errors"] = result["errors"]
        out["first_error"] = result["first_error"]
    if args.abort:
        out["quiesce"] = args.quiesce
        for key in ("decode_aborts", "reused_blocks", "corrupted_blocks", "quiesces", "never_began"):
            out[key] = sum(d.get(key, 0) for d in decoded)
    return out


def table(rows, columns):
    """A plain text table of dicts."""
    cells = [[str(c) for c in columns]] + [[str(r.get(c, "")) for c in columns] for r in rows]
    return "\n".join(texttable.lines(cells, right=True))


SUMMARY_COLUMNS = ("verify", "inject", "transport", "transfers", "ok", "failed", "descriptors",
                   "mismatches", "retries", "seconds", "gbps")


def expected_mismatches(inject, verify, peer_checked=False):
    """What docs/VERIFICATION.md expects of a cell: True when the cell must
    show mismatches (the mode cannot see the fault), False when none. An
    engine that lies fools read-backs made through it, not those the
    peer's guard answered (peer_checked)."""
    lie_unseen = inject == "lie" and verify != "digest" and not peer_checked
    return verify == "off" or (verify == "tail" and inject == "stale") or lie_unseen


ABORT_COLUMNS = ("inject", "transport", "quiesce", "transfers", "ok", "failed", "decode_aborts", "reused_blocks",
                 "corrupted_blocks", "seconds")

MATRIX_COLUMNS = ("inject", "verify", "transfers", "ok", "failed", "mismatches", "retries", "resends",
                  "pipelined_chunks", "gbps", "expected", "as_expected")


def run_matrix(args):
    rows = []
    faults = ENGINE_DELIVERY_FAULTS if args.transport == "mooncake" else DELIVERY_FAULTS
    cells = [(f, m) for f in faults for m in MODES]
    for k, (fault, mode) in enumerate(cells):
        cell = argparse.Namespace(**vars(args))
        cell.inject, cell.verify, cell.quiet = fault, mode, True
        if not args.zero_tail_given:
            cell.zero_tail = args.block_bytes // 16 if fault == "stale" else 0
        out = run(cell)
        want = expected_mismatches(fault, mode, out["peer_checked"] > 0)
        row = {key: out[key] for key in MATRIX_COLUMNS if key not in ("expected", "as_expected")}
        row["expected"] = "mismatches" if want else "none"
        row["as_expected"] = (out["mismatches"] > 0) == want and not out["settle_timeouts"]
        rows.append(row)
        if not args.quiet:
            print("[%2d/%d] inject=%-7s verify=%-6s ok %5d failed %5d mismatches %6d  %s"
                  % (k + 1, len(cells), fault, mode, out["ok"], out["failed"], out["mismatches"],
                     "as expected" if row["as_expected"] else "UNEXPECTED"), file=sys.stderr, flush=True)
    print(table(rows, MATRIX_COLUMNS))
    bad = [r for r in rows if not r["as_expected"]]
    print("%d of %d cells as expected" % (len(rows) - len(bad), len(rows)))
    if args.json:
        print(json.dumps({"matrix": rows}))
    return 1 if bad else 0


def main(argv=None):
    args = parse_args(argv)
    try:
        return _main(args)
    except RuntimeError as e:
        print("mcguard stress: %s" % e, file=sys.stderr)
        return 2


def _main(args):
    if args.matrix:
        return run_matrix(args)
    if not args.quiet:
        print("mcguard stress: verify=%s inject=%s sessions=%d threads=%d batch=%d x %d B (%s), %s"
              % (args.verify, args.inject, args.sessions, args.threads, args.batch, args.block_bytes, args.layout,
                 "%d batches/thread" % args.batches if args.batches > 0 else "%gs" % args.seconds),
              file=sys.stderr, flush=True)
    out = run(args)
    print(table([out], ABORT_COLUMNS if args.abort else SUMMARY_COLUMNS))
    if out.get("errors"):
        print("errors: %s (first: %s)" % (out["errors"], out["first_error"]))
    if args.json:
        print(json.dumps(out))
    return 1 if out["mismatches"] > 0 or out.get("corrupted_blocks", 0) > 0 else 0


if __name__ == "__main__":
    sys.exit(main())
