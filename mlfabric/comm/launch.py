"""How this process was launched, as init() needs to know it: a launcher whose world is larger
than the one MPI sees (torchrun, srun without PMI wiring, an mpirun of another MPI library) is
refused with an error saying how to launch; under Open MPI's mpirun, torchrun's variables
(RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) are exported for
torch code written for torchrun, and follow the world when elastic training changes it (those
mlfabric set; never a user's). Also owns where rank 0's rendezvous store listens (the torch
backend's and MASTER_ADDR's choice alike)."""
import ipaddress
import os
import socket

from ..errors import MlfabricError

HOW_TO_LAUNCH = ("launch mlfabric programs with MPI: `mpirun -n N python ...` or "
                 "`mlfabricrun -np N python ...`")
# The torchrun variables export_torch_env set, with the values it gave them (the torch backend
# treats those as its own, not the user's: see mlfabric/torch/backend.py).
EXPORTED = {}
# Where rank 0's rendezvous store listens and the others connect when the job spans hosts (one
# host: the loopback). Unset, rank 0 takes the address it routes from towards its peers.
STORE_ADDR_VAR = "MLFABRIC_STORE_ADDR"


def ucx_device_present():
    """Whether this host has a device UCX would drive (an InfiniBand / RoCE adapter: an entry in
    /sys/class/infiniband). Where there is none, Open MPI's UCX one-sided component prints
    errors when it declines, so mlfabric and mlfabricrun leave it out (osc ^ucx); where there is
    one, the user's own one-sided MPI keeps it."""
    try:
        return bool(os.listdir("/sys/class/infiniband"))
    except OSError:
        return False


def _int(name, env):
    try:
        return int(env.get(name, ""))
    except ValueError:
        return None


def launcher_world(env=None):
    """(launcher name, the number of processes it started) as this process's environment tells,
    or None when no known launcher started it. Open MPI's mpirun is asked first (it may run
    inside a SLURM allocation or a torchrun job's environment), then srun, then torchrun."""
    env = os.environ if env is None else env
    n = _int("OMPI_COMM_WORLD_SIZE", env)
    if n is not None:
        return "mpirun", n
    # srun sets the step's variables; a batch script has SLURM_NTASKS without a step of its own
    if "SLURM_PROCID" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env):
        n = _int("SLURM_STEP_NUM_TASKS", env) or _int("SLURM_NTASKS", env)
        if n is not None:
            return "srun", n
    if "RANK" in env and any(v in env for v in ("TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE",
                                                  "WORLD_SIZE")):
        n = _int("WORLD_SIZE", env)
        if n is not None:
            return "torchrun", n
    return None


def check_launch(mpi_world_size, spawned=False, env=None):
    """Raise MlfabricError when a launcher started more processes than MPI sees (each process
    then runs alone as rank 0 of 1: N unsynchronised copies of the training). spawned: this
    process was started by MPI_Comm_spawn (its world is the spawned group; nothing to check)."""
    if spawned or mpi_world_size != 1:
        return
    found = launcher_world(env)
    if found is None or found[1] <= 1:
        return
    name, n = found
    why = {"torchrun": "torchrun starts processes that MPI does not connect",
           "srun": "srun started them without PMI/PMIx wiring this MPI library uses (try "
                   "`srun --mpi=pmix`)",
           "mpirun": "the mpirun that started them belongs to another MPI library than the "
                     "one mpi4py loaded"}[name]
    raise MlfabricError(
        f"mlfabric: {name} started {n} processes but MPI sees only this one ({why}); each "
        f"would train alone as rank 0 of 1. {HOW_TO_LAUNCH.capitalize()}, e.g. "
        f"`mpirun -n {n} python ...` or `mlfabricrun -np {n} python ...`")


def route_from(address):
    """This host's address on the interface it would reach `address` through (a UDP socket's
    connect sends nothing); None when it cannot tell (no route, a name that does not resolve)."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(address, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(sockaddr)
            return probe.getsockname()[0]
    except OSError:
        return None


def store_address(comm, rank, single_host):
    """(the address rank 0's store listens on, the address the other ranks connect to); the
    first is None when no one address reaches every peer (the store then listens on all of
    rank 0's interfaces, as torch's TCPStore does by itself). Collective over comm."""
    given = os.environ.get(STORE_ADDR_VAR, "").strip()
    if given:
        return given, given
    if single_host:
        return "127.0.0.1", "127.0.0.1"
    hosts = comm.allgather(socket.gethostname())
    # each rank away from rank 0's host: its own address towards rank 0 ("" on rank 0's host);
    # rank 0: its own address towards each of those, which must be one and the same
    mine = route_from(hosts[0]) if hosts[rank] != hosts[0] else ""
    peers = comm.gather(mine, root=0)
    listen = None
    if rank == 0:
        remote = [p for p in peers if p != ""]
        routes = {route_from(p) for p in remote} if None not in remote else {None}
        listen = routes.pop() if len(routes) == 1 else None
        if listen and ipaddress.ip_address(listen.split("%")[0]).is_loopback:
            listen = None
    listen = comm.bcast(listen, root=0)
    return listen, listen or hosts[0]


def _free_port(address):
    """A TCP port free on `address` (any interface when None) at the time of asking."""
    family = socket.getaddrinfo(address or "0.0.0.0", 0, type=socket.SOCK_STREAM)[0][0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((address or "", 0))
        return sock.getsockname()[1]


def _world_values(ctx):
    return {"RANK": ctx.rank, "LOCAL_RANK": ctx.local_rank, "WORLD_SIZE": ctx.size,
            "LOCAL_WORLD_SIZE": ctx.local_size}


def _store_values(ctx):
    """MASTER_ADDR / MASTER_PORT for a store rank 0 of ctx can serve (the address the torch
    backend's store would take, a port free there), or {} when rank 0 has no free port.
    Collective over ctx's ranks."""
    comm = ctx.user_comm
    listen, host = store_address(comm, ctx.rank, ctx.single_host)
    port = None
    if ctx.rank == 0:
        try:
            port = _free_port(listen)
        except OSError:
            port = None
    port = comm.bcast(port, root=0)
    return {} if port is None else {"MASTER_ADDR": host, "MASTER_PORT": port}


def export_torch_env(ctx):
    """Under Open MPI's mpirun, set torchrun's variables (only those unset) from ctx, the world
    context: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, and MASTER_ADDR / MASTER_PORT
    where rank 0 can serve a store (the address the torch backend's store would take, a port
    free there). Collective over ctx's ranks."""
    if "OMPI_COMM_WORLD_RANK" not in os.environ:
        return
    values = _world_values(ctx)
    if not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
        values.update(_store_values(ctx))
    for name, value in values.items():
        if name not in os.environ:
            os.environ[name] = str(value)
            EXPORTED[name] = str(value)


def _ours(name):
    """Whether mlfabric may give torchrun's variable `name` a value: unset, or holding the one
    mlfabric gave it (a value the user set is never overwritten)."""
    value = os.environ.get(name)
    return value is None or value == EXPORTED.get(name)


def refresh_torch_env(ctx, joined=False):
    """After the world changed (elastic training: the survivors of a failure shrunk to, or
    merged with replacements; ctx the new world context), give torchrun's variables ctx's values
    on the ranks where mlfabric exported them, or where this process joined as a replacement
    (joined=True; its own are unset: it exports them as init() would have). Only the variables
    mlfabric set, or unset ones, change: a user's stay as they are. MASTER_ADDR / MASTER_PORT
    name a store the new rank 0 can serve (the old rank 0 may be dead), or are removed when it
    has no free port. Collective over ctx's ranks (they agree first whether there is anything
    to do)."""
    if "OMPI_COMM_WORLD_RANK" not in os.environ:
        return
    mine = bool(EXPORTED) or joined
    flags = ctx.user_comm.allgather((mine, mine and (_ours("MASTER_ADDR") or
                                                     _ours("MASTER_PORT"))))
    if not any(m for m, _ in flags):
        return
    values = _world_values(ctx)
    if any(store for _, store in flags):
        store = _store_values(ctx)
        if mine and not store:  # no store named: a dead rank 0's would be waited for in vain
            for name in ("MASTER_ADDR", "MASTER_PORT"):
                if name in EXPORTED and _ours(name):
                    os.environ.pop(name, None)
                    del EXPORTED[name]
        values.update(store)
    if mine:
        for name, value in values.items():
            if _ours(name):
                os.environ[name] = EXPORTED[name] = str(value)


def torch_env_is_ours(names):
    """True when every one of `names` set in the environment holds what export_torch_env gave
    it (none set counts too): the user set none of them."""
    return all(os.environ.get(n) in (None, "", EXPORTED.get(n)) for n in names)
