"""mlfabric.workloads: the training workloads the trainers drive (paper §7) - image classifiers
(the small stand-ins for ResNet on ImageNet), LDA by collapsed Gibbs sampling, and matrix
factorisation. Single process; the parameter-server and allreduce trainers move their models.

Every workload keeps its model as ONE flat numpy vector and has the same shape:
    w.size            the model's length
    w.model0()        the seeded initial model (a new array)
    w.step(model)     the update (delta to ADD to the model) from this worker's next minibatch
                      (LDA: one Gibbs sweep over its documents), computed at `model`
plus a metric: Classifier.accuracy, lda.log_likelihood / lda.topic_recovery, mf.rmse. So
`update_fn = lambda rank, i, model: worker.step(model)` plugs into mlfabric.ps.driver.run_job.

Modules: data (digits, synthetic blobs, shard, batches), models (torch models and flat
parameters; torch imported on use), lda, mf. Optional dependencies, imported on use:
scikit-learn (digits), torch (models), scipy (LDA metrics).
"""
from . import data, lda, mf, models
from .data import batches, digits, shard, synthetic_classification
from .lda import LdaConfig, LdaWorker, generate_corpus
from .mf import Entries, MfWorker, low_rank_problem
from .models import Classifier, build, flat_grads, flat_params, set_flat_params

__all__ = ["data", "models", "lda", "mf", "digits", "synthetic_classification", "shard",
           "batches", "build", "flat_params", "set_flat_params", "flat_grads", "Classifier",
           "LdaConfig", "LdaWorker", "generate_corpus", "Entries", "MfWorker",
           "low_rank_problem"]
