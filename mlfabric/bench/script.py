"""What every MPI benchmark script under benchmarks/ needs around its main(): a command-line
parser whose help and errors only rank 0 prints (every rank exits alike), a comma-separated
integer list option, and an entry point that takes the whole job down when one rank fails,
rather than leaving the others waiting for it."""
import argparse
import sys
import traceback


class Parser(argparse.ArgumentParser):
    """argparse, printing on rank 0 only; every rank exits alike (status 2 on errors)."""

    def _print_message(self, message, file=None):
        from mpi4py import MPI
        if MPI.COMM_WORLD.rank == 0:
            super()._print_message(message, file)


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
