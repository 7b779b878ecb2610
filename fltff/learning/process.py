"""Composing a method's learning process from TFF templates, and the `Algorithm` record.

Every global method of the library is `compose_learning_process(initial weights, broadcast,
client work, aggregator, optimizer finalizer)`; a method changes only the piece that defines
it (a regulariser in the client work, an aggregation factory, the server optimizer).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np

from fltff.errors import ConfigError
from fltff.learning import client_work as client_work_lib
from fltff.learning import protocol
from fltff.learning.model_spec import ModelSpec
from fltff.learning.model_spec import type_num_bytes


@dataclasses.dataclass
class Algorithm(protocol.FederatedAlgorithm):
  """A built global method (`protocol.FederatedAlgorithm` over a TFF LearningProcess).

  Attributes:
    name: Method name for logs and reports.
    build_process: Builds `process`, the `tff.learning.templates.LearningProcess` whose client
      data is `client_work.client_input(...)` per participant: on first use, so that rounds
      with vectorised client work never trace TFF's per-client client work.
    model_spec: The model it trains.
    bytes_down_per_client: Bytes the server sends one participant per round (from the TFF type
      of the broadcast value).
    bytes_up_per_client: Bytes one participant sends the server per round (from the TFF type of
      the client work's result: update and weight).
  """

  name: str
  build_process: Callable[[], Any]
  model_spec: ModelSpec
  bytes_down_per_client: int
  bytes_up_per_client: int
  # Methods with per-client state (SCAFFOLD's c_i): `client_state_init()` gives a new client's
  # state (a list of arrays, passed in via `client_input(client_state=...)`), and the process's
  # `client_work` measurements hold the participants' new states under `client_states_key`
  # (gathered as OrderedDict(update=arrays with a leading [K] axis, weight=client_index[K])).
  client_state_init: Optional[Callable[[], list]] = None
  client_states_key: Optional[str] = None
  # Methods whose state is indexed by client (FedAdp/FedLayerWise's smoothed angles,
  # SCAFFOLD's and MOON's client states): the N it is sized for. Client indices must be < N.
  num_clients: Optional[int] = None
  # The composed pieces (distributor, the client work's `initialize`, aggregator, finalizer),
  # which vectorised rounds run, and a builder of the client work's vectorised twin
  # (`fltff.learning.vectorized.VectorizedClientWork`): set by `build_algorithm` for the
  # default client work only.
  components: Optional[tuple] = None
  vectorized_fn: Optional[Callable[[Optional[str]], Any]] = None
  _vectorized: Any = dataclasses.field(default=None, repr=False)

  @functools.cached_property
  def process(self):
    """The `tff.learning.templates.LearningProcess` (built on first use)."""
    return self.build_process()

  # -- protocol.FederatedAlgorithm -----------------------------------------------------------
  def initialize(self, call: protocol.Call = protocol.direct_call):
    """The process's initial state with the model spec's initial weights (so every method of a
    run starts from the same model). Vectorised: the same state (`compose_learning_process`'s
    `LearningAlgorithmState`) from the pieces the rounds run."""
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

  @property
  def has_client_state(self) -> bool:
    return self.client_state_init is not None

  def initial_client_state(self, client_index: int):
    del client_index
    return None if self.client_state_init is None else self.client_state_init()

  def client_input(self, batches, client_index: int, epochs: int, client_state=None):
    # Vectorised client work reads the info and state in Python: no datasets for them.
    return client_work_lib.client_input(batches, client_index, epochs, client_state=client_state,
                                        state_in_dataset=not self.vectorized,
                                        info_in_dataset=not self.vectorized)

  def next(self, state, server_input, client_inputs: Sequence,
           call: protocol.Call = protocol.direct_call) -> protocol.RoundOutput:
    """`process.next(state, client_inputs)` after checking the clients' indices in Python; the
    participants' new client states come from the client work's measurements."""
    from fltff.learning.client_state import unpack_client_states  # pylint: disable=g-import-not-at-top

    if server_input is not None:
      raise ValueError(f'{self.name} takes no server input.')
    clients = [client_work_lib.client_index_of_input(c) for c in client_inputs]
    self.check_client_indices(clients)
    if self.vectorized:
      output = self._vectorized_next(state, client_inputs, call)
    else:
      output = call(self.process.next, state, client_inputs)
    others = dict(output.metrics)
    client_work = dict(others.pop('client_work'))
    train = client_work.pop('train')
    client_states = {}
    if self.client_states_key is not None:
      client_states = unpack_client_states(client_work.pop(self.client_states_key))
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
    """Whether `trained_weights` can give the participants' models (vectorised rounds, on a
    model whose weights are all trainable: `trained_weights` gives trainable weights only)."""
    return self.vectorized and not self.model_spec.initial_weights().non_trainable

  def trained_weights(self) -> Optional[tuple]:
    """The last round's participants' models after local training (one `[K, ...]` array per
    trainable tensor, in the order of the round's clients), or None when the round did not run
    the vectorised client work."""
    work = getattr(self._vectorized, '_work', self._vectorized)  # MOON's and SCAFFOLD's wrap it.
    return getattr(work, 'last_trained', None)

  def _vectorized_next(self, state, client_inputs: Sequence, call: protocol.Call):
    """`process.next` with the client work run by `VectorizedClientWork`: the composition of
    `tff.learning.templates.compose_learning_process` (distributor, client work, aggregator,
    finalizer; same state and measurements), each other piece run by `call` as TFF computes
    it."""
    import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

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
                    weight_fields: Optional[Sequence[str]] = None,
                    frozen: Sequence[int] = (),
                    client_work=None,
                    client_weighting: str = 'num_examples') -> Algorithm:
  """Builds a FedAvg-family method as a composed `tff.learning` LearningProcess.

  Args:
    name: Method name.
    model_spec: The model.
    client_optimizer: `tff.learning.optimizers.Optimizer` for local steps.
    server_optimizer: `tff.learning.optimizers.Optimizer` applying the aggregated delta.
    regularizer: Optional local regulariser (see `client_work.LocalRegularizer`).
    model_aggregator: Any `tff.aggregators.WeightedAggregationFactory`; default
      `MeanFactory()`, the sample-weighted mean of FedAvg. fltff's factories (CCN, FedNova,
      FedAdp/FedLayerWise) say which extra weight fields they need (`weight_fields`).
    weight_fields: Extra fields of the update weight (`client_work.WEIGHT_FIELDS`):
      `client_index`, `latent_mean`, `local_steps`. None: the aggregator's `weight_fields`
      (none for TFF's own factories, whose weight stays the float example count).
    frozen: Trainable tensors kept fixed during local training (FedBABU's head).
    client_work: A `ClientWorkProcess` replacing the default local training (SCAFFOLD's).
    client_weighting: The base weight ν of each participant's update: 'num_examples' (n_k,
      FedAvg's sample-weighted mean) or 'uniform' (1, the unweighted mean of the FedProx and
      FedLap papers). The aggregator (and CCN on top of it) weights by ν.
  """
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

  client_work_lib.check_client_weighting(client_weighting)
  if client_work is not None and client_weighting != 'num_examples':
    raise ConfigError(f'client_weighting={client_weighting!r} applies to the default client '
                      f'work only; {name} builds its own.')

  if isinstance(model_aggregator, tff.aggregators.UnweightedAggregationFactory):
    # E.g. TFF's DP factories: the unweighted mean of the updates, ν ignored (as in TFF's
    # build_weighted_fed_avg).
    model_aggregator = tff.aggregators.as_weighted_aggregator(model_aggregator)
  if weight_fields is None:
    weight_fields = tuple(getattr(model_aggregator, 'weight_fields', ()))
  weights_type = model_spec.weights_type()

  distributor = tff.learning.templates.build_broadcast_process(weights_type)
  default_client_work = client_work is None
  if default_client_work:
    # TFF's client work is traced only when a round runs it (not for vectorised rounds).
    result_type = client_work_lib.client_result_type(model_spec, weight_fields)
    client_work_initialize = client_work_lib.build_stateless_initialize()
  else:
    result_type = client_work.next.type_signature.result.result.member
    client_work_initialize = client_work.initialize
  if model_aggregator is None:
    model_aggregator = tff.aggregators.MeanFactory()
  aggregator = model_aggregator.create(result_type.update, result_type.update_weight)
  finalizer = tff.learning.templates.build_apply_optimizer_finalizer(server_optimizer,
                                                                     weights_type)

  def build_process():
    @tff.tensorflow.computation
    def initial_model_weights_fn():
      return tff.learning.models.ModelWeights.from_model(model_spec.tff_model())

    work = client_work
    if default_client_work:
      work = client_work_lib.build_client_work(
          model_spec, client_optimizer, regularizer, weight_fields=weight_fields, frozen=frozen,
          client_weighting=client_weighting)
    return tff.learning.templates.compose_learning_process(
        initial_model_weights_fn, distributor, work, aggregator, finalizer)

  def vectorized_fn(device, factor_dense=True):
    from fltff.learning.vectorized import VectorizedClientWork  # pylint: disable=g-import-not-at-top
    return VectorizedClientWork(model_spec, client_optimizer, regularizer,
                                weight_fields=weight_fields, frozen=frozen,
                                client_weighting=client_weighting, device=device,
                                factor_dense=factor_dense, batch_norm=True)
  return Algorithm(
      name=name,
      build_process=build_process,
      model_spec=model_spec,
      components=(distributor, client_work_initialize, aggregator, finalizer),
      # A client work of the user's own: fltff cannot know its arithmetic to vectorise it.
      vectorized_fn=vectorized_fn if default_client_work else None,
      # The distributor broadcasts the full ModelWeights; each client uploads its
      # ClientResult (update and weight) to the aggregator.
      bytes_down_per_client=type_num_bytes(weights_type),
      bytes_up_per_client=type_num_bytes(result_type),
  )


def ccn_name(name: str, model_aggregator) -> str:
  """`name`, with '+ccn' when `model_aggregator` applies client contribution normalisation."""
  return f'{name}+ccn' if getattr(model_aggregator, 'temperature', None) else name
