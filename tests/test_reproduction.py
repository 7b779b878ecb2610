"""The Reproduction report: paper numbers beside ours, gains and round reductions computed right."""

import csv
import json
import os

import pytest

from launcher import run_program
from pipelines import report
from pipelines import reproduction

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write_run(root, name, columns, summary=None, measurements=None):
  """A run folder: metrics.csv with `columns` ({column: [accuracy per round]}), summary.json."""
  path = os.path.join(root, 'runs', name)
  os.makedirs(path)
  rounds = len(next(iter(columns.values())))
  with open(os.path.join(path, 'metrics.csv'), 'w', newline='') as f:
    writer = csv.DictWriter(f, fieldnames=['round', *columns, 'bytes_up', 'bytes_down'])
    writer.writeheader()
    for i in range(rounds):
      row = {'round': i + 1, 'bytes_up': 1e6, 'bytes_down': 2e6}
      row.update({k: v[i] for k, v in columns.items() if v[i] is not None})
      writer.writerow(row)
  with open(os.path.join(path, 'summary.json'), 'w') as f:
    json.dump(dict({'method': name}, **(summary or {})), f)
  if measurements:
    with open(os.path.join(path, 'measurements.jsonl'), 'w') as f:
      for record in measurements:
        f.write(json.dumps(record) + '\n')


def _head(protocol, column, statistic, value):
  return {'headline': {'protocol': protocol, 'column': column, 'statistic': statistic,
                       'value': value}}


@pytest.fixture
def results(tmp_path):
  root = str(tmp_path / 'results')
  # KAPC-style: KAPC over two of three seeds (headline 0.90, 0.94), FedAvg one seed with other
  # protocols, local training not run, one earlier run without a headline.
  _write_run(root, 'kapc_s0', {'personal_local_accuracy': [0.80, 0.90, 0.85]},
             _head('personal_local', 'personal_local_accuracy', 'best_round_mean', 0.90))
  _write_run(root, 'kapc_s1', {'personal_local_accuracy': [0.94, 0.90, 0.93]},
             _head('personal_local', 'personal_local_accuracy', 'best_round_mean', 0.94))
  _write_run(root, 'avg_k_s0', {'test_accuracy': [0.55, 0.65], 'global_local_accuracy': [0.5, 0.6],
                                'trained_local_accuracy': [0.7, 0.8]},
             dict(_head('global_local', 'global_local_accuracy', 'mean_client_best', 0.62),
                  mean_client_best_global_local_accuracy=0.62,
                  mean_client_best_trained_local_accuracy=0.83))
  _write_run(root, 'old_s0', {'mean_local_accuracy': [0.70, 0.75, 0.72]})
  # Seed 0 with a headline, seed 1 an earlier run: only seed 0 is averaged.
  _write_run(root, 'mix_s0', {'trained_local_accuracy': [0.8, 0.9]},
             _head('trained_local', 'trained_local_accuracy', 'best_round_mean', 0.9))
  _write_run(root, 'mix_s1', {'mean_local_accuracy': [0.70, 0.6]})
  # FedLap-style, first_rounds = 2: FedLap and FedAvg over seeds 0-1, FedProx seed 0 only.
  _write_run(root, 'lap_s0', {'test_accuracy': [0.3, 0.5, 0.6, 0.7]})
  _write_run(root, 'avg_s0', {'test_accuracy': [0.2, 0.3, 0.65, 0.6]})
  _write_run(root, 'lap_s1', {'test_accuracy': [0.4, 0.4, 0.5, 0.5]})
  _write_run(root, 'avg_s1', {'test_accuracy': [0.3, 0.4, 0.5, 0.45]})
  _write_run(root, 'prox_s0', {'test_accuracy': [0.3, 0.6, 0.6, 0.7]})
  # Rounds to 0.5: fedavg 4, fedadp 2, fedlayerwise 1; to 0.75 only fedadp (4); 0.9 nobody.
  _write_run(root, 'f_avg', {'test_accuracy': [0.1, 0.2, 0.3, 0.5]})
  _write_run(root, 'f_adp', {'test_accuracy': [0.1, 0.6, 0.7, 0.8]})
  _write_run(root, 'f_lw', {'test_accuracy': [0.5, 0.6, 0.7, 0.72]})
  # CCN: original and T = 1 (with Λ and ω of 3 clients over 2 rounds); T = 0.5 not run.
  _write_run(root, 'c_orig', {'test_accuracy': [0.5, 0.7, 0.6]})
  _write_run(root, 'c_t1', {'test_accuracy': [0.55, 0.72, 0.69]}, measurements=[
      {'round': 1, 'aggregator/client_index': [0, 1, 2], 'aggregator/contribution': [0.5, 0.8, 0.7],
       'aggregator/weight': [0.25, 0.4, 0.35]},
      {'round': 2, 'aggregator/client_index': [0, 1, 2], 'aggregator/contribution': [0.9, 0.6, 0.5],
       'aggregator/weight': [0.45, 0.3, 0.25]}])
  _write_run(root, 'c2_orig', {'test_accuracy': [0.5, 0.6]})
  _write_run(root, 'c2_t1', {'test_accuracy': [0.5, 0.58]})
  manifest = {'sections': [
      {'id': 'kapc', 'kind': 'paper_table', 'paper': 'kp', 'title': 'KAPC',
       'groups': [{'label': 'T1 a0.1', 'table': 'Table 1', 'dataset': 'FMNIST', 'alpha': '0.1',
                   'runs': {'KAPC': ['kapc_s0', 'kapc_s1', 'kapc_s2'], 'FedAvg': ['avg_k_s0'],
                            'local': ['local_s0'], 'old': ['old_s0'],
                            'mixed': ['mix_s0', 'mix_s1']},
                   'paper_rows': {'KAPC': 'kapc', 'FedAvg': 'fedavg', 'local': 'local_training',
                                  'old': 'moon', 'mixed': 'moon'}}]},
      {'id': 'gain', 'kind': 'claim_gaps', 'paper': 'p', 'title': 'Gain', 'first_rounds': 2,
       'rounds_to': 0.5,
       'groups': [{'label': 'g', 'runs': {'lap': ['lap_s0', 'lap_s1'], 'avg': ['avg_s0', 'avg_s1'],
                                          'prox': ['prox_s0', 'prox_s1']},
                   'comparisons': [['lap', 'avg', ['c1', 'c2']], ['lap', 'prox', ['c1']]]}]},
      {'id': 'rtt', 'kind': 'rounds_to_target', 'paper': 'fl', 'title': 'Rounds',
       'targets': [0.5, 0.75, 0.9],
       'comparisons': [['fedlayerwise', 'fedadp'], ['fedlayerwise', 'fedavg'],
                       ['fedadp', 'fedavg']],
       'groups': [{'label': 'mix', 'paper_key': 'mix',
                   'runs': {'fedavg': ['f_avg'], 'fedadp': ['f_adp'], 'fedlayerwise': ['f_lw']}}]},
      {'id': 'ccn', 'kind': 'pairs', 'paper': 'cc', 'title': 'CCN', 'original': 'original',
       'extra_files': ['measurements.jsonl'],
       'groups': [{'label': 'fedavg', 'paper_row': 'fedavg',
                   'runs': {'original': ['c_orig'], 'T = 1': ['c_t1'], 'T = 0.5': ['c_t05']}},
                  {'label': 'sgdm', 'paper_row': 'sgdm',
                   'runs': {'original': ['c2_orig'], 'T = 1': ['c2_t1'], 'T = 0.5': ['c2_t05']}}]},
      {'id': 'far', 'kind': 'out_of_reach', 'title': 'Out of reach',
       'entries': [{'setting': 'KAPC MNIST', 'paper': 'kp', 'data': 'MNIST',
                    'configs': ['gin_configs/x/mnist_*.gin'],
                    'numbers': [{'kind': 'kapc_table', 'table': 'Table 1', 'dataset': 'FMNIST'}]},
                   {'setting': 'nothing', 'data': 'CIFAR', 'configs': ['gin_configs/x/cifar_*.gin']}]},
  ]}
  paper = {
      'p': {'paper': 'A paper', 'claims': [
          {'id': 'c1', 'statistic': 'mean_first', 'short': '+3 to +5', 'source': 'abstract',
           'text': 'three to five points'},
          {'id': 'c2', 'statistic': 'max', 'source': 'abstract', 'text': 'up to ten points'}]},
      'kp': {'paper': 'K paper', 'plusminus': 'PLUSMINUS NOTE',
             'values': {'Table 1': {'FMNIST': {'0.1': {
                 'kapc': [96.71, 0.17], 'fedavg': [57.85, 0.42], 'local_training': [88.33, 0.09],
                 'moon': [96.61, 0.35]}}}},
             'flags': [{'cell': 'Table 1/FMNIST/0.1/moon', 'note': 'MOON FLAG'}]},
      'fl': {'paper': 'F paper', 'table_I': {'source': 'Table I', 'dataset': 'MNIST', 'target': 0.95,
                                             'rounds': {'mix': {'fedlayerwise': 12, 'fedadp': 21,
                                                                'fedavg': 25}}},
             'claims': [{'id': 'x', 'source': 'abstract', 'text': 'about 40 % fewer'}]},
      'cc': {'paper': 'C paper', 'tables': {
          'Table I': {'dataset': 'CIFAR-10', 'columns': {'α = 0.1': {
              'fedavg': {'original': 69.68, 'normalized': 74.44, 'gain_printed': 4.76}}}},
          'Table II': {'dataset': 'FEMNIST', 'columns': {'10 clients': {
              'fedavg': {'original': 62.26, 'normalized': 71.12, 'gain_printed': 6.86}}}}}},
  }
  with open(os.path.join(root, 'reproduction.json'), 'w') as f:
    json.dump(manifest, f)
  with open(os.path.join(root, 'paper_numbers.json'), 'w') as f:
    json.dump(paper, f)
  for name in ('mnist_a.gin', 'mnist_b.gin'):
    os.makedirs(tmp_path / 'gin_configs' / 'x', exist_ok=True)
    (tmp_path / 'gin_configs' / 'x' / name).write_text('# config\n')
  return root


def _row(md, start, which=-1):
  """Cells of the last (or `which`) line starting with `start`."""
  line = [l for l in md.splitlines() if l.startswith(start)][which]
  return [c.strip() for c in line.strip('|').split('|')]


def _write(results):
  return reproduction.write(results, report, repo_root=os.path.dirname(results))


def test_paper_table_puts_the_paper_number_beside_ours(results):
  md = _write(results)
  # KAPC: headline 0.90 and 0.94 -> 92.00, gap 92.00 - 96.71, seed 2 missing and named; ranked
  # first of the 4 rows with runs by the best-round mean.
  assert _row(md, '| KAPC |') == [
      'KAPC', '96.71 ± 0.17', '92.00', 'personal_local, best-round mean', '-4.71',
      '92.00 ± 2.83 (n=2)', 's0 90.00, s1 94.00', '92.00 ± 2.83 (n=2)', '1 of 4', '–', 'kapc_s2']
  # FedAvg: the headline is the mean of client bests of global_local (marked: not the statistic
  # methods are ranked by); its best-round mean (60.00) ranks it; the other readings beside.
  assert _row(md, '| FedAvg |') == [
      'FedAvg', '57.85 ± 0.42', '62.00 *', 'global_local, mean of client bests', '+4.15',
      '62.00 (n=1, no std)', 's0 62.00', '60.00 (n=1, no std)', '4 of 4',
      'central best-round 65.00; trained_local best-round 80.00; trained_local client-best 83.00',
      'none']
  assert '\\* mean of client bests, the paper\'s statistic for this method' in md
  assert _row(md, '| local |') == ['local', '88.33 ± 0.09'] + ['not run'] * 8 + ['local_s0']
  # An earlier run (no headline): best round of its one local column, said so; flagged paper cell.
  old = _row(md, '| old |')
  assert old[1:6] == ['96.61 ± 0.35 [1]', '75.00', 'mean_local (earlier run), best-round mean',
                      '-21.61', '75.00 (n=1, no std)']
  assert old[7:9] == ['75.00 (n=1, no std)', '3 of 4']
  assert '[1] MOON FLAG' in md and 'PLUSMINUS NOTE' in md
  # A recorded headline and an earlier run: the earlier one is listed, not averaged, and redone.
  assert _row(md, '| mixed |') == [
      'mixed', '96.61 ± 0.35 [2]', '90.00', 'trained_local, best-round mean', '-6.61',
      '90.00 (n=1, no std)', 's0 90.00, s1 70.00 (earlier run, not averaged)',
      '90.00 (n=1, no std)', '2 of 4', '–', 'mix_s1 (earlier run)']


def test_table_2_adds_the_mean_over_the_last_rounds_and_unranked_rows(tmp_path):
  """With `last_rounds` k a group shows the mean over each run's last k rounds beside the
  best-round mean (the best of the rounds' draws of participants); `unranked` rows get no rank."""
  root = str(tmp_path / 'results')
  _write_run(root, 'k_s0', {'personal_local_accuracy': [0.5, 0.9, 0.6, 0.7]},
             _head('personal_local', 'personal_local_accuracy', 'best_round_mean', 0.9))
  _write_run(root, 'k_s1', {'personal_local_accuracy': [0.8, 0.7, 0.8, 0.6]},
             _head('personal_local', 'personal_local_accuracy', 'best_round_mean', 0.8))
  _write_run(root, 'short_s0', {'personal_local_accuracy': [0.95]},
             _head('personal_local', 'personal_local_accuracy', 'best_round_mean', 0.95))
  section = {'id': 'kapc', 'kind': 'paper_table', 'paper': 'kp', 'title': 'KAPC', 'groups': [
      {'label': 'T2', 'table': 'Table 2', 'dataset': 'FMNIST', 'alpha': '0.1', 'last_rounds': 2,
       'unranked': ['short'], 'runs': {'KAPC': ['k_s0', 'k_s1'], 'short': ['short_s0']},
       'paper_rows': {'KAPC': 'kapc', 'short': 'kapc'}}]}
  paper = {'kp': {'paper': 'K', 'values': {'Table 2': {'FMNIST': {'0.1': {'kapc': [94.57, 0.25]}}}}}}
  with open(os.path.join(root, 'reproduction.json'), 'w') as f:
    json.dump({'sections': [section]}, f)
  with open(os.path.join(root, 'paper_numbers.json'), 'w') as f:
    json.dump(paper, f)
  md = _write(root)
  assert 'rank by best-round mean | mean over the last 2 rounds % |' in md
  # Last two rounds: s0 (0.6 + 0.7) / 2 = 65, s1 (0.8 + 0.6) / 2 = 70.
  assert _row(md, '| KAPC |')[7:10] == ['85.00 ± 7.07 (n=2)', '1 of 1', '67.50 ± 3.54 (n=2)']
  # One round run: no mean over the last 2; not ranked although its best-round mean is higher.
  assert _row(md, '| short |')[7:10] == ['95.00 (n=1, no std)', '–', '–']


def test_claim_gaps_per_seed_and_over_seeds(results):
  md = _write(results)
  # lap - avg: s0 gaps +10 +20 -5 +10, s1 +10 0 0 +5 (points).
  assert _row(md, '| g | lap − avg | mean gap, rounds 1–2') == [
      'g', 'lap − avg', 'mean gap, rounds 1–2 (declared)', 's0 +15.00, s1 +5.00',
      '+10.00 ± 7.07 (n=2)', '+3 to +5 [c1]']
  assert _row(md, '| g | lap − avg | largest') == [
      'g', 'lap − avg', 'largest per-round gap (declared)', 's0 +20.00 (r2), s1 +10.00 (r1)',
      '+15.00 ± 7.07 (n=2)', 'up to ten points [c2]']
  assert _row(md, '| g | lap − avg | gap at the last')[3:5] == ['s0 +10.00, s1 +5.00',
                                                                '+7.50 ± 3.54 (n=2)']
  # lap - prox: seed 1 of prox not run.
  assert _row(md, '| g | lap − prox | mean gap')[3:5] == ['s0 -5.00, not run: s1',
                                                          '-5.00 (n=1, no std)']
  assert _row(md, '| g | prox |') == ['g', 'prox', 's0', '60.00 (n=1, no std)',
                                       '45.00 (n=1, no std)', '70.00 (n=1, no std)',
                                       '70.00 (n=1, no std)', 's0 2', 'prox_s1']
  assert _row(md, '| g | lap |')[3:8] == ['45.00 ± 7.07 (n=2)', '40.00 ± 0.00 (n=2)',
                                          '60.00 ± 14.14 (n=2)', '60.00 ± 14.14 (n=2)',
                                          's0 2, s1 3']
  assert '- [c1] three to five points (abstract)' in md


def test_rounds_to_target_beside_table_i_with_bounds(results):
  md = _write(results)
  assert _row(md, '| fedlayerwise | 12 |') == ['fedlayerwise', '12', '1', '> 4', '> 4',
                                                '72.00 (4)', '4', 'none']
  assert _row(md, '| fedavg | 25 |')[2:5] == ['4', '> 4', '> 4']
  assert _row(md, '| 50 % |') == ['50 %', '+50.0 %', '+42.9 % (21 → 12)', '+75.0 %',
                                  '+52.0 % (25 → 12)', '+50.0 %', '+16.0 % (25 → 21)']
  # 75 %: fedlayerwise never (needs >= 5 rounds), fedadp 4, fedavg never.
  assert _row(md, '| 75 % |')[1::2] == ['≤ -25.0 %', 'neither reached', '≥ +20.0 %']
  assert _row(md, '| 90 % |')[1::2] == ['neither reached'] * 3
  assert '- about 40 % fewer (abstract)' in md


def test_pairs_gains_paper_ranges_and_contribution_spread(results):
  md = _write(results)
  assert _row(md, '| fedavg | T = 1 |', 0) == ['fedavg', 'T = 1', '1 run', '72.00 (n=1, no std)',
                                            '69.00 (n=1, no std)', '+2.00 (n=1, no std)',
                                            '+9.00 (n=1, no std)', 'none']
  assert _row(md, '| fedavg | T = 0.5 |', 0)[2:7] == ['not run'] * 5
  # Paper gains from its own columns (the printed 6.86 contradicts 71.12 - 62.26) beside ours.
  assert _row(md, '| fedavg | +4.76') == ['fedavg', '+4.76', '+8.86 [1]', '+2.00', '–']
  assert 'the paper prints 6.86 in brackets; its own Original and Normalized give 8.86' in md
  # Λ of 3 clients over 2 rounds; equal base weights; weight moved 8.33 % and 11.67 %.
  assert _row(md, '| fedavg | T = 1 | 2 rounds') == [
      'fedavg', 'T = 1', '2 rounds, 3 clients in round 1', '0.5000 – 0.9000', '0.3500 (max 0.4000)',
      '0.7500 – 1.3500', '10.000 / 11.667', '33.333']
  assert _row(md, '| sgdm | T = 1 | not recorded')[3:] == ['–'] * 5


def test_out_of_reach_lists_configs_and_paper_numbers(results):
  md = _write(results)
  assert _row(md, '| KAPC MNIST |') == [
      'KAPC MNIST', 'MNIST', '`gin_configs/x/mnist_*.gin` (2 files)',
      'Table 1 FMNIST: α = 0.1: kapc 96.71, fedavg 57.85, local_training 88.33, moon 96.61']
  assert _row(md, '| nothing |')[2] == '`gin_configs/x/cifar_*.gin` (none here)'


def test_figures_have_a_band_over_seeds(results):
  runs = {n: reproduction._load(report, os.path.join(results, 'runs'), n)  # pylint: disable=protected-access
          for n in ('lap_s0', 'lap_s1')}
  x, mean, lo, hi = reproduction.band(list(runs.values()), lambda r: 'test_accuracy')
  assert x == [1, 2, 3, 4]
  assert mean == pytest.approx([0.35, 0.45, 0.55, 0.6])
  assert lo == [0.3, 0.4, 0.5, 0.5] and hi == [0.4, 0.5, 0.6, 0.7]
  md = _write(results)
  for section in ('kapc', 'gain', 'rtt', 'ccn'):
    assert os.path.getsize(os.path.join(results, 'figures', f'{section}.png')) > 1000
    assert f'![{section}](figures/{section}.png)' in md
  assert not os.path.exists(os.path.join(results, 'figures', 'far.png'))
  assert open(os.path.join(results, 'reproduction.md')).read() == md


def test_kapc_self_relations_are_the_mean_over_clients_per_layer_first_to_last(tmp_path):
  import numpy as np
  rng = np.random.default_rng(1)
  cube = rng.uniform(size=(3, 4, 2))  # rounds x clients x layers
  records = [{'round': r + 1, 'kapc/self_relation': cube[r].tolist(), 'clients': [0, 1, 2, 3]}
             for r in range(3)]
  records.insert(1, {'round': 9, 'omega': [2, 2, 2, 2]})  # a record without r_ii is skipped
  _write_run(tmp_path, 'kapc_s0', {'test_accuracy': [0.5, 0.6, 0.7]}, measurements=records)
  # Local training records its fixed R = I too: only the KAPC rows are tabled.
  _write_run(tmp_path, 'local_s0', {'test_accuracy': [0.5, 0.6, 0.7]}, measurements=[
      {'round': 1, 'kapc/self_relation': [[1.0, 1.0]] * 4}])
  _write_run(tmp_path, 'fedavg_s0', {'test_accuracy': [0.5, 0.6, 0.7]})
  runs = {name: {'dir': os.path.join(tmp_path, 'runs', name), 'label': name}
          for name in ('kapc_s0', 'local_s0', 'fedavg_s0')}
  measured = reproduction.self_relations(runs['kapc_s0'])
  assert [r for r, _ in measured] == [1, 2, 3]
  np.testing.assert_allclose([m for _, m in measured], cube.mean(axis=1), rtol=1e-12)
  assert reproduction.self_relations(runs['fedavg_s0']) is None
  section = {'groups': [{'runs': {'local training': ['local_s0'], 'KAPC': ['kapc_s0', 'kapc_s1'],
                                  'FedAvg': ['fedavg_s0']}}]}
  lines = reproduction.self_relation_table(section, runs)
  start, end = cube[0].mean(axis=0), cube[-1].mean(axis=0)
  assert lines[-2] == (f'| kapc_s0 | 1–3 | {start[0]:.3f} → {end[0]:.3f}, '
                       f'{start[1]:.3f} → {end[1]:.3f} |')
  assert sum(line.startswith(('| kapc', '| local', '| fedavg')) for line in lines) == 1
  assert reproduction.self_relation_table(
      {'groups': [{'runs': {'local training': ['local_s0'], 'FedAvg': ['fedavg_s0']}}]},
      runs) == []


def test_weight_shift_bounds():
  """CCN's weights against the bound the report states: equal base weights move < 1/N."""
  import numpy as np
  rng = np.random.default_rng(0)
  for _ in range(200):
    n = int(rng.integers(2, 40))
    scores = rng.normal(size=n) * rng.choice([0.1, 1.0, 5.0])  # no Λ_r rounds to 0
    soft = np.exp(scores - scores.max())
    soft /= soft.sum()
    lam = 1 - soft
    assert lam.sum() == pytest.approx(n - 1)
    for nu in (np.ones(n), rng.dirichlet(np.full(n, 0.3)) + 1e-3):
      w = lam * nu / (lam * nu).sum()
      shift = reproduction.weight_shift(list(lam), list(w))
      p = nu / nu.sum()
      assert shift['p'] == pytest.approx(list(p), abs=1e-9)
      assert shift['moved'] <= shift['bound'] + 1e-12
      assert shift['ratio'][1] <= 1 / (1 - p.max()) + 1e-9
      if np.all(nu == 1):
        assert shift['bound'] == pytest.approx(1 / n) and w.max() <= 1 / (n - 1) + 1e-12
  assert reproduction.weight_shift([0.0], [1.0]) is None


def test_shipped_results_report_builds(tmp_path):
  """The repository's results/ manifest and paper numbers are consistent (CLI, exit 0), and
  every Fashion-MNIST cell of KAPC Tables 1-2 appears beside its row."""
  import shutil
  shutil.copytree(os.path.join(REPO, 'results'), tmp_path / 'results')
  # As a user runs it, in a fresh interpreter (not the launcher's, which has TensorFlow loaded)
  # without the suite's TF_CPP_MIN_LOG_LEVEL: TensorFlow's start-up lines (the report reads
  # config.gin through fltff) must not reach the terminal.
  import subprocess
  import sys
  result = subprocess.run(
      [sys.executable, '-m', 'pipelines.report', f'--reproduction={tmp_path / "results"}'],
      cwd=REPO, capture_output=True, text=True, timeout=300,
      env={k: v for k, v in os.environ.items() if k != 'TF_CPP_MIN_LOG_LEVEL'})
  assert result.returncode == 0, result.stderr[-2000:]
  assert 'not in the report' not in result.stderr, result.stderr[-2000:]  # Every run is shown.
  assert 'tensorflow/' not in result.stderr, result.stderr[-2000:]
  manifest = json.load(open(os.path.join(REPO, 'results', 'reproduction.json')))
  md = (tmp_path / 'results' / 'reproduction.md').read_text()
  for section in manifest['sections']:
    assert section['title'] in md
  paper = json.load(open(os.path.join(REPO, 'results', 'paper_numbers.json')))
  for section in manifest['sections']:
    assert section.get('paper') in (None, *paper)
  checked = 0
  for section in manifest['sections']:
    if section['kind'] != 'paper_table':
      continue
    for group in section['groups']:
      cells = paper[section['paper']]['values'][group['table']][group['dataset']][group['alpha']]
      assert set(cells) <= set(group['paper_rows'].values())
      table = md.split(f'### {group["label"]}\n')[1].split('\n### ')[0].split('\n## ')[0]
      for row, key in group['paper_rows'].items():
        # A method the paper does not have (Ditto) shows a dash in the paper's column.
        paper_cell = f'{cells[key][0]:.2f} ± {cells[key][1]:.2f}' if key in cells else '–'
        assert _row(table, f'| {row} |')[1].startswith(paper_cell)
        checked += 1
  assert checked >= 40


def test_collect_copies_only_finished_runs(results, tmp_path):
  source = tmp_path / 'runs_out'
  for name, rounds_done, rounds in (('avg_s0', 4, 4), ('prox_s0', 2, 4), ('c_t05', 3, 3)):
    d = source / name
    d.mkdir(parents=True)
    rows = ['round,test_accuracy'] + [f'{i},0.5' for i in range(1, rounds_done + 1)]
    (d / 'metrics.csv').write_text('\n'.join(rows) + '\n')
    (d / 'summary.json').write_text('{}')
    (d / 'config.gin').write_text(f'experiment.model = "mlp2"\nexperiment.rounds = {rounds}\n')
    (d / 'measurements.jsonl').write_text('{"round": 1}\n')
    (d / 'checkpoints').mkdir()
  status = reproduction.collect(results, str(source))
  assert status['avg_s0'] == 'copied' and status['prox_s0'] == 'in progress 2/4'
  assert status['lap_s1'] == 'absent' and status['c_t05'] == 'copied'
  # Only the CCN section asks for measurements.jsonl (extra_files).
  assert sorted(os.listdir(os.path.join(results, 'runs', 'avg_s0'))) == [
      'config.gin', 'metrics.csv', 'summary.json']
  assert sorted(os.listdir(os.path.join(results, 'runs', 'c_t05'))) == [
      'config.gin', 'measurements.jsonl', 'metrics.csv', 'summary.json']
  assert open(os.path.join(results, 'runs', 'avg_s0', 'metrics.csv')).read().count('\n') == 5
  assert open(os.path.join(results, 'runs', 'prox_s0', 'metrics.csv')).read().count('0.6') == 2  # kept


def test_runs_the_report_leaves_out_are_named(results):
  """A seed finished after its row was written, or a run no comparison names, is not silently
  missing from the report: `unshown_runs` names it, and the report prints it as a warning."""
  assert reproduction.unshown_runs(results) == []
  _write_run(results, 'avg_s2', {'test_accuracy': [0.3, 0.4, 0.5, 0.5]})  # The row has s0, s1.
  _write_run(results, 'stray', {'test_accuracy': [0.5]})
  with open(os.path.join(results, 'plan.txt'), 'w') as f:
    f.write('kapc_s3 gin_configs/x/mnist_a.gin experiment.seed = 3\n')
  assert reproduction.unshown_runs(results) == [
      'kapc_s3 (planned or in runs/) is in no comparison of reproduction.json',
      'avg_s2 (planned or in runs/) is in no comparison of reproduction.json',
      'stray (planned or in runs/) is in no comparison of reproduction.json',
      'kapc, T1 a0.1 row "KAPC" lists kapc_s{0,1,2} but not kapc_s3',
      'gain, g row "avg" lists avg_s{0,1} but not avg_s2']
  result = run_program('pipelines.report', f'--reproduction={results}', timeout=600)
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stderr.count('warning: not in the report: ') == 5, result.stderr[-2000:]


def test_read_plan_and_commands(tmp_path):
  from pipelines import plan as plans
  plan = tmp_path / 'plan.txt'
  plan.write_text('# comment\n\na gin_configs/x.gin\n'
                  'b gin_configs/y.gin experiment.seed = 1; federated_data.seed = 1  # s1\n')
  runs = plans.read_plan(str(plan))
  assert runs == [plans.PlannedRun('a', 'gin_configs/x.gin'),
                  plans.PlannedRun('b', 'gin_configs/y.gin',
                                       ('experiment.seed = 1', 'federated_data.seed = 1'))]
  args, state = plans.command(runs[1], str(tmp_path))
  # No executor pin (the default 'auto' chooses); the plan's bindings come last.
  assert state == 'start' and args[-2:] == ['--gin_bindings=experiment.seed = 1',
                                            '--gin_bindings=federated_data.seed = 1']
  assert not any('runtime.executor' in a for a in args)
  (tmp_path / 'b').mkdir()
  (tmp_path / 'b' / 'config.gin').write_text('experiment.rounds = 2\n')
  (tmp_path / 'b' / 'metrics.csv').write_text('round\n1\n')
  # Stopped before its first checkpoint: pipelines.run refuses the folder without --resume.
  args, state = plans.command(runs[1], str(tmp_path))
  assert state == 'restart' and args[-1] == '--resume'
  (tmp_path / 'b' / 'checkpoints').mkdir()
  assert plans.command(runs[1], str(tmp_path))[1] == 'resume'
  (tmp_path / 'b' / 'metrics.csv').write_text('round\n1\n2\n')
  assert plans.command(runs[1], str(tmp_path)) == ([], 'done')
  for bad in ('just_a_name\n', 'a x.gin\na y.gin\n'):
    plan.write_text(bad)
    with pytest.raises(ValueError):
      plans.read_plan(str(plan))


def test_a_plan_with_a_missing_gin_file_is_refused_before_any_run(tmp_path):
  """Checked up front (a typo in the plan's last line must not wait for the runs before it);
  a failed run's error line is echoed beside its exit status."""
  from pipelines import plan as plans
  plan = tmp_path / 'plan.txt'
  plan.write_text('fine gin_configs/quickstart.gin\ntypo gin_configs/quikstart.gin\n')
  result = run_program('pipelines.reproduce', f'--plan={plan}', f'--runs_dir={tmp_path / "r"}',
                       timeout=120)
  assert result.returncode == 2 and 'fine: start' not in result.stdout, result.stdout
  assert result.stderr.strip().splitlines()[-1].startswith(
      'error: planned run typo: Gin file gin_configs/quikstart.gin does not exist')
  plans.check_configurations(plans.read_plan(os.path.join(REPO, 'results', 'plan.txt')),
                             str(tmp_path / 'r'))
  log = tmp_path / 'run.log'
  log.write_text('W1128 noise\nerror: experiment.rounds must be a positive integer, got 0.\n')
  assert plans.error_line(str(log)).endswith('got 0.')


def test_a_recorded_run_is_checked_against_its_plan_line_by_what_it_computed(tmp_path):
  """A shipped pFedLA run recorded `pfedla.seed = 0`, now the run seed: its plan line gives what
  it computed; the same run planned with seed 1 is refused, naming the old binding."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  import shutil  # pylint: disable=g-import-not-at-top
  from fltff.errors import ConfigError  # pylint: disable=g-import-not-at-top
  from pipelines import plan as plans
  name = 'kapc_fmnist_n10_dir0.3_pfedla_s0'
  [run] = [r for r in plans.read_plan(os.path.join(REPO, 'results', 'plan.txt')) if r.name == name]
  (tmp_path / name).mkdir()
  shutil.copy(os.path.join(REPO, 'results', 'runs', name, 'config.gin'), tmp_path / name)
  assert plans.check_configurations([run], str(tmp_path)) == {name: 50}
  seed_1 = dataclasses.replace(run, bindings=run.bindings + ('experiment.seed = 1',))
  with pytest.raises(ConfigError, match=f'planned run {name}: .*experiment.seed: 0 -> 1; '
                     'pfedla.seed: 0 -> 1'):
    plans.check_configurations([seed_1], str(tmp_path))


def test_shipped_plan_names_every_manifest_run_and_existing_configs():
  """Every manifest run is planned, or an earlier run already in results/runs/."""
  from pipelines import plan as plans
  plan = plans.read_plan(os.path.join(REPO, 'results', 'plan.txt'))
  names = {r.name for r in plan} | set(os.listdir(os.path.join(REPO, 'results', 'runs')))
  assert set(reproduction.manifest_runs(os.path.join(REPO, 'results'))) <= names
  for run in plan:
    assert os.path.isfile(os.path.join(REPO, run.gin_file)), run.gin_file


def test_reproduce_runs_then_skips_a_finished_run_and_refuses_one_computed_otherwise(tmp_path):
  """End to end on the MNIST sample: one planned run, then the same command finds it done (its
  settings those of the gin file with reproduce's bindings before the plan's; its data moved
  too), and refuses it, nothing run, once the gin file is edited to give other settings."""
  from helpers import SMALL, assert_one_line_error, pipeline_env
  gin_file = tmp_path / 'tiny.gin'
  gin_file.write_text(f"include '{SMALL[0].split('=', 1)[1]}'\nexperiment.local_epochs = 1\n")
  plan = tmp_path / 'plan.txt'
  plan.write_text(f'tiny {gin_file} experiment.rounds = 1; runtime.executor = "tff_cpp"\n')
  cmd = [f'--plan={plan}', f'--runs_dir={tmp_path / "runs"}',
         '--gin_bindings=experiment.clients_per_round = 3']
  first = run_program('pipelines.reproduce', *cmd, env=pipeline_env(), timeout=600)
  assert first.returncode == 0, first.stderr[-2000:] + first.stdout
  assert 'tiny: start' in first.stdout and 'tiny: exit 0' in first.stdout
  metrics = tmp_path / 'runs' / 'tiny' / 'metrics.csv'
  rows = metrics.read_text()
  assert len(rows.splitlines()) == 2
  again = run_program('pipelines.reproduce', *cmd, env=pipeline_env(), timeout=600)
  assert again.returncode == 0 and 'tiny: done' in again.stdout, again.stderr[-2000:]
  # The data's location is not a setting: the data moved, the run is still the line's.
  moved = run_program('pipelines.reproduce', *cmd, '--dry_run',
                      "--gin_bindings=npz_source.path = '/moved/mnist_first1003.npz'",
                      env=pipeline_env(), timeout=600)
  assert moved.returncode == 0 and 'tiny: done' in moved.stdout, moved.stderr[-2000:]
  gin_file.write_text(gin_file.read_text().replace('local_epochs = 1', 'local_epochs = 2'))
  for dry_run in ([], ['--dry_run']):
    edited = run_program('pipelines.reproduce', *cmd, *dry_run, env=pipeline_env(), timeout=600)
    assert_one_line_error(edited, 'planned run tiny: its run in ',
                          'experiment.local_epochs: 1 -> 2', 'move that run folder away')
    assert 'tiny:' not in edited.stdout
  assert metrics.read_text() == rows


def test_one_seed_has_no_spread_and_none_is_a_dash():
  assert reproduction._pm([50.0]) == '50.00 (n=1, no std)'  # pylint: disable=protected-access
  assert reproduction._pm([]) == '–'  # pylint: disable=protected-access
  assert reproduction._pm([90.0, 70.0]) == '80.00 ± 14.14 (n=2)'  # pylint: disable=protected-access
  assert reproduction._pm([1.0, -3.0], signed=True) == '-1.00 ± 2.83 (n=2)'  # pylint: disable=protected-access
  assert reproduction.mean_std([0.9]) == (0.9, None, 1)
  # A run without a seed suffix is seed 0 (results/plan.txt): it pairs with seed-0 runs.
  assert [reproduction.seed_of(n) for n in ('a_s0', 'a_s12', 'ccn_fmnist_fedavg')] == [
      's0', 's12', 's0']
  group = {'runs': {'a': ['x', 'x_s1'], 'b': ['y_s0', 'y_s1', 'y_s2']}}
  runs = {'x': 'X0', 'x_s1': 'X1', 'y_s0': 'Y0', 'y_s1': 'Y1', 'y_s2': 'Y2'}
  assert reproduction._seed_pairs(group, runs, 'a', 'b') == (  # pylint: disable=protected-access
      [('s0', 'X0', 'Y0'), ('s1', 'X1', 'Y1')], ['s2'])


# -- Why KAPC trails: the ablation table, its verdict rule and its figures ----------------------

def _kapc_run(root, name, best, column='personal_local_accuracy', rii=(0.1, 0.2), omega=5.0,
              rii_max=None, method=None):
  """Three rounds reaching `best` in round 2, r_ii (mean, two layers) rising to rii[1], Ω
  `omega` (None: not logged); with `rii_max`, the largest r_ii of any client per round;
  `method`: summary.json's (default: the run's name)."""
  columns = {column: [best - 0.05, best, best - 0.01]}
  if column == 'personal_local_accuracy':
    columns.update({'kapc/self_relation_mean': [rii[0], rii[1], rii[1] - 0.01],
                    'kapc/self_relation_layer_0': [rii[0], rii[0], rii[0]],
                    'kapc/self_relation_layer_1': [rii[0], rii[1], rii[1]]})
    if omega is not None:
      columns.update({'kapc/omega_mean': [omega] * 3,
                      'kapc/skipped_layer_fraction': [0.0, 0.0, 0.2]})
    if rii_max is not None:
      columns['kapc/self_relation_max'] = list(rii_max)
  _write_run(root, name, columns, dict(_head('personal_local', column, 'best_round_mean', best),
                                       **({'method': method} if method else {})))


def _base(gid, stem, column='personal_local_accuracy', row=None):
  group = {'id': gid, 'role': 'base', 'label': f'base {gid}', 'column': column,
           'runs': {'base': [f'{stem}_s{k}' for k in range(3)]}}
  if row:
    group['row'] = row
  return group


def _point(label, base, stem, factor='f'):
  return {'suspect': f'suspect {label}', 'label': label, 'base': base, 'factor': factor,
          'base_tick': f'{base} (base)', 'tick': label,
          'runs': {'variant': [f'{stem}_s{k}' for k in range(3)]}}


@pytest.fixture
def ablation_results(tmp_path):
  root = str(tmp_path / 'results')
  for k, best in enumerate((0.90, 0.92, 0.94)):  # base seed std 2.00 points
    _kapc_run(root, f'kb_s{k}', best)
    _kapc_run(root, f'a_s{k}', best + 0.01)  # +1.00: within the base's std
    _kapc_run(root, f'b_s{k}', best + 0.05, rii=(0.1, 0.4))  # +5.00
    _kapc_run(root, f'fp_s{k}', 0.93 + 0.01 * k, column='trained_local_accuracy')  # std 1.00
    _kapc_run(root, f'e_s{k}', 0.90, column='trained_local_accuracy')  # -4.00
    _kapc_run(root, f'f_s{k}', 0.80)  # its base has one seed
  _kapc_run(root, 'c_s0', 0.80, omega=1.0)  # one seed of three
  _kapc_run(root, 'g_s0', 0.85)
  groups = [_base('kapc', 'kb', row={'table': 'Table 1', 'alpha': '0.1', 'paper_row': 'kapc'}),
            _base('fedprox', 'fp', 'trained_local_accuracy'), _base('a03', 'g'),
            _point('A', 'kapc', 'a', 'lam'), _point('B', 'kapc', 'b', 'lam'),
            _point('C', 'kapc', 'c'), _point('D', 'kapc', 'd'),
            _point('E', 'fedprox', 'e', 'opt'), _point('F', 'a03', 'f', 'a03')]
  manifest = {'sections': [
      {'id': 'kapc', 'kind': 'paper_table', 'paper': 'kp', 'title': 'KAPC', 'groups': [
          {'label': 'T1', 'table': 'Table 1', 'dataset': 'FMNIST', 'alpha': '0.1',
           'runs': {'KAPC': ['kb_s0', 'kb_s1', 'kb_s2']}, 'paper_rows': {'KAPC': 'kapc'}}]},
      {'id': 'why', 'kind': 'ablation', 'title': 'Why', 'seeds': 3, 'groups': groups}]}
  paper = {'kp': {'paper': 'K', 'values': {'Table 1': {'FMNIST': {'0.1': {'kapc': [96.71, 0.17]}}}}}}
  with open(os.path.join(root, 'reproduction.json'), 'w') as f:
    json.dump(manifest, f)
  with open(os.path.join(root, 'paper_numbers.json'), 'w') as f:
    json.dump(paper, f)
  return root


def test_ablation_rows_cells_and_verdicts(ablation_results):
  md = _write(ablation_results)
  assert _row(md, '| base | base kapc |') == [
      'base', 'base kapc', 'kb_s{0,1,2}', '3/3', '92.00 ± 2.00 (n=3)', '–', '91.00 ± 2.00 (n=3)',
      '–', '0.190 ± 0.000 (n=3)', '0.200 ± 0.000 (n=3)', '5.00, 0.20', 'seed std 2.00']
  assert _row(md, '| suspect A |') == [
      'suspect A', 'A', 'a_s{0,1,2}', '3/3', '93.00 ± 2.00 (n=3)', '+1.00 ± 0.00 (n=3)',
      '92.00 ± 2.00 (n=3)', '+1.00 ± 0.00 (n=3)', '0.190 ± 0.000 (n=3)', '0.200 ± 0.000 (n=3)',
      '5.00, 0.20', 'tested, no effect']
  assert _row(md, '| suspect B |')[5] == '+5.00 ± 0.00 (n=3)'
  assert _row(md, '| suspect B |')[8:10] == ['0.390 ± 0.000 (n=3)', '0.400 ± 0.000 (n=3)']
  assert _row(md, '| suspect B |')[-1] == '+5.00 points'
  # One seed of three: its numbers, paired with base seed 0, and "pending (1/3)".
  assert _row(md, '| suspect C |') == [
      'suspect C', 'C', 'c_s{0,1,2}', '1/3', '80.00 (n=1, no std)', '-10.00 (n=1, no std)',
      '79.00 (n=1, no std)', '-10.00 (n=1, no std)', '0.190 (n=1, no std)',
      '0.200 (n=1, no std)', '1.00, 0.20', 'pending (1/3)']
  # Not run at all: listed all the same.
  assert _row(md, '| suspect D |') == ['suspect D', 'D', 'd_s{0,1,2}', '0/3'] + ['–'] * 7 + [
      'pending (0/3)']
  # FedProx reads its own protocol (trained_local) and has no R.
  assert _row(md, '| suspect E |')[4:] == ['90.00 ± 0.00 (n=3)', '-4.00 ± 1.00 (n=3)',
                                          '89.00 ± 0.00 (n=3)', '-4.00 ± 1.00 (n=3)', '–', '–',
                                          '–', '-4.00 points']
  # A base with one seed: its points wait for it.
  assert _row(md, '| suspect F |')[-1] == 'pending base (1/3)'
  for name in ('why_self_relation.png', 'why_factors.png'):
    assert os.path.getsize(os.path.join(ablation_results, 'figures', name)) > 1000
    assert f'](figures/{name})' in md
  assert not os.path.exists(os.path.join(ablation_results, 'figures', 'why.png'))


def test_ablation_reads_the_mean_over_the_sections_last_rounds(ablation_results):
  """With `last_rounds` k the table gives each seed's mean over its last k rounds beside the
  best-round mean, paired with the base's; a run with fewer rounds than k has none."""
  path = os.path.join(ablation_results, 'reproduction.json')
  for k, cells in ((2, ['91.50 ± 2.00 (n=3)', '–', '92.50 ± 2.00 (n=3)', '+1.00 ± 0.00 (n=3)']),
                   (5, ['–', '–', '–', '–'])):
    manifest = json.load(open(path))
    manifest['sections'][1]['last_rounds'] = k
    json.dump(manifest, open(path, 'w'))
    md = _write(ablation_results)
    assert f'| mean over the last {k} rounds % | − base, mean over the last {k} rounds' in md
    assert _row(md, '| base | base kapc |')[6:8] == cells[:2]
    assert _row(md, '| suspect A |')[6:8] == cells[2:]
    # The verdict stays the declared rule's: the best-round mean.
    assert _row(md, '| suspect B |')[-1] == '+5.00 points'


def test_a_point_read_from_kapcs_runs_is_void_once_a_clients_r_ii_exceeds_mu(tmp_path):
  """KAPC+BLS with the upload search off is KAPC only while Algorithm 3 skips nothing, i.e. while
  no client's r_ii in KAPC's runs exceeds μ: a point marked `equal_while_self_relation_at_most`
  gets its verdict from those runs until one of them goes above μ in any round (not only the
  last) or does not log r_ii (fail closed); a point still missing seeds stays pending."""
  root = str(tmp_path / 'results')
  for k, best in enumerate((0.90, 0.92, 0.94)):
    _kapc_run(root, f'bls_s{k}', best, omega=1.0)
    _kapc_run(root, f'below_s{k}', best + 0.05, rii_max=(0.3, 0.7, 0.5))
    _kapc_run(root, f'above_s{k}', best + 0.05, rii_max=(0.3, 0.75 if k == 1 else 0.5, 0.5))
    _kapc_run(root, f'unlogged_s{k}', best + 0.05)
  _kapc_run(root, 'early_s0', 0.95, rii_max=(0.9, 0.9, 0.9))
  point = lambda label, stem: dict(_point(label, 'bls', stem),
                                   equal_while_self_relation_at_most=0.7)
  manifest = {'sections': [{'id': 'why', 'kind': 'ablation', 'title': 'Why', 'seeds': 3,
                            'groups': [_base('bls', 'bls'), point('B', 'below'),
                                       point('A', 'above'), point('U', 'unlogged'),
                                       point('E', 'early')]}]}
  os.makedirs(root, exist_ok=True)
  with open(os.path.join(root, 'reproduction.json'), 'w') as f:
    json.dump(manifest, f)
  with open(os.path.join(root, 'paper_numbers.json'), 'w') as f:
    json.dump({}, f)
  md = _write(root)
  assert _row(md, '| suspect B |')[-1] == '+5.00 points'  # μ itself skips nothing (r > μ).
  assert _row(md, '| suspect A |')[-1] == "void: a client's r_ii reached 0.75 > μ = 0.7"
  assert _row(md, '| suspect U |')[-1] == 'void: a run does not log kapc/self_relation_max'
  assert _row(md, '| suspect E |')[-1] == 'pending (1/3)'


def test_ablation_verdict_rule_is_the_base_seed_std():
  base = {'seeds': {f's{k}': {'best': b} for k, b in enumerate((0.90, 0.92, 0.94))}}  # std 2.00

  def point(shift, seeds=3):
    return {'seeds': {f's{k}': {'best': b + shift}
                      for k, b in enumerate((0.90, 0.92, 0.94)) if k < seeds}}

  assert reproduction.ablation_verdict(point(0.0199), base, 3)[0] == 'tested, no effect'
  assert reproduction.ablation_verdict(point(-0.0199), base, 3)[0] == 'tested, no effect'
  verdict, effect = reproduction.ablation_verdict(point(0.0201), base, 3)
  assert verdict == '+2.01 points' and effect == pytest.approx(2.01)
  assert reproduction.ablation_verdict(point(-0.03), base, 3)[0] == '-3.00 points'
  assert reproduction.ablation_verdict(point(0.05, seeds=2), base, 3) == ('pending (2/3)', None)


def test_ablation_figures_render_with_no_run_finished(ablation_results):
  """Every point pending (no run folder at all): both figures still render."""
  import shutil  # pylint: disable=g-import-not-at-top
  shutil.rmtree(os.path.join(ablation_results, 'runs'))
  os.makedirs(os.path.join(ablation_results, 'runs'))
  md = _write(ablation_results)
  assert _row(md, '| suspect A |')[-1] == 'pending (0/3)'
  assert _row(md, '| base | base kapc |')[3:5] == ['0/3', '–']
  for name in ('why_self_relation.png', 'why_factors.png'):
    assert os.path.getsize(os.path.join(ablation_results, 'figures', name)) > 1000


def test_docs_summary_block_is_generated_from_the_results(ablation_results, tmp_path):
  """docs/reproduction.md beside results/ gets the per-paper summary between its markers; the
  text around them is kept. The KAPC row's verdict names the ablation points tested."""
  docs = tmp_path / 'docs'
  docs.mkdir()
  (docs / 'reproduction.md').write_text('intro\n<!-- results:start -->\nstale\n'
                                        '<!-- results:end -->\noutro\n')
  _write(ablation_results)
  text = (docs / 'reproduction.md').read_text()
  assert text.startswith('intro\n<!-- results:start -->\n') and text.endswith(
      '<!-- results:end -->\noutro\n')
  assert 'stale' not in text
  assert _row(text, '| KAPC, Table 1, α = 0.1 |') == [
      'KAPC, Table 1, α = 0.1', '96.71 ± 0.17', '92.00 ± 2.00 (n=3)',
      'ablation: 2 of 4 points with 3 seeds (A: tested, no effect; B: +5.00 points), the '
      'others pending']
  assert _row(text, '| KAPC has the best accuracy')[2] == 'Table 1, α = 0.1: 1 of 1'
  assert ('3 of 6 declared points have their 3 seeds. With an effect: B (+5.00 points); E '
          '(-4.00 points). '
          'Tested, no effect: A. Still running (the point or its base), point − base in points '
          'over the seeds finished (not a verdict): C -10.00 (n=1, no std); F -5.00 (n=1, no std).') in text
  # A results folder without a docs page beside it writes none.
  assert reproduction.write_docs_summary(str(tmp_path / 'elsewhere' / 'results'), report) is None


def test_kapc_without_bls_uploads_every_layer_by_the_method(tmp_path):
  """KAPC without BLS logs no Ω (by the method it uploads all L layers and skips none; earlier
  runs logged that as kapc/omega_mean): its rows state it for every seed, logged or not, with L
  counted from its r_ii layers; KAPC+BLS rows keep the values BLS measured."""
  root = str(tmp_path / 'results')
  for k, best in enumerate((0.90, 0.92, 0.94)):
    _kapc_run(root, f'bls_s{k}', best, omega=1.0, method='kapc+bls')
    _kapc_run(root, f'kapc_s{k}', best, omega=5.0 if k == 0 else None, method='kapc')
  with open(os.path.join(root, 'reproduction.json'), 'w') as f:
    json.dump({'sections': [{'id': 'why', 'kind': 'ablation', 'title': 'Why', 'seeds': 3,
                             'groups': [_base('bls', 'bls'), _point('K', 'bls', 'kapc')]}]}, f)
  with open(os.path.join(root, 'paper_numbers.json'), 'w') as f:
    json.dump({}, f)
  md = _write(root)
  assert _row(md, '| base | base bls |')[10] == '1.00, 0.20'
  assert _row(md, '| suspect K |')[10] == 'all 2, none (no BLS)'


def test_bls_and_self_relation_columns_are_read_under_old_and_new_names(tmp_path):
  """Runs logged before each rule's measurements had its own group (every personalised rule
  under `kapc/`, BLS's too; a real metrics.csv of results/runs) read as runs that log BLS under
  `bls/` and a rule's self-relations under its name (`fedamp/`)."""
  old = report.load_run(os.path.join(REPO, 'results', 'runs', 'kapc_why_bls_upload_all_s0'))
  last = old['rows'][-1]
  assert 'bls/omega_mean' not in last and last['kapc/omega_mean'] == 5.0
  assert reproduction._final_of(old, 'omega_mean') == 5.0
  assert reproduction._final_of(old, 'skipped_layer_fraction') == last[
      'kapc/skipped_layer_fraction']
  _write_run(tmp_path, 'new_bls', {'bls/omega_mean': [3.0, 2.0],
                                   'bls/skipped_layer_fraction': [0.0, 0.25],
                                   'fedamp/self_relation_layer_0': [0.5, 0.4],
                                   'fedamp/self_relation_layer_1': [0.6, 0.7]})
  new = report.load_run(str(tmp_path / 'runs' / 'new_bls'))
  assert (reproduction._final_of(new, 'omega_mean'),
          reproduction._final_of(new, 'skipped_layer_fraction')) == (2.0, 0.25)
  assert reproduction._final_of(new, 'search_steps_mean') is None
  old_fedamp = report.load_run(os.path.join(REPO, 'results', 'runs',
                                            'kapc_fmnist_n10_dir0.1_fedamp_s0'))
  for run in (old_fedamp, new):
    path = str(tmp_path / f'{run["label"]}.png')
    assert report.self_relation_plot(run, path) and os.path.getsize(path) > 1000
  assert not report.self_relation_plot({'label': 'x', 'rows': [{'round': 1.0}]},
                                       str(tmp_path / 'none.png'))
