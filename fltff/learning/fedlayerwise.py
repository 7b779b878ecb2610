"""FedLayerWise ("Layer-Wise Adaptive Weighting for Faster Convergence in Federated Learning")
and FedAdp: FedAvg whose server weights each client's layers (FedAdp: whole update) by its
gradient angle. Per layer l and client k, ψ_k,l comes from the smoothed angle between the
client's and the global gradient (eqs. (1)-(6)); the new layer is the ψ-weighted mean of the
clients' updated layers (eq. (7)). The rule: `fltff.aggregators.layerwise_adaptive_factory`.
"""

from __future__ import annotations

import gin

from fltff.aggregators import adaptive_weighting
from fltff.learning.model_spec import ModelSpec
from fltff.learning.process import Algorithm
from fltff.learning.process import build_averaging_method


@gin.configurable('fedlayerwise')
def build_fedlayerwise(model_spec: ModelSpec, num_clients: int, alpha: float = 5.0,
                       client_optimizer=None, server_optimizer=None) -> Algorithm:
  """FedLayerWise with Gompertz α (paper: 5); `num_clients` sizes the per-client angle state."""
  return build_averaging_method(
      'fedlayerwise', model_spec, client_optimizer, server_optimizer, 1.0,
      adaptive_weighting.layerwise_adaptive_factory(
          model_spec.trainable_layers()[0], num_clients=num_clients, alpha=alpha),
      num_clients=num_clients)


@gin.configurable('fedadp')
def build_fedadp(model_spec: ModelSpec, num_clients: int, alpha: float = 5.0,
                 client_optimizer=None, server_optimizer=None) -> Algorithm:
  """FedAdp (Wu & Wang, 2021): one adaptive weight per client from the whole-model angle."""
  num_tensors = sum(len(g) for g in model_spec.trainable_layers()[0])
  return build_averaging_method(
      'fedadp', model_spec, client_optimizer, server_optimizer, 1.0,
      adaptive_weighting.fedadp_factory(num_tensors, num_clients=num_clients, alpha=alpha),
      num_clients=num_clients)
