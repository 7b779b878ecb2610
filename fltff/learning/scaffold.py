"""SCAFFOLD (Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated
Learning", ICML 2020, Algorithm 1): local steps corrected by control variates.

c_i is the client state, c the client work's server state. Local steps use `g_i(y) − c_i + c`
(eq. (3)); c_i⁺ is the mean minibatch gradient over the local steps: with plain SGD exactly
option II, `c_i − c + (x − y)/(K η_l)` (eq. (4), tested), and, unlike that formula, still a
gradient estimate with momentum or Adam. The server applies `c ← c + (1/N) Σ_{i∈S} (c_i⁺ − c_i)`
(eq. (5)).

Deviation (our choice): the model update is the example-weighted mean of the deltas (FedAvg's
ν), not the paper's unweighted one, so zero controls give exactly FedAvg and CCN reweights the
same ν as for every other base scheme.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import gin
import numpy as np
import tensorflow as tf

from fltff.config_checks import check_number
from fltff.learning import client_state
from fltff.learning import client_work as client_work_lib
from fltff.learning import optimizers
from fltff.learning.model_spec import ModelSpec
from fltff.learning.model_spec import type_num_bytes
from fltff.learning.process import Algorithm
from fltff.learning.process import build_averaging_method
from fltff.learning.stacked_optimizer import client_mask


class ControlVariateCorrection(client_work_lib.LocalRegularizer):
  """`LocalRegularizer` adding the constant `c − c_i` to every local gradient (eq. (3))."""

  # The gradient is the constant correction: an affine gradient with no w-term.
  traits = client_work_lib.RegularizerTraits(analytic=True, affine=True)

  def __init__(self, correction: Sequence[tf.Tensor]):
    self.correction = tuple(correction)

  def penalty(self, local, global_, context):
    """`<c − c_i, w>`, whose gradient is the correction."""
    del global_, context
    return tf.add_n([tf.reduce_sum(c * w) for c, w in zip(self.correction, local)])

  def gradient(self, local, global_, context):
    del local, global_, context
    return list(self.correction)

  def affine_gradient(self, global_, context):
    del global_, context
    return [None] * len(self.correction), list(self.correction)


class GradientMean:
  """The new control c_i⁺: the client's minibatch gradients averaged over its local steps (a
  `client_work.StepObserver` for both training loops); with plain SGD, option II of eq. (4)."""

  name = 'gradient_mean'

  def initial(self, weights):
    return tuple(tf.zeros(tf.shape(w), w.dtype) for w in weights)

  def observe(self, total, gradients):
    return tuple(a + g for a, g in zip(total, gradients))

  def result(self, total, steps):
    steps = tf.maximum(steps, 1)
    if steps.shape.rank:  # One step count per client: over each client's slice.
      return tuple(g / client_mask(tf.cast(steps, g.dtype), g.shape.rank) for g in total)
    return tuple(g / tf.cast(steps, g.dtype) for g in total)


def server_control_update(control: Sequence[tf.Tensor], delta_sum: Sequence[tf.Tensor],
                          num_clients: int) -> tuple:
  """`c + (1/N) Σ_{i∈S} Δc_i` (Karimireddy et al. 2020, Algorithm 1, line 17)."""
  return tuple(c + d / float(num_clients) for c, d in zip(control, delta_sum))


def correction(server_control: Sequence[tf.Tensor], controls: Sequence[tf.Tensor]) -> tuple:
  """`c − c_i`, added to each local gradient (Alg. 1, line 10); `controls` may be stacked."""
  return tuple(c - ci for c, ci in zip(server_control, controls))


def new_controls(out: dict, controls: Sequence[tf.Tensor]) -> tuple:
  """`(c_i⁺, Δc_i)` from the training's `gradient_mean` and `steps` (a client that took no step
  keeps its control); for one client or along a leading client axis."""
  took_steps = out['steps'] > 0  # Per client: against the client axis of each tensor.
  new = tuple(tf.where(client_mask(took_steps, g.shape.rank) if took_steps.shape.rank
                       else took_steps, g, ci) for g, ci in zip(out['gradient_mean'], controls))
  return new, tuple(n - o for n, o in zip(new, controls))


@gin.configurable('scaffold')
def build_scaffold(model_spec: ModelSpec, num_clients: int, client_optimizer=None,
                   server_learning_rate: float = 1.0, server_optimizer=None,
                   model_aggregator=None) -> Algorithm:
  """SCAFFOLD with η_g = `server_learning_rate`; the server control averages over N =
  `num_clients`. Only the model update, not Δc_i, goes through `model_aggregator` (CCN: Λ)."""
  check_number('scaffold.num_clients', num_clients, integer=True, low=1)
  optimizer = optimizers.default_client_optimizer(client_optimizer)
  specs = model_spec.trainable_specs()
  work = client_state.StatefulClientWork(  # c the server state, c_i the client state.
      lambda terms, latent_apply: ControlVariateCorrection(terms), correction, new_controls,
      server_init=lambda: tuple(tf.zeros(s.shape, s.dtype) for s in specs),
      server_update=functools.partial(server_control_update, num_clients=num_clients),
      step_observers=(GradientMean(),))
  statistics = getattr(model_aggregator, 'client_statistics', ())
  client_work, control_type = client_state.build_stateful_client_work(
      model_spec, optimizer, work, statistics)
  zeros = [np.zeros(t.shape, t.dtype.type) for t in control_type]
  return build_averaging_method(
      'scaffold', model_spec, optimizer, server_optimizer, server_learning_rate,
      model_aggregator, client_work=client_work,
      # SCAFFOLD sums its gradients: kernels are never factored (`factor_dense` unused).
      vectorized_fn=lambda device, factor_dense=True: client_state.VectorizedStatefulWork(
          model_spec, optimizer, work, statistics, device),
      # The server sends c with the model; each client sends Δc_i with its update.
      extra_bytes_per_client=type_num_bytes(control_type), num_clients=num_clients,
      client_state_init=lambda: [np.zeros_like(z) for z in zeros])
