"""FedLap ("Lay Importance on the Layer: Federated Learning for Non-IID data with Layer-based
Regularization"): per-neuron regularisation of the local objective. Client k minimises

    h_k(W) = ℓ_k(W) + 1/2 Σ_l <λ_l, d_l>,
    λ_lj = 1 − cos(w_lj^local, w_lj^global) ∈ [0, 2],   d_lj = ||w_lj^local − w_lj^global||²,

over layers l and their rows (neurons) j (`fltff.models.to_rows`). λ gets no gradient and is
fixed within each local epoch, from the weights at its start (Algorithm 1; in epoch 1 λ = 0:
plain SGD), or recomputed before every step (`refresh='step'`).

Importance q ∈ [0, 1] (fltff's formula; the source's q is not reproduced literally) gives row
coefficients `c_lj = a(q) λ_lj + b(q) μ`, `a(q) = 1 − |2q − 1|`, `b(q) = max(0, 2q − 1)`, in the
term `1/2 Σ_lj c_lj d_lj`: q = 0 is exactly FedAvg (c ≡ 0), 1/2 FedLap's h_k (c = λ), 1 FedProx
with strength μ (c ≡ μ), linear in between.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Optional

import gin
import tensorflow as tf

from fltff.config_checks import check_choice
from fltff.config_checks import check_number
from fltff.learning import client_work as client_work_lib
from fltff.learning.model_spec import ModelSpec
from fltff.learning.process import Algorithm
from fltff.learning.process import build_averaging_method
from fltff.models.layers import row_cosine
from fltff.models.layers import row_squared_distance


def importance_coefficients(q: float) -> tuple[float, float]:
  """`(a(q), b(q))`: the weights of λ and of μ in each row's coefficient (module docstring)."""
  check_number('fedlap.q', q, low=0, high=1)
  return 1.0 - abs(2.0 * q - 1.0), max(0.0, 2.0 * q - 1.0)


def neuron_dissimilarities(local: Sequence[tf.Tensor],
                           global_: Sequence[tf.Tensor]) -> list[tf.Tensor]:
  """λ_lj = 1 − cos(w_lj^local, w_lj^global) per row of every tensor (zero rows: λ = 0)."""
  return [1.0 - row_cosine(w, g) for w, g in zip(local, global_)]


def neuron_distances(local: Sequence[tf.Tensor], global_: Sequence[tf.Tensor]) -> list[tf.Tensor]:
  """d_lj = ||w_lj^local − w_lj^global||² per row of every tensor."""
  return [row_squared_distance(w, g) for w, g in zip(local, global_)]


def fedlap_penalty(local: Sequence[tf.Tensor], global_: Sequence[tf.Tensor],
                   lambdas: Sequence[tf.Tensor], q: float, mu: float) -> tf.Tensor:
  """`1/2 Σ_lj c_lj(q) d_lj` with `c = a(q) λ + b(q) μ`; λ is treated as a constant."""
  a, b = importance_coefficients(q)
  return 0.5 * tf.add_n([tf.reduce_sum((a * tf.stop_gradient(lam) + b * mu) * d)
                         for lam, d in zip(lambdas, neuron_distances(local, global_))])


def coefficient_tensors(local: Sequence[tf.Tensor], lambdas: Sequence[tf.Tensor], q: float,
                        mu: float) -> list[tf.Tensor]:
  """`c_lj = a(q) λ_lj + b(q) μ` per row, shaped `[..., 1]` (scalar for a scalar weight) to
  broadcast against each weight: smaller than the weight, so less memory traffic per step."""
  a, b = importance_coefficients(q)
  out = []
  for w, lam in zip(local, lambdas):
    shape = tf.convert_to_tensor(w).shape
    coefficient = a * tf.stop_gradient(lam) + b * mu        # One per row of `to_rows(w)`.
    out.append(tf.reshape(coefficient, shape[:-1] + [1] if shape.rank else []))
  return out


def fedlap_gradient(local: Sequence[tf.Tensor], global_: Sequence[tf.Tensor],
                    lambdas: Sequence[tf.Tensor], q: float, mu: float) -> list[tf.Tensor]:
  """∂/∂w of `fedlap_penalty` with λ fixed: `c_lj (w_lj − w_lj^global)` for every row j."""
  return [c * (w - g) for c, w, g in
          zip(coefficient_tensors(local, lambdas, q, mu), local, global_)]


class FedLapRegularizer:
  """`LocalRegularizer` of FedLap, with per-layer λ and d measurements."""

  def __init__(self, q: float = 0.5, mu: float = 0.01, refresh: str = 'epoch',
               layers: Optional[Sequence[Sequence[int]]] = None,
               layer_names: Optional[Sequence[str]] = None):
    importance_coefficients(q)  # Validates q.
    check_number('fedlap.mu', mu, low=0)
    check_choice('fedlap.refresh', refresh, ('epoch', 'step'))
    self.q, self.mu, self.refresh = float(q), float(mu), refresh
    self.layers = None if layers is None else [list(g) for g in layers]
    self.layer_names = list(layer_names) if layer_names is not None else None

  def epoch_start(self, local, global_):
    """Context of an epoch: λ and the per-weight coefficients c(q) (both fixed within it)."""
    if self.refresh == 'step':
      return ()
    lambdas = tuple(neuron_dissimilarities(local, global_))
    return lambdas, tuple(coefficient_tensors(local, lambdas, self.q, self.mu))

  def penalty(self, local, global_, context):
    lambdas = context[0] if self.refresh == 'epoch' else neuron_dissimilarities(
        [tf.convert_to_tensor(v) for v in local], global_)
    return fedlap_penalty(local, global_, lambdas, self.q, self.mu)

  def gradient(self, local, global_, context):
    if self.refresh == 'epoch':
      # The coefficients are fixed within the epoch: one multiply per weight per step.
      return [c * (w - g) for c, w, g in zip(context[1], local, global_)]
    return fedlap_gradient(local, global_, neuron_dissimilarities(local, global_), self.q,
                           self.mu)

  @property
  def traits(self) -> client_work_lib.RegularizerTraits:
    """Closed-form; with λ fixed per epoch also affine, `c ⊙ (w − w_global)` (per step, λ
    follows the weights: not affine)."""
    per_epoch = self.refresh == 'epoch'
    return client_work_lib.RegularizerTraits(
        analytic=True, affine=per_epoch, global_anchor=per_epoch, measures=True)

  def affine_gradient(self, global_, context):
    """With λ fixed per epoch the gradient is `c ⊙ w − c ⊙ w_global` (`traits.affine`)."""
    return list(context[1]), [-c * g for c, g in zip(context[1], global_)]

  def measurements(self, local, global_):
    """Per layer: mean λ and mean d over its rows, between the trained and the global model."""
    lambdas = neuron_dissimilarities(local, global_)
    distances = neuron_distances(local, global_)
    layers = self.layers or [[i] for i in range(len(lambdas))]
    names = self.layer_names or [f'layer{l}' for l in range(len(layers))]
    lam_mean, d_mean = collections.OrderedDict(), collections.OrderedDict()
    for name, group in zip(names, layers):
      lam_mean[name] = tf.reduce_mean(tf.concat([lambdas[i] for i in group], 0))
      d_mean[name] = tf.reduce_mean(tf.concat([distances[i] for i in group], 0))
    return collections.OrderedDict(lambda_mean=lam_mean, distance_mean=d_mean)


@gin.configurable('fedlap')
def build_fedlap(model_spec: ModelSpec, q: float = 0.5, mu: float = 0.01,
                 refresh: str = 'epoch', client_optimizer=None,
                 server_learning_rate: float = 1.0, server_optimizer=None,
                 model_aggregator=None,
                 client_weighting: str = 'num_examples') -> Algorithm:
  """FedLap: FedAvg with the layer-based regulariser of importance q (module docstring).

  Args:
    q: Importance in [0, 1]: 0 FedAvg, 0.5 FedLap (the papers' setting), 1 FedProx(μ).
    mu: FedProx strength reached at q = 1.
    refresh: 'epoch' (Algorithm 1: λ fixed within each local epoch) or 'step'.
    client_weighting: 'uniform' is the paper's unweighted mean.
  """
  layers, names = model_spec.trainable_layers()
  return build_averaging_method(
      'fedlap', model_spec, client_optimizer, server_optimizer, server_learning_rate,
      model_aggregator, regularizer=FedLapRegularizer(q, mu, refresh, layers, names),
      client_weighting=client_weighting)
