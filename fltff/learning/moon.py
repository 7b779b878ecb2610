"""MOON (Li, He, Song, "Model-Contrastive Federated Learning", CVPR 2021).

Local loss `ℓ_CE + μ ℓ_con` (eq. (4)): ℓ_con (eq. (3)) pulls the representation z towards z_glob
(global model) and away from z_prev (the client's previous local model); FedAvg's server. z is
the zoo's latent layer, flattened (the paper's projection head is not added). The client state
(the previous model's trainable weights) never leaves the client; a new client starts from the
initial model (as MOON's code), so round 1 and μ = 0 equal FedAvg (tested). More in
docs/methods/personalised.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Callable, Optional

import gin
import tensorflow as tf

from fltff.config_checks import check_number
from fltff.errors import ConfigError
from fltff.learning import client_state
from fltff.learning import client_work as client_work_lib
from fltff.learning import optimizers
from fltff.learning.model_spec import ModelSpec
from fltff.learning.process import Algorithm
from fltff.learning.process import build_averaging_method


def model_contrastive_loss(z: tf.Tensor, z_glob: tf.Tensor, z_prev: tf.Tensor,
                           temperature: float, mask: Optional[tf.Tensor] = None) -> tf.Tensor:
  """MOON's model-contrastive loss (Li, He, Song, CVPR 2021, eq. (3)), averaged over examples.

  `ℓ_con = −log( exp(sim(z, z_glob)/τ) / (exp(sim(z, z_glob)/τ) + exp(sim(z, z_prev)/τ)) )` for
  `[B, D]` representations under the local, global and previous local model; `sim` is the
  cosine similarity (0 for a zero vector), τ = `temperature` > 0. `mask`: optional `[B]`, 1 for
  the examples to average over (0 if none).
  """
  z, z_glob, z_prev = (tf.math.l2_normalize(t, axis=-1) for t in (z, z_glob, z_prev))
  logits = tf.stack([tf.reduce_sum(z * z_glob, -1), tf.reduce_sum(z * z_prev, -1)], -1)
  losses = -tf.nn.log_softmax(logits / temperature, axis=-1)[:, 0]
  if mask is None:
    return tf.reduce_mean(losses)
  return tf.reduce_sum(losses * mask) / tf.maximum(tf.reduce_sum(mask), 1.0)


def _flat(z: tf.Tensor) -> tf.Tensor:
  return tf.reshape(z, [tf.shape(z)[0], -1])


class ModelContrastiveRegularizer(client_work_lib.LocalRegularizer):
  """`LocalRegularizer` adding `μ ℓ_con` on each minibatch (`batch_penalty`), for one client on
  either executor. z is the training pass's own latent (`batch['latent']`), as in MOON's code;
  z_glob and z_prev are `latent_apply(weights, x)` (inference mode) with the global and the
  `previous` trainable weights."""

  traits = client_work_lib.RegularizerTraits(batch_term=True, reads_latent=True)

  def __init__(self, latent_apply: Callable, previous: Sequence[tf.Tensor], mu: float,
               temperature: float):
    self._latent_apply = latent_apply
    self.previous = tuple(previous)
    self.mu, self.temperature = float(mu), float(temperature)

  def penalty(self, local, global_, context):
    del local, global_, context
    return tf.constant(0.0)

  def batch_penalty(self, local, global_, batch, context):
    del local, context
    x = batch['x']
    z_glob = tf.stop_gradient(_flat(self._latent_apply(global_, x)))
    z_prev = tf.stop_gradient(_flat(self._latent_apply(self.previous, x)))
    return self.mu * model_contrastive_loss(_flat(batch['latent']), z_glob, z_prev,
                                            self.temperature, batch['mask'])


@gin.configurable('moon')
def build_moon(model_spec: ModelSpec, num_clients: int, client_optimizer=None, mu: float = 1.0,
               temperature: float = 0.5, server_optimizer=None) -> Algorithm:
  """MOON: local loss `ℓ_CE + μ ℓ_con` (eq. (4)), server aggregation as FedAvg.

  Args:
    model_spec: The model (needs the zoo's latent layer).
    mu: μ ≥ 0, the weight of ℓ_con (paper: 5 on CIFAR-10, 1 on CIFAR-100).
    temperature: τ > 0 (paper: 0.5).
  """
  check_number('moon.num_clients', num_clients, integer=True, low=1)
  check_number('moon.mu', mu, low=0)
  check_number('moon.temperature', temperature, low=0, open_low=True)
  from fltff.models import latent_model  # pylint: disable=g-import-not-at-top
  with tf.Graph().as_default():  # A clear error now, not inside the computation.
    if not latent_model(model_spec.keras_fn()).trainable_weights:
      raise ConfigError(f"moon: {model_spec.name}'s latent layer is its input, so the contrastive "
                        'term would be constant (MOON = FedAvg): use a model with a hidden layer.')
  optimizer = optimizers.default_client_optimizer(client_optimizer)
  # The client state and term: the previous local model; the new state: the trained one (no
  # server state or contribution).
  work = client_state.StatefulClientWork(
      lambda previous, latent_apply: ModelContrastiveRegularizer(latent_apply, previous, mu,
                                                                 temperature),
      lambda server_value, previous: tuple(previous),
      lambda out, previous: (tuple(out['trained']), ()), latent=True)
  initial = [w.copy() for w in model_spec.initial_weights().trainable]
  return build_averaging_method(
      'moon', model_spec, optimizer, server_optimizer, 1.0, None,
      client_work=client_state.build_stateful_client_work(model_spec, optimizer, work)[0],
      # The batch term reads the model: kernels are never factored (`factor_dense` unused).
      vectorized_fn=lambda device, factor_dense=True: client_state.VectorizedStatefulWork(
          model_spec, optimizer, work, device=device),
      num_clients=num_clients, client_state_init=lambda: [w.copy() for w in initial])
