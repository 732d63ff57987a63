"""What every MPI benchmark script under benchmarks/ needs around its main(): a command-line
parser whose help and errors only rank 0 prints (every rank exits alike), a comma-separated
integer list option, an output-file option checked before any work (a path that cannot be
written is a usage error at once, not a failure after the whole run), and an entry point that
takes the whole job down when one rank fails, rather than leaving the others waiting for it."""
import argparse
import os
import sys
import traceback


class Parser(argparse.ArgumentParser):
    """argparse, printing on rank 0 only; every rank exits alike (status 2 on errors)."""

    def _print_message(self, message, file=None):
        if world_rank() == 0:
            super()._print_message(message, file)


RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")


def world_rank():
    """This process's rank in the MPI job: COMM_WORLD's where mpi4py has started MPI, else the
    launcher's variable (so that a parser used without MPI, as in a test, starts none), else 0."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        return mpi.COMM_WORLD.rank
    for name in RANK_VARIABLES:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def parser(prog, doc):
    """The script's Parser: `prog` as named in its usage line, the first paragraph of its module
    docstring `doc` as the description, laid out as written."""
    return Parser(prog=prog, description=doc.split("\n\n")[0],
                  formatter_class=argparse.RawDescriptionHelpFormatter)


def int_list(text):
    """argparse type: comma-separated integers >= 1."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError("%r is not a comma-separated list of integers" % text)
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("%r: needs integers >= 1" % text)
    return values


def _int_at_least(low):
    """argparse type: an integer >= low."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError("%r is not an integer" % text)
        if value < low:
            raise argparse.ArgumentTypeError("%r: needs an integer >= %d" % (text, low))
        return value
    return parse


positive_int = _int_at_least(1)
nonnegative_int = _int_at_least(0)

UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text):
    """'8' -> 8, '64K' -> 65536, '128M', '1G', '1.5K', '4KiB', '16B'; binary units. ValueError
    for anything but a whole number of bytes >= 1."""
    s = str(text).strip().upper()
    for tail in ("IB", "B"):
        if s.endswith(tail) and len(s) > len(tail):
            s = s[:-len(tail)]
            break
    unit = s[-1] if s and s[-1] in UNITS else ""
    num = s[:-1] if unit else s
    try:
        value = float(num) * UNITS[unit]
    except ValueError:
        raise ValueError(f"bad size {text!r}: expected a byte count like 8, 64K, 128M or 1G")
    if not 1 <= value < float("inf") or value != int(value):
        raise ValueError(f"bad size {text!r}: must be a whole number of bytes >= 1")
    return int(value)


def byte_size(text):
    """argparse type: parse_size() as a usage error."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc))


def unwritable(path):
    """Why open(path, "w") would fail, or None; creates nothing. (As root, permission bits do
    not stop a write: only a missing directory, a directory in the way or a read-only file
    system do.)"""
    if not path:
        return "an empty path"
    if os.path.isdir(path):
        return "%s is a directory" % path
    if os.path.exists(path):
        return None if os.access(path, os.W_OK) else "%s is not writable" % path
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return "its directory %s does not exist" % parent
    if not os.access(parent, os.W_OK | os.X_OK):
        return "no file can be created in %s" % parent
    return None


def output_path(text):
    """argparse type: a file the run will write at its end, checked now. Under an MPI job of
    several ranks rank 0 (the rank that writes) checks and tells the others, so that every rank
    takes the same exit; a process without MPI checks by itself."""
    problem = unwritable(text)
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized() \
            and mpi.COMM_WORLD.size > 1:
        problem = mpi.COMM_WORLD.bcast(problem, root=0)
    if problem:
        raise argparse.ArgumentTypeError("cannot write %r: %s" % (text, problem))
    return text


def run_main(main):
    """Exit with main()'s status; any other failure on one rank aborts the whole MPI job."""
    try:
        status = main()
    except SystemExit:
        raise
    except BaseException:  # noqa: B902 - one rank's failure must not leave the others waiting
        traceback.print_exc()
        sys.stderr.flush()
        from mpi4py import MPI
        MPI.COMM_WORLD.Abort(1)
    sys.exit(status)
