"""Entry point of `python -m mlfabric.bench` and of the `mlfabric-bench` script. Owns only the
routing: `kernels ...` goes to mlfabric.bench.kernels.main (single process, no MPI), everything else
to the MPI driver (mlfabric.bench.driver.main)."""
import importlib
import sys


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "kernels":
        try:  # imported only here: it must not pull in MPI
            kernels = importlib.import_module(__package__ + ".kernels")
        except ModuleNotFoundError as e:
            if e.name != __package__ + ".kernels":
                raise
            print("mlfabric.bench: the kernels benchmark (mlfabric/bench/kernels.py) is not in "
                  "this build", file=sys.stderr)
            return 2
        return kernels.main(argv[1:])
    from . import driver
    return driver.main(argv)


if __name__ == "__main__":
    sys.exit(main())
