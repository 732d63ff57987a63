"""Pictures of a schedule, for people: timeline(plan, path) writes a PNG Gantt chart,
timeline_text(plan) returns an ASCII one for terminals. One row per host the schedule uses; every
transfer is a bar on its sender's row (and a thin mark on its receiver's), coloured by what it
carries: updates straight to the server and updates to an aggregator (§5.1, Alg. 2), aggregates
(§5.2, Alg. 3), replica transfers (§5.3, when plan.replica has transfers()), models (§10.3). The
server's commits are ticks on its row (and the replica's on its row, when plan.replica has
`replica`, its host, and `commits`); dropped updates are listed beside the chart.

Besides a Plan, both accept a ShardedPlan (mlfabric.sched.sharded: one row per server, each with
its own commits) and a Distribution (mlfabric.sched.distribution: no commits; unserved
requesters listed).

matplotlib is imported only when a PNG is drawn, and only its object API with the Agg canvas: no
pyplot, so the caller's backend and figures are left alone.
"""
from dataclasses import dataclass, field
from math import ceil

from .network import GBPS
from .plan import Plan

# kind -> (ASCII mark, priority when two marks share a cell, colour, legend text)
KINDS = {
    "direct": ("=", 4, "tab:blue", "update -> server"),
    "to-aggregator": ("-", 3, "tab:orange", "update -> aggregator"),
    "aggregate": ("#", 5, "tab:green", "aggregate -> server"),
    "replica": ("r", 2, "tab:purple", "replica transfer"),
    "model": ("m", 4, "tab:brown", "model"),
    "other": ("?", 1, "tab:gray", "other"),
}
RECEIVING = "."  # on the receiver's row, under every other mark


@dataclass
class _View:
    """What a chart shows, whatever the schedule's type."""
    title: str
    servers: list
    transfers: list                                  # (Transfer, kind)
    commits: dict = field(default_factory=dict)      # server or replica host -> [Commit]
    notes: list = field(default_factory=list)        # dropped / unserved, one line each
    start: float = 0.0
    roles: dict = field(default_factory=dict)        # host -> set of role names


def _plan_transfers(plan):
    out = [(t, "direct") for t in plan.direct]
    for a in plan.aggregates:   # (a cut-through pipeline's partial sums count as aggregates)
        out.extend((t, "to-aggregator" if t.what == "update" else "aggregate")
                   for t in a.transfers())
    transfers = getattr(plan.replica, "transfers", None)
    if callable(transfers):
        out.extend((t, "replica") for t in transfers())
    return out


def _replica_commits(plan, commits, roles):
    """A replica that says where it is (`replica`: its host) and what it applied (`commits`)
    gets its commits on its row, like the server's."""
    host = getattr(plan.replica, "replica", None)
    done = getattr(plan.replica, "commits", None)
    if isinstance(host, int) and host >= 0 and done is not None:
        commits[host] = list(done)
        roles.setdefault(host, set()).add("replica")


def _plan_roles(plan, roles):
    roles.setdefault(plan.server, set()).add("server")
    for t in plan.direct:
        roles.setdefault(t.src, set()).add("worker")
    for a in plan.aggregates:
        for level in a.levels():
            roles.setdefault(level.aggregator, set()).add("aggregator")
            for t in level.inbound:
                if t.what == "update":
                    roles.setdefault(t.src, set()).add("worker")


def _dropped_notes(dropped, updates):
    return ["dropped u%d (w%d): %s" % (uid, updates[uid].worker, why)
            for uid, why in sorted(dropped.items())]


def _view(schedule):
    from .distribution import Distribution
    from .sharded import ShardedPlan
    if isinstance(schedule, Plan):
        p = schedule
        roles = {}
        _plan_roles(p, roles)
        commits = {p.server: list(p.commits)}
        _replica_commits(p, commits, roles)
        v = _View("plan: server %d, %d applied, %d dropped, makespan %.4g s"
                  % (p.server, len(p.order), len(p.dropped), p.makespan),
                  [p.server], _plan_transfers(p), commits,
                  _dropped_notes(p.dropped, p.updates), p.start, roles)
    elif isinstance(schedule, ShardedPlan):
        sp = schedule
        roles = {}
        commits = {p.server: list(p.commits) for p in sp.plans}
        for p in sp.plans:
            _plan_roles(p, roles)
            _replica_commits(p, commits, roles)
        v = _View("sharded plan: servers %s, %d applied, %d dropped, makespan %.4g s"
                  % (", ".join(str(s) for s in sp.servers), len(sp.order), len(sp.dropped),
                     sp.makespan),
                  list(sp.servers), [tk for p in sp.plans for tk in _plan_transfers(p)], commits,
                  _dropped_notes(sp.dropped, sp.updates), sp.start, roles)
    elif isinstance(schedule, Distribution):
        d = schedule
        roles = {d.server: {"server"}}
        for r in d.distributors:
            roles.setdefault(r.host, set()).add("distributor")
        for w in d.deliveries:
            roles.setdefault(w, set()).add("requester")
        v = _View("distribution from server %d: %d requesters, %d distributors, makespan %.4g s"
                  % (d.server, len(d.deliveries) + len(d.unserved), len(d.distributors),
                     d.makespan),
                  [d.server], [(t, "model") for t in d.transfers()], {},
                  ["unserved w%d" % w for w in d.unserved], d.start, roles)
    else:
        raise ValueError("expected a Plan, ShardedPlan or Distribution, got %r"
                         % (type(schedule).__name__,))
    # hosts only replica transfers explain: a replica aggregator forwards them, a replica does not
    relays = {t.src for t, kind in v.transfers if kind == "replica"}
    for t, kind in v.transfers:
        if kind == "replica" and not roles.get(t.dst):
            roles[t.dst] = {"replica aggregator" if t.dst in relays else "replica"}
    return v


def _hosts(v):
    """Servers first (in their order), then every other host a transfer touches or that commits
    (a replica), ascending."""
    others = sorted(({h for t, _ in v.transfers for h in (t.src, t.dst)} | set(v.commits))
                    - set(v.servers))
    return list(v.servers) + others


def _span(v):
    ends = [t.end for t, _ in v.transfers] + [c.time for cs in v.commits.values() for c in cs]
    t1 = max(ends + [v.start])
    return v.start, (t1 if t1 > v.start else v.start + 1.0)


def _label(h, v):
    roles = sorted(v.roles.get(h, ()), key=["server", "aggregator", "distributor", "replica",
                                             "replica aggregator", "worker",
                                             "requester"].index)
    return "h%d %s" % (h, "/".join(roles))


# --- ASCII -------------------------------------------------------------------------------------

def timeline_text(schedule, width=72):
    """An ASCII Gantt chart of a Plan (or ShardedPlan, Distribution): one row per host used, time
    across `width` columns. Marks: see the legend line it prints. On a server's row a digit is
    the number of commits in that column ('+' for ten or more); every commit is also listed."""
    if not (isinstance(width, int) and width >= 10):
        raise ValueError("width must be an int >= 10 columns, got %r" % (width,))
    v = _view(schedule)
    hosts = _hosts(v)
    t0, t1 = _span(v)
    dt = (t1 - t0) / width

    def cols(a, b):
        c0 = min(width - 1, max(0, int((a - t0) / dt)))
        c1 = min(width - 1, max(c0, ceil((b - t0) / dt) - 1))
        return range(c0, c1 + 1)

    cells = {h: [(" ", 0)] * width for h in hosts}

    def put(h, c, mark, prio):
        if prio >= cells[h][c][1]:
            cells[h][c] = (mark, prio)

    for t, kind in v.transfers:
        mark, prio, _, _ = KINDS[kind]
        for s in t.segments:
            for c in cols(s.t0, s.t1):
                put(t.src, c, mark, prio)
                put(t.dst, c, RECEIVING, 0.5)
    for server, commits in v.commits.items():
        count = [0] * width
        for cm in commits:
            count[cols(cm.time, cm.time)[0]] += 1
        for c, n in enumerate(count):
            if n:
                put(server, c, str(n) if n < 10 else "+", 9)

    label_w = max(len(_label(h, v)) for h in hosts)
    lines = [v.title, "time %.6g .. %.6g s, %.4g s per column" % (t0, t1, dt)]
    for h in hosts:
        lines.append("%-*s |%s|" % (label_w, _label(h, v), "".join(m for m, _ in cells[h])))
    used = sorted({k for _, k in v.transfers}, key=list(KINDS).index)
    legend = ["%s %s" % (KINDS[k][0], KINDS[k][3]) for k in used] + ["%s receiving" % RECEIVING]
    if any(v.commits.values()):
        legend.append("digit: commits in that column")
    lines.append("legend: " + ", ".join(legend))
    for host, commits in v.commits.items():
        who = "S%d" % host if host in v.servers else "replica h%d" % host
        for i, cm in enumerate(commits, 1):
            lines.append("commit %d at %s: t=%.6g s, %s via h%d"
                         % (i, who, cm.time, " ".join("u%d" % u for u in cm.ids), cm.via))
    lines.extend(v.notes)
    return "\n".join(lines)


# --- PNG ---------------------------------------------------------------------------------------

def _matplotlib():
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
        from matplotlib.lines import Line2D
        from matplotlib.backends.backend_agg import FigureCanvasAgg
    except ImportError as e:
        raise ImportError("mlfabric.sched.render.timeline draws with matplotlib, which is not "
                          "installed (pip install matplotlib); timeline_text needs nothing") from e
    return Figure, Patch, Line2D, FigureCanvasAgg


def _ingress_use(v, server):
    """The schedule's own rate into `server` over time: [(t, bytes/s)] steps."""
    events = {}
    for t, _ in v.transfers:
        if t.dst == server:
            for s in t.segments:
                events[s.t0] = events.get(s.t0, 0.0) + s.rate
                events[s.t1] = events.get(s.t1, 0.0) - s.rate
    steps, rate = [], 0.0
    for time in sorted(events):
        rate += events[time]
        steps.append((time, max(rate, 0.0)))
    return steps


def _lanes(transfers):
    """Greedy interval partitioning per sender: lane index of each transfer, lanes per host."""
    lane, free, lanes = [0] * len(transfers), {}, {}
    for i in sorted(range(len(transfers)), key=lambda i: transfers[i][0].start):
        t = transfers[i][0]
        ends = free.setdefault(t.src, [])
        for k, end in enumerate(ends):
            if end <= t.start:
                ends[k] = t.end
                lane[i] = k
                break
        else:
            ends.append(t.end)
            lane[i] = len(ends) - 1
        lanes[t.src] = len(ends)
    return lane, lanes


def timeline(schedule, path, network=None, *, max_notes=12):
    """Write a PNG Gantt chart of a Plan (or ShardedPlan, Distribution) to `path`; return `path`.
    With `network`, a second panel shows each server's ingress residual capacity over time (pass
    the network schedule() returned to see what the plan left, or the one it was given to see
    what it started from) next to the schedule's own rate into the server."""
    Figure, Patch, Line2D, FigureCanvasAgg = _matplotlib()
    v = _view(schedule)
    hosts = _hosts(v)
    t0, t1 = _span(v)
    row = {h: i for i, h in enumerate(hosts)}
    height = 1.6 + 0.4 * len(hosts) + (2.2 if network is not None else 0.0)
    fig = Figure(figsize=(11, height))
    FigureCanvasAgg(fig)
    if network is not None:
        gs = fig.add_gridspec(2, 1, height_ratios=[max(1.0, 0.4 * len(hosts)), 2.0], hspace=0.35)
        ax = fig.add_subplot(gs[0])
        cap = fig.add_subplot(gs[1], sharex=ax)
    else:
        ax = fig.add_subplot(1, 1, 1)
        cap = None

    used = set()
    lane, lanes = _lanes(v.transfers)
    for i, (t, kind) in enumerate(v.transfers):
        colour = KINDS[kind][2]
        spans = [(s.t0, s.t1 - s.t0) for s in t.segments if s.t1 > s.t0]
        if not spans:
            continue
        used.add(kind)
        # a sender's concurrent transfers share its row in lanes, so none hides another
        h = 0.5 / lanes[t.src]
        ax.broken_barh(spans, (row[t.src] - 0.3 + lane[i] * h, h), facecolors=colour,
                       edgecolor="black", linewidth=0.3)
        ax.broken_barh(spans, (row[t.dst] + 0.22, 0.13), facecolors=colour, alpha=0.45)
    n_commits = 0
    for server, commits in v.commits.items():
        if commits:
            n_commits += len(commits)
            ax.plot([c.time for c in commits], [row[server]] * len(commits), linestyle="none",
                    marker="|", markersize=16, markeredgewidth=1.5, color="black")
    ax.set_yticks(range(len(hosts)))
    ax.set_yticklabels([_label(h, v) for h in hosts])
    ax.set_ylim(len(hosts) - 0.5, -0.5)
    ax.set_xlim(t0, t1 + 0.01 * (t1 - t0))   # room for a commit tick at the very end
    ax.set_xlabel("time (s)")
    ax.grid(axis="x", alpha=0.3)
    handles = [Patch(facecolor=KINDS[k][2], label=KINDS[k][3])
               for k in sorted(used, key=list(KINDS).index)]
    if n_commits:
        handles.append(Line2D([], [], color="black", marker="|", linestyle="none", markersize=12,
                              label="commit"))
    if handles:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
                  frameon=False)
    title = v.title
    if v.notes:
        shown = v.notes[:max_notes]
        more = len(v.notes) - len(shown)
        note = "\n".join(shown + (["... and %d more" % more] if more else []))
        ax.text(1.01, 0.0, note, transform=ax.transAxes, fontsize=7, va="bottom", ha="left",
                family="monospace")
    ax.set_title(title, fontsize=10)

    if cap is not None:
        for i, server in enumerate(v.servers):
            colour = "C%d" % (i % 10)
            use = _ingress_use(v, server)
            if use:
                ut = [t0] + [t for t, _ in use] + [t1]
                ur = [0.0] + [r / GBPS for _, r in use] + [0.0]
                cap.fill_between(ut, ur, step="post", alpha=0.3, color=colour, linewidth=0,
                                 label="S%d ingress used by this schedule" % server)
            prof = network.links[network.ingress(server)]
            ts = [t0] + [t for t in prof.t if t0 < t < t1] + [t1]
            cap.step(ts, [prof.at(t) / GBPS for t in ts], where="post", color=colour,
                     linewidth=2, label="S%d ingress residual capacity" % server)
        cap.set_ylabel("Gbit/s")
        cap.set_xlabel("time (s)")
        cap.set_ylim(bottom=0)
        cap.grid(alpha=0.3)
        cap.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return path
