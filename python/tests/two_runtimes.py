"""Two Go runtimes in one process: libmcguard.so and Mooncake's
libetcd_wrapper.so (Go c-shared libraries both), worked hard. Run with a
Python that has Mooncake's wheel:

    python two_runtimes.py SCENARIO [SECONDS]

Scenarios: "load" (which Go libraries are mapped), "concurrent" (raw
Mooncake transfers, guarded transfers over mcguard's TCP and guarded
transfers over Mooncake's engine, all at once from threads, under GC
pressure (GOGC=5 from the caller) and a SIGPROF timer as a sampling
profiler sets, with SIGINT delivered to the main thread meanwhile, and an
engine callback raising now and then), "sigterm" (waits mid-transfer to be
terminated: the caller checks it dies promptly), "sigterm-handled" (a
Python SIGTERM handler closes everything and exits 0). Each destination is
hashed after its transfer; prints one JSON line.
"""

import ctypes
import hashlib
import json
import os
import signal
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import mooncake.engine  # noqa: E402,F401 - loads Mooncake's Go runtime (libetcd_wrapper.so)
from mooncake.engine import TransferEngine  # noqa: E402

from mcguard import Guard, MCGuardError  # noqa: E402
from mcguard.engine import MooncakeEngine  # noqa: E402

BLOCK, N = 64 << 10, 16
SIZE = BLOCK * N


def go_libraries():
    with open("/proc/self/maps") as f:
        names = {os.path.basename(line.split()[-1]) for line in f if ".so" in line}
    return sorted(n for n in names if n.startswith(("libmcguard", "libetcd_wrapper")))


class Region:
    def __init__(self):
        self.buf = ctypes.create_string_buffer(SIZE)
        self.addr = ctypes.addressof(self.buf)

    def blocks(self, k):
        return [self.addr + i * BLOCK for i in range(k)]

    def fill(self):
        self.buf.raw = os.urandom(SIZE)
        return hashlib.sha1(self.buf.raw).hexdigest()

    def sha1(self):
        return hashlib.sha1(ctypes.string_at(self.addr, SIZE)).hexdigest()


def mooncake_engine():
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    return te


class Flaky(MooncakeEngine):
    """Mooncake's engine whose write raises every so often: the exception
    must come back as a failed transfer, never unwind into Go."""

    def __init__(self, engine, every):
        super().__init__(engine)
        self.every, self.calls, self.raised = every, 0, 0

    def write(self, session, local, remote, lengths):
        self.calls += 1
        if self.calls % self.every == 0:
            self.raised += 1
            raise RuntimeError("flaky engine, call %d" % self.calls)
        return super().write(session, local, remote, lengths)


def concurrent(seconds):
    out = {"errors": []}
    kinds, per_kind = ("raw", "tcp", "engine"), 2
    workers = [(k, i) for k in kinds for i in range(per_kind)]
    recv_te = mooncake_engine()
    recv_guard = Guard(listen="127.0.0.1:0", transport="tcp")
    session = "127.0.0.1:%d" % recv_te.get_rpc_port()
    dst = {w: Region() for w in workers}
    for w, r in dst.items():
        assert recv_te.register_memory(r.addr, SIZE) == 0
        if w[0] == "tcp":
            recv_guard.register(r.addr, SIZE)

    raw_te, eng_te = mooncake_engine(), mooncake_engine()
    tcp_guard = Guard(verify="tail", transport="tcp")
    flaky = Flaky(eng_te, every=7)
    eng_guard = Guard(verify="sample", engine=flaky)
    src = {w: Region() for w in workers}
    for w, r in src.items():
        if w[0] == "raw":
            assert raw_te.register_memory(r.addr, SIZE) == 0
        else:
            (tcp_guard if w[0] == "tcp" else eng_guard).register(r.addr, SIZE)
    out["libraries"] = go_libraries()

    counts = {k: {"ok": 0, "failed": 0, "bad": 0} for k in kinds}
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def count(kind, key):
        with lock:
            counts[kind][key] += 1

    def worker(w):
        kind, s, d = w[0], src[w], dst[w]
        while time.monotonic() < stop:
            want = s.fill()
            try:
                if kind == "raw":
                    if raw_te.batch_transfer_sync_write(session, s.blocks(N), d.blocks(N), [BLOCK] * N) != 0:
                        raise RuntimeError("mooncake returned non-zero")
                elif kind == "tcp":
                    tcp_guard.transfer(recv_guard.endpoint, s.blocks(N), d.blocks(N), [BLOCK] * N)
                else:
                    eng_guard.transfer(session, s.blocks(N), d.blocks(N), [BLOCK] * N)
            except (MCGuardError, RuntimeError) as e:
                count(kind, "failed")
                if "flaky engine" not in str(e):
                    with lock:
                        out["errors"].append("%s: %s" % (kind, e))
                continue
            count(kind, "ok")
            if d.sha1() != want:  # the receiving side's hash of what landed
                count(kind, "bad")

    ticks = [0]
    signal.signal(signal.SIGPROF, lambda *_: ticks.__setitem__(0, ticks[0] + 1))
    # Ctrl-C as an interactive Python has it: a process started in the
    # background by a shell without job control inherits SIGINT ignored,
    # and Python then leaves it ignored (a CI run launched so saw no
    # KeyboardInterrupt at all).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.setitimer(signal.ITIMER_PROF, 0.002, 0.002)  # what a sampling profiler does
    threads = [threading.Thread(target=worker, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    interrupts, garbage = 0, []
    while any(t.is_alive() for t in threads):
        garbage = [bytearray(4096) for _ in range(256)]  # Python allocating beside two Go collectors
        try:
            time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, delivered to the main thread
            time.sleep(0.05)
        except KeyboardInterrupt:
            interrupts += 1
        for t in threads:
            t.join(0.01)
    signal.setitimer(signal.ITIMER_PROF, 0, 0)
    del garbage
    out.update(counts=counts, sigprof=ticks[0], sigint=interrupts, raised=flaky.raised,
               gogc=os.environ.get("GOGC", ""))
    for g in (tcp_guard, eng_guard, recv_guard):
        g.close()
    return out


def sigterm(handled):
    if handled:
        def on_term(*_):
            raise SystemExit(0)
        signal.signal(signal.SIGTERM, on_term)
    recv_te, send_te = mooncake_engine(), mooncake_engine()
    dst, src = Region(), Region()
    assert recv_te.register_memory(dst.addr, SIZE) == 0
    session = "127.0.0.1:%d" % recv_te.get_rpc_port()
    g = Guard(verify="tail", engine=MooncakeEngine(send_te))
    g.register(src.addr, SIZE)
    transfers = 0
    print("ready", flush=True)
    try:
        while True:
            src.fill()
            g.transfer(session, src.blocks(N), dst.blocks(N), [BLOCK] * N)
            transfers += 1
    except SystemExit:
        g.close()
        print(json.dumps({"closed": True, "transfers": transfers}), flush=True)
        raise


if __name__ == "__main__":
    scenario = sys.argv[1]
    if scenario == "load":
        Guard().close()
        print(json.dumps({"libraries": go_libraries()}))
    elif scenario == "concurrent":
        print(json.dumps(concurrent(float(sys.argv[2]) if len(sys.argv) > 2 else 5.0)))
    else:
        sigterm(scenario == "sigterm-handled")
