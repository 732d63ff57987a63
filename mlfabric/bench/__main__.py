"""Entry point of `python -m mlfabric.bench` and of the `mlfabric-bench` script. Owns only the
routing: the single-process benchmarks (`kernels`, `sched`, `sched-oracle`: no MPI traffic) go
to their module's main, imported only when named; everything else to the MPI driver
(mlfabric.bench.driver.main)."""
import importlib
import sys

# command -> module of mlfabric.bench with a main(argv)
SINGLE_PROCESS = {"kernels": "kernels", "sched": "sched", "sched-oracle": "sched_oracle"}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SINGLE_PROCESS:
        name = __package__ + "." + SINGLE_PROCESS[argv[0]]
        try:  # imported only here: it must not pull in MPI
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            print("mlfabric.bench: the %s benchmark (%s.py) is not in this build"
                  % (argv[0], name.replace(".", "/")), file=sys.stderr)
            return 2
        return module.main(argv[1:])
    from . import driver
    return driver.main(argv)


if __name__ == "__main__":
    sys.exit(main())
