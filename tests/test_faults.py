"""Every fault ends in one clear line with nothing lost: damaged checkpoints, unusable output
folders, badly typed numbers, divergence, existing run folders, signals, TensorBoard tags.

User errors: one `error:` line on stderr, exit status 2, no traceback; faults a run survives:
one `warning:` line.
"""

import importlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from helpers import REPO
from helpers import SMALL
from helpers import assert_one_line_error
from helpers import pipeline_env
from helpers import read_csv
from helpers import run_pipeline_here
from helpers import tagged_worker_pids
from launcher import Program

from fltff.errors import CheckpointError
from fltff.errors import ConfigError
from fltff.simulation.checkpoint import Checkpointer
from fltff.simulation.driver import RoundConfig
from fltff.simulation.outputs import RunOutputs

TWO_ROUNDS = [*SMALL, '--gin_bindings=experiment.rounds = 2']


def _stderr_lines(result) -> list[str]:
  return [l for l in result.stderr.splitlines() if l.strip()]


def _warnings(result) -> list[str]:
  return [l for l in _stderr_lines(result) if l.startswith('warning: ')]


# -- 1. damaged checkpoints ----------------------------------------------------------------
def _saved(tmp_path, rounds=(1, 2, 3)) -> Checkpointer:
  ckpt = Checkpointer(str(tmp_path))
  for r in rounds:
    ckpt.save(r, {'w': np.full(3, r, np.float32)},
              {'rows': [{'round': i} for i in range(1, r + 1)]})
  return ckpt


def _truncate(path: str) -> None:
  with open(path, 'r+b') as f:
    f.truncate(os.path.getsize(path) // 2)


def test_restore_skips_a_truncated_checkpoint_with_one_warning(tmp_path):
  ckpt = _saved(tmp_path)
  _truncate(os.path.join(ckpt.directory, 'round_00003.npz'))
  warnings = []
  round_num, state, meta, _ = ckpt.restore({'w': np.zeros(3, np.float32)}, warnings.append)
  assert round_num == 2 and len(meta['rows']) == 2
  np.testing.assert_array_equal(state['w'], np.full(3, 2.0))
  assert len(warnings) == 1
  assert 'round 3 is damaged' in warnings[0] and 'resuming from round 2' in warnings[0]


def test_restore_survives_a_corrupt_latest_json(tmp_path):
  ckpt = _saved(tmp_path)
  with open(os.path.join(ckpt.directory, 'latest.json'), 'w') as f:
    f.write('{"round": 3')
  assert ckpt.latest_round() == 3
  warnings = []
  round_num, _, _, _ = ckpt.restore({'w': np.zeros(3, np.float32)}, warnings.append)
  assert round_num == 3
  assert len(warnings) == 1 and 'latest.json is damaged' in warnings[0], warnings


def test_restore_past_a_stale_latest_json_takes_the_newest_round(tmp_path):
  ckpt = _saved(tmp_path, rounds=(2, 4, 6, 8))  # Keeps 4, 6, 8.
  with open(os.path.join(ckpt.directory, 'latest.json'), 'w') as f:
    f.write('{"round": 2}')  # E.g. an older copy put back.
  assert ckpt.latest_round() == 8
  warnings = []
  round_num, state, _, _ = ckpt.restore({'w': np.zeros(3, np.float32)}, warnings.append)
  assert round_num == 8
  np.testing.assert_array_equal(state['w'], np.full(3, 8.0))
  assert warnings == ['latest.json names round 2, whose checkpoint is missing; resuming from '
                      'round 8.']


def test_restore_with_no_intact_checkpoint_is_a_clear_error(tmp_path):
  ckpt = _saved(tmp_path)
  for r in ckpt.rounds():
    _truncate(os.path.join(ckpt.directory, f'round_{r:05d}.npz'))
  with pytest.raises(CheckpointError, match='No intact checkpoint'):
    ckpt.restore({'w': np.zeros(3, np.float32)}, lambda message: None)


def test_resume_from_a_truncated_checkpoint_falls_back(small_run, tmp_path):
  out = str(tmp_path / 'run')
  shutil.copytree(small_run[0], out)
  _truncate(os.path.join(out, 'checkpoints', 'round_00003.npz'))
  result = run_pipeline_here(*SMALL, f'--output_dir={out}', '--resume')
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'Traceback' not in result.stderr
  warnings = _warnings(result)
  assert len(warnings) == 1 and 'round 3 is damaged' in warnings[0], result.stderr[-3000:]
  assert 'Resumed from the checkpoint of round 2' in result.stdout
  assert [r['round'] for r in read_csv(os.path.join(out, 'metrics.csv'))] == ['1', '2', '3']
  assert json.load(open(os.path.join(out, 'checkpoints', 'latest.json')))['round'] == 3


def test_resume_with_no_intact_checkpoint_is_one_line(small_run, tmp_path):
  out = str(tmp_path / 'run')
  shutil.copytree(small_run[0], out)
  with open(os.path.join(out, 'checkpoints', 'latest.json'), 'w') as f:
    f.write('garbage')
  for name in os.listdir(os.path.join(out, 'checkpoints')):
    if name.endswith('.npz'):
      _truncate(os.path.join(out, 'checkpoints', name))
  assert_one_line_error(run_pipeline_here(*SMALL, f'--output_dir={out}', '--resume'),
                        'No intact checkpoint', 'latest.json is damaged')


# -- 2. unusable output folder -------------------------------------------------------------
def test_output_dir_that_is_a_file_fails_before_any_work(tmp_path):
  existing = tmp_path / 'afile'
  existing.write_text('mine')
  # The data source is missing too: the folder is checked first, before any data is read.
  missing_data = "--gin_bindings=npz_source.path = '/nonexistent/x.npz'"
  assert_one_line_error(run_pipeline_here(SMALL[0], missing_data, f'--output_dir={existing}'),
                        str(existing), 'existing file')
  assert_one_line_error(run_pipeline_here(SMALL[0], missing_data, f'--output_dir={existing}/run'),
                        'Cannot write', str(existing))
  assert existing.read_text() == 'mine'


# -- 3./4. numbers given with the wrong type -----------------------------------------------
@pytest.mark.parametrize('bindings,fragments', [
    (['client_optimizer.learning_rate = "abc"'], ['client_optimizer.learning_rate', "'abc'"]),
    (['experiment.method = @fedprox', 'fedprox.mu = "big"'], ['fedprox.mu', "'big'"]),
    (['experiment.clients_per_round = 2.5'], ['experiment.clients_per_round', '2.5', 'integer']),
    (['experiment.rounds = True'], ['experiment.rounds', 'True']),
    (['experiment.local_epochs = 1.5'], ['experiment.local_epochs', '1.5']),
    # Optional[int] in a module whose annotations are evaluated (no postponed annotations).
    (['npz_source.num_classes = "ten"'],
     ["npz_source.num_classes must be an integer, got 'ten'."]),
    (['shard_partition.num_shards = 20.0'],
     ['shard_partition.num_shards must be an integer, got 20.0.']),
])
def test_badly_typed_numbers_are_one_line(bindings, fragments, tmp_path):
  args = [SMALL[0], *[f'--gin_bindings={b}' for b in bindings], f'--output_dir={tmp_path}']
  assert_one_line_error(run_pipeline_here(*args), *fragments)


@pytest.mark.parametrize('kwargs,message', [
    (dict(value=0, integer=True, low=1), 'n must be >= 1, got 0.'),
    (dict(value=0.0, low=0, open_low=True), 'n must be > 0, got 0.0.'),
    (dict(value=float('nan'), low=0), 'n must be finite, got nan.'),
    (dict(value=float('inf'), low=0), 'n must be finite, got inf.'),
    (dict(value=-np.inf, hint='dBm'), 'n must be finite, got -inf; dBm.'),
    (dict(value=1.5, low=0, high=1), 'n must be in [0, 1], got 1.5.'),
    (dict(value=0, low=0, high=1, open_low=True), 'n must be in (0, 1], got 0.'),
    (dict(value=1, low=0, high=1, open_high=True), 'n must be in [0, 1), got 1.'),
    (dict(value=3, high=2), 'n must be <= 2, got 3.'),
    (dict(value=-1, integer=True, low=0, hint='0: never'), 'n must be >= 0, got -1; 0: never.'),
    (dict(value=2.0, integer=True, low=1), 'n must be an integer, got 2.0.'),
    (dict(value=True, low=0), 'n must be a number, got True.'),
])
def test_check_number_refuses_what_is_out_of_range_in_one_sentence(kwargs, message):
  from fltff.config_checks import check_number
  with pytest.raises(ConfigError) as raised:
    check_number('n', **kwargs)
  assert str(raised.value) == message


@pytest.mark.parametrize('kwargs', [
    dict(value=1, integer=True, low=1), dict(value=1.0, low=0, high=1),
    dict(value=None, allow_none=True, low=0, open_low=True), dict(value=np.int64(3), low=3),
    dict(value=np.float32(0.5), low=0, high=1, open_low=True, open_high=True),
    dict(value=float('inf'), low=0, open_low=True, allow_inf=True), dict(value=10**400),
])
def test_check_number_takes_the_bounds_themselves_and_numpy_scalars(kwargs):
  from fltff.config_checks import check_number
  check_number('n', **kwargs)


def test_check_choice_names_the_choices():
  from fltff.config_checks import check_choice
  check_choice('mode', 'drop', ('partial', 'drop'))
  with pytest.raises(ConfigError, match=re.escape("mode must be one of 'partial', 'drop', got "
                                                  "'dropp'.")):
    check_choice('mode', 'dropp', ('partial', 'drop'))


def test_an_out_of_range_setting_is_one_line(tmp_path):
  args = [SMALL[0], '--gin_bindings=experiment.straggler_fraction = 1.5',
          f'--output_dir={tmp_path}']
  assert_one_line_error(run_pipeline_here(*args),
                        'experiment.straggler_fraction must be in [0, 1], got 1.5')


@pytest.mark.parametrize('binding,fragments', [
    ("experiment.method = 'fedprox'", ["got 'fedprox'", 'write experiment.method = @fedprox']),
    ('experiment.method = 3', ['experiment.method must name a configurable with @', 'got 3']),
    ("federated_data.partitioner = 'dirichlet'", ['federated_data.partitioner = @<configurable>',
                                                  "got 'dirichlet'"]),
    ("experiment.personalization = 'fedlap'", ['experiment.personalization', "'fedlap'"]),
    ('experiment.method = @fedavg()', ['@fedavg() calls fedavg', 'its model_spec',
                                       'write @fedavg']),
])
def test_a_builder_given_as_a_value_or_a_call_is_one_line(binding, fragments, tmp_path):
  """Parameters annotated `Callable` take a configurable (`@fedavg`): a string, a number, or a
  call gin would make without the builder's arguments, is one line naming the binding."""
  args = [SMALL[0], f'--gin_bindings={binding}', f'--output_dir={tmp_path}']
  assert_one_line_error(run_pipeline_here(*args), *fragments)


@pytest.mark.parametrize('settings', [
    {'clients_per_round': 2.5}, {'clients_per_round': True}, {'rounds': True},
    {'batch_size': 10.0}, {'eval_every': '1'}, {'checkpoint_every': 1.5},
    {'target_accuracies': 0.5}, {'target_accuracies': [95]}, {'target_accuracies': ['high']},
])
def test_round_config_rejects_non_integers(settings):
  with pytest.raises(ConfigError, match=f'experiment.{next(iter(settings))}'):
    RoundConfig(**settings)


@pytest.mark.parametrize('kwargs,message', [
    (dict(connect_timeout=0), 'runtime.connect_timeout must be > 0, got 0; seconds.'),
    (dict(max_retries=-1), 'runtime.max_retries must be >= 0, got -1.'),
    (dict(max_retries=1.5), 'runtime.max_retries must be an integer, got 1.5.'),
    (dict(insecure_plaintext='yes'), "runtime.insecure_plaintext must be True or False, got 'yes'."),
])
def test_runtime_settings_are_checked_before_anything_starts(kwargs, message):
  from fltff.runtime import make_runtime
  with pytest.raises(ConfigError, match=re.escape(message)):  # Gin appends the configurable.
    make_runtime(**kwargs)


def test_kapc_min_upload_layers_without_bls_is_refused_not_ignored(spec):
  from fltff.personalization.kapc import build_kapc
  with pytest.raises(ConfigError, match='kapc.min_upload_layers applies to KAPC.BLS only'):
    build_kapc(spec, 4, min_upload_layers=2)
  build_kapc(spec, 4, bls_mu=0.7, min_upload_layers=2)


# -- 5. divergence and an exploding loss ---------------------------------------------------
def test_divergence_in_round_one_says_nothing_was_kept(tmp_path):
  out = str(tmp_path / 'run')
  result = run_pipeline_here(*SMALL, '--gin_bindings=experiment.rounds = 1',
                        '--gin_bindings=client_optimizer.learning_rate = 1e12',
                        f'--output_dir={out}')
  line = assert_one_line_error(result, 'diverged in round 1', 'No completed round is in a checkpoint')
  assert 'Rounds 1-0' not in line and not os.path.exists(os.path.join(out, 'checkpoints'))


def test_exploding_loss_warns_once_and_runs_on(tmp_path):
  out = str(tmp_path / 'run')
  result = run_pipeline_here(*TWO_ROUNDS, '--gin_bindings=client_optimizer.learning_rate = 1e6',
                        f'--output_dir={out}')
  assert result.returncode == 0, result.stderr[-3000:]
  warnings = _warnings(result)
  assert len(warnings) == 1 and 'training loss' in warnings[0], result.stderr[-3000:]
  assert len(read_csv(os.path.join(out, 'metrics.csv'))) == 2


# -- 6. a folder with results but no checkpoint --------------------------------------------
def test_folder_with_metrics_but_no_checkpoint_is_not_overwritten(tmp_path):
  metrics = tmp_path / 'metrics.csv'
  metrics.write_text('round,train_loss\n1,0.5\n')
  assert_one_line_error(run_pipeline_here(*SMALL, f'--output_dir={tmp_path}'),
                        'metrics.csv', '--resume', '--output_dir')
  assert metrics.read_text() == 'round,train_loss\n1,0.5\n'


# -- 7. TensorBoard: images under their own tag --------------------------------------------
def test_heatmaps_have_their_own_tensorboard_tag(tmp_path):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  outputs = RunOutputs(str(tmp_path))
  outputs.log_arrays(1, {'relation': np.eye(3), 'psi': np.arange(4.0)})
  outputs.close()
  plugins = {}
  events = tmp_path / 'tensorboard'
  for name in os.listdir(events):
    for event in tf.compat.v1.train.summary_iterator(str(events / name)):
      for value in event.summary.value:
        plugins.setdefault(value.tag, set()).add(value.metadata.plugin_data.plugin_name)
  assert plugins == {'relation': {'histograms'}, 'psi': {'histograms'},
                     'relation/heatmap': {'images'}}


def test_matrices_are_drawn_as_labelled_heat_maps_on_one_scale_across_rounds(tmp_path):
  import matplotlib.image  # pylint: disable=g-import-not-at-top

  outputs = RunOutputs(str(tmp_path))
  outputs.log_arrays(1, {'aggregator/psi': [[0.1, 0.2], [0.3, 0.4]], 'client_index': [4, 7]})
  outputs.log_arrays(2, {'aggregator/psi': [[0.5, 0.5], [0.5, 0.9]], 'client_index': [7, 2]})
  outputs.close()
  assert outputs.plot_matrices() == ['heatmap_aggregator_psi.png']
  picture = matplotlib.image.imread(str(tmp_path / 'heatmap_aggregator_psi.png'))
  assert picture.shape[0] > 200 and picture.shape[1] > 300  # Axes and a colour bar, not 2×2.


# -- 8. signals and worker logs ------------------------------------------------------------
def _start_and_signal(out: str, tmpdir: str, signals: int, after_rounds: int = 1,
                      extra: tuple = (), while_running=lambda: None) -> tuple[int, str]:
  """Starts a long run, calls `while_running()` and sends SIGTERM `signals` times once
  `after_rounds` rounds are done; (status, stderr)."""
  proc = Program('pipelines.run', *SMALL, '--gin_bindings=experiment.rounds = 50',
                 '--gin_bindings=experiment.local_epochs = 5', *extra, f'--output_dir={out}',
                 env=dict(pipeline_env(), TMPDIR=tmpdir))
  metrics = os.path.join(out, 'metrics.csv')
  deadline = time.monotonic() + 300
  while time.monotonic() < deadline and proc.poll() is None:
    if os.path.exists(metrics) and len(read_csv(metrics)) >= after_rounds:
      break
    time.sleep(0.05)
  assert proc.poll() is None, 'the run ended before the signal'
  while_running()
  for _ in range(signals):
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
  _, stderr = proc.communicate(timeout=300)
  return proc.returncode, stderr


def test_two_sigterms_keep_every_completed_round_and_logs_stay_out_of_tmp(tmp_path):
  # Checkpoints every 100 rounds: the second signal itself checkpoints what is completed.
  out, tmpdir = str(tmp_path / 'run'), tmp_path / 'tmp'
  tmpdir.mkdir()
  # Rounds of several seconds, so that the second signal arrives while the round still runs.
  status, stderr = _start_and_signal(out, str(tmpdir), signals=2, after_rounds=2,
                                     extra=('--gin_bindings=experiment.checkpoint_every = 100',
                                            '--gin_bindings=experiment.local_epochs = 40'))
  assert status == 143, stderr[-3000:]
  assert 'Traceback' not in stderr, stderr[-3000:]
  lines = [l for l in stderr.splitlines() if l.strip()]
  stopped = [l for l in lines if l.startswith('stopped: ')]
  assert len(stopped) == 1 and 'at once' in stopped[0], stderr[-3000:]
  saved = json.load(open(os.path.join(out, 'checkpoints', 'latest.json')))['round']
  completed = len(read_csv(os.path.join(out, 'metrics.csv')))
  assert saved == completed >= 2, (saved, completed)
  assert f'Rounds 1-{saved} are kept' in stopped[0], stopped[0]
  # Only our own lines: the first signal's warning and the stop.
  assert all(l.startswith(('warning: ', 'stopped: ')) for l in lines), stderr[-3000:]
  assert not [n for n in os.listdir(tmpdir) if n.startswith('fltff_worker')]


@pytest.mark.parametrize('client_work,epochs', [('auto', 1000), ('per_client', 60)])
def test_a_second_signal_during_a_long_in_process_round_stops_at_once(client_work, epochs,
                                                                      tmp_path):
  """Two signals while TensorFlow computes a round in this process (vectorised clients, or the
  in-process executor client by client): Python runs a handler only between TensorFlow's
  calls, so the two merged into one, after the round (an 18-s KAPC round stopped 16.7 s
  later, as if signalled once). They are counted as they arrive."""
  out = str(tmp_path / 'run')
  proc = Program('pipelines.run', *SMALL, '--gin_bindings=experiment.rounds = 50',
                 f'--gin_bindings=experiment.local_epochs = {epochs}',  # Rounds of ~10 s.
                 '--gin_bindings=experiment.checkpoint_every = 100',
                 "--gin_bindings=runtime.executor = 'in_process'",
                 f"--gin_bindings=experiment.client_work = '{client_work}'",
                 f'--output_dir={out}', env=pipeline_env())
  metrics = os.path.join(out, 'metrics.csv')
  deadline = time.monotonic() + 300
  while proc.poll() is None and time.monotonic() < deadline and not (
      os.path.exists(metrics) and read_csv(metrics)):
    time.sleep(0.05)
  time.sleep(1.0)  # Into round 2's computation.
  assert proc.poll() is None and len(read_csv(metrics)) == 1, 'round 2 ended too soon'
  proc.send_signal(signal.SIGTERM)
  time.sleep(0.05)  # Delivered one by one (the kernel merges a signal still pending), but
  proc.send_signal(signal.SIGTERM)  # one to Python's handler, which TensorFlow's call delays.
  start = time.monotonic()
  _, stderr = proc.communicate(timeout=300)
  seconds = time.monotonic() - start
  assert proc.returncode == 143, stderr[-3000:]
  lines = [l for l in stderr.splitlines() if l.strip()]
  assert len(lines) == 2 and lines[0].startswith('warning: signal 15'), stderr[-3000:]
  assert lines[1].startswith('stopped: at once by a second signal. Round 1 is kept in the '
                             'checkpoint'), lines[1]
  assert seconds < 6, seconds
  saved = json.load(open(os.path.join(out, 'checkpoints', 'latest.json')))['round']
  assert saved == len(read_csv(metrics)) == 1  # The second signal checkpointed round 1.


def test_one_sigterm_stops_after_the_round_in_one_line_keeping_every_round(tmp_path):
  out, tmpdir = str(tmp_path / 'run'), tmp_path / 'tmp'
  tmpdir.mkdir()
  before = tagged_worker_pids()

  def worker_seen():
    assert tagged_worker_pids() - before, 'the leak check cannot see the running worker'

  status, stderr = _start_and_signal(out, str(tmpdir), signals=1, after_rounds=2,
                                     while_running=worker_seen)
  assert status == 143, stderr[-3000:]
  assert 'Traceback' not in stderr, stderr[-3000:]
  lines = [l for l in stderr.splitlines() if l.strip()]
  stopped = [l for l in lines if l.startswith('stopped: ')]
  assert len(stopped) == 1 and 'Stopped by signal after round' in stopped[0], stderr[-3000:]
  # No gin context or other text: our own lines only.
  assert all(l.startswith(('warning: ', 'stopped: ')) for l in lines), stderr[-3000:]
  completed = len(read_csv(os.path.join(out, 'metrics.csv')))
  saved = json.load(open(os.path.join(out, 'checkpoints', 'latest.json')))['round']
  assert saved == completed >= 2  # Every completed round is in the checkpoint.
  assert not tagged_worker_pids() - before


@pytest.mark.parametrize('address,message', [
    ('hostA', "has no port; write host:port, e.g. 'hostA:8000'"),
    ('10.0.0.5:', 'has no port'),
    ('::1', 'has no port'),
    ('hostA:http', "has port 'http'"),
    ('hostA:70000', "has port '70000'"),
    ('', 'must be "host:port" strings'),
])
def test_worker_address_without_a_valid_port_is_one_line(address, message):
  from fltff.errors import ConfigError
  from fltff.runtime import channels
  from fltff.runtime import make_runtime
  with pytest.raises(ConfigError, match=re.escape(message)):
    make_runtime(workers=[address])
  for good in ('hostA:8000', '127.0.0.1:1', '[::1]:8000'):
    channels.check_worker_address(good)


def test_factories_type_check_their_arguments():
  import tensorflow_federated as tff
  from fltff.aggregators import adaptive_weighting
  from fltff.errors import ConfigError
  from fltff.learning import scaffold as scaffold_lib
  with pytest.raises(ConfigError, match='num_clients must be an integer, got <'):
    adaptive_weighting.AdaptiveWeightingFactory(None, tff.aggregators.MeanFactory())
  with pytest.raises(ConfigError, match='num_clients must be >= 1, got 0'):
    adaptive_weighting.AdaptiveWeightingFactory(None, 0)
  with pytest.raises(ConfigError, match="alpha must be a number, got 'five'"):
    adaptive_weighting.AdaptiveWeightingFactory(None, 3, 'five')
  with pytest.raises(ConfigError, match=re.escape('alpha must be >= 0, got -1.0; 0: FedAvg.')):
    adaptive_weighting.AdaptiveWeightingFactory(None, 3, -1.0)
  with pytest.raises(ConfigError, match='layers must be groups of tensor indices'):
    adaptive_weighting.AdaptiveWeightingFactory([0, 1], 3)
  adaptive_weighting.AdaptiveWeightingFactory([[0, 1], range(2, 4)], 3, 5)
  with pytest.raises(ConfigError, match="scaffold.num_clients must be an integer, got '3'"):
    scaffold_lib.build_scaffold(None, '3')
  from fltff.learning import fedprox
  with pytest.raises(ConfigError, match="fedprox.mu must be a number, got 'a'"):
    fedprox.build_fedprox(None, mu='a')  # The setting a user writes, not the regularizer's.
  from fltff.learning import optimizers
  with pytest.raises(ConfigError, match="server.learning_rate must be a number, got 'x'"):
    optimizers.build_optimizer('sgd', 'x', role='server')
  with pytest.raises(ConfigError, match=re.escape('fedprox.server_learning_rate must be > 0, '
                                                  'got 0.0.')):
    optimizers.server_sgd(None, 0.0, 'fedprox')
  # The library's own optimizer: a NaN or negative η diverged in round 1 (0: no step, a test's).
  for rate, wanted in ((-0.1, '>= 0, got -0.1'), (float('nan'), 'finite, got nan')):
    with pytest.raises(ConfigError, match=f'sgdm.learning_rate must be {wanted}'):
      optimizers.sgdm(rate)
  with pytest.raises(ConfigError, match=re.escape('sgdm.momentum must be in [0, 1), got 1.0')):
    optimizers.sgdm(0.1, 1.0)


@pytest.mark.parametrize('name,kwargs,message', [
    ('kapc', {'num_clients': 0}, 'kapc.num_clients must be >= 1, got 0'),
    ('kapc', {'num_clients': 2.0}, 'kapc.num_clients must be an integer, got 2.0'),
    ('kapc', {'num_clients': 3, 'bls_mu': 'high'}, "kapc+bls.bls_mu must be a number, got 'high'"),
    ('kapc', {'num_clients': 3, 'bls_mu': 1.5}, 'kapc+bls.bls_mu must be in [0, 1]'),
    ('kapc', {'num_clients': 3, 'bls_mu': -0.1}, 'kapc+bls.bls_mu must be in [0, 1]'),
    ('kapc', {'num_clients': 3, 'relationship_init': 'ones'},
     "kapc.relationship_init must be one of 'uniform', 'identity', 'random', got 'ones'."),
    ('kapc', {'num_clients': 3, 'relationship_steps': 1.5},
     'kapc.relationship_steps must be an integer, got 1.5'),
    # FedAMP's α_k is a positive step (α = 0: no message passing, local training).
    ('fedamp', {'num_clients': 3, 'alpha': -0.1}, 'fedamp.alpha must be > 0, got -0.1'),
    ('fedamp', {'num_clients': 3, 'alpha': 0.0}, 'fedamp.alpha must be > 0, got 0.0'),
    ('pfedla', {'num_clients': 3, 'hidden_dim': 0}, 'pfedla.hidden_dim must be >= 1, got 0'),
])
def test_a_personalised_method_checks_its_arguments(name, kwargs, message, spec):
  from fltff import methods
  with pytest.raises(ConfigError, match=re.escape(message)):
    methods.build(name, spec, **kwargs)


def _build(name, spec, *args, **kwargs):
  from fltff import methods
  return methods.build(name, spec, *args, **kwargs)


_module = importlib.import_module  # Imported when the test runs, not when it is collected.
# Library entry points, by the setting they check: a call with that setting = v.
_REFUSING_INFINITY = {
    'kapc.lambda_': lambda spec, v: _build('kapc', spec, 3, lambda_=v),
    'kapc.beta': lambda spec, v: _build('kapc', spec, 3, beta=v),
    'moon.temperature': lambda spec, v: _build('moon', spec, 3, temperature=v),
    'fedamp.sigma': lambda spec, v: _build('fedamp', spec, 3, sigma=v),
    'fedadp.alpha': lambda spec, v: _build('fedadp', spec, 3, alpha=v),
    'fedlayerwise.alpha': lambda spec, v: _build('fedlayerwise', spec, 3, alpha=v),
    'fedprox.mu': lambda spec, v: _build('fedprox', spec, mu=v),
    'ditto.lambda_': lambda spec, v: _build('ditto', spec, lambda_=v),
    'sgdm.learning_rate': lambda spec, v: _module('fltff.learning.optimizers').sgdm(v),
    'AdaptiveWeightingFactory.alpha': lambda spec, v: _module(
        'fltff.aggregators.adaptive_weighting').AdaptiveWeightingFactory(None, 3, v),
    'channel_model.server_power_dbm': lambda spec, v: _module(
        'fltff.simulation.channel').ChannelModel(4, server_power_dbm=v),
    'channel_model.power_dbm': lambda spec, v: _module(
        'fltff.simulation.channel').ChannelModel(4, power_dbm=(23.0, v)),
    'experiment.round_deadline': lambda spec, v: _module(
        'fltff.simulation.driver').RoundConfig(round_deadline=v),
    'runtime.rpc_timeout': lambda spec, v: _module('fltff.runtime.runtimes').make_runtime(
        rpc_timeout=v, executor='in_process'),
}


@pytest.mark.parametrize('setting', sorted(_REFUSING_INFINITY))
@pytest.mark.parametrize('value', [float('inf'), -np.inf])
def test_settings_refuse_infinity_naming_the_parameter(setting, value, spec):
  with pytest.raises(ConfigError, match=rf'^{re.escape(setting)} must be finite, got -?inf\b'):
    _REFUSING_INFINITY[setting](spec, value)


def test_infinity_where_it_means_something():
  """runtime.connect_timeout = inf waits for the workers as long as it takes; gin writes it
  1e999, and its type check leaves it to the configurable's own."""
  from fltff.config_checks import check_gin_bindings
  from fltff.runtime.runtimes import make_runtime
  assert make_runtime(connect_timeout=float('inf'), executor='in_process') is not None
  check_gin_bindings({('', 'runtime'): {'connect_timeout': 1e999}})
  with pytest.raises(ConfigError, match=r'^runtime.max_retries must be an integer, got inf'):
    check_gin_bindings({('', 'runtime'): {'max_retries': 1e999}})


# -- num_clients smaller than the real clients: one Python error, not a raw gRPC INTERNAL ---
def test_client_index_beyond_num_clients_is_a_python_error():
  import collections
  import numpy as np
  import tensorflow as tf
  from fltff import learning
  from fltff import personalization
  from fltff.errors import ConfigError
  from fltff.learning import ModelSpec
  from helpers import start_process
  from helpers import tiny_mlp

  spec = ModelSpec(lambda: tiny_mlp(3, 2, 1), (3,), 2)
  rng = np.random.default_rng(0)
  inputs = [learning.client_input(tf.data.Dataset.from_tensor_slices(collections.OrderedDict(
      x=rng.normal(size=(4, 3)).astype(np.float32), y=np.zeros(4, np.int32))).batch(2), k, 1)
            for k in range(3)]
  for algorithm in (learning.build_fedlayerwise(spec, num_clients=2),
                    learning.build_fedadp(spec, num_clients=2)):
    _, state = start_process(algorithm)
    with pytest.raises(ConfigError, match=r'num_clients=2 .*client index\(es\) \[2\]'):
      algorithm.next(state, None, inputs)
    assert algorithm.next(state, None, inputs[:2]).state is not None  # In range: it runs.
  scaffold = learning.build_scaffold(spec, num_clients=2)
  with pytest.raises(ConfigError, match=r'scaffold was built for num_clients=2'):
    scaffold.check_client_indices([0, 5])
  kapc = personalization.build_kapc(spec, 2)
  states = [kapc.initial_client_state(k) for k in range(2)]
  with pytest.raises(ConfigError, match=r'kapc was built for num_clients=2 .*\[2\]'):
    kapc.server_input([0, 2], states, [4.0, 4.0])


def test_a_full_disk_is_one_line_keeps_the_rounds_and_leaves_no_tmp(tmp_path):
  """The run folder on a 1.8 MB tmpfs (a private mount namespace, as an unprivileged user):
  checkpoints fill it within a few rounds."""
  mount = tmp_path / 'small_disk'
  mount.mkdir()
  out = mount / 'run'
  command = (f'mount -t tmpfs -o size=1800k tmpfs {mount} && {sys.executable} -m '
             f'pipelines.run {" ".join(shlex.quote(a) for a in SMALL)} '
             f"'--gin_bindings=experiment.rounds = 20' "
             f"'--gin_bindings=runtime.executor = \"in_process\"' --output_dir={out}; "
             f'status=$?; ls -a {out}/checkpoints; echo LATEST; cat {out}/checkpoints/latest.json; '
             'exit $status')
  result = subprocess.run(['unshare', '--user', '--map-root-user', '--mount', 'sh', '-c',
                           command], cwd=REPO, env=pipeline_env(), capture_output=True,
                          text=True, timeout=600)
  line = assert_one_line_error(result, 'No space left on device')
  saved = json.loads(result.stdout.split('LATEST')[-1])['round']
  assert saved >= 1 and (f'Rounds 1-{saved} are kept' in line or 'Round 1 is kept' in line), line
  assert '.tmp' not in result.stdout, result.stdout
  assert 'Exception ignored' not in result.stderr, result.stderr[-3000:]


def test_a_required_parameter_left_unbound_is_one_line(tmp_path):
  # gin raises a RuntimeError when a configurable is called without a required binding.
  config = tmp_path / 'unbound.gin'
  config.write_text('experiment.rounds = 1\n')
  out = tmp_path / 'run'
  line = assert_one_line_error(run_pipeline_here(f'--gin_file={config}', f'--output_dir={out}'),
                               'experiment.method, experiment.model are not bound')
  assert '--gin_bindings' in line
  assert not out.exists()  # A run that wrote nothing leaves no folder.
