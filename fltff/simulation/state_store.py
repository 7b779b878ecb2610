"""The per-client state store (DESIGN.md: stateful clients).

Personal models, smoothed angles, control variates and stale layers live here, keyed by client
index, as nested NumPy structures. The round driver owns it, feeds participants' entries to a
process as CLIENTS-placed values, writes the outputs back, and saves it in checkpoints.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np
import tensorflow as tf


class ClientStateStore:
  """Client index → nested NumPy state, with lazy initialisation and (de)serialisation."""

  def __init__(self, init_fn: Optional[Callable[[int], Any]] = None):
    self._init_fn = init_fn
    self._states: dict[int, Any] = {}

  def __len__(self) -> int:
    return len(self._states)

  def __contains__(self, client_index: int) -> bool:
    return client_index in self._states

  def get(self, client_index: int) -> Any:
    """The client's state, created with `init_fn` on first use."""
    if client_index not in self._states:
      if self._init_fn is None:
        raise KeyError(f'No state for client {client_index} and no init_fn.')
      self._states[client_index] = tf.nest.map_structure(np.asarray,
                                                         self._init_fn(client_index))
    return self._states[client_index]

  def set(self, client_index: int, state: Any) -> None:
    self._states[client_index] = tf.nest.map_structure(np.asarray, state)

  def to_arrays(self, prefix: str = 'client') -> dict[str, np.ndarray]:
    """Flat `{name: array}` for `np.savez`; structure comes back through `from_arrays`."""
    out = {}
    for index, state in self._states.items():
      for j, leaf in enumerate(tf.nest.flatten(state)):
        out[f'{prefix}/{index}/{j}'] = leaf
    return out

  def load_arrays(self, arrays: dict[str, np.ndarray], template_fn: Callable[[int], Any],
                  prefix: str = 'client') -> None:
    """Restores states saved by `to_arrays`; `template_fn(i)` gives each state's structure."""
    leaves: dict[int, dict[int, np.ndarray]] = {}
    for key, value in arrays.items():
      parts = key.split('/')
      if len(parts) == 3 and parts[0] == prefix:
        leaves.setdefault(int(parts[1]), {})[int(parts[2])] = value
    self._states = {}
    for index, by_pos in leaves.items():
      template = template_fn(index)
      flat = [by_pos[j] for j in range(len(by_pos))]
      self._states[index] = tf.nest.pack_sequence_as(template, flat)
