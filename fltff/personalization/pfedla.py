"""pFedLA: layer-wise aggregation weights from per-client hypernetworks.

Source: Ma, Zhang, Guo, Xu, "Layer-wised Model Aggregation for Personalized Federated Learning",
CVPR 2022. Per client i a hypernetwork HN_i(v_i; φ_i) (embedding v_i, MLP) gives layer l's weights
over clients, `α_i^l` (eq. (5)); client i trains `θ̄_i^l = Σ_j α_ij^l θ_j^l` (eq. (4)) to θ_i, then
`φ_i ← φ_i + η_hn (∂θ̄_i/∂φ_i)ᵀ Δθ_i`, `Δθ_i = θ_i − θ̄_i` (eq. (7): the chain rule with Δθ for
−∇L; likewise v_i). `HypernetworkRelation` (start from s_i, λ = 0) is the rule for
`process.build_personalized_process`.

Our reading, where the paper leaves it open or we chose differently:

1. Architecture `e → relu(W1 e + b1) → relu(W2 · + b2) → relu(H_l · + c_l)` per layer l, one
   output per client, normalised over clients (all-zero row: uniform); embedding and hidden sizes
   100 (the public pFedLA code's defaults), η_hn = 5e-3, plain SGD.
2. Glorot initialisation, head weights ×0.01 and head biases 1: every client starts near uniform
   weights (FedAvg's unweighted mean), not a random mixture.
3. Partial participation: weights restricted to the participants and renormalised (as KAPC's
   Algorithm 5); the server input holds only their stored models.
4. Clients start from θ̄_i and keep their trained θ_i as personal model (evaluated on the local
   test split); the server stores θ_i for later aggregation.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Optional

import gin
import numpy as np
import tensorflow as tf

from fltff.config_checks import check_number
from fltff.errors import ConfigError
from fltff.learning.model_spec import ModelSpec
from fltff.personalization import process as process_lib
from fltff.personalization.process import normalize_rows
from fltff.personalization.process import personalized_server_models


def initial_hypernetworks(num_clients: int, num_layers: int, embedding_dim: int = 100,
                          hidden_dim: int = 100, seed: int = 0) -> collections.OrderedDict:
  """Every client's hypernetwork parameters, stacked `[N, ...]`.

  Stateless TF draws: a TFF computation holds a seed, not N parameter sets as constants."""
  n, l, d, h = num_clients, num_layers, embedding_dim, hidden_dim

  def glorot(fan_in, fan_out, stream, scale=1.0):
    limit = scale * np.sqrt(6.0 / (fan_in + fan_out))
    return tf.random.stateless_uniform([n, fan_in, fan_out], seed=[seed, stream],
                                       minval=-limit, maxval=limit)

  return collections.OrderedDict(
      embedding=tf.random.stateless_normal([n, d], seed=[seed, 0]),
      w1=glorot(d, h, 1), b1=tf.zeros([n, h]),
      w2=glorot(h, h, 2), b2=tf.zeros([n, h]),
      head=glorot(h, l * n, 3, scale=0.01), head_bias=tf.ones([n, l * n]))


def hypernetwork_outputs(params, num_layers: int) -> tf.Tensor:
  """`relu(H_l h + c_l)` for the stacked hypernetworks in `params`: `[P, L, N]`, ≥ 0."""
  e = params['embedding']
  h = tf.nn.relu(tf.einsum('pd,pdh->ph', e, params['w1']) + params['b1'])
  h = tf.nn.relu(tf.einsum('pd,pdh->ph', h, params['w2']) + params['b2'])
  out = tf.nn.relu(tf.einsum('ph,pho->po', h, params['head']) + params['head_bias'])
  return tf.reshape(out, [tf.shape(out)[0], num_layers, -1])


def layer_weights(params, clients: tf.Tensor, num_layers: int) -> tf.Tensor:
  """pFedLA's α for the participants `clients` (eq. (5)), restricted to them: `[P, L, P]`."""
  return normalize_rows(tf.gather(hypernetwork_outputs(params, num_layers), clients, axis=2))


def update_hypernetworks(params, clients: tf.Tensor, models: Sequence[tf.Tensor],
                         deltas: Sequence[tf.Tensor], layer_of: Sequence[int],
                         num_layers: int, learning_rate: float):
  """One step `φ_i ← φ_i + η (∂θ̄_i/∂φ_i)ᵀ Δθ_i` for every participant (eq. (7)).

  Args:
    params: The participants' hypernetworks (leading axis P, in `clients` order).
    models: Per trainable tensor, the participants' stored models `[P, ...]` θ̄ came from.
    deltas: Per trainable tensor, `θ_i − θ̄_i` `[P, ...]`.
    learning_rate: η_hn.
  """
  flat = tf.nest.flatten(params)
  with tf.GradientTape() as tape:
    tape.watch(flat)
    aggregate = personalized_server_models(layer_weights(params, clients, num_layers), models,
                                           layer_of)
    # Ascending ⟨θ̄(φ), Δθ⟩ with Δθ held fixed is descending the client loss along its update.
    objective = -tf.add_n([tf.reduce_sum(a * tf.stop_gradient(d))
                           for a, d in zip(aggregate, deltas)])
  grads = tape.gradient(objective, flat, unconnected_gradients=tf.UnconnectedGradients.ZERO)
  return tf.nest.pack_sequence_as(params, [p - learning_rate * g for p, g in zip(flat, grads)])


@dataclasses.dataclass(frozen=True)
class HypernetworkRelation(process_lib.RelationRule):
  """pFedLA's rule: α from the participants' hypernetworks, stepped along their updates."""
  name = 'pfedla'
  embedding_dim: int = 100
  hidden_dim: int = 100
  learning_rate: float = 5e-3
  seed: int = 0
  start_from: str = 'server'

  def check(self, name: str) -> None:
    # The step uses Δθ_i = θ_i − s_i: valid only when the client started from all of s_i.
    if self.start_from != 'server' or self.layer_selection.partial:
      raise ConfigError(f"{name}: pFedLA's hypernetwork rule needs start_from='server' and every "
                        f'layer exchanged (got start_from={self.start_from!r}, layer selection '
                        f'{self.layer_selection.name}).')
    if self.lambda_ != 0:
      raise ConfigError(f'{name}: pFedLA has no proximal term (lambda_ must be 0, got '
                        f'{self.lambda_}).')
    check_number(f'{name}.learning_rate', self.learning_rate, low=0)
    check_number(f'{name}.embedding_dim', self.embedding_dim, integer=True, low=1)
    check_number(f'{name}.hidden_dim', self.hidden_dim, integer=True, low=1)

  def initial_state(self, context):
    state = super().initial_state(context)
    state['hypernetwork'] = initial_hypernetworks(context.num_clients, context.num_layers,
                                                  self.embedding_dim, self.hidden_dim,
                                                  self.seed)
    return state

  def relation(self, state, server_input, context):
    clients = server_input['clients']
    return layer_weights(_rows(state['hypernetwork'], clients), clients,
                         context.num_layers), {}

  def server_update(self, state, server_input, server_msg, trained, uploaded, context):
    del uploaded
    clients = server_input['clients']
    # Δθ_i = θ_i − θ̄_i: the client started from s_i = θ̄_i (every layer sent, no BLS).
    deltas = [v - m for v, m in zip(trained, server_msg['models'])]
    updated_rows = update_hypernetworks(
        _rows(state['hypernetwork'], clients), clients, list(server_input['models']), deltas,
        context.layer_of, context.num_layers, self.learning_rate)
    hypernetwork = tf.nest.map_structure(
        lambda p, r: tf.tensor_scatter_nd_update(p, clients[:, None], r),
        state['hypernetwork'], updated_rows)
    # R keeps each participant's full α (over all N clients) for the report's heatmap.
    relation = tf.tensor_scatter_nd_update(
        state['relation'], clients[:, None],
        normalize_rows(hypernetwork_outputs(updated_rows, context.num_layers)))
    return collections.OrderedDict(relation=relation, hypernetwork=hypernetwork)


def _rows(params, clients):
  return tf.nest.map_structure(lambda p: tf.gather(p, clients), params)


@gin.configurable('pfedla')
def build_pfedla(model_spec: ModelSpec, num_clients: int, client_optimizer=None,
                 embedding_dim: int = 100, hidden_dim: int = 100, learning_rate: float = 5e-3,
                 relationship_seed: Optional[int] = 0) -> process_lib.PersonalizedAlgorithm:
  """pFedLA (module docstring); `relationship_seed` (None: 0) seeds the hypernetworks'
  initialisation. Named as KAPC's seed of R, so an experiment passes its run seed unless gin
  binds `pfedla.relationship_seed` (`fltff.simulation.experiment.build_method`)."""
  return process_lib.build_personalized_process(
      model_spec, num_clients, client_optimizer,
      HypernetworkRelation(embedding_dim=embedding_dim, hidden_dim=hidden_dim,
                           learning_rate=learning_rate, seed=relationship_seed or 0))
