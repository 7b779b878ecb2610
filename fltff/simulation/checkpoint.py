"""Round checkpoints: process state, client state store and metric history, written atomically.

A checkpoint is `checkpoints/round_XXXXX.npz` (all arrays) plus `round_XXXXX.json` (round number
and the metric rows so far); `latest.json` names the newest complete pair. Files are written to a
temporary name and renamed, so a run killed mid-write never corrupts the last checkpoint.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

import numpy as np
import tensorflow as tf


def _atomic_write(path: str, write_fn) -> None:
  tmp = path + '.tmp'
  write_fn(tmp)
  os.replace(tmp, path)


class Checkpointer:
  """Saves and restores the driver's state under `<output_dir>/checkpoints`."""

  def __init__(self, output_dir: str, keep: int = 3):
    self.directory = os.path.join(output_dir, 'checkpoints')
    self.keep = keep

  def save(self, round_num: int, process_state: Any, meta: dict,
           extra_arrays: Optional[dict[str, np.ndarray]] = None) -> str:
    """Writes round `round_num`; `meta` must be JSON-able."""
    os.makedirs(self.directory, exist_ok=True)
    stem = os.path.join(self.directory, f'round_{round_num:05d}')
    arrays = {f'state/{i}': np.asarray(leaf)
              for i, leaf in enumerate(tf.nest.flatten(process_state))}
    arrays.update(extra_arrays or {})

    def write_npz(tmp):
      with open(tmp, 'wb') as f:
        np.savez(f, **arrays)

    _atomic_write(stem + '.npz', write_npz)
    payload = dict(meta, round=round_num)
    _atomic_write(stem + '.json', lambda tmp: _write_json(tmp, payload))
    _atomic_write(os.path.join(self.directory, 'latest.json'),
                  lambda tmp: _write_json(tmp, {'round': round_num}))
    self._prune()
    return stem

  def latest_round(self) -> Optional[int]:
    path = os.path.join(self.directory, 'latest.json')
    if not os.path.exists(path):
      return None
    with open(path) as f:
      return int(json.load(f)['round'])

  def restore(self, process_state_template: Any) -> tuple[int, Any, dict, dict]:
    """Returns `(round, process_state, meta, other_arrays)` of the latest checkpoint."""
    round_num = self.latest_round()
    if round_num is None:
      raise FileNotFoundError(self.directory)
    stem = os.path.join(self.directory, f'round_{round_num:05d}')
    with np.load(stem + '.npz', allow_pickle=False) as data:
      arrays = {k: data[k] for k in data.files}
    with open(stem + '.json') as f:
      meta = json.load(f)
    template_leaves = tf.nest.flatten(process_state_template)
    leaves = [arrays.pop(f'state/{i}') for i in range(len(template_leaves))]
    for i, (saved, ref) in enumerate(zip(leaves, template_leaves)):
      if np.shape(saved) != np.shape(ref):
        raise ValueError(f'Checkpoint tensor {i} has shape {np.shape(saved)}, the process '
                         f'expects {np.shape(ref)}: was it written by another model/method?')
    state = tf.nest.pack_sequence_as(process_state_template, leaves)
    return round_num, state, meta, arrays

  def _prune(self) -> None:
    rounds = sorted(int(n[6:11]) for n in os.listdir(self.directory)
                    if n.startswith('round_') and n.endswith('.npz'))
    for r in rounds[:-self.keep]:
      for ext in ('.npz', '.json'):
        path = os.path.join(self.directory, f'round_{r:05d}{ext}')
        if os.path.exists(path):
          os.remove(path)


def _write_json(path: str, payload: dict) -> None:
  with open(path, 'w') as f:
    json.dump(payload, f, indent=1, sort_keys=True)
