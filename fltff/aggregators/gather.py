"""Single-pass gathering of every participant's update and weight at the server
(docs/architecture.md): one `federated_aggregate` whose accumulator concatenates client values
along a new leading axis (merging is another concatenation), so TFF's mergeable context can split
a round across workers. No `tff.federated_select` (wrong rows in the mergeable context), no
aggregate depending on another ("Detected one aggregate dependent on another").
"""

from __future__ import annotations

import collections

import tensorflow as tf
import tensorflow_federated as tff


def build_gather(value_type, weight_type):
  """`(gather, its result type)`: `(value@CLIENTS, weight@CLIENTS) -> gathered@SERVER`.

  `gathered = OrderedDict(update=tuple of [K, ...] (the flattened value), weight=<the weight with
  a leading [K] axis>)`, rows in TFF's merge order: per-client data (e.g. a client index) must
  travel inside the weight."""
  specs = collections.OrderedDict(
      update=tuple(tf.nest.flatten(tff.types.type_to_tf_tensor_specs(value_type))),
      weight=tff.types.type_to_tf_tensor_specs(weight_type))

  @tff.tensorflow.computation
  def zero():  # Zero rows, the leading dimension unknown ([None, ...]).
    return tf.nest.map_structure(lambda s: tf.compat.v1.placeholder_with_default(
        tf.zeros([0, *s.shape], s.dtype), [None, *s.shape]), specs)

  acc_type = zero.type_signature.result

  @tff.tensorflow.computation(acc_type, (value_type, weight_type))
  def accumulate(acc, client_value):
    update, weight = client_value
    element = collections.OrderedDict(update=tuple(tf.nest.flatten(update)), weight=weight)
    return tf.nest.map_structure(lambda a, x: tf.concat([a, tf.expand_dims(x, 0)], 0), acc,
                                 element, check_types=False)

  @tff.tensorflow.computation(acc_type, acc_type)
  def merge(a, b):
    return tf.nest.map_structure(lambda x, y: tf.concat([x, y], 0), a, b)

  report = tff.tensorflow.computation(lambda acc: acc, acc_type)

  @tff.federated_computation(tff.FederatedType(value_type, tff.CLIENTS),
                             tff.FederatedType(weight_type, tff.CLIENTS))
  def gather(value, weight):
    return tff.federated_aggregate(tff.federated_zip((value, weight)), zero(), accumulate,
                                   merge, report)

  return gather, acc_type


def build_gathering_process(value_type, weight_type, initial_state,
                            server_update) -> tff.templates.AggregationProcess:
  """An aggregation process of one `build_gather`, then `server_update(state, gathered) ->
  (new state, aggregate, measurements)` at the server (TF); `initial_state`: a no-argument TF
  function giving the state."""
  gather, gathered_type = build_gather(value_type, weight_type)
  init_state = tff.tensorflow.computation(initial_state)
  update = tff.tensorflow.computation(server_update, init_state.type_signature.result,
                                      gathered_type)

  @tff.federated_computation
  def init_fn():
    return tff.federated_eval(init_state, tff.SERVER)

  @tff.federated_computation(init_fn.type_signature.result,
                             tff.FederatedType(value_type, tff.CLIENTS),
                             tff.FederatedType(weight_type, tff.CLIENTS))
  def next_fn(state, value, weight):
    new_state, aggregate, measurements = tff.federated_map(update, (state, gather(value, weight)))
    return tff.templates.MeasuredProcessOutput(new_state, aggregate, measurements)

  return tff.templates.AggregationProcess(init_fn, next_fn)
