"""`python -m mlfabric.torch.merge_timeline OUT IN [IN ...]`: the per-rank timeline files
(timeline.py) merged into one Chrome trace file, every rank a row. (Its own module: the package
imports timeline.py, and running an imported module with -m runs it twice.)"""
import sys

from .timeline import merge


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2 or argv[0] in ("-h", "--help"):
        print("usage: python -m mlfabric.torch.merge_timeline OUT IN [IN ...]\n"
              "merge the per-rank timeline files IN into one Chrome trace file OUT")
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    n = merge(argv[0], argv[1:])
    print(f"{argv[0]}: {n} events from {len(argv) - 1} file(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
