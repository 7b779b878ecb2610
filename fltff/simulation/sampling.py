"""Seeded per-round client sampling and per-round seeds."""

from __future__ import annotations

from typing import Optional

import numpy as np

from fltff.config_checks import check_number
from fltff.errors import ConfigError


def round_rng(seed: int, round_num: int, stream: int = 0) -> np.random.Generator:
  """A generator that depends only on (seed, round, stream): resumable, order-independent."""
  return np.random.default_rng([int(seed), int(round_num), int(stream)])


def num_participants(num_clients: int, clients_per_round: Optional[int] = None,
                     client_fraction: Optional[float] = None) -> int:
  """Participants per round from a count or a fraction C (McMahan et al.: m = max(C·K, 1))."""
  if clients_per_round is not None and client_fraction is not None:
    raise ConfigError('Set either experiment.clients_per_round or experiment.client_fraction, '
                      'not both.')
  if client_fraction is not None:
    check_number('experiment.client_fraction', client_fraction, low=0, high=1, open_low=True)
    return max(int(round(client_fraction * num_clients)), 1)
  if clients_per_round is None:
    return num_clients
  if not 1 <= clients_per_round <= num_clients:
    raise ConfigError(f'experiment.clients_per_round must be between 1 and the number of '
                      f'clients ({num_clients}), got {clients_per_round}.')
  return int(clients_per_round)


def sample_clients(num_clients: int, m: int, seed: int, round_num: int) -> np.ndarray:
  """Indices of the `m` participants of `round_num`, sorted, without replacement."""
  if m >= num_clients:
    return np.arange(num_clients)
  return np.sort(round_rng(seed, round_num).choice(num_clients, size=m, replace=False))


def shuffle_seed(seed: int, round_num: int, client_index: int) -> int:
  """Seed of a client's local data order in a round."""
  return int(round_rng(seed, round_num, stream=1 + client_index).integers(0, 2**31 - 1))


# Random streams of a round: 0 samples participants, 1 + k orders client k's data; stragglers
# use their own stream so that changing the straggler setting leaves the rest unchanged.
_STRAGGLER_STREAM = 2**31 - 1


def straggler_plan(clients: np.ndarray, local_epochs: int, fraction: float, mode: str,
                   seed: int, round_num: int) -> tuple[dict[int, int], set[int]]:
  """Epochs per participant and the dropped ones, for a round with stragglers.

  A `fraction` of the participants are stragglers (FedProx's system heterogeneity, Li et al.
  2020, §5.2): with `mode='partial'` each completes a uniformly random number of local epochs
  in [1, E] and sends what it has; with `mode='drop'` they are dropped from the round (FedAvg's
  behaviour), always keeping at least one participant.
  """
  epochs = {int(k): int(local_epochs) for k in clients}
  count = straggler_count(len(clients), fraction, mode)
  if count == 0:
    return epochs, set()
  rng = round_rng(seed, round_num, stream=_STRAGGLER_STREAM)
  stragglers = [int(k) for k in rng.choice(clients, size=count, replace=False)]
  if mode == 'drop':
    return epochs, set(stragglers)
  for k in stragglers:
    epochs[k] = int(rng.integers(1, local_epochs + 1))
  return epochs, set()


def straggler_count(participants: int, fraction: float, mode: str) -> int:
  """How many of a round's `participants` straggle: round(fraction × m), Python's rounding
  (0.5 × 5 is 2); with `mode='drop'` at most m − 1."""
  count = int(round(fraction * participants))
  return min(count, participants - 1) if mode == 'drop' else count


def check_stragglers(participants: int, local_epochs: int, fraction: float, mode: str) -> None:
  """`ConfigError` for stragglers asked for (`fraction` > 0) that never change a round: none
  of `participants` straggles, or a partial straggler trains the `local_epochs` = 1 all do."""
  if not fraction:
    return
  if mode == 'partial' and local_epochs == 1:
    raise ConfigError("experiment.straggler_mode = 'partial': a straggler trains a random "
                      'number of epochs in [1, experiment.local_epochs], with local_epochs = '
                      "1 as many as the others; use more epochs or straggler_mode = 'drop'.")
  if not straggler_count(participants, fraction, mode):
    rounded = straggler_count(participants, fraction, 'partial')  # Not capped at m − 1.
    raise ConfigError(
        f'experiment.straggler_fraction = {fraction:g} of {participants} participant(s) a round '
        'gives no straggler (' + ("'drop' keeps one); use " if rounded else (
            f'{fraction * participants:g} rounds to 0); use at least {1 / participants:.3g}, '
            'or ')) + 'more participants.')
