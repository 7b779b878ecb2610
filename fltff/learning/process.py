"""Composing a method's learning process from TFF templates, and the `Algorithm` record.

Every global method is `compose_learning_process(initial weights, broadcast, client work,
aggregator, optimizer finalizer)` and changes only the piece that defines it (a regulariser in
the client work, an aggregation factory, the server optimizer).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np
import tensorflow as tf

from fltff.config_checks import check_choice
from fltff.errors import ConfigError
from fltff.learning import client_work as client_work_lib
from fltff.learning import protocol
from fltff.learning.model_spec import ModelSpec
from fltff.learning.model_spec import type_num_bytes


@dataclasses.dataclass(frozen=True)
class Algorithm(protocol.FederatedAlgorithm):
  """A built global method (`protocol.FederatedAlgorithm` over a TFF LearningProcess), complete
  and immutable (`with_vectorized_clients` returns a new one).

  Attributes:
    build_process: Builds `process` (client data: `client_work.client_input(...)`) on first
      use, so vectorised rounds never trace TFF's per-client work.
    bytes_down_per_client: Bytes sent to one participant per round (TFF type of the broadcast).
    bytes_up_per_client: Bytes one participant sends per round (TFF type of update and weight).
  """

  name: str
  build_process: Callable[[], Any]
  model_spec: ModelSpec
  bytes_down_per_client: int
  bytes_up_per_client: int
  client_state_init: Optional[Callable[[], list]] = None  # A new client's state (SCAFFOLD's c_i).
  num_clients: Optional[int] = None  # N that client-indexed state is sized for; indices < N.
  # The composed pieces (distributor, client work `initialize`, aggregator, finalizer) that
  # vectorised rounds run, and `(device, factor_dense) ->` their client work.
  components: Optional[tuple] = None
  vectorized_fn: Optional[Callable[..., Any]] = None
  finetunes: bool = False  # Evaluation fine-tunes the global model first (FedBABU).
  _vectorized: Any = dataclasses.field(default=None, repr=False, compare=False)

  @functools.cached_property
  def process(self):
    """The `tff.learning.templates.LearningProcess` (built on first use)."""
    return self.build_process()

  def initialize(self, call: protocol.Call = protocol.direct_call):
    """The initial state, with the spec's initial weights (all methods of a run start alike)."""
    import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

    if self.vectorized:
      distributor, client_work_initialize, aggregator, finalizer = self.components
      return tff.learning.templates.LearningAlgorithmState(
          global_model_weights=self.model_spec.initial_weights(),
          distributor=call(distributor.initialize),
          client_work=call(client_work_initialize), aggregator=call(aggregator.initialize),
          finalizer=call(finalizer.initialize))
    state = call(self.process.initialize)
    return self.process.set_model_weights(state, self.model_spec.initial_weights())

  def client_input(self, batches, client_index: int, epochs: int, client_state=None):
    # Vectorised client work reads info and state in Python: no datasets.
    return client_work_lib.client_input(batches, client_index, epochs, client_state=client_state,
                                        state_in_dataset=not self.vectorized,
                                        info_in_dataset=not self.vectorized,
                                        input_spec=self.model_spec.input_spec)

  def next(self, state, server_input, client_inputs: Sequence,
           call: protocol.Call = protocol.direct_call) -> protocol.RoundOutput:
    """`process.next` after checking the client indices; new client states from measurements."""
    from fltff.learning import client_state  # pylint: disable=g-import-not-at-top

    if server_input is not None:
      raise ValueError(f'{self.name} takes no server input.')
    clients = [client_work_lib.client_info_of_input(c)['client_index'] for c in client_inputs]
    self.check_client_indices(clients)
    if self.vectorized:
      output = self._vectorized_next(state, client_inputs, call)
    else:
      output = call(self.process.next, state, client_inputs)
    others = dict(output.metrics)
    client_work = dict(others.pop('client_work'))
    train = client_work.pop('train')
    client_states = {}
    if self.has_client_state:
      client_states = client_state.unpack_client_states(
          client_work.pop(client_state.CLIENT_STATES_KEY))
    return protocol.RoundOutput(
        state=output.state, client_states=client_states, train=train,
        measurements=dict(others, client_work=client_work), clients=clients,
        bytes_down=np.full(len(clients), float(self.bytes_down_per_client)),
        bytes_up=np.full(len(clients), float(self.bytes_up_per_client)))

  def global_model_weights(self, state):
    if self.vectorized:
      return state.global_model_weights
    return self.process.get_model_weights(state)

  @property
  def reports_trained_weights(self) -> bool:
    """Whether `trained_weights` gives the models: in vectorised rounds."""
    return self.vectorized

  def trained_weights(self):
    """The last round's trained models (`ModelWeights` of `[K, ...]` tensors), None unless
    vectorised."""
    return self.vectorized_work().last_trained if self.vectorized else None

  def _vectorized_next(self, state, client_inputs: Sequence, call: protocol.Call):
    """`process.next` with `VectorizedClientWork` as client work (same state and measurements)."""
    import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top
    from fltff.runtime.in_process import InProcessContext  # pylint: disable=g-import-not-at-top

    if not isinstance(tff.framework.get_context_stack().current, InProcessContext):
      raise ConfigError(  # Not TFF's "deserialize federated value with no data" from a worker.
          f"{self.name}'s vectorised rounds run on the in-process executor: call them inside "
          '`with runtime.InProcessRuntime():`, or on a C++ runtime after `rt.place(algorithm)` '
          '(its workers then train the clients).')
    distributor, _, aggregator, finalizer = self.components
    distributed = call(distributor.next, state.distributor, state.global_model_weights)
    client_work_state, results, client_work_measurements = self._vectorized.next(
        state.client_work, state.global_model_weights, client_inputs, call)
    aggregated = call(aggregator.next, state.aggregator, *results.aggregator_arguments())
    finalized = call(finalizer.next, state.finalizer, state.global_model_weights,
                     aggregated.result)
    new_state = tff.learning.templates.LearningAlgorithmState(
        finalized.result, distributed.state, client_work_state, aggregated.state,
        finalized.state)
    metrics = collections.OrderedDict(
        distributor=distributed.measurements, client_work=client_work_measurements,
        aggregator=aggregated.measurements, finalizer=finalized.measurements)
    return tff.learning.templates.LearningProcessOutput(new_state, metrics)


def build_algorithm(name: str,
                    model_spec: ModelSpec,
                    client_optimizer,
                    server_optimizer,
                    regularizer: Optional[client_work_lib.LocalRegularizer] = None,
                    model_aggregator=None,
                    frozen: Sequence[int] = (),
                    client_work=None,
                    client_weighting: str = 'num_examples',
                    vectorized_fn: Optional[Callable[..., Any]] = None,
                    extra_bytes_per_client: int = 0,
                    **description) -> Algorithm:
  """Builds a FedAvg-family method as a composed `tff.learning` LearningProcess.

  Args:
    client_optimizer: `tff.learning.optimizers.Optimizer` for local steps.
    server_optimizer: `tff.learning.optimizers.Optimizer` applying the aggregated delta.
    model_aggregator: Any `tff.aggregators.WeightedAggregationFactory` (default `MeanFactory()`,
      FedAvg's weighted mean); an unweighted one is wrapped and ignores ν.
    frozen: Trainable tensors kept fixed during local training (FedBABU's head).
    client_work: A `ClientWorkProcess` replacing the default local training (SCAFFOLD's).
    client_weighting: Each update's base weight ν: 'num_examples' (n_k) or 'uniform' (1, only
      with the default client work, else `ConfigError`).
    vectorized_fn: `client_work`'s vectorised twin, `(device, factor_dense) -> work` (the
      default client work has its own); None with `client_work`: it cannot be vectorised.
    extra_bytes_per_client: Bytes sent each way besides model and update (SCAFFOLD's controls).
    **description: `Algorithm`'s `num_clients`, `client_state_init`, `finetunes`.
  """
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

  check_choice('client_weighting', client_weighting, client_work_lib.CLIENT_WEIGHTINGS)
  if client_work is not None and client_weighting != 'num_examples':
    raise ConfigError(f'client_weighting={client_weighting!r} applies to the default client '
                      f'work only; {name} builds its own.')

  if isinstance(model_aggregator, tff.aggregators.UnweightedAggregationFactory):
    # E.g. TFF's DP factories; ν ignored, as in TFF's build_weighted_fed_avg.
    model_aggregator = tff.aggregators.as_weighted_aggregator(model_aggregator)
  statistics = tuple(getattr(model_aggregator, 'client_statistics', ()))
  plain_mean = model_aggregator is None  # TFF's `MeanFactory()`: a group's mean may stand in.
  weights_type = model_spec.weights_type()

  distributor = tff.learning.templates.build_broadcast_process(weights_type)
  default_client_work = client_work is None
  if default_client_work:
    # TFF's client work is traced only when a round runs it.
    result_type = client_work_lib.client_result_type(model_spec, statistics)
    client_work_initialize = client_work_lib.build_stateless_initialize()
  else:
    result_type = client_work.next.type_signature.result.result.member
    client_work_initialize = client_work.initialize
  if model_aggregator is None:
    model_aggregator = tff.aggregators.MeanFactory()
  finalizer = tff.learning.templates.build_apply_optimizer_finalizer(server_optimizer,
                                                                     weights_type)
  if len(weights_type.non_trainable):  # BatchNorm's moving statistics.
    aggregator, finalizer = build_statistics_mean(model_aggregator, result_type, finalizer)
  else:
    aggregator = model_aggregator.create(result_type.update, result_type.update_weight)

  def build_process():
    @tff.tensorflow.computation
    def initial_model_weights_fn():
      return tff.learning.models.ModelWeights.from_model(model_spec.tff_model())

    work = client_work
    if default_client_work:
      work = client_work_lib.build_client_work(
          model_spec, client_optimizer, regularizer, client_statistics=statistics, frozen=frozen,
          client_weighting=client_weighting)
    return tff.learning.templates.compose_learning_process(
        initial_model_weights_fn, distributor, work, aggregator, finalizer)

  def default_vectorized_fn(device, factor_dense=True):
    from fltff.learning.vectorized import VectorizedClientWork  # pylint: disable=g-import-not-at-top
    return VectorizedClientWork(model_spec, client_optimizer, regularizer,
                                client_statistics=statistics, frozen=frozen,
                                client_weighting=client_weighting, device=device,
                                factor_dense=factor_dense, batch_norm=True,
                                mean_aggregation=plain_mean)
  return Algorithm(
      name=name,
      build_process=build_process,
      model_spec=model_spec,
      components=(distributor, client_work_initialize, aggregator, finalizer),
      vectorized_fn=default_vectorized_fn if default_client_work else vectorized_fn,
      bytes_down_per_client=type_num_bytes(weights_type) + extra_bytes_per_client,
      bytes_up_per_client=type_num_bytes(result_type) + extra_bytes_per_client,
      **description)


def build_statistics_mean(model_aggregator, result_type, finalizer) -> tuple:
  """`(aggregator, finalizer)` for a model with BatchNorm moving statistics s: the update
  `ModelWeights(delta, s − s_k)` (`client_work.with_moving_statistics`) has its delta aggregated
  by `model_aggregator`, its statistics part averaged beside by a `MeanFactory()` with the
  update's weight ν; `finalizer` applies the delta, then s ← Σ ν_k s_k / Σ ν_k (unchanged without
  weight). ν_k = n_k by default, as the PyTorch reference code (MOON's, PFLlib, FL-bench)
  averages the whole state_dict: our choice where the papers are silent."""
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

  update_type, weight_type = result_type.update, result_type.update_weight
  state_type, weights_type, _ = finalizer.next.type_signature.parameter
  inner = model_aggregator.create(update_type.trainable, weight_type)
  mean = tff.aggregators.MeanFactory().create(update_type.non_trainable,
                                              tff.TensorType(np.float32))

  @tff.federated_computation(inner.next.type_signature.parameter[0], tff.FederatedType(
      update_type, tff.CLIENTS), tff.FederatedType(weight_type, tff.CLIENTS))
  def aggregate(state, update, weight):
    output = inner.next(state, update.trainable, weight)
    nu = weight.num_examples if isinstance(weight_type, tff.StructType) else weight
    change = mean.next(mean.initialize(), update.non_trainable, nu).result
    return tff.templates.MeasuredProcessOutput(output.state, tff.federated_zip(
        tff.learning.models.ModelWeights(output.result, change)), output.measurements)

  @tff.tensorflow.computation(weights_type.member, update_type.non_trainable)
  def set_statistics(weights, change):
    return tff.learning.models.ModelWeights(weights.trainable, tf.nest.map_structure(
        tf.subtract, weights.non_trainable, change))

  @tff.federated_computation(state_type, weights_type,
                             tff.FederatedType(update_type, tff.SERVER))
  def finalize(state, weights, update):
    output = finalizer.next(state, weights, update.trainable)
    return tff.templates.MeasuredProcessOutput(output.state, tff.federated_map(
        set_statistics, (output.result, update.non_trainable)), output.measurements)

  return (tff.templates.AggregationProcess(inner.initialize, aggregate),
          tff.learning.templates.FinalizerProcess(finalizer.initialize, finalize))


def build_averaging_method(name: str, model_spec: ModelSpec, client_optimizer, server_optimizer,
                           server_learning_rate: float, model_aggregator, **kwargs) -> Algorithm:
  """`build_algorithm` for a method of the FedAvg family: named `name`, '+ccn' with a CCN
  `model_aggregator`; the default client optimizer for None, the server step
  `optimizers.server_sgd`; `kwargs` as there."""
  from fltff.learning import optimizers  # pylint: disable=g-import-not-at-top

  return build_algorithm(
      f'{name}+ccn' if getattr(model_aggregator, 'temperature', None) else name, model_spec,
      optimizers.default_client_optimizer(client_optimizer),
      optimizers.server_sgd(server_optimizer, server_learning_rate, name),
      model_aggregator=model_aggregator, **kwargs)
