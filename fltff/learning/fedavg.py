"""FedAvg (McMahan et al., AISTATS 2017): local SGD, sample-weighted mean of the models."""

from __future__ import annotations

import gin

from fltff.learning.model_spec import ModelSpec
from fltff.learning.process import Algorithm
from fltff.learning.process import build_averaging_method


@gin.configurable('fedavg')
def build_fedavg(model_spec: ModelSpec, client_optimizer=None,
                 server_learning_rate: float = 1.0, server_optimizer=None,
                 model_aggregator=None, client_weighting: str = 'num_examples') -> Algorithm:
  """FedAvg: `w^{t+1} = w^t − η_s Σ_k (n_k/n) (w^t − w_k^{t+1})` with η_s = 1 by default.

  Equals `tff.learning.algorithms.build_weighted_fed_avg` for the same client optimizer, or
  with `client_weighting='uniform'` `build_unweighted_fed_avg`; CCN's `model_aggregator`
  reweights either mean by Λ.
  """
  return build_averaging_method(
      'fedavg', model_spec, client_optimizer, server_optimizer, server_learning_rate,
      model_aggregator, client_weighting=client_weighting)
