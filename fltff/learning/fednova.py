"""FedNova (Wang et al., "Tackling the Objective Inconsistency Problem in Heterogeneous
Federated Optimization", NeurIPS 2020): normalised averaging of client updates.

Each update is divided by its number of local steps τ_k and the mean rescaled by
τ_eff = Σ_k p_k τ_k (`fltff.aggregators.nova_aggregate`), so clients taking more steps do not
bias the objective; with equal τ it is exactly FedAvg (tested).
"""

from __future__ import annotations

import gin

from fltff.learning.model_spec import ModelSpec
from fltff.learning.process import Algorithm
from fltff.learning.process import build_averaging_method
from fltff.errors import ConfigError


@gin.configurable('fednova')
def build_fednova(model_spec: ModelSpec, client_optimizer=None,
                  server_learning_rate: float = 1.0, server_optimizer=None,
                  model_aggregator=None) -> Algorithm:
  """FedNova. Its normalised averaging is its aggregator: `model_aggregator` may only be None or
  `aggregators.contribution_normalization_factory(T)` (CCN's Λ on the weights p_k)."""
  from fltff.aggregators import contribution_normalization as ccn  # pylint: disable=g-import-not-at-top

  if not (model_aggregator is None or isinstance(model_aggregator, ccn.NormalizedMeanFactory)):
    raise ConfigError(f'fednova.model_aggregator must be CCN (@contribution_normalization()) '
                      f'or None: FedNova aggregates by normalised averaging, got '
                      f'{type(model_aggregator).__name__}.')
  # CCN's temperature is kept: `build_averaging_method` names it fednova+ccn.
  aggregator = ccn.NormalizedMeanFactory(getattr(model_aggregator, 'temperature', None),
                                         normalized_averaging=True)
  return build_averaging_method('fednova', model_spec, client_optimizer, server_optimizer,
                                server_learning_rate, aggregator)
