"""Checking and timing a pipeline schedule (mlfabric.pipeline.schedules): validate() runs every
rank's list as an event simulation and raises ScheduleError on a schedule that cannot run or breaks
its weight-version policy; weight_versions() says which version each pass uses; simulate() times
the schedule with synthetic forward / backward costs and returns a Timeline.

Dependencies between passes, for model piece q (virtual stage: chunk * p + stage) and microbatch
k: F(q, k) needs F(q-1, k) done (on whichever rank ran it: activations are sent); B(q, k) needs
F(q, k) done on the same rank (its stashed activations) and B(q+1, k) done (the gradient is sent
back). S depends on nothing across ranks: data-parallel replicas all-reduce at S in a real
executor, which these timings leave out.

Policy rules checked (the S placement documented in schedules.py):
  flush     on each rank, every F and B of batch j comes after exactly j steps; `batches` steps.
  2bw       every B of batch j after exactly j steps, `batches` steps; every F after as many steps
            as the version it uses (max(j - 1, 0)) or one more: the version exists and is one of
            the two kept.
  stash     a step right after every backward and nowhere else.
  vertical  as stash, and every F after at least as many steps as its input's tag.

Memory counts, per rank in program order (timing does not change them):
  stashed activations: forwards whose backward has not run yet (chunk-forwards when v > 1);
  live weight versions, per piece: the latest version plus every older version a microbatch whose
  backward is still to come on that rank uses.
"""
from dataclasses import dataclass, field
from numbers import Real

from ..errors import MlfabricError
from .schedules import Schedule

_GRID_ROWS = 30  # steps of the grid shown in a deadlock report (the last ones)


class ScheduleError(MlfabricError, ValueError):
    """A schedule that cannot run (deadlock, a missing or duplicated pass, a backward on another
    replica than its forward) or that breaks its weight-version policy. `problems` lists what is
    wrong; on deadlock `stuck` maps each stuck rank to the action it waits at and `step` is the
    lockstep round where no rank could move."""

    def __init__(self, message, problems=(), stuck=None, step=None):
        super().__init__(message)
        self.problems = list(problems)
        self.stuck = dict(stuck or {})
        self.step = step


@dataclass
class Stats:
    """What validate() learned. `steps`: lockstep rounds to run the schedule (every action one
    round: the makespan with unit costs, S included); `versions`: weight_versions(); peaks per
    stage (the max over its replicas) and per rank."""
    steps: int
    actions: int
    versions: dict
    peak_stash: dict
    peak_versions: dict
    rank_peak_stash: dict
    rank_peak_versions: dict
    order: list = field(default=None, repr=False)  # execution order [(rank, position)]


def validate(schedule):
    """Check `schedule`; return Stats, or raise ScheduleError saying what is wrong (on deadlock:
    which ranks are stuck on which action, waiting for what, with the step x rank grid)."""
    if not isinstance(schedule, Schedule):
        raise ValueError("validate takes a Schedule, got %r" % (type(schedule).__name__,))
    owner = _check_structure(schedule)
    order, rows = _run(schedule, owner)
    versions = _versions(schedule, owner)
    _check_policy(schedule, versions)
    stash, live = _memory(schedule, versions)
    per_stage = {}
    for s in range(schedule.p):
        rs = schedule.stage_ranks(s)
        per_stage[s] = (max(stash[r] for r in rs), max(live[r] for r in rs))
    stats = Stats(steps=len(rows), actions=sum(len(a) for a in schedule.actions.values()),
                  versions=versions,
                  peak_stash={s: v[0] for s, v in per_stage.items()},
                  peak_versions={s: v[1] for s, v in per_stage.items()},
                  rank_peak_stash=stash, rank_peak_versions=live, order=order)
    return stats


def weight_versions(schedule):
    """{(piece, microbatch): (version used by F, version used by B)}; piece = chunk*p + stage
    (the stage when v = 1). Rules (schedules.py): flush: the batch index; 2bw: max(k//m - 1, 0);
    stash: the steps the rank ran before the forward, kept for the backward; vertical: the steps
    the input stage's rank ran before the input's first forward, at every stage."""
    if not isinstance(schedule, Schedule):
        raise ValueError("weight_versions takes a Schedule, got %r"
                         % (type(schedule).__name__,))
    return _versions(schedule, _check_structure(schedule))


# --- structure ------------------------------------------------------------------------------------

def lockstep(schedule):
    """The lockstep run of a valid schedule: (rounds, step_of), rounds[t] = {rank: action} run in
    step t, step_of[(rank, position)] = t. ScheduleError if it is not valid."""
    order, rounds = _run(schedule, _check_structure(schedule))
    step_of, j = {}, 0
    for t, row in enumerate(rounds):
        for _ in row:
            step_of[order[j]] = t
            j += 1
    return rounds, step_of


def grid(schedule, rounds, stuck):
    """The step x rank grid of `rounds` (from lockstep(), or a prefix of them) with the next step
    marked '>>': each rank in `stuck` ({rank: action}) shows that action followed by '!'."""
    return _grid(schedule, rounds, stuck)


def _check_structure(sched):
    """Every pass belongs to its rank's stage and exists exactly once, each B on its F's rank;
    return owner: (kind, piece, k) -> (rank, position)."""
    problems, owner = [], {}
    n_mb, v = sched.microbatches, sched.v
    for r in range(sched.ranks):
        stage = sched.placement[r].stage
        for i, a in enumerate(sched.actions[r]):
            where = "rank %d position %d (%s)" % (r, i, a.label(v > 1))
            if a.stage != stage:
                problems.append("%s: stage %d, but rank %d holds stage %d"
                                % (where, a.stage, r, stage))
            if a.chunk >= v:
                problems.append("%s: chunk %d, but v=%d" % (where, a.chunk, v))
            if a.kind == "S":
                continue
            if a.microbatch >= n_mb:
                problems.append("%s: microbatch %d, but there are %d (m=%d x batches=%d)"
                                % (where, a.microbatch, n_mb, sched.m, sched.batches))
            key = (a.kind, sched.vstage(a), a.microbatch)
            if key in owner:
                problems.append("%s: %s of piece %d runs twice (also rank %d position %d)"
                                % (where, a.kind, key[1], *owner[key]))
            else:
                owner[key] = (r, i)
    for q in range(sched.pieces):
        for k in range(n_mb):
            f, b = owner.get(("F", q, k)), owner.get(("B", q, k))
            if f is None:
                problems.append("microbatch %d never runs forward through %s"
                                % (k, _piece(sched, q)))
            if b is None:
                problems.append("microbatch %d never runs backward through %s"
                                % (k, _piece(sched, q)))
            if f is not None and b is not None and f[0] != b[0]:
                problems.append("microbatch %d at %s: forward on rank %d, backward on rank %d "
                                "(the backward needs the forward's stashed activations)"
                                % (k, _piece(sched, q), f[0], b[0]))
    if problems:
        raise ScheduleError(_report(sched, "schedule %s is malformed" % sched.name, problems),
                            problems)
    return owner


def _piece(sched, q):
    s, c = q % sched.p, q // sched.p
    return "stage %d chunk %d" % (s, c) if sched.v > 1 else "stage %d" % s


# --- event simulation -----------------------------------------------------------------------------

def _needs(sched, a, done_f, done_b):
    """The pass `a` waits for, as (kind, piece, k), or None when it can run."""
    if a.kind == "S":
        return None
    q, k = sched.vstage(a), a.microbatch
    if a.kind == "F":
        return ("F", q - 1, k) if q > 0 and (q - 1, k) not in done_f else None
    if (q, k) not in done_f:
        return ("F", q, k)
    if q < sched.pieces - 1 and (q + 1, k) not in done_b:
        return ("B", q + 1, k)
    return None


def _run(sched, owner):
    """Lockstep rounds: in each, every rank whose next action's inputs were done in an earlier
    round runs it. Returns the execution order [(rank, position)] and the rounds ({rank: action}).
    Raises ScheduleError when no rank can move."""
    acts = sched.actions
    ptr = {r: 0 for r in acts}
    done_f, done_b = set(), set()
    order, rows = [], []
    left = sum(len(a) for a in acts.values())
    while left:
        ready = {}
        for r in acts:
            if ptr[r] < len(acts[r]) and _needs(sched, acts[r][ptr[r]], done_f, done_b) is None:
                ready[r] = acts[r][ptr[r]]
        if not ready:
            _deadlock(sched, owner, ptr, rows, done_f, done_b)
        for r, a in ready.items():
            if a.kind != "S":
                (done_f if a.kind == "F" else done_b).add((sched.vstage(a), a.microbatch))
            order.append((r, ptr[r]))
            ptr[r] += 1
        left -= len(ready)
        rows.append(ready)
    return order, rows


def _deadlock(sched, owner, ptr, rows, done_f, done_b):
    acts, v = sched.actions, sched.v
    stuck, problems = {}, []
    for r in acts:
        if ptr[r] >= len(acts[r]):
            continue
        a = acts[r][ptr[r]]
        stuck[r] = a
        kind, q, k = _needs(sched, a, done_f, done_b)
        r2, i2 = owner[(kind, q, k)]
        what = "%s of microbatch %d at %s" % (kind, k, _piece(sched, q))
        if r2 == r:
            why = "which comes later in its own list (position %d)" % i2
        else:
            b = acts[r2][ptr[r2]]
            why = "which rank %d runs at position %d, but rank %d is stuck at position %d (%s)" % (
                r2, i2, r2, ptr[r2], b.label(v > 1))
        problems.append("rank %d (%s) stuck at position %d (%s): waits for %s, %s"
                        % (r, sched.placement[r].describe(sched._replicated()), ptr[r],
                           a.label(v > 1), what, why))
    step = len(rows)
    head = "schedule %s deadlocks at step %d: no rank can make progress; stuck ranks %s" % (
        sched.name, step, ", ".join(str(r) for r in sorted(stuck)))
    grid = _grid(sched, rows, stuck)
    raise ScheduleError(_report(sched, head, problems) + "\n" + grid, problems, stuck, step)


def _grid(sched, rows, stuck):
    """Step x rank grid of the lockstep run, the failing step marked '>>' with each stuck rank's
    waiting action followed by '!' ('-' for a rank that finished)."""
    chunks = sched.v > 1
    cells = [[row[r].label(chunks) if r in row else "." for r in range(sched.ranks)]
             for row in rows]
    fail = [stuck[r].label(chunks) + "!" if r in stuck else "-" for r in range(sched.ranks)]
    width = max([len(c) for row in cells + [fail] for c in row] + [len("r%d" % sched.ranks)])
    lines = ["step x rank (a cell is the action the rank ran in that step, '.' waiting):",
             ("      step  " + " ".join(("r%d" % r).ljust(width)
                                     for r in range(sched.ranks))).rstrip()]
    first = max(0, len(cells) - _GRID_ROWS)
    if first:
        lines.append("      ... %d earlier steps" % first)
    for i in range(first, len(cells)):
        lines.append("    %6d  %s" % (i, " ".join(c.ljust(width) for c in cells[i]).rstrip()))
    lines.append(">>  %6d  %s" % (len(cells), " ".join(c.ljust(width) for c in fail).rstrip()))
    return "\n".join(lines)


def _report(sched, head, problems, limit=20):
    shown = problems[:limit]
    more = ["... and %d more" % (len(problems) - limit)] if len(problems) > limit else []
    return "\n".join([head] + ["  " + x for x in shown + more])


# --- weight versions ------------------------------------------------------------------------------

def _steps_before(sched):
    """(rank, position) -> optimizer steps the rank ran before that position."""
    out = {}
    for r, lst in sched.actions.items():
        n = 0
        for i, a in enumerate(lst):
            out[(r, i)] = n
            n += a.kind == "S"
    return out


def _versions(sched, owner):
    before = _steps_before(sched)
    out = {}
    for q in range(sched.pieces):
        for k in range(sched.microbatches):
            if sched.policy == "flush":
                ver = (k // sched.m,) * 2
            elif sched.policy == "2bw":
                ver = (max(k // sched.m - 1, 0),) * 2
            elif sched.policy == "stash":
                ver = (before[owner[("F", q, k)]],) * 2
            else:  # vertical: the tag the input stage gave microbatch k
                ver = (before[owner[("F", 0, k)]],) * 2
            out[(q, k)] = ver
    return out


def _check_policy(sched, versions):
    problems = []
    chunks = sched.v > 1
    for r, lst in sched.actions.items():
        n_steps = sum(a.kind == "S" for a in lst)
        if sched.policy in ("flush", "2bw") and n_steps != sched.batches:
            problems.append("rank %d runs %d optimizer steps, policy %s needs one per batch (%d)"
                            % (r, n_steps, sched.policy, sched.batches))
        n = 0
        for i, a in enumerate(lst):
            where = "rank %d position %d (%s)" % (r, i, a.label(chunks))
            if a.kind == "S":
                if sched.policy in ("stash", "vertical") and (i == 0 or lst[i - 1].kind != "B"):
                    problems.append("%s: policy %s steps right after each backward only"
                                    % (where, sched.policy))
                n += 1
                continue
            batch = a.microbatch // sched.m
            ver = versions[(sched.vstage(a), a.microbatch)][0]
            if sched.policy == "flush" and n != batch:
                problems.append("%s: after %d steps, but batch %d must run between step %d and "
                                "step %d (flush)" % (where, n, batch, batch, batch + 1))
            elif sched.policy == "2bw" and a.kind == "B" and n != batch:
                problems.append("%s: after %d steps, but the gradient of batch %d accumulates "
                                "between step %d and step %d (2bw)"
                                % (where, n, batch, batch, batch + 1))
            elif sched.policy in ("2bw", "vertical") and a.kind == "F" and n < ver:
                problems.append("%s: uses weight version %d, but only %d steps ran before it"
                                % (where, ver, n))
            elif sched.policy == "2bw" and a.kind == "F" and n > ver + 1:
                problems.append("%s: uses weight version %d, but after %d steps only versions "
                                "%d and %d are kept (2bw double buffer)"
                                % (where, ver, n, n - 1, n))
            elif (sched.policy in ("stash", "vertical") and a.kind == "B"
                  and (i + 1 == len(lst) or lst[i + 1].kind != "S")):
                problems.append("%s: policy %s steps right after every backward"
                                % (where, sched.policy))
    if problems:
        raise ScheduleError(_report(sched, "schedule %s breaks its weight-version policy %r"
                                    % (sched.name, sched.policy), problems), problems)


def _memory(sched, versions):
    """Per rank: peak stashed activations and peak live weight versions (max over its pieces)."""
    stash, live = {}, {}
    for r, lst in sched.actions.items():
        pieces = {sched.vstage(a) for a in lst if a.kind != "S"}
        pending = {q: {} for q in pieces}   # piece -> {microbatch: version its B uses}
        for a in lst:
            if a.kind == "F":
                pending[sched.vstage(a)][a.microbatch] = versions[(sched.vstage(a),
                                                                   a.microbatch)][1]
        n = in_flight = peak_s = 0
        peak_v = 1 if pieces else 0
        for a in lst:
            if a.kind == "S":
                n += 1
            elif a.kind == "F":
                in_flight += 1
            else:
                in_flight -= 1
                pending[sched.vstage(a)].pop(a.microbatch)
            peak_s = max(peak_s, in_flight)
            for q in pieces:
                peak_v = max(peak_v, len({n} | {x for x in pending[q].values() if x <= n}))
        stash[r], live[r] = peak_s, peak_v
    return stash, live


# --- timing ---------------------------------------------------------------------------------------

@dataclass
class Timeline:
    """A timed run of a schedule: rows[rank] = [(action, start, end)] in the rank's order.
    t_f, t_b are per microbatch per stage (a chunk takes 1/v of it), S takes no time."""
    schedule: Schedule
    rows: dict
    makespan: float
    t_f: tuple
    t_b: tuple
    t_comm: float
    stats: Stats = field(repr=False)

    def busy(self, rank):
        return sum(e - s for _, s, e in self.rows[rank])

    @property
    def bubble_fraction(self):
        """The thesis's pipeline bubble size (§4.2.2, t_pb / t_id): time the ranks sit idle
        within the makespan over the time they compute. (p-1)/m for GPipe and Flush, (p-1)/(vm)
        interleaved."""
        busy = sum(self.busy(r) for r in self.rows)
        return (len(self.rows) * self.makespan - busy) / busy if busy else 0.0

    @property
    def idle_fraction(self):
        """Idle time over ranks x makespan: (p-1)/(m+p-1) for GPipe and Flush."""
        total = len(self.rows) * self.makespan
        return 1.0 - sum(self.busy(r) for r in self.rows) / total if total else 0.0

    def idle_between(self, t0, t1):
        """Idle fraction of all ranks over the window [t0, t1]."""
        if t1 <= t0:
            raise ValueError("window [%g, %g] is empty" % (t0, t1))
        busy = sum(max(0.0, min(e, t1) - max(s, t0)) for row in self.rows.values()
                   for _, s, e in row)
        return 1.0 - busy / (len(self.rows) * (t1 - t0))

    @property
    def steady_window(self):
        """From when every rank has run its first backward to when the first rank starts its
        last forward: the steady state between warm-up and cool-down (None if empty)."""
        rows = [row for row in self.rows.values() if any(a.kind == "B" for a, _, _ in row)]
        if not rows:  # a rank with no pass (a replica with no input) has no warm-up to wait for
            return None
        t0 = max(next(e for a, _, e in row if a.kind == "B") for row in rows)
        t1 = min(max(s for a, s, _ in row if a.kind == "F") for row in rows)
        return (t0, t1) if t1 > t0 else None

    @property
    def steady_idle(self):
        """Idle fraction in the steady window (None when there is none)."""
        w = self.steady_window
        return None if w is None else self.idle_between(*w)

    @property
    def peak_stash(self):
        return self.stats.peak_stash

    @property
    def peak_versions(self):
        return self.stats.peak_versions

    def __str__(self):
        from .timeline import gantt
        return gantt(self)


def simulate(schedule, t_f=1.0, t_b=2.0, t_comm=0.0):
    """Time `schedule` (validated first): each pass starts when its rank is free and its inputs
    are done, plus t_comm when an input comes from another rank. t_f and t_b are per microbatch
    per stage: a number, or one per stage (a chunk takes t/v); S takes no time."""
    stats = validate(schedule)
    p, v = schedule.p, schedule.v
    tf, tb = _per_stage("t_f", t_f, p), _per_stage("t_b", t_b, p)
    if not isinstance(t_comm, Real) or isinstance(t_comm, bool) or not t_comm >= 0:
        raise ValueError("t_comm must be a number >= 0, got %r" % (t_comm,))
    end_f, end_b, free = {}, {}, {r: 0.0 for r in schedule.actions}
    rows = {r: [] for r in schedule.actions}
    last = schedule.pieces - 1
    for r, i in stats.order:
        a = schedule.actions[r][i]
        start = free[r]
        if a.kind == "S":
            end = start
        else:
            q, k = schedule.vstage(a), a.microbatch
            if a.kind == "F":
                if q > 0:
                    r2, t = end_f[(q - 1, k)]
                    start = max(start, t + (t_comm if r2 != r else 0.0))
                end = start + tf[a.stage] / v
                end_f[(q, k)] = (r, end)
            else:
                start = max(start, end_f[(q, k)][1])
                if q < last:
                    r2, t = end_b[(q + 1, k)]
                    start = max(start, t + (t_comm if r2 != r else 0.0))
                end = start + tb[a.stage] / v
                end_b[(q, k)] = (r, end)
        free[r] = end
        rows[r].append((a, start, end))
    makespan = max(free.values())
    return Timeline(schedule, rows, makespan, tf, tb, float(t_comm), stats)


def _per_stage(name, t, p):
    ts = tuple(t) if isinstance(t, (list, tuple)) else (t,) * p
    if len(ts) != p or not all(isinstance(x, Real) and not isinstance(x, bool) and x > 0
                               for x in ts):
        raise ValueError("%s must be a number > 0 or one per stage (%d), got %r" % (name, p, t))
    return tuple(float(x) for x in ts)
