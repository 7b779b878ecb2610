"""Client work and process builders, one module per method.

`build_<method>` (in `<method>.py`, gin name `<method>`) takes a `ModelSpec` and its optimizers
as arguments (none reads gin) and returns an `Algorithm`: a TFF learning process plus its
per-client communication sizes. Shared arguments:

- `client_optimizer`: None means `optimizers.default_client_optimizer()`; it must be a
  `tff.learning.optimizers.Optimizer`.
- `server_learning_rate`: η_s of the server SGD on the mean delta (1: plain averaging);
  `server_optimizer` (a `tff.learning.optimizers.Optimizer` too) replaces that SGD (then
  leave η_s at 1). An optimizer of another kind is refused when the method is built.
- `model_aggregator` (FedAvg family): any TFF weighted aggregation factory (default the
  weighted mean), e.g. CCN's `aggregators.contribution_normalization_factory(T)`.
- `client_weighting`: 'num_examples' (n_k/n, default) or 'uniform' (1/|S_t|).
- `num_clients`: the total number of clients (passed by `fltff.simulation.experiment`).
"""

from fltff.learning.client_work import CLIENT_INFO_SPEC
from fltff.learning.client_work import ClientStatistic
from fltff.learning.client_work import LocalRegularizer
from fltff.learning.client_work import RegularizerTraits
from fltff.learning.client_work import StepObserver
from fltff.learning.client_work import build_client_work
from fltff.learning.client_work import build_local_training
from fltff.learning.client_work import build_local_update
from fltff.learning.client_work import client_input
from fltff.learning.fedavg import build_fedavg
from fltff.learning.fedbabu import build_fedbabu
from fltff.learning.fedlap import FedLapRegularizer
from fltff.learning.fedlap import build_fedlap
from fltff.learning.fedlap import fedlap_penalty
from fltff.learning.fedlap import importance_coefficients
from fltff.learning.fedlap import neuron_dissimilarities
from fltff.learning.fedlap import neuron_distances
from fltff.learning.fedlayerwise import build_fedadp
from fltff.learning.fedlayerwise import build_fedlayerwise
from fltff.learning.fednova import build_fednova
from fltff.learning.fedprox import build_fedprox
from fltff.learning.model_spec import ModelSpec
from fltff.learning.model_spec import type_num_bytes
from fltff.learning.moon import model_contrastive_loss
from fltff.learning.moon import build_moon
from fltff.learning.optimizers import client_optimizer
from fltff.learning.optimizers import server_optimizer
from fltff.learning.process import Algorithm
from fltff.learning.process import build_algorithm
from fltff.learning.regularizers import ProximalRegularizer
from fltff.learning.regularizers import proximal_penalty
from fltff.learning.scaffold import build_scaffold
from fltff.learning.sgdm import build_sgdm

__all__ = [
    'Algorithm',
    'build_algorithm',
    'build_client_work',
    'build_fedadp',
    'build_fedavg',
    'build_fedbabu',
    'build_fedlap',
    'build_fedlayerwise',
    'build_fednova',
    'build_fedprox',
    'build_local_training',
    'build_local_update',
    'build_moon',
    'build_scaffold',
    'build_sgdm',
    'CLIENT_INFO_SPEC',
    'ClientStatistic',
    'client_input',
    'client_optimizer',
    'fedlap_penalty',
    'FedLapRegularizer',
    'importance_coefficients',
    'LocalRegularizer',
    'model_contrastive_loss',
    'ModelSpec',
    'neuron_dissimilarities',
    'neuron_distances',
    'proximal_penalty',
    'ProximalRegularizer',
    'RegularizerTraits',
    'server_optimizer',
    'StepObserver',
    'type_num_bytes',
]
