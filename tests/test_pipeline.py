"""End-to-end tests of `python -m pipelines.run`: outputs, resume, clear errors, no leaks.

Each test starts the pipeline as a process of its own, as a user would (`launcher.py`), or
in this process where only its numbers matter.
"""

import json
import os
import shutil
import subprocess
import time

import numpy as np
import pytest

import fltff

from helpers import REPO
from helpers import SMALL
from helpers import assert_one_line_error
from helpers import read_csv
from helpers import tagged_worker_pids
from helpers import run_pipeline
from helpers import run_pipeline_here
from helpers import stopped_after
from launcher import Program
from launcher import run_program


def test_outputs_are_complete(small_run):
  out, result, leaked = small_run
  assert not leaked, f'worker_binary processes outlived the pipeline: {leaked}'
  assert 'round    3/3' in result.stdout
  rows = read_csv(os.path.join(out, 'metrics.csv'))
  assert [int(r['round']) for r in rows] == [1, 2, 3]
  for r in rows:
    assert 0.0 <= float(r['test_accuracy']) <= 1.0
    assert np.isfinite(float(r['train_loss']))
  summary = json.load(open(os.path.join(out, 'summary.json')))
  assert summary['rounds_completed'] == 3
  assert summary['fltff_version'] == fltff.__version__
  commit = subprocess.run(['git', '-C', REPO, 'rev-parse', '--short=12', 'HEAD'],
                          capture_output=True, text=True, check=True).stdout.strip()
  assert summary['fltff_commit'].startswith(commit)
  assert summary['final_accuracy'] == pytest.approx(float(rows[-1]['test_accuracy']))
  assert summary['best_accuracy'] == pytest.approx(max(float(r['test_accuracy']) for r in rows))
  assert set(summary['rounds_to_target']) == {'0.6', '0.7', '0.8'}
  # mlp2 has 159,010 float32 parameters; 3 clients per round receive the model and send an
  # update of the same size plus a float32 weight.
  assert summary['bytes_down_per_round'] == [3 * 159010 * 4] * 3
  assert summary['bytes_up_per_round'] == [3 * (159010 * 4 + 4)] * 3
  assert summary['examples_processed'] == sum(int(r['examples']) for r in rows)
  partition = json.load(open(os.path.join(out, 'partition.json')))
  hist = np.array(partition['label_histograms'])
  assert hist.shape == (10, 10) and hist.sum() == 1003
  config = open(os.path.join(out, 'config.gin')).read()
  assert 'experiment.rounds = 3' in config and 'shard_partition' in config
  assert any(f.startswith('events.out.tfevents')
             for f in os.listdir(os.path.join(out, 'tensorboard')))
  assert os.path.getsize(os.path.join(out, 'accuracy_loss.png')) > 1000
  assert os.path.exists(os.path.join(out, 'checkpoints', 'latest.json'))


def test_a_binding_the_run_never_reads_is_one_warning(small_run, tmp_path):
  # gin ignores the bindings of a configurable the run never calls without a word: a
  # `fedprox.mu` left in a file that runs `experiment.method = @fedavg` seemed to apply.
  _, quiet, _ = small_run
  assert 'does not read' not in quiet.stderr, quiet.stderr[-3000:]
  result = run_pipeline(
      SMALL[0], '--gin_bindings=experiment.rounds = 1',
      '--gin_bindings=experiment.clients_per_round = 2', '--gin_bindings=fedprox.mu = 0.1',
      '--gin_bindings=UNUSED = 1',  # A macro nothing refers to.
      '--gin_bindings=other/fedavg.server_learning_rate = 2.0',  # No call in that scope.
      # Read: the channel model's seed, which the experiment passes only when gin does not.
      '--gin_bindings=experiment.channel = @channel_model',
      '--gin_bindings=channel_model.seed = 3', f'--output_dir={tmp_path / "run"}')
  assert result.returncode == 0, result.stderr[-3000:]
  warnings = [l for l in result.stderr.splitlines() if l.startswith('warning: ')]
  assert len(warnings) == 1, result.stderr[-3000:]
  assert warnings[0].startswith('warning: this run does not read UNUSED, fedprox.mu, '
                                'other/fedavg.server_learning_rate: '), warnings[0]
  summary = json.load(open(tmp_path / 'run' / 'summary.json'))
  assert summary['seeds']['channel'] == 3


def test_resume_after_kill_matches_uninterrupted_run(small_run, tmp_path):
  reference_dir, _, _ = small_run
  out = str(tmp_path / 'killed')
  before = tagged_worker_pids()
  proc = Program('pipelines.run', *SMALL, f'--output_dir={out}', capture=False)
  latest = os.path.join(out, 'checkpoints', 'latest.json')
  deadline = time.monotonic() + 300
  while time.monotonic() < deadline and proc.poll() is None:
    if os.path.exists(latest) and json.load(open(latest))['round'] >= 1:
      break
    time.sleep(0.05)
  assert proc.poll() is None, 'run finished before it could be killed'
  proc.kill()  # SIGKILL: no Python cleanup at all.
  proc.wait()
  killed_at = json.load(open(latest))['round']
  assert killed_at < 3
  # PR_SET_PDEATHSIG takes the worker down with the SIGKILLed driver.
  deadline = time.monotonic() + 10
  while tagged_worker_pids() - before and time.monotonic() < deadline:
    time.sleep(0.1)
  assert not tagged_worker_pids() - before

  result = run_pipeline(*SMALL, f'--output_dir={out}', '--resume')
  assert result.returncode == 0, result.stderr[-3000:]
  assert f'Resumed from the checkpoint of round {killed_at}' in result.stdout
  # The killed process made the rounds its checkpoint kept; later ones it ran were redone.
  segments = json.load(open(os.path.join(out, 'summary.json')))['segments']
  assert [(s['first_round'], s['last_round']) for s in segments] == [(1, killed_at),
                                                                      (killed_at + 1, 3)]
  resumed = read_csv(os.path.join(out, 'metrics.csv'))
  reference = read_csv(os.path.join(reference_dir, 'metrics.csv'))
  assert [r['round'] for r in resumed] == [r['round'] for r in reference]
  for a, b in zip(resumed, reference):
    for key in ('train_loss', 'train_accuracy', 'test_loss', 'test_accuracy', 'examples'):
      assert float(a[key]) == pytest.approx(float(b[key]), rel=1e-5, abs=1e-6), key


def test_rerun_without_resume_refuses_to_overwrite(small_run):
  out, _, _ = small_run
  assert_one_line_error(run_pipeline(*SMALL, f'--output_dir={out}'), '--resume')


@pytest.mark.parametrize('bindings,fragments', [
    (['experiment.methodd = @fedavg'], ["methodd"]),
    (['experiment.method = @fedavgg'], ['fedavgg']),
    (['client_optimizer.lr = 0.1'], ['lr']),
    (["experiment.model = 'mlp3'"], ['mlp3', 'mlp2']),
    (['experiment.model = @fedavg'], ['a model name (a string), got the function build_fedavg', 'mlp2']),
    (['experiment.method = @kapc', 'kapc.bls_mu = 1.5'], ['bls_mu must be in [0, 1]', '1.5']),
    (['federated_data.num_clients = 2000', 'shard_partition.shards_per_client = 1'],
     ['2000']),
    (['federated_data.partitioner = @dirichlet_partition',
      'dirichlet_partition.alpha = 0.0'], ['alpha']),
    (["federated_data.source = @tfds_source", "tfds_source.name = 'mnistt'"], ['mnistt']),
    (['experiment.rounds = [3'], ['leaves a bracket or string open']),
    (["include 'gin_configs/no_such_file.gin'"], ['an included file is not found',
                                                  'no_such_file.gin']),
])
def test_bad_configuration_is_one_clear_error(bindings, fragments, tmp_path):
  args = [SMALL[0], *[f'--gin_bindings={b}' for b in bindings], f'--output_dir={tmp_path}']
  assert_one_line_error(run_pipeline_here(*args), *fragments)


def test_an_include_cycle_is_one_line_naming_its_files(tmp_path):
  # Gin follows it until Python's recursion limit ("maximum recursion depth exceeded").
  a, b = str(tmp_path / 'a.gin'), str(tmp_path / 'b.gin')
  with open(a, 'w') as f:
    f.write(f"include '{SMALL[0].split('=', 1)[1]}'\ninclude 'b.gin'\n")
  with open(b, 'w') as f:
    f.write("include 'a.gin'\n")
  for args in ([f'--gin_file={a}'], [SMALL[0], f"--gin_bindings=include '{b}'"]):
    result = run_pipeline_here(*args, f'--output_dir={tmp_path}/out')
    assert_one_line_error(result, 'an include cycle', f'{a} includes {b} includes {a}'
                          if args[0].endswith('a.gin') else f'{b} includes {a} includes {b}')
  assert not os.path.exists(tmp_path / 'out')


def test_a_gin_files_imports_are_found_beside_it_after_pythons_path(tmp_path, monkeypatch):
  # `fltff run --gin_file=/elsewhere/exp.gin` whose `import my_models` names a module beside
  # exp.gin stopped with "No module named 'my_models'": only its includes were looked up there.
  import sys  # pylint: disable=g-import-not-at-top

  import gin  # pylint: disable=g-import-not-at-top
  from fltff.errors import ConfigError  # pylint: disable=g-import-not-at-top
  from fltff.simulation.experiment import configure  # pylint: disable=g-import-not-at-top

  elsewhere, parts, cwd = tmp_path / 'elsewhere', tmp_path / 'elsewhere' / 'parts', tmp_path / 'cwd'
  parts.mkdir(parents=True)
  cwd.mkdir()
  monkeypatch.chdir(cwd)
  (elsewhere / 'exp.gin').write_text(
      "import beside_exp_models\ninclude 'parts/part.gin'\nexperiment.rounds = 2\n")
  (elsewhere / 'beside_exp_models.py').write_text('ROUNDS = 2\n')
  (parts / 'part.gin').write_text('import beside_part_models\n')  # Beside the including file.
  (parts / 'beside_part_models.py').write_text('ROUNDS = 3\n')
  (elsewhere / 'missing.gin').write_text('import beside_no_such_models\n')
  path = list(sys.path)
  try:
    configure([str(elsewhere / 'exp.gin')], [])
    assert gin.query_parameter('experiment.rounds') == 2
    assert sys.modules['beside_exp_models'].__file__ == str(elsewhere / 'beside_exp_models.py')
    assert sys.modules['beside_part_models'].__file__ == str(parts / 'beside_part_models.py')
    assert sys.path == path  # Only while gin parses the file.
    gin.clear_config()
    with pytest.raises(ConfigError, match="No module named 'beside_no_such_models'"):
      configure([str(elsewhere / 'missing.gin')], [])
    assert sys.path == path
  finally:
    gin.clear_config()
    for name in ('beside_exp_models', 'beside_part_models'):
      sys.modules.pop(name, None)


@pytest.mark.parametrize('what', ['a device', 'a folder', 'over 1 MiB'])
def test_a_gin_file_that_cannot_be_a_configuration_is_refused_unread(what, tmp_path):
  # --gin_file=/dev/zero was read without limit (8.9 GB in 26 s); /dev/null stands in for it.
  path = {'a device': '/dev/null', 'a folder': str(tmp_path)}.get(what, str(tmp_path / 'big.gin'))
  if what == 'over 1 MiB':
    with open(path, 'w') as f:
      f.write('# a comment\n' * 100_000)
  from fltff import resources  # pylint: disable=g-import-not-at-top
  from fltff.errors import ConfigError  # pylint: disable=g-import-not-at-top

  message = 'is over 1 MiB' if what == 'over 1 MiB' else 'is not a regular file'
  with pytest.raises(ConfigError, match=f'the gin file {path} {message}'):
    resources.find_gin_files([path])
  with open(tmp_path / 'includer.gin', 'w') as f:
    f.write(f"include '{path}'\n")
  with pytest.raises(ConfigError, match=message):  # Included, too.
    resources.find_gin_files([str(tmp_path / 'includer.gin')])


def test_tfds_not_prepared_offline_says_how_to_prepare(tmp_path):
  empty = tmp_path / 'tfds'
  empty.mkdir()
  args = [SMALL[0], '--gin_bindings=federated_data.source = @tfds_source',
          "--gin_bindings=tfds_source.name = 'fashion_mnist'",
          f"--gin_bindings=tfds_source.data_dir = '{empty}'", f'--output_dir={tmp_path}/o']
  line = assert_one_line_error(run_pipeline_here(*args), 'fashion_mnist', str(empty))
  assert 'download' in line


def test_resume_with_another_configuration_is_refused_and_changes_nothing(small_run):
  out, _, _ = small_run
  # Every file but the lock the resume took (it writes its pid there).
  before = {name: os.path.getmtime(os.path.join(root, name))
            for root, _, names in os.walk(out) for name in names if name != '.fltff-run.lock'}
  result = run_pipeline_here(*SMALL, '--gin_bindings=experiment.seed = 5',
                        '--gin_bindings=experiment.rounds = 4', f'--output_dir={out}', '--resume')
  assert_one_line_error(result, 'experiment.seed: 0 -> 5', 'rounds 1-3', '--allow_config_change')
  after = {name: os.path.getmtime(os.path.join(root, name))
           for root, _, names in os.walk(out) for name in names if name != '.fltff-run.lock'}
  assert after == before


def test_resume_with_fewer_rounds_than_checkpointed_is_refused_and_changes_nothing(small_run):
  out, _, _ = small_run
  before = {name: os.path.getmtime(os.path.join(root, name))
            for root, _, names in os.walk(out) for name in names if name != '.fltff-run.lock'}
  result = run_pipeline_here(*SMALL, '--gin_bindings=experiment.rounds = 2',
                             f'--output_dir={out}', '--resume')
  assert_one_line_error(result, 'rounds 1-3', 'experiment.rounds = 2', '>= 3')
  after = {name: os.path.getmtime(os.path.join(root, name))
           for root, _, names in os.walk(out) for name in names if name != '.fltff-run.lock'}
  assert after == before


def test_divergence_stops_and_keeps_completed_rounds(small_run, tmp_path):
  out = str(tmp_path / 'nan')
  shutil.copytree(small_run[0], out)
  stopped_after(out, 2)  # As a run stopped after round 2 leaves it.
  result = run_pipeline_here(*SMALL, '--gin_bindings=client_optimizer.learning_rate = 1e12',
                        f'--output_dir={out}', '--resume', '--allow_config_change')
  assert_one_line_error(result, 'diverged in round 3', 'Rounds 1-2')
  with open(os.path.join(out, 'config_changes.txt')) as f:
    assert f.read().startswith('resumed after round 2: client_optimizer.learning_rate: ')
  assert json.load(open(os.path.join(out, 'checkpoints', 'latest.json')))['round'] == 2
  assert [r['round'] for r in read_csv(os.path.join(out, 'metrics.csv'))] == ['1', '2']


def test_missing_gin_file_and_npz(tmp_path):
  assert_one_line_error(
      run_pipeline_here('--gin_file=gin_configs/nope.gin', f'--output_dir={tmp_path}'), 'nope.gin')
  assert_one_line_error(
      run_pipeline_here(SMALL[0], "--gin_bindings=npz_source.path = '/nonexistent/x.npz'",
                   f'--output_dir={tmp_path / "new" / "deeper" / "run"}'), '/nonexistent/x.npz')
  # A run that wrote nothing leaves no folder, nor the folders made for it.
  assert not os.path.exists(tmp_path / 'new')


def test_report_compares_runs(small_run, tmp_path):
  out, _, _ = small_run
  result = run_program('pipelines.report', f'--runs={out},{out}', f'--out={tmp_path}',
                       '--at_round=2', '--targets=0.01,0.99', timeout=120)
  assert result.returncode == 0, result.stderr[-2000:]
  rows = read_csv(os.path.join(out, 'metrics.csv'))
  acc = [100 * float(r['test_accuracy']) for r in rows]
  lines = open(os.path.join(tmp_path, 'report.md')).read().splitlines()
  start = lines.index(next(l for l in lines if l.startswith('**Table 2.** `central`'))) + 4
  cells = [c.strip() for c in lines[start].strip('|').split('|')]
  assert cells[1:4] == ['fedavg', '0', '3']
  assert cells[4] == f'{acc[1]:.2f}'
  assert cells[5] == f'{max(acc[:2]):.2f} ({acc[:2].index(max(acc[:2])) + 1})'
  assert cells[6:] == ['1', '–']
  assert os.path.getsize(os.path.join(tmp_path, 'accuracy.png')) > 1000


def test_report_pairs_gain_table(small_run, tmp_path):
  out, _, _ = small_run
  result = run_program('pipelines.report', f'--runs={out},{out}', '--pairs',
                       f'--out={tmp_path}', timeout=120)
  assert result.returncode == 0, result.stderr[-2000:]
  rows = read_csv(os.path.join(out, 'metrics.csv'))
  best = max(float(r['test_accuracy']) for r in rows)
  line = open(os.path.join(tmp_path, 'report.md')).read().splitlines()[2]
  cells = [c.strip() for c in line.strip('|').split('|')]
  assert cells[0] == 'fedavg' and float(cells[1]) == pytest.approx(best, abs=1e-4)
  assert cells[3] == '+0.00' and cells[6] == '+0.00'
  odd = run_program('pipelines.report', f'--runs={out}', '--pairs', f'--out={tmp_path}',
                    timeout=120)
  assert odd.returncode == 2 and 'even number' in odd.stderr
