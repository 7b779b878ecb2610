"""The protocol every fltff method implements, in the shape of FedJAX's `FederatedAlgorithm`
(docs/api.md). `call(fn, *args)` runs a TFF computation (the runtime's failover wrapper;
default: a plain call). `RoundDriver` (`fltff.simulation.driver`, built on `run_round`) is the
only round loop. Per-client memory that never leaves the server (FedAdp's angles, KAPC's R) is
server state.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

import numpy as np

from fltff.errors import ConfigError

Call = Callable[..., Any]


def direct_call(fn, *args):
  """`call` without a runtime wrapper."""
  return fn(*args)


@dataclasses.dataclass
class RoundOutput:
  """What one round of any method returns."""
  state: Any
  client_states: dict  # `{client index: new state}` of the participants (`{}`: stateless).
  train: Mapping  # Training metrics: `loss`, `accuracy`, `num_examples`.
  measurements: dict  # The rest, nested: scalars go to metrics.csv, arrays to the JSONL.
  clients: list  # The participants, in the order of the byte counts.
  bytes_down: np.ndarray  # Bytes sent to each participant (float64 `[P]`).
  bytes_up: np.ndarray  # Bytes received from each participant.
  arrays: dict = dataclasses.field(default_factory=dict)  # Extra arrays to log (KAPC's Ω).
  server_seconds: float = 0.0  # The method's Python server bookkeeping inside `next`.


class FederatedAlgorithm:
  """The protocol every built method implements (`process`: its TFF template); built complete,
  it never changes (`with_vectorized_clients` returns a new one)."""
  name: str
  model_spec: Any
  bytes_down_per_client: int  # The most a participant receives per round (channel sizes).
  bytes_up_per_client: int  # The most a participant sends per round.
  num_clients: Optional[int] = None  # N the state is sized for; None: any.
  client_state_init: Optional[Callable[[], Any]] = None  # A new client's state; None: none.
  personalized: bool = False  # Clients are evaluated with their own models; no global model.
  personal_models: bool = False  # Clients keep personal models (`personal_weights`).
  # `(device, factor_dense) -> vectorised client work` where possible; the work it made.
  vectorized_fn: Optional[Callable[..., Any]] = None
  _vectorized: Any = None

  def initialize(self, call: Call = direct_call):
    """The server state at round 0."""
    raise NotImplementedError

  @property
  def has_client_state(self) -> bool:
    """Whether clients carry a state between rounds (the store keeps it)."""
    return self.client_state_init is not None

  def initial_client_state(self, client_index: int):
    """A client's state before its first round (nested NumPy), or None without client state."""
    del client_index
    return None if self.client_state_init is None else self.client_state_init()

  @property
  def vectorized(self) -> bool:
    """Whether rounds run the vectorised client work (client info then as plain values)."""
    return self._vectorized is not None

  def vectorized_work(self):
    """The `VectorizedClientWork` that trains the participants; None unless vectorised."""
    return getattr(self._vectorized, '_work', self._vectorized)  # MOON's, SCAFFOLD's wrap it.

  def client_input(self, batches, client_index: int, epochs: int, client_state=None):
    """One participant's CLIENTS-placed input: its data, index, epochs and own state."""
    raise NotImplementedError

  def server_input(self, clients: Sequence[int], client_states: Sequence,
                   num_examples: Sequence[float]):
    """The round's SERVER-placed input (None for methods without one)."""
    del clients, client_states, num_examples
    return None

  def next(self, state, server_input, client_inputs: Sequence,
           call: Call = direct_call) -> RoundOutput:
    """One round: the new server state and the participants' new client states."""
    raise NotImplementedError

  def with_vectorized_clients(self, device: Optional[str] = None, factor_dense: bool = True):
    """This method running all participants' client work as one vectorised TensorFlow step.

    `vectorized_fn(device, factor_dense)` builds it (`fltff.learning.vectorized`);
    `factor_dense=False` trains no Dense kernel in factored form. Raises `ConfigError` for a
    method without `vectorized_fn`."""
    if self.vectorized_fn is not None:
      return dataclasses.replace(self, _vectorized=self.vectorized_fn(device, factor_dense))
    raise ConfigError(f'{self.name} cannot vectorise its clients: its client work is not '
                      f"one of fltff's (experiment.client_work = 'vectorised' supports every fltff method "
                      f'built by its builders, which know their client work).')

  def global_model_weights(self, state):
    """The global model (`tff.learning.models.ModelWeights`), or None for personalised methods."""
    del state
    return None

  finetunes: bool = False  # Whether the method fine-tunes before testing (FedBABU).
  reports_trained_weights: bool = False  # Whether `trained_weights` gives the round's models.

  def trained_weights(self):
    """The last round's trained models (`ModelWeights` of `[K, ...]` tensors, client order), or
    None."""
    return None

  def personal_weights(self, state, client_state):
    """The personal model of the client with state `client_state` (`personal_models`)."""
    raise NotImplementedError(f'{self.name} keeps no personal models.')

  def round_files(self, state) -> dict[str, np.ndarray]:
    """Arrays written next to each checkpoint (`{file name: array}`), e.g. KAPC's R."""
    del state
    return {}

  def summary_extras(self, num_clients: int) -> dict:
    """Method-specific entries of summary.json."""
    del num_clients
    return {}

  def check_client_indices(self, indices: Sequence[int]) -> None:
    """`ConfigError` naming the indices of `indices` outside `[0, num_clients)`."""
    n = self.num_clients
    bad = [] if n is None else sorted({int(k) for k in indices if not 0 <= int(k) < n})
    if bad:
      raise ConfigError(f'{self.name} was built for num_clients={n} clients (indices 0-{n - 1}), '
                        f'but got client index(es) {bad}: build it with the real number of '
                        f'clients.')


def run_round(algorithm: FederatedAlgorithm, state, clients: Sequence[int],
              batches_of: Callable[[int], Any], epochs_of: Callable[[int], int],
              num_examples_of: Callable[[int], float], client_state_of: Callable[[int], Any],
              call: Call = direct_call) -> tuple[RoundOutput, float]:
  """One round of any method for `clients`: builds the inputs and runs `algorithm.next`.

  Returns `(out, seconds in next)`, Python server bookkeeping excluded (in `out.server_seconds`).
  Client states are not stored: the caller commits `out.client_states` once the round is good.
  """
  clients = [int(k) for k in clients]
  states = [client_state_of(k) for k in clients] if algorithm.has_client_state else [None] * len(
      clients)
  inputs = [algorithm.client_input(batches_of(k), k, epochs_of(k), s)
            for k, s in zip(clients, states)]
  server_start = time.perf_counter()
  server_input = algorithm.server_input(clients, states, [num_examples_of(k) for k in clients])
  # Only a method with a server input has server-side bookkeeping to time.
  server_seconds = 0.0 if server_input is None else time.perf_counter() - server_start
  start = time.perf_counter()
  out = algorithm.next(state, server_input, inputs, call)
  seconds = time.perf_counter() - start - out.server_seconds
  out.server_seconds += server_seconds
  return out, seconds
