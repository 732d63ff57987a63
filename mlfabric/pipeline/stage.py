"""The PyTorch front end of pipeline-parallel training: cut a model (an nn.Sequential or a list of
modules) into pieces, keep the pieces of this rank, and train them with a schedule.

    model = PipelineModel(layers, schedule=flush(p=4, m=8), loss_fn=nn.CrossEntropyLoss(),
                          optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    loss = model.train_step(inputs, targets)   # the loss on the last stage, None elsewhere

Where the cuts go: `boundaries` (the index of the first layer of pieces 1, 2, ...), or a
partition.Partition (its stages' layer ranges, and its replication per stage, which the schedule
must have), or by default layers spread as evenly as their count allows. With v chunks per rank
(interleaved schedules) the model is cut into p * v pieces and rank s holds pieces s, s + p, ...

Every rank builds the whole layer list (seeded alike, so the weights agree) and keeps its pieces;
replicas of a stage are given replica 0's weights anyway. Construction checks that every rank
cut the same model the same way: the schedule, the layer count, the cuts and each layer's
signature (its class, its submodules' classes, its parameters' and buffers' names, shapes and
dtypes) are compared in one small bounded collective; ranks that differ (cuts computed per rank
from timings, say) raise MismatchError on every rank, naming what differs and who passed what.
The running is mlfabric.pipeline.executor's. This module imports torch; MPI (mpi4py, the
executor) only when a PipelineModel is built, so split_layers and make_schedule work in a
process without MPI.
"""
import torch

from .partition import Partition
from .schedules import Schedule, flush, gpipe, interleaved, one_f_one_b, two_bw

SCHEDULES = ("gpipe", "flush", "1f1b", "2bw", "interleaved")


def split_layers(layers, pieces, boundaries=None, partition=None):
    """Cut `layers` (an nn.Sequential or a sequence of modules) into `pieces` nn.Sequential
    pieces, in order. boundaries: the index of the first layer of each piece after the first
    (pieces - 1 increasing ints in (0, len(layers))); partition: a Partition whose stages cover
    the layers in order (one piece per stage); neither: as even as the layer count allows (the
    first len % pieces pieces get one layer more). Every piece has at least one layer."""
    layers = _as_layers(layers)
    if not isinstance(pieces, int) or isinstance(pieces, bool) or pieces < 1:
        raise ValueError("pieces must be an int >= 1, got %r" % (pieces,))
    n = len(layers)
    if boundaries is not None and partition is not None:
        raise ValueError("give boundaries or partition, not both")
    if partition is not None:
        boundaries = _partition_boundaries(partition, n, pieces)
    elif boundaries is None:
        if n < pieces:
            raise ValueError("cannot cut %d layers into %d pieces (each needs a layer); use "
                             "fewer stages or chunks, or finer layers" % (n, pieces))
        sizes = [n // pieces + (1 if i < n % pieces else 0) for i in range(pieces)]
        boundaries = [sum(sizes[:i]) for i in range(1, pieces)]
    else:
        boundaries = list(boundaries)
        if len(boundaries) != pieces - 1 or not all(
                isinstance(b, int) and not isinstance(b, bool) for b in boundaries):
            raise ValueError("boundaries must be %d ints (the first layer of pieces 1..%d), got %r"
                             % (pieces - 1, pieces - 1, boundaries))
        cuts = [0] + boundaries + [n]
        if any(a >= b for a, b in zip(cuts, cuts[1:])):
            raise ValueError("boundaries must increase strictly within (0, %d) so that every "
                             "piece has a layer, got %r" % (n, boundaries))
    cuts = [0] + list(boundaries) + [n]
    return [torch.nn.Sequential(*layers[a:b]) for a, b in zip(cuts, cuts[1:])]


def stage_modules(pieces, schedule, rank):
    """The pieces rank `rank` holds under `schedule`, in chunk order: pieces stage, stage + p..."""
    if len(pieces) != schedule.pieces:
        raise ValueError("schedule %s runs %d pieces (p=%d x v=%d), got %d"
                         % (schedule.name, schedule.pieces, schedule.p, schedule.v, len(pieces)))
    return [pieces[q] for q in schedule.pieces_of(rank)]


def make_schedule(name, ranks, microbatches, chunks=1, batches=1, replicas=None,
                  vertical_sync=False):
    """A schedule by name for `ranks` ranks: gpipe, flush, 2bw, interleaved (p = ranks, m =
    microbatches per batch, `batches` batches) or 1f1b (PipeDream: microbatches * batches
    inputs, a step after each; `replicas` per stage for 1F1B-RR, p = len(replicas))."""
    if name not in SCHEDULES:
        raise ValueError("unknown schedule %r; choose one of %s" % (name, ", ".join(SCHEDULES)))
    if replicas is not None and name != "1f1b":
        raise ValueError("replicated stages (replicas=%r) come with the 1f1b schedule "
                         "(1F1B-RR)" % (replicas,))
    if chunks != 1 and name != "interleaved":
        raise ValueError("chunks=%r is for the interleaved schedule" % (chunks,))
    if name == "1f1b":
        reps = tuple(replicas) if replicas is not None else (1,) * ranks
        if sum(reps) != ranks:
            raise ValueError("replicas %r place %d ranks, but there are %d"
                             % (reps, sum(reps), ranks))
        return one_f_one_b(len(reps), microbatches * batches, replicas=reps,
                           vertical_sync=vertical_sync)
    if vertical_sync:
        raise ValueError("vertical_sync is a 1f1b option")
    if name == "gpipe":
        return gpipe(ranks, microbatches, batches)
    if name == "flush":
        return flush(ranks, microbatches, batches)
    if name == "2bw":
        return two_bw(ranks, microbatches, batches)
    return interleaved(ranks, microbatches, chunks, batches)


class PipelineModel:
    """This rank's part of a pipeline-parallel model. Collective to build (over comm, default
    COMM_WORLD: one rank per schedule rank).

    layers: nn.Sequential or a list of modules (the whole model, built alike on every rank).
    schedule: a Schedule, or a name for make_schedule (then `microbatches`, and `chunks` for
        interleaved; replicas come from `partition` if given).
    loss_fn(output, target) -> scalar tensor; the batch loss is the mean over microbatches.
    optimizer: a factory, params -> torch optimizer, called with this rank's trainable params.
    boundaries / partition: where the cuts go (split_layers).

    Attributes: schedule, stage, replica, modules (this rank's pieces, chunk order), optimizer,
    executor (its counters: live_versions, peak_versions, stashed, peak_stash, versions_used)."""

    def __init__(self, layers, *, schedule, loss_fn, optimizer, boundaries=None, partition=None,
                 comm=None, microbatches=None, chunks=1):
        from mpi4py import MPI

        from .executor import PipelineExecutor
        comm = MPI.COMM_WORLD if comm is None else comm
        if isinstance(schedule, str):
            if microbatches is None:
                raise ValueError("schedule=%r by name needs microbatches=" % schedule)
            reps = None
            if partition is not None and schedule == "1f1b":
                reps = tuple(st.replicas for st in partition.stages)
            schedule = make_schedule(schedule, comm.Get_size(), microbatches, chunks,
                                     replicas=reps)
        if not isinstance(schedule, Schedule):
            raise ValueError("schedule must be a Schedule or one of %s, got %r"
                             % (", ".join(SCHEDULES), schedule))
        if partition is not None:
            if not isinstance(partition, Partition):
                raise ValueError("partition must be a mlfabric.pipeline.partition.Partition, got "
                                 "%r" % (type(partition).__name__,))
            reps = tuple(st.replicas for st in partition.stages)
            if schedule.v != 1 or reps != tuple(schedule.replicas):
                raise ValueError("the partition has %d stages with replicas %r, the schedule %d "
                                 "stages (v=%d) with replicas %r: they must agree"
                                 % (len(reps), reps, schedule.p, schedule.v,
                                    tuple(schedule.replicas)))
        if not callable(optimizer):
            raise ValueError("optimizer must be a factory: params -> torch optimizer")
        pieces = split_layers(layers, schedule.pieces, boundaries, partition)
        sizes = [len(pc) for pc in pieces]
        agree_on = (("the number of layers", sum(sizes), None),
                    ("the cuts (the first layer of each piece after the first)",
                     [sum(sizes[:i]) for i in range(1, len(sizes))], None),
                    ("the layers", [layer_signature(m) for pc in pieces for m in pc], "layer"))
        self.schedule = schedule
        self.rank = comm.Get_rank()
        self.stage = schedule.placement[self.rank].stage
        self.replica = schedule.placement[self.rank].replica
        self.modules = stage_modules(pieces, schedule, self.rank)
        params = [prm for m in self.modules for prm in m.parameters() if prm.requires_grad]
        self.optimizer = optimizer(params) if params else None
        self.executor = PipelineExecutor(schedule, self.modules, loss_fn, self.optimizer, comm,
                                         agree_on=agree_on)
        self.is_first = 0 in self.executor.pieces
        self.is_last = self.executor.last_piece in self.executor.pieces

    def parameters(self):
        """This rank's trainable parameters (all its chunks)."""
        return [prm for m in self.modules for prm in m.parameters() if prm.requires_grad]

    def train_step(self, inputs, targets):
        """Run the schedule once over one batch per schedule batch: inputs and targets (tensors
        or numpy arrays, samples along axis 0) are cut into schedule.microbatches microbatches
        (torch.tensor_split: sizes differ by at most one), or given already cut as a list of
        that many. Only stage 0 uses inputs and only the last stage targets (None elsewhere).
        Returns the mean microbatch loss on the last stage (over all its replicas), None
        elsewhere. Collective over the communicator."""
        n = self.schedule.microbatches
        xs = _microbatches(inputs, n, "inputs") if self.is_first else None
        ys = _microbatches(targets, n, "targets") if self.is_last else None
        losses = self.executor.run(xs, ys)
        if not self.is_last:
            return None
        total, count = self.executor.replica_sum([sum(losses.values()), len(losses)])
        return float(total / count) if count else float("nan")


def layer_signature(module):
    """What must match across ranks about one layer: its class, its submodules' classes and its
    parameters' and buffers' names, shapes and dtypes (frozen parameters marked), as a short
    string, e.g. "Sequential[Linear, Tanh](0.weight 6x5 float64, 0.bias 6 float64)"."""
    subs = [type(m).__name__ for m in module.modules()][1:]
    out = type(module).__name__ + ("[%s]" % ", ".join(subs) if subs else "")
    tensors = ["%s %s%s" % (n, _tensor_signature(t), "" if t.requires_grad else " frozen")
               for n, t in module.named_parameters()]
    tensors += ["%s %s buffer" % (n, _tensor_signature(t)) for n, t in module.named_buffers()]
    return out + "(%s)" % ", ".join(tensors)


def _tensor_signature(t):
    if isinstance(t, torch.nn.parameter.UninitializedTensorMixin):  # a lazy module's
        return "uninitialized"
    return "%s %s" % ("x".join(str(d) for d in t.shape) or "scalar",
                      str(t.dtype).replace("torch.", ""))


def _microbatches(data, n, what):
    if data is None:
        return None  # the executor says which rank needed it
    if isinstance(data, (list, tuple)):
        return list(data) if len(data) == n else data
    if not isinstance(data, torch.Tensor):
        data = torch.as_tensor(data)
    if data.dim() == 0 or data.shape[0] < n:
        raise ValueError("%s: cannot cut %s samples into %d microbatches"
                         % (what, "no" if data.dim() == 0 else data.shape[0], n))
    return list(torch.tensor_split(data, n))


def _as_layers(layers):
    if isinstance(layers, torch.nn.Sequential):
        layers = list(layers)
    elif isinstance(layers, (list, tuple)):
        layers = list(layers)
    else:
        raise ValueError("layers must be an nn.Sequential or a list of modules, got %r"
                         % (type(layers).__name__,))
    if not layers or not all(isinstance(m, torch.nn.Module) for m in layers):
        raise ValueError("layers must be a non-empty list of torch modules")
    return layers


def _partition_boundaries(partition, n, pieces):
    if not isinstance(partition, Partition):
        raise ValueError("partition must be a mlfabric.pipeline.partition.Partition, got %r"
                         % (type(partition).__name__,))
    stages = partition.stages
    if len(stages) != pieces:
        raise ValueError("the partition has %d stages, the schedule %d pieces"
                         % (len(stages), pieces))
    expect = 0
    for st in stages:
        if st.first_layer != expect or st.last_layer < st.first_layer:
            raise ValueError("the partition's stages must cover layers 0..%d in order, got %r"
                             % (n - 1, [(s.first_layer, s.last_layer) for s in stages]))
        expect = st.last_layer + 1
    if expect != n:
        raise ValueError("the partition covers layers 0..%d, the model has %d layers"
                         % (expect - 1, n))
    return [st.first_layer for st in stages[1:]]
