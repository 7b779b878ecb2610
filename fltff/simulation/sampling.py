"""Seeded per-round client sampling and per-round seeds."""

from __future__ import annotations

from typing import Optional

import numpy as np

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
    if not 0 < client_fraction <= 1:
      raise ConfigError(f'experiment.client_fraction must be in (0, 1], got {client_fraction}.')
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
