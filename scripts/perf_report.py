"""The performance page's figures from `python -m mcguard.tools.peerbench --json`
output: PNG plots and the Markdown tables between the page's markers.

    python3 scripts/perf_report.py [--page docs/PERFORMANCE.md] [--plots docs/perf] RUN.json...

Each run is one peerbench invocation (its engines interleaved round by
round, so its ratios are like for like); runs are never mixed in one ratio.
Plots: throughput by batch shape and 1 x 4 KiB latency by engine, each
bar a median with the spread of its rounds; a run with Mooncake alone and
mcguard over it (--over-mooncake) adds the fraction of Mooncake's
throughput each mode keeps.
"""

import argparse
import json
import os
import re
import statistics
import sys

LATENCY = "1x4KiB"


def load(path):
    with open(path) as f:
        run = json.load(f)
    run["name"] = os.path.splitext(os.path.basename(path))[0]
    return run


def med(run, engine, size):
    return statistics.median(run["figures"][engine][size])


def spread(run, engine, size):
    xs = run["figures"][engine][size]
    return min(xs), max(xs)


def reference(run):
    return "mooncake" if "mooncake" in run["engines"] else None


def table(run):
    """Markdown: medians (min-max over rounds) and the ratio to Mooncake."""
    ref = reference(run)
    head = ["engine"] + ["%s (%s)" % (s, "µs" if run["units"][s] == "us" else "GB/s") for s in run["sizes"]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in run["engines"]:
        cells = [e]
        for s in run["sizes"]:
            m, (lo, hi) = med(run, e, s), spread(run, e, s)
            fmt = "%.1f" if run["units"][s] == "us" else "%.2f"
            cell = (fmt + " (" + fmt + "–" + fmt + ")") % (m, lo, hi)
            if ref and e != ref:
                cell += " ×%.2f" % (m / med(run, ref, s))
            cells.append(cell)
        lines.append("| " + " | ".join(cells) + " |")
    m = run["machine"]
    lines.append("")
    lines.append("%s: %d rounds, %s s per throughput figure, %d latency iterations, %s layout; %s, %d cores, "
                 "kernel %s, Python %s, mcguard %s%s. Medians, (min–max) over rounds%s." % (
                     run["date"], run["rounds"], run["seconds"], run["latency_iters"], run["layout"], m["cpu"],
                     m["cores"], m["kernel"], m["python"], m["mcguard"],
                     "; NIXL with UCX_TLS=%s" % run["nixl_tls"] if "nixl" in run["engines"] else "",
                     ", ×N the ratio to Mooncake's median in the same rounds" if ref else ""))
    if run["mismatches"]:
        lines.append("**Destination mismatches: %s**" % run["mismatches"])
    else:
        lines.append("Every destination matched its source (SHA-1 at the receiver) in every round.")
    return "\n".join(lines)


def bars(ax, run, engines, sizes, value):
    """Grouped bars: one group per size, one bar per engine, whiskers from
    the rounds' spread."""
    width = 0.8 / len(engines)
    for i, e in enumerate(engines):
        xs = [j + (i - (len(engines) - 1) / 2) * width for j in range(len(sizes))]
        ys, lo, hi = [], [], []
        for s in sizes:
            y, (a, b) = value(run, e, s)
            ys.append(y)
            lo.append(y - a)
            hi.append(b - y)
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=e)
    ax.set_xticks(range(len(sizes)))
    ax.set_xticklabels(sizes)


def save(plt, fig, ax, out, title, legend=True):
    """Title, the legend beside the bars, and the PNG written."""
    ax.set_title(title)
    if legend:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def throughput_plot(plt, run, out):
    sizes = [s for s in run["sizes"] if s != LATENCY]
    if not sizes:
        return None
    fig, ax = plt.subplots(figsize=(10.5, 4.5))
    bars(ax, run, run["engines"], sizes, lambda r, e, s: (med(r, e, s), spread(r, e, s)))
    ax.set_ylabel("GB/s (median, whiskers: min–max)")
    return save(plt, fig, ax, out, "Throughput by batch shape, two processes on one host (%s)" % run["date"])


def latency_plot(plt, run, out):
    if LATENCY not in run["sizes"]:
        return None
    engines = run["engines"]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(engines) + 1.2))
    ms = [med(run, e, LATENCY) for e in engines]
    sp = [spread(run, e, LATENCY) for e in engines]
    ax.barh(range(len(engines)), ms, xerr=[[m - a for m, (a, _) in zip(ms, sp)], [b - m for m, (_, b) in zip(ms, sp)]],
            capsize=2, color="tab:blue")
    ax.set_yticks(range(len(engines)))
    ax.set_yticklabels(engines)
    ax.invert_yaxis()
    ax.set_xlabel("µs per 1 x 4 KiB transfer (median, whiskers: min–max)")
    return save(plt, fig, ax, out, "Latency by engine and mode (%s)" % run["date"], legend=False)


def fraction_plot(plt, run, out):
    """Each engine's throughput as a fraction of Mooncake alone."""
    sizes = [s for s in run["sizes"] if s != LATENCY]
    others = [e for e in run["engines"] if e != "mooncake"]
    if not sizes or not others:
        return None
    fig, ax = plt.subplots(figsize=(10.5, 4.5))

    def value(r, e, s):
        ref = med(r, "mooncake", s)
        a, b = spread(r, e, s)
        return med(r, e, s) / ref, (a / ref, b / ref)
    bars(ax, run, others, sizes, value)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_ylabel("fraction of Mooncake alone")
    return save(plt, fig, ax, out, "Over Mooncake's own engine (TCP), %s blocks: what each check keeps (%s)"
                % (run.get("layout", "consecutive"), run["date"]))


def replace_section(page, name, body):
    """The text between <!-- NAME:begin --> and <!-- NAME:end --> becomes body."""
    with open(page) as f:
        text = f.read()
    pat = re.compile(r"(<!-- %s:begin -->\n)(?:.*?\n)?(<!-- %s:end -->)" % (re.escape(name), re.escape(name)),
                     re.S)
    if not pat.search(text):
        print("%s has no %s markers: its table left as it was" % (page, name), file=sys.stderr)
        return False
    with open(page, "w") as f:
        f.write(pat.sub(lambda m: m.group(1) + body.rstrip("\n") + "\n" + m.group(2), text))
    return True


def main(argv=None):
    p = argparse.ArgumentParser(prog="perf_report.py", description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="peerbench --json outputs")
    p.add_argument("--page", default="docs/PERFORMANCE.md", help="page whose marked tables are rewritten")
    p.add_argument("--plots", default="docs/perf", help="folder for the PNG plots")
    a = p.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(a.plots, exist_ok=True)
    written = []
    for path in a.runs:
        run = load(path)
        name = run["name"]
        over = any(e.startswith("guarded-mooncake-") for e in run["engines"])
        plots = [fraction_plot(plt, run, os.path.join(a.plots, name + "-fraction.png"))] if over else [
            throughput_plot(plt, run, os.path.join(a.plots, name + "-throughput.png")),
            latency_plot(plt, run, os.path.join(a.plots, name + "-latency.png"))]
        written += [x for x in plots if x]
        updated = replace_section(a.page, name, table(run)) if os.path.exists(a.page) else False
        print("%-28s %d engines x %d shapes, %d rounds%s" % (name, len(run["engines"]), len(run["sizes"]),
                                                            run["rounds"], ", table in " + a.page if updated else ""))
    print("plots:\n  " + "\n  ".join(written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
