"""FedLap personalisation: a persistent purely local model mixed layer by layer with the global.

Thesis extension of FedLap. Each client keeps its own model, trained only on its own data when
it takes part (kept in the driver's client state store across skipped rounds). Its personalised
model is `p_l = β_l w_l^local + (1 − β_l) w_l^global` per layer l, with `mixing`:

* `'fixed'`: β_l = `degree` for every layer.
* `'dissimilarity'` (default): β_l = clip(degree · D_l / mean_l' D_l', 0, 1), D_l ∈ [0, 1] the
  mean over the layer's rows of FedLap's λ_lj / 2, λ_lj = 1 − cos(w_lj^local, w_lj^global).
  Layers where the local model moved away (client-specific features) are personalised more;
  where both agree the better-trained global weights stay. The mean β over layers is `degree`.

A client that never trained locally is evaluated with the global model (β = 0).
`with_fedlap_personalization` adds this to any global method; client states become
`OrderedDict(local=<its local model>[, method=<the method's client state>])`.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import gin
import numpy as np

from fltff.config_checks import check_choice
from fltff.config_checks import check_number
from fltff.errors import ConfigError
from fltff.learning import client_work as client_work_lib
from fltff.learning import optimizers
from fltff.learning import protocol


def layer_dissimilarities(local: Sequence[np.ndarray], global_: Sequence[np.ndarray],
                          layers: Sequence[Sequence[int]]) -> np.ndarray:
  """D_l = mean over the rows of layer l of λ_lj / 2 (FedLap's λ), in [0, 1]."""
  from fltff.learning.fedlap import neuron_dissimilarities  # pylint: disable=g-import-not-at-top

  lambdas = [np.asarray(x) for x in neuron_dissimilarities(local, global_)]
  return np.array([np.concatenate([lambdas[i] for i in g]).mean() / 2.0 for g in layers])


def mixing_coefficients(dissimilarities: np.ndarray, degree: float, mixing: str) -> np.ndarray:
  """β_l per layer (module docstring)."""
  mean = float(np.mean(dissimilarities))
  if mixing == 'fixed' or mean <= 0.0:
    return np.full(len(dissimilarities), degree)
  return np.clip(degree * dissimilarities / mean, 0.0, 1.0)


def mix_layers(local: Sequence[np.ndarray], global_: Sequence[np.ndarray],
               layers: Sequence[Sequence[int]], betas: np.ndarray) -> list[np.ndarray]:
  """p_l = β_l local_l + (1 − β_l) global_l for every tensor of every layer."""
  out = [np.asarray(g).copy() for g in global_]
  for beta, group in zip(betas, layers):
    for i in group:
      out[i] = beta * np.asarray(local[i]) + (1.0 - beta) * np.asarray(global_[i])
  return out


class FedLapPersonalization:
  """Local models, their federated update computation and the personalised mixing."""

  def __init__(self, model_spec, optimizer, degree: float = 0.5,
               mixing: str = 'dissimilarity'):
    check_number('personalization.degree', degree, low=0, high=1)
    check_choice('personalization.mixing', mixing, ('fixed', 'dissimilarity'))
    self.degree, self.mixing = float(degree), mixing
    self.layers = model_spec.trainable_layers()[0]
    self.model_spec, self.optimizer = model_spec, optimizer
    self.local_update = client_work_lib.build_local_update(model_spec, optimizer)

  def personalized_weights(self, local, global_):
    """ModelWeights-like OrderedDict(trainable, non_trainable) of the personalised model."""
    d = layer_dissimilarities(local['trainable'], global_.trainable, self.layers)
    betas = mixing_coefficients(d, self.degree, self.mixing)
    return collections.OrderedDict(
        trainable=mix_layers(local['trainable'], global_.trainable, self.layers, betas),
        non_trainable=[np.asarray(x) for x in global_.non_trainable])


class _LocalModelInput(collections.namedtuple('_LocalModelInput', ['method', 'local'])):
  """A participant's input with local models: the method's input and its local model."""


class FedLapPersonalized(protocol.FederatedAlgorithm):
  """A global method plus each client's persistent local model and personalised evaluation."""

  personal_models = True

  def __init__(self, algorithm: protocol.FederatedAlgorithm,
               personalization: FedLapPersonalization):
    if algorithm.personalized:
      raise ConfigError(f'{algorithm.name} is personalised already; remove '
                        'experiment.personalization.')
    self.inner = algorithm
    self.personalization = personalization
    self.name = algorithm.name
    self.model_spec = algorithm.model_spec
    self.num_clients = algorithm.num_clients
    self.bytes_down_per_client = algorithm.bytes_down_per_client
    self.bytes_up_per_client = algorithm.bytes_up_per_client
    self._local_work = None  # `vectorize_clients`.
    self._initial_local = algorithm.model_spec.initial_weights()  # NumPy `ModelWeights`.

  @property
  def process(self):
    """The inner method's process (built on first use; vectorised rounds never need it)."""
    return self.inner.process

  def initialize(self, call: protocol.Call = protocol.direct_call):
    return self.inner.initialize(call)

  def vectorize_clients(self, device=None, factor_dense: bool = True) -> None:
    """Vectorises the method's clients (else `ConfigError`) and the local models' training."""
    from fltff.learning.vectorized import VectorizedClientWork  # pylint: disable=g-import-not-at-top

    self.inner.vectorize_clients(device, factor_dense)
    self._local_work = VectorizedClientWork(self.personalization.model_spec,
                                            self.personalization.optimizer, device=device,
                                            factor_dense=factor_dense, batch_norm=True)

  @property
  def vectorized(self) -> bool:
    return self._local_work is not None

  has_client_state = True  # Overrides the protocol's property.

  def initial_client_state(self, client_index: int) -> collections.OrderedDict:
    """The initial model as the local model (a client that never took part trains from it)."""
    state = collections.OrderedDict(local=collections.OrderedDict(
        (key, [w.copy() for w in value]) for key, value in self._initial_local._asdict().items()))
    if self.inner.has_client_state:
      state['method'] = self.inner.initial_client_state(client_index)
    return state

  def client_input(self, batches, client_index: int, epochs: int, client_state=None):
    return _LocalModelInput(
        self.inner.client_input(batches, client_index, epochs, client_state.get('method')),
        client_state['local'])

  def server_input(self, clients, client_states, num_examples):
    return self.inner.server_input(clients, [s.get('method') for s in client_states],
                                   num_examples)

  def next(self, state, server_input, client_inputs, call=protocol.direct_call):
    """The method's round, then each participant's local model trained on the same data."""
    inputs = [c.method for c in client_inputs]
    out = self.inner.next(state, server_input, inputs, call)
    if self._local_work is None:
      updated = call(self.personalization.local_update, [c.local for c in client_inputs], inputs)
    else:
      updated = self._vectorized_local_update([c.local for c in client_inputs], inputs)
    client_states = {}
    for index, weights in updated:
      k = int(index)
      client_states[k] = collections.OrderedDict(local=collections.OrderedDict(
          trainable=[np.asarray(w) for w in weights.trainable],
          non_trainable=[np.asarray(w) for w in weights.non_trainable]))
      if self.inner.has_client_state:
        client_states[k]['method'] = out.client_states[k]
    out.client_states = client_states
    return out

  def _vectorized_local_update(self, local_models, inputs) -> list:
    """`(client index, trained ModelWeights)` per participant, as `local_update` returns them."""
    import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top
    from fltff.learning.vectorized import stack_clients  # pylint: disable=g-import-not-at-top

    start = stack_clients([tuple(model['trainable']) for model in local_models])
    statistics = None
    if len(local_models[0]['non_trainable']):  # A BatchNorm model's, each local model's own.
      statistics = stack_clients([tuple(model['non_trainable']) for model in local_models])
    # The method's clients read these datasets this round: read them afresh, as TFF would.
    out, _ = self._local_work.train(inputs, start=start, statistics=statistics,
                                    read_before_elsewhere=True)
    trained = [t.numpy() for t in out['trained']]
    moved = [t.numpy() for t in out.get('non_trainable', ())]
    return [(client_work_lib.client_index_of_input(data),
             tff.learning.models.ModelWeights(
                 trainable=[t[k] for t in trained],
                 non_trainable=[t[k] for t in moved] if moved else list(model['non_trainable'])))
            for k, (data, model) in enumerate(zip(inputs, local_models))]

  def global_model_weights(self, state):
    return self.inner.global_model_weights(state)

  def personal_weights(self, state, client_state):
    return self.personalization.personalized_weights(client_state['local'],
                                                     self.inner.global_model_weights(state))

  def round_files(self, state) -> dict:
    return self.inner.round_files(state)

  def summary_extras(self, num_clients: int) -> dict:
    return self.inner.summary_extras(num_clients)


def with_fedlap_personalization(algorithm: protocol.FederatedAlgorithm,
                                personalization: FedLapPersonalization) -> FedLapPersonalized:
  """`algorithm` with FedLap personalisation's local models (module docstring)."""
  return FedLapPersonalized(algorithm, personalization)


@gin.configurable('fedlap_personalization')
def build_fedlap_personalization(model_spec, degree: float = 0.5,
                                 mixing: str = 'dissimilarity',
                                 client_optimizer=None) -> FedLapPersonalization:
  """Gin entry: `experiment.personalization = @fedlap_personalization`."""
  return FedLapPersonalization(
      model_spec, client_optimizer or optimizers.default_client_optimizer(), degree, mixing)
