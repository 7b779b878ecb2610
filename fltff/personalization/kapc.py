"""KAPC: personalised FL through a learned layer-wise relationship cube, with BLS.

Source: "Communication-Efficient Personalized Federated Learning ..." (KAPC + BLS, IEEE TMC
2024), Algorithms 1–5. The server holds R ∈ ℝ^{N×L×N} (each row r_i^l a distribution over
clients) and the latest model it received from every client (stale layers fill what was not
uploaded). Per round, for the participants P (default order, `relationship_update=
'before_send'`, Algorithm 5):

1. slice R to P and renormalise the rows on the slice;
2. the server's copies of the participants' models (`server_input['models']`) are the models
   each uploaded the last time it took part, with the layers it did not upload filled with the
   latest older copies (stale layers; a client that never took part: the initial model). On
   these copies the server takes E_r gradient steps with learning rate η_r on
   `λ Σ_l ||s_i^l(R) − w_i^l||² + β/2 Σ_l ||r_i^l − 1/|P| ||²` for every participant
   (`update_relationship`, Algorithm 2), projecting the rows back onto the simplex
   (`normalize_rows`: clip at 0, renormalise) after each step;
3. from that stepped slice R': personalised server models `s_i^l = Σ_{j∈P} r'_ij^l w_j^l`
   (`personalized_server_models`); BLS (Algorithm 3) skips layer l of client i when
   `r'_ii^l > μ`;
4. client i trains its own model w_i for E epochs on `f_i(w) + λ Σ_l ||w^l − s_i^l||²` (no
   term for skipped layers; `regularizers.ProximalRegularizer` with μ = 2λ, anchored at s_i)
   and uploads its first Ω_i layers (Algorithm 4, `bls.py`);
5. the server writes R' back into R scaled by the slice's previous mass, so rows of the whole
   cube stay normalised, and stores the uploaded layers as its new copies (the rest keep the
   stale copy): they are the models the next R step of these clients uses, not used for a
   second step in this round.

`relationship_update='after_training'` keeps fltff's earlier order: s_i and the skip mask from
the un-stepped slice (step 3 before step 2), and the E_r steps after training, on the freshly
uploaded layers filled with the stale copies, in step 5.

Assumptions (the paper's text is our only source for these and we state our reading): the
uniform target of the β term is 1/|P| on the slice (1/N with full participation); the
projection after each R step is clip-and-renormalise; R starts uniform.

The round itself is `process.build_personalized_process`; this module is KAPC's rule
(`KapcRule`: R in the server state, its E_r steps, writing it back). The personalised
baselines are rules of their own: `local.py`, `fedamp.py`, `fedbn.py`, `pfedla.py`.

BLS on the client (Algorithm 4, `bls.select_omega_tf`): τ^l = ||w_i^l − s_i^l||_F with, for a
layer the server skipped this round, the client's own model at the round's start in place of
s_i^l (it received no s_i^l; `bls.py`, C4). On the client's first selection and after a round
with Ω = L, Ω becomes L − 1 without a search and only then are the stored maxima of B and τ
updated; otherwise Ω is searched from its last value on inequality (29). Ω and the stored
bounds are client state (`PersonalizedAlgorithm`).

Single pass (DESIGN.md): the server's pre-step (slice, R step, s_i, skip mask) depends only on
its state and inputs, the clients' results come back through one gathering aggregate, writing
R back (and, in the 'after_training' order, the R step) is server math.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Optional

import gin
import tensorflow as tf

from fltff.errors import ConfigError
from fltff.learning import optimizers
from fltff.learning.model_spec import ModelSpec
from fltff.personalization import process as process_lib
from fltff.personalization.process import normalize_rows
from fltff.personalization.process import personalized_server_models
from fltff.personalization.process import refreshed_models
from fltff.personalization.process import scatter_relationship
from fltff.personalization.process import slice_relationship

# When KAPC takes its E_r steps on R: before s_i is sent (Algorithm 5, the default) or after
# the clients trained (fltff's earlier order).
RELATIONSHIP_UPDATES = ('before_send', 'after_training')


def relationship_objective(relation: tf.Tensor, models: Sequence[tf.Tensor],
                           layer_of: Sequence[int], lambda_: float, beta: float) -> tf.Tensor:
  """`Σ_i [λ Σ_l ||s_i^l(R) − w_i^l||² + β/2 Σ_l ||r_i^l − 1/P||²]` (KAPC's R-step objective)."""
  s = personalized_server_models(relation, models, layer_of)
  fit = tf.add_n([tf.reduce_sum(tf.square(a - w)) for a, w in zip(s, models)])
  num = tf.cast(tf.shape(relation)[-1], relation.dtype)
  return lambda_ * fit + 0.5 * beta * tf.reduce_sum(tf.square(relation - 1.0 / num))


def layer_grams(models: Sequence[tf.Tensor], layer_of: Sequence[int]) -> tf.Tensor:
  """`G[:, l, :] = Σ_{t∈l} W_t W_tᵀ` (`[P, L, P]`, R's layout): the participants' models'
  inner products per layer, all the R step needs of them."""
  flats = [tf.reshape(w, [tf.shape(w)[0], -1]) for w in models]
  grams = []
  for layer in range(max(layer_of) + 1):
    grams.append(tf.add_n([tf.matmul(f, f, transpose_b=True)
                           for f, l in zip(flats, layer_of) if l == layer]))
  return tf.stack(grams, axis=1)


def relationship_gradient(relation: tf.Tensor, grams: tf.Tensor, lambda_: float,
                          beta: float) -> tf.Tensor:
  """∂/∂R of `relationship_objective` in closed form: per layer, with `S = R W`,
  `2λ (S − W) Wᵀ + β (R − 1/P) = 2λ (R G − G) + β (R − 1/P)`, `G = layer_grams(W)`."""
  num = tf.cast(tf.shape(relation)[-1], relation.dtype)
  fit = tf.einsum('ilk,klj->ilj', relation, grams) - grams
  return 2.0 * lambda_ * fit + beta * (relation - 1.0 / num)


def update_relationship(relation: tf.Tensor, models: Sequence[tf.Tensor],
                        layer_of: Sequence[int], lambda_: float, beta: float,
                        learning_rate: float, steps: int) -> tf.Tensor:
  """E_r projected gradient steps on `relationship_objective` (KAPC, Algorithm 2).

  The gradient is `relationship_gradient`'s closed form (tests/test_kapc.py checks it against
  differentiating the objective): the models enter through their `[P, P]` inner products,
  computed once, so a step costs `O(P³ L)` instead of two model-sized products `O(P² d)`
  (measured: KAPC's `prepare` at 100 mlp2 clients, one step, 0.09–0.10 → 0.06 s).
  """
  if steps <= 0:
    return relation
  grams = layer_grams(models, layer_of)
  for _ in range(steps):
    relation = normalize_rows(
        relation - learning_rate * relationship_gradient(relation, grams, lambda_, beta))
  return relation


@dataclasses.dataclass(frozen=True)
class KapcRule(process_lib.RelationRule):
  """KAPC's rule: R learned by E_r projected steps (Algorithm 2) in the order of Algorithm 5.

  `start_from='server'` (clients start from s_i instead of their own model) is not KAPC; it
  exists for tests that read s_i back from the clients.
  """
  lambda_: float = 0.5
  beta: float = 0.1
  relationship_learning_rate: float = 0.01
  relationship_steps: int = 1
  relationship_update: str = 'before_send'
  start_from: str = 'own'

  def check(self, name: str, bls_mu: Optional[float]) -> None:
    del bls_mu
    if self.relationship_update not in RELATIONSHIP_UPDATES:
      raise ConfigError(f'{name}.relationship_update must be one of '
                        f'{", ".join(RELATIONSHIP_UPDATES)}, got {self.relationship_update!r}.')
    for label in ('beta', 'relationship_learning_rate', 'relationship_steps'):
      if getattr(self, label) < 0:
        raise ConfigError(f'{name}.{label} must be >= 0, got {getattr(self, label)}.')

  def _step(self, relation, models, context):
    return update_relationship(relation, models, context.layer_of, self.lambda_, self.beta,
                               self.relationship_learning_rate, self.relationship_steps)

  def relation(self, state, server_input, context):
    rel = normalize_rows(slice_relationship(state['relation'], server_input['clients']))
    if self.relationship_update != 'before_send':
      return rel, {}
    # Algorithm 5: the server's copies of the participants' latest models (stale layers
    # filled) are what the clients uploaded when they last took part.
    stepped = self._step(rel, list(server_input['models']), context)
    return stepped, {'relation': stepped}  # `server_update` writes the stepped slice back.

  def server_update(self, state, server_input, server_msg, trained, uploaded, context):
    clients = server_input['clients']
    relation = state['relation']
    if self.relationship_update == 'before_send':
      # The fresh uploads become the next round's copies (`next_client_states`) and are not
      # used for a second step now.
      relation = scatter_relationship(relation, clients, server_msg['relation'])
    else:
      # The fresh uploads, layers not uploaded filled with the stale copies.
      models = refreshed_models(trained, list(server_input['models']), uploaded,
                                context.layer_of)
      current = normalize_rows(slice_relationship(relation, clients))
      relation = scatter_relationship(relation, clients, self._step(current, models, context))
    return collections.OrderedDict(relation=relation)


@gin.configurable('kapc')
def build_kapc(model_spec: ModelSpec, num_clients: int, client_optimizer=None,
               lambda_: float = 0.5, beta: float = 0.1,
               relationship_learning_rate: float = 0.01, relationship_steps: int = 1,
               bls_mu: Optional[float] = None, min_upload_layers: int = 1,
               relationship_update: str = 'before_send') -> process_lib.PersonalizedAlgorithm:
  """KAPC; with `bls_mu` set, KAPC+BLS (μ = bls_mu).

  `relationship_update`: 'before_send' (Algorithm 5: R stepped on the server's copies, then
  s_i and the skip mask from the stepped R) or 'after_training' (fltff's earlier order).
  """
  rule = KapcRule(lambda_=lambda_, beta=beta,
                  relationship_learning_rate=relationship_learning_rate,
                  relationship_steps=relationship_steps, relationship_update=relationship_update)
  return process_lib.build_personalized_process(
      model_spec, num_clients, client_optimizer or optimizers.default_client_optimizer(), rule,
      bls_mu=bls_mu, min_upload_layers=min_upload_layers,
      name='kapc+bls' if bls_mu is not None else 'kapc')
