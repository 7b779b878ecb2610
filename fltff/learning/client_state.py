"""Client work for global methods whose clients carry a state shaped like the trainable weights
(SCAFFOLD's c_i, MOON's previous model; docs/architecture.md, "Contracts"). A state comes in
with the client data (under `state`) and the new states go out, keyed by client index, through
one gathering aggregate (`fltff.aggregators.gather`) under `CLIENT_STATES_KEY`.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np
import tensorflow as tf

from fltff.learning import client_work as client_work_lib
from fltff.learning.model_spec import ModelSpec

# Where the gathered new client states appear in the process's client-work measurements.
CLIENT_STATES_KEY = 'client_states'


@dataclasses.dataclass(frozen=True)
class StatefulClientWork:
  """A method whose clients keep a state, declared once for both executors
  (`build_stateful_client_work` client by client, `VectorizedStatefulWork` all at once).

  Attributes:
    regularizer: `(client terms, latent_apply) -> LocalRegularizer` of one client;
      `latent_apply(trainable, x)` is the latent layer in inference mode with other weights
      (the global model's BatchNorm statistics), None unless `latent`.
    client_terms: `(server value, client state) -> client terms`; the server value is the
      broadcast server state (`()` without one); one client's, or along a client axis.
    client_final: `(training outputs, client state) -> (new client state, server contribution)`.
    server_init: No-arg TF function giving the server state (SCAFFOLD's c); None: none.
    server_update: `(server state, summed contributions) -> new server state`; given exactly
      when `server_init` is (else `ValueError`).
    step_observers: As in `client_work.build_local_training`.
    latent: The regulariser reads latent representations (MOON).
  """
  regularizer: Callable[[Any, Optional[Callable]], Any]
  client_terms: Callable[[Any, tuple], Any]
  client_final: Callable[[dict, tuple], tuple]
  server_init: Optional[Callable[[], Any]] = None
  server_update: Optional[Callable[[Any, Any], Any]] = None
  step_observers: Sequence[client_work_lib.StepObserver] = ()
  latent: bool = False

  def __post_init__(self):
    if (self.server_init is None) != (self.server_update is None):
      raise ValueError('server_init and server_update go together.')


def build_stateful_client_work(model_spec: ModelSpec, optimizer, work: StatefulClientWork,
                               client_statistics: Sequence[client_work_lib.ClientStatistic] = ()):
  """A `ClientWorkProcess` whose clients read and return a state shaped like the weights; each
  participant trains (`client_work.build_local_training`) with `work`'s regulariser.

  Returns:
    `(process, TFF type of one client's state)`; the process measures `train` and, under
    `CLIENT_STATES_KEY`, `OrderedDict(update=[K, ...] new states, weight=client_index[K])`.
    `client_statistics`: as in `client_work.build_client_work`.
  """
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top
  from fltff.aggregators.gather import build_gather  # pylint: disable=g-import-not-at-top

  metrics_aggregation_fn = client_work_lib.metrics_aggregation(model_spec)
  specs = model_spec.trainable_specs()
  state_type = tff.types.to_type(tuple((s.dtype.as_numpy_dtype, tuple(s.shape.as_list()))
                                       for s in specs))
  weights_type, data_type = client_work_lib.client_types(model_spec, state_type=state_type)

  def run_client(initial_weights, server_value, data):
    client_state = client_work_lib.read_single(data['state'])
    keras_model = model_spec.keras_fn()
    latent_apply = None
    if work.latent:
      from fltff.learning.vectorized import functional_apply  # pylint: disable=g-import-not-at-top
      from fltff.models import latent_model  # pylint: disable=g-import-not-at-top
      apply = functional_apply(latent_model(keras_model), keras_model, batch_norm=True)
      statistics = tuple(tf.nest.flatten(initial_weights.non_trainable))
      latent_apply = lambda w, x: apply(w, x, training=False, statistics=statistics)
    regularizer = work.regularizer(work.client_terms(server_value, client_state), latent_apply)
    out = client_work_lib.build_local_training(
        keras_model, optimizer, regularizer,
        step_observers=work.step_observers)(initial_weights, data['batches'], data['info'])
    result = client_work_lib.client_result(initial_weights, data, out, client_statistics,
                                           keras_model=keras_model)
    new_state, contribution = work.client_final(out, client_state)
    return (result, out['metrics'], tuple(new_state), client_work_lib.client_index_of(data),
            contribution)

  gather, _ = build_gather(state_type, tff.TensorType(np.int32))

  # Without a server state: `()`, broadcast and updated as one.
  @tff.tensorflow.computation
  def initial_server_state():
    return () if work.server_init is None else work.server_init()

  server_type = initial_server_state.type_signature.result

  @tff.tensorflow.computation(weights_type, server_type, data_type)
  def client_update(initial_weights, server_value, data):
    return run_client(initial_weights, server_value, data)

  @tff.federated_computation
  def init_fn():
    return tff.federated_eval(initial_server_state, tff.SERVER)

  @tff.tensorflow.computation(server_type, client_update.type_signature.result[4])
  def update_server_state(server_state, contribution_sum):
    if work.server_update is None:
      return server_state
    return work.server_update(server_state, contribution_sum)

  @tff.federated_computation(init_fn.type_signature.result,
                             tff.FederatedType(weights_type, tff.CLIENTS),
                             tff.FederatedType(data_type, tff.CLIENTS))
  def next_fn(state, weights, client_data):
    result, model_outputs, new_states, indices, contributions = tff.federated_map(
        client_update, (weights, tff.federated_broadcast(state), client_data))
    new_server_state = tff.federated_map(update_server_state,
                                         (state, tff.federated_sum(contributions)))
    # The aggregates are independent: one pass.
    measurements = tff.federated_zip(collections.OrderedDict(
        train=metrics_aggregation_fn(model_outputs),
        **{CLIENT_STATES_KEY: gather(new_states, indices)}))
    return tff.templates.MeasuredProcessOutput(new_server_state, result, measurements)

  return tff.learning.templates.ClientWorkProcess(init_fn, next_fn), state_type


class VectorizedStatefulWork:
  """`build_stateful_client_work` for a round's participants together: `next` returns the same
  state and measurements. A BatchNorm model trains its statistics unless `work.latent`."""

  def __init__(self, model_spec: ModelSpec, optimizer, work: StatefulClientWork,
               client_statistics: Sequence[client_work_lib.ClientStatistic] = (),
               device: Optional[str] = None):
    from fltff.learning.vectorized import VectorizedClientWork  # pylint: disable=g-import-not-at-top

    latent_apply = None
    if work.latent:
      latent_apply = lambda w, x: self._work.latent_apply(w, x, training=False)
    self._work = VectorizedClientWork(  # `FederatedAlgorithm.vectorized_work` unwraps it.
        model_spec, optimizer, client_statistics=client_statistics, device=device,
        client_regularizer=lambda terms: work.regularizer(terms, latent_apply),
        step_observers=work.step_observers, latent=work.latent, batch_norm=not work.latent)
    self._declared = work

  def next(self, state, global_weights, client_inputs, call=None):
    from fltff.learning.vectorized import stack_clients  # pylint: disable=g-import-not-at-top

    work = self._declared
    states = stack_clients([tuple(data['state']) for data in client_inputs])
    server_value = tf.nest.map_structure(tf.convert_to_tensor, state)
    results, train, _, out = self._work.round_results(
        global_weights, client_inputs, call, client_terms=work.client_terms(server_value, states))
    new_states, contributions = work.client_final(out, states)
    if work.server_update is not None:
      summed = tuple(tf.reduce_sum(c, axis=0) for c in contributions)
      state = type(state)(np.asarray(v) for v in work.server_update(server_value, summed))
    indices = client_work_lib.CLIENT_INDEX.of_clients(client_inputs, out)
    measurements = collections.OrderedDict(train=train)
    measurements[CLIENT_STATES_KEY] = collections.OrderedDict(
        update=tuple(np.asarray(s) for s in new_states), weight=indices)
    return state, results, measurements


def unpack_client_states(gathered) -> dict[int, list[np.ndarray]]:
  """`{client index: new state (list of arrays)}` from the gathered `CLIENT_STATES_KEY` value."""
  return {int(k): [np.asarray(a[row]) for a in gathered['update']]
          for row, k in enumerate(np.asarray(gathered['weight']))}
