"""`fltff report`: one protocol per table, one round for all runs, seed groups that survive a
resume, and the same tables as Markdown, CSV and LaTeX (small run folders shaped as `fltff run`
writes them)."""

import csv
import json
import os

import pytest

from launcher import run_program
from pipelines import report

CONFIG = """# Parameters for dirichlet_partition:
# ==============================================================================
dirichlet_partition.alpha = 0.1
dirichlet_partition.max_tries = 100

# Parameters for experiment:
# ==============================================================================
experiment.checkpoint_every = 5
experiment.clients_per_round = 10
experiment.evaluation = None
experiment.method = @{method}
experiment.model = 'mlp2'
experiment.rounds = {rounds}
experiment.seed = {seed}
experiment.target_accuracies = [0.5, 0.9]

# Parameters for {method}:
# ==============================================================================
{method}.{parameter} = {value}

# Parameters for federated_data:
# ==============================================================================
federated_data.local_test_examples = 20
federated_data.num_clients = 20
federated_data.partitioner = @dirichlet_partition
federated_data.seed = None

# Parameters for runtime:
# ==============================================================================
runtime.executor = '{executor}'
runtime.workers = []
"""


def write_run(root, name, columns, method='fedavg', seed=0, rounds=None, statistic=None,
              parameter='server_learning_rate', value='1.0', executor='auto', data=None):
  """A run folder as `fltff run` leaves it: metrics.csv (`columns`: {accuracy column: one value
  per round}), summary.json (its headline: the first column's best round) and config.gin;
  `data`: (npz_source.path, the data's source_fingerprint)."""
  path = os.path.join(root, name)
  os.makedirs(path)
  count = len(next(iter(columns.values())))
  with open(os.path.join(path, 'metrics.csv'), 'w', newline='') as f:
    writer = csv.DictWriter(f, fieldnames=['round', 'train_loss', 'examples', 'clients',
                                           'bytes_down', 'bytes_up', 'round_seconds',
                                           'test_loss', *columns])
    writer.writeheader()
    for i in range(count):
      row = {'round': i + 1, 'train_loss': 1.0 / (i + 1), 'examples': 400, 'clients': 10,
             'bytes_down': 636040, 'bytes_up': 636080, 'round_seconds': 0.5}
      if 'test_accuracy' in columns:
        row['test_loss'] = 1.5
      row.update({k: v[i] for k, v in columns.items()})
      writer.writerow(row)
  column = next(iter(columns))
  best = max(range(count), key=lambda i: columns[column][i])
  protocol = {'test_accuracy': 'central', 'personal_local_accuracy': 'personal_local'}[column]
  with open(os.path.join(path, 'summary.json'), 'w') as f:
    json.dump({'method': method, 'dataset': 'mnist1003', 'model': 'mlp2',
               'evaluation': [protocol], 'rounds_completed': count,
               'seeds': {'run': seed, 'model': seed, 'data': seed},
               'headline': {'protocol': protocol, 'column': column,
                            'statistic': statistic or 'best_round_mean',
                            'value': columns[column][best], 'round': best + 1},
               'rounds_to_target': {'0.5': None, '0.9': None},
               **({'source_fingerprint': data[1]} if data else {})}, f, indent=1)
  with open(os.path.join(path, 'config.gin'), 'w') as f:
    f.write(CONFIG.format(method=method, rounds=rounds or count, seed=seed, parameter=parameter,
                          value=value, executor=executor) +
            (f"npz_source.path = '{data[0]}'\n" if data else ''))
  return path


@pytest.fixture
def runs(tmp_path):
  """FedAvg (central and global_local) and KAPC (personal_local) over seeds 0 and 1, 10 rounds;
  FedAvg's seed 1 was run to 6 rounds, then continued to 12 with --resume on TFF's runtime."""
  root = str(tmp_path / 'runs')
  return [
      write_run(root, 'fedavg_s0', {
          'test_accuracy': [.30, .40, .50, .55, .60, .62, .64, .66, .70, .68],
          'global_local_accuracy': [.40] * 9 + [.50]}),
      write_run(root, 'fedavg_s1', {
          'test_accuracy': [.32, .42, .52, .56, .58, .60, .62, .66, .68, .72, .74, .75],
          'global_local_accuracy': [.44] * 9 + [.54, .55, .56]}, seed=1, rounds=12,
                executor='tff_cpp'),
      write_run(root, 'kapc_s0', {
          'personal_local_accuracy': [.60, .70, .80, .85, .86, .87, .88, .89, .90, .88]},
                method='kapc', parameter='lam', value='0.5', statistic='mean_client_best'),
      write_run(root, 'kapc_s1', {
          'personal_local_accuracy': [.62, .72, .82, .86, .87, .88, .89, .90, .91, .92]},
                method='kapc', seed=1, parameter='lam', value='0.5'),
  ]


def _table(md: str, number: int) -> list[list[str]]:
  """The cells of table `number` of report.md, header first."""
  lines = md.splitlines()
  start = next(i for i, l in enumerate(lines) if l.startswith(f'**Table {number}.**')) + 2
  rows = []
  for line in lines[start:]:
    if not line.startswith('|'):
      break
    if not line.startswith('|---'):
      rows.append([c.strip() for c in line.strip('|').split('|')])
  return rows


def test_each_protocol_is_a_table_at_the_last_round_all_runs_reached(runs, tmp_path):
  out = str(tmp_path / 'report')
  md = report.write_report([report.load_run(p) for p in runs], out, targets=[0.5, 0.9])
  assert md.splitlines()[0] == ('# Comparison of 4 runs: mnist1003 · mlp2 · 20 clients, 10 per '
                                'round · dirichlet partition (alpha=0.1)')
  assert ('Compared at round 10, the last round all 4 runs evaluated (`--at_round` chooses '
          'another). Runs that went further (their rounds): fedavg_s1 (12); the tables compare '
          'round 10.') in md
  # Headline protocols first (two runs each: the registry's order), then the others.
  assert [l.split('`')[1] for l in md.splitlines() if l.startswith('**Table')] == [
      'central', 'central', 'personal_local', 'personal_local', 'global_local', 'global_local']
  assert '**Table 1.** `central` protocol: the global model on the central test set ' \
         '(metrics.csv `test_accuracy`). Accuracy (%) at round 10' in md
  # The resumed run (rounds 12, another executor) stays in its seed group; KAPC has no central
  # reading and is marked, not mixed in.
  assert _table(md, 1) == [
      ['method', 'seeds', 'at round 10 (%)', 'best round ≤ 10 (%)'],
      ['fedavg', '0, 1', '70.00 ± 2.83 (n=2)', '71.00 ± 1.41 (n=2)'],
      ['kapc', '0, 1', 'not evaluated', 'not evaluated']]
  assert _table(md, 2) == [
      ['run', 'method', 'seed', 'rounds', 'at round 10 (%)', 'best round ≤ 10 (%)',
       'rounds to 50%', 'rounds to 90%'],
      ['fedavg_s0', 'fedavg', '0', '10', '68.00', '70.00 (9)', '3', '–'],
      ['fedavg_s1', 'fedavg', '1', '12', '72.00', '72.00 (10)', '3', '–'],
      ['kapc_s0', 'kapc', '0', '10', 'not evaluated', 'not evaluated', '–', '–'],
      ['kapc_s1', 'kapc', '1', '10', 'not evaluated', 'not evaluated', '–', '–']]
  # The personalised method is filled on its own protocol.
  assert _table(md, 3)[1:] == [
      ['fedavg', '0, 1', 'not evaluated', 'not evaluated'],
      ['kapc', '0, 1', '90.00 ± 2.83 (n=2)', '91.00 ± 1.41 (n=2)']]
  assert _table(md, 4)[3:] == [
      ['kapc_s0', 'kapc', '0', '10', '88.00', '90.00 (9)', '1', '9'],
      ['kapc_s1', 'kapc', '1', '10', '92.00', '92.00 (10)', '1', '8']]
  assert 'Runs whose headline is the mean of client bests' in md
  assert _table(md, 5)[1] == ['fedavg', '0, 1', '52.00 ± 2.83 (n=2)', '52.00 ± 2.83 (n=2)']
  # The same tables as CSV (numbers as numbers) and LaTeX.
  with open(os.path.join(out, 'central-methods.csv')) as f:
    assert list(csv.reader(f)) == [
        ['method', 'seeds', 'at round 10 (%) mean', 'at round 10 (%) std', 'at round 10 (%) n',
         'best round ≤ 10 (%) mean', 'best round ≤ 10 (%) std', 'best round ≤ 10 (%) n'],
        ['fedavg', '0, 1', '70.0000', '2.8284', '2', '71.0000', '1.4142', '2'],
        ['kapc', '0, 1', 'not evaluated', '', '', 'not evaluated', '', '']]
  with open(os.path.join(out, 'personal_local-runs.csv')) as f:
    assert list(csv.reader(f))[3] == ['kapc_s0', 'kapc', '0', '10', '88.0000', '90.0000', '9',
                                      '1', '9']
  with open(os.path.join(out, 'report.tex')) as f:
    tex = f.read()
  assert tex.count(r'\begin{table}') == 6 and r'\label{tab:central-methods}' in tex
  assert r'    fedavg & 0, 1 & 70.00 $\pm$ 2.83 (n=2) & 71.00 $\pm$ 1.41 (n=2) \\' in tex
  assert r'\caption{\texttt{central} protocol' in tex and '**' not in tex
  for name in ('accuracy.png', 'accuracy.pdf'):
    assert os.path.getsize(os.path.join(out, name)) > 5000


def test_a_round_some_runs_did_not_reach_is_marked_and_said(runs, tmp_path):
  md = report.write_report([report.load_run(p) for p in runs], str(tmp_path / 'r'), at_round=12)
  assert ('Compared at round 12 (`--at_round`). Runs without an evaluation in round 12 are '
          'marked "no round 12": fedavg_s0, kapc_s0, kapc_s1.') in md
  assert _table(md, 1)[1] == ['fedavg', '0, 1', '75.00 (n=1)', '75.00 (n=1)']
  assert _table(md, 3)[2] == ['kapc', '0, 1', 'no round 12', 'no round 12']
  assert _table(md, 2)[1][4:6] == ['no round 12', 'no round 12']


def test_groups_are_named_by_method_and_the_settings_that_differ(tmp_path):
  root = str(tmp_path)
  curve = {'test_accuracy': [0.5, 0.6]}
  paths = [write_run(root, f'p{mu}_s{seed}', curve, method='fedprox', seed=seed,
                     parameter='mu', value=mu) for mu in ('0.01', '0.1') for seed in (0, 1)]
  paths.append(write_run(root, 'avg', curve))
  # The same run twice (a copy, or a run continued under another name) is not two seeds.
  paths.append(write_run(root, 'avg_copy', curve, rounds=5))
  runs = [report.load_run(p) for p in paths]
  groups = report.seed_groups(runs)
  assert groups == [[0, 1], [2, 3], [4], [5]]
  assert report.group_names(runs, groups) == [
      'fedprox (mu=0.01)', 'fedprox (mu=0.1)', 'fedavg [avg]', 'fedavg [avg_copy]']


def test_a_setting_one_run_records_at_its_default_does_not_split_seeds(tmp_path):
  """As a resume compares them: a parameter one run records at its default and another does
  not (fltff added it since, or recorded the channel model's settings only in some versions)
  is the same setting; at another value it is not."""
  root, curve = str(tmp_path), {'test_accuracy': [0.5, 0.6]}
  paths = [write_run(root, f'kapc_s{seed}', curve, method='kapc', seed=seed, parameter=name,
                     value=value)
           for seed, name, value in ((0, 'relationship_projection', "'renormalize'"),
                                     (1, 'beta', '0.005'), (2, 'beta', '0.005'),
                                     (3, 'relationship_projection', "'clip'"))]
  runs = [report.load_run(p) for p in paths]
  groups = report.seed_groups(runs)
  assert groups == [[0, 1, 2], [3]]
  assert report.group_names(runs, groups) == ['kapc (relationship_projection=renormalize)',
                                              'kapc (relationship_projection=clip)']


def test_runs_on_other_data_are_not_seeds_of_one_group(tmp_path):
  """Where the data lie is no setting (the same data moved, or on another machine, stay one
  group); what they are is: runs on other data are not averaged as seeds of one group."""
  root, curve = str(tmp_path), {'test_accuracy': [0.5, 0.6]}
  mnist, fmnist = ('/data/mnist.npz', 'a' * 64), ('/data/fmnist.npz', 'b' * 64)
  paths = [write_run(root, 'mnist_s0', curve, data=mnist),
           write_run(root, 'fmnist_s0', {'test_accuracy': [0.7, 0.8]}, data=fmnist),
           write_run(root, 'fmnist_s1', {'test_accuracy': [0.7, 0.9]}, seed=1, data=fmnist),
           write_run(root, 'mnist_s1', {'test_accuracy': [0.5, 0.7]}, seed=1,
                     data=('/scratch/mnist.npz', mnist[1]))]
  runs = [report.load_run(p) for p in paths]
  groups = report.seed_groups(runs)
  assert groups == [[0, 3], [1, 2]]
  assert report.group_names(runs, groups) == ['fedavg (data=aaaaaaaa)', 'fedavg (data=bbbbbbbb)']
  md = report.write_report(runs, str(tmp_path / 'report'))
  assert _table(md, 1)[1:] == [['fedavg (data=aaaaaaaa)', '0, 1', '65.00 ± 7.07 (n=2)',
                                '65.00 ± 7.07 (n=2)'],
                               ['fedavg (data=bbbbbbbb)', '0, 1', '85.00 ± 7.07 (n=2)',
                                '85.00 ± 7.07 (n=2)']]


def test_a_sweep_folder_stands_for_its_finished_runs(runs, tmp_path):
  """As in the sweep's own report: a run still running, stopped or failed is left out, not
  compared at the round it reached."""
  sweep = os.path.dirname(runs[0])
  write_run(sweep, 'fedavg_s2', {'test_accuracy': [.10, .20], 'global_local_accuracy': [.1] * 2},
            seed=2, rounds=10)
  with open(os.path.join(sweep, 'plan.txt'), 'w') as f:
    f.write(''.join(f'{name} exp.gin\n' for name in ('fedavg_s0', 'fedavg_s2', 'fedavg_s1',
                                                    'kapc_s0', 'kapc_s1', 'not_run')))
  assert report.run_dirs([sweep]) == [runs[0], runs[1], runs[2], runs[3]]
  md = report.write_report([report.load_run(p) for p in report.run_dirs([sweep])],
                           str(tmp_path / 'out'))
  assert 'Compared at round 10, the last round all 4 runs evaluated' in md
  assert _table(md, 1)[1] == ['fedavg', '0, 1', '70.00 ± 2.83 (n=2)', '71.00 ± 1.41 (n=2)']


@pytest.mark.parametrize('row', ['3,0.5', '3,0.5,0.2,0.1', '3,0.5,high'])
def test_a_damaged_metrics_csv_is_one_error_naming_the_line(tmp_path, row):
  (tmp_path / 'metrics.csv').write_text(f'round,train_loss,test_accuracy\n1,0.5,0.3\n2,,0.4\n'
                                        f'{row}\n')
  with pytest.raises(ValueError) as error:
    report.load_run(str(tmp_path))
  assert str(error.value) == (f'{tmp_path}/metrics.csv, line 4: not a row of numbers under its '
                              'header (a damaged or hand-edited metrics.csv)')
  result = run_program('pipelines.report', f'--runs={tmp_path}', f'--out={tmp_path / "out"}',
                       timeout=300)
  assert result.returncode == 2 and 'Traceback' not in result.stderr
  assert result.stderr.splitlines() == [f'error: {error.value}']


def test_the_command_reads_a_sweep_folder_and_refuses_an_empty_one(runs, tmp_path):
  sweep = os.path.dirname(runs[0])
  with open(os.path.join(sweep, 'plan.txt'), 'w') as f:
    f.write('# fltff sweep\n' + ''.join(f'{os.path.basename(p)} exp.gin experiment.seed = 0\n'
                                        for p in runs) + 'not_run exp.gin\n')
  out = tmp_path / 'out'
  result = run_program('pipelines.report', f'--runs={sweep}', f'--out={out}', timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  assert 'Compared at round 10, the last round all 4 runs evaluated' in result.stdout
  assert sorted(os.listdir(out)) == [
      'accuracy.pdf', 'accuracy.png', 'central-methods.csv', 'central-runs.csv',
      'global_local-methods.csv', 'global_local-runs.csv', 'personal_local-methods.csv',
      'personal_local-runs.csv', 'report.md', 'report.tex']
  (tmp_path / 'empty').mkdir()
  (tmp_path / 'empty' / 'plan.txt').write_text('a exp.gin\n')
  empty = run_program('pipelines.report', f'--runs={tmp_path / "empty"}', f'--out={out}',
                      timeout=300)
  assert empty.returncode == 2 and empty.stderr.startswith('error: no finished run in ')
