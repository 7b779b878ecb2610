"""KAPC: personalised FL through a learned layer-wise relationship cube R, with BLS.

Source: the KAPC + BLS paper (IEEE TMC 2024), Algorithms 1–5. `KapcRule`, for
`process.build_personalized_process`, follows Algorithm 5 by default: the participants' slice of
R `[N, L, N]`, rows renormalised, takes E_r steps on Eq. (11) (`update_relationship`) over the
server's model copies; s_i (clients train towards it, μ = 2λ) and BLS's skip mask come from the
stepped slice, which is written back into R. Step order, initial R, hyperparameters and our
reading where the paper is silent: docs/methods/personalised.md.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Optional

import gin
import tensorflow as tf

from fltff.config_checks import check_choice
from fltff.config_checks import check_number
from fltff.errors import ConfigError
from fltff.learning.model_spec import ModelSpec
from fltff.personalization import bls
from fltff.personalization import process as process_lib
from fltff.personalization.process import normalize_rows
from fltff.personalization.process import project_rows_to_simplex
from fltff.personalization.process import scatter_relationship
from fltff.personalization.process import select_by_layer
from fltff.personalization.process import slice_relationship

# When R takes its E_r steps: before s_i is sent (Algorithm 5) or after training (our alternative).
RELATIONSHIP_UPDATES = ('before_send', 'after_training')
# f_s of the R step (Eqs. (6), (11)): the L2 norm (§4.2) or its square (our alternative reading).
COACHING_LOSSES = ('norm', 'squared')
# How each R step returns its rows to the simplex (the paper only requires rows on it, Eq. (12)):
# clip at 0 and renormalise (ours, the default) or the Euclidean projection.
RELATIONSHIP_PROJECTIONS = {'renormalize': normalize_rows, 'simplex': project_rows_to_simplex}


def layer_grams(models: Sequence[tf.Tensor], layer_of: Sequence[int]) -> tf.Tensor:
  """`G[:, l, :] = Σ_{t∈l} W_t W_tᵀ` (`[P, L, P]`): all the squared-loss R step needs of W."""
  flats = [tf.reshape(w, [tf.shape(w)[0], -1]) for w in models]
  return tf.stack([tf.add_n([tf.matmul(f, f, transpose_b=True)
                             for f, l in zip(flats, layer_of) if l == layer])
                   for layer in range(max(layer_of) + 1)], axis=1)


def relationship_gradient(relation: tf.Tensor, grams: tf.Tensor, lambda_: float,
                          beta: float) -> tf.Tensor:
  """∂/∂R of the 'squared' objective per layer: `2λ (R G − G) + β (R − 1/P)`, G = `layer_grams`."""
  num = tf.cast(tf.shape(relation)[-1], relation.dtype)
  fit = tf.einsum('ilk,klj->ilj', relation, grams) - grams
  return 2.0 * lambda_ * fit + beta * (relation - 1.0 / num)


def relationship_gradient_norm(relation: tf.Tensor, models: Sequence[tf.Tensor],
                               layer_of: Sequence[int], lambda_: float,
                               beta: float) -> tf.Tensor:
  """∂/∂R of the 'norm' objective (Eqs. (12)–(13), f_s the L2 norm of §4.2).

  With d_i^l = s_i^l − w_i^l: `∂/∂r_ij^l = λ <d_i^l, w_j^l> / ||d_i^l|| + β (r_ij^l − 1/P)`. At
  d_i^l = 0 (e.g. round 1, all copies initial) the fit term takes its minimum-norm subgradient 0
  (ours: the paper is silent). d is formed from models centred on the first participant's
  (`c_j = w_j − w_0`; equal since rows sum to 1), so identical models give exactly d = 0, not
  rounding noise of arbitrary direction that the quotient would scale to ||w^l||.
  """
  num_layers = max(layer_of) + 1
  inner = [0.0] * num_layers   # Per layer: <d_i, w_j>, [P, P].
  squares = [0.0] * num_layers  # Per layer: ||d_i||², [P].
  for w, layer in zip(models, layer_of):
    flat = tf.reshape(w, [tf.shape(w)[0], -1])
    centred = flat - flat[:1]
    d = tf.matmul(relation[:, layer, :], centred) - centred
    inner[layer] += tf.matmul(d, flat, transpose_b=True)
    squares[layer] += tf.reduce_sum(tf.square(d), axis=1)
  inner = tf.stack(inner, axis=1)                                    # [P, L, P]
  norm = tf.sqrt(tf.stack(squares, axis=1))[:, :, None]              # [P, L, 1]
  fit = tf.where(norm > 0, inner / tf.where(norm > 0, norm, 1.0), 0.0)
  num = tf.cast(tf.shape(relation)[-1], relation.dtype)
  return lambda_ * fit + beta * (relation - 1.0 / num)


def update_relationship(relation: tf.Tensor, models: Sequence[tf.Tensor],
                        layer_of: Sequence[int], lambda_: float, beta: float,
                        learning_rate: float, steps: int,
                        coaching_loss: str = 'norm',
                        projection: str = 'renormalize') -> tf.Tensor:
  """E_r gradient steps (Eq. (12), Algorithm 1 lines 4–6), each followed by
  `RELATIONSHIP_PROJECTIONS[projection]` (clip-and-renormalise or the Euclidean projection).

  `'norm'`: `relationship_gradient_norm` (two `[P, P] × [P, d]` products per step); `'squared'`:
  the closed form on inner products computed once, `O(P³ L)` per step instead of `O(P² d)`.
  """
  if coaching_loss == 'squared':
    grams = layer_grams(models, layer_of)
    gradient = lambda r: relationship_gradient(r, grams, lambda_, beta)
  else:
    gradient = lambda r: relationship_gradient_norm(r, models, layer_of, lambda_, beta)
  back_to_simplex = RELATIONSHIP_PROJECTIONS[projection]
  for _ in range(steps):
    relation = back_to_simplex(relation - learning_rate * gradient(relation))
  return relation


@dataclasses.dataclass(frozen=True)
class KapcRule(process_lib.RelationRule):
  """KAPC's rule: R learned by E_r projected steps (Eq. (12)) in the order of Algorithm 5.

  Defaults: random initial R (§4.4), f_s the L2 norm (§4.2), λ = 1, β = 0.005 (the point the two
  sweeps of the §7.3.1 ablation at α = 0.1 share; gin_configs/kapc/kapc_dir0.1_common.gin).
  `start_from='server'` is not KAPC: it lets tests read s_i back from the clients. BLS is its
  `layer_selection` (`bls.BidirectionalSelection`).
  """
  name = 'kapc'
  lambda_: float = 1.0
  beta: float = 0.005
  relationship_learning_rate: float = 0.01
  relationship_steps: int = 1
  relationship_update: str = 'before_send'
  coaching_loss: str = 'norm'
  relationship_projection: str = 'renormalize'
  relationship_init: str = 'random'

  def check(self, name: str) -> None:
    check_choice(f'{name}.relationship_update', self.relationship_update, RELATIONSHIP_UPDATES)
    check_choice(f'{name}.coaching_loss', self.coaching_loss, COACHING_LOSSES)
    check_choice(f'{name}.relationship_projection', self.relationship_projection,
                 tuple(RELATIONSHIP_PROJECTIONS))
    for label in ('beta', 'relationship_learning_rate', 'relationship_steps'):
      check_number(f'{name}.{label}', getattr(self, label), low=0,
                   integer=label == 'relationship_steps')

  def _step(self, relation, models, context):
    return update_relationship(relation, models, context.layer_of, self.lambda_, self.beta,
                               self.relationship_learning_rate, self.relationship_steps,
                               self.coaching_loss, self.relationship_projection)

  def relation(self, state, server_input, context):
    rel = normalize_rows(slice_relationship(state['relation'], server_input['clients']))
    if self.relationship_update != 'before_send':
      return rel, {}
    # Algorithm 5: step on the server's copies (the clients' last uploads, stale layers filled).
    stepped = self._step(rel, list(server_input['models']), context)
    return stepped, {'relation': stepped}  # `server_update` writes the stepped slice back.

  def server_update(self, state, server_input, server_msg, trained, uploaded, context):
    clients = server_input['clients']
    relation = state['relation']
    if self.relationship_update == 'before_send':
      # Fresh uploads only become next round's copies (`next_client_states`): no second step.
      relation = scatter_relationship(relation, clients, server_msg['relation'])
    else:
      # The fresh uploads, layers not uploaded filled with the stale copies.
      models = select_by_layer([uploaded[:, l] for l in context.layer_of], trained,
                               list(server_input['models']))
      current = normalize_rows(slice_relationship(relation, clients))
      relation = scatter_relationship(relation, clients, self._step(current, models, context))
    return collections.OrderedDict(relation=relation)


@gin.configurable('kapc')
def build_kapc(model_spec: ModelSpec, num_clients: int, client_optimizer=None,
               lambda_: float = 1.0, beta: float = 0.005,
               relationship_learning_rate: float = 0.01, relationship_steps: int = 1,
               bls_mu: Optional[float] = None, min_upload_layers: int = 1,
               relationship_update: str = 'before_send', coaching_loss: str = 'norm',
               relationship_projection: str = 'renormalize',
               relationship_init: str = 'random',
               relationship_seed: int = 0) -> process_lib.PersonalizedAlgorithm:
  """KAPC; with `bls_mu` set, KAPC+BLS (μ = bls_mu).

  `relationship_update`, `coaching_loss`, `relationship_projection`: see
  `RELATIONSHIP_UPDATES`, `COACHING_LOSSES`, `RELATIONSHIP_PROJECTIONS`;
  `relationship_init`: 'random' (§4.4, seeded by `relationship_seed`), 'uniform' or 'identity'.
  """
  if bls_mu is None and min_upload_layers != 1:
    raise ConfigError('kapc.min_upload_layers applies to KAPC+BLS only: set kapc.bls_mu too.')
  rule = KapcRule(lambda_=lambda_, beta=beta,
                  relationship_learning_rate=relationship_learning_rate,
                  relationship_steps=relationship_steps, relationship_update=relationship_update,
                  coaching_loss=coaching_loss, relationship_projection=relationship_projection,
                  relationship_init=relationship_init, relationship_seed=relationship_seed,
                  layer_selection=process_lib.ALL_LAYERS if bls_mu is None else
                  bls.BidirectionalSelection(bls_mu, min_upload_layers))
  return process_lib.build_personalized_process(model_spec, num_clients, client_optimizer, rule)
