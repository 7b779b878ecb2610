"""The one shape of every fltff method: a round with the server state and the participants'
client states passed in and returned explicitly.

The shape follows FedJAX's `FederatedAlgorithm` (`init`/`apply`, client states in and out);
underneath, each method keeps its TFF template (a `tff.learning` LearningProcess for the global
methods, so `tff.learning.programs.train_model` can drive them; an `IterativeProcess` for the
personalised ones). A round, for any method:

    state = algorithm.initialize(call)
    inputs = [algorithm.client_input(batches_k, k, epochs_k, client_state_k) for k in P]
    server_input = algorithm.server_input(P, [client_state_k], [n_k])   # None: the method has none
    out = algorithm.next(state, server_input, inputs, call)             # a `RoundOutput`
    # out.state: the new server state; out.client_states: {k: k's new state} for k in P.

A method without client state returns `{}`; FedAvg-family methods with state (SCAFFOLD's
c_i, MOON's previous model) and personalised ones (personal model, server copy, Ω) return the
participants' new states the same way, and one `ClientStateStore` keeps them between rounds
(`fltff.simulation.driver.RoundDriver`, the only round loop; `run_round` is its core, also used
by `pipelines.bench`). `call(fn, *args)` runs a TFF computation (the runtime's failover
wrapper; default: a plain call).

Server-side memory that is indexed by client but never leaves the server (FedAdp's and
FedLayerWise's smoothed angles, KAPC's relationship cube R) is server state, not client state.
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
  """What one round of any method returns.

  Attributes:
    state: The new server state.
    client_states: `{client index: its new state}` for the round's participants (empty for a
      method without client state).
    train: The training metrics (`loss`, `accuracy`, `num_examples`).
    measurements: The process's other measurements (nested; scalars go to metrics.csv,
      arrays to the per-round JSONL).
    clients: The participants, in the order of `bytes_down`/`bytes_up`.
    bytes_down, bytes_up: Bytes sent to / received from each participant (float64 `[P]`).
    arrays: Extra per-round arrays to log (e.g. KAPC's Ω per participant).
    server_seconds: Time of the method's Python-side server bookkeeping (inside `next`).
  """
  state: Any
  client_states: dict
  train: Mapping
  measurements: dict
  clients: list
  bytes_down: np.ndarray
  bytes_up: np.ndarray
  arrays: dict = dataclasses.field(default_factory=dict)
  server_seconds: float = 0.0


class FederatedAlgorithm:
  """The protocol every built method implements (see the module docstring).

  Attributes set by implementations: `name`, `process` (the TFF template), `model_spec`,
  `num_clients` (N the method's state is sized for; None: any), `personalized` (True: every
  client is evaluated with its own model; there is no global model), `personal_models` (clients
  keep personal models, `personal_weights`), `bytes_down_per_client`
  and `bytes_up_per_client` (the most a participant receives / sends per round: the channel
  model's sizes).
  """
  name: str
  model_spec: Any
  bytes_down_per_client: int
  bytes_up_per_client: int
  num_clients: Optional[int] = None
  personalized: bool = False
  personal_models: bool = False
  # `device -> vectorised client work` where the method can vectorise its clients, and the
  # work once `vectorize_clients` made it (the round runs it instead of the TFF client work).
  vectorized_fn: Optional[Callable[[Optional[str]], Any]] = None
  _vectorized: Any = None
  # Why `experiment.client_work = 'auto'` left the clients unvectorised (None otherwise).
  client_work_reason: Optional[str] = None

  # -- state ---------------------------------------------------------------------------------
  def initialize(self, call: Call = direct_call):
    """The server state at round 0."""
    raise NotImplementedError

  @property
  def has_client_state(self) -> bool:
    """Whether clients carry a state between rounds (the store keeps it)."""
    return False

  def initial_client_state(self, client_index: int):
    """A client's state before its first round (nested NumPy), or None without client state."""
    del client_index
    return None

  @property
  def vectorized(self) -> bool:
    """Whether `vectorize_clients` switched the round to the vectorised client work (its
    client inputs then carry their info as plain values, not as a dataset)."""
    return self._vectorized is not None

  # -- one round -----------------------------------------------------------------------------
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

  def vectorize_clients(self, device: Optional[str] = None, factor_dense: bool = True) -> None:
    """Run each round's client work for all participants in one vectorised TensorFlow step
    (`experiment.client_work`, `fltff.learning.vectorized`) from now on: the work
    `vectorized_fn(device, factor_dense)` makes (the builders set it where the method can);
    `ConfigError` for a method that cannot. `factor_dense=False`: no Dense kernel is trained
    in factored form (`experiment.factor_dense`, `fltff.learning.factored_dense`)."""
    if self.vectorized_fn is not None:
      self._vectorized = self.vectorized_fn(device, factor_dense)
      return
    raise ConfigError(f'{self.name} cannot vectorise its clients: its client work is not '
                      f"one of fltff's (experiment.client_work = 'vectorised' supports every fltff method "
                      f'built by its builders, which know their client work).')

  # -- evaluation, communication, outputs ----------------------------------------------------
  def global_model_weights(self, state):
    """The global model (`tff.learning.models.ModelWeights`), or None for personalised methods."""
    del state
    return None

  finetunes: bool = False  # Whether the method fine-tunes before testing (FedBABU).
  reports_trained_weights: bool = False  # Whether `trained_weights` gives the round's models.

  def trained_weights(self) -> Optional[tuple]:
    """The last round's participants' models after local training (one `[K, ...]` array per
    trainable tensor, in the round's client order), where the method reports them; else None."""
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
    """`ConfigError` when an index is outside `[0, num_clients)`."""
    check_client_indices(self.name, self.num_clients, indices)


def check_client_indices(name: str, num_clients: Optional[int], indices: Sequence[int]) -> None:
  """`ConfigError` naming the indices of `indices` outside `[0, num_clients)`."""
  if num_clients is None:
    return
  bad = sorted({int(k) for k in indices if not 0 <= int(k) < num_clients})
  if bad:
    raise ConfigError(f'{name} was built for num_clients={num_clients} clients (indices 0-'
                      f'{num_clients - 1}), but got client index(es) {bad}: build it with the '
                      f'real number of clients.')


def run_round(algorithm: FederatedAlgorithm, state, clients: Sequence[int],
              batches_of: Callable[[int], Any], epochs_of: Callable[[int], int],
              num_examples_of: Callable[[int], float], client_state_of: Callable[[int], Any],
              call: Call = direct_call) -> tuple[RoundOutput, float]:
  """One round of any method for the participants `clients`: builds their inputs (data and own
  state), the server input, runs `algorithm.next`; returns the output and the seconds spent in
  it (the method's Python server bookkeeping excluded, reported as `server_seconds`).

  Client states are returned, not stored: the caller commits `out.client_states` once the round
  is known to be good.
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
