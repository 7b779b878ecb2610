"""`fltff sweep`: the grid × seeds as one plan, checked before anything runs, run in parallel,
stopped by a signal, continued by the same command, and reported."""

import os
import re
import time

import pytest

from helpers import REPO
from helpers import assert_one_line_error
from helpers import pipeline_env
from helpers import read_csv
from launcher import Program
from launcher import run_program
from pipelines import plan
from pipelines import sweep

EXPERIMENT = """include 'gin_configs/quickstart.gin'
experiment.method = @fedprox
experiment.target_accuracies = []
"""


def test_the_grid_and_seeds_make_one_named_run_per_point():
  axes = sweep.parse_grid(['fedprox.mu=[0.001, 0.01]', "experiment.evaluation=['central'],"
                           "['central', 'global_local']"])
  assert axes == [('fedprox.mu', ['0.001', '0.01']),
                  ('experiment.evaluation', ["['central']", "['central', 'global_local']"])]
  runs = sweep.plan_points('/p/exp.gin', axes[:1], [0, 1], ['experiment.rounds = 2'])
  assert [r.name for r in runs] == ['fedprox.mu=0.001,seed=0', 'fedprox.mu=0.001,seed=1',
                                    'fedprox.mu=0.01,seed=0', 'fedprox.mu=0.01,seed=1']
  assert runs[1].bindings == ('experiment.rounds = 2', 'fedprox.mu = 0.001',
                              'experiment.seed = 1')
  assert sweep.plan_points('/p/exp.gin', axes[1:], [])[1].name == (
      'experiment.evaluation=central_global_local')
  for bad, message in [('mu=[1]', 'expected'), ('fedprox.mu=[1, 2', 'unbalanced'),
                       ('fedprox.mu=[1,,2]', 'empty'), ('fedprox.mu=[1, 1]', 'twice')]:
    with pytest.raises(ValueError, match=message):
      sweep.parse_grid([bad])
  with pytest.raises(ValueError, match='same folder name'):
    sweep.plan_points('/p/exp.gin', sweep.parse_grid(["a.b=['x y', 'x_y']"]), [])
  with pytest.raises(ValueError, match='nothing to sweep'):
    sweep.plan_points('/p/exp.gin', [], [])


def test_a_sweep_folder_keeps_its_runs_settings():
  old = sweep.plan_points('/p/exp.gin', sweep.parse_grid(['fedprox.mu=[0.1]']), [0])
  more = sweep.plan_points('/p/exp.gin', sweep.parse_grid(['fedprox.mu=[0.1]']), [0, 1])
  assert sweep.merge_plans(more, old, 'd') == old + more[1:]
  other = sweep.plan_points('/p/exp.gin', sweep.parse_grid(['fedprox.mu=[0.1]']), [0],
                            ['experiment.rounds = 9'])
  with pytest.raises(ValueError, match='d already plans fedprox.mu=0.1,seed=0 as'):
    sweep.merge_plans(other, old, 'd')


@pytest.mark.parametrize('args,fragment', [
    (['--grid=fedprox.muu=[0.1, 1.0]'], 'sweep point fedprox.muu=0.1,seed=0: Invalid gin '
     'configuration: fedprox.muu = 0.1 (in --gin_bindings): fedprox has no parameter muu; did '
     'you mean mu?'),
    (['--grid=experiment.local_epochs=[1, 2.5]'],
     'sweep point experiment.local_epochs=2.5,seed=0: experiment.local_epochs must be an integer'),
    (['--grid=fedprox.mu=[0.1, 1.0'], 'unbalanced brackets'),
    (['--grid=fedprox.mu=[0.1]', '--seeds=a'], '--seeds=a: expected integers'),
])
def test_bad_input_is_one_error_line_and_nothing_runs(tmp_path, args, fragment):
  (tmp_path / 'exp.gin').write_text(EXPERIMENT)
  result = run_program('pipelines.sweep', '--gin_file=exp.gin', '--seeds=0', *args,
                       '--sweep_dir=out', cwd=str(tmp_path), timeout=300)
  assert_one_line_error(result, fragment)
  assert sorted(os.listdir(tmp_path)) == ['exp.gin']


@pytest.mark.parametrize('program', [
    ['-m', 'pipelines.sweep', '--gin_file=gin_configs/quickstart.gin', '--sweep_dir=SWEEP'],
    ['-m', 'pipelines.reproduce', '--only=no_such_run'],
])
def test_the_flags_of_fltff_run_are_refused_in_one_line(program, tmp_path):
  # sweep and reproduce imported `pipelines.run` (through plan.py) and with it its flags: a
  # `--resume` or `--output_dir` given to them was accepted and ignored.
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top

  args = [sys.executable, *[a.replace('SWEEP', str(tmp_path / 'sweep')) for a in program],
          '--dry_run']
  for flag in ('--resume', f'--output_dir={tmp_path / "out"}'):
    result = subprocess.run(args + [flag], capture_output=True, text=True, cwd=REPO,
                            env=pipeline_env(), timeout=300, check=False)
    line = assert_one_line_error(result, 'Unknown command line flag')
    assert flag.split('=')[0][2:] in line
  assert os.listdir(tmp_path) == []
  imported = subprocess.run(
      [sys.executable, '-c', 'import sys, pipelines.plan, pipelines.sweep, pipelines.reproduce; '
       "print(sorted(m for m in ('pipelines.run', 'tensorflow') if m in sys.modules))"],
      capture_output=True, text=True, cwd=REPO, env=pipeline_env(), timeout=300, check=True)
  assert imported.stdout.strip() == '[]'


def _wait_for(predicate, what: str, timeout: float = 300):
  deadline = time.monotonic() + timeout
  while not predicate():
    assert time.monotonic() < deadline, what
    time.sleep(0.2)


def test_a_sweep_runs_in_parallel_stops_on_a_signal_and_continues(tmp_path):
  """From a folder outside the checkout: two points at once; SIGTERM reaches both runs (by
  PID), which stop after their round, checkpointed; the same command (the folder alone)
  resumes them and reports; a rerun with another seed skips the finished runs."""
  (tmp_path / 'exp.gin').write_text(EXPERIMENT)
  env = dict(pipeline_env(), PYTHONPATH=REPO)  # The runs are `python -m pipelines.run`.
  flags = ['--gin_file=exp.gin', '--grid=fedprox.mu=[0.0, 0.1]', '--seeds=0',
           '--gin_bindings=experiment.rounds = 150', '--sweep_dir=sweep']
  names = ['fedprox.mu=0.0,seed=0', 'fedprox.mu=0.1,seed=0']
  folder = tmp_path / 'sweep'
  first = Program('pipelines.sweep', *flags, '--parallel=2', env=env, cwd=str(tmp_path))
  logs = [folder / f'{name}.log' for name in names]
  _wait_for(lambda: all(l.exists() and 'round    2/150' in l.read_text() for l in logs) or
            first.poll() is not None, 'both runs reach round 2')
  first.terminate()
  first.wait(300)
  stdout, stderr = first.output()
  assert first.returncode == 143, stdout + stderr
  pids = [int(p) for p in re.findall(r': start, pid (\d+)', stdout)]
  assert len(pids) == 2 and not any(os.path.exists(f'/proc/{p}') for p in pids)
  assert stderr.splitlines()[-1].startswith('stopped: by a signal; the runs stopped are '
                                            'checkpointed')
  assert (folder / 'plan.txt').read_text().splitlines()[2:] == [
      f'{name} {tmp_path}/exp.gin experiment.rounds = 150; fedprox.mu = {mu}; experiment.seed = 0'
      for name, mu in zip(names, ('0.0', '0.1'))]
  for name, log in zip(names, logs):
    assert 'stopped: Stopped by signal after round' in log.read_text()
    assert plan.command(plan.read_plan(folder / 'plan.txt')[names.index(name)],
                        str(folder))[1] == 'resume'
  assert not (folder / 'report').exists()

  again = run_program('pipelines.sweep', '--sweep_dir=sweep', '--parallel=2', env=env,
                      cwd=str(tmp_path), timeout=600)
  assert again.returncode == 0, again.stdout + again.stderr[-3000:]
  for name in names:
    assert f'{name}: resume, pid' in again.stdout
    assert [int(r['round']) for r in read_csv(folder / name / 'metrics.csv')] == list(
        range(1, 151))
  text = (folder / 'report' / 'report.md').read_text()
  assert 'Sweep `sweep`: 2 of the 2 planned runs finished.' in text
  assert 'Compared at round 150, the last round all 2 runs evaluated' in text
  assert '| fedprox (mu=0.0) | 0 |' in text and '| fedprox (mu=0.1) | 0 |' in text

  # Another seed: added to the plan; the finished runs are skipped (shown without running).
  more = run_program('pipelines.sweep', *flags[:2], '--seeds=0,1', *flags[3:], '--dry_run',
                     env=env, cwd=str(tmp_path), timeout=300)
  assert more.returncode == 0, more.stderr[-3000:]
  assert re.findall(r'\d\d:\d\d:\d\d (\S+): (\w+)', more.stdout) == [
      ('fedprox.mu=0.0,seed=0', 'done'), ('fedprox.mu=0.1,seed=0', 'done'),
      ('fedprox.mu=0.0,seed=1', 'start'), ('fedprox.mu=0.1,seed=1', 'start')]
  # The same points with other settings are refused: the folder keeps its runs' settings.
  changed = run_program('pipelines.sweep', *flags[:3], '--gin_bindings=experiment.rounds = 9',
                        flags[4], env=env, cwd=str(tmp_path), timeout=300)
  assert_one_line_error(changed, 'sweep already plans fedprox.mu=0.0,seed=0 as')


def test_a_finished_point_the_edited_gin_file_would_compute_otherwise_is_refused(tmp_path):
  """A sweep continued after its gin file changed: a finished run computed with the old
  settings is not counted as done (nor reported as the point's), an unchanged one is, and one
  the file now asks more rounds of is continued to them."""
  (tmp_path / 'exp.gin').write_text(EXPERIMENT + 'experiment.rounds = 1\n')
  env = dict(pipeline_env(), PYTHONPATH=REPO)
  flags = ['--gin_file=exp.gin', '--grid=fedprox.mu=[0.1]', '--seeds=0', '--sweep_dir=sweep']
  first = run_program('pipelines.sweep', *flags, env=env, cwd=str(tmp_path), timeout=600)
  assert first.returncode == 0, first.stdout + first.stderr[-3000:]
  again = run_program('pipelines.sweep', '--sweep_dir=sweep', '--dry_run', env=env,
                      cwd=str(tmp_path), timeout=300)
  assert again.returncode == 0, again.stderr[-3000:]
  assert re.findall(r'\d\d:\d\d:\d\d (\S+): (\w+)', again.stdout) == [
      ('fedprox.mu=0.1,seed=0', 'done')]
  (tmp_path / 'exp.gin').write_text(EXPERIMENT + 'experiment.rounds = 1\n'
                                    'client_optimizer.learning_rate = 0.05\n')
  planned = (tmp_path / 'sweep' / 'plan.txt').read_text()
  changed = run_program('pipelines.sweep', '--sweep_dir=sweep', env=env, cwd=str(tmp_path),
                        timeout=300)
  assert_one_line_error(changed, 'sweep point fedprox.mu=0.1,seed=0: ',
                        'client_optimizer.learning_rate: 0.01 -> 0.05')
  assert (tmp_path / 'sweep' / 'plan.txt').read_text() == planned
  (tmp_path / 'exp.gin').write_text(EXPERIMENT + 'experiment.rounds = 2\n')
  longer = run_program('pipelines.sweep', '--sweep_dir=sweep', env=env, cwd=str(tmp_path),
                       timeout=600)
  assert longer.returncode == 0, longer.stdout + longer.stderr[-3000:]
  assert 'fedprox.mu=0.1,seed=0: resume, pid' in longer.stdout
  run = tmp_path / 'sweep' / 'fedprox.mu=0.1,seed=0'
  assert [r['round'] for r in read_csv(run / 'metrics.csv')] == ['1', '2']
  assert 'Compared at round 2, the last round all 1 runs evaluated' in (
      tmp_path / 'sweep' / 'report' / 'report.md').read_text()


@pytest.mark.parametrize('grid, fragment', [
    ('moon.mu=[1.0, 5.0]', '--grid moon.mu: no point reads it (experiment.method = @fedprox '),
    ('dirichlet_partition.alpha=[0.1, 0.5]',
     '--grid dirichlet_partition.alpha: no point reads it (federated_data.partitioner = '
     '@natural_partition '),
])
def test_a_grid_over_a_setting_no_point_reads_is_refused(tmp_path, grid, fragment):
  # Before: both values ran, as the same experiment, and the report showed them as two groups.
  (tmp_path / 'exp.gin').write_text(EXPERIMENT)
  result = run_program('pipelines.sweep', '--gin_file=exp.gin', f'--grid={grid}',
                       '--sweep_dir=out', cwd=str(tmp_path), timeout=300)
  assert_one_line_error(result, fragment)
  assert sorted(os.listdir(tmp_path)) == ['exp.gin']


def test_a_grid_some_points_do_not_read_is_a_warning():
  runs = sweep.plan_points(os.path.join(REPO, 'gin_configs/quickstart.gin'), sweep.parse_grid(
      ['experiment.method=[@fedavg, @fedprox]', 'fedprox.mu=[0.0, 0.1]']), [])
  assert sweep.inert_points(runs, 'fedprox.mu') == {
      'experiment.method=@fedavg,fedprox.mu=0.0': 'experiment.method = @fedavg',
      'experiment.method=@fedavg,fedprox.mu=0.1': 'experiment.method = @fedavg'}
  assert sweep.inert_points(runs, 'experiment.method') == {}
