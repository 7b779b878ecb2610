"""FedAdp and FedLayerWise: adaptive (layer-wise) weighting of client updates.

Sources: H. Wu, P. Wang, "Fast-Convergent Federated Learning with Adaptive Weighting" (FedAdp, IEEE
TCCN 2021) and "Layer-Wise Adaptive Weighting for Faster Convergence in Federated Learning"
(FedLayerWise: FedAdp's rule per layer). Equation numbers are FedLayerWise's. Two typos of that
paper are resolved as in docs/methods/adaptive.md: the Gompertz map decreases with the angle
(FedAdp's form), and eq. (7) averages the clients' *updated* layer weights.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from fltff.aggregators.gather import build_gathering_process
from fltff.config_checks import check_number
from fltff.errors import ConfigError
from fltff.learning.client_work import CLIENT_INDEX
from fltff.models.layers import row_cosine
from fltff.models.layers import update_index_groups

GOMPERTZ_ALPHA = 5.0


def client_gradients(updates: tf.Tensor, learning_rate: float) -> tf.Tensor:
  """Eq. (3): `g_k = (w(t−1) − w_k(t)) / η`; `updates` hold `w(t−1) − w_k(t)` (TFF's delta)."""
  return tf.convert_to_tensor(updates) / learning_rate


def global_gradient(gradients: tf.Tensor, num_examples: tf.Tensor) -> tf.Tensor:
  """Eq. (2): the sample-weighted mean `Σ_k n_k g_k / Σ_k n_k` over the leading (client) axis."""
  weights = num_examples / tf.reduce_sum(num_examples)
  return tf.tensordot(weights, gradients, axes=1)


def instantaneous_angles(gradients: tf.Tensor, global_grad: tf.Tensor) -> tf.Tensor:
  """Eq. (1): `θ_k = arccos(<g_k, g> / (|g_k| |g|))`, `[K]` in [0, π], cosine clipped to [−1, 1].

  `gradients` `[K, D]` (one layer or the whole model, flattened), `global_grad` `[D]`. A zero-norm
  gradient has angle 0 (`fltff.models.layers.row_cosine`'s convention), so never NaN.
  """
  broadcast = tf.broadcast_to(global_grad[tf.newaxis, :], tf.shape(gradients))
  return tf.acos(tf.clip_by_value(row_cosine(gradients, broadcast), -1.0, 1.0))


def smoothed_angles(previous: tf.Tensor, current: tf.Tensor,
                    participations: tf.Tensor) -> tf.Tensor:
  """Eq. (4): `θ̃(t) = ((t−1)/t) θ̃(t−1) + θ(t)/t`, t = rounds *this client* has taken part in.

  `participations`: t counting this round (>= 1), broadcastable to the angles; `previous` may be
  any value where t = 1.
  """
  t = tf.cast(participations, current.dtype)
  return (t - 1.0) / t * previous + current / t


def gompertz(angles: tf.Tensor, alpha: float = GOMPERTZ_ALPHA) -> tf.Tensor:
  """Eq. (5), corrected: `f(θ̃) = α (1 − exp(−exp(−α (θ̃ − 1))))`, decreasing in θ̃."""
  return alpha * (1.0 - tf.exp(-tf.exp(-alpha * (angles - 1.0))))


def adaptive_weights(contributions: tf.Tensor, num_examples: tf.Tensor) -> tf.Tensor:
  """Eq. (6): `ψ_k = n_k e^{f_k} / Σ_k' n_k' e^{f_k'}` over axis 0; f `[K, ...]`, n `[K]` > 0."""
  log_n = tf.math.log(num_examples)
  log_n = tf.reshape(log_n, [-1] + [1] * (len(contributions.shape) - 1))
  return tf.nn.softmax(contributions + log_n, axis=0)


def weighted_layer_mean(values: tf.Tensor, layer_weights: tf.Tensor) -> tf.Tensor:
  """Eq. (7): `Σ_k ψ_k,l v_k,l` for one tensor of layer l (`values` `[K, ...]`, ψ `[K]`).

  On the deltas `w(t−1) − w_k(t)` this is `w(t−1) − Σ_k ψ_k,l w_k,l(t)` (Σ_k ψ_k,l = 1): the new
  layer is the ψ-weighted mean of the *updated* client layers."""
  return tf.tensordot(layer_weights, values, axes=1)


class AdaptiveWeightingFactory(tff.aggregators.WeightedAggregationFactory):
  """TFF weighted aggregation factory for FedAdp (model-wise) and FedLayerWise (layer-wise).

  Usable wherever TFF takes a `model_aggregator` (e.g. `build_weighted_fed_avg`). With TFF's plain
  float32 weight no client identity arrives: angles are unsmoothed (θ̃ = θ) and `num_clients` must
  be unset. With `OrderedDict(num_examples=float32, client_index=int32)` (fltff's client work,
  `client_statistics`) `num_clients` is required, and every client's smoothed angles
  and participation counts live in the state (saved in fltff's checkpoints); an index outside
  [0, num_clients) fails the round. A mismatch raises `ConfigError` in `create`.

  Measurements: `client_index` [K] (`position` with a plain float weight), `angle` θ [K, L],
  `smoothed_angle` θ̃ [K, L], `psi` ψ [K, L] (L = 1 for FedAdp).
  """

  def __init__(self,
               layers: Optional[Sequence[Sequence[int]]] = None,
               num_clients: Optional[int] = None,
               alpha: float = GOMPERTZ_ALPHA, name: str = 'AdaptiveWeightingFactory'):
    """Args:
      layers: Per layer, indices into the flattened update (`tf.nest.flatten`), or
        `fltff.models.layer_groups(model)` as is. None: one layer per tensor; one group: FedAdp.
      num_clients: Total number of clients (size of the smoothing state).
      alpha: Gompertz α ≥ 0 (the papers: 5; 0: FedAvg); errors name it `<name>.alpha`.
    """
    # Checked now: a factory passed positionally here would fail as a raw gRPC error in round 1.
    check_number(f'{name}.num_clients', num_clients, integer=True, allow_none=True, low=1)
    check_number(f'{name}.alpha', alpha, low=0, hint='0: FedAvg')
    if layers is not None and any(hasattr(g, 'trainable_indices') for g in layers):
      layers = update_index_groups(layers)  # `fltff.models.layer_groups(model)`'s output.
    if layers is not None and not all(
        isinstance(g, (list, tuple, range)) and all(
            isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in g)
        for g in layers):
      raise ConfigError(f'AdaptiveWeightingFactory layers must be groups of tensor indices, '
                        f'e.g. [[0, 1], [2, 3]], got {layers!r}.')
    self._layers = None if layers is None else [list(g) for g in layers]
    self._num_clients = num_clients
    self._alpha = float(alpha)

  @property
  def client_statistics(self) -> tuple:
    """What the client work sends with each update: the client index if `num_clients` is set."""
    return (CLIENT_INDEX,) if self._num_clients is not None else ()

  def create(self, value_type, weight_type) -> tff.templates.AggregationProcess:
    specs = tff.types.type_to_tf_tensor_specs(value_type)
    flat_specs = tf.nest.flatten(specs)
    layers = self._layers or [[i] for i in range(len(flat_specs))]
    covered = sorted(i for g in layers for i in g)
    if covered != list(range(len(flat_specs))):
      raise ConfigError(f'Layer groups {layers} do not partition the {len(flat_specs)} '
                        'tensors of the update.')
    tensor_layer = {i: l for l, group in enumerate(layers) for i in group}
    keyed = isinstance(weight_type, tff.StructType)
    if keyed and not self._num_clients:
      raise ConfigError('Per-client angle smoothing needs num_clients (the total number of '
                        'clients) in the adaptive weighting factory.')
    if not keyed and self._num_clients:
      raise ConfigError(
          f'num_clients={self._num_clients} smooths each client\'s angles across rounds, which '
          'needs the client\'s index in its update weight; this process sends only the example '
          'count (as TFF\'s builders, e.g. build_weighted_fed_avg, do). Leave num_clients unset '
          '(angles unsmoothed, θ̃ = θ), or use fltff\'s builders (learning.build_fedlayerwise, '
          'learning.build_fedadp), whose client work sends the index.')
    num_state_clients = self._num_clients if keyed else 1

    def init_state():
      return collections.OrderedDict(
          smoothed_angle=tf.zeros([num_state_clients, len(layers)], tf.float32),
          participations=tf.zeros([num_state_clients], tf.int32))

    def server_update(state, gathered):
      updates = list(gathered['update'])
      weight = gathered['weight']
      n = weight['num_examples'] if keyed else weight
      k = tf.shape(n)[0]
      angles = []
      for group in layers:  # η = 1: it cancels in the angles.
        grads = client_gradients(
            tf.concat([tf.reshape(updates[i], [k, -1]) for i in group], axis=1), 1.0)
        angles.append(instantaneous_angles(grads, global_gradient(grads, n)))
      angle = tf.stack(angles, axis=1)  # [K, L]
      if keyed:
        index = weight['client_index']  # Out of range, a GPU's gather would read zeros silently.
        with tf.control_dependencies([tf.debugging.Assert(tf.reduce_all(
            (index >= 0) & (index < num_state_clients)), [f'AdaptiveWeightingFactory(num_clients='
            f'{num_state_clients}) got client indices outside [0, num_clients); num_clients must '
            'count every client of the data:', index])]):
          index = tf.identity(index)
        t = tf.gather(state['participations'], index) + 1
        smoothed = smoothed_angles(tf.gather(state['smoothed_angle'], index), angle,
                                   t[:, tf.newaxis])
        new_state = collections.OrderedDict(
            smoothed_angle=tf.tensor_scatter_nd_update(state['smoothed_angle'],
                                                       index[:, tf.newaxis], smoothed),
            participations=tf.tensor_scatter_nd_update(state['participations'],
                                                       index[:, tf.newaxis], t))
      else:
        index = tf.range(k, dtype=tf.int32)
        smoothed = angle
        new_state = state
      psi = adaptive_weights(gompertz(smoothed, self._alpha), n)  # [K, L]
      aggregate = [weighted_layer_mean(u, psi[:, tensor_layer[i]])
                   for i, u in enumerate(updates)]
      # Without client indices a row is a participant's position in this round, named so.
      measurements = collections.OrderedDict(
          [('client_index' if keyed else 'position', index), ('angle', angle),
           ('smoothed_angle', smoothed), ('psi', psi)])
      return new_state, tf.nest.pack_sequence_as(specs, aggregate), measurements

    return build_gathering_process(value_type, weight_type, init_state, server_update)


def layerwise_adaptive_factory(layers: Optional[Sequence[Sequence[int]]] = None,
                               num_clients: Optional[int] = None,
                               alpha: float = GOMPERTZ_ALPHA) -> AdaptiveWeightingFactory:
  """FedLayerWise: ψ per client *and layer* (`layers` from `fltff.models.layer_groups`)."""
  return AdaptiveWeightingFactory(layers, num_clients, alpha, 'fedlayerwise')


def fedadp_factory(num_tensors: int,
                   num_clients: Optional[int] = None,
                   alpha: float = GOMPERTZ_ALPHA) -> AdaptiveWeightingFactory:
  """FedAdp: one ψ per client, from the angle of the whole flattened model update."""
  return AdaptiveWeightingFactory([list(range(num_tensors))], num_clients, alpha, 'fedadp')
