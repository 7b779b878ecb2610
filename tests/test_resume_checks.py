"""Nothing silent: a resume verifies everything that determines its numbers, and data are
checked before the first round (docs/faults.md). Each case is one `error:` line that leaves the
run folder exactly as it was."""

import hashlib
import json
import os
import re
import shutil
import sqlite3

import numpy as np
import pytest

from helpers import REPO
from helpers import assert_one_line_error
from helpers import read_csv
from helpers import run_pipeline_here

SAMPLE = os.path.join(REPO, 'fltff', 'data', 'samples', 'mnist_first1003.npz')
# Vectorised in process (the default executor): quick, and the resume paths are the driver's.
BASE = ['--gin_file=gin_configs/foundation/mnist1003_shards_fedavg.gin',
        '--gin_bindings=experiment.clients_per_round = 3',
        '--gin_bindings=experiment.local_epochs = 1',
        '--gin_bindings=experiment.checkpoint_every = 1']


def _path_binding(path) -> str:
  return f"--gin_bindings=npz_source.path = '{path}'"


def _rounds(n: int) -> str:
  return f'--gin_bindings=experiment.rounds = {n}'


def _snapshot(folder) -> dict:
  """Every file under `folder` and a digest of its bytes."""
  out = {}
  for root, _, files in os.walk(folder):
    for name in files:
      path = os.path.join(root, name)
      with open(path, 'rb') as f:
        out[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
  return out


def _write_npz(path, **changes):
  with np.load(SAMPLE) as f:
    arrays = {k: f[k] for k in f.files}
  arrays.update(changes)
  np.savez(path, **arrays)
  return path


@pytest.fixture(scope='module')
def two_rounds(tmp_path_factory):
  """A 2-round run on a copy of the sample (its path bound), to be continued to 3 rounds."""
  root = tmp_path_factory.mktemp('resume_checks')
  data = _write_npz(root / 'data.npz')
  out = root / 'run'
  result = run_pipeline_here(*BASE, _rounds(2), _path_binding(data), f'--output_dir={out}')
  assert result.returncode == 0, result.stderr[-3000:]
  return out, data


def _copy(run, tmp_path):
  out = tmp_path / 'run'
  shutil.copytree(run, out)
  return out


def _refused(out, *args, fragments=()):
  before = _snapshot(out)
  line = assert_one_line_error(run_pipeline_here(*BASE, _rounds(3), f'--output_dir={out}',
                                                 '--resume', *args), *fragments)
  assert _snapshot(out) == before, 'a refused resume changed the run folder'
  return line


def test_a_binding_given_only_on_resume_is_refused(two_rounds, tmp_path):
  run, data = two_rounds
  out = _copy(run, tmp_path)
  _refused(out, _path_binding(data), '--gin_bindings=server_optimizer.learning_rate = 5.0',
           fragments=('--resume refused', 'server_optimizer.learning_rate: (not bound) -> 5.0'))


@pytest.mark.parametrize('change', ['inverted', 'shuffled_labels'])
def test_other_data_under_another_path_are_refused(two_rounds, tmp_path, change):
  run, _ = two_rounds
  out = _copy(run, tmp_path)
  with np.load(SAMPLE) as f:
    x_train, y_train = f['x_train'], f['y_train']
  changed = (dict(x_train=255 - x_train) if change == 'inverted' else
             dict(y_train=np.random.default_rng(0).permutation(y_train)))
  other = _write_npz(tmp_path / f'{change}.npz', **changed)
  _refused(out, _path_binding(other), fragments=('the data (content fingerprint)',))


def test_the_same_data_moved_elsewhere_resume_exactly(two_rounds, tmp_path):
  run, data = two_rounds
  out = _copy(run, tmp_path)
  moved = shutil.copy(data, tmp_path / 'moved.npz')
  result = run_pipeline_here(*BASE, _rounds(3), _path_binding(moved), f'--output_dir={out}',
                             '--resume')
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'Resumed from the checkpoint of round 2' in result.stdout
  assert [r['round'] for r in read_csv(out / 'metrics.csv')] == ['1', '2', '3']
  # What the data are, wherever they lie: `fltff report` groups seeds by it.
  fingerprints = [json.loads((folder / 'summary.json').read_text())['source_fingerprint']
                  for folder in (run, out)]
  assert fingerprints[0] == fingerprints[1] and len(fingerprints[0]) == 64


def test_a_deleted_config_gin_does_not_disable_the_check(two_rounds, tmp_path):
  run, data = two_rounds
  out = _copy(run, tmp_path)
  recorded = (out / 'config.gin').read_text()
  (out / 'config.gin').unlink()
  # The checkpoint carries the configuration its rounds were computed with.
  _refused(out, _path_binding(data), '--gin_bindings=client_optimizer.learning_rate = 0.05',
           fragments=('client_optimizer.learning_rate: 0.01 -> 0.05',))
  result = run_pipeline_here(*BASE, _rounds(3), _path_binding(data), f'--output_dir={out}',
                             '--resume')
  assert result.returncode == 0, result.stderr[-3000:]
  assert (out / 'config.gin').read_text() == recorded.replace('rounds = 2', 'rounds = 3')


@pytest.mark.parametrize('change, fragments', [
    ('nan', ('mnist_first1003', 'x_test holds', 'NaN or infinite values')),
    ('unscaled', ('x_train holds float32 images with values in [0, 255]', 'divide by 255')),
    ('labels', ('y_test holds 1 labels outside [0, 10)', '1-based labels, subtract 1')),
])
def test_unusable_data_are_refused_before_the_first_round(tmp_path, change, fragments):
  with np.load(SAMPLE) as f:
    x_train, x_test, y_test = f['x_train'], f['x_test'], f['y_test']
  if change == 'nan':
    x = x_test.astype(np.float32) / 255
    x[: len(x) // 3] = np.nan
    changes = dict(x_test=x, x_train=x_train.astype(np.float32) / 255)
  elif change == 'unscaled':
    changes = dict(x_train=x_train.astype(np.float32), x_test=x_test.astype(np.float32))
  else:
    changes = dict(y_test=np.where(np.arange(len(y_test)) == 0, 10, y_test))
  data = _write_npz(tmp_path / 'mnist_first1003.npz', **changes)
  out = tmp_path / 'run'
  line = assert_one_line_error(
      run_pipeline_here(*BASE, _rounds(1), _path_binding(data),
                        '--gin_bindings=npz_source.num_classes = 10', f'--output_dir={out}'),
      *fragments)
  assert str(data) in line
  assert not (out / 'checkpoints').exists() and not (out / 'metrics.csv').exists()


@pytest.mark.parametrize('split, change, message', [
    ('train', 'label', 'src: y_train holds 1 labels outside [0, 3) (the declared classes)'),
    ('test', 'inf', 'src: x_test holds 1 NaN or infinite values (of 8)'),
    ('test', 'image', 'src: x_test holds float32 images with values in [0.5, 2]'),
    ('train', 'count', 'src: x_train has 2 examples but y_train has 1; both must have the same'),
    ('test', 'shape', 'src: training examples have shape (2, 2, 1), test examples (3, 2, 1); '
                      'they must match.'),
    ('test', 'empty', 'src: the test split has no examples, and every evaluation reads it (the '
                      'central test set, and the local test splits drawn from it).'),
    # Pixels 0..255 as int64 (pandas' dtype for a CSV of pixels): not scaled, so refused.
    ('train', 'int', 'src: x_train holds int64 images with values in [0, 255]'),
    ('test', 'same', 'src: every test example (all 2) is also a training example, as when '
                     'one file or folder is read as both splits: every evaluation would '
                     'measure accuracy on training data'),
    ('test', 'subset', 'src: every test example (all 1) is also a training example'),
    ('train', 'list', 'src: x_train is of type list, not a NumPy array'),
    ('train', 'channel-first', 'src: examples of shape (3, 8, 8) are channel-first'),
    # Binarised images as uint8 would be divided by 255 to 0 and 0.004.
    ('test', 'binary', 'src: x_test holds uint8 images of only 0s and 1s'),
])
def test_check_dataset_names_the_split_and_the_count(split, change, message):
  from fltff.data.sources import ArrayDataset  # pylint: disable=g-import-not-at-top
  from fltff.data.sources import check_dataset  # pylint: disable=g-import-not-at-top
  from fltff.errors import DataError  # pylint: disable=g-import-not-at-top

  arrays = dict(x_train=np.full((2, 2, 2, 1), 0.25, np.float32), y_train=np.array([0, 2]),
                x_test=np.full((2, 2, 2, 1), 0.5, np.float32), y_test=np.array([1, 1]))
  check_dataset(ArrayDataset('d', num_classes=3, **arrays), 'src')
  if change == 'label':
    arrays[f'y_{split}'] = np.array([0, 3])
  elif change == 'count':
    arrays[f'y_{split}'] = np.array([0])
  elif change == 'shape':
    arrays[f'x_{split}'] = np.full((2, 3, 2, 1), 0.5, np.float32)
  elif change == 'empty':
    arrays.update(x_test=arrays['x_test'][:0], y_test=arrays['y_test'][:0])
  elif change == 'int':
    arrays['x_train'] = np.array([0, 255]).reshape(2, 1, 1, 1) * np.ones((2, 2, 2, 1), np.int64)
  elif change in ('same', 'subset'):  # The training split again, or a part of it.
    arrays.update(x_train=np.stack([arrays['x_train'][0], arrays['x_test'][0]]))
    chosen = [1, 0] if change == 'same' else [1]
    arrays.update(x_test=arrays['x_train'][chosen], y_test=arrays['y_train'][chosen])
  elif change == 'list':
    arrays['x_train'] = list(arrays['x_train'])
  elif change == 'binary':
    arrays.update(x_train=np.full((2, 2, 2, 1), 200, np.uint8),
                  x_test=np.repeat(np.array([0, 1], np.uint8), 4).reshape(2, 2, 2, 1))
  elif change == 'channel-first':  # As PyTorch stores images: (N, C, H, W).
    arrays.update(x_train=np.full((2, 3, 8, 8), 0.5, np.float32),
                  x_test=np.full((2, 3, 8, 8), 0.25, np.float32))
  else:
    x = arrays[f'x_{split}'].copy()
    x[0, 0, 0, 0] = np.inf if change == 'inf' else 2.0
    arrays[f'x_{split}'] = x
  with pytest.raises(DataError, match=re.escape(message)):
    check_dataset(ArrayDataset('d', num_classes=3, **arrays), 'src')
  # Feature vectors ([n, d]) may take any finite value.
  check_dataset(ArrayDataset('d', x_train=np.full((2, 3), -7.0, np.float32),
                             y_train=np.array([0, 1]), x_test=np.full((1, 3), 9.0, np.float32),
                             y_test=np.array([2]), num_classes=3), 'src')


def test_data_without_a_test_split_are_refused_not_evaluated_as_accuracy_0(tmp_path):
  """Synthetic data with `test_fraction = 0` have no test split: every accuracy would read 0."""
  out = tmp_path / 'run'
  assert_one_line_error(run_pipeline_here(
      '--gin_file=gin_configs/quickstart.gin', '--gin_bindings=experiment.rounds = 1',
      '--gin_bindings=synthetic_source.test_fraction = 0.0', f'--output_dir={out}'),
      'synthetic_source: the test split has no examples')
  assert not out.exists()


def test_float_images_in_range_are_used(tmp_path):
  with np.load(SAMPLE) as f:
    x_train, x_test = f['x_train'], f['x_test']
  data = _write_npz(tmp_path / 'scaled.npz', x_train=x_train.astype(np.float32) / 255,
                    x_test=x_test.astype(np.float32) / 255)
  result = run_pipeline_here(*BASE, _rounds(1), _path_binding(data),
                             f'--output_dir={tmp_path / "run"}')
  assert result.returncode == 0, result.stderr[-3000:]


def test_a_stray_file_among_the_checkpoints_is_not_one(two_rounds, tmp_path):
  run, data = two_rounds
  out = _copy(run, tmp_path)
  shutil.copy(out / 'checkpoints' / 'round_00002.npz', out / 'checkpoints' / 'round_backup.npz')
  result = run_pipeline_here(*BASE, _rounds(3), _path_binding(data), f'--output_dir={out}',
                             '--resume')
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'Resumed from the checkpoint of round 2' in result.stdout


@pytest.mark.parametrize('old_checkpoint', [False, True])
def test_summary_names_the_code_and_executor_of_each_segment_of_rounds(two_rounds, tmp_path,
                                                                       old_checkpoint):
  """`segments`: one per process that ran rounds; a checkpoint written before them (no
  `segments` key) gives a first segment whose code is unknown, not the resuming code's."""
  run, data = two_rounds
  fresh = json.loads((run / 'summary.json').read_text())
  made = {key: fresh[key] for key in ('fltff_version', 'fltff_commit', 'executor')}
  assert made['fltff_version'] and made['executor'].startswith('the in-process executor')
  assert fresh['segments'] == [{'first_round': 1, 'last_round': 2, **made}]
  out = _copy(run, tmp_path)
  if old_checkpoint:
    for meta in (out / 'checkpoints').glob('round_*.json'):
      meta.write_text(json.dumps({k: v for k, v in json.loads(meta.read_text()).items()
                                  if k != 'segments'}))
  result = run_pipeline_here(*BASE, _rounds(3), _path_binding(data), f'--output_dir={out}',
                             '--resume')
  assert result.returncode == 0, result.stderr[-3000:]
  first = (dict.fromkeys(made) if old_checkpoint else made)
  segments = [{'first_round': 1, 'last_round': 2, **first},
              {'first_round': 3, 'last_round': 3, **made}]
  assert json.loads((out / 'summary.json').read_text())['segments'] == segments
  # The checkpoint keeps them for the next resume.
  meta = json.loads((out / 'checkpoints' / 'round_00003.json').read_text())
  assert meta['segments'] == segments


# SCAFFOLD keeps a state per client (its control variate); the SQLite store holds them.
SCAFFOLD = ['--gin_file=gin_configs/ccn/offline_mnist1003_scaffold.gin',
            '--gin_bindings=experiment.clients_per_round = 3',
            '--gin_bindings=experiment.local_epochs = 1',
            '--gin_bindings=experiment.checkpoint_every = 1',
            "--gin_bindings=experiment.client_state_store = 'sqlite'"]


@pytest.fixture(scope='module')
def sqlite_run(tmp_path_factory):
  out = tmp_path_factory.mktemp('sqlite') / 'run'
  result = run_pipeline_here(*SCAFFOLD, _rounds(3), f'--output_dir={out}')
  assert result.returncode == 0, result.stderr[-3000:]
  return out


def test_swapped_client_states_are_refused(sqlite_run, tmp_path):
  out = _copy(sqlite_run, tmp_path)
  with sqlite3.connect(out / 'client_states.sqlite') as db:
    rows = db.execute('SELECT client, round, leaves FROM states ORDER BY client, round DESC'
                      ).fetchall()
    newest = {}
    for client, round_num, blob in rows:
      newest.setdefault(client, (round_num, blob))
    (a, (ra, blob_a)), (b, (rb, blob_b)) = list(newest.items())[:2]
    db.execute('UPDATE states SET leaves = ? WHERE client = ? AND round = ?', (blob_b, a, ra))
    db.execute('UPDATE states SET leaves = ? WHERE client = ? AND round = ?', (blob_a, b, rb))
  result = run_pipeline_here(*SCAFFOLD, _rounds(5), f'--output_dir={out}', '--resume')
  line = assert_one_line_error(result, 'not the one stored for it')
  assert 'new --output_dir' in line
  # The checkpointed rounds are kept.
  assert [r['round'] for r in read_csv(out / 'metrics.csv')] == ['1', '2', '3']


def test_a_missing_sqlite_store_refuses_and_leaves_the_folder_as_it_was(sqlite_run, tmp_path):
  out = _copy(sqlite_run, tmp_path)
  (out / 'client_states.sqlite').unlink()
  for suffix in ('-wal', '-shm'):
    if (out / f'client_states.sqlite{suffix}').exists():
      (out / f'client_states.sqlite{suffix}').unlink()
  before = _snapshot(out)
  line = assert_one_line_error(
      run_pipeline_here(*SCAFFOLD, _rounds(5), f'--output_dir={out}', '--resume'),
      'client_states.sqlite is missing', 'new --output_dir')
  assert 'without --resume' not in line
  assert _snapshot(out) == before


@pytest.mark.parametrize('binding, fragment', [
    ('experiment.seed = 9223372036854775808', 'experiment.seed must be in [0, 4294967295]'),
    ('experiment.model_seed = -1', 'experiment.model_seed must be in [0, 4294967295]'),
    ('federated_data.seed = 4294967296', 'federated_data.seed must be in [0, 4294967295]'),
])
def test_a_seed_out_of_range_is_one_line(tmp_path, binding, fragment):
  assert_one_line_error(run_pipeline_here(*BASE, _rounds(1), f'--gin_bindings={binding}',
                                          f'--output_dir={tmp_path / "run"}'), fragment)


def test_what_a_stopped_run_keeps_is_its_newest_readable_checkpoint(tmp_path):
  from fltff.simulation.checkpoint import Checkpointer  # pylint: disable=g-import-not-at-top
  from fltff.simulation.checkpoint import kept_message  # pylint: disable=g-import-not-at-top

  ckpt = Checkpointer(str(tmp_path))
  assert ckpt.intact_round() is None
  assert kept_message(ckpt.directory, 0) == 'No completed round is in a checkpoint'
  for r in (2, 4):
    ckpt.save(r, {'w': np.zeros(2, np.float32)}, {'rows': []})
  # A full disk cut round 6: its arrays were written, its metadata was not.
  shutil.copy(ckpt.path(4, '.npz'), ckpt.path(6, '.npz'))
  assert ckpt.latest_round() == 6 and ckpt.intact_round() == 4
  (tmp_path / 'checkpoints' / 'round_00004.json').write_text('{"rou')
  assert ckpt.intact_round() == 2


# A model of the test's own, registered by name: its code may change between run and resume.
USER_MODEL = ['--gin_bindings=experiment.model = "resume_user_mlp"']


def _register_user_mlp(activation: str) -> None:
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from fltff import models  # pylint: disable=g-import-not-at-top

  def model_fn(input_shape, num_classes, seed):
    init = lambda i: tf.keras.initializers.GlorotUniform(seed=seed * 10 + i)
    inputs = tf.keras.Input(input_shape)
    x = tf.keras.layers.Flatten()(inputs)
    x = tf.keras.layers.Dense(16, activation, kernel_initializer=init(0), name='latent')(x)
    return tf.keras.Model(inputs, tf.keras.layers.Dense(num_classes,
                                                        kernel_initializer=init(1))(x))
  models.register('resume_user_mlp', model_fn)


@pytest.fixture(scope='module')
def user_model_run(tmp_path_factory):
  from fltff.models import zoo  # pylint: disable=g-import-not-at-top

  out = tmp_path_factory.mktemp('user_model') / 'run'
  _register_user_mlp('relu')
  result = run_pipeline_here(*BASE, *USER_MODEL, _rounds(2), f'--output_dir={out}')
  assert result.returncode == 0, result.stderr[-3000:]
  yield out
  zoo._REGISTRY.pop('resume_user_mlp')  # pylint: disable=protected-access


def _resume(out, *args):
  return run_pipeline_here(*BASE, *USER_MODEL, _rounds(3), f'--output_dir={out}', '--resume',
                           *args)


def test_a_changed_model_of_the_same_shapes_is_refused_or_recorded(user_model_run, tmp_path):
  out = _copy(user_model_run, tmp_path)
  _register_user_mlp('tanh')
  before = _snapshot(out)
  line = assert_one_line_error(_resume(out), '--resume refused',
                               'the model (architecture fingerprint): ')
  assert 'experiment.model' not in line  # The configuration is the same.
  assert _snapshot(out) == before, 'a refused resume changed the run folder'
  result = _resume(out, '--allow_config_change')
  assert result.returncode == 0, result.stderr[-3000:]
  assert [r['round'] for r in read_csv(out / 'metrics.csv')] == ['1', '2', '3']
  assert re.fullmatch(r'resumed after round 2: the model \(architecture fingerprint\): '
                      r'[0-9a-f]{16} -> [0-9a-f]{16}\n', (out / 'config_changes.txt').read_text())


@pytest.mark.parametrize('recorded', ['recorded', 'not recorded'])
def test_the_same_model_resumes_and_a_record_without_one_as_before(user_model_run, tmp_path,
                                                                   recorded):
  out = _copy(user_model_run, tmp_path)
  _register_user_mlp('relu')
  if recorded == 'not recorded':  # As checkpoints written before the model was recorded.
    for path in (out / 'checkpoints').glob('round_*.json'):
      meta = json.loads(path.read_text())
      assert len(meta['run'].pop('model')) == 64
      path.write_text(json.dumps(meta))
  result = _resume(out)
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'Resumed from the checkpoint of round 2' in result.stdout
  assert 'warning' not in result.stderr and not (out / 'config_changes.txt').exists()
  assert [r['round'] for r in read_csv(out / 'metrics.csv')] == ['1', '2', '3']


# Seed 1: the channel's seed, unless bound, is the run seed, not channel_model.seed's default 0.
CHANNEL = ('--gin_bindings=experiment.channel = @channel_model',
           '--gin_bindings=experiment.seed = 1')


@pytest.fixture(scope='module')
def channel_run(two_rounds, tmp_path_factory):
  """`two_rounds` with the channel model (sim_* columns), to be continued to 3 rounds."""
  _, data = two_rounds
  out = tmp_path_factory.mktemp('channel') / 'run'
  result = run_pipeline_here(*BASE, *CHANNEL, _rounds(2), _path_binding(data),
                             f'--output_dir={out}')
  assert result.returncode == 0, result.stderr[-3000:]
  return out, data


def test_a_changed_channel_setting_is_refused(channel_run, tmp_path):
  run, data = channel_run
  out = _copy(run, tmp_path)
  assert 'channel_model.bandwidth_mhz = (10.0, 30.0)' in (out / 'config.gin').read_text()
  _refused(out, *CHANNEL, _path_binding(data), '--gin_bindings=channel_model.bandwidth_mhz = '
           '(1.0, 2.0)', fragments=('channel_model.bandwidth_mhz: (10.0, 30.0) -> (1.0, 2.0)',))
  # Bound for the resume only, to its default (0): not the run seed the channel was drawn with.
  _refused(out, *CHANNEL, _path_binding(data), '--gin_bindings=channel_model.seed = 0',
           fragments=('channel_model.seed: 1 -> 0',))


@pytest.mark.parametrize('recorded', ['recorded', 'not recorded'])
def test_the_same_channel_resumes_and_a_record_without_its_settings_as_before(
    channel_run, tmp_path, recorded):
  run, data = channel_run
  out = _copy(run, tmp_path)
  if recorded == 'not recorded':  # As runs written before the record held the channel's.
    def strip(config):
      return ''.join(line for line in config.splitlines(keepends=True)
                     if not line.startswith(('channel_model.', '# Parameters for channel')))
    (out / 'config.gin').write_text(strip((out / 'config.gin').read_text()))
    for path in (out / 'checkpoints').glob('round_*.json'):
      meta = json.loads(path.read_text())
      meta['run']['config'] = strip(meta['run']['config'])
      path.write_text(json.dumps(meta))
    # Its channel settings are not known: other than the defaults, they are refused.
    _refused(out, *CHANNEL, _path_binding(data), '--gin_bindings=channel_model.power_dbm = '
             '(1.0, 2.0)', fragments=('channel_model.power_dbm: (not bound) -> (1.0, 2.0)',))
  # The seed the channel was drawn with, now bound: the same channel.
  result = run_pipeline_here(*BASE, *CHANNEL, _rounds(3), _path_binding(data),
                             f'--output_dir={out}', '--resume',
                             '--gin_bindings=channel_model.seed = 1')
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'Resumed from the checkpoint of round 2' in result.stdout
  assert not (out / 'config_changes.txt').exists()
  rows = read_csv(out / 'metrics.csv')
  assert [r['round'] for r in rows] == ['1', '2', '3'] and float(rows[2]['sim_round_seconds']) > 0
  assert 'channel_model.bandwidth_mhz = (10.0, 30.0)' in (out / 'config.gin').read_text()


def test_a_run_continued_past_a_last_round_off_the_evaluation_grid_ends_as_one_run(
    two_rounds, tmp_path):
  """With experiment.eval_every = 2, a 3-round run evaluates round 3 as its last; continued to
  4 rounds, it ends with the rows (and headline) of a 4-round run, which does not evaluate 3."""
  _, data = two_rounds
  every = ['--gin_bindings=experiment.eval_every = 2', _path_binding(data)]
  continued, whole = tmp_path / 'continued', tmp_path / 'whole'
  for args in ([_rounds(3), f'--output_dir={continued}'],
               [_rounds(4), f'--output_dir={continued}', '--resume'],
               [_rounds(4), f'--output_dir={whole}']):
    result = run_pipeline_here(*BASE, *every, *args)
    assert result.returncode == 0, result.stderr[-3000:]
  rows = [read_csv(out / 'metrics.csv') for out in (continued, whole)]
  assert [r['test_accuracy'] for r in rows[0]] == [r['test_accuracy'] for r in rows[1]]
  assert rows[1][2]['test_accuracy'] == '' and rows[1][3]['test_accuracy'] != ''
  summaries = [json.loads((out / 'summary.json').read_text()) for out in (continued, whole)]
  assert summaries[0]['headline'] == summaries[1]['headline']
