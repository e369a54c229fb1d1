"""Where a benchmarked transfer's time went, from the guards' own clocks:
peerbench reads the sending and the receiving guard's stats before and
after each measurement, and this module turns the two readings into the
means per transfer (µs): the whole transfer as the benchmark timed it,
the part inside mc_guard_transfer, of that the engine's own calls (over
a user's engine) and the fences and checks after the writes, and at the
receiver its sync calls. What is left inside the library ("the rest") is
the guard's own path over an engine, and on mcguard's own data planes
the writes too; what is left outside it is the Python wrapper's (its
arrays, ctypes)."""

import statistics

from . import texttable

# The stats counters read, each summed over calls in the library.
COUNTERS = ("transfers", "transfer_ns", "check_ns", "engine_calls", "engine_call_ns")
RECEIVER_COUNTERS = ("sync_calls", "sync_ns")
COLUMNS = ("engine", "shape", "a transfer", "in the library", "engine's calls", "checks", "the rest",
           "outside the library", "receiver's call", "receiver's sync")


def reading(sender_stats, receiver_stats):
    """The counters of one reading: the sending guard's, and the receiving
    one's ({} where the receiver runs no guard)."""
    out = {k: sender_stats.get(k, 0) for k in COUNTERS}
    out.update({k: receiver_stats.get(k, 0) for k in RECEIVER_COUNTERS})
    out["has_engine"] = "engine_calls" in sender_stats
    return out


def profile(before, after, transfers, wall_seconds):
    """Means per transfer in µs between two readings (None: the engine has
    no guard, and the transfer's own time is all there is), for transfers
    that took wall_seconds together as the benchmark timed them."""
    prof = {"a transfer": wall_seconds / transfers * 1e6 if transfers else None}
    if before is None or after is None:
        return prof
    d = {k: after[k] - before[k] for k in COUNTERS + RECEIVER_COUNTERS}
    n = d["transfers"]
    if n <= 0:
        return prof
    prof["in the library"] = d["transfer_ns"] / n / 1e3
    prof["checks"] = d["check_ns"] / n / 1e3
    own = prof["in the library"] - prof["checks"]
    if after["has_engine"]:
        prof["engine's calls"] = d["engine_call_ns"] / n / 1e3
        own -= prof["engine's calls"]
    prof["the rest"] = own
    prof["outside the library"] = prof["a transfer"] - prof["in the library"]
    if d["sync_calls"] > 0:
        prof["receiver's sync"] = d["sync_ns"] / d["sync_calls"] / 1e3
    return prof


def combined(rounds):
    """Each figure's median over the rounds that have it."""
    out = {}
    for key in COLUMNS[2:]:
        vals = [r[key] for r in rounds if r.get(key) is not None]
        if vals:
            out[key] = statistics.median(vals)
    return out


def table(profiles, pairs=None):
    """A text table of the profiles ({(engine, shape): [per round]}), for
    the (engine, shape) pairs given, in that order (all of them: None)."""
    pairs = [p for p in (pairs if pairs is not None else list(profiles)) if profiles.get(p)]
    cells = [list(COLUMNS)]
    for kind, shape in pairs:
        prof = combined(profiles[(kind, shape)])
        cells.append([kind, shape] + ["%.1f" % prof[c] if c in prof else "-" for c in COLUMNS[2:]])
    lines = texttable.lines(cells)
    lines.append("µs per transfer: means over each round's transfers, the median over rounds. \"In the library\": "
                 "inside mc_guard_transfer; of it the engine's own calls, the fences and checks after the writes, "
                 "and the rest (over an engine the guard's own path; on mcguard's planes the writes too); "
                 "\"outside the library\": the Python wrapper around it (for a kind that syncs, the receiver's "
                 "call too); \"receiver's call\": its sync_transfers as the receiving process timed it, and of "
                 "that \"receiver's sync\", in the receiving guard")
    return "\n".join(lines)
