"""The performance goals, each beside the peer it is measured against:
peerbench --goals runs the engines below in one run and prints a row per
path and figure (mcguard's figures, the peer's, the goal, whether the
medians of this run meet it, and in how many rounds the figures of that
round meet it: the engines of a round run one after the other, so a goal
met in some rounds and not in others is within this machine's noise)."""

import statistics

from . import texttable

# Every engine the goals table needs (peerbench kinds).
ENGINES = ["mooncake", "mooncake+ping", "nixl",
           "mcguard-socket-off", "mcguard-socket-tail", "mcguard-socket-digest",
           "mcguard-socket-off+ping", "mcguard-socket-digest+sync-read",
           "mcguard-off", "mcguard-tail", "mcguard-digest", "mcguard-off+ping", "mcguard-digest+sync-read",
           "guarded-mooncake-tail", "guarded-mooncake-sample", "guarded-mooncake-digest"]
SIZES = ["1x4KiB", "64x256KiB", "512x16KiB", "4096x4KiB"]
COLUMNS = ("path", "figure", "mcguard", "peer", "goal", "met", "rounds met")


def rows(results, nixl_tls):
    """The goals table's rows (dicts of COLUMNS) from peerbench's results,
    {(engine, size): [figure per round]}; a row whose engines did not run
    says so in "met"."""
    out = judged(results, nixl_tls, statistics.median)
    rounds = min((len(figs) for figs in results.values()), default=0)
    per_round = [judged(results, nixl_tls, lambda figs, r=r: figs[r]) for r in range(rounds)]
    for i, row in enumerate(out):
        verdicts = [rs[i]["met"] for rs in per_round]
        row["rounds met"] = "-" if row["met"] == "not run" else "%d of %d" % (verdicts.count("yes"), rounds)
    return out


def judged(results, nixl_tls, pick):
    """The rows, every figure pick(its figures per round): their median,
    or one round's."""
    def med(kind, size):
        figs = results.get((kind, size))
        return pick(figs) if figs else None

    nixl = "NIXL (UCX_TLS=%s)" % nixl_tls
    out = []

    def row(path, figure, ours, peer, goal, met, pairs):
        out.append({"path": path, "figure": figure, "mcguard": ours, "peer": peer, "goal": goal,
                    "met": "not run" if met is None else ("yes" if met else "NO"),
                    "profiled": [list(p) for p in pairs]})

    def need(*vals):
        return None if any(v is None for v in vals) else True

    def fmt(*vals, unit="µs"):
        return " / ".join("-" if v is None else ("%.1f" % v if unit == "µs" else "%.2f" % v) for v in vals)

    for path, pre in (("sockets", "mcguard-socket-"), ("one host", "mcguard-")):
        off, tail, dig = (med(pre + m, "1x4KiB") for m in ("off", "tail", "digest"))
        mc, nx = med("mooncake", "1x4KiB"), med("nixl", "1x4KiB")
        if path == "sockets":
            row(path, "1 x 4 KiB µs: off / tail / digest", fmt(off, tail, dig),
                "Mooncake %s; %s %s" % (fmt(mc), nixl, fmt(nx)), "digest <= 1.15 x off",
                need(off, dig) and dig <= 1.15 * off, at(pre, ("off", "digest"), "1x4KiB"))
        else:
            row(path, "1 x 4 KiB µs: off / tail / digest", fmt(off, tail, dig), "%s %s" % (nixl, fmt(nx)),
                "tail <= 1.1 x NIXL; digest <= 1.5 x off",
                need(off, tail, dig, nx) and tail <= 1.1 * nx and dig <= 1.5 * off,
                at(pre, ("off", "tail", "digest"), "1x4KiB"))
        done, synced = med(pre + "off+ping", "1x4KiB"), med(pre + "digest+sync-read", "1x4KiB")
        mdone = med("mooncake+ping", "1x4KiB")
        goal = "digest + sync <= 1.2 x (off + done)"
        met = need(done, synced) and synced <= 1.2 * done
        if path == "sockets":
            goal += "; off + done <= Mooncake + done"
            met = need(done, synced, mdone) and met and done <= mdone
        row(path, "off + done / digest + the receiver's sync, µs", fmt(done, synced),
            "Mooncake + done %s" % fmt(mdone) if path == "sockets" else "-", goal, met,
            at(pre, ("off+ping", "digest+sync-read"), "1x4KiB"))
        off, tail = (med(pre + m, "64x256KiB") for m in ("off", "tail"))
        nx, mc = med("nixl", "64x256KiB"), med("mooncake", "64x256KiB")
        row(path, "64 x 256 KiB GB/s: off / tail", fmt(off, tail, unit="GB/s"),
            "%s %s; Mooncake %s" % (nixl, fmt(nx, unit="GB/s"), fmt(mc, unit="GB/s")), "tail >= NIXL",
            need(tail, nx) and tail >= nx, at(pre, ("off", "tail"), "64x256KiB"))
    shapes = ("64x256KiB", "512x16KiB", "4096x4KiB")
    for mode, want in (("tail", 0.9), ("sample", 0.9), ("digest", 0.95)):
        fr = [None if None in (med("guarded-mooncake-" + mode, s), med("mooncake", s)) else
              med("guarded-mooncake-" + mode, s) / med("mooncake", s) for s in shapes]
        row("over Mooncake's engine", "%s: fraction of Mooncake alone at %s" % (mode, " / ".join(shapes)),
            fmt(*fr, unit="GB/s"), "Mooncake alone = 1 (%s GB/s)" % fmt(*(med("mooncake", s) for s in shapes),
                                                                          unit="GB/s"),
            ">= %.2f" % want, need(*fr) and all(f >= want for f in fr),
            [p for s in shapes for p in (("mooncake", s), ("guarded-mooncake-" + mode, s))])
    tail, dig, mc = (med(k, "1x4KiB") for k in ("guarded-mooncake-tail", "guarded-mooncake-digest", "mooncake"))
    row("over Mooncake's engine", "1 x 4 KiB µs: tail / digest", fmt(tail, dig), "Mooncake alone %s" % fmt(mc),
        "<= 1.3 x Mooncake alone", need(tail, dig, mc) and max(tail, dig) <= 1.3 * mc,
        [("mooncake", "1x4KiB"), ("guarded-mooncake-tail", "1x4KiB"), ("guarded-mooncake-digest", "1x4KiB")])
    return out


def at(prefix, modes, shape):
    """The (engine, shape) pairs of prefix+mode for each mode."""
    return [(prefix + m, shape) for m in modes]


def missed_pairs(rs):
    """The (engine, shape) pairs of the goals not met, each once, in the
    rows' order: the ones whose time peerprofile shows."""
    out = []
    for r in rs:
        if r["met"] == "NO":
            out += [tuple(p) for p in r["profiled"] if tuple(p) not in out]
    return out


# What the over-Mooncake rows measure with each layout (peerbench --layout).
LAYOUT_NOTES = {
    "consecutive": "over Mooncake's engine the guard joins consecutive blocks into requests of one Mooncake "
                   "slice; --layout scattered measures blocks sent one by one, as vLLM's and SGLang's "
                   "connectors (which join a request's consecutive blocks themselves) reach it",
    "scattered": "blocks that do not continue one another: nothing is joined, over sockets, on one host or "
                 "over Mooncake's engine",
}


def table(rs, layout=None):
    """The rows as a text table, the count of goals met, and what the
    layout means for them."""
    lines = texttable.lines([list(COLUMNS)] + [[r[c] for c in COLUMNS] for r in rs])
    met = sum(r["met"] == "yes" for r in rs)
    lines.append("%d of %d goals met (medians of this run); \"rounds met\": in how many rounds that "
                 "round's figures meet it" % (met, len(rs)))
    if layout in LAYOUT_NOTES:
        lines.append("layout %s: %s" % (layout, LAYOUT_NOTES[layout]))
    return "\n".join(lines)
