"""mlfabric.torch: Horovod's PyTorch API on mlfabric's collectives.

`import mlfabric.torch as hvd` in place of `import horovod.torch as hvd`, and a script written for
Horovod runs on mlfabric::

    hvd.init(); hvd.rank(); hvd.size(); hvd.local_rank(); hvd.local_size(); hvd.cross_rank();
    hvd.cross_size(); hvd.is_homogeneous(); hvd.shutdown()
    hvd.allreduce / allreduce_ / allreduce_async / allreduce_async_   (default op: Average)
    hvd.grouped_allreduce (+ _ / _async / _async_), hvd.allgather (+ _async),
    hvd.broadcast / broadcast_ (+ _async), hvd.alltoall (+ _async), hvd.reducescatter
    (+ _async), hvd.sparse_allreduce_async, hvd.synchronize, hvd.poll,
    hvd.join, hvd.barrier, hvd.Average / Sum / Min / Max / Product, hvd.Compression,
    hvd.DistributedOptimizer (hvd.PartialDistributedOptimizer: some layers kept local),
    hvd.broadcast_parameters, hvd.broadcast_optimizer_state,
    hvd.broadcast_object, hvd.allgather_object, hvd.grouped_allgather / grouped_reducescatter,
    hvd.SyncBatchNorm, hvd.start_timeline / stop_timeline,
    hvd.ProcessSet, hvd.global_process_set, hvd.add_process_set, hvd.remove_process_set
    (process_set= on every collective and DistributedOptimizer),
    hvd.elastic.run / hvd.elastic.TorchState (elastic.py: training goes on when ranks die)
    hvd.HorovodInternalError / hvd.HostsUpdatedInterrupt (Horovod's elastic exceptions)

Parameter-server training (ps_optimizer.py): ps_init(mode, ...), serve_model(model) on the
scheduler/server/replica ranks, PSOptimizer(optimizer, params, tau_max=...) on the workers.
torch.distributed backend (backend.py): importing mlfabric.torch registers "mlfabric", so
torch.distributed.init_process_group("mlfabric") and DistributedDataParallel run on mlfabric.

This module owns the process-level calls (init, shutdown, the queries); ops.py the tensor
collectives (on arguments.py's checks, dispatch.py's queues, control.py's control round,
fusion.py's fused buffers and streams.py's GPU streams), grouped_ops.py grouped allgather /
reducescatter, optimizer.py DistributedOptimizer, sync_batch_norm.py SyncBatchNorm, functions.py
the whole-model helpers, compression.py the compressors, process_sets.py the process sets,
sparse.py the sparse allreduce. Differences from Horovod:
collectives are matched by the order ranks issue them, not by name (names, when every rank
gives one, are checked to agree); the timeline (timeline.py) is a file per rank; op Adasum
(adasum.py) is for allreduce only; process sets are built from lists of ranks (not from
communicators) and may always be added after init.
"""
import os as _os

from mpi4py import MPI as _MPI

import mlfabric as _mf

from ..errors import MismatchError, MlfabricError, NotInitializedError, PeerTimeoutError
from .compression import Compression
from .functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                        broadcast_parameters)
from .ops import (Adasum, Average, Max, Min, Product, Sum, allgather, allgather_async, allreduce,
                  allreduce_, allreduce_async, allreduce_async_, alltoall, alltoall_async,
                  barrier, broadcast, broadcast_, broadcast_async, broadcast_async_,
                  grouped_allreduce, grouped_allreduce_, grouped_allreduce_async,
                  grouped_allreduce_async_, join, poll, reducescatter, reducescatter_async,
                  synchronize)
from .grouped_ops import (grouped_allgather, grouped_allgather_async, grouped_reducescatter,
                          grouped_reducescatter_async)
from .optimizer import DistributedOptimizer, PartialDistributedOptimizer
from .process_sets import (ProcessSet, add_process_set, global_process_set,
                           remove_process_set)
from .process_sets import on_init as _init_process_sets
from .ps_optimizer import PSOptimizer, ps_init, serve_model
from .sparse import sparse_allreduce_async
from .sync_batch_norm import SyncBatchNorm
from . import backend as _backend  # noqa: F401  (registers the "mlfabric" process-group backend)
from . import elastic  # noqa: F401  (hvd.elastic.run, hvd.elastic.TorchState)
from .elastic import HorovodInternalError, HostsUpdatedInterrupt
from . import dispatch as _dispatch
from . import timeline as _timeline
from ..comm import respawn as _respawn


def init(comm=None, process_sets=None):
    """Initialise on comm: None (MPI.COMM_WORLD), an mpi4py communicator, or a list of ranks of
    MPI.COMM_WORLD (every listed rank calls init with the same list). Collective. Calling it
    again with the same communicator does nothing. process_sets: a list of ProcessSet (or of
    rank lists) to register now, or "dynamic" (accepted for Horovod's sake: sets may always be
    added later with add_process_set). As mlfabric.init(): a process started by a launcher MPI
    does not connect (torchrun, srun without PMI) is refused with an error saying how to launch;
    under mpirun, torchrun's RANK / LOCAL_RANK / WORLD_SIZE / LOCAL_WORLD_SIZE / MASTER_ADDR /
    MASTER_PORT are set where unset (and follow the world through an elastic reset: elastic.py;
    a replacement for a dead rank gets its own here)."""
    if isinstance(comm, (list, tuple)):
        world = _MPI.COMM_WORLD
        ranks = [int(r) for r in comm]
        if world.rank not in ranks:
            raise ValueError(f"init(comm={ranks}): this rank ({world.rank} of MPI.COMM_WORLD) is "
                             "not in the list; only the listed ranks call init")
        comm = world.Create_group(world.Get_group().Incl(ranks))
    joining = comm is None and not _mf.initialized()
    _mf.init(comm)
    if joining and _respawn.joining:  # a replacement for a dead rank joined the survivors
        elastic.joined()
    _init_process_sets(process_sets)
    if _os.environ.get("MLFABRIC_TIMELINE"):
        start_timeline(_os.environ["MLFABRIC_TIMELINE"])


def shutdown():
    """Finish queued calls and release mlfabric (collective). init() may be called again."""
    _dispatch.drain()
    _timeline.stop()
    _mf.finalize()


def start_timeline(file_path, mark_cycles=False):
    """Record every call this rank makes from now on to a Chrome trace file (Horovod's
    timeline; see mlfabric/torch/timeline.py for what it shows): file_path itself with one rank,
    else file_path with this rank before the extension (t.json -> t.0.json, t.1.json, ...), or
    in place of "{rank}". Returns the file's path. Starting again closes the last file first.
    mark_cycles is accepted for Horovod's signature: mlfabric has no background cycles to mark.
    MLFABRIC_TIMELINE=path starts one at init()."""
    del mark_cycles
    return _timeline.start(file_path, _mf.rank(), _mf.size())


def stop_timeline():
    """Stop recording and complete the file (also done at shutdown and exit)."""
    _timeline.stop()


def is_initialized():
    return _mf.initialized()


def rank():
    """This process's rank; NotInitializedError before init()."""
    return _mf.rank()


def size():
    """Number of ranks; NotInitializedError before init()."""
    return _mf.size()


def local_rank():
    """This process's rank among the ranks on its host."""
    return _mf.local_rank()


def local_size():
    """Number of ranks on this host."""
    return _mf.local_size()


def cross_rank():
    """This host's index among the hosts running a rank with this local rank."""
    return _mf.cross_rank()


def cross_size():
    """Number of hosts running a rank with this local rank."""
    return _mf.cross_size()


def is_homogeneous():
    """True when every host runs the same number of ranks."""
    return _mf.is_homogeneous()


# Build queries, as Horovod's: what a script may test to pick a code path.
def mpi_built():
    return True


def mpi_enabled():
    return True


def mpi_threads_supported():
    return _MPI.Query_thread() == _MPI.THREAD_MULTIPLE


def gloo_built():
    return False


def gloo_enabled():
    return False


def nccl_built():
    """True when CUDA tensors can move (over NCCL, loaded at run time)."""
    return _mf.nccl_built()


def cuda_built():
    """True when mlfabric.torch collectives take CUDA tensors: the same as nccl_built()."""
    return _mf.nccl_built()


def rocm_built():
    return False


def ddl_built():
    return False


def ccl_built():
    return False


__all__ = ["init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
           "cross_rank", "cross_size", "is_homogeneous", "start_timeline", "stop_timeline",
           "reducescatter", "reducescatter_async", "allreduce", "allreduce_", "allreduce_async",
           "allreduce_async_", "grouped_allreduce", "grouped_allreduce_",
           "grouped_allreduce_async", "grouped_allreduce_async_", "sparse_allreduce_async",
           "grouped_allgather",
           "grouped_allgather_async", "grouped_reducescatter", "grouped_reducescatter_async",
           "allgather", "allgather_async", "broadcast", "broadcast_", "broadcast_async",
           "broadcast_async_", "alltoall", "alltoall_async", "synchronize", "poll", "join",
           "barrier", "Adasum", "Average", "Sum", "Min", "Max", "Product", "Compression",
           "DistributedOptimizer", "PartialDistributedOptimizer", "SyncBatchNorm",
           "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object",
           "allgather_object", "mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built",
           "gloo_enabled", "nccl_built", "cuda_built", "rocm_built", "ddl_built", "ccl_built",
           "MlfabricError", "MismatchError", "NotInitializedError", "PeerTimeoutError",
           "HorovodInternalError", "HostsUpdatedInterrupt",
           "PSOptimizer", "ps_init", "serve_model", "ProcessSet", "global_process_set",
           "add_process_set", "remove_process_set"]
