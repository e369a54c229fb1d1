"""What the two-process prefill/decode harnesses (vllm_pd, sglang_pd)
share: the plugin's distribution metadata for a framework's plugin loader,
ports, a spawned process's settings, and waiting for a process's answer."""

import os
import random
import socket
import sys
import tempfile
import time

PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def plugin_metadata(group):
    """A folder with mcguard's distribution metadata (its entry point in
    group, from pyproject.toml), as an editable install writes it: the
    framework finds the plugin in the working tree through
    importlib.metadata. It goes first on the path: an older egg-info of
    mcguard's in the tree would otherwise be the one found. The caller
    removes it."""
    root = os.path.dirname(PYTHON_DIR)
    with open(os.path.join(root, "pyproject.toml")) as f:
        text = f.read()
    entry = text.split('[project.entry-points."%s"]' % group, 1)[1].strip().splitlines()[0]
    d = tempfile.mkdtemp(prefix="mcguard-plugin-")
    info = os.path.join(d, "mcguard-0.0.0.dist-info")
    os.mkdir(info)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: mcguard\nVersion: 0.0.0\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write("[%s]\n%s\n" % (group, entry.replace('"', "")))
    return d


def _ephemeral_low():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_handed_out = set()


def free_port():
    """A port free now that the caller binds later. It comes from below
    the kernel's ephemeral range: a port from bind(0) is one the kernel
    also hands to any process's next outgoing connection, and one CI run
    lost its port that way between this pick and the framework's bind.
    Below the range only an explicit bind takes it. Random, so that
    processes picking at once rarely meet; never the same one twice here."""
    low = max(1024, min(_ephemeral_low(), 65536) - 12000)
    for _ in range(200):
        port = random.randrange(low, low + 12000)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError("no free port below the ephemeral range")


def take_env(env):
    """A spawned process's settings, its path included (it started with
    the parent's)."""
    os.environ.update(env)
    for p in reversed(env["PYTHONPATH"].split(os.pathsep)):
        if p and p not in sys.path:
            sys.path.insert(0, p)


def finished_sending(conn, want, poll, limit=60, grace=10):
    """The prefill side's wait in run_pair: the requests that poll()
    reports finished sending, gathered until want of them are in, limit s
    pass, or grace s after "stop" (the decode side has its result, but
    word of its last transfers can still be on its way here). Returns
    them sorted, and whether "stop" came."""
    sent, deadline, stopped = set(), time.monotonic() + limit, False
    while len(sent) < want and time.monotonic() < deadline:
        sent |= set(poll() or ())
        if stopped:
            time.sleep(0.05)
        elif conn.poll(0.05) and conn.recv() == "stop":
            stopped, deadline = True, min(deadline, time.monotonic() + grace)
    return sorted(sent), stopped


def expect(conn, proc, what, timeout):
    """The next message on conn, which must be what, within timeout s; an
    error naming the process where it exits or is silent first."""
    deadline = time.monotonic() + timeout
    while not conn.poll(0.2):
        if not proc.is_alive():
            raise RuntimeError("the %s process exited (status %s) before %r" % (proc.name, proc.exitcode, what))
        if time.monotonic() > deadline:
            raise RuntimeError("no %r from the %s process in %d s" % (what, proc.name, timeout))
    msg = conn.recv()
    if msg[0] != what:
        raise RuntimeError("expected %r, got %r" % (what, msg[:1]))
    return msg


def run_pair(case, prefill_main, decode_main, prefill_env, decode_env, plan):
    """Run prefill_main and decode_main, each in a spawned process with its
    settings and plan: both say "ready" (the prefill with its data plane,
    or what the decode side needs of it), the decode side is told ("go",
    that) and answers "result" (its result and
    guard stats), then the prefill side is told "stop" and answers "sent"
    (its result and guard stats). Returns (data plane, decode result,
    decode stats, prefill result, prefill stats); both processes are gone
    when it returns."""
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    p_here, p_there = ctx.Pipe()
    d_here, d_there = ctx.Pipe()
    prefill = ctx.Process(target=prefill_main, args=(p_there, prefill_env, plan), daemon=True, name="prefill")
    decode = ctx.Process(target=decode_main, args=(d_there, decode_env, plan), daemon=True, name="decode")
    t0 = time.monotonic()
    prefill.start()
    decode.start()
    try:
        _, transport = expect(p_here, prefill, "ready", 180)
        expect(d_here, decode, "ready", 180)
        print("  [%s] both sides up in %.1f s; prefill's data plane: %s" % (case, time.monotonic() - t0, transport),
              flush=True)
        d_here.send(("go", transport))
        _, result, decode_stats = expect(d_here, decode, "result", 120)
        p_here.send("stop")
        _, sent, prefill_stats = expect(p_here, prefill, "sent", 60)
    finally:
        for c in (p_here, d_here):
            try:
                c.send("stop")
            except (BrokenPipeError, OSError):
                pass
        for p in (prefill, decode):
            p.join(10)
            if p.is_alive():
                p.kill()
    return transport, result, decode_stats, sent, prefill_stats


# The guard counters a harness reports from each side.
DECODE_STATS = ("notices_received", "syncs", "sync_failures", "quiesces", "refused_quiesced", "bytes_received")
PREFILL_STATS = ("transfers", "transfers_ok", "transfers_failed", "mismatches", "quiesces")


def picked(stats, names):
    return {k: stats.get(k) for k in names}


def framework_or_skip(module, variable, what):
    """Skip the calling test module, saying why, where module is not
    importable; fail instead where environment variable is 1 (the make
    target that made the environment for it)."""
    import importlib
    import pytest
    try:
        importlib.import_module(module)
    except ImportError:
        if os.environ.get(variable) == "1":
            raise RuntimeError("%s=1 and %s is not importable by %s" % (variable, module, sys.executable))
        pytest.skip(what, allow_module_level=True)


def run_case(pd, case):
    """Run harness pd's case in a fresh interpreter; print its per-request
    lines and return its JSON result."""
    import json
    import subprocess
    p = subprocess.run([sys.executable, pd, case], capture_output=True, text=True, timeout=420)
    print("\n".join(line for line in p.stdout.splitlines() if line.startswith("  [")))
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-8000:]
    return json.loads(p.stdout.strip().splitlines()[-1])
