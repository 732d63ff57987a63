"""Pictures of a timed pipeline schedule (mlfabric.pipeline.validate.simulate), for people:
gantt(timeline) is a text Gantt chart (one row per rank, one column per time unit, each cell the
pass running then), plot(timeline, path) writes the same as a PNG.

matplotlib is imported only inside plot(), and only its object API with the Agg canvas: no
pyplot, so the caller's backend and figures are left alone.
"""
import math

from .validate import Timeline

IDLE = "."
STEP = "|"  # between two cells: an optimizer step (S) at that time on that rank


def gantt(timeline, unit=None):
    """A text Gantt chart: one row per rank, one column per `unit` of time (by default the
    shortest pass), each cell the label of the pass running at the column's middle ("F3", "B3",
    "F3.1" with chunks; "." idle); "|" between cells marks an optimizer step."""
    if not isinstance(timeline, Timeline):
        raise ValueError("gantt takes a Timeline (from simulate), got %r"
                         % (type(timeline).__name__,))
    sched = timeline.schedule
    spans = [e - s for row in timeline.rows.values() for _, s, e in row if e > s]
    if unit is None:
        unit = min(spans) if spans else 1.0
    if not isinstance(unit, (int, float)) or isinstance(unit, bool) or not unit > 0:
        raise ValueError("unit must be a number > 0, got %r" % (unit,))
    cols = max(1, math.ceil(timeline.makespan / unit - 1e-9))
    chunks = sched.v > 1
    width = max([len(a.label(chunks)) for row in timeline.rows.values() for a, _, _ in row]
                + [len(IDLE)])
    names = {r: sched.rank_label(r) for r in timeline.rows}
    lw = max(len(n) for n in names.values())
    lines = ["%s: makespan %.6g, bubble %.4g (idle / compute), idle %.4g of ranks x makespan, "
             "%.6g per column" % (sched.header(), timeline.makespan, timeline.bubble_fraction,
                                  timeline.idle_fraction, unit)]
    for r in sorted(timeline.rows):
        cells = [IDLE] * cols
        seps = [" "] * (cols + 1)
        for a, s, e in timeline.rows[r]:
            if a.kind == "S":
                seps[min(cols, max(0, round(s / unit)))] = STEP
                continue
            for c in range(max(0, math.floor(s / unit)), min(cols, math.ceil(e / unit))):
                if s <= (c + 0.5) * unit < e:
                    cells[c] = a.label(chunks)
        body = "".join(seps[c] + cells[c].ljust(width) for c in range(cols)) + seps[cols]
        lines.append("%-*s %s" % (lw, names[r], body.rstrip()))
    lines.append("legend: F forward, B backward (microbatch[.chunk]), %s idle, %s optimizer step"
                 % (IDLE, STEP))
    lines.append("peak stashed activations per stage: %s; peak live weight versions per stage: %s"
                 % (_per_stage(timeline.peak_stash), _per_stage(timeline.peak_versions)))
    return "\n".join(lines)


def _per_stage(d):
    return " ".join("s%d=%d" % (s, d[s]) for s in sorted(d))


def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
    except ImportError as e:
        raise ImportError("mlfabric.pipeline.timeline.plot draws with matplotlib, which is not "
                          "installed (pip install matplotlib); gantt() needs nothing") from e
    return Figure, Patch, Line2D, FigureCanvasAgg


def plot(timeline, path):
    """Write a PNG Gantt chart of `timeline` to `path` (one row per rank; forwards blue,
    backwards orange, darker for later chunks; optimizer steps black ticks); return `path`."""
    if not isinstance(timeline, Timeline):
        raise ValueError("plot takes a Timeline (from simulate), got %r"
                         % (type(timeline).__name__,))
    Figure, Patch, Line2D, FigureCanvasAgg = _matplotlib()
    from matplotlib import colormaps
    sched = timeline.schedule
    ranks = sorted(timeline.rows)
    fig = Figure(figsize=(max(8.0, min(24.0, 0.25 * timeline.makespan + 4)),
                          1.4 + 0.45 * len(ranks)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    shades = {"F": colormaps["Blues"], "B": colormaps["Oranges"]}
    chunks = sched.v > 1
    steps = 0
    for y, r in enumerate(ranks):
        for a, s, e in timeline.rows[r]:
            if a.kind == "S":
                steps += 1
                ax.plot([s, s], [y - 0.4, y + 0.4], color="black", linewidth=1.5)
                continue
            # chunk 0 lightest: later chunks of the interleaved schedule darker
            colour = shades[a.kind](0.35 + 0.5 * a.chunk / max(1, sched.v - 1))
            ax.broken_barh([(s, e - s)], (y - 0.35, 0.7), facecolors=colour, edgecolor="black",
                           linewidth=0.4)
            ax.text((s + e) / 2, y, a.label(chunks)[1:], ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([sched.rank_label(r) for r in ranks])
    ax.set_ylim(len(ranks) - 0.5, -0.5)
    ax.set_xlim(0, timeline.makespan * 1.01 if timeline.makespan > 0 else 1.0)
    ax.set_xlabel("time")
    ax.grid(axis="x", alpha=0.3)
    handles = [Patch(facecolor=shades["F"](0.6), label="forward"),
               Patch(facecolor=shades["B"](0.6), label="backward")]
    if steps:
        handles.append(Line2D([], [], color="black", label="optimizer step"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
              frameon=False)
    ax.set_title("%s p=%d m=%d v=%d: makespan %.4g, bubble %.3g"
                 % (sched.name, sched.p, sched.m, sched.v, timeline.makespan,
                    timeline.bubble_fraction), fontsize=10)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return path
