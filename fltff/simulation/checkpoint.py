"""Round checkpoints: process state, client state store and metric history, written atomically.

A checkpoint is `checkpoints/round_XXXXX.npz` (all arrays) and `round_XXXXX.json` (round, metric
rows so far); `latest.json` names the newest complete pair. Files are written under a temporary
name and renamed, so a killed run never corrupts the last checkpoint; one damaged later (a
truncated copy, a full disk, a hand-edited `latest.json`) is skipped with a warning on restore.
"""

from __future__ import annotations

import json
import os
import re
import zipfile
import zlib
from collections.abc import Callable
from typing import Any, Optional

import numpy as np
import tensorflow as tf

from fltff.errors import CheckpointError
from fltff.errors import ConfigError
from fltff.errors import warn
from fltff.simulation.outputs import atomic_write
from fltff.simulation.outputs import atomic_write_json

_ROUND_FILE = re.compile(r'round_(\d{5,})\.npz')
# What reading a damaged (truncated, overwritten, hand-edited) checkpoint file raises.
_DAMAGE = (OSError, EOFError, ValueError, KeyError, TypeError, zipfile.BadZipFile, zlib.error)


class Checkpointer:
  """Saves and restores the driver's state under `<output_dir>/checkpoints`."""

  def __init__(self, output_dir: str, keep: int = 3, durable: bool = True):
    """`durable=False` skips the `fsync`s (for `pipelines.bench --checkpoints` to time them)."""
    self.directory = os.path.join(output_dir, 'checkpoints')
    self._latest = os.path.join(self.directory, 'latest.json')
    self.keep = keep
    self.durable = durable

  def save(self, round_num: int, process_state: Any, meta: dict,
           extra_arrays: Optional[dict[str, np.ndarray]] = None) -> str:
    """Writes round `round_num`; `meta` must be JSON-able."""
    os.makedirs(self.directory, exist_ok=True)
    stem = self.path(round_num)
    arrays = {f'state/{i}': np.asarray(leaf)
              for i, leaf in enumerate(tf.nest.flatten(process_state))}
    arrays.update(extra_arrays or {})

    def write_npz(tmp):
      # `np.savez`'s layout, with the zip closed on every path (a failed np.savez leaves its
      # ZipFile to a finaliser that fails noisily at exit).
      with zipfile.ZipFile(tmp, 'w', zipfile.ZIP_STORED, allowZip64=True) as archive:
        for name, array in arrays.items():
          with archive.open(f'{name}.npy', 'w', force_zip64=True) as f:
            np.lib.format.write_array(f, np.asanyarray(array), allow_pickle=False)

    atomic_write(stem + '.npz', write_npz, self.durable)
    atomic_write_json(stem + '.json', dict(meta, round=round_num), self.durable)
    self.mark_latest(round_num)
    for old in self.rounds()[:-self.keep]:
      self.remove(old)
    return stem

  def path(self, round_num: int, ext: str = '') -> str:
    """Round `round_num`'s checkpoint file (`ext` '.npz' or '.json'), or their common stem."""
    return os.path.join(self.directory, f'round_{round_num:05d}{ext}')

  def mark_latest(self, round_num: int) -> None:
    """Names round `round_num` the newest complete checkpoint (`latest.json`)."""
    atomic_write_json(self._latest, {'round': round_num}, self.durable)

  def rounds(self) -> list[int]:
    """Rounds with a checkpoint file on disk, oldest first (damaged ones included)."""
    if not os.path.isdir(self.directory):
      return []
    # Other files there (a user's `round_backup.npz`, editor copies) are not checkpoints.
    return sorted(int(m.group(1)) for m in map(_ROUND_FILE.fullmatch, os.listdir(self.directory))
                  if m)

  def latest_round(self) -> Optional[int]:
    """The newest checkpointed round: the round `latest.json` names, or a newer round file's
    (`restore` resumes the newest intact one)."""
    rounds = self.rounds()
    try:
      with open(self._latest) as f:
        named = int(json.load(f)['round'])
    except _DAMAGE:
      return rounds[-1] if rounds else None
    return max([named] + rounds[-1:])

  def intact_round(self) -> Optional[int]:
    """The newest round whose checkpoint a resume can read (its metadata parses and its arrays
    file is a whole zip): what a stopped run truly keeps, e.g. after a full disk cut a write."""
    for round_num in reversed(self.rounds()):
      try:
        with open(self.path(round_num, '.json')) as f:
          json.load(f)
        with zipfile.ZipFile(self.path(round_num, '.npz')):
          return round_num
      except _DAMAGE:
        continue
    return None

  def recorded(self) -> Optional[dict]:
    """The run record (`{'config': ..., 'data': ..., 'model': ...}`) of the newest checkpoint
    whose metadata reads; None if there is none or it predates the record."""
    for round_num in reversed(self.rounds()):
      try:
        with open(self.path(round_num, '.json')) as f:
          return json.load(f).get('run')
      except _DAMAGE:
        continue
    return None

  def restore(self, process_state_template: Any,
              warn_fn: Callable[[str], None] = warn) -> tuple[int, Any, dict, dict]:
    """`(round, process_state, meta, other_arrays)` of the newest intact checkpoint, skipping
    damaged ones (and `latest.json`) with one `warn_fn` line. Raises `FileNotFoundError` if
    there is none, `CheckpointError` if none is intact."""
    latest, problems = None, []
    try:
      with open(self._latest) as f:
        latest = int(json.load(f)['round'])
    except _DAMAGE as e:
      if os.path.exists(self._latest):
        problems.append(f'{self._latest} is damaged ({_describe(e)})')
    # Round files are written atomically: the newest intact one wins over a stale `latest.json`
    # (a crash between the two writes, or a restored copy).
    candidates = list(reversed(self.rounds()))
    if latest is not None and latest not in candidates:
      problems.append(f'latest.json names round {latest}, whose checkpoint is missing')
    elif latest is not None and candidates and candidates[0] > latest:
      problems.append(f'latest.json names round {latest} but round {candidates[0]} is newer')
    for round_num in candidates:
      stem = self.path(round_num)
      try:
        with np.load(stem + '.npz', allow_pickle=False) as data:
          arrays = {k: data[k] for k in data.files}  # Reads (and CRC-checks) every array.
        with open(stem + '.json') as f:
          meta = json.load(f)
        if int(meta['round']) != round_num or not isinstance(meta.get('rows', []), list):
          raise ValueError(f'{stem}.json describes round {meta["round"]}')
      except _DAMAGE as e:
        problems.append(f'checkpoint round {round_num} is damaged ({_describe(e)})')
        continue
      if problems:
        warn_fn(f'{"; ".join(problems)}; resuming from round {round_num}.')
      # `state/i` leave `arrays` for the process state, packed like the template.
      template_leaves = tf.nest.flatten(process_state_template)
      if any(f'state/{i}' not in arrays for i in range(len(template_leaves))):
        raise ConfigError(f'The checkpoint holds fewer state tensors than the process has '
                          f'({len(template_leaves)}): was it written by another model/method?')
      leaves = [arrays.pop(f'state/{i}') for i in range(len(template_leaves))]
      for i, (saved, ref) in enumerate(zip(leaves, template_leaves)):
        if np.shape(saved) != np.shape(ref):
          raise ConfigError(f'Checkpoint tensor {i} has shape {np.shape(saved)}, the process '
                            f'expects {np.shape(ref)}: was it written by another model/method?')
      return (round_num, tf.nest.pack_sequence_as(process_state_template, leaves), meta, arrays)
    if not candidates and not problems:
      raise FileNotFoundError(self.directory)
    raise CheckpointError(
        f'No intact checkpoint to resume from in {self.directory}: '
        f'{"; ".join(problems) or "no round files"}. Move that folder away or choose another '
        '--output_dir to start again.')

  def remove(self, round_num: int) -> None:
    """Deletes round `round_num`'s checkpoint files."""
    for ext in ('.npz', '.json'):
      if os.path.exists(self.path(round_num, ext)):
        os.remove(self.path(round_num, ext))


def _describe(error: BaseException) -> str:
  """One line naming a read error, e.g. 'BadZipFile: File is not a zip file'."""
  lines = str(error).strip().splitlines()
  return f'{type(error).__name__}: {lines[0]}' if lines else type(error).__name__


def kept_message(directory: str, last_round: int) -> str:
  """The sentence saying what a stopped run keeps, true in every case (no round completed too)."""
  if last_round < 1:
    return 'No completed round is in a checkpoint'
  rounds = 'Round 1 is' if last_round == 1 else f'Rounds 1-{last_round} are'
  return f'{rounds} kept in the checkpoint under {directory}'
