"""Client contribution normalisation (CCN, "Client Contribution Normalization for Enhanced
Federated Learning") and FedNova's normalised averaging (Wang et al., NeurIPS 2020), as one
single-pass factory; the equations and their use: docs/methods/ccn.md.
"""

from __future__ import annotations

import collections
from typing import Optional

import gin
import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from fltff.aggregators.gather import build_gathering_process
from fltff.config_checks import check_number
from fltff.errors import ConfigError
from fltff.learning.client_work import CLIENT_INDEX
from fltff.learning.client_work import ClientStatistic
from fltff.models import latent_model
from fltff.models.layers import row_cosine


def similarity_matrix(latents: tf.Tensor) -> tf.Tensor:
  """S_qp = cos(z_q, z_p) for `latents` `[K, D]`, with S_qq = 1 (zero vectors: cosine 1)."""
  latents = tf.convert_to_tensor(latents)
  k = tf.shape(latents)[0]
  a = tf.repeat(latents, k, axis=0)  # row q*K + p holds z_q
  b = tf.tile(latents, [k, 1])       # row q*K + p holds z_p
  s = tf.reshape(row_cosine(a, b), [k, k])
  return tf.linalg.set_diag(s, tf.ones([k], s.dtype))


def contribution_factors(similarity: tf.Tensor, temperature: float) -> tf.Tensor:
  """Λ_r = Σ_{q≠r} exp(Σ_p S_qp/T) / Σ_q exp(Σ_p S_qp/T), computed as 1 − softmax (stable)."""
  return 1.0 - tf.nn.softmax(tf.reduce_sum(similarity, axis=1) / temperature)


def normalized_weights(factors: tf.Tensor, base_weights: tf.Tensor) -> tf.Tensor:
  """ω_r = Λ_r ν_r / Σ_q Λ_q ν_q, or ν_r / Σ_q ν_q where Λ·ν = 0 (e.g. one client: Λ = 0).

  Both divisions are NaN-safe; all ν = 0 gives ω = 0 (a zero update)."""
  base_weights = tf.convert_to_tensor(base_weights)
  w = tf.convert_to_tensor(factors, base_weights.dtype) * base_weights
  total = tf.reduce_sum(w)
  return tf.where(total > 0, tf.math.divide_no_nan(w, total),
                  tf.math.divide_no_nan(base_weights, tf.reduce_sum(base_weights)))


def nova_aggregate(updates: list, weights: tf.Tensor, steps: tf.Tensor) -> list:
  """FedNova: `τ_eff Σ_k p_k (Δ_k / τ_k)` with `τ_eff = Σ_k p_k τ_k` (p normalised)."""
  steps = tf.cast(steps, tf.float32)
  tau_eff = tf.reduce_sum(weights * steps)
  return [tau_eff * tf.tensordot(weights / steps, u, axes=1) for u in updates]


def _latent_mean_of_client(keras_model, data, out):
  """The mean latent representation over one pass of the client's batches, read after training."""
  latent = latent_model(keras_model)
  dim = int(latent.output_shape[-1])

  def add_latents(state, batch):
    total, count = state
    z = tf.reshape(latent(batch['x'], training=False), [-1, dim])
    return total + tf.reduce_sum(z, axis=0), count + tf.cast(tf.shape(z)[0], tf.float32)

  with tf.control_dependencies(tf.nest.flatten(out['trained'])):
    total, count = data['batches'].reduce((tf.zeros([dim]), tf.constant(0.0)), add_latents)
  return total / tf.maximum(count, 1.0)


def _latent_means_in_trace(work, weights, first_epoch):
  """Each vectorised client's mean latent representation under its trained weights over its
  first epoch's batches."""
  examples, index, mask, k = first_epoch
  latent_apply, latent_dim = work.latent_apply, work.latent_dim

  def latent_sums(args):
    local, bx, bmask = args
    z = latent_apply(local, bx, training=False)
    return tf.reduce_sum(z * bmask[:, tf.newaxis], axis=0), tf.reduce_sum(bmask)

  def step(s, total, count):
    step_total, step_count = tf.vectorized_map(
        latent_sums, (weights, tf.gather(examples, index[0, s]), mask[0, s]))
    return s + 1, total + step_total, count + step_count

  _, total, count = tf.while_loop(
      lambda s, *_: s < tf.shape(index)[1], step,
      (tf.constant(0), tf.zeros([k, latent_dim]), tf.zeros([k])))
  return total / tf.maximum(count, 1.0)[:, tf.newaxis]


# CCN's z_k: the client's mean latent (last hidden) layer after training, float32 [D].
LATENT_MEAN = ClientStatistic(
    'latent_mean', np.float32, _latent_mean_of_client, in_trace=_latent_means_in_trace,
    reads_latent=True, shape=lambda spec: latent_model(spec.keras_fn()).output_shape[-1:])
# FedNova's τ_k: the client's optimizer steps, int32.
LOCAL_STEPS = ClientStatistic('local_steps', np.int32, lambda keras_model, data, out: out['steps'],
                              lambda client_inputs, out: np.asarray(out['steps'], np.int32))


class NormalizedMeanFactory(tff.aggregators.WeightedAggregationFactory):
  """Weighted mean of the clients' updates with CCN weights and/or FedNova normalisation.

  The update weight is a struct with `num_examples` (ν), plus `latent_mean` for CCN
  (`temperature` set) and `local_steps` for FedNova (else `ConfigError` in `create`); an
  optional `client_index` labels the per-client measurements (Λ, ω)."""

  def __init__(self, temperature: Optional[float] = None, normalized_averaging: bool = False):
    check_number('CCN temperature', temperature, allow_none=True, low=0, open_low=True)
    self._temperature = temperature
    self._nova = normalized_averaging

  @property
  def temperature(self) -> Optional[float]:
    """CCN's T, or None when CCN is off."""
    return self._temperature

  @property
  def client_statistics(self) -> tuple[ClientStatistic, ...]:
    """What the client work sends with each update (`client_work.ClientStatistic`)."""
    return ((CLIENT_INDEX,) + ((LATENT_MEAN,) if self._temperature else ()) +
            ((LOCAL_STEPS,) if self._nova else ()))

  def create(self, value_type, weight_type) -> tff.templates.AggregationProcess:
    fields = [name for name, _ in tff.structure.iter_elements(weight_type)] if isinstance(
        weight_type, tff.StructType) else []
    # ν and the statistics but the first, `client_index` (optional: it labels measurements).
    needed = ['num_examples'] + [s.name for s in self.client_statistics[1:]]
    missing = [f for f in needed if f not in fields]
    if missing:  # E.g. CCN inside TFF's own `build_weighted_fed_avg`, whose weight is n_k.
      what = ' and '.join(filter(None, (
          "CCN (contribution_normalization_factory) needs each client's latent_mean, the mean of "
          "its model's 'latent' layer over its local training data" if self._temperature else '',
          "FedNova's normalised averaging needs each client's local_steps" if self._nova else '')))
      raise ConfigError(
          f'{what}, sent with its update in the update weight, a struct ({", ".join(needed)}); '
          f'this process\'s update weight is {weight_type}, without {", ".join(missing)} (TFF\'s '
          'own client work sends only the example count). Build the process with an fltff '
          'builder, whose client work sends the factory\'s client_statistics: '
          'fltff.learning.build_fedavg(model_spec, model_aggregator=<this factory>) or another '
          'that takes model_aggregator (fltff.methods marks them composes_aggregator), or '
          'build_algorithm(..., model_aggregator=<this factory>) for a method of your own.')
    specs = tff.types.type_to_tf_tensor_specs(value_type)

    def server_update(state, gathered):
      updates = list(gathered['update'])
      weight = gathered['weight']
      nu = weight['num_examples']
      measurements = collections.OrderedDict(client_index=(
          weight['client_index'] if 'client_index' in fields else tf.range(tf.shape(nu)[0])))
      if self._temperature:
        factors = contribution_factors(similarity_matrix(weight['latent_mean']), self._temperature)
        omega = normalized_weights(factors, nu)
        measurements['contribution'] = factors
      else:
        omega = nu / tf.reduce_sum(nu)
      measurements['weight'] = omega
      if self._nova:
        aggregate = nova_aggregate(updates, omega, weight['local_steps'])
      else:
        aggregate = [tf.tensordot(omega, u, axes=1) for u in updates]
      return state, tf.nest.pack_sequence_as(specs, aggregate), measurements

    return build_gathering_process(value_type, weight_type, lambda: (), server_update)


@gin.configurable('contribution_normalization')
def contribution_normalization_factory(temperature: float = 1.0) -> NormalizedMeanFactory:
  """CCN over the base scheme's weights ν, with T = `temperature`.

  gin: `<method>.model_aggregator = @contribution_normalization()`. FedNova keeps its normalised
  averaging, with the weights Λν."""
  return NormalizedMeanFactory(temperature)
