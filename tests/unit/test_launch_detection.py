"""Launch detection (mlfabric/comm/launch.py): which launcher started this process and with how
many processes, from its environment; a launcher whose world is larger than the one MPI sees
(torchrun, srun without PMI wiring, another MPI's mpirun) is an error saying how to launch."""
import pytest

from mlfabric.comm import launch
from mlfabric.errors import MlfabricError

TORCHRUN = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
            "TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
SRUN = {"SLURM_PROCID": "3", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "8",
        "SLURM_NTASKS": "8"}


@pytest.mark.parametrize("env, found", [
    ({}, None),
    (TORCHRUN, ("torchrun", 2)),
    (SRUN, ("srun", 8)),
    ({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "0"}, ("mpirun", 4)),
    # mpirun inside a SLURM step or a torchrun environment: mpirun's world is the one
    ({**SRUN, **TORCHRUN, "OMPI_COMM_WORLD_SIZE": "1"}, ("mpirun", 1)),
    # a batch script's own environment (no step): not an srun launch
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "8"}, None),
    # RANK alone (a user's own variable) says nothing
    ({"RANK": "0"}, None),
])
def test_launcher_world(env, found):
    assert launch.launcher_world(env) == found


@pytest.mark.parametrize("env, name", [(TORCHRUN, "torchrun"), (SRUN, "srun"),
                                       ({"OMPI_COMM_WORLD_SIZE": "3"}, "mpirun")])
def test_a_world_larger_than_mpis_is_an_error_saying_how_to_launch(env, name):
    with pytest.raises(MlfabricError) as info:
        launch.check_launch(1, env=env)
    text = str(info.value)
    assert name in text and "MPI sees only this one" in text
    assert "mpirun -n" in text and "mlfabricrun -np" in text


@pytest.mark.parametrize("size, env, spawned", [
    (1, {}, False),                                   # a plain singleton
    (1, {**TORCHRUN, "WORLD_SIZE": "1"}, False),      # torchrun of one process
    (2, TORCHRUN, False),                             # MPI connects them: nothing to say
    (1, {"OMPI_COMM_WORLD_SIZE": "4"}, True),          # spawned by MPI_Comm_spawn
])
def test_no_error_where_mpi_sees_the_whole_world(size, env, spawned):
    launch.check_launch(size, spawned=spawned, env=env)


def test_torch_env_is_ours(monkeypatch):
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(launch, "EXPORTED", {"RANK": "0", "WORLD_SIZE": "2"})
    names = ("MASTER_ADDR", "RANK", "WORLD_SIZE")
    assert launch.torch_env_is_ours(names)            # none set
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert launch.torch_env_is_ours(names)            # only what mlfabric exported
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    assert not launch.torch_env_is_ours(names)        # one of the user's own


# --- torchrun's variables after the world changes (elastic reset, replacement) -----------------

TORCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT")


class _Comm:
    """One rank's view of a communicator whose other ranks answer `others` (their allgather
    items) and whose rank 0 broadcasts `root` (None: this rank is rank 0); records the
    collectives called."""

    def __init__(self, others=(), root=None):
        self.others, self.root, self.calls = list(others), root, []

    def allgather(self, item):
        self.calls.append("allgather")
        return [item, *self.others]

    def bcast(self, item, root=0):
        self.calls.append("bcast")
        return item if self.root is None else self.root


class _Ctx:
    def __init__(self, rank, size, local_rank, local_size, comm):
        self.rank, self.size, self.local_rank, self.local_size = rank, size, local_rank, local_size
        self.user_comm, self.single_host = comm, True


@pytest.fixture
def mpirun_env(monkeypatch):
    """Under mpirun, none of torchrun's variables set, nothing exported yet."""
    for name in TORCH_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    monkeypatch.setattr(launch, "EXPORTED", {})
    return monkeypatch


def _env():
    import os
    return {n: os.environ[n] for n in TORCH_VARS if n in os.environ}


def test_refresh_follows_the_world_where_mlfabric_set_the_variables(mpirun_env):
    mpirun_env.setenv("LOCAL_WORLD_SIZE", "8")  # the user's own: kept
    launch.export_torch_env(_Ctx(2, 4, 2, 4, _Comm(root=29400)))
    first = _env()
    assert first["RANK"] == "2" and first["WORLD_SIZE"] == "4" and first["LOCAL_RANK"] == "2"
    assert (first["MASTER_ADDR"], first["MASTER_PORT"]) == ("127.0.0.1", "29400")
    assert "LOCAL_WORLD_SIZE" not in launch.EXPORTED
    # a shrink to 3 ranks, this one now rank 1 (rank 0 of 4 died: its store went with it)
    comm = _Comm(others=[(True, True)] * 2, root=29411)
    launch.refresh_torch_env(_Ctx(1, 3, 1, 3, comm))
    now = _env()
    assert {n: now[n] for n in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")} == \
        {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "8"}
    assert (now["MASTER_ADDR"], now["MASTER_PORT"]) == ("127.0.0.1", "29411")
    assert comm.calls == ["allgather", "bcast"]  # agreed, then the new rank 0's port
    assert launch.EXPORTED == {n: v for n, v in now.items() if n != "LOCAL_WORLD_SIZE"}
    assert launch.torch_env_is_ours(("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def test_refresh_never_overwrites_a_users_value(mpirun_env):
    launch.export_torch_env(_Ctx(0, 2, 0, 2, _Comm()))
    mpirun_env.setenv("WORLD_SIZE", "2")  # set again by the user after init: the same text
    launch.EXPORTED.pop("WORLD_SIZE")      # (as mlfabric never set it)
    mpirun_env.setenv("MASTER_ADDR", "10.1.2.3")
    mpirun_env.setenv("MASTER_PORT", "29500")
    comm = _Comm(others=[(True, False)])
    launch.refresh_torch_env(_Ctx(0, 1, 0, 1, comm))
    now = _env()
    assert now["RANK"] == "0" and now["LOCAL_WORLD_SIZE"] == "1"
    assert now["WORLD_SIZE"] == "2"
    assert (now["MASTER_ADDR"], now["MASTER_PORT"]) == ("10.1.2.3", "29500")
    assert comm.calls == ["allgather"]  # no rank needs a store


def test_refresh_takes_part_in_the_store_another_rank_needs(mpirun_env):
    """The user set MASTER_ADDR / MASTER_PORT on this rank only, another rank (a replacement
    with nothing set) needs a store: this one still takes part in choosing it, keeping its
    own values."""
    mpirun_env.setenv("MASTER_ADDR", "10.1.2.3")
    mpirun_env.setenv("MASTER_PORT", "29500")
    launch.export_torch_env(_Ctx(0, 2, 0, 2, _Comm()))
    comm = _Comm(others=[(True, True)])
    launch.refresh_torch_env(_Ctx(0, 2, 0, 2, comm))
    assert comm.calls == ["allgather", "bcast"]
    assert (_env()["MASTER_ADDR"], _env()["MASTER_PORT"]) == ("10.1.2.3", "29500")


def test_a_replacement_sets_its_unset_variables(mpirun_env):
    comm = _Comm(others=[(True, True)] * 2)
    launch.refresh_torch_env(_Ctx(2, 3, 2, 3, comm), joined=True)
    now = _env()
    assert (now["RANK"], now["WORLD_SIZE"], now["LOCAL_RANK"], now["LOCAL_WORLD_SIZE"]) == \
        ("2", "3", "2", "3")
    assert launch.EXPORTED == now


def test_refresh_is_a_no_op_where_nothing_was_exported(mpirun_env):
    """Initialised on a communicator other than MPI.COMM_WORLD (nothing exported) and no
    replacement among the ranks: the variables stay unset."""
    comm = _Comm(others=[(False, False)])
    launch.refresh_torch_env(_Ctx(0, 2, 0, 2, comm))
    assert _env() == {} and comm.calls == ["allgather"]


def test_refresh_drops_a_store_rank_0_cannot_serve(mpirun_env):
    launch.export_torch_env(_Ctx(0, 3, 0, 3, _Comm()))

    def no_port(address):
        raise OSError("no free port")
    mpirun_env.setattr(launch, "_free_port", no_port)
    launch.refresh_torch_env(_Ctx(0, 2, 0, 2, _Comm(others=[(True, True)])))
    now = _env()
    assert "MASTER_ADDR" not in now and "MASTER_PORT" not in now
    assert now["WORLD_SIZE"] == "2" and "MASTER_PORT" not in launch.EXPORTED


def test_refresh_outside_mpirun_does_nothing(mpirun_env):
    mpirun_env.delenv("OMPI_COMM_WORLD_RANK")
    comm = _Comm()
    launch.refresh_torch_env(_Ctx(0, 2, 0, 2, comm), joined=True)
    assert _env() == {} and comm.calls == []
