"""FedNova (Wang et al., "Tackling the Objective Inconsistency Problem in Heterogeneous
Federated Optimization", NeurIPS 2020): normalised averaging of client updates.

Clients that take more local steps (more data, more epochs, stragglers doing fewer) would bias
FedAvg towards their own objective; FedNova divides each update by its number of local steps
τ_k and rescales the mean by τ_eff = Σ_k p_k τ_k (`fltff.aggregators.nova_aggregate`). With
equal τ it is exactly FedAvg (tested).
"""

from __future__ import annotations

import gin

from fltff.learning import optimizers
from fltff.learning.model_spec import ModelSpec
from fltff.learning.process import Algorithm
from fltff.learning.process import build_algorithm
from fltff.learning.process import contribution_normalization_options


@gin.configurable('fednova')
def build_fednova(model_spec: ModelSpec, client_optimizer=None,
                  server_learning_rate: float = 1.0, server_optimizer=None,
                  contribution_normalization: bool = False,
                  temperature: float = 1.0) -> Algorithm:
  """FedNova; `contribution_normalization=True` also applies CCN's Λ to the weights p_k."""
  return build_algorithm(
      'fednova+ccn' if contribution_normalization else 'fednova', model_spec,
      client_optimizer or optimizers.default_client_optimizer(),
      optimizers.server_sgd(server_optimizer, server_learning_rate, 'fednova'),
      **contribution_normalization_options(contribution_normalization, temperature,
                                           normalized_averaging=True))
