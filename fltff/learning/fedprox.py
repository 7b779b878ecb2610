"""FedProx (Li et al., MLSys 2020): FedAvg with a proximal term in the local objective."""

from __future__ import annotations

import gin

from fltff.learning.model_spec import ModelSpec
from fltff.learning.process import Algorithm
from fltff.learning.process import build_averaging_method
from fltff.learning.regularizers import ProximalRegularizer


@gin.configurable('fedprox')
def build_fedprox(model_spec: ModelSpec, mu: float = 0.01, client_optimizer=None,
                  server_learning_rate: float = 1.0, server_optimizer=None,
                  model_aggregator=None, client_weighting: str = 'num_examples') -> Algorithm:
  """FedProx: clients minimise `F_k(w) + μ/2 ||w − w^t||²` (eq. (2)); server averages as FedAvg.

  The server weights client k by n_k/n; the paper's unweighted mean (Algorithm 2) is
  `client_weighting='uniform'`. Unlike TFF 0.87's `build_weighted_fed_prox`, the proximal
  gradient has the right sign. μ = 0 is exactly `fedavg` (same `client_weighting`).
  """
  return build_averaging_method(
      'fedprox', model_spec, client_optimizer, server_optimizer, server_learning_rate,
      model_aggregator, regularizer=ProximalRegularizer(mu, setting='fedprox.mu'),
      client_weighting=client_weighting)
