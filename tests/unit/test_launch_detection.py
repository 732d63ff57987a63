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
