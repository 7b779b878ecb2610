"""Run outputs: metrics.csv, TensorBoard events, summary.json and PNG plots."""

from __future__ import annotations

import contextlib
import csv
import errno
import json
import math
import os
from collections.abc import Sequence
from typing import Optional

from fltff.errors import ConfigError
from fltff.errors import warn

# Besides checkpoints/, what a run leaves that a new run in the same folder would overwrite.
RUN_RESULTS = ('metrics.csv', 'summary.json')


def rounds_to_targets(rows: Sequence[dict], targets: Sequence[float]) -> dict[str, Optional[int]]:
  """First round whose central test accuracy reaches each target (None if never)."""
  return {f'{target:g}': next((r['round'] for r in rows if finite(r.get('test_accuracy'))
                               and r['test_accuracy'] >= target), None) for target in targets}


def finite(value) -> bool:
  """Whether a metrics value is a finite Python number (not '', None or NaN)."""
  return isinstance(value, (int, float)) and math.isfinite(value)


RUN_MARKER = '.fltff-run'  # Written into every run folder: the folder is a fltff run's.
LOCK_FILE = '.fltff-run.lock'
# Run folders this process holds (real path -> open lock file): a lock is per process, so
# `run_experiment` may retake the one `pipelines.run` took.
_HELD_LOCKS: dict = {}
_CREATED: dict[str, str] = {}  # A run folder (real path) -> the outermost folder made for it.


def _lock(output_dir: str) -> None:
  """Holds `<output_dir>/.fltff-run.lock` for the rest of the process (an exclusive `flock`,
  which the kernel releases however the process ends)."""
  import fcntl  # pylint: disable=g-import-not-at-top

  key = os.path.realpath(output_dir)
  if key in _HELD_LOCKS:
    return
  path = os.path.join(output_dir, LOCK_FILE)
  handle = open(path, 'a+')  # pylint: disable=consider-using-with
  try:
    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError:
    handle.seek(0)
    owner = handle.read().strip() or 'another process'
    handle.close()
    raise ConfigError(f'{output_dir} is in use by another run ({owner}); wait for it to end or '
                      'choose another --output_dir.') from None
  handle.seek(0)
  handle.truncate()
  handle.write(f'pid {os.getpid()}\n')
  handle.flush()
  _HELD_LOCKS[key] = handle


def prepare_output_dir(output_dir: str, resume: bool) -> bool:
  """Creates `output_dir`, checks it is writable and locks it for this process, before any work.

  Never writes into a folder holding files not a fltff run's or, without `resume`, an earlier
  run's checkpoints or results (`ConfigError`). Returns whether this call created the folder.
  """
  if os.path.exists(output_dir) and not os.path.isdir(output_dir):
    raise ConfigError(f'--output_dir {output_dir} is an existing file, not a folder; choose '
                      'another --output_dir.')
  existing = sorted(n for n in os.listdir(output_dir) if n != LOCK_FILE) if os.path.isdir(
      output_dir) else []
  # A fltff run's folder has its marker or (runs from before the marker) checkpoints/results.
  if existing and not (RUN_MARKER in existing or any(n in existing for n in RUN_RESULTS)
                       or os.path.isdir(os.path.join(output_dir, 'checkpoints'))):
    shown = ', '.join(existing[:3]) + (', ...' if len(existing) > 3 else '')
    raise ConfigError(f'{output_dir} holds files that are not a fltff run\'s ({shown}) and is '
                      'never written into; choose a new or empty --output_dir.')
  probe = os.path.join(output_dir, f'.fltff_write_test_{os.getpid()}')
  created = not os.path.exists(output_dir)
  top = os.path.abspath(output_dir)  # The outermost folder this call creates.
  while not os.path.exists(os.path.dirname(top)):
    top = os.path.dirname(top)
  try:
    os.makedirs(output_dir, exist_ok=True)
    with open(probe, 'w') as f:
      f.write('ok')
    os.remove(probe)
  except OSError as e:
    # Nothing is left behind: the folders this call made (e.g. those `makedirs` made before a
    # path too long to create) go, deepest first, up to `top`; one not empty stays.
    folder = os.path.abspath(output_dir)
    while created:
      try:
        os.rmdir(folder)
      except (FileNotFoundError, NotADirectoryError):
        pass  # Never made: the path ran out deeper.
      except OSError as cause:
        if cause.errno != errno.ENAMETOOLONG:
          break  # Not empty, or not ours to remove.
      if folder == top or len(folder) <= len(top):
        break
      folder = os.path.dirname(folder)
    raise ConfigError(f'Cannot write to --output_dir {output_dir} ({e.strerror or e}); choose '
                      'a writable folder.') from None
  _lock(output_dir)
  if created:
    _CREATED[os.path.realpath(output_dir)] = top
  if not resume:
    checkpoints = os.path.join(output_dir, 'checkpoints')
    if os.path.isdir(checkpoints) and os.listdir(checkpoints):
      raise ConfigError(
          f'{output_dir} already holds checkpoints of an earlier run; pass --resume to continue '
          'it or choose another --output_dir.')
    found = [name for name in RUN_RESULTS if os.path.exists(os.path.join(output_dir, name))]
    if found:
      raise ConfigError(
          f'{output_dir} already holds {" and ".join(found)} but no checkpoint (a run stopped '
          'before its first checkpoint) and is never overwritten: choose another '
          '--output_dir, or pass --resume to rerun it from round 1 there.')
  with open(os.path.join(output_dir, RUN_MARKER), 'a'):
    pass
  return created


def release_output_dir(output_dir: str) -> None:
  """Releases this process's lock on a run folder (e.g. a run ends in a program that goes on)."""
  handle = _HELD_LOCKS.pop(os.path.realpath(output_dir), None)
  if handle is not None:
    handle.close()


def remove_if_unused(output_dir: str) -> bool:
  """Removes a run folder holding only this process's marker and lock, and the empty folders
  above it that `prepare_output_dir` created; returns whether it removed the run folder."""
  if not os.path.isdir(output_dir) or set(os.listdir(output_dir)) - {RUN_MARKER, LOCK_FILE}:
    return False
  if os.path.realpath(output_dir) not in _HELD_LOCKS:
    return False  # Not this process's folder.
  top = _CREATED.pop(os.path.realpath(output_dir), None)
  for name in (RUN_MARKER, LOCK_FILE):
    with contextlib.suppress(FileNotFoundError):
      os.remove(os.path.join(output_dir, name))
  release_output_dir(output_dir)
  folder = os.path.abspath(output_dir)
  with contextlib.suppress(OSError):  # Stops at a folder that is not empty.
    os.rmdir(folder)
    while top is not None and folder != top:
      folder = os.path.dirname(folder)
      os.rmdir(folder)
  return not os.path.exists(output_dir)


def config_bindings(config_text: str) -> dict[str, str]:
  """`{'scope.param': 'value text'}` of a `gin.operative_config_str()` text (continuation
  lines joined; whitespace normalised)."""
  bindings, key = {}, None
  for line in config_text.splitlines():
    if not line.strip() or line.lstrip().startswith('#'):
      continue
    if line[0].isspace() and key is not None:
      bindings[key] += ' ' + line.strip()
      continue
    key, _, value = (part.strip() for part in line.partition(' = '))
    bindings[key] = value
  return {k: ' '.join(v.split()).replace('[ ', '[').replace(' ]', ']')
          for k, v in bindings.items()}


# Bindings a resumed run may change without changing what it computes: its length, how often
# it checkpoints, where it runs, and where its data files are (their contents are checked by the
# data fingerprint instead).
RESUMABLE_CHANGES = ('experiment.rounds', 'experiment.checkpoint_every', 'runtime.')
_DATA_LOCATIONS = ('.path', '.data_dir', '.cache_dir')
ABSENT = '(not bound)'


def _default_text(key: str) -> Optional[str]:
  """The current code's default of binding `key` ('[scope/]configurable.parameter') as the
  operative config writes it, or None if it has none."""
  from fltff.config_checks import configurable_parameters  # pylint: disable=g-import-not-at-top

  name, _, parameter = key.rpartition('/')[2].rpartition('.')
  found = configurable_parameters(name).get(parameter)
  return None if found is None or found.default is found.empty else repr(found.default)


def is_resumable_change(binding: str) -> bool:
  """Whether `binding` ('scope.param') may change between a run and its resume without
  changing what the run computes: `RESUMABLE_CHANGES` and data locations."""
  return binding.startswith(RESUMABLE_CHANGES) or binding.endswith(_DATA_LOCATIONS)


# Parameters that read as other bindings where a side leaves them unbound (the first bound, else
# the last one's default): the seeds the run passes unless gin binds them (the run seed,
# `fltff.simulation.experiment`), and `pfedla.seed`, which runs recorded before its successor.
FOLLOWS = {'channel_model.seed': ('experiment.seed',),
           'kapc.relationship_seed': ('experiment.seed',),
           'pfedla.relationship_seed': ('pfedla.seed', 'experiment.seed'),
           'pfedla.seed': ('pfedla.relationship_seed', 'experiment.seed')}


def config_changes(earlier: str, now: str, parsed: bool = False) -> list[tuple[str, str, str]]:
  """`(binding, earlier value, value now)` for each binding whose value differs between the
  operative configs (a `FOLLOWS` one a side does not bind read as the bindings it follows),
  except `RESUMABLE_CHANGES` and data locations. A binding in only one of them counts (its
  missing side reads `ABSENT`), e.g. a server optimizer bound only for the resume, unless its
  value is the parameter's default (a parameter fltff added since). `parsed`: `now` is a
  configuration as parsed (`gin.config_str()`), not yet run: a binding only it has (e.g. of a
  configurable the run never calls) is no change."""
  a, b = config_bindings(earlier), config_bindings(now)

  def value_now(key: str) -> Optional[str]:
    return b.get(_parsed_binding(key, b) if parsed else key)

  changes = []
  for key in sorted(set(a) | set(b)):
    if parsed and key not in a:
      continue
    follows = (key, *FOLLOWS.get(key, ()))
    old, value = (next(filter(None, map(get, follows)), None) for get in (a.get, value_now))
    if old == value or is_resumable_change(key):
      continue
    if (old is None or value is None) and (old or value) == _default_text(follows[-1]):
      continue
    changes.append((key, ABSENT if old is None else old, ABSENT if value is None else value))
  return changes


def _parsed_binding(key: str, parsed: dict[str, str]) -> Optional[str]:
  """The binding of `parsed` (`config_bindings` of a configuration as parsed) that a call
  recorded as operative `key` reads: `a/b/f.x` reads `a/b/f.x`, else `a/f.x`, else `f.x`."""
  *scopes, name = key.split('/')
  return next((k for k in ('/'.join(scopes[:i] + [name]) for i in range(len(scopes), -1, -1))
               if k in parsed), None)


def unread_bindings(parsed: str, operative: str) -> list[str]:
  """The bindings (and macros) of configuration `parsed` (`gin.config_str()`) that no call
  recorded in `operative` (`gin.operative_config_str()`) read: gin ignores them without a word
  (a parameter of a method, partitioner or source the run does not use)."""
  bindings = config_bindings(parsed)
  read = {_parsed_binding(key, bindings) for key in config_bindings(operative)}
  return sorted(set(bindings) - read)


def changes_text(changes: list[tuple[str, str, str]]) -> str:
  """The first five `config_changes` as 'binding: old -> new; ...' (and how many more)."""
  more = f' and {len(changes) - 5} more' if len(changes) > 5 else ''
  return '; '.join(f'{k}: {old} -> {new}' for k, old, new in changes[:5]) + more


def check_resume(output_dir: str, record: dict, recorded: Optional[dict],
                 resumed_from: Optional[int], allow_changes: bool = False) -> None:
  """On a resume (`resumed_from`: a round), refuses one whose inputs differ from those the
  checkpointed rounds were computed with, in one `ConfigError` naming what changed.

  Args:
    record: This run's `{'config': operative config text, 'data': data fingerprint, 'model':
      `ModelSpec.architecture()`}`.
    recorded: The record the checkpoint of `resumed_from` carries; None for a checkpoint
      written before checkpoints carried one, whose config is then read from `config.gin`
      (its data cannot be verified: one warning line). One without 'model' resumes without a
      line: its config names the model, and the checkpoints after it record it.
    allow_changes: Continue anyway, appending the differences to `config_changes.txt`.
  """
  if not resumed_from:
    return
  recorded = recorded or {}
  earlier = recorded.get('config')
  path = os.path.join(output_dir, 'config.gin')
  if earlier is None and os.path.exists(path):
    with open(path) as f:
      earlier = f.read()
  changes = []
  if recorded.get('data') is None:
    warn(f'the checkpoint of round {resumed_from} records no data fingerprint (written by an '
         'earlier fltff): the data of the resumed rounds are not verified.')
  for key, what in (('data', 'content'), ('model', 'architecture')):
    if recorded.get(key) not in (None, record[key]):
      changes.append((f'the {key} ({what} fingerprint)', recorded[key][:16], record[key][:16]))
  if earlier is None:
    changes.append(('the configuration', 'not recorded (config.gin is missing)', 'this one'))
  else:
    changes += config_changes(earlier, record['config'])
  if changes and not allow_changes:
    raise ConfigError(
        f'--resume refused, nothing changed: what this run would compute differs from what '
        f'rounds 1-{resumed_from} were computed with ({changes_text(changes)}). Resume with '
        'the same gin files, bindings and data, or pass --allow_config_change to continue with '
        'these (recorded in config_changes.txt).')
  if changes:
    with open(os.path.join(output_dir, 'config_changes.txt'), 'a') as f:
      for key, old, new in changes:
        f.write(f'resumed after round {resumed_from}: {key}: {old} -> {new}\n')


def _fsync(path: str) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def atomic_write(path: str, write_fn, durable: bool = True) -> None:
  """`write_fn(tmp)`, then renamed into place. `durable`: the file and its folder are flushed
  to disk (`fsync`) around the rename, so a power loss leaves the old file or the new one,
  never a torn one. A failed write (e.g. a full disk) removes its `.tmp`."""
  tmp = path + '.tmp'
  try:
    write_fn(tmp)
    if durable:
      _fsync(tmp)
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(OSError):
      os.remove(tmp)
    raise
  if durable:
    _fsync(os.path.dirname(path) or '.')


def _write_text(path: str, text: str, durable: bool = False) -> None:
  def write(tmp):
    with open(tmp, 'w') as f:
      f.write(text)
  atomic_write(path, write, durable)


def atomic_write_json(path: str, payload: dict, durable: bool) -> None:
  """`payload` as indented JSON with sorted keys, written by `atomic_write`."""
  _write_text(path, json.dumps(payload, indent=1, sort_keys=True), durable)


def _png(gray) -> bytes:
  """A grayscale [H, W] uint8 array as PNG bytes (zlib only: no TensorFlow op per round)."""
  import struct  # pylint: disable=g-import-not-at-top
  import zlib  # pylint: disable=g-import-not-at-top

  import numpy as np  # pylint: disable=g-import-not-at-top

  gray = np.asarray(gray, np.uint8)
  height, width = gray.shape
  raw = b''.join(b'\x00' + gray[row].tobytes() for row in range(height))

  def chunk(kind: bytes, data: bytes) -> bytes:
    return (struct.pack('>I', len(data)) + kind + data
            + struct.pack('>I', zlib.crc32(kind + data) & 0xffffffff))

  return (b'\x89PNG\r\n\x1a\n'
          + chunk(b'IHDR', struct.pack('>IIBBBBB', width, height, 8, 0, 0, 0, 0))
          + chunk(b'IDAT', zlib.compress(raw)) + chunk(b'IEND', b''))


class RunOutputs:
  """Writes one row per round to CSV and TensorBoard; summary and plots on demand.

  TensorBoard events are written as protobufs with no TensorFlow op: eager `tf.summary` keeps
  driver memory per scalar written, for the whole run.
  """

  def __init__(self, output_dir: str):
    self.output_dir = output_dir
    os.makedirs(output_dir, exist_ok=True)
    self.csv_path = os.path.join(output_dir, 'metrics.csv')
    self.measurements_path = os.path.join(output_dir, 'measurements.jsonl')
    self._events = None  # Made at the first event: a refused resume creates no file.

  def _add_event(self, step: int, **fields) -> None:
    """One TensorBoard event at `step`, written through to the file."""
    # pylint: disable=g-import-not-at-top
    import time
    from tensorboard.compat.proto import event_pb2
    from tensorboard.summary.writer.event_file_writer import EventFileWriter
    # pylint: enable=g-import-not-at-top
    if self._events is None:
      self._events = EventFileWriter(os.path.join(self.output_dir, 'tensorboard'))
    self._events.add_event(event_pb2.Event(wall_time=time.time(), step=int(step), **fields))
    self._events.flush()

  def write_rows(self, rows: Sequence[dict]) -> None:
    """Rewrites metrics.csv from all rows (cheap; keeps it exact after a resume)."""
    # The newest row's order first (restored rows have sorted keys, new ones the driver's
    # order); '_' keys are in-memory only.
    fields = []
    for row in [*rows[-1:], *rows]:
      fields.extend(k for k in row if k not in fields and not k.startswith('_'))
    tmp = self.csv_path + '.tmp'
    with open(tmp, 'w', newline='') as f:
      w = csv.DictWriter(f, fieldnames=fields)
      w.writeheader()
      w.writerows({k: row.get(k, '') for k in fields} for row in rows)
    os.replace(tmp, self.csv_path)

  def restart_at(self, round_num: int) -> None:
    """A resume restarts at `round_num`: TensorBoard drops earlier files' events from there."""
    from tensorboard.compat.proto import event_pb2  # pylint: disable=g-import-not-at-top

    self._add_event(round_num,
                    session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START))

  def log_scalars(self, row: dict) -> None:
    # pylint: disable=g-import-not-at-top
    from tensorboard.compat.proto import summary_pb2
    from tensorboard.plugins.scalar import summary_v2
    # pylint: enable=g-import-not-at-top
    self._add_event(int(row['round']), summary=summary_pb2.Summary(value=[
        summary_v2.scalar_pb(key, float(value)).value[0] for key, value in row.items()
        if key != 'round' and finite(value)]))

  def log_arrays(self, round_num: int, arrays: dict, scalar_tags=()) -> None:
    """Appends non-scalar measurements (e.g. FedLayerWise's ψ [clients, layers]) to
    `measurements.jsonl` and logs them to TensorBoard: histograms under `key` (`key/values` if
    one of `scalar_tags` has that name: one summary kind per tag), matrices also as heat maps
    under `key/heatmap`."""
    # pylint: disable=g-import-not-at-top
    import numpy as np
    from tensorboard.compat.proto import summary_pb2
    from tensorboard.plugins.histogram import summary_v2
    from tensorboard.plugins.image import metadata
    from tensorboard.util import tensor_util
    # pylint: enable=g-import-not-at-top

    record = {'round': int(round_num)}
    record.update({k: np.asarray(v).tolist() for k, v in arrays.items()})
    with open(self.measurements_path, 'a') as f:
      f.write(json.dumps(record) + '\n')
    values = []
    for key, value in arrays.items():
      value = np.asarray(value, np.float32)
      values.append(summary_v2.histogram_pb(f'{key}/values' if key in scalar_tags else key,
                                            value).value[0])
      if value.ndim == 2 and value.size:
        scale = max(float(np.max(np.abs(value))), 1e-12)
        # As tf.summary.image showed it: value / max|value| as 8-bit gray (negatives black).
        gray = np.clip(np.round(value / scale * 255.0), 0, 255)
        tag = f'{key}/heatmap'
        tensor = tensor_util.make_tensor_proto(
            [str(gray.shape[1]).encode(), str(gray.shape[0]).encode(), _png(gray)],
            dtype='string')
        values.append(summary_pb2.Summary.Value(tag=tag, tensor=tensor, metadata=(
            metadata.create_summary_metadata(display_name=tag, description=''))))
    self._add_event(int(round_num), summary=summary_pb2.Summary(value=values))

  def truncate_measurements(self, last_round: int) -> None:
    """Drops measurement records after `last_round` (on resume)."""
    if not os.path.exists(self.measurements_path):
      return
    with open(self.measurements_path) as f:
      _write_text(self.measurements_path,
                  ''.join(l for l in f if json.loads(l)['round'] <= last_round))

  def write_text(self, name: str, text: str) -> None:
    _write_text(os.path.join(self.output_dir, name), text)

  def write_json(self, name: str, payload: dict) -> None:
    atomic_write_json(os.path.join(self.output_dir, name), payload, durable=False)

  def plot(self, rows: Sequence[dict], title: str) -> None:
    """accuracy_loss.png: each evaluated protocol's accuracy and the losses per round."""
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

    from fltff.simulation.evaluation import PROTOCOL_COLUMNS  # pylint: disable=g-import-not-at-top

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for protocol, column in PROTOCOL_COLUMNS.items():  # One line per protocol the run evaluated.
      ev = [r for r in rows if finite(r.get(column))]
      if ev:
        label = 'central test' if protocol == 'central' else f'{protocol} (mean over clients)'
        ax1.plot([r['round'] for r in ev], [r[column] for r in ev], marker='.', label=label)
    ev = [r for r in rows if finite(r.get('test_accuracy'))]
    ax1.plot([r['round'] for r in rows], [r.get('train_accuracy') for r in rows], alpha=0.6,
             label='train (participants)')
    ax2.plot([r['round'] for r in rows], [r.get('train_loss') for r in rows], label='train')
    if ev:
      ax2.plot([r['round'] for r in ev], [r.get('test_loss') for r in ev], marker='.',
               label='central test')
    for ax, quantity in ((ax1, 'accuracy'), (ax2, 'loss')):
      ax.set(xlabel='round', ylabel=quantity)
      ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(os.path.join(self.output_dir, 'accuracy_loss.png'), dpi=100)
    plt.close(fig)

  def plot_matrices(self) -> list[str]:
    """`heatmap_<name>.png` of the last round's value of each per-round matrix in
    `measurements.jsonl` (e.g. FedLayerWise's ψ), its colour scale spanning all rounds so
    pictures compare. Returns the files written."""
    import numpy as np  # pylint: disable=g-import-not-at-top

    if not os.path.exists(self.measurements_path):
      return []
    with open(self.measurements_path) as f:
      records = [json.loads(line) for line in f if line.strip()]
    matrices = {}
    for record in records:
      for key, value in record.items():
        try:
          value = np.asarray(value, dtype=float)
        except (TypeError, ValueError):  # Ragged or not numbers: not a matrix.
          continue
        if key != 'round' and value.ndim == 2 and value.size:
          matrices.setdefault(key, []).append((record['round'], value))
    if not matrices:
      return []
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

    written = []
    for key, by_round in matrices.items():
      finite = [m[np.isfinite(m)] for _, m in by_round]
      low = min(float(v.min()) for v in finite if v.size)
      high = max(float(v.max()) for v in finite if v.size)
      last_round, matrix = by_round[-1]
      clients = records[-1].get('client_index') if key != 'client_index' else None
      fig, ax = plt.subplots(figsize=(max(4.0, 0.5 * matrix.shape[1] + 2),
                                      max(3.0, 0.3 * matrix.shape[0] + 1.5)))
      image = ax.imshow(matrix, aspect='auto', cmap='viridis', vmin=low,
                        vmax=high if high > low else low + 1e-12)
      ax.set_xlabel('layer (input → output)' if matrix.shape[1] > 1 else 'value')
      ax.set_ylabel('participant (client index)' if clients is not None else 'row')
      if clients is not None and len(clients) == matrix.shape[0] and len(clients) <= 40:
        ax.set_yticks(range(len(clients)), [str(c) for c in clients])
      ax.set_title(f'{key}, round {last_round} (colour scale: all rounds)')
      fig.colorbar(image, ax=ax)
      fig.tight_layout()
      name = 'heatmap_' + ''.join(c if c.isalnum() or c in '-_' else '_' for c in key) + '.png'
      fig.savefig(os.path.join(self.output_dir, name), dpi=100)
      plt.close(fig)
      written.append(name)
    return written

  def close(self) -> None:
    if self._events is not None:
      self._events.close()
