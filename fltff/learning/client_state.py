"""Client work for global methods whose clients carry a state shaped like the trainable weights.

SCAFFOLD's c_i and MOON's previous model are kept in the round driver's store; a state comes in
with the client data (a one-element dataset under `state`) and the new states go out, keyed by
client index, through one gathering aggregate (`fltff.aggregators.gather`) under
`CLIENT_STATES_KEY`. `build_stateful_client_work` (client by client) and
`VectorizedStatefulWork` (all participants together) share the method's functions.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np
import tensorflow as tf

from fltff.learning import client_work as client_work_lib
from fltff.learning.model_spec import ModelSpec

# Where the gathered new client states appear in the process's client-work measurements.
CLIENT_STATES_KEY = 'client_states'


def build_stateful_client_work(
    model_spec: ModelSpec,
    optimizer,
    regularizer_fn: Callable[[Any, Any, Any], Any],
    client_terms: Callable[[Any, tuple], Any],
    client_final: Callable[[dict, tuple], tuple],
    server_init_fn: Optional[Callable[[], Any]] = None,
    server_update_fn: Optional[Callable[[Any, Any], Any]] = None,
    weight_fields: Sequence[str] = (),
    step_observers: Sequence[client_work_lib.StepObserver] = ()):
  """A `ClientWorkProcess` whose clients read and return a state shaped like the weights.

  Each participant trains (`client_work.build_local_training`) with the regulariser
  `regularizer_fn(keras model, initial weights, client_terms(server_value, client_state))`;
  `client_terms` and `client_final` as `VectorizedStatefulWork`'s, `client_state` being
  `data['state']`'s element and `server_value` the broadcast server state (None without one).

  Args:
    server_init_fn: No-arg TF function giving the server state (SCAFFOLD's c); None: none.
    server_update_fn: `(server_state, summed contributions) -> new server state`; given
      exactly when `server_init_fn` is (else `ValueError`).
    weight_fields: As in `client_work.build_client_work`.

  Returns:
    `(process, TFF type of one client's state)`; the process measures `train` and, under
    `CLIENT_STATES_KEY`, `OrderedDict(update=[K, ...] new states, weight=client_index[K])`.
  """
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top
  from fltff.aggregators.gather import build_gather  # pylint: disable=g-import-not-at-top

  if (server_init_fn is None) != (server_update_fn is None):
    raise ValueError('server_init_fn and server_update_fn go together.')
  client_work_lib.check_weight_fields(weight_fields)
  with tf.Graph().as_default():
    metrics_aggregation_fn = tff.learning.metrics.sum_then_finalize(
        model_spec.metric_finalizers())
  specs = model_spec.trainable_specs()
  state_type = tff.types.to_type(tuple((s.dtype.as_numpy_dtype, tuple(s.shape.as_list()))
                                       for s in specs))
  weights_type, data_type = client_work_lib.client_types(model_spec, state_type=state_type)

  def run_client(initial_weights, server_value, data):
    zero = tuple(tf.zeros(s.shape, s.dtype) for s in specs)
    client_state = client_work_lib.read_single(data['state'], zero)
    keras_model = model_spec.keras_fn()
    regularizer = regularizer_fn(keras_model, initial_weights,
                                 client_terms(server_value, client_state))
    out = client_work_lib.build_local_training(
        keras_model, optimizer, regularizer,
        latent_fn=client_work_lib.latent_fn_for(keras_model, weight_fields),
        step_observers=step_observers)(initial_weights, data['batches'], data['info'])
    result = client_work_lib.client_result(initial_weights, data, out, weight_fields)
    new_state, contribution = client_final(out, client_state)
    return (result, out['metrics'], tuple(new_state), client_work_lib.client_index_of(data),
            contribution)

  gather, _ = build_gather(state_type, tff.TensorType(np.int32))

  if server_init_fn is None:

    @tff.tensorflow.computation(weights_type, data_type)
    def client_update(initial_weights, data):
      return run_client(initial_weights, None, data)[:4]

    init_fn = client_work_lib.build_stateless_initialize()

  else:

    @tff.tensorflow.computation
    def initial_server_state():
      return server_init_fn()

    server_type = initial_server_state.type_signature.result

    @tff.tensorflow.computation(weights_type, server_type, data_type)
    def client_update(initial_weights, server_value, data):  # pylint: disable=function-redefined
      return run_client(initial_weights, server_value, data)

    @tff.federated_computation
    def init_fn():  # pylint: disable=function-redefined
      return tff.federated_eval(initial_server_state, tff.SERVER)

    @tff.tensorflow.computation(server_type, client_update.type_signature.result[4])
    def update_server_state(server_state, contribution_sum):
      return server_update_fn(server_state, contribution_sum)

  @tff.federated_computation(init_fn.type_signature.result,
                             tff.FederatedType(weights_type, tff.CLIENTS),
                             tff.FederatedType(data_type, tff.CLIENTS))
  def next_fn(state, weights, client_data):
    if server_init_fn is None:
      result, model_outputs, new_states, indices = tff.federated_map(
          client_update, (weights, client_data))
      new_server_state = state
    else:
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
  """A stateful method's client work for a round's participants together.

  `work` trains each participant with the regulariser from its row of `client_terms(server
  state, client states)`; `client_final(out, client states)` gives `(new states, server
  contributions)`, `server_update` the server state from their sum. `next` returns the same
  state and measurements as the `build_stateful_client_work` process."""

  def __init__(self, work, client_terms: Callable[[Any, tuple], tuple],
               client_final: Callable[[dict, tuple], tuple],
               server_update: Optional[Callable[[Any, tuple], Any]] = None):
    self._work = work  # `FederatedAlgorithm.vectorized_work` unwraps it.
    self._client_terms, self._client_final = client_terms, client_final
    self._server_update = server_update

  def next(self, state, global_weights, client_inputs, call=None):
    from fltff.learning.vectorized import stack_clients  # pylint: disable=g-import-not-at-top

    states = stack_clients([tuple(data['state']) for data in client_inputs])
    server_value = tf.nest.map_structure(tf.convert_to_tensor, state)
    results, train, _, out = self._work.round_results(
        global_weights, client_inputs, call, client_terms=self._client_terms(server_value, states))
    new_states, contributions = self._client_final(out, states)
    if self._server_update is not None:
      summed = tuple(tf.reduce_sum(c, axis=0) for c in contributions)
      state = type(state)(np.asarray(v) for v in self._server_update(server_value, summed))
    indices = np.asarray([client_work_lib.client_index_of_input(data) for data in client_inputs],
                         np.int32)
    measurements = collections.OrderedDict(train=train)
    measurements[CLIENT_STATES_KEY] = collections.OrderedDict(
        update=tuple(np.asarray(s) for s in new_states), weight=indices)
    return state, results, measurements


def unpack_client_states(gathered) -> dict[int, list[np.ndarray]]:
  """`{client index: new state (list of arrays)}` from the gathered `CLIENT_STATES_KEY` value."""
  return {int(k): [np.asarray(a[row]) for a in gathered['update']]
          for row, k in enumerate(np.asarray(gathered['weight']))}


def with_client_states(algorithm, client_state_init: Callable[[], list]):
  """Marks `algorithm` as keeping client state, starting from `client_state_init()`."""
  algorithm.client_state_init = client_state_init
  algorithm.client_states_key = CLIENT_STATES_KEY
  return algorithm
