"""Run outputs: metrics.csv, TensorBoard events, summary.json and PNG plots."""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Sequence
from typing import Optional


from fltff.errors import ConfigError

# Besides checkpoints/, what a run leaves that a new run in the same folder would overwrite.
RUN_RESULTS = ('metrics.csv', 'summary.json')


def rounds_to_targets(rows: Sequence[dict], targets: Sequence[float],
                      key: str = 'test_accuracy') -> dict[str, Optional[int]]:
  """First round whose `key` reaches each target (None if never)."""
  out = {}
  for target in targets:
    hit = next((r['round'] for r in rows
                if _finite(r.get(key)) and r[key] >= target), None)
    out[f'{target:g}'] = hit
  return out


def _finite(value) -> bool:
  return isinstance(value, (int, float)) and math.isfinite(value)


def prepare_output_dir(output_dir: str, resume: bool) -> None:
  """Creates `output_dir` and checks it is writable and not an earlier run's, before any work.

  Without `resume`, a folder holding an earlier run's results (`RUN_RESULTS`) is refused, so a
  run folder is never overwritten; an empty or unrelated folder is fine. Raises `ConfigError`.
  """
  if os.path.exists(output_dir) and not os.path.isdir(output_dir):
    raise ConfigError(f'--output_dir {output_dir} is an existing file, not a folder; choose '
                      'another --output_dir.')
  probe = os.path.join(output_dir, f'.fltff_write_test_{os.getpid()}')
  try:
    os.makedirs(output_dir, exist_ok=True)
    with open(probe, 'w') as f:
      f.write('ok')
    os.remove(probe)
  except OSError as e:
    raise ConfigError(f'Cannot write to --output_dir {output_dir} ({e.strerror or e}); choose '
                      'a writable folder.') from None
  if resume:
    return
  checkpoints = os.path.join(output_dir, 'checkpoints')
  if os.path.isdir(checkpoints) and os.listdir(checkpoints):
    raise ConfigError(
        f'{output_dir} already holds checkpoints of an earlier run; pass --resume to continue '
        'it or choose another --output_dir.')
  found = [name for name in RUN_RESULTS if os.path.exists(os.path.join(output_dir, name))]
  if found:
    raise ConfigError(
        f'{output_dir} already holds {" and ".join(found)} but no checkpoint (a run stopped '
        'before its first checkpoint, or other files) and is never overwritten: choose another '
        '--output_dir, or pass --resume to rerun it from round 1 there.')


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


class _EventWriter:
  """TensorBoard event files written from protobufs, with no TensorFlow op.

  `tf.summary` in eager mode kept ~0.18 KiB of driver memory per scalar written, for the whole
  run (measured, issue 20: ~7 KiB per round for a 40-column row); these are the same events
  (scalars, histograms, PNG images with their TensorBoard plugin metadata) built directly.
  """

  def __init__(self, logdir: str):
    # pylint: disable=g-import-not-at-top
    from tensorboard.summary.writer.event_file_writer import EventFileWriter
    # pylint: enable=g-import-not-at-top
    self._writer = EventFileWriter(logdir)

  def write(self, step: int, values) -> None:
    import time  # pylint: disable=g-import-not-at-top

    from tensorboard.compat.proto import event_pb2  # pylint: disable=g-import-not-at-top
    from tensorboard.compat.proto import summary_pb2  # pylint: disable=g-import-not-at-top

    summary = summary_pb2.Summary(value=list(values))
    self._writer.add_event(event_pb2.Event(wall_time=time.time(), step=int(step),
                                           summary=summary))

  @staticmethod
  def scalar(tag: str, value: float):
    from tensorboard.plugins.scalar import summary_v2  # pylint: disable=g-import-not-at-top
    return summary_v2.scalar_pb(tag, float(value)).value[0]

  @staticmethod
  def histogram(tag: str, value):
    from tensorboard.plugins.histogram import summary_v2  # pylint: disable=g-import-not-at-top
    return summary_v2.histogram_pb(tag, value).value[0]

  @staticmethod
  def image(tag: str, gray):
    # pylint: disable=g-import-not-at-top
    from tensorboard.compat.proto import summary_pb2
    from tensorboard.plugins.image import metadata
    from tensorboard.util import tensor_util
    # pylint: enable=g-import-not-at-top
    height, width = gray.shape
    tensor = tensor_util.make_tensor_proto(
        [str(width).encode(), str(height).encode(), _png(gray)], dtype='string')
    return summary_pb2.Summary.Value(
        tag=tag, tensor=tensor, metadata=metadata.create_summary_metadata(
            display_name=tag, description=''))

  def flush(self) -> None:
    self._writer.flush()

  def close(self) -> None:
    self._writer.close()


class RunOutputs:
  """Writes one row per round to CSV and TensorBoard; summary and plots on demand."""

  def __init__(self, output_dir: str):
    self.output_dir = output_dir
    os.makedirs(output_dir, exist_ok=True)
    self.csv_path = os.path.join(output_dir, 'metrics.csv')
    self._writer = _EventWriter(os.path.join(output_dir, 'tensorboard'))

  def write_rows(self, rows: Sequence[dict]) -> None:
    """Rewrites metrics.csv from all rows (cheap; keeps it exact after a resume)."""
    fields = []
    for row in rows:  # Keys starting with '_' are in-memory only (per-client evaluations).
      fields.extend(k for k in row if k not in fields and not k.startswith('_'))
    tmp = self.csv_path + '.tmp'
    with open(tmp, 'w', newline='') as f:
      w = csv.DictWriter(f, fieldnames=fields)
      w.writeheader()
      for row in rows:
        w.writerow({k: row.get(k, '') for k in fields})
    os.replace(tmp, self.csv_path)

  def log_scalars(self, row: dict) -> None:
    self._writer.write(int(row['round']), [
        self._writer.scalar(key, value) for key, value in row.items()
        if key != 'round' and _finite(value)])
    self._writer.flush()

  def log_arrays(self, round_num: int, arrays: dict) -> None:
    """Non-scalar measurements (e.g. FedLayerWise's ψ [clients, layers]).

    Appended to `measurements.jsonl` (one JSON object per round, for plotting) and logged to
    TensorBoard as histograms under `key` and, for matrices, as a heat-map image under
    `key/heatmap` (one tag holds one kind of summary, or TensorBoard shows neither well).
    """
    import numpy as np  # pylint: disable=g-import-not-at-top

    path = os.path.join(self.output_dir, 'measurements.jsonl')
    record = {'round': int(round_num)}
    record.update({k: np.asarray(v).tolist() for k, v in arrays.items()})
    with open(path, 'a') as f:
      f.write(json.dumps(record) + '\n')
    values = []
    for key, value in arrays.items():
      value = np.asarray(value, np.float32)
      values.append(self._writer.histogram(key, value))
      if value.ndim == 2 and value.size:
        scale = max(float(np.max(np.abs(value))), 1e-12)
        # As tf.summary.image showed it: value / max|value| as 8-bit gray (negatives black).
        gray = np.clip(np.round(value / scale * 255.0), 0, 255)
        values.append(self._writer.image(f'{key}/heatmap', gray))
    self._writer.write(int(round_num), values)
    self._writer.flush()

  def truncate_measurements(self, last_round: int) -> None:
    """Drops measurement records after `last_round` (on resume)."""
    path = os.path.join(self.output_dir, 'measurements.jsonl')
    if not os.path.exists(path):
      return
    with open(path) as f:
      keep = [l for l in f if json.loads(l)['round'] <= last_round]
    with open(path + '.tmp', 'w') as f:
      f.writelines(keep)
    os.replace(path + '.tmp', path)

  def write_json(self, name: str, payload: dict) -> None:
    path = os.path.join(self.output_dir, name)
    with open(path + '.tmp', 'w') as f:
      json.dump(payload, f, indent=1, sort_keys=True)
    os.replace(path + '.tmp', path)

  def plot(self, rows: Sequence[dict], title: str) -> str:
    """accuracy_loss.png: each evaluated protocol's accuracy and the losses per round."""
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

    from fltff.simulation.evaluation import PROTOCOL_COLUMNS  # pylint: disable=g-import-not-at-top

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for protocol, column in PROTOCOL_COLUMNS.items():  # One line per protocol the run evaluated.
      ev = [r for r in rows if _finite(r.get(column))]
      if ev:
        label = 'central test' if protocol == 'central' else f'{protocol} (mean over clients)'
        ax1.plot([r['round'] for r in ev], [r[column] for r in ev], marker='.', label=label)
    ev = [r for r in rows if _finite(r.get('test_accuracy'))]
    ax1.plot([r['round'] for r in rows], [r.get('train_accuracy') for r in rows], alpha=0.6,
             label='train (participants)')
    ax1.set_xlabel('round')
    ax1.set_ylabel('accuracy')
    ax1.legend()
    ax2.plot([r['round'] for r in rows], [r.get('train_loss') for r in rows], label='train')
    if ev:
      ax2.plot([r['round'] for r in ev], [r.get('test_loss') for r in ev], marker='.',
               label='central test')
    ax2.set_xlabel('round')
    ax2.set_ylabel('loss')
    ax2.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path = os.path.join(self.output_dir, 'accuracy_loss.png')
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

  def close(self) -> None:
    self._writer.close()
