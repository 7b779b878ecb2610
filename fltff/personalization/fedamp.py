"""FedAMP (Huang et al., AAAI 2021): attentive message passing between participants' models.

Paper: "Personalized Cross-Silo Federated Learning on Non-IID Data". The personalised round's
slice is FedAMP's weights, recomputed each round from the server's copies (whole-model
distances, the same for every layer); clients continue their own model with the proximal term
λ Σ_l ||w^l − s_i^l||² towards s_i.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import gin
import tensorflow as tf

from fltff.config_checks import check_number
from fltff.learning.model_spec import ModelSpec
from fltff.personalization import process as process_lib
from fltff.personalization.process import normalize_rows


def attentive_relationship(models: Sequence[tf.Tensor], num_layers: int, sigma: float,
                           alpha: float) -> tf.Tensor:
  """FedAMP's message-passing weights (eq. (8)) as a `[P, L, P]` slice, equal for every layer.

  `ξ_ij = α A'(||w_i − w_j||²)` with `A(x) = 1 − exp(−x/σ)` for j ≠ i, `ξ_ii = 1 − Σ_{j≠i} ξ_ij`;
  rows projected onto the simplex."""
  flat = tf.concat([tf.reshape(w, [tf.shape(w)[0], -1]) for w in models], axis=1)
  # Centring (distances are translation-invariant) keeps ||a||² + ||b||² − 2ab from cancelling:
  # close models (early rounds) would get float32 rounding noise of ||w||², varying by executor.
  flat = flat - tf.reduce_mean(flat, axis=0, keepdims=True)
  sq = tf.reduce_sum(flat * flat, axis=1)
  dist = tf.maximum(sq[:, None] + sq[None, :] - 2.0 * tf.matmul(flat, flat, transpose_b=True),
                    0.0)
  off = alpha * tf.exp(-dist / sigma) / sigma
  eye = tf.eye(tf.shape(flat)[0], dtype=flat.dtype)
  off = off * (1.0 - eye)
  xi = normalize_rows(off + eye * (1.0 - tf.reduce_sum(off, axis=1, keepdims=True)))
  return tf.tile(xi[:, None, :], [1, num_layers, 1])


@dataclasses.dataclass(frozen=True)
class AttentiveRelation(process_lib.RelationRule):
  """FedAMP's weights, recomputed each round; the state's R is empty (`[0, L, 0]`), not N-sized."""
  name = 'fedamp'
  lambda_: float = 0.5
  sigma: float = 1.0
  alpha: float = 0.1

  def check(self, name) -> None:
    for label in ('sigma', 'alpha'):  # α_k, σ > 0 (eq. (8); α = 0 would be local training).
      check_number(f'{name}.{label}', getattr(self, label), low=0, open_low=True)

  def initial_state(self, context):
    return collections.OrderedDict(relation=tf.zeros([0, context.num_layers, 0]))

  def relation(self, state, server_input, context):
    del state
    return attentive_relationship(list(server_input['models']), context.num_layers,
                                  self.sigma, self.alpha), {}


@gin.configurable('fedamp')
def build_fedamp(model_spec: ModelSpec, num_clients: int, client_optimizer=None,
                 lambda_: float = 0.5, sigma: float = 1.0,
                 alpha: float = 0.1) -> process_lib.PersonalizedAlgorithm:
  """FedAMP with proximal weight λ, attention scale σ and α_k."""
  return process_lib.build_personalized_process(
      model_spec, num_clients, client_optimizer,
      AttentiveRelation(lambda_=lambda_, sigma=sigma, alpha=alpha))
