"""SGDM / FedAvgM (Hsu et al., 2019): FedAvg with server-side momentum."""

from __future__ import annotations

import gin

from fltff.learning import optimizers
from fltff.learning.model_spec import ModelSpec
from fltff.learning.process import Algorithm
from fltff.learning.process import build_algorithm
from fltff.learning.process import contribution_normalization_options


@gin.configurable('sgdm')
def build_sgdm(model_spec: ModelSpec, server_learning_rate: float = 1.0,
               server_momentum: float = 0.9, client_optimizer=None,
               contribution_normalization: bool = False,
               temperature: float = 1.0) -> Algorithm:
  """Server momentum: `v ← β v + Δ^t`, `w^{t+1} = w^t − η_s v` with Δ^t the mean client delta."""
  return build_algorithm(
      'sgdm+ccn' if contribution_normalization else 'sgdm', model_spec,
      client_optimizer or optimizers.default_client_optimizer(),
      optimizers.build_optimizer('sgdm', server_learning_rate, server_momentum,
                                 role='sgdm.server_learning_rate'),
      **contribution_normalization_options(contribution_normalization, temperature))
