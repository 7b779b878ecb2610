"""A global method plus a persistent personal model per client (FedLap personalisation, Ditto).

Each round runs the global method, then every participant trains its own model on the same
batches, optionally with a `LocalRegularizer` anchored at the round's global model w^t. Client
states: `OrderedDict(local=<personal model>[, method=<the global method's client state>])`.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any, Optional

import numpy as np

from fltff.errors import ConfigError
from fltff.learning import client_work as client_work_lib
from fltff.learning import protocol


@dataclasses.dataclass(frozen=True)
class PersonalTraining:
  """How participants train their personal models and how a personal model is evaluated.

  Attributes:
    model_spec: The model.
    optimizer: The personal models' client optimizer (a `tff.learning.optimizers.Optimizer`).
    personalized_weights: `(personal ModelWeights-like OrderedDict, global ModelWeights) ->
      OrderedDict(trainable, non_trainable)`, the model a client is evaluated with (None: its
      personal model as it is, Ditto's v_k).
    regularizer: A term towards the round's global model w^t (`LocalRegularizer`; its
      `global_` is w^t), or None for plain local training.
  """
  model_spec: Any
  optimizer: Any
  personalized_weights: Optional[Callable[[Any, Any], collections.OrderedDict]] = None
  regularizer: Optional[client_work_lib.LocalRegularizer] = None


# A participant's input: the global method's input and its personal model.
_PersonalModelInput = collections.namedtuple('_PersonalModelInput', ['method', 'local'])


@dataclasses.dataclass(frozen=True)
class WithPersonalModels(protocol.FederatedAlgorithm):
  """A global method plus each client's persistent personal model (module docstring), built by
  `with_personal_models`: complete and immutable (`with_vectorized_clients` returns a new one).
  """
  inner: protocol.FederatedAlgorithm
  personalization: PersonalTraining
  name: str
  local_update: Any  # `client_work.build_local_update`'s computation.
  _local_work: Any = dataclasses.field(default=None, repr=False, compare=False)  # Vectorised.
  # The initial model's NumPy `ModelWeights`: a client's personal model before its first round.
  initial_local: Any = dataclasses.field(default=None, repr=False, compare=False)
  personal_models = True
  has_client_state = True  # Overrides the protocol's property.
  model_spec = property(lambda self: self.inner.model_spec)
  num_clients = property(lambda self: self.inner.num_clients)
  bytes_down_per_client = property(lambda self: self.inner.bytes_down_per_client)
  bytes_up_per_client = property(lambda self: self.inner.bytes_up_per_client)

  @property
  def process(self):
    """The inner method's process (built on first use; vectorised rounds never need it)."""
    return self.inner.process

  def initialize(self, call: protocol.Call = protocol.direct_call):
    return self.inner.initialize(call)

  def with_vectorized_clients(self, device=None, factor_dense: bool = True):
    """A copy with the method's clients (else `ConfigError`) and the personal models' training
    vectorised."""
    from fltff.learning.vectorized import VectorizedClientWork  # pylint: disable=g-import-not-at-top

    personal = self.personalization
    return dataclasses.replace(
        self, inner=self.inner.with_vectorized_clients(device, factor_dense),
        _local_work=VectorizedClientWork(personal.model_spec, personal.optimizer,
                                         personal.regularizer, device=device,
                                         factor_dense=factor_dense, batch_norm=True))

  @property
  def vectorized(self) -> bool:
    return self._local_work is not None

  def vectorized_work(self):
    """The method's vectorised client work (a runtime may train it on its workers; the personal
    models train in this process)."""
    return self.inner.vectorized_work()

  def initial_client_state(self, client_index: int) -> collections.OrderedDict:
    """The initial model as the personal model (a client that never took part trains from it)."""
    state = collections.OrderedDict(local=collections.OrderedDict(
        (key, [w.copy() for w in value]) for key, value in self.initial_local._asdict().items()))
    if self.inner.has_client_state:
      state['method'] = self.inner.initial_client_state(client_index)
    return state

  def client_input(self, batches, client_index: int, epochs: int, client_state=None):
    return _PersonalModelInput(
        self.inner.client_input(batches, client_index, epochs, client_state.get('method')),
        client_state['local'])

  def server_input(self, clients, client_states, num_examples):
    return self.inner.server_input(clients, [s.get('method') for s in client_states],
                                   num_examples)

  def next(self, state, server_input, client_inputs, call=protocol.direct_call):
    """The method's round, then each participant's personal model trained on the same data
    (towards the global model the round started from, w^t, with a regulariser)."""
    inputs = [c.method for c in client_inputs]
    received = self.inner.global_model_weights(state)
    out = self.inner.next(state, server_input, inputs, call)
    locals_ = [c.local for c in client_inputs]
    if self._local_work is None:
      updated = call(self.local_update, locals_, received, inputs)
    else:  # `(client index, (trainable, non-trainable))` per participant, as `local_update`.
      from fltff.learning.vectorized import stack_clients  # pylint: disable=g-import-not-at-top

      # A BatchNorm model trains each local model's own statistics.
      statistics = (stack_clients([tuple(model['non_trainable']) for model in locals_])
                    if len(locals_[0]['non_trainable']) else None)
      anchor = None if self.personalization.regularizer is None else tuple(
          np.asarray(w) for w in received.trainable)
      # The method's clients read these datasets this round: read them afresh, as TFF would.
      result, _ = self._local_work.train(
          inputs, anchor, start=stack_clients([tuple(model['trainable']) for model in locals_]),
          statistics=statistics, read_before_elsewhere=True)
      trained = [t.numpy() for t in result['trained']]
      moved = [t.numpy() for t in result.get('non_trainable', ())]
      updated = [(client_work_lib.client_info_of_input(data)['client_index'],
                  ([t[k] for t in trained],
                   [t[k] for t in moved] if moved else model['non_trainable']))
                 for k, (data, model) in enumerate(zip(inputs, locals_))]
    client_states = {}
    for index, (trainable, non_trainable) in updated:
      k = int(index)
      client_states[k] = collections.OrderedDict(local=collections.OrderedDict(
          trainable=[np.asarray(w) for w in trainable],
          non_trainable=[np.asarray(w) for w in non_trainable]))
      if self.inner.has_client_state:
        client_states[k]['method'] = out.client_states[k]
    out.client_states = client_states
    return out

  def global_model_weights(self, state):
    return self.inner.global_model_weights(state)

  def personal_weights(self, state, client_state):
    weights_of = self.personalization.personalized_weights
    return client_state['local'] if weights_of is None else weights_of(
        client_state['local'], self.inner.global_model_weights(state))

  def round_files(self, state) -> dict:
    return self.inner.round_files(state)

  def summary_extras(self, num_clients: int) -> dict:
    return self.inner.summary_extras(num_clients)


def with_personal_models(algorithm: protocol.FederatedAlgorithm, personal: PersonalTraining,
                         name: Optional[str] = None) -> WithPersonalModels:
  """`algorithm` (a global method) plus personal models trained as `personal` declares; named
  `name` (None: the method's name)."""
  if algorithm.personalized or algorithm.personal_models:  # Ditto's v_k, or these.
    raise ConfigError(f'{algorithm.name} is personalised already; remove '
                      'experiment.personalization.')
  # Built here, not in a round: tracing Keras models in a graph invalidates the eager models
  # built before it (the driver's evaluator).
  return WithPersonalModels(algorithm, personal, name or algorithm.name,
                            client_work_lib.build_local_update(
                                personal.model_spec, personal.optimizer, personal.regularizer),
                            initial_local=algorithm.model_spec.initial_weights())
