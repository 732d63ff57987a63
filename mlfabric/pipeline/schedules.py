"""Pipeline-parallel schedules as plain data: which forward (F), backward (B) and optimizer step (S)
each rank runs, in which order, and which weight version each pass uses. The generators write the
schedules of the PipeDream thesis (Narayanan, 2021): GPipe, PipeDream's asynchronous 1F1B and
1F1B-RR (§2.4.2, weight stashing and vertical sync §2.4.3), PipeDream-2BW (§3.2.1),
PipeDream-Flush (§3.2.2) and Megatron's interleaved 1F1B (§4.2.2). Nothing here runs a model:
mlfabric.pipeline.validate checks and times a schedule, mlfabric.pipeline.timeline draws it.

Conventions (everything 0-indexed):
- Stages s = 0..p-1, microbatches k = 0..m*batches-1 (the thesis counts inputs from 1: its input k
  is our microbatch k-1; its "F1 F2 F3 F4 B1 F5" at stage 0 of a 4-stage pipeline is our
  "F0 F1 F2 F3 B0 F4"), batch of microbatch k = k // m, chunks c = 0..v-1, ranks 0..R-1.
- With v chunks per rank (interleaved), the model is cut into p*v pieces; piece c*p + s (the
  "virtual stage") is chunk c of the rank at stage s, so rank s holds pieces s, s+p, s+2p, ...
- Replicated stages (1F1B-RR): stage s has replicas[s] ranks, numbered stage by stage; input k runs
  forward and backward on replica k mod replicas[s].
- "S" is an optimizer step of every piece the rank holds. When it comes, by weight-version policy:
    "flush" (GPipe, PipeDream-Flush, interleaved): once per batch, after the batch's last
        backward on that rank: the flush. One weight version; batch j uses version j.
    "2bw": once per batch, after the batch's last backward on that rank; it makes a new version
        that microbatches admitted later use: microbatch k uses version max(k//m - 1, 0).
    "stash" (PipeDream): after every backward (batch size = one microbatch); a forward uses the
        latest version, and its backward uses the one the forward stashed.
    "vertical" (PipeDream with vertical sync): same order as "stash"; microbatch k uses, at every
        stage, the version current at the input stage when k entered the pipeline.
  Version n is the weights after n steps of that piece on that rank (each replica counts its own
  steps); version 0 is the initial weights.

Text form: one action is "F3", "B3" or "S"; with v > 1 the chunk is always written: "F3.1".
A rank's list is such tokens separated by spaces (parse_actions / format_actions); a whole
schedule is a header line plus one line per rank (Schedule.to_text / Schedule.from_text).
"""
import math
import re
from dataclasses import dataclass

KINDS = ("F", "B", "S")
POLICIES = ("flush", "2bw", "stash", "vertical")


@dataclass(frozen=True)
class Action:
    """One entry of a rank's list: forward or backward of `microbatch` through chunk `chunk` of
    stage `stage`, or an optimizer step ("S", microbatch None) of the rank's stage."""
    kind: str
    stage: int
    microbatch: int = None
    chunk: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError("Action kind must be one of %s, got %r" % (", ".join(KINDS),
                                                                       self.kind))
        if not _is_int(self.stage) or self.stage < 0:
            raise ValueError("Action stage must be an int >= 0, got %r" % (self.stage,))
        if not _is_int(self.chunk) or self.chunk < 0:
            raise ValueError("Action chunk must be an int >= 0, got %r" % (self.chunk,))
        if self.kind == "S":
            if self.microbatch is not None:
                raise ValueError("an S (optimizer step) has no microbatch, got %r"
                                 % (self.microbatch,))
        elif not _is_int(self.microbatch) or self.microbatch < 0:
            raise ValueError("%s needs a microbatch, an int >= 0, got %r"
                             % (self.kind, self.microbatch))

    def label(self, chunks=False):
        """The text form: "F3", "B3", "S"; "F3.1" with `chunks` (schedules with v > 1)."""
        if self.kind == "S":
            return "S"
        if chunks:
            return "%s%d.%d" % (self.kind, self.microbatch, self.chunk)
        return "%s%d" % (self.kind, self.microbatch)

    def __str__(self):
        return self.label(self.chunk != 0)


@dataclass(frozen=True)
class Placement:
    """What a rank holds: chunks 0..v-1 of stage `stage`, as replica `replica` of that stage."""
    stage: int
    replica: int = 0

    def describe(self, replicated):
        if replicated:
            return "stage %d, replica %d" % (self.stage, self.replica)
        return "stage %d" % self.stage


_TOKEN = re.compile(r"^([FB])(\d+)(?:\.(\d+))?$")


def parse_actions(text, stage=0):
    """The actions of one rank from their text form ("F0 F1 B0 F2.1 S"); the stage is not written
    in the text, so it is given (the rank's stage). Raises ValueError on a bad token."""
    if not isinstance(text, str):
        raise ValueError("parse_actions takes a string, got %r" % (type(text).__name__,))
    out = []
    for tok in text.split():
        if tok == "S":
            out.append(Action("S", stage))
            continue
        hit = _TOKEN.match(tok)
        if hit is None:
            raise ValueError("bad action %r: expected F<microbatch>, B<microbatch>, "
                             "F<microbatch>.<chunk>, B<microbatch>.<chunk> or S" % tok)
        out.append(Action(hit.group(1), stage, int(hit.group(2)), int(hit.group(3) or 0)))
    return out


def format_actions(actions, chunks=False):
    """The text form of a list of actions (chunks written when `chunks`, i.e. v > 1)."""
    return " ".join(a.label(chunks) for a in actions)


@dataclass
class Schedule:
    """A pipeline schedule: p stages, m microbatches per batch, `batches` batches, v chunks per
    rank, replicas[s] ranks for stage s, each rank's ordered action list (`actions`: rank ->
    tuple of Action; a string is parsed with the rank's stage), `placement` (rank -> Placement;
    by default ranks are laid out stage by stage, replica by replica) and the weight-version
    `policy` (see the module docstring)."""
    name: str
    p: int
    m: int
    actions: dict
    v: int = 1
    batches: int = 1
    replicas: tuple = None
    policy: str = "flush"
    placement: dict = None

    def __post_init__(self):
        for arg, low in (("p", 1), ("m", 1), ("v", 1), ("batches", 1)):
            _check_int(arg, getattr(self, arg), low)
        if self.policy not in POLICIES:
            raise ValueError("policy must be one of %s, got %r" % (", ".join(POLICIES),
                                                                  self.policy))
        self.replicas = _check_replicas(self.replicas, self.p)
        if self.placement is None:
            self.placement = default_placement(self.replicas)
        else:
            self.placement = dict(self.placement)
            expected = default_placement(self.replicas)
            if sorted(self.placement) != sorted(expected) or sorted(
                    self.placement.values(), key=_key) != sorted(expected.values(), key=_key):
                raise ValueError("placement must put replicas[s] ranks on each stage s, ranks "
                                 "numbered 0..%d, got %r" % (len(expected) - 1, self.placement))
        if not isinstance(self.actions, dict) or sorted(self.actions) != sorted(self.placement):
            raise ValueError("actions must map every rank 0..%d to its list, got ranks %r"
                             % (len(self.placement) - 1, sorted(self.actions)
                                if isinstance(self.actions, dict) else self.actions))
        acts = {}
        for r in sorted(self.actions):
            lst = self.actions[r]
            if isinstance(lst, str):
                lst = parse_actions(lst, self.placement[r].stage)
            lst = tuple(lst)
            if not all(isinstance(a, Action) for a in lst):
                raise ValueError("rank %d: actions must be Action objects or a string" % r)
            acts[r] = lst
        self.actions = acts

    # --- facts -----------------------------------------------------------------------------------
    @property
    def ranks(self):
        return len(self.placement)

    @property
    def microbatches(self):
        """Microbatches in the whole schedule: m * batches."""
        return self.m * self.batches

    @property
    def pieces(self):
        """Model pieces (virtual stages): p * v."""
        return self.p * self.v

    def vstage(self, action):
        """The model piece an action runs: chunk * p + stage."""
        return action.chunk * self.p + action.stage

    def batch_of(self, k):
        return k // self.m

    def pieces_of(self, rank):
        """The model pieces a rank holds, chunk by chunk: stage, stage + p, ..."""
        stage = self.placement[rank].stage
        return tuple(c * self.p + stage for c in range(self.v))

    def stage_ranks(self, s):
        """The ranks holding stage s, by replica."""
        return sorted((r for r, pl in self.placement.items() if pl.stage == s),
                      key=lambda r: self.placement[r].replica)

    def rank_of(self, s, k):
        """The rank that runs microbatch k at stage s under 1F1B-RR routing (k mod replicas)."""
        return self.stage_ranks(s)[k % self.replicas[s]]

    def _replicated(self):
        return any(r > 1 for r in self.replicas)

    # --- text ------------------------------------------------------------------------------------
    def header(self):
        return "schedule %s p=%d m=%d v=%d batches=%d replicas=%s policy=%s" % (
            self.name, self.p, self.m, self.v, self.batches,
            ",".join(str(r) for r in self.replicas), self.policy)

    def rank_label(self, r):
        return "rank %d (%s)" % (r, self.placement[r].describe(self._replicated()))

    def to_text(self):
        """Header line, then "rank R (stage S[, replica J]): F0 F1 B0 ..." per rank. Round-trips
        through Schedule.from_text."""
        lines = [self.header()]
        for r in range(self.ranks):
            lines.append("%s: %s" % (self.rank_label(r),
                                     format_actions(self.actions[r], self.v > 1)))
        return "\n".join(lines)

    @classmethod
    def from_text(cls, text):
        """Parse Schedule.to_text()'s form. Header fields other than p and m may be left out
        (v=1, batches=1, unreplicated, policy=flush); rank lines need only "rank R: ..."; the
        stage comes from the placement."""
        lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
        if not lines or not lines[0].startswith("schedule "):
            raise ValueError("a schedule's text starts with 'schedule NAME p=.. m=..'")
        head = lines[0].split()
        if len(head) < 2:
            raise ValueError("schedule header needs a name: %r" % lines[0])
        kw = {}
        for item in head[2:]:
            key, eq, val = item.partition("=")
            if not eq or key not in ("p", "m", "v", "batches", "replicas", "policy"):
                raise ValueError("bad schedule header field %r (fields: p, m, v, batches, "
                                 "replicas, policy)" % item)
            if key == "replicas":
                kw[key] = tuple(_parse_int(key, x) for x in val.split(","))
            elif key == "policy":
                kw[key] = val
            else:
                kw[key] = _parse_int(key, val)
        if "p" not in kw or "m" not in kw:
            raise ValueError("schedule header must give p= and m=: %r" % lines[0])
        placement = default_placement(_check_replicas(kw.get("replicas"), kw["p"]))
        actions = {}
        for ln in lines[1:]:
            hit = re.match(r"^rank\s+(\d+)(?:\s*\([^)]*\))?\s*:(.*)$", ln)
            if hit is None:
                raise ValueError("bad rank line %r: expected 'rank R (...): actions'" % ln)
            r = int(hit.group(1))
            if r not in placement:
                raise ValueError("rank %d is not in the placement (ranks 0..%d)"
                                 % (r, len(placement) - 1))
            if r in actions:
                raise ValueError("rank %d listed twice" % r)
            actions[r] = parse_actions(hit.group(2), placement[r].stage)
        return cls(head[1], actions=actions, **kw)

    def __str__(self):
        """A grid: one row per rank, one column per position in the rank's list."""
        labels = {r: [a.label(self.v > 1) for a in self.actions[r]] for r in range(self.ranks)}
        width = max([len(x) for lst in labels.values() for x in lst] + [1])
        names = {r: self.rank_label(r) for r in range(self.ranks)}
        lw = max(len(n) for n in names.values())
        lines = [self.header()]
        for r in range(self.ranks):
            lines.append("%-*s | %s" % (lw, names[r], " ".join(x.ljust(width)
                                                                 for x in labels[r]).rstrip()))
        return "\n".join(lines)


def default_placement(replicas):
    """Ranks stage by stage: stage 0's replicas first, then stage 1's, ..."""
    out, r = {}, 0
    for s, n in enumerate(replicas):
        for j in range(n):
            out[r] = Placement(s, j)
            r += 1
    return out


# --- generators -----------------------------------------------------------------------------------

def gpipe(p, m, batches=1):
    """GPipe: per batch, every stage runs all m forwards, then all m backwards (in microbatch
    order), then the optimizer step (flush). Stashes up to m activations per stage."""
    _check_int("p", p, 1)
    _check_int("m", m, 1)
    _check_int("batches", batches, 1)
    acts = {}
    for s in range(p):
        lst = []
        for b in range(batches):
            ks = range(b * m, (b + 1) * m)
            lst += [Action("F", s, k) for k in ks] + [Action("B", s, k) for k in ks]
            lst.append(Action("S", s))
        acts[s] = lst
    return Schedule("gpipe", p, m, acts, batches=batches, policy="flush")


def flush(p, m, batches=1):
    """PipeDream-Flush (§3.2.2): per batch, stage s runs w = min(p-s-1, m) warm-up forwards,
    then m-w pairs [F, B] (newest forward, oldest backward), then w cool-down backwards and the
    optimizer step. At most p-s activations stashed at stage s, one weight version."""
    _check_int("p", p, 1)
    _check_int("m", m, 1)
    _check_int("batches", batches, 1)
    acts = {}
    for s in range(p):
        lst = []
        for b in range(batches):
            lst += _one_f_one_b(s, list(range(b * m, (b + 1) * m)), min(p - s - 1, m), None)
            lst.append(Action("S", s))
        acts[s] = lst
    return Schedule("flush", p, m, acts, batches=batches, policy="flush")


def one_f_one_b(p, m_total, replicas=None, vertical_sync=False):
    """PipeDream's asynchronous 1F1B (§2.4.2) over m_total inputs, with a step after every
    backward (weight stashing; with `vertical_sync` the "vertical" policy). `replicas` (r_s per
    stage) gives 1F1B-RR: input k runs forward and backward on replica k mod r_s of stage s.

    Each replica of stage s first admits w_s = ceil((r_s + ... + r_{p-1}) / r_s) of its inputs,
    the replicas of stages s..p-1 over its own count, so that the pipeline downstream is full; for
    the input stage that is NOAM = ceil(#workers / r_0) (§2.4.2), for a straight pipeline p-s.
    Then it alternates one forward (newest input) and one backward (oldest)."""
    _check_int("p", p, 1)
    _check_int("m_total", m_total, 1)
    reps = _check_replicas(replicas, p)
    if not isinstance(vertical_sync, bool):
        raise ValueError("vertical_sync must be True or False, got %r" % (vertical_sync,))
    if vertical_sync and any(r > 1 for r in reps):
        # versions count each replica's own steps, so a tag from one input-stage replica means
        # nothing at another stage's replicas; the thesis states vertical sync for straight
        # pipelines (§2.4.3)
        raise ValueError("vertical_sync is defined for a straight pipeline: replicas must all "
                         "be 1, got %r" % (reps,))
    placement = default_placement(reps)
    acts = {}
    for r, pl in placement.items():
        s = pl.stage
        mine = [k for k in range(m_total) if k % reps[s] == pl.replica]
        warm = math.ceil(sum(reps[s:]) / reps[s])
        # _one_f_one_b counts the warm-up without the first pair's forward
        acts[r] = _one_f_one_b(s, mine, min(warm - 1, len(mine)), Action("S", s))
    return Schedule("1f1b", p, m_total, acts, replicas=reps,
                    policy="vertical" if vertical_sync else "stash")


def noam(replicas):
    """NUM_OPT_ACTIVE_MINIBATCHES (§2.4.2): inputs admitted per input-stage replica."""
    if not isinstance(replicas, (list, tuple)) or not replicas:
        raise ValueError("replicas must list one int >= 1 per stage, got %r" % (replicas,))
    reps = _check_replicas(replicas, len(replicas))
    return math.ceil(sum(reps) / reps[0])


def two_bw(p, m, batches):
    """PipeDream-2BW (§3.2.1): PipeDream's 1F1B order over m*batches microbatches without
    flushes, gradients accumulated over m >= p microbatches; after the last backward of each
    batch a stage steps, making the version that microbatches two batches later use."""
    _check_int("p", p, 1)
    _check_int("m", m, 1)
    _check_int("batches", batches, 1)
    if m < p:
        raise ValueError("two_bw needs m >= p (a new weight version every m microbatches must "
                         "not be needed before it exists), got m=%d < p=%d" % (m, p))
    acts = {}
    for s in range(p):
        ks = list(range(m * batches))
        lst = []
        for a in _one_f_one_b(s, ks, min(p - s - 1, len(ks)), None):
            lst.append(a)
            if a.kind == "B" and (a.microbatch + 1) % m == 0:
                lst.append(Action("S", s))
        acts[s] = lst
    return Schedule("2bw", p, m, acts, batches=batches, policy="2bw")


def interleaved(p, m, v, batches=1):
    """Megatron's interleaved 1F1B (§4.2.2) with v chunks per rank, flushed per batch. Rank s
    holds chunks 0..v-1 (pieces s, s+p, ...). Its virtual microbatch i = 0..m*v-1 runs forward
    on chunk c = (i mod pv) // p and backward on chunk v-1-c, for microbatch (i // pv)*p + i mod
    p; the rank runs min(2(p-s-1) + (v-1)p, m*v) warm-up forwards, then [F, B] pairs, then the
    remaining backwards and the step. With v = 1 this is PipeDream-Flush's order."""
    _check_int("p", p, 1)
    _check_int("m", m, 1)
    _check_int("v", v, 1)
    _check_int("batches", batches, 1)
    if m % p:
        raise ValueError("interleaved needs m to be a multiple of p (microbatches go through the "
                         "chunks in groups of p), got m=%d, p=%d" % (m, p))
    if v == 1:
        sched = flush(p, m, batches)
        sched.name = "interleaved"
        return sched
    acts = {}
    total = m * v
    for s in range(p):
        warm = min(2 * (p - s - 1) + (v - 1) * p, total)
        lst = []
        for b in range(batches):
            def virtual(i, forward):
                c = (i % (p * v)) // p
                k = b * m + (i // (p * v)) * p + i % p
                return Action("F" if forward else "B", s, k, c if forward else v - 1 - c)
            lst += [virtual(i, True) for i in range(warm)]
            for i in range(total - warm):
                lst += [virtual(warm + i, True), virtual(i, False)]
            lst += [virtual(i, False) for i in range(total - warm, total)]
            lst.append(Action("S", s))
        acts[s] = lst
    return Schedule("interleaved", p, m, acts, v=v, batches=batches, policy="flush")


GENERATORS = {
    "gpipe": gpipe,
    "flush": flush,
    "pipedream-flush": flush,
    "1f1b": one_f_one_b,
    "pipedream": one_f_one_b,
    "2bw": two_bw,
    "pipedream-2bw": two_bw,
    "interleaved": interleaved,
}


def by_name(name, **kw):
    """A schedule by name: gpipe, flush (pipedream-flush), 1f1b (pipedream), 2bw
    (pipedream-2bw), interleaved; keyword arguments go to the generator."""
    gen = GENERATORS.get(name.lower() if isinstance(name, str) else name)
    if gen is None:
        raise ValueError("unknown schedule %r; known: %s" % (name, ", ".join(GENERATORS)))
    return gen(**kw)


# --- helpers -----------------------------------------------------------------------------------

def _one_f_one_b(s, ks, warm, step):
    """`warm` forwards, then [F newest, B oldest] pairs, then the remaining backwards, over
    microbatches `ks` in order at stage s; `step` (an S action or None) after every backward."""
    out = [Action("F", s, k) for k in ks[:warm]]
    tail = [] if step is None else [step]
    for i in range(len(ks) - warm):
        out += [Action("F", s, ks[warm + i]), Action("B", s, ks[i])] + tail
    for i in range(len(ks) - warm, len(ks)):
        out += [Action("B", s, ks[i])] + tail
    return out


def _is_int(x):
    return isinstance(x, int) and not isinstance(x, bool)


def _check_int(name, x, low):
    if not _is_int(x) or x < low:
        raise ValueError("%s must be an int >= %d, got %r" % (name, low, x))


def _parse_int(name, text):
    try:
        return int(text)
    except ValueError:
        raise ValueError("%s must be an integer, got %r" % (name, text)) from None


def _check_replicas(replicas, p):
    if replicas is None:
        return (1,) * p
    reps = tuple(replicas) if isinstance(replicas, (list, tuple)) else None
    if reps is None or len(reps) != p or not all(_is_int(r) and r >= 1 for r in reps):
        raise ValueError("replicas must list one int >= 1 per stage (%d stages), got %r"
                         % (p, replicas))
    return reps


def _key(pl):
    return (pl.stage, pl.replica)
