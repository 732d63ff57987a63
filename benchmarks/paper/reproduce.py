"""Runs the paper-reproduction benchmarks (or some of them) and writes REPRODUCTION.md: the
paper's §7 numbers and ours side by side, the scale-down stated, every row naming the JSON and the
command it comes from.

    python benchmarks/paper/reproduce.py                      # collect the JSONs, write the report
    python benchmarks/paper/reproduce.py --run all            # run every benchmark first (~15 min)
    python benchmarks/paper/reproduce.py --run table2,fig7_lda [--quick] [--results DIR]

--run starts each MPI benchmark as `mpirun --oversubscribe -n 8 python benchmarks/paper/X.py
--out DIR/X.json` (as root, Open MPI also wants OMPI_ALLOW_RUN_AS_ROOT=1 and
OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 in the environment), each bounded by --timeout. A benchmark whose
JSON is missing is reported as not run. Exit status: 0, or 1 when a run failed.
"""
import argparse
import functools
import math
import re
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

# Each result is read once: the Table 2 JSONs (1.5 MB at 30 workers) serve two sections.
read_json = functools.lru_cache(maxsize=None)(common.read_json)

# name -> (script, runs under mpirun, its ranks (None: --ranks), its own arguments)
BENCHMARKS = {"sched_cost": ("sched_cost.py", False, None, []),
              "lr-grid": ("lr_grid.py", False, None, []),
              "table2": ("table2.py", True, None, []),
              # Table 2 at the paper's 30 workers: 1 MB at 12.5 MB/s is still 80 ms a
              # transfer, with a quarter of the copying for 32 processes on 2 cores
              "table2-30": ("table2.py", True, 32, ["--payload-mb", "1", "--base-rate-mb", "12.5"]),
              # the same with every time 3x the paper's: the CPU's own costs (32 processes on
              # 2 cores) weigh 3x less, every ratio of the setting is unchanged
              "table2-30-dilated": ("table2.py", True, 32, ["--payload-mb", "1", "--base-rate-mb",
                                                            "12.5", "--dilate", "3"]),
              # the same at the learning rate where both modes are at their best (0.04: sync
              # SGD's fewest updates on lr_grid.py's grid, async's too with the delays the
              # 30-worker runs measure), from the initial model, so that a run's updates to
              # target barely move (at 0.08 both oscillate, and that noise decided cells)
              "table2-30-lr": ("table2.py", True, 32, ["--payload-mb", "1", "--base-rate-mb",
                                                       "12.5", "--pretrain", "0", "--lr",
                                                       "0.04"]),
              # that learning rate with every time 3x the paper's (as table2-30-dilated)
              "table2-30-dilated-lr": ("table2.py", True, 32, ["--payload-mb", "1",
                                                               "--base-rate-mb", "12.5",
                                                               "--pretrain", "0", "--lr",
                                                               "0.04", "--dilate", "3"]),
              "fig7_lda": ("fig7_lda.py", True, None, []),
              "sync_iteration": ("sync_iteration.py", True, None, []),
              "fig9_replica": ("fig9_replica.py", True, None, [])}

TIE = 0.03   # ratios within 3% of 1 are ties: one run on this shared machine cannot order them


# --- running -------------------------------------------------------------------------------------

def mpirun_path():
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    return here if os.path.exists(here) else shutil.which("mpirun")


def run_one(name, results, quick, ranks, timeout):
    script, mpi, own_ranks, own_args = BENCHMARKS[name]
    ranks = own_ranks or ranks
    # paths relative to the repo root (the command's cwd), so the JSON records a command that
    # works from any checkout
    cmd = [sys.executable, "benchmarks/paper/" + script] + own_args \
        + ["--out", common.relpath(os.path.join(results, name + ".json"))] \
        + (["--quick"] if quick else [])
    if mpi:
        mpirun = mpirun_path()
        if not mpirun:
            raise SystemExit("reproduce: mpirun not found next to python or on PATH")
        cmd = [mpirun, "--oversubscribe", "-n", str(ranks)] + cmd
    env = dict(os.environ)
    env["PYTHONPATH"] = common.ROOT + os.pathsep + env.get("PYTHONPATH", "")
    print("reproduce: %s" % " ".join(cmd), file=sys.stderr, flush=True)
    t0 = time.monotonic()
    try:
        rc = subprocess.run(cmd, cwd=common.ROOT, env=env, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        rc = "timed out after %d s" % timeout
    wall = time.monotonic() - t0
    print("reproduce: %s: %s in %.0f s" % (name, "ok" if rc == 0 else "FAILED (%s)" % rc, wall),
          file=sys.stderr, flush=True)
    return rc == 0, wall


# --- the report ----------------------------------------------------------------------------------

def f2(x, fmt="%.2f"):
    return "-" if x is None else fmt % x


def source(doc, path):
    m = doc["meta"]
    git = m.get("git") or {}
    commit = (git.get("commit") or "?")[:10] + (" + uncommitted changes"
                                                 if git.get("modified") else "")
    load = m.get("load_average")
    return ("Source: `%s` - command `%s` (git %s, %s, %s s of wall time%s%s)." % (
        common.relpath(path), m["command"], commit, m.get("timestamp", "?"),
        f2(m.get("total_wall_s"), "%.0f"),
        ", load average %.1f at the start (2 cores)" % load[0] if load else "",
        ", **--quick size**" if m.get("quick") else "")) + (
            " Note: %s" % m["git_note"] if m.get("git_note") else "")


def section_table2(doc, path):
    m, cells = doc["meta"], doc["cells"]
    task = m["task"]
    dilate = m.get("dilate", 1.0)
    out = ["## Table 2 with %d workers%s%s%s: mlfabric-A vs RR-Sync, time to a target "
           "accuracy, %d setting%s (§7.1)" % (
               m["workers"], " (the paper's count)" if m["workers"] == 30 else "",
               ", learning rate %g" % task["lr"] if "lr" in task else "",
               ", time dilated %gx" % dilate if dilate != 1 else "",
               len(cells), "" if len(cells) == 1 else "s"), ""]
    if dilate != 1:
        out += ["Every time of the setting runs %gx the paper's (`--dilate %g`): compute, "
                "transfers (the base rate divided by %g), the scheduler's batch interval and "
                "monitor lag, the NIC rate period and the trailing window, so every ratio is "
                "the same as undilated while the CPU's own costs (%d processes on 2 cores) "
                "weigh %gx less. Times below are as run: divide by %g for paper seconds." % (
                    dilate, dilate, dilate, m["workers"] + 2, dilate, dilate), ""]
    out += ["Paper: ResNet-50 on ImageNet from a pre-trained model, 30 workers, time to 74%% top-1, "
           "MLfabric-A with tau_max = 30. Ours: an MLP (%d parameters) on %s data, "
           "%s, time to %.3f test accuracy%s; "
           "%d workers, tau_max = %g; updates padded to %.1f MB (%.0f ms at the base "
           "rate); compute %g ms. Synchronous SGD reaches the target after %d iterations "
           "(offline, no network); RR-Sync ran %d iterations, mlfabric-A's workers for %s "
           "(%gx RR-Sync's ideal time to that crossing: a time, not a quota; fast workers do "
           "more). Reached = the model held, averaged over the trailing %g s, is at or above "
           "the target (the first touch of a noisy metric near its plateau is luck, more of it "
           "for the mode that makes more models)." % (
               task["params"], task.get("dataset", "?"),
               ("pre-trained by %d synchronous iterations (start accuracy %.3f)"
                % (task["pretrain_iterations"], doc["offline"]["start_accuracy"])
                if task["pretrain_iterations"] else "from its initial model (accuracy %.3f)"
                % doc["offline"]["start_accuracy"]),
               m["target"], " at a learning rate of %g per update (both modes)" % task["lr"]
               if "lr" in task else "", m["workers"], m["tau_max"], task["payload_bytes"] / 1e6,
               1e3 * task["payload_bytes"] / m["base_rate"], m["compute_ms"],
               doc["offline"]["crossing"], m["rr_iterations"],
               span(m.get("a_duration_s", {}).values(), "%.1f s"), m.get("a_factor", 0),
               m.get("window_s", 0)), "",
           "Speedup = RR-Sync's time to target / mlfabric-A's (> 1: mlfabric-A faster). s/it: a "
           "worker's mean iteration; wait: of it, the time not spent in its own emulated compute "
           "(RR-Sync: the allreduce and the wait for stragglers; mlfabric-A: fetching the model, "
           "its push returns at once). Updates to target: updates applied when the target was "
           "first reached. Ideal: RR-Sync on an infinitely fast CPU under the same emulated "
           "stragglers and NIC rates (each iteration the slowest worker's compute, then the "
           "ring's 2(N-1) steps at its slowest link's rate): the measured RR-Sync's time beyond "
           "it is CPU overhead, so a direction that holds against the ideal too does not rest "
           "on that overhead.", "",
           "Columns: A = mlfabric-A, RR = RR-Sync.", "",
           "| setting | paper | ours | vs RR ideal | same direction? | t A (s) | t RR (s) | "
           "t RR ideal (s) | RR s/it (wait) | A s/it (wait) | applied/s A vs RR | dropped (A) "
           "| updates to target A vs RR |",
           "|---|--:|--:|--:|:-:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for cell, c in cells.items():
        ours = f2(c["speedup"]) if c["speedup"] is not None else c.get("bound", "not reached")
        same = verdict(c)
        out.append("| %s | %.2f | %s | %s | %s | %s | %s | %s | %s (%s) | %s (%s) | %s vs %s | "
                   "%d/%d | %s vs %s |" % (
                       cell, c["paper_speedup"], ours, f2(c.get("speedup_vs_rr_ideal")), same,
                       f2(c["t_mlfabric_A"]) if c["a_reached"] else "not reached",
                       f2(c["t_rr_sync"]) if c["rr_reached"] else "not reached",
                       f2(c.get("t_rr_sync_ideal")),
                       f2(c["rr_iteration_s"], "%.3f"), f2(c.get("rr_wait_s"), "%.3f"),
                       f2(c["a_worker_iteration_s"], "%.3f"), f2(c.get("a_wait_s"), "%.3f"),
                       f2(c["a_applied_per_s"], "%.1f"), f2(c["rr_applied_per_s"], "%.1f"),
                       c["a_dropped"], c["a_pushed"], f2(c["a_updates_to_target"], "%d"),
                       f2(c["rr_updates_to_target"], "%d")))
    agree = [k for k, c in cells.items() if verdict(c) == "yes"]
    other = [k for k, c in cells.items() if verdict(c) == "**no**"]
    ties = [k for k, c in cells.items() if verdict(c).startswith("tie")]
    undet = [k for k, c in cells.items() if c["direction"] == "undetermined"]
    ideal = [k for k, c in cells.items() if c.get("direction_vs_rr_ideal") == "as the paper"]
    out += ["", "Direction: mlfabric-A faster than RR-Sync, as in the paper, in %d of %d "
            "settings (%s); the other way in %d (%s)%s%s." % (
                len(agree), len(cells), ", ".join(agree) or "none", len(other),
                ", ".join(other) or "none",
                "; a tie (within %d%%) in %d (%s)" % (round(100 * TIE), len(ties),
                                                      ", ".join(ties)) if ties else "",
                "; undetermined (a job ended below the target; the bound the run supports is "
                "given) in %d (%s)" % (len(undet), ", ".join(undet)) if undet else "")]
    if any("speedup_vs_rr_ideal" in c for c in cells.values()):
        out[-1] += (" Against RR-Sync's ideal (no CPU overhead), mlfabric-A is faster in %d of "
                    "%d%s." % (len(ideal), len(cells),
                               " (%s)" % ", ".join(ideal) if 0 < len(ideal) < len(cells) else ""))
    out += [""] + table2_profile(doc) + [""] + table2_ceiling(doc) + ["", source(doc, path),
                                                                       ""] + table2_runs(doc, path)
    # what the defaults of these commands' settings rest on (the template's notes)
    extra = note(os.path.basename(path))
    out += ["", extra, ""] if extra else []
    return out


TEMPLATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "REPRODUCTION.template.md")
NOTE = re.compile(r"^<!-- note: (\S+) -->$", re.M)


@functools.lru_cache(maxsize=None)
def template():
    """(the report's header, {name: note}) from REPRODUCTION.template.md: the header is the text
    before the first `<!-- notes` marker; each `<!-- note: NAME -->` paragraph goes under the
    section NAME (a JSON's file name, or a name the code asks for)."""
    with open(TEMPLATE) as f:
        text = f.read()
    header, _, rest = text.partition("<!-- notes")
    parts = NOTE.split(rest)
    notes = {parts[k]: " ".join(parts[k + 1].split()) for k in range(1, len(parts), 2)}
    return header.rstrip("\n"), notes


def note(name):
    """The template's note for `name`, as one paragraph, or None."""
    return template()[1].get(name)


def repeats(path):
    """The repeats of the command (Table 2's, Fig. 7's) that wrote `path`: X-repeat2.json, ...
    beside X.json, in order."""
    import glob
    stem = os.path.splitext(path)[0] + "-repeat"
    found = glob.glob(glob.escape(stem) + "*.json")
    return sorted((p for p in found if p[len(stem):-5].isdigit()),
                  key=lambda p: int(p[len(stem):-5]))


def median_speedup(cells):
    """The median of one cell's speedups over runs. A run where one mode never reached the
    target ranks below (mlfabric-A missed it) or above (RR-Sync did) every run where both did."""
    vals = sorted(c["speedup"] if c.get("speedup") is not None else
                  (math.inf if c.get("a_reached") else 0.0) for c in cells)
    k = len(vals) // 2
    return vals[k] if len(vals) % 2 else 0.5 * (vals[k - 1] + vals[k])


def table2_runs(doc, path):
    """Repeats of the same Table 2 command: each cell's speedup per run, their median and its
    direction; one run on this shared machine can land either side of 1 where the two modes
    are close."""
    others = repeats(path)
    if not others:
        return []
    runs = [doc] + [read_json(p) for p in others]
    out = ["Repeats of this command (%s): speedup per run, and the median. " % ", ".join(
        "`%s`" % common.relpath(p) for p in others) +
           "Runs minutes apart differ by more than the cells differ from each other where the "
           "two modes are close, so the median is the number to read.", "",
           "| setting | paper | %s | median | median's direction |" % " | ".join(
               "run %d" % (k + 1) for k in range(len(runs))),
           "|---|--:|%s--:|:-:|" % ("--:|" * len(runs))]
    agree = 0
    for cell, c in doc["cells"].items():
        got = [r["cells"].get(cell, {}) for r in runs]
        med = median_speedup(got)
        same = same_direction(med, c["paper_speedup"])
        agree += same == "yes"
        out.append("| %s | %.2f | %s | %.2f | %s |" % (
            cell, c["paper_speedup"], " | ".join(
                f2(g["speedup"]) if g.get("speedup") is not None else g.get("bound", "-")
                for g in got), med, same))
    out += ["", "Over %d runs, the median speedup is in the paper's direction in %d of %d "
            "settings." % (len(runs), agree, len(doc["cells"])), ""]
    return out


def same_direction(speedup, paper):
    """'yes' / '**no**' (mlfabric-A faster than RR-Sync, or not, as in the paper), or a tie:
    one run on this machine cannot order ratios within TIE of 1."""
    if abs(speedup - 1) < TIE:
        return "tie (within %d%%)" % round(100 * TIE)
    return "yes" if (speedup > 1) == (paper > 1) else "**no**"


def verdict(c):
    """A cell's 'same direction?' entry: same_direction, or undetermined (a job ended below
    the target)."""
    if c["direction"] == "undetermined" or c["speedup"] is None:
        return "undetermined"
    return same_direction(c["speedup"], c["paper_speedup"])


def section_table2_scale(results):
    """Table 2 at 6 and at 30 workers side by side, and the arithmetic of why the count decides
    it: a synchronous iteration waits for its slowest worker and runs its ring at its slowest
    link, and both get likelier with every worker added; an asynchronous worker waits for
    nobody."""
    from mlfabric.emulate.presets import COMPUTE_PRESETS, NET_PRESETS
    docs, runs = {}, {}
    for name in ("table2", "table2-30"):
        path = os.path.join(results, name + ".json")
        if os.path.exists(path):
            doc = read_json(path)
            docs[doc["meta"]["workers"]] = doc
            runs[doc["meta"]["workers"]] = [doc] + [read_json(p)
                                                    for p in repeats(path)]
    if len(docs) < 2:
        return []
    ns = sorted(docs)
    out = ["## Table 2: why the number of workers decides its direction", "",
           "A synchronous iteration waits for the slowest of its N workers and runs its ring at "
           "the rate of its slowest link; mlfabric-A's workers wait for nobody (a slow update "
           "is dropped). Both penalties grow with N. The chance that an iteration has a "
           "straggler, 1 - (1 - r)^N: %s. The chance that a ring has a link below the base "
           "rate, 1 - p_10^(2N) (every NIC direction is drawn alone): %s." % (
               "; ".join("%s (r = %g) %s" % (k, c.prob, " vs ".join(
                   "%.0f%%" % (100 * (1 - (1 - c.prob) ** n)) for n in ns))
                   for k, c in COMPUTE_PRESETS.items() if k != "C0"),
               "; ".join("%s %s" % (k, " vs ".join(
                   "%.1f%%" % (100 * (1 - p.probs[-1] ** (2 * n))) for n in ns))
                   for k, p in NET_PRESETS.items() if k != "N0")) +
           " (N = %s.) Speedup: the median over each table's runs (%s); the other columns "
           "from each table's first run." % (" vs ".join(str(n) for n in ns), " vs ".join(
               str(len(runs[n])) for n in ns)), "",
           "| setting | paper | speedup, %s | RR-Sync ideal s/it, %s | mlfabric-A s/it, %s | "
           "dropped (A), %s |" % tuple(" / ".join("%d workers" % n for n in ns)
                                       for _ in range(4)),
           "|---|--:|--:|--:|--:|--:|"]
    for cell in docs[ns[0]]["cells"]:
        row = [docs[n]["cells"].get(cell) for n in ns]
        if None in row:
            continue
        out.append("| %s | %.2f | %s | %s | %s | %s |" % (
            cell, row[0]["paper_speedup"],
            " / ".join(f2(median_speedup([r["cells"][cell] for r in runs[n]
                                          if cell in r["cells"]])) for n in ns),
            " / ".join(f2(c.get("rr_ideal_iteration_s"), "%.3f") for c in row),
            " / ".join(f2(c["a_worker_iteration_s"], "%.3f") for c in row),
            " / ".join("%.0f%%" % (100.0 * c["a_dropped"] / c["a_pushed"]) for c in row)))
    sets = [("%d workers" % ns[-1], runs[ns[-1]])]
    dilated = os.path.join(results, "table2-30-dilated.json")
    if os.path.exists(dilated):
        doc = read_json(dilated)
        sets.append(("%d workers, time dilated %gx" % (doc["meta"]["workers"],
                                                        doc["meta"]["dilate"]),
                     [doc] + [read_json(p) for p in repeats(dilated)]))
    out += [""] + paper_baseline(docs[ns[-1]], sets)
    return out


def paper_baseline(doc, sets):
    """What the paper's RR-Sync paid for stragglers, against a bandwidth-optimal ring: the
    paper's §2 gives one synchronous slowdown (C2 with N1's links: 8x); common.ring_ideal gives
    the ring's under the same emulation, at this table's scale. Their quotient is how much slower
    than a ring the paper's baseline was, and the paper's Table 2 speedup divided by it is
    mlfabric-A against an ideal ring, the comparison our 'vs RR-Sync ideal' column makes (for
    each of `sets`, [(label, the runs of one command)]: the median over its runs)."""
    m = doc["meta"]
    cell, paper_slow = common.PAPER_SYNC_SLOWDOWN
    if cell not in doc["cells"]:
        return []
    its = 200

    def per_iteration(preset):
        em = common.emulation(preset, m.get("seed", 0), base_rate=m["base_rate"])
        return common.ring_ideal(em, m["workers"], m["compute_ms"] / 1e3,
                                 m["task"]["payload_bytes"], its)[-1] / its
    calm = per_iteration("C0-N0")   # no stragglers, every link at the base rate
    ring_slow = per_iteration(cell) / calm
    measured = doc["cells"][cell]["rr_iteration_s"] / calm
    paper_vs_ring = common.PAPER_TABLE2[cell] * ring_slow / paper_slow
    ours = ["%.2f (%s, median of %d run%s)" % (
        median_speedup([dict(speedup=r["cells"][cell].get("speedup_vs_rr_ideal"),
                             a_reached=r["cells"][cell].get("a_reached"))
                        for r in runs]), label, len(runs),
        "" if len(runs) == 1 else "s") for label, runs in sets
        if all(cell in r["cells"] for r in runs)]
    return ["What the paper's baseline paid for stragglers: its §2 measured a synchronous "
            "iteration %.0fx as long under %s (10%% of the workers 4x slower, 10%% of the NIC "
            "directions at half rate) as without stragglers. A bandwidth-optimal ring on an "
            "infinitely fast CPU under the same emulation (common.ring_ideal, %d workers, "
            "%d iterations) takes %.2fx as long; our measured RR-Sync %.2fx (its CPU overhead "
            "added). The paper's RR-Sync thus lost about %.1fx more per iteration to stragglers "
            "than a ring must, and its Table 2 speedups are over that baseline: its %s "
            "speedup of %.2f is %.2f x %.2f / %.0f = **%.2fx against an ideal ring**. Ours "
            "against the ideal ring in %s, the same comparison: %s." % (
                paper_slow, cell, m["workers"], its, ring_slow, measured,
                paper_slow / ring_slow, cell, common.PAPER_TABLE2[cell],
                common.PAPER_TABLE2[cell], ring_slow, paper_slow, paper_vs_ring, cell,
                "; ".join(ours)), ""]


def span(xs, fmt="%.2f"):
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    lo, hi = min(xs), max(xs)
    return fmt % lo if fmt % lo == fmt % hi else "%s-%s" % (fmt % lo, fmt % hi)


def push_side(doc):
    """Per mlfabric-A job: (its cell, pushes offered / the server link's base rate, the share of
    the commit span the link spent carrying commits at that rate, updates applied per commit,
    the share of its pushes dropped)."""
    m, out = doc["meta"], []
    rate, payload = m["base_rate"], m["task"]["payload_bytes"]
    for j in doc.get("jobs", []):
        s, span_s = j.get("summary", {}), (j.get("target") or {}).get("commit_span_s")
        commits = j.get("server_commits")
        if j.get("mode") != "mlfabric-A" or not span_s or not commits or not j.get("duration_s"):
            continue
        out.append((j.get("cell"), s["pushed"] * payload / j["duration_s"] / rate,
                    s["server_bytes_in"] / rate / span_s, s["applied"] / len(commits),
                    s["dropped_total"] / s["pushed"]))
    return out


def staleness_side(doc, tau_max):
    """Per mlfabric-A job with the scheduler's staleness profile (benchmarks/ps_modes.py
    staleness_record): (median lag when planned, the share planned with a lag of tau_max or
    more - no position left within the bound, median updates in flight at a plan, median wait
    at the server before a pull batch left (s), median request-to-delivery of a fetch (s),
    median plan-to-applied of an update and its lateness against the planned arrival (s), the
    times the pull admission sent a get back to a later batch, per get, and of those the times
    it parked one for a slow uplink (a get can be sent back more than once; None, each of the
    last four, in runs before they were recorded))."""
    out = []
    for j in doc.get("jobs", []):
        st = (j.get("summary") or {}).get("staleness")
        if j.get("mode") != "mlfabric-A" or not st:
            continue
        lag = sorted((int(k), n) for k, n in st["lag_at_plan"].items())
        total, seen = sum(n for _, n in lag), 0
        for median, n in lag:    # the first lag at which half the updates are counted
            seen += n
            if 2 * seen >= total:
                break
        over = sum(n for k, n in lag if k >= tau_max) / total
        med = [(st.get(x) or {}).get("median") for x in ("in_flight_at_plan", "pull_wait",
                                                          "get_latency", "commit_latency",
                                                          "commit_late")]
        gets = (st.get("get_latency") or {}).get("n")
        per_get = [st.get(x) / gets if st.get(x) is not None and gets else None
                   for x in ("deferred_pulls", "parked_pulls")]
        out.append((median, over, *med, *per_get))
    return out


def a_ceiling(tau_max, transfer_s, compute_s, batch_s, pipeline=True):
    """mlfabric-A's most applied updates per second with no slow link, in a simple model (the
    section says which): (rate, updates per commit). An update's lag when planned is the rate
    times what passes between the snapshot of the model it was computed from and its plan - the
    commit ahead of it still travelling, the model's fetch (one transfer t), the compute c and
    half a batch b - and it must stay within tau_max.
    pipeline (the runtime's cut-through reduce chain, sched/aggregation.py): a batch's updates
    reach the server as one commit in about one transfer, commits every max(t, b), so
    rate (2t + c + b/2) = tau_max and m = rate max(t, b).
    Otherwise Alg. 3's groups (each member's transfer into its aggregator in turn): the server's
    link takes one commit per transfer, rate = m / t, and the commit ahead travels m transfers:
    (m / t)(m t + t + c + b / 2) = tau_max, a quadratic in m."""
    if pipeline:
        rate = tau_max / (2 * transfer_s + compute_s + batch_s / 2)
        return rate, rate * max(transfer_s, batch_s)
    k = transfer_s + compute_s + batch_s / 2
    m = (-k + math.sqrt(k * k + 4 * transfer_s * transfer_s * tau_max)) / (2 * transfer_s)
    return m / transfer_s, m


def table2_ceiling(doc):
    """Each cell's RR-Sync at its ideal rate against mlfabric-A's ceiling (a_ceiling), the
    runtime's cut-through pipeline and Alg. 3's store-and-forward groups: where the ideal ring
    applies more updates per second than mlfabric-A could with every link at full rate, no run
    of this setting can show the paper's direction against an efficient baseline; and how far
    below its ceiling mlfabric-A measured, with the staleness record's plan-to-applied time
    (what keeps an update in flight) where the JSON has it."""
    m, cells = doc["meta"], doc["cells"]
    transfer = m["task"]["payload_bytes"] / m["base_rate"]
    batch = next((j["batch_interval"] for j in doc.get("jobs", ()) if j.get("batch_interval")),
                 0.1 * m.get("dilate", 1.0))
    rows, above = [], []
    for cell, c in cells.items():
        if not (c.get("rr_ideal_iteration_s") and c.get("compute_s_mean")):
            continue
        ceiling, per_commit = a_ceiling(m["tau_max"], transfer, c["compute_s_mean"], batch)
        groups, per_group = a_ceiling(m["tau_max"], transfer, c["compute_s_mean"], batch,
                                      pipeline=False)
        ideal = m["workers"] / c["rr_ideal_iteration_s"]
        if ideal > ceiling:
            above.append(cell)
        rows.append("| %s | %.1f | %.1f (%.1f per commit) | %.1f (%.1f) | %s | %s |" % (
            cell, ideal, ceiling, per_commit, groups, per_group,
            f2(c.get("a_applied_per_s"), "%.1f"), f2(c.get("rr_applied_per_s"), "%.1f")))
    if not rows:
        return []
    flight = [st for st in staleness_side(doc, m["tau_max"]) if st[5] is not None]
    why = ("" if not flight else
           " The staleness record says where: an update's plan-to-applied took a median %s s "
           "(one transfer is %.0f ms), %s s of it later than the plan had the commit arrive." % (
               span([x[5] for x in flight]), 1e3 * transfer, span([x[6] for x in flight])))
    return ["mlfabric-A's ceiling, in a simple model: an update's lag when planned is the rate "
            "of applied updates times what passes between the snapshot of the model it was "
            "computed from and its plan (the commit ahead of it still travelling; the fetch, "
            "one %.0f ms transfer at best; the compute; half a %.0f ms batch), and must stay "
            "within tau_max = %g. With the runtime's cut-through pipeline (a batch's updates "
            "summed along a chain of its workers, the default) a commit travels about one "
            "transfer and the server takes one a batch; with the paper's Alg. 3 groups (each "
            "member's transfer into its aggregator in turn) it travels m transfers and the "
            "server takes one per transfer. Every link at full rate, no CPU cost and every "
            "update applied: the most it could apply. RR-Sync ideal: the ideal ring's updates "
            "per second (%d per iteration)." % (1e3 * transfer, 1e3 * batch, m["tau_max"],
                                                 m["workers"]), "",
            "| setting | RR-Sync ideal (updates/s) | mlfabric-A ceiling, pipeline (updates/s) "
            "| ceiling, Alg. 3 groups | mlfabric-A measured | RR-Sync measured |",
            "|---|--:|--:|--:|--:|--:|"] + rows + [
            "", ("Where the ideal ring's rate is above mlfabric-A's pipeline ceiling (%s), "
                 "mlfabric-A can be faster only against a baseline slower than the ideal ring, "
                 "as the paper's was (by its §2 numbers, the last section on Table 2), or by "
                 "needing fewer updates. Elsewhere" % ", ".join(above) if above else
                 "The ideal ring's rate is below mlfabric-A's pipeline ceiling in every setting:")
            + " the ceiling leaves room, and what mlfabric-A measured below it is the "
            "implementation's and this machine's: fetches and commits that take several "
            "transfers and, in N2/N3, links below full rate.%s" % why]


def table2_profile(doc):
    """Where the time goes, in numbers from the JSON: time to target = updates needed / update
    rate, so say which of the two differs."""
    m, cells = doc["meta"], list(doc["cells"].values())

    def ratio(a, b):
        return [c[a] / c[b] for c in cells if c.get(a) and c.get(b)]
    need = ratio("a_updates_to_target", "rr_updates_to_target")
    rate = ratio("a_applied_per_s", "rr_applied_per_s")
    iters = ratio("a_worker_iteration_s", "rr_iteration_s")
    drops = [100.0 * c["a_dropped"] / c["a_pushed"] for c in cells if c["a_pushed"]]
    # of the pushes, those dropped for a slow link (sched.scheduler; runs since it exists)
    slow = [100.0 * j["summary"]["dropped"].get("slow-link", 0) / j["summary"]["pushed"]
            for j in doc.get("jobs", ()) if j["mode"] == "mlfabric-A"
            and isinstance(j["summary"].get("dropped"), dict) and j["summary"].get("pushed")]
    payload = m["task"]["payload_bytes"]
    fetch = [m["workers"] * payload / c["a_worker_iteration_s"] / 1e6 for c in cells
             if c.get("a_worker_iteration_s")]
    waits = [c["a_fetch_s_median"] for c in cells if c.get("a_fetch_s_median") is not None]
    lines = ["Profile, over the settings: time to target = updates needed / update rate. "
             "mlfabric-A needed %sx RR-Sync's applied updates to reach the target, and applied "
             "%sx as many updates per second. Its workers' iterations took %sx RR-Sync's, and "
             "%s%% of its pushes were dropped (tau_max = %g with %d workers)%s. Each of "
             "its iterations fetches a whole %.1f MB model from the one server: %s MB/s asked "
             "of the server's link, which runs at %.0f MB/s%s." % (
                 span(need), span(rate), span(iters), span(drops, "%.0f"), m["tau_max"],
                 m["workers"], ": %s%% for a slow link (sched.scheduler's slow-link drop), "
                 "the rest as stale" % span(slow, "%.0f") if "slow_drop" in m else " as stale",
                 payload / 1e6, span(fetch, "%.0f"), m["base_rate"] / 1e6,
                 "; a fetch took a median %s s per setting, where the transfer alone takes "
                 "%.0f ms (the rest is waiting: for the pull batch ahead of it to leave - the "
                 "server answers the gets that came meanwhile once every model send of that "
                 "batch%s is done, runtime/server.py _serve_pulls - and, through a "
                 "distributor, for that worker's link)" % (
                     span(waits), 1e3 * payload / m["base_rate"],
                     # the gate that skips slow receivers came with table2.py's --slow-drop
                     " not paced by a slow receiver" if "slow_drop" in m else "")
                 if waits else "")]
    inbound = push_side(doc)
    if inbound:
        _, offered, busy, per_commit, dropped = zip(*inbound)
        idle = [100 * d for d, b in zip(dropped, busy) if b < 0.4]
        lines[0] += (
            " Push side: mlfabric-A's pushes offered the server's inbound link (a dedicated "
            "machine's: always at the base rate) %sx what it carries; it carried commits %s%% "
            "of the time from the first commit to the last, each commit summing %s updates." % (
                span(offered, "%.1f"), span([100 * b for b in busy], "%.0f"),
                span(per_commit, "%.1f")))
        if idle:
            lines[0] += (
                " Where that link was busy under 40%% of the time, %s%% of the pushes were "
                "still dropped: not for the server link's queue, then, but for the bound, with "
                "slow worker links (N3: half the NIC directions at a tenth of the rate) aging "
                "updates on their way: with tau_max = the workers, an update is stale once the "
                "model it started from is about a round of the others' updates old (the paper "
                "dropped 30%% in C1-N1, §7.1)." % span(idle, "%.0f"))
    budget = staleness_side(doc, m["tau_max"])
    if budget:
        lags, over, flight, wait, fetch, commit, late, deferred, parked = zip(*budget)
        lines[0] += (
            " Staleness budget (tau_max = %g versions, counted per update): an update's lag when "
            "planned - the updates planned since the model it was computed from - had a median "
            "of %s per setting, and %s%% of the pushes reached the scheduler with no position "
            "left within the bound (a lag of tau_max or more). Of that lag, the updates in "
            "flight at a plan (planned, not yet applied: the model a worker fetches is behind "
            "the plan by them) were a median %s; the rest is the updates planned while the "
            "model travelled to the worker, the worker computed, and its update waited for the "
            "next batch. A fetch: a median %s s from the request to the model's arrival, of "
            "which %s s waiting at the server for the pull batch ahead of it to leave (the "
            "snapshot is taken when its own batch leaves; the transfer alone takes %.0f ms)." % (
                m["tau_max"], span(lags, "%d"), span([100 * x for x in over], "%.0f"),
                span(flight, "%.0f"), span([x for x in fetch if x is not None]),
                span([x for x in wait if x is not None]), 1e3 * payload / m["base_rate"]))
        if any(x is not None for x in commit):
            lines[0] += (
                " An update stays in flight a median %s s from its plan to the server's report "
                "that it is applied, %s s of it later than its commit's planned arrival (the "
                "plan books the network as the monitor saw it; each cut-through hop adds CPU "
                "time on this machine that the plan does not know of)." % (
                    span([x for x in commit if x is not None]),
                    span([x for x in late if x is not None])))
        if any(x is not None for x in deferred):
            lines[0] += (
                " mlfabric-A's pull admission (runtime/pulls.py: a model handed out only while "
                "the update computed from it can still meet tau_max) sent a get back to wait "
                "for a later pull batch %s times per get (one can be sent back more than once); "
                "that wait is part of the fetch, not of the update's lag." % span(
                    [x for x in deferred if x is not None], "%.2f"))
        if any(x for x in parked if x is not None):
            lines[0] += (
                " Besides, it parked the gets of workers whose uplink was slow while one with a "
                "fast uplink pushed (their updates would be dropped for the slow link), %s "
                "times per get, each time asked again after t_lag." % span(
                    [x for x in parked if x is not None], "%.2f"))
    if need and 0.8 <= sorted(need)[len(need) // 2] <= 1.25:
        lines += ["", "Per applied update the two modes progress alike here (the median of the "
                  "first ratio is within 0.8-1.25x), so the difference in time to target is the "
                  "update rate."]
    return lines


def section_lda(doc, path):
    m, rows = doc["meta"], doc["rows"]
    task = m["task"]
    out = ["## Fig. 7 (c, d): distributed LDA, iterations and time to convergence (§7.1)%s" % (
        ", mlfabric-A without its pull admission" if m.get("pull_admission") == "off" else ""), "",
           "Paper: NYTimes, 100 topics, 30 workers, C1-N1, converged at log-likelihood -7.94. "
           "Ours: a synthetic corpus (%d documents of %d tokens, %d words, %d topics), %d "
           "workers, %s, compute %g ms, updates padded to %.1f MB; converged = %.4f (the offline "
           "synchronous plateau %.4f minus a tolerance). mlfabric-A-30 / -60 are tau_max = the "
           "workers / twice the workers. LDA's counts are state, not gradients: a worker folds "
           "the deltas of its dropped updates (mlfabric.ps.dropped()) into its next push, as "
           "lost work must be regenerated." % (
               task["docs"], task["doc_len"], task["vocab"], task["topics"], m["workers"],
               m["preset"], m["compute_ms"], task["payload_bytes"] / 1e6, m["target"],
               doc["offline"]["plateau"]), "",
           "| mode | paper iterations | paper s | paper time / RR-Sync | ours iterations | ours s "
           "| ours time / RR-Sync | s/it (wait) | dropped | best reached |",
           "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for label, r in rows.items():
        out.append("| %s | %d | %.0f | %.2f | %s | %s | %s | %s (%s) | %d/%d | %.4f |" % (
            label, r["paper_iterations"], r["paper_s"], r["paper_time_vs_rr"],
            f2(r["iterations"], "%d") if r["reached"] else "not reached",
            f2(r["t"]) if r["reached"] else "> %.1f" % r["job_s"], f2(r["time_vs_rr"]),
            f2(r["iteration_s"], "%.3f"), f2(r["wait_s"], "%.3f"), r["dropped"], r["pushed"],
            r["best"]))
    rr = rows.get("rr-sync")
    faster_paper = [k for k, r in rows.items() if k != "rr-sync" and r["paper_time_vs_rr"] < 1]
    faster_ours = [k for k, r in rows.items() if k != "rr-sync" and r["time_vs_rr"] is not None
                   and r["time_vs_rr"] < 1]
    notes = ["Faster than RR-Sync to the target: in the paper %s; here %s." % (
        ", ".join(faster_paper) or "none", ", ".join(faster_ours) or "none")]
    for label, r in rows.items():
        first = sum(1 for i in r.get("dropped_iterations", []) if i == 0)
        if r["dropped"] and not r["reached"]:
            notes.append("%s dropped %d updates (%s) and ended at %.4f, below the target%s: a "
                         "dropped LDA delta is lost for good, since counts are state, not "
                         "gradients - the model's counts no longer match the workers' topic "
                         "assignments." % (
                             label, r["dropped"], "%d of them first sweeps, which carry a "
                             "worker's whole initial counts" % first if first else
                             "none of them a first sweep", r["best"],
                             " (still below it at %.1f s, %.2fx RR-Sync's time)" % (
                                 r["job_s"], r["job_s"] / rr["t"]) if rr and rr["t"] else ""))
    w, payload = m["workers"], task["payload_bytes"]
    per = payload / m["base_rate"]
    notes.append("Vanilla Async's server link carries one update in and one model out per worker "
                 "per round: here %d x %.0f ms = %.2f s each way against %g ms of compute; in the "
                 "paper 30 x 56 ms = 1.7 s (its §2: a PS round ~1.8 s, 10x the computation), "
                 "which is what made its Async 5.9x slower than RR-Sync." % (
                     w, 1e3 * per, w * per, m["compute_ms"]))
    out += [""] + notes + [""] + [source(doc, path), ""] + lda_runs(doc, path)
    return out


def lda_runs(doc, path):
    """Repeats of the Fig. 7 command (X-repeat2.json, ... beside X.json): each mode's iterations to
    the target and its time against RR-Sync's, per run. Asynchronous LDA's progress depends on
    the order updates arrive in, so one run says little where the modes are close."""
    others = repeats(path)
    if not others:
        return []
    runs = [doc] + [read_json(p) for p in others]
    out = ["Repeats of this command (%s): iterations to the target (time / RR-Sync's), per run."
           % ", ".join("`%s`" % common.relpath(p) for p in others), "",
           "| mode | " + " | ".join("run %d" % (k + 1) for k in range(len(runs))) + " |",
           "|---|" + "--:|" * len(runs)]
    for label in doc["rows"]:
        cells = []
        for run in runs:
            r = run["rows"].get(label)
            cells.append("-" if r is None else "not reached" if not r["reached"] else
                         "%d (%s)" % (r["iterations"], f2(r["time_vs_rr"])))
        out.append("| %s | %s |" % (label, " | ".join(cells)))
    # vanilla async's first commit: a start-up race that its iterations follow (the note below)
    firsts = [next((j["server_commits"][0][1] for j in run.get("jobs", [])
                    if j.get("label") == "async" and j.get("server_commits")), None)
              for run in runs]
    if any(f is not None for f in firsts):
        out.append("| async's first commit, s | %s |" % " | ".join(f2(f, "%.3f") for f in firsts))
        out += ["", note("fig7-first-commit")]
    return out + [""]


def section_sync(doc, path):
    out = ["## §7.2: mlfabric-S vs RR-Sync vs Tr-Sync, time per iteration", "",
           "Paper (ResNet-50, 30 workers): RR-Sync 1.2-2x faster than MLfabric-S in every setting "
           "but C2-N1, where MLfabric-S is 16%% faster; under C2-N2 MLfabric-S's per-iteration "
           "communication is 18.42%% below Tr-Sync's. Ours: %d workers, %d server(s), a %.1f MB "
           "model, compute %g ms, %d iterations x %d rounds alternating; wait = iteration - own "
           "emulated compute." % (
               doc["meta"]["workers"], doc["meta"]["servers"],
               doc["meta"]["model_bytes"] / 1e6, doc["meta"]["compute_ms"],
               doc["meta"]["iterations"], doc["meta"]["rounds"]), "",
           "| setting | paper | mlfabric-S s/it | RR-Sync s/it | Tr-Sync s/it | RR-Sync speedup "
           "over S (ours) | S / Tr-Sync | S wait vs Tr-Sync wait | same direction? |",
           "|---|---|--:|--:|--:|--:|--:|--:|:-:|"]
    for name, p in doc["presets"].items():
        red = p["s_wait_reduction_vs_tr"]
        # the paper's claims, each as (what it says, whether ours goes the same way)
        # (None: a tie, within TIE of 1, which one run on this machine cannot order)
        tie = abs(p["s_over_rr"] - 1) < TIE
        if name == "C2-N1":
            claims = [("S 16% faster than RR-Sync", None if tie else p["s_over_rr"] < 1)]
        else:
            claims = [("RR-Sync 1.2-2x faster", None if tie else p["s_over_rr"] > 1)]
        if name == "C2-N2":
            claims.append(("S wait -18.4% vs Tr-Sync", red is not None and red > 0))
        m = p["per_mode_s"]
        out.append("| %s | %s | %.3f | %.3f | %.3f | %.2fx | %.2f | %s | %s |" % (
            name, "; ".join(c for c, _ in claims), m["mlfabric-S"], m["rr-sync"],
            m["tr-sync"], p["s_over_rr"], p["s_over_tr"],
            "-" if red is None else "%+.1f%%" % (-100 * red),
            ", ".join("tie (within %d%%)" % round(100 * TIE) if same is None else
                      "yes" if same else "**no**" for _, same in claims)))
    if all(p["s_over_tr"] < 1 for p in doc["presets"].values()):
        why = ("mlfabric-S is ahead of Tr-Sync in every setting here: BENCHMARKS.md (\"mlfabric-S "
               "vs Tr-Sync\") shows what put it there (cut-through relays, updates reduced and "
               "models sent down pipelines of workers), which also brings it level with RR-Sync, "
               "the bandwidth-optimal ring.")
    else:
        why = ("BENCHMARKS.md (\"mlfabric-S vs Tr-Sync\") profiles where mlfabric-S's iteration "
               "goes, hop by hop, against Tr-Sync's 64 KiB segments down a binary tree.")
    out += ["", why, "", source(doc, path), ""]
    return out


def section_fig9(doc, path):
    res = doc["results"]
    savings = [r["saving"] for r in res["rows"]]
    out = ["## Fig. 9: data sent to the replica vs Div_max (§7.3)", "",
           "Paper: the saving from aggregation plateaus at %.1fx (30 workers). Ours: %d workers "
           "and one replica, %s, Div_max in units of a typical update's norm; saving = every "
           "applied update sent on its own / the bytes of update copies that reached the "
           "replica." % (common.PAPER_FIG9_PLATEAU, doc["meta"]["workers"],
                         doc["meta"]["preset"]), "",
           "| Div_max (update norms) | " + " | ".join(str(r["div_max_units"])
                                                    for r in res["rows"]) + " |",
           "|---|" + "--:|" * len(res["rows"]),
           "| MB into the replica | " + " | ".join("%.0f" % (r["replica_update_bytes"] / 1e6)
                                                  for r in res["rows"]) + " |",
           "| saving (paper plateau %.1fx) | " % common.PAPER_FIG9_PLATEAU
           + " | ".join(f2(r["saving"]) + "x" for r in res["rows"]) + " |",
           "", "Reference job with no aggregators: %.0f MB for %d updates (expected %.0f MB)." % (
               res["reference"]["replica_update_bytes"] / 1e6, res["reference"]["replicated"],
               res["reference"]["expected"] / 1e6),
           "", "Shape: saving %s at the smallest Div_max, %s at most, %s at the largest; the "
           "paper's grows to a %.1fx plateau. BENCHMARKS.md (\"Replica traffic vs Div_max\") "
           "explains the low plateau at this scale (a 100 ms batch holds about one update per "
           "worker; copies that reach the replica by the batch's last server commit are frozen, "
           "so little is left to aggregate)." % (
               f2(savings[0]) + "x", f2(max(v for v in savings if v is not None)) + "x"
               if any(v is not None for v in savings) else "-",
               f2(savings[-1]) + "x", common.PAPER_FIG9_PLATEAU),
           "", source(doc, path), ""]
    return out


def section_sched(doc, path):
    out = ["## §7.4: scheduler cost per batch", "",
           "Not scaled down: one call of the scheduler (Alg. 2 + Alg. 3 + the plan) on the "
           "paper's §7.4 instance, on this machine. Paper: < 5 ms per batch for 30 workers "
           "(batches of < 10 updates), 30 / 440 / 1460 ms at |U| = 100 / 500 / 1000.", "",
           "| updates | paper ms | ours ms (fast path, median) | ours ms (Python reference) | "
           "vs paper | plans identical |", "|--:|--:|--:|--:|--:|:-:|"]
    for r in doc["results"]:
        out.append("| %d | %s | %.3f | %.1f | %s | %s |" % (
            r["updates"], f2(r["paper_ms"], "%g"), r["ms_median"], r["ms_reference"],
            f2(r["speedup_vs_paper"], "%.0fx"), "yes" if r["match"] else "**no**"))
    out += ["", source(doc, path), ""]
    return out


def section_lr_grid(doc, path):
    """The learning rate Table 2 runs at (lr_grid.py): updates to the target per rate, for
    synchronous SGD and for asynchronous SGD under two delay distributions."""
    m, rows = doc["meta"], doc["rows"]
    names = [k for k in rows[0] if k not in ("lr", "sync")] if rows else []

    def cell(v):
        if isinstance(v, list):
            return ", ".join("-" if x is None else "%d" % x for x in v)
        return "-" if v is None else "%d" % v
    out = ["## Table 2's learning rate: every rate of a grid, offline", "",
           "Updates applied until the test accuracy, averaged over the last 3 evaluations, is at "
           "or above %.3f, from %s (accuracy %.3f), %d workers: synchronous SGD (RR-Sync's model "
           "sequence, exact; an iteration applies %d) and asynchronous SGD with each update "
           "computed from the model `delay` updates old (mlfabric-A's; %d draws each; "
           "- : not within %d updates). A rate too large makes both overshoot and oscillate "
           "near the target, so that the updates a run needs move by several times between "
           "identical runs; at the rate where both are at their best they need alike many, and "
           "a cell's speedup is the ratio of the update rates the two systems sustain." % (
               m["target"], "%d synchronous iterations of pre-training" % m["pretrain"]
               if m["pretrain"] else "the initial model", m["start_accuracy"], m["workers"],
               m["workers"], m["seeds"], m["max_updates"]), "",
           "| learning rate | synchronous | %s |" % " | ".join(
               "asynchronous, delay %s" % n for n in names),
           "|--:|--:|%s" % ("--:|" * len(names))]
    for r in rows:
        out.append("| %g | %s | %s |" % (r["lr"], cell(r["sync"]), " | ".join(
            cell(r[n]) for n in names)))
    return out + ["", source(doc, path), ""]


SECTIONS = [("lr-grid", section_lr_grid), ("table2-30-lr", section_table2),
            ("table2-30-dilated-lr", section_table2),
            ("table2-30", section_table2),
            ("table2-30-dilated", section_table2),
            ("table2", section_table2),
            ("table2-scale", None), ("fig7_lda", section_lda), ("fig7_lda-off", section_lda),
            ("sync_iteration", section_sync), ("fig9_replica", section_fig9),
            ("sched_cost", section_sched)]


def build_report(results):
    """The markdown of REPRODUCTION.md from the JSONs in `results` (missing ones: not run)."""
    lines = [template()[0].format(results=common.relpath(results)), ""]
    for name, section in SECTIONS:
        path = os.path.join(results, name + ".json")
        if section is None:         # the 6- vs 30-worker comparison reads both Table 2 JSONs
            lines += section_table2_scale(results)
        elif os.path.exists(path):
            lines += section(read_json(path), path)
        else:
            lines += ["## %s" % name, "", "Not run: `%s` is missing (`python "
                      "benchmarks/paper/reproduce.py --run %s`)." % (common.relpath(path), name),
                      ""]
    return "\n".join(lines)


WIDTH = 100


def wrap(text, width=WIDTH):
    """The report with its paragraphs filled to `width` columns; headings, table rows and
    blank lines as they are, a `code span` never split (a long command stays on one line)."""
    import textwrap
    out = []
    for line in text.split("\n"):
        if len(line) <= width or line.startswith(("|", "#")):
            out.append(line)
            continue
        # spaces inside code spans become NUL for the filling, so no span breaks
        parts = line.split("`")
        glued = "`".join(p.replace(" ", "\0") if k % 2 else p for k, p in enumerate(parts))
        filled = textwrap.fill(glued, width, break_long_words=False, break_on_hyphens=False)
        out.append(filled.replace("\0", " "))
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(prog="benchmarks/paper/reproduce.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--run", default="", help="comma-separated benchmarks to run first, or "
                   "'all' (%s); default: none, only collect" % ", ".join(BENCHMARKS))
    p.add_argument("--quick", action="store_true", help="run them at their --quick size")
    p.add_argument("--results", default=common.RESULTS, help="where the JSONs are")
    p.add_argument("--out", default=os.path.join(common.ROOT, "REPRODUCTION.md"))
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--timeout", type=int, default=2700,
                   help="seconds per benchmark (the dilated 30-worker Table 2 takes ~21 min)")
    args = p.parse_args(argv)
    names = list(BENCHMARKS) if args.run == "all" else [
        x.strip() for x in args.run.split(",") if x.strip()]
    bad = [n for n in names if n not in BENCHMARKS]
    if bad:
        p.error("--run: unknown %s (known: %s)" % (", ".join(bad), ", ".join(BENCHMARKS)))
    if args.ranks < 4:
        p.error("--ranks must be >= 4")
    ok, walls = True, {}
    for name in names:
        good, walls[name] = run_one(name, args.results, args.quick, args.ranks, args.timeout)
        ok = ok and good
    if names:
        print("reproduce: ran %s in %.0f s in all" % (", ".join(names), sum(walls.values())),
              file=sys.stderr)
    text = wrap(build_report(args.results))
    with open(args.out, "w") as f:
        f.write(text + "\n")
    print("wrote %s" % common.relpath(args.out))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
