"""make bench-peer: mcguard beside Mooncake's own TCP transport and a raw
socket pair, moving the same bytes between two processes, rounds
interleaved so each sees the same load; the destination is SHA-1 checked
at the receiver after every engine's round.

    python3 -m mcguard.tools.peerbench [--rounds N] [--latency-iters N] [--sizes ...]

Runs under a Python that can import mooncake.engine (make bench-peer uses
build/venv-mooncake with python/ on the path); without Mooncake it
compares mcguard with the socket pair only, and says so. Prints a progress
line per round and ends with a table: per engine and size, the median
(latency in µs for 1 x 4 KiB, GB/s for the batches) and the ratio to
Mooncake in the same rounds.
"""

import argparse
import base64
import ctypes
import functools
import hashlib
import json
import mmap
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

from . import peergoals, peerprofile, texttable
from .cli import prog

SIZES = {"1x4KiB": (1, 4 << 10), "64x256KiB": (64, 256 << 10), "512x16KiB": (512, 16 << 10),
         "4096x4KiB": (4096, 4 << 10), "1x64MiB": (1, 64 << 20)}
REGION = 64 << 20
# Mooncake's TCP transport refuses batches above its per-peer queue limit
# (about 2048 by default): raised so 4096 x 4 KiB completes.
MOONCAKE_ENV = {"MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "16384", "MC_LOG_LEVEL": "ERROR", "GLOG_minloglevel": "2"}


# Engine kinds: "mooncake" (its TCP transport alone), "mcguard-MODE" (mcguard's
# own TCP), "guarded-mooncake-MODE" (mcguard over Mooncake's engine),
# "guarded-mooncake-desctail" (tail with slice_bytes 0: each descriptor's tail
# only), "vllm-fix" (Mooncake, then the original vLLM fix's check: a 64-byte
# tail of each descriptor read back through Mooncake and polled), "socket",
# and "mcguard[-socket]-digest+sync[-read]": digest mode with
# the receiver's sync_transfers after every transfer (its request and answer
# cross a pipe to the receiving process; the pipe's time is left out of the
# figures, the call's is in), comparing the digests its target
# took as the bytes landed, or reading its memory again (digest_at "sync").
# An mcguard kind ending in "@N" opens its sessions with tcp_stripes N; one
# ending in "+ping" makes the same round trip through the pipe after every
# transfer as "+sync" does, calling nothing there: the same pause between
# transfers without the sync, the baseline a "+sync" kind compares with.
# One ending in "~serial" opens its guard with post_ahead false: each
# chunk's writes wait for the check of the chunk before it.
TAIL = 64
PING = "+ping"
SERIAL = "~serial"


@functools.lru_cache(maxsize=None)
def dest_slots(count, scattered):
    """Where each source block i lands, in blocks from the destination's
    start: block i (consecutive, the default: a cache's consecutive blocks,
    which mcguard joins into one write per run), or a fixed shuffle
    (scattered: no descriptor continues the one before it). Made once per
    shape (not inside a timed transfer); callers do not change it."""
    slots = list(range(count))
    if scattered:
        import random
        random.Random(count).shuffle(slots)
    return slots


def landed_hash(read, count, size, slots):
    """The SHA-1 the destination's first count blocks must have when block
    i of the source, read(off, n), went to block slots[i]."""
    if slots == sorted(slots):
        return hashlib.sha1(read(0, count * size)).hexdigest()
    at = [0] * count
    for i, j in enumerate(slots):
        at[j] = i
    h = hashlib.sha1()
    for i in at:
        h.update(read(i * size, size))
    return h.hexdigest()


def receiver_syncs(kind):
    return "+sync" in kind


def new_engine(kind):
    """A new engine of kind, not yet initialized. An mcguard kind may end
    in "@N": its sessions over N TCP connections (tcp_stripes); or in
    "~serial": post_ahead false."""
    if kind.endswith(PING):
        if not kind.startswith("mcguard-") and kind != "mooncake" + PING:
            raise SystemExit("%s is for mcguard kinds and mooncake, not %r" % (PING, kind))
        return new_engine(kind[:-len(PING)])
    if kind.endswith(SERIAL):
        if not kind.startswith("mcguard-"):
            raise SystemExit("%s (post_ahead false) is for mcguard kinds, not %r" % (SERIAL, kind))
        engine = new_engine(kind[:-len(SERIAL)])
        engine._config["post_ahead"] = False
        return engine
    kind, _, stripes = kind.partition("@")
    if stripes:
        from ..integrations.mooncake import GuardedTransferEngine
        engine = new_engine(kind)
        if not isinstance(engine, GuardedTransferEngine):
            raise SystemExit("@N (tcp_stripes) is for mcguard kinds, not %r" % kind)
        engine._config["tcp_stripes"] = int(stripes)
        return engine
    if receiver_syncs(kind):
        from ..integrations.mooncake import GuardedTransferEngine
        at = "sync" if kind.endswith("-read") else "landing"
        return GuardedTransferEngine(verify="digest", digest_at=at, same_host="off" if "-socket-" in kind else "auto")
    if kind in ("mooncake", "vllm-fix"):
        from mooncake.engine import TransferEngine
        return TransferEngine()
    from ..integrations.mooncake import GuardedTransferEngine
    if kind.startswith("guarded-mooncake-"):
        from mooncake.engine import TransferEngine
        mode = kind.rsplit("-", 1)[1]
        if mode == "desctail":  # the vLLM fix's check, by mcguard: each descriptor's tail only
            return GuardedTransferEngine(engine=TransferEngine(), verify="tail", slice_bytes=0)
        return GuardedTransferEngine(engine=TransferEngine(), verify=mode)
    if kind.startswith("mcguard-socket-"):  # TCP with the bytes through the socket, also on one host
        return GuardedTransferEngine(verify=kind.rsplit("-", 1)[1], same_host="off")
    return GuardedTransferEngine(verify=kind.split("-", 1)[1])


# --- the receiving process ---------------------------------------------------

def nixl_api():
    """NIXL's Python API: the meta package's, else its CUDA 12 build's."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError:
        from nixl_cu12._api import nixl_agent, nixl_agent_config
    return nixl_agent, nixl_agent_config


def new_nixl(role):
    """A NIXL agent with its UCX backend and a registered 64 MiB region.
    The sender's has no progress thread: its transfer loop progresses UCX
    itself (check_xfer_state), and the thread would take CPU from the
    other engines' rounds all along (about 30 % of a core here)."""
    nixl_agent, nixl_agent_config = nixl_api()
    cfg = nixl_agent_config(enable_prog_thread=role != "send", backends=["UCX"])
    agent = nixl_agent("%s-%d" % (role, os.getpid()), cfg)
    mem = mmap.mmap(-1, REGION)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mem))
    reg = agent.register_memory([(addr, REGION, 0, "")], "DRAM")
    return agent, reg, mem, addr


def nixl_exit(code):
    """Exit without running C++ static destructors: NIXL 1.5.1's UCX
    backend crashes (SIGSEGV) at process exit here, even for a bare agent
    created and deleted, so a process that loaded it leaves with _exit."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serve(kind):
    """Receiver: one engine (or a socket) and one region; answers "hash
    OFFSET LEN" with the SHA-1 of what landed, "quit" to stop."""
    if kind == "socket":
        return serve_socket()
    if kind == "nixl":
        return serve_nixl()
    engine = new_engine(kind)
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        sys.exit("initialize failed")
    addr = engine.allocate_managed_buffer(REGION)
    guard = engine.get_guard_endpoint() if hasattr(engine, "get_guard_endpoint") else ""
    print(json.dumps({"session": "127.0.0.1:%d" % engine.get_rpc_port(), "addr": addr, "guard": guard}),
          flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "hash":
            off, n = int(cmd[1]), int(cmd[2])
            print(hashlib.sha1(ctypes.string_at(addr + off, n)).hexdigest(), flush=True)
        elif cmd[0] == "sync":  # answered with how long the call took here, in seconds
            start = time.perf_counter()
            engine.guard.sync_transfers([int(cmd[1])])  # raises on a mismatch: the run stops
            print("ok %.9f" % (time.perf_counter() - start), flush=True)
        elif cmd[0] == "ping":  # the same round trip, calling nothing
            print("ok 0", flush=True)
        elif cmd[0] == "stats":  # the receiving guard's stats, one JSON line ({} for other engines)
            guard = getattr(engine, "guard", None)
            print(json.dumps(guard.stats() if hasattr(guard, "stats") else {}), flush=True)
        elif cmd[0] == "quit":
            break


def serve_nixl():
    """A NIXL agent whose metadata is the session (base64); its UCX
    progress thread takes the writes."""
    out = os.fdopen(os.dup(1), "w")  # NIXL logs to standard output: the replies get their own
    os.dup2(2, 1)
    agent, reg, mem, addr = new_nixl("recv")
    meta = base64.b64encode(agent.get_agent_metadata()).decode()
    print(json.dumps({"session": meta, "addr": addr}), file=out, flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "hash":
            off, n = int(cmd[1]), int(cmd[2])
            print(hashlib.sha1(mem[off:off + n]).hexdigest(), file=out, flush=True)
        elif cmd[0] == "quit":
            break
    agent.deregister_memory(reg)
    out.flush()
    nixl_exit(0)


def serve_socket():
    mem = mmap.mmap(-1, REGION)
    lst = socket.create_server(("127.0.0.1", 0))
    print(json.dumps({"session": "127.0.0.1:%d" % lst.getsockname()[1], "addr": 0}), flush=True)
    conn, _ = lst.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    view = memoryview(mem)
    ctl = os.fdopen(0, "r")

    def fill(into):  # all of into, or False at the end of the stream
        got = 0
        while got < len(into):  # recv may return less, as when the process is stopped (pause) meanwhile
            k = conn.recv_into(into[got:])
            if k == 0:
                return False
            got += k
        return True

    def pump():  # each message: 8-byte length, then that many bytes at offset 0; answered with one byte
        hdr = bytearray(8)
        while fill(memoryview(hdr)):
            n = int.from_bytes(hdr, "little")
            if not fill(view[:n]):
                return
            conn.sendall(b"\x01")
    threading.Thread(target=pump, daemon=True).start()
    for line in ctl:
        cmd = line.split()
        if cmd[0] == "hash":
            off, n = int(cmd[1]), int(cmd[2])
            print(hashlib.sha1(mem[off:off + n]).hexdigest(), flush=True)
        elif cmd[0] == "quit":
            break


# --- the sending side ---------------------------------------------------------

class Receiver:
    def __init__(self, kind):
        env = dict(os.environ, **MOONCAKE_ENV)
        self.proc = subprocess.Popen([sys.executable, "-m", "mcguard.tools.peerbench", "--serve", kind],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        hello = json.loads(self.proc.stdout.readline())
        self.session, self.addr, self.guard = hello["session"], hello["addr"], hello.get("guard", "")
        self.synced = []  # seconds each sync_transfers call took in the receiving process

    def hash(self, off, n):
        self.proc.stdin.write("hash %d %d\n" % (off, n))
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def sync(self, transfer_id):
        """The receiver's sync_transfers for one transfer (None: a ping,
        the round trip alone); returns the seconds the pipe to the
        receiving process and back took beyond the call itself."""
        start = time.perf_counter()
        self.proc.stdin.write("ping\n" if transfer_id is None else "sync %d\n" % transfer_id)
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline().split()
        if len(answer) != 2 or answer[0] != "ok":
            raise RuntimeError("the receiver's sync_transfers failed (its stderr says why)")
        self.synced.append(float(answer[1]))
        return max(time.perf_counter() - start - self.synced[-1], 0.0)

    def stats(self):
        """The receiving guard's stats ({} for an engine that has none)."""
        self.proc.stdin.write("stats\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def pause(self, paused):
        """Stop (or continue) the receiving process while another engine is
        measured: an idle engine must not take CPU from the one measured
        (NIXL's UCX progress thread took about half a core here while
        idle)."""
        os.kill(self.proc.pid, signal.SIGSTOP if paused else signal.SIGCONT)

    def close(self):
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


class Sender:
    """One engine kind's sending half, with a source region of random bytes."""

    def __init__(self, kind, recv, scattered=False):
        # The raw socket pair moves the bytes as one stream whatever the layout.
        self.kind, self.recv, self.scattered = kind, recv, scattered and kind != "socket"
        if kind == "nixl":
            self.agent, self.reg, self.mem, self.src = new_nixl("send")
            self.mem[:] = os.urandom(REGION)
            self.peer = self.agent.add_remote_agent(base64.b64decode(recv.session))
            self.handles = {}
            return
        if kind == "socket":
            self.mem = mmap.mmap(-1, REGION)
            self.mem[:] = os.urandom(REGION)
            host, port = recv.session.rsplit(":", 1)
            self.sock = socket.create_connection((host, int(port)))
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return
        self.engine = new_engine(kind)
        if self.engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("%s: initialize failed" % kind)
        self.src = self.engine.allocate_managed_buffer(REGION)
        ctypes.memmove(self.src, os.urandom(REGION), REGION)
        if kind.startswith("guarded-mooncake-") and recv.guard:
            self.engine.set_peer_guard(recv.session, recv.guard)  # where digest notices go
        if kind == "vllm-fix":  # where the tails are read back to
            self.tails = self.engine.allocate_managed_buffer(max(SIZES[s][0] for s in SIZES) * TAIL)

    def nixl_transfer(self, count, size):
        """A WRITE of the batch, prepared once per shape and posted again
        (NIXL's own fast path), polled until DONE: the UCX flush reached
        the target. NIXL checks no bytes."""
        h = self.handles.get((count, size))
        if h is None:
            local = self.agent.get_xfer_descs([(self.src + i * size, size, 0) for i in range(count)], "DRAM")
            remote = self.agent.get_xfer_descs([(self.recv.addr + j * size, size, 0) for j in self.order(count)],
                                               "DRAM")
            h = self.handles[(count, size)] = self.agent.initialize_xfer("WRITE", local, remote, self.peer)
        state = self.agent.transfer(h)
        while state == "PROC":
            state = self.agent.check_xfer_state(h)
        if state != "DONE":
            raise RuntimeError("nixl: transfer ended %s" % state)

    def order(self, count):
        return dest_slots(count, self.scattered)

    def source_hash(self, count, size):
        if self.kind in ("socket", "nixl"):
            read = lambda off, n: self.mem[off:off + n]  # noqa: E731
        else:
            read = lambda off, n: ctypes.string_at(self.src + off, n)  # noqa: E731
        return landed_hash(read, count, size, self.order(count))

    def transfer(self, count, size):
        """One batch of count descriptors of size bytes, src block i to dst
        block i; for the "+sync" kinds, returns the seconds the pipe to the
        receiver took (Receiver.sync)."""
        if self.kind == "nixl":
            return self.nixl_transfer(count, size)
        if self.kind == "socket":
            n = count * size
            self.sock.sendall(n.to_bytes(8, "little"))
            self.sock.sendall(memoryview(self.mem)[:n])
            if self.sock.recv(1) != b"\x01":
                raise RuntimeError("socket receiver went away")
            return
        src = [self.src + i * size for i in range(count)]
        dst = [self.recv.addr + j * size for j in self.order(count)]
        ret = self.engine.batch_transfer_sync_write(self.recv.session, src, dst, [size] * count)
        if ret != 0:
            raise RuntimeError("%s: batch_transfer_sync_write returned %d" % (self.kind, ret))
        if receiver_syncs(self.kind):
            return self.recv.sync(self.engine.last_transfer_id)
        if self.kind.endswith(PING):
            return self.recv.sync(None)
        if self.kind == "vllm-fix":
            self.poll_tails(src, dst, size)

    def poll_tails(self, src, dst, size, retries=500):
        """The original vLLM fix: read back each descriptor's last 64 bytes
        through Mooncake, and poll until every one equals its source's."""
        k = min(TAIL, size)
        want = [ctypes.string_at(a + size - k, k) for a in src]
        todo = list(range(len(src)))
        for _ in range(retries):
            local = [self.tails + i * TAIL for i in range(len(todo))]
            if self.engine.batch_transfer_sync_read(self.recv.session, local, [dst[j] + size - k for j in todo],
                                                    [k] * len(todo)) != 0:
                raise RuntimeError("vllm-fix: batch_transfer_sync_read failed")
            todo = [j for i, j in enumerate(todo) if ctypes.string_at(local[i], k) != want[j]]
            if not todo:
                return
            time.sleep(0.001)
        raise RuntimeError("vllm-fix: %d tails never matched" % len(todo))

    def close(self):
        if self.kind == "nixl":
            for h in self.handles.values():
                self.agent.release_xfer_handle(h)
            self.handles = {}
            self.agent.remove_remote_agent(self.peer)
            self.agent.deregister_memory(self.reg)
            return
        if self.kind == "socket":
            self.sock.close()
        elif hasattr(self.engine, "close"):  # Mooncake's engine has none
            self.engine.close()


class LocalCopy:
    """The baseline of same-host transfers: a single-threaded memcpy of the
    same descriptors, source to destination, in this process."""

    kind = "memcpy"

    def __init__(self, scattered=False):
        self.src, self.dst = mmap.mmap(-1, REGION), mmap.mmap(-1, REGION)
        self.src[:] = os.urandom(REGION)
        self.src_addr = ctypes.addressof(ctypes.c_char.from_buffer(self.src))
        self.dst_addr = ctypes.addressof(ctypes.c_char.from_buffer(self.dst))
        self.scattered = scattered

    def transfer(self, count, size):
        for i, j in enumerate(dest_slots(count, self.scattered)):
            ctypes.memmove(self.dst_addr + j * size, self.src_addr + i * size, size)

    def source_hash(self, count, size):
        return landed_hash(lambda off, n: self.src[off:off + n], count, size, dest_slots(count, self.scattered))

    def hash(self, off, n):
        return hashlib.sha1(self.dst[off:off + n]).hexdigest()

    def close(self):
        pass


def measure(sender, name, count, size, iters, seconds):
    """Latency (median µs) for 1 x 4 KiB, else GB/s of repeated batches; a
    note for the progress line; and where the time went (peerprofile). A
    transfer that returns a time (the "+sync" kinds: the pipe to the
    receiving process and back, beyond its sync_transfers call) has that
    time left out: an application's receiver syncs in its own process, and
    the pipe is this benchmark's."""
    sender.transfer(count, size)  # warm: connect, handshake
    piped = []
    if isinstance(getattr(sender, "recv", None), Receiver):
        sender.recv.synced = []
    before = guard_reading(sender)
    if name == "1x4KiB":
        samples = []
        for _ in range(iters):
            t = time.perf_counter()
            pipe = sender.transfer(count, size) or 0.0
            samples.append((time.perf_counter() - t - pipe) * 1e6)
            piped.append(pipe)
        fig, wall = statistics.median(samples), sum(samples) / 1e6
    else:
        moved, start = 0, time.perf_counter()
        while True:
            piped.append(sender.transfer(count, size) or 0.0)
            moved += count * size
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                wall = elapsed - sum(piped)
                fig = moved / wall / 1e9
                break
    prof = peerprofile.profile(before, guard_reading(sender), len(piped), wall)
    if not any(piped):
        return fig, "", prof
    prof["receiver's call"] = statistics.mean(sender.recv.synced) * 1e6
    return fig, "   (the receiver's call: median %.1f µs; the pipe to it, left out: %.1f µs)" % (
        statistics.median(sender.recv.synced) * 1e6, statistics.median(piped) * 1e6), prof


def guard_stats(sender):
    """The sending and the receiving guard's stats now; None where the
    sender runs no guard."""
    guard = getattr(getattr(sender, "engine", None), "guard", None)
    recv = getattr(sender, "recv", None)
    if not hasattr(guard, "stats") or not isinstance(recv, Receiver):
        return None
    return guard.stats(), recv.stats()


def guard_reading(sender):
    """The two guards' time counters now (peerprofile.reading), or None."""
    both = guard_stats(sender)
    return peerprofile.reading(*both) if both else None


def busy_polls(sender):
    """(spins, paid) of the sending and the receiving guard's busy polling
    so far; None for engines that are not mcguard's own over TCP."""
    both = guard_stats(sender)
    if not both:
        return None
    return [(d.get("busy_poll_spins", 0), d.get("busy_poll_paid", 0)) for d in both]


def spin_note(before, after):
    """How the measurement's busy polling went, sender and receiver: a
    small-transfer figure depends on whether both ends kept spinning
    (most waits spin, nearly all pay) or backed off (few spin), and a run
    settles in one or the other (measured on a 2-core VM)."""
    if not before or not after:
        return ""
    parts = []
    for who, (s0, p0), (s1, p1) in zip(("sender", "receiver"), before, after):
        spins, paid = s1 - s0, p1 - p0
        parts.append("%s %d spins %d%% paid" % (who, spins, 100 * paid // spins if spins else 0))
    return "   busy poll: " + ", ".join(parts)


def main(argv=None):
    rc = run_bench(argv)
    if "nixl_cu12" in sys.modules or "nixl" in sys.modules:
        nixl_exit(rc)
    return rc


def run_bench(argv=None):
    p = argparse.ArgumentParser(prog=prog("peerbench"))
    p.add_argument("--serve", help=argparse.SUPPRESS)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--latency-iters", type=int, default=1000)
    p.add_argument("--seconds", type=float, default=1.0, help="per throughput measurement")
    p.add_argument("--sizes", nargs="*", default=list(SIZES), choices=list(SIZES))
    p.add_argument("--engines", nargs="*",
                   default=["mooncake", "nixl", "mcguard-off", "mcguard-tail", "mcguard-sample", "mcguard-digest",
                            "socket"],
                   help="of mooncake, vllm-fix, mcguard-MODE (same host where it can), mcguard-socket-MODE "
                        "(bytes through the socket), guarded-mooncake-MODE (MODE: off, tail, sample, full, digest), "
                        "nixl, socket, memcpy")
    p.add_argument("--nixl-tls", default="tcp",
                   help="UCX_TLS for NIXL's UCX backend (default tcp, so it crosses the network stack as the "
                        "others do; \"default\": UCX's own choice, cross-memory attach on one host)")
    p.add_argument("--layout", choices=("consecutive", "scattered"), default="consecutive",
                   help="where source block i lands: destination block i (consecutive, as a cache's "
                        "consecutive blocks; mcguard joins them into one write per run), or a fixed shuffle of "
                        "the blocks (scattered: one write per descriptor). The raw socket pair moves one "
                        "stream either way")
    p.add_argument("--json", metavar="PATH",
                   help="also write every round's figure, the machine and the settings to PATH "
                        "(what scripts/perf_report.py plots)")
    p.add_argument("--over-mooncake", action="store_true",
                   help="engines: Mooncake alone, the vLLM fix's tail polling, mcguard over Mooncake with the "
                        "same check (desctail), tail and sample (slice-aware) and digest")
    p.add_argument("--goals", action="store_true",
                   help="the engines and shapes of the performance goals, and after the summary a table of "
                        "each goal beside its peer and whether this run's medians meet it")
    a = p.parse_args(argv)
    if a.serve:
        return serve(a.serve)
    engines = list(a.engines)
    if a.goals:
        engines, a.sizes = list(peergoals.ENGINES), list(peergoals.SIZES)
    if a.over_mooncake:
        engines = ["mooncake", "vllm-fix", "guarded-mooncake-desctail", "guarded-mooncake-tail",
                   "guarded-mooncake-sample", "guarded-mooncake-digest"]
    needs = [k for k in engines if k in ("mooncake", "vllm-fix") or k.startswith("guarded-mooncake-")]
    if needs:
        try:
            import mooncake.engine  # noqa: F401
        except ImportError:
            print("mooncake.engine is not importable here (make bench-peer installs it): skipping %s"
                  % ", ".join(needs), file=sys.stderr)
            engines = [k for k in engines if k not in needs]
    if "nixl" in engines:
        try:
            nixl_api()
        except ImportError:
            print("NIXL is not importable here (make bench-peer installs it): skipping nixl", file=sys.stderr)
            engines.remove("nixl")
    os.environ.update(MOONCAKE_ENV)
    if a.nixl_tls != "default":  # UCX reads it when the agents start, here and in the receiver
        os.environ["UCX_TLS"] = a.nixl_tls
    pairs = {}
    for kind in engines:
        if kind == "memcpy":
            copier = LocalCopy(a.layout == "scattered")
            pairs[kind] = (copier, copier)
            continue
        recv = Receiver(kind)
        pairs[kind] = (Sender(kind, recv, a.layout == "scattered"), recv)
    results = {}  # (engine, size) -> [per-round figures]
    profiles = {}  # (engine, size) -> [per-round peerprofile.profile]
    bad = []
    try:
        for r in range(a.rounds):
            for name in a.sizes:
                count, size = SIZES[name]
                for kind in engines:
                    sender, recv = pairs[kind]
                    others = [r for k, (_, r) in pairs.items() if k != kind and isinstance(r, Receiver)]
                    for other in others:
                        other.pause(True)
                    spins = busy_polls(sender)
                    try:
                        fig, note, prof = measure(sender, name, count, size, a.latency_iters, a.seconds)
                    finally:
                        for other in others:
                            other.pause(False)
                    n = count * size
                    if recv.hash(0, n) != sender.source_hash(count, size):
                        bad.append((r, name, kind))
                    results.setdefault((kind, name), []).append(fig)
                    profiles.setdefault((kind, name), []).append(prof)
                    print("round %d/%d  %-10s %-26s %10.2f %s%s%s" % (r + 1, a.rounds, name, kind, fig,
                                                                     "µs" if name == "1x4KiB" else "GB/s",
                                                                     spin_note(spins, busy_polls(sender)), note),
                          file=sys.stderr, flush=True)
    finally:
        for sender, recv in pairs.values():
            sender.close()
            recv.close()
    print(summary(results, engines, a.sizes))
    print("layout: %s destination blocks" % a.layout)
    goals = peergoals.rows(results, a.nixl_tls, profiles) if a.goals else None
    print()
    if goals:
        print(peergoals.table(goals, a.layout))
        missed = peergoals.missed_pairs(goals)
        if missed:
            print()
            print("Where the time went, for the goals not met:")
            print(peerprofile.table(profiles, missed))
    else:
        print("Where the time went:")
        print(peerprofile.table(profiles, [(k, s) for k in engines for s in a.sizes]))
    if a.json:
        write_json(a.json, results, engines, a, bad, goals, profiles)
        print("figures written to %s" % a.json)
    if bad:
        print("DESTINATION MISMATCH (round, size, engine): %s" % bad)
        return 1
    print("every destination matched its source (SHA-1 at the receiver)")
    return 0


def machine():
    """What the figures were taken on."""
    from ..guard import version
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "kernel": platform.release(),
            "python": platform.python_version(), "mcguard": version()}


def write_json(path, results, engines, a, bad, goals=None, profiles=None):
    """Every round's figure per engine and shape (µs for 1x4KiB, else GB/s),
    where each round's time went (peerprofile), and the goals table's rows
    where it was asked for."""
    doc = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "rounds": a.rounds,
           "seconds": a.seconds, "latency_iters": a.latency_iters, "layout": a.layout,
           "nixl_tls": a.nixl_tls, "engines": engines, "sizes": a.sizes,
           "units": {s: "us" if s == "1x4KiB" else "GB/s" for s in a.sizes},
           "figures": {k: {s: results[(k, s)] for s in a.sizes} for k in engines},
           "mismatches": [list(b) for b in bad]}
    if profiles:
        doc["profiles"] = {k: {s: profiles[(k, s)] for s in a.sizes if (k, s) in profiles} for k in engines}
    if goals is not None:
        doc["goals"] = goals
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)


def summary(results, engines, sizes):
    ref = "mooncake" if "mooncake" in engines else None
    head = ["engine"] + ["%s %s" % (s, "µs" if s == "1x4KiB" else "GB/s") for s in sizes]
    rows = [head]
    for kind in engines:
        row = [kind]
        for s in sizes:
            med = statistics.median(results[(kind, s)])
            cell = "%.1f" % med if s == "1x4KiB" else "%.2f" % med
            if ref and kind != ref:
                cell += " (x%.2f)" % (med / statistics.median(results[(ref, s)]))
            row.append(cell)
        rows.append(row)
    lines = texttable.lines(rows)
    note = "medians over rounds; (xN) = ratio to Mooncake's median in the same rounds" if ref else \
        "medians over rounds; Mooncake not run"
    return "\n".join(lines + [note])


if __name__ == "__main__":
    sys.exit(main())
