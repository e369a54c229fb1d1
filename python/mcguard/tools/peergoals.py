"""The performance goals, each beside the peer it is measured against:
peerbench --goals runs the engines below in one run and prints a row per
path and figure (mcguard's figures, the peer's, the goal, whether the
medians of this run meet it, and in how many rounds the figures of that
round meet it: the engines of a round run one after the other, so a goal
met in some rounds and not in others is within this machine's noise).
Under a goal not met, why: its figures round by round, and where the
time went from the profiles (peerprofile)."""

import statistics

from . import peerprofile, texttable

# Every engine the goals table needs (peerbench kinds).
ENGINES = ["mooncake", "mooncake+ping", "nixl",
           "mcguard-socket-off", "mcguard-socket-tail", "mcguard-socket-digest",
           "mcguard-socket-off+ping", "mcguard-socket-digest+sync-read",
           "mcguard-off", "mcguard-tail", "mcguard-digest", "mcguard-off+ping", "mcguard-digest+sync-read",
           "guarded-mooncake-tail", "guarded-mooncake-sample", "guarded-mooncake-digest"]
SIZES = ["1x4KiB", "64x256KiB", "512x16KiB", "4096x4KiB"]
COLUMNS = ("path", "figure", "mcguard", "peer", "goal", "met", "rounds met")


def rows(results, nixl_tls, profiles=None):
    """The goals table's rows (dicts of COLUMNS) from peerbench's results,
    {(engine, size): [figure per round]}; a row whose engines did not run
    says so in "met". Each row's "why" says, for a goal not met, what its
    figures were round by round and where the time went, from profiles
    ({(engine, size): [per-round peerprofile.profile]}, None: figures
    only)."""
    out = judged(results, nixl_tls, statistics.median, profiles or {})
    rounds = min((len(figs) for figs in results.values()), default=0)
    per_round = [judged(results, nixl_tls, lambda figs, r=r: figs[r]) for r in range(rounds)]
    for i, row in enumerate(out):
        verdicts = [rs[i]["met"] for rs in per_round]
        row["rounds met"] = "-" if row["met"] == "not run" else "%d of %d" % (verdicts.count("yes"), rounds)
    return out


def judged(results, nixl_tls, pick, profiles=None):
    """The rows, every figure pick(its figures per round): their median,
    or one round's; with profiles (the medians' pass), why for each goal
    not met."""
    def med(kind, size):
        figs = results.get((kind, size))
        return pick(figs) if figs else None

    nixl = "NIXL (UCX_TLS=%s)" % nixl_tls
    out = []
    why = Why(results, profiles) if profiles is not None else None  # the medians' pass only

    def row(path, figure, ours, peer, goal, met, pairs, reason=None):
        out.append({"path": path, "figure": figure, "mcguard": ours, "peer": peer, "goal": goal,
                    "met": "not run" if met is None else ("yes" if met else "NO"),
                    "profiled": [list(p) for p in pairs],
                    "why": reason() if met is False and reason and why is not None else ""})

    def need(*vals):
        return None if any(v is None for v in vals) else True

    for path, pre in (("sockets", "mcguard-socket-"), ("one host", "mcguard-")):
        off, tail, dig = (med(pre + m, "1x4KiB") for m in ("off", "tail", "digest"))
        mc, nx = med("mooncake", "1x4KiB"), med("nixl", "1x4KiB")
        if path == "sockets":
            row(path, "1 x 4 KiB µs: off / tail / digest", fmt(off, tail, dig),
                "Mooncake %s; %s %s" % (fmt(mc), nixl, fmt(nx)), "digest <= 1.15 x off",
                need(off, dig) and dig <= 1.15 * off, at(pre, ("off", "digest"), "1x4KiB"),
                lambda pre=pre: why.latency(pre))
        else:
            row(path, "1 x 4 KiB µs: off / tail / digest", fmt(off, tail, dig), "%s %s" % (nixl, fmt(nx)),
                "tail <= 1.1 x NIXL; digest <= 1.5 x off",
                need(off, tail, dig, nx) and tail <= 1.1 * nx and dig <= 1.5 * off,
                at(pre, ("off", "tail", "digest"), "1x4KiB"), lambda pre=pre: why.latency(pre, against_nixl=True))
        done, synced = med(pre + "off+ping", "1x4KiB"), med(pre + "digest+sync-read", "1x4KiB")
        mdone = med("mooncake+ping", "1x4KiB")
        goal = "digest + sync <= 1.2 x (off + done)"
        within = need(done, synced) and synced <= 1.2 * done
        met, over_mooncake = within, False
        if path == "sockets":
            goal += "; off + done <= Mooncake + done"
            over_mooncake = need(done, mdone) and done > mdone
            met = need(done, synced, mdone) and within and not over_mooncake
        row(path, "off + done / digest + the receiver's sync, µs", fmt(done, synced),
            "Mooncake + done %s" % fmt(mdone) if path == "sockets" else "-", goal, met,
            at(pre, ("off+ping", "digest+sync-read"), "1x4KiB"),
            lambda pre=pre, done=done, synced=synced, within=within, mdone=mdone if over_mooncake else None:
                why.done(pre, done, synced, within, mdone))
        off, tail = (med(pre + m, "64x256KiB") for m in ("off", "tail"))
        nx, mc = med("nixl", "64x256KiB"), med("mooncake", "64x256KiB")
        row(path, "64 x 256 KiB GB/s: off / tail", fmt(off, tail, unit="GB/s"),
            "%s %s; Mooncake %s" % (nixl, fmt(nx, unit="GB/s"), fmt(mc, unit="GB/s")), "tail >= NIXL",
            need(tail, nx) and tail >= nx, at(pre, ("off", "tail"), "64x256KiB"),
            lambda pre=pre: why.by_round([(pre + "tail", "tail"), ("nixl", "NIXL")], "64x256KiB", "GB/s"))
    shapes = ("64x256KiB", "512x16KiB", "4096x4KiB")
    for mode, want in (("tail", 0.9), ("sample", 0.9), ("digest", 0.95)):
        fr = [None if None in (med("guarded-mooncake-" + mode, s), med("mooncake", s)) else
              med("guarded-mooncake-" + mode, s) / med("mooncake", s) for s in shapes]
        row("over Mooncake's engine", "%s: fraction of Mooncake alone at %s" % (mode, " / ".join(shapes)),
            fmt(*fr, unit="GB/s"), "Mooncake alone = 1 (%s GB/s)" % fmt(*(med("mooncake", s) for s in shapes),
                                                                          unit="GB/s"),
            ">= %.2f" % want, need(*fr) and all(f >= want for f in fr),
            [p for s in shapes for p in (("mooncake", s), ("guarded-mooncake-" + mode, s))],
            lambda mode=mode, fr=fr, want=want: why.fractions(mode, [s for s, f in zip(shapes, fr) if f < want]))
    tail, dig, mc = (med(k, "1x4KiB") for k in ("guarded-mooncake-tail", "guarded-mooncake-digest", "mooncake"))
    row("over Mooncake's engine", "1 x 4 KiB µs: tail / digest", fmt(tail, dig), "Mooncake alone %s" % fmt(mc),
        "<= 1.3 x Mooncake alone", need(tail, dig, mc) and max(tail, dig) <= 1.3 * mc,
        [("mooncake", "1x4KiB"), ("guarded-mooncake-tail", "1x4KiB"), ("guarded-mooncake-digest", "1x4KiB")],
        lambda: why.engine_latency(mc))
    return out


class Why:
    """The sentences under a goal not met: figures round by round (the
    run's own), and from the profiles (means per transfer, the median over
    rounds) where the time went."""

    def __init__(self, results, profiles):
        self.results, self.profiles = results, profiles

    def prof(self, kind, size="1x4KiB"):
        return peerprofile.combined(self.profiles.get((kind, size), []))

    def rounds(self, kind, size, unit):
        return fmt(*self.results.get((kind, size), []), unit=unit) + " " + unit

    def by_round(self, kinds, size, unit):
        """Each (kind, label)'s figures round by round."""
        return "by round, %s" % "; ".join("%s %s" % (label, self.rounds(kind, size, unit)) for kind, label in kinds)

    def ratios(self, a, b, size="1x4KiB"):
        return " / ".join("%.2f" % (x / y) for x, y in zip(self.results.get((a, size), []),
                                                            self.results.get((b, size), [])) if y)

    def latency(self, pre, against_nixl=False):
        text = "digest / off by round %s" % self.ratios(pre + "digest", pre + "off")
        if against_nixl:
            text = "tail / NIXL by round %s; %s" % (self.ratios(pre + "tail", "nixl"), text)
        off, dig = self.prof(pre + "off"), self.prof(pre + "digest")
        if "in the library" in off and "in the library" in dig:
            text += "; in the library off took %.1f µs, digest %.1f (%.1f of it its fence and check)" % (
                off["in the library"], dig["in the library"], dig.get("checks", 0.0))
        return text

    def done(self, pre, done, synced, within, mdone=None):
        """Digest plus the receiver's sync against off plus "done": what the
        goal leaves, whether digest plus sync was within it, and where the
        difference went; mdone: Mooncake + done where off + done took
        longer."""
        text = "the goal leaves %.1f µs above off + done; digest + sync took %.1f more%s" % (
            0.2 * done, synced - done, " (within it)" if within else "")
        ping, sync = self.prof(pre + "off+ping"), self.prof(pre + "digest+sync-read")
        call = sync.get("receiver's call")
        if call is not None:
            text += ": the receiver's sync_transfers call %.1f µs in its process (%.1f in the library)" % (
                call, sync.get("receiver's sync", 0.0))
            if all(k in p for p in (sync, ping) for k in ("a transfer", "in the library")):
                # From the profiles alone, as the header says: the means of
                # the same transfers, not the figures' medians less a mean.
                text += ", and the sender's transfer %.1f µs more than off's (in the library %.1f more, its " \
                        "fence and check %.1f)" % (sync["a transfer"] - call - ping["a transfer"],
                                                  sync["in the library"] - ping["in the library"],
                                                  sync.get("checks", 0.0))
        if mdone is not None:
            text += "; off + done took %.1f µs against Mooncake + done %.1f" % (done, mdone)
        return text

    def inside(self, kind, size, form):
        """Mooncake's calls inside the guard against Mooncake alone as a
        whole, and the guard's own time (a transfer less those calls),
        each in form; "" where either is not profiled."""
        p, alone = self.prof(kind, size), self.prof("mooncake", size)
        if "engine's calls" not in p or "a transfer" not in alone:
            return ""
        return ("Mooncake's calls inside the guard took %s µs a transfer against %s for Mooncake alone, the "
                "guard's own time (checks, its path, the wrapper) %s" % (form, form, form)) % (
                    p["engine's calls"], alone["a transfer"], p["a transfer"] - p["engine's calls"])

    def fractions(self, mode, shapes):
        parts = []
        for s in shapes:
            text = "at %s the fraction by round %s" % (s, self.ratios("guarded-mooncake-" + mode, "mooncake", s) or "-")
            inside = self.inside("guarded-mooncake-" + mode, s, "%.0f")
            parts.append(text + (": " + inside if inside else ""))
        return "; ".join(parts)

    def engine_latency(self, mc):
        text = "the goal leaves %.1f µs above Mooncake alone (%.1f)" % (0.3 * mc, mc)
        for mode in ("tail", "digest"):
            inside = self.inside("guarded-mooncake-" + mode, "1x4KiB", "%.1f")
            if inside:
                text += "; %s: %s" % (mode, inside)
        return text


def fmt(*vals, unit="µs"):
    """Figures as the goals table writes them: µs to 0.1, the rest (GB/s,
    fractions) to 0.01; "-" for one not measured."""
    return " / ".join("-" if v is None else ("%.1f" % v if unit == "µs" else "%.2f" % v) for v in vals)


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
    """The rows as a text table, the count of goals met, what the layout
    means for them, and why each goal not met was missed."""
    lines = texttable.lines([list(COLUMNS)] + [[r[c] for c in COLUMNS] for r in rs])
    met = sum(r["met"] == "yes" for r in rs)
    lines.append("%d of %d goals met (medians of this run); \"rounds met\": in how many rounds that "
                 "round's figures meet it" % (met, len(rs)))
    if layout in LAYOUT_NOTES:
        lines.append("layout %s: %s" % (layout, LAYOUT_NOTES[layout]))
    whys = [r for r in rs if r.get("why")]
    if whys:
        lines.append("")
        lines.append("Why, for the goals not met (means per transfer from the profiles below):")
        lines += ["- %s, %s: %s" % (r["path"], r["figure"], r["why"]) for r in whys]
    return "\n".join(lines)
