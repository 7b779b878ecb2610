"""MOON (Li, He, Song, "Model-Contrastive Federated Learning", CVPR 2021).

Client i trains from the global model w^t on `ℓ = ℓ_CE + μ ℓ_con` per minibatch (eq. (4)),
where the model-contrastive loss (eq. (3)) pulls the representation z of x under the model
being trained towards z_glob, its representation under the fixed global model w^t, and pushes
it away from z_prev, its representation under the client's own previous local model (the model
it ended its last participation with). The server aggregates like FedAvg.

In fltff:
- The representation is the model zoo's latent layer (`fltff.models.latent_model`, the one CCN
  averages), flattened; the paper's projection head is not added.
- The previous local model's trainable weights are the client's state in the round driver's
  store (`client_state.build_stateful_client_work`, like SCAFFOLD's c_i); the participants'
  trained models are gathered back into it. A client that never took part starts from the
  initial model (as MOON's official code does), so in round 1 z_prev = z_glob, ℓ_con = log 2
  with zero gradient and the round equals FedAvg's (tested); with μ = 0 MOON is FedAvg.
- The fixed global and previous models are extra Keras models in the client computation, run
  in inference mode (`training=False`). The previous model uses the global model's
  non-trainable weights (BatchNorm statistics): the state holds trainable weights only.
- Nothing extra is communicated: the client state never leaves the client.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Callable, Optional

import gin
import tensorflow as tf

from fltff.errors import ConfigError
from fltff.learning import client_state
from fltff.learning import client_work as client_work_lib
from fltff.learning import optimizers
from fltff.learning.model_spec import ModelSpec
from fltff.learning.process import Algorithm
from fltff.learning.process import build_algorithm


def model_contrastive_loss(z: tf.Tensor, z_glob: tf.Tensor, z_prev: tf.Tensor,
                           temperature: float, mask: Optional[tf.Tensor] = None) -> tf.Tensor:
  """MOON's model-contrastive loss (Li, He, Song, CVPR 2021, eq. (3)), averaged over examples.

  `ℓ_con = −log( exp(sim(z, z_glob)/τ) / (exp(sim(z, z_glob)/τ) + exp(sim(z, z_prev)/τ)) )`
  with `sim` the cosine similarity of each example's representations.

  Args:
    z: `[B, D]` representations of B examples under the local model.
    z_glob: The same examples' representations under the global model.
    z_prev: The same examples' representations under the previous local model.
    temperature: τ > 0.
    mask: Optional `[B]`, 1 for the examples to average over (a padded batch's real ones).

  Returns:
    The mean of ℓ_con over the B examples, or over the masked ones (0 if none); a zero vector
    has similarity 0 to everything.
  """
  z, z_glob, z_prev = (tf.math.l2_normalize(t, axis=-1) for t in (z, z_glob, z_prev))
  logits = tf.stack([tf.reduce_sum(z * z_glob, -1), tf.reduce_sum(z * z_prev, -1)], -1)
  losses = -tf.nn.log_softmax(logits / temperature, axis=-1)[:, 0]
  if mask is None:
    return tf.reduce_mean(losses)
  return tf.reduce_sum(losses * mask) / tf.maximum(tf.reduce_sum(mask), 1.0)


def _flat(z: tf.Tensor) -> tf.Tensor:
  return tf.reshape(z, [tf.shape(z)[0], -1])


class ModelContrastiveRegularizer:
  """`LocalRegularizer` adding `μ ℓ_con` on each minibatch (`batch_penalty`).

  Args:
    local_model: The Keras model being trained (its latent layer gives z).
    global_model, previous_model: Two more Keras models of the same architecture, loaded with
      `global_weights` (`ModelWeights`) and `previous_trainable` (+ the global non-trainable
      weights) at every epoch start, inside the training function (idempotent, so that the
      assignments are ordered before the epoch's steps).
    mu: μ ≥ 0.
    temperature: τ > 0.
  """

  traits = client_work_lib.RegularizerTraits(batch_term=True)

  def __init__(self, local_model: tf.keras.Model, global_model: tf.keras.Model,
               previous_model: tf.keras.Model, global_weights,
               previous_trainable: Sequence[tf.Tensor], mu: float, temperature: float):
    from fltff.models import latent_model  # pylint: disable=g-import-not-at-top

    self.mu = float(mu)
    self.temperature = float(temperature)
    self._latent = latent_model(local_model)
    self._global_latent = latent_model(global_model)
    self._previous_latent = latent_model(previous_model)
    global_trainable = tuple(tf.nest.flatten(global_weights.trainable))
    global_non_trainable = tuple(tf.nest.flatten(global_weights.non_trainable))
    self._loads = list(zip(global_model.trainable_weights + global_model.non_trainable_weights +
                           previous_model.trainable_weights +
                           previous_model.non_trainable_weights,
                           global_trainable + global_non_trainable + tuple(previous_trainable) +
                           global_non_trainable))
    self._statistics = list(local_model.non_trainable_weights)

  def epoch_start(self, local, global_):
    del local, global_
    for variable, value in self._loads:
      variable.assign(value)
    return ()

  def penalty(self, local, global_, context):
    del local, global_, context
    return tf.constant(0.0)

  def batch_penalty(self, local, global_, batch, context):
    """`μ ℓ_con(z, z_glob, z_prev)` on `batch['x']`; differentiable through the local model
    (the global model is the Keras model loaded at the epoch start)."""
    del local, global_, context
    x = batch['x']
    # The data loss's forward pass has already updated BatchNorm statistics on this batch;
    # this second pass (in training mode, as the representation being trained) must not.
    saved = [v.read_value() for v in self._statistics]
    z = _flat(self._latent(x, training=True))
    for v, s in zip(self._statistics, saved):
      v.assign(s)
    z_glob = tf.stop_gradient(_flat(self._global_latent(x, training=False)))
    z_prev = tf.stop_gradient(_flat(self._previous_latent(x, training=False)))
    return self.mu * model_contrastive_loss(z, z_glob, z_prev, self.temperature)


class StackedModelContrastive:
  """MOON's `μ ℓ_con` for one client of a vectorised round (`vectorized_moon_work`): the same
  term as `ModelContrastiveRegularizer`, with the three models as one functional latent
  apply (`vectorized.functional_apply`) on the local weights, the global weights and the
  client's previous weights (its row of the stacked client states), averaged over the batch's
  real examples (`batch['mask']`). z is the training pass's own latent output
  (`batch['latent']`, `RegularizerTraits.reads_latent`), as MOON's official code takes z and
  the logits from one `net(x)` call: the same value as the second training-mode pass
  `ModelContrastiveRegularizer` makes (on models without BatchNorm, the only ones that
  vectorise; with dropout the two would draw different masks), at one forward and one backward
  pass less per step."""

  traits = client_work_lib.RegularizerTraits(batch_term=True, reads_latent=True)

  def __init__(self, latent_apply: Callable, previous: Sequence[tf.Tensor], mu: float,
               temperature: float):
    self._latent_apply = latent_apply
    self.previous = tuple(previous)
    self.mu, self.temperature = float(mu), float(temperature)

  def epoch_start(self, local, global_):
    del local, global_
    return ()

  def penalty(self, local, global_, context):
    del local, global_, context
    return tf.constant(0.0)

  def batch_penalty(self, local, global_, batch, context):
    del context
    x = batch['x']
    z = _flat(batch['latent'] if 'latent' in batch else
              self._latent_apply(local, x, training=True))
    z_glob = tf.stop_gradient(_flat(self._latent_apply(global_, x, training=False)))
    z_prev = tf.stop_gradient(_flat(self._latent_apply(self.previous, x, training=False)))
    return self.mu * model_contrastive_loss(z, z_glob, z_prev, self.temperature,
                                            batch['mask'])


def previous_models(server_value, previous: tuple) -> tuple:
  """MOON's per-client term: the client's previous local model (its client state), for one
  client or for a round's clients along a leading axis. MOON has no server state."""
  del server_value
  return tuple(previous)


def trained_models(out: dict, previous: tuple) -> tuple:
  """MOON's new client states, the trained models, and no server contribution."""
  del previous
  return tuple(out['trained']), ()


def vectorized_moon_work(model_spec: ModelSpec, optimizer, mu: float, temperature: float,
                         device: Optional[str] = None):
  """MOON's client work for a round's participants together (`experiment.client_work`):
  `StackedModelContrastive` on each client's previous model (`previous_models`), the trained
  models as the new states (`trained_models`), as `build_moon_client_work` does client by
  client (`client_state.VectorizedStatefulWork`)."""
  from fltff.learning.vectorized import VectorizedClientWork  # pylint: disable=g-import-not-at-top

  work = VectorizedClientWork(
      model_spec, optimizer, device=device, latent=True,
      client_regularizer=lambda previous: StackedModelContrastive(
          work.latent_apply, previous, mu, temperature))
  return client_state.VectorizedStatefulWork(work, previous_models, trained_models)


def build_moon_client_work(model_spec: ModelSpec, optimizer, mu: float, temperature: float):
  """Client work of MOON: the client state is its previous local model's trainable weights;
  the new state is the trained model (gathered under `client_state.CLIENT_STATES_KEY`)."""

  def client_fn(initial_weights, server_value, data, previous):
    keras_model = model_spec.keras_fn()
    regularizer = ModelContrastiveRegularizer(
        keras_model, model_spec.keras_fn(), model_spec.keras_fn(), initial_weights,
        previous_models(server_value, previous), mu, temperature)
    out = client_work_lib.build_local_training(
        model_spec.tff_model(keras_model), optimizer, regularizer)(
            initial_weights, data['batches'], data['info'])
    result = client_work_lib.client_result(initial_weights, data, out)
    return (result, out['metrics'], *trained_models(out, previous))

  process, _ = client_state.build_stateful_client_work(model_spec, client_fn)
  return process


@gin.configurable('moon')
def build_moon(model_spec: ModelSpec, num_clients: int, client_optimizer=None, mu: float = 1.0,
               temperature: float = 0.5, server_optimizer=None) -> Algorithm:
  """MOON: local loss `ℓ_CE + μ ℓ_con` (eq. (4)), server aggregation as FedAvg.

  Args:
    model_spec: The model (needs the zoo's latent layer).
    num_clients: N, the total number of clients (each keeps its previous local model).
    client_optimizer: Local optimizer (default: `optimizers.default_client_optimizer()`).
    mu: μ, the weight of the model-contrastive loss (paper: 5 on CIFAR-10, 1 on CIFAR-100).
    temperature: τ (paper: 0.5).
  """
  if num_clients < 1:
    raise ConfigError(f'moon needs num_clients >= 1, got {num_clients}.')
  if mu < 0:
    raise ConfigError(f'moon.mu must be >= 0, got {mu}.')
  if temperature <= 0:
    raise ConfigError(f'moon.temperature must be > 0, got {temperature}.')
  from fltff.models import latent_model  # pylint: disable=g-import-not-at-top
  with tf.Graph().as_default():
    latent_model(model_spec.keras_fn())  # A clear error now, not inside the computation.
  optimizer = client_optimizer or optimizers.default_client_optimizer()
  algorithm = build_algorithm(
      'moon', model_spec, optimizer, optimizers.server_sgd(server_optimizer, 1.0, 'moon'),
      client_work=build_moon_client_work(model_spec, optimizer, mu, temperature))
  algorithm.num_clients = num_clients
  # MOON's batch term reads the model: its kernels are never factored (`factor_dense` unused).
  algorithm.vectorized_fn = lambda device, factor_dense=True: vectorized_moon_work(
      model_spec, optimizer, mu, temperature, device)
  initial = [w.copy() for w in model_spec.initial_weights().trainable]
  return client_state.with_client_states(algorithm, lambda: [w.copy() for w in initial])
