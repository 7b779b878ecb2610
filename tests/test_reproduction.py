"""The Reproduction report: paper numbers beside ours, gains and round reductions computed right."""

import csv
import json
import os
import subprocess
import sys

import pytest

from pipelines import report
from pipelines import reproduction

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write_run(root, name, accs, key='test_accuracy'):
  path = os.path.join(root, 'runs', name)
  os.makedirs(path)
  with open(os.path.join(path, 'metrics.csv'), 'w', newline='') as f:
    writer = csv.DictWriter(f, fieldnames=['round', key, 'bytes_up', 'bytes_down'])
    writer.writeheader()
    for i, a in enumerate(accs, start=1):
      writer.writerow({'round': i, key: a, 'bytes_up': 1e6, 'bytes_down': 2e6})
  with open(os.path.join(path, 'summary.json'), 'w') as f:
    json.dump({'method': name}, f)


@pytest.fixture
def results(tmp_path):
  root = str(tmp_path)
  # FedLap-style curves over 4 rounds; at_round = 2.
  _write_run(root, 'avg', [0.1, 0.3, 0.5, 0.6])
  _write_run(root, 'prox', [0.2, 0.35, 0.45, 0.65])
  _write_run(root, 'lap', [0.3, 0.4, 0.55, 0.7])
  # Rounds to 0.5: fedavg 4, fedadp 2, fedlayerwise 1.
  _write_run(root, 'f_avg', [0.1, 0.2, 0.3, 0.5])
  _write_run(root, 'f_adp', [0.1, 0.6, 0.7, 0.8])
  _write_run(root, 'f_lw', [0.5, 0.6, 0.7, 0.8])
  _write_run(root, 's0', [0.5, 0.9], key='mean_local_accuracy')
  _write_run(root, 's1', [0.6, 0.7], key='mean_local_accuracy')
  manifest = {'sections': [
      {'id': 'gain', 'kind': 'early_gain', 'paper': 'p', 'title': 'Gain', 'at_round': 2,
       'method': 'lap', 'baselines': ['avg', 'prox'],
       'groups': [{'label': 'g', 'claim': 'c1',
                   'runs': {'avg': 'avg', 'prox': 'prox', 'lap': 'lap'}},
                  {'label': 'missing', 'runs': {'avg': 'avg', 'prox': 'nope', 'lap': 'lap'}}]},
      {'id': 'rtt', 'kind': 'rounds_to_target', 'paper': 'p', 'title': 'Rounds',
       'target': 0.5, 'targets': [0.5, 0.9],
       'groups': [{'label': 'mix', 'runs': {'fedavg': 'f_avg', 'fedadp': 'f_adp',
                                            'fedlayerwise': 'f_lw'}}]},
      {'id': 'seeds', 'kind': 'seeds', 'title': 'Seeds',
       'groups': [{'label': 'k', 'metric': 'mean_local_accuracy',
                   'runs': {'kapc': ['s0', 's1', 's2']}}]},
  ]}
  paper = {'p': {'paper': 'A paper', 'claims': [
      {'id': 'c1', 'source': 'abstract', 'text': 'three to five points'}],
                 'not_available': ['Fig. 1']}}
  with open(os.path.join(root, 'reproduction.json'), 'w') as f:
    json.dump(manifest, f)
  with open(os.path.join(root, 'paper_numbers.json'), 'w') as f:
    json.dump(paper, f)
  return root


def _row(md, start):
  """Cells of the last line starting with `start` (the summary tables follow the run tables)."""
  line = [l for l in md.splitlines() if l.startswith(start)][-1]
  return [c.strip() for c in line.strip('|').split('|')]


def test_gains_reductions_and_seeds(results):
  md = reproduction.write(results, report)
  # lap at round 2: 0.40 vs avg 0.30 / prox 0.35; mean over rounds 1-2: lap 0.35, avg 0.2,
  # prox 0.275; final 0.70 vs 0.60 / 0.65.
  assert _row(md, '| g | avg |') == ['g', 'avg', '+10.00', '+15.00', '+10.00',
                                     'three to five points']
  assert _row(md, '| g | prox |') == ['g', 'prox', '+5.00', '+7.50', '+5.00',
                                      'three to five points']
  assert _row(md, '| missing | prox |')[2] == 'not run'
  assert _row(md, '| missing | avg |')[2] == '+10.00'
  assert _row(md, '| g | lap')[3:5] == ['0.4000', '0.3500']
  # Rounds to 0.5: 1 vs 4 -> 75 % fewer; 1 vs 2 -> 50 %; fedadp 2 vs 4 -> 50 %.
  assert _row(md, '| mix | 0.5 (main)')[2:] == ['+75.0 %', '+50.0 %', '+50.0 %']
  assert _row(md, '| mix | 0.9 |')[2:] == ['–', '–', '–']
  assert _row(md, '| mix | fedlayerwise')[3:5] == ['1', '–']
  # Seeds: best 0.9 and 0.7 -> 0.8 ± 0.1414 (n=2); s2 missing and named.
  seeds = _row(md, '| k | kapc')
  assert seeds[2] == '0.8000 ± 0.1414 (n=2)' and seeds[3] == '0.8000 ± 0.1414 (n=2)'
  assert seeds[4] == 's2'
  assert 'Not available to us (paper PDF not reachable here): Fig. 1.' in md
  assert os.path.getsize(os.path.join(results, 'figures', 'gain.png')) > 1000
  assert open(os.path.join(results, 'reproduction.md')).read() == md


def test_shipped_results_report_builds(tmp_path):
  """The repository's results/ manifest and paper numbers are consistent (CLI, exit 0)."""
  import shutil
  shutil.copytree(os.path.join(REPO, 'results'), tmp_path / 'results')
  result = subprocess.run([sys.executable, '-m', 'pipelines.report',
                           f'--reproduction={tmp_path / "results"}'], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  manifest = json.load(open(os.path.join(REPO, 'results', 'reproduction.json')))
  md = (tmp_path / 'results' / 'reproduction.md').read_text()
  for section in manifest['sections']:
    assert section['title'] in md
  paper = json.load(open(os.path.join(REPO, 'results', 'paper_numbers.json')))
  for section in manifest['sections']:
    assert section.get('paper') in (None, *paper)


def test_collect_copies_only_finished_runs(results, tmp_path):
  source = tmp_path / 'runs_out'
  for name, rounds_done, rounds in (('avg', 4, 4), ('prox', 2, 4)):
    d = source / name
    d.mkdir(parents=True)
    rows = ['round,test_accuracy'] + [f'{i},0.5' for i in range(1, rounds_done + 1)]
    (d / 'metrics.csv').write_text('\n'.join(rows) + '\n')
    (d / 'summary.json').write_text('{}')
    (d / 'config.gin').write_text(f'experiment.model = "mlp2"\nexperiment.rounds = {rounds}\n')
    (d / 'checkpoints').mkdir()
  status = reproduction.collect(results, str(source))
  assert status['avg'] == 'copied' and status['prox'] == 'in progress 2/4'
  assert status['lap'] == 'absent'
  copied = sorted(os.listdir(os.path.join(results, 'runs', 'avg')))
  assert copied == ['config.gin', 'metrics.csv', 'summary.json']
  assert open(os.path.join(results, 'runs', 'avg', 'metrics.csv')).read().count('\n') == 5


def test_read_plan_and_commands(tmp_path):
  from pipelines import reproduce
  plan = tmp_path / 'plan.txt'
  plan.write_text('# comment\n\na gin_configs/x.gin\n'
                  'b gin_configs/y.gin experiment.seed = 1; federated_data.seed = 1  # s1\n')
  runs = reproduce.read_plan(str(plan))
  assert runs == [reproduce.PlannedRun('a', 'gin_configs/x.gin'),
                  reproduce.PlannedRun('b', 'gin_configs/y.gin',
                                       ('experiment.seed = 1', 'federated_data.seed = 1'))]
  args, state = reproduce.command(runs[1], str(tmp_path))
  # No executor pin (the default 'auto' chooses); the plan's bindings come last.
  assert state == 'start' and args[-2:] == ['--gin_bindings=experiment.seed = 1',
                                            '--gin_bindings=federated_data.seed = 1']
  assert not any('runtime.executor' in a for a in args)
  (tmp_path / 'b').mkdir()
  (tmp_path / 'b' / 'config.gin').write_text('experiment.rounds = 2\n')
  (tmp_path / 'b' / 'metrics.csv').write_text('round\n1\n')
  # Stopped before its first checkpoint: pipelines.run refuses the folder without --resume.
  args, state = reproduce.command(runs[1], str(tmp_path))
  assert state == 'restart' and args[-1] == '--resume'
  (tmp_path / 'b' / 'checkpoints').mkdir()
  assert reproduce.command(runs[1], str(tmp_path))[1] == 'resume'
  (tmp_path / 'b' / 'metrics.csv').write_text('round\n1\n2\n')
  assert reproduce.command(runs[1], str(tmp_path)) == ([], 'done')
  for bad in ('just_a_name\n', 'a x.gin\na y.gin\n'):
    plan.write_text(bad)
    with pytest.raises(ValueError):
      reproduce.read_plan(str(plan))


def test_shipped_plan_names_every_manifest_run_and_existing_configs():
  from pipelines import reproduce
  plan = reproduce.read_plan(os.path.join(REPO, 'results', 'plan.txt'))
  names = {r.name for r in plan}
  assert set(reproduction.manifest_runs(os.path.join(REPO, 'results'))) <= names
  for run in plan:
    assert os.path.isfile(os.path.join(REPO, run.gin_file)), run.gin_file


def test_reproduce_runs_then_skips_a_finished_run(tmp_path):
  """End to end on the MNIST sample: one planned run, then the same command finds it done."""
  from helpers import SMALL, pipeline_env
  bindings = '; '.join(a.split('=', 1)[1] for a in SMALL[1:]) + '; experiment.rounds = 1'
  plan = tmp_path / 'plan.txt'
  plan.write_text(f'tiny {SMALL[0].split("=", 1)[1]} {bindings}\n')
  cmd = [sys.executable, '-m', 'pipelines.reproduce', f'--plan={plan}',
         f'--runs_dir={tmp_path / "runs"}']
  first = subprocess.run(cmd, cwd=REPO, env=pipeline_env(), capture_output=True, text=True,
                         timeout=600)
  assert first.returncode == 0, first.stderr[-2000:] + first.stdout
  assert 'tiny: start' in first.stdout and 'tiny: exit 0' in first.stdout
  rows = open(tmp_path / 'runs' / 'tiny' / 'metrics.csv').read().splitlines()
  assert len(rows) == 2
  again = subprocess.run(cmd, cwd=REPO, env=pipeline_env(), capture_output=True, text=True,
                         timeout=600)
  assert again.returncode == 0 and 'tiny: done' in again.stdout


def test_one_seed_has_no_spread_and_none_is_a_dash():
  assert reproduction._mean_std([0.5]) == '0.5000 (n=1, no std)'  # pylint: disable=protected-access
  assert reproduction._mean_std([]) == '–'  # pylint: disable=protected-access
  assert reproduction._mean_std([0.9, 0.7]) == '0.8000 ± 0.1414 (n=2)'  # pylint: disable=protected-access
