"""A thread that calls into the library again and again leaves the Go
runtime's own threads asleep: the library keeps the calling thread's
scheduler slot, so the runtime's monitor neither takes it away between
calls nor needs waking by the next one (export/shim.c, mcg_keep_slot).
Those wake-ups cost every call a futex wake and took a CPU from whatever
else the process runs (a transfer engine's threads)."""

import subprocess
import sys
import textwrap

CALLS = 2000

# In a process of its own, so that no other guard's goroutines run: one
# guard, CALLS cheap calls 300 µs apart (a transfer engine's call between
# two of the guard's), and the voluntary context switches of every thread
# but the caller's over them.
SCRIPT = textwrap.dedent("""
    import ctypes, os, threading, time
    from mcguard import Guard

    def switches():
        out = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                status = open("/proc/self/task/%s/status" % tid).read()
            except OSError:
                continue  # ended meanwhile
            out[tid] = int(status.split("voluntary_ctxt_switches:")[1].split()[0])
        return out

    g = Guard(verify="off")
    lib, h, buf = g._lib, g._handle, ctypes.create_string_buffer(16)
    me = str(threading.get_native_id())
    for _ in range(200):
        assert lib.mc_guard_id(h, buf, 16) == 0
    before = switches()
    for _ in range(CALLS):
        assert lib.mc_guard_id(h, buf, 16) == 0
        t = time.perf_counter()
        while time.perf_counter() - t < 300e-6:
            pass
    after = switches()
    print(sum(n - before.get(tid, 0) for tid, n in after.items() if tid != me))
    g.close()
""").replace("CALLS", str(CALLS))


def test_a_busy_caller_leaves_the_runtimes_threads_asleep():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    woken = int(out.stdout.split()[-1])
    # Without the kept slot this is about two per call (the monitor woken by
    # the call, then asleep again after it took the slot); with it, three
    # or four per yield, one yield per 8 ms of calls: about 0.13 per call.
    assert woken < CALLS // 2, "the library's threads woke %d times in %d calls" % (woken, CALLS)
