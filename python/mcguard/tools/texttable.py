"""The tools' plain text tables: a header row, a rule of dashes, and the
rows, each column as wide as its widest cell."""


def lines(cells, right=False):
    """cells (the header row first, every cell a str) as aligned lines:
    left-justified, or right-justified (numbers) with right."""
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    out = ["  ".join(v.rjust(w) if right else v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    out.insert(1, "  ".join("-" * w for w in widths))
    return out
