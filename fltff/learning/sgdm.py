"""SGDM / FedAvgM (Hsu et al., 2019): FedAvg with server-side momentum."""

from __future__ import annotations

import gin

from fltff.learning import optimizers
from fltff.learning.model_spec import ModelSpec
from fltff.learning.process import Algorithm
from fltff.learning.process import build_averaging_method


@gin.configurable('sgdm')
def build_sgdm(model_spec: ModelSpec, server_learning_rate: float = 1.0,
               server_momentum: float = 0.9, client_optimizer=None,
               model_aggregator=None) -> Algorithm:
  """Server momentum: `v ← β v + Δ^t`, `w^{t+1} = w^t − η_s v` with Δ^t the mean client delta."""
  server_sgdm = optimizers.build_optimizer('sgdm', server_learning_rate, server_momentum,
                                           role='sgdm.server_learning_rate')
  return build_averaging_method('sgdm', model_spec, client_optimizer, server_sgdm, 1.0,
                                model_aggregator)
