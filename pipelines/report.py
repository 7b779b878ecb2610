r"""Compares finished runs: one accuracy-per-round PNG and a Markdown table.

  python -m pipelines.report --runs=runs/a,runs/b,runs/c [--out=runs/report] \
      [--at_round=20] [--targets=0.6,0.7,0.8]

Reads each run's metrics.csv and summary.json (written by `pipelines.run`); the label of a run
is its directory name. Writes `<out>/report.md` and `<out>/accuracy.png` and prints the table.
Runs whose config.gin differ only in seeds are also grouped: mean ± std over the seeds in
report.md and mean curves with seed bands in `<out>/accuracy_seeds.png`.

  python -m pipelines.report --pairs --runs=runs/ccn/fedavg,runs/ccn/fedavg_ccn,...

With `--pairs` the runs are (original, normalised) pairs and the report adds the CCN paper's
"Original vs Normalised (gain)" table (best and final test accuracy, gain in points).

  python -m pipelines.report --personalized --runs=runs/kapc/kapc,runs/kapc/local,... \
      [--heatmap_client=0]

With `--personalized` it writes the KAPC paper's tables instead: best mean accuracy of the
round's clients on their local test splits (Tables 1–2), communication — cumulative U-Comm /
D-Comm MB and MB until the best round (Tables 3, 6) — and the per-round time breakdown from
the channel model with the server's memory (Table 5); plus, for runs that saved their
relationship cube (`relationship.npy`), a heatmap of one client's R (Fig. 7; fixed colour
scale [0, --heatmap_vmax]) and, for runs that logged it, r_ii per layer by round; both are
linked from report.md.

  python -m pipelines.report --reproduction=results

writes the Reproduction report (`results/reproduction.md`, `results/figures/*.png`): every
comparison of `results/reproduction.json` with the papers' numbers from
`results/paper_numbers.json` beside ours (see `pipelines/reproduction.py`).
"""

import csv
import json
import os
import sys
from typing import Optional

from absl import flags

_RUNS = flags.DEFINE_list('runs', [], 'Run directories to compare.')
_OUT = flags.DEFINE_string('out', 'runs/report', 'Where report.md and accuracy.png go.')
_AT_ROUND = flags.DEFINE_integer('at_round', 20, 'Report the test accuracy at this round.')
_TARGETS = flags.DEFINE_list('targets', [], 'Target accuracies (default: each run\'s own).')
_PERSONALIZED = flags.DEFINE_bool('personalized', False,
                                  'Write the pFL tables (mean local accuracy, comms, time).')
_HEATMAP_CLIENT = flags.DEFINE_integer('heatmap_client', 0,
                                       'Client whose relationship matrix is drawn (the KAPC '
                                       'paper\'s Fig. 7 shows client 9).')
_HEATMAP_VMAX = flags.DEFINE_float('heatmap_vmax', 1.0,
                                   'Top of the heat map\'s fixed colour scale (bottom: 0).')
_REPRODUCTION = flags.DEFINE_string(
    'reproduction', None, 'A results folder (reproduction.json, paper_numbers.json, runs/): '
    'write its Reproduction report instead.')
_COLLECT_FROM = flags.DEFINE_string(
    'collect_from', None, 'With --reproduction: first copy metrics.csv, summary.json and '
    'config.gin of every finished run the manifest names from this folder of run outputs.')
_PAIRS = flags.DEFINE_bool('pairs', False, 'Runs are (original, normalised) pairs: add the '
                           '"Original vs Normalised (gain)" table.')


def load_run(path: str) -> dict:
  """Metrics rows (floats) and summary of one run directory."""
  metrics = os.path.join(path, 'metrics.csv')
  if not os.path.exists(metrics):
    raise FileNotFoundError(f'{path} has no metrics.csv: is it a pipelines.run output dir?')
  with open(metrics) as f:
    rows = [{k: float(v) for k, v in r.items() if v != ''} for r in csv.DictReader(f)]
  summary = {}
  if os.path.exists(os.path.join(path, 'summary.json')):
    with open(os.path.join(path, 'summary.json')) as f:
      summary = json.load(f)
  return {'label': os.path.basename(os.path.normpath(path)), 'rows': rows, 'summary': summary}


def _fmt(x) -> str:
  return '–' if x is None else f'{x:.4f}'


def table(runs: list[dict], at_round: int, targets: list[float]) -> str:
  """Markdown: accuracy at `at_round`, final, best (round), rounds to each target."""
  head = ['run', 'method', 'rounds', f'acc@{at_round}', 'final acc', 'best acc (round)']
  head += [f'rounds to {t:g}' for t in targets]
  lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
  for run in runs:
    evals = [r for r in run['rows'] if 'test_accuracy' in r]
    at = next((r['test_accuracy'] for r in evals if int(r['round']) == at_round), None)
    best = max(evals, key=lambda r: r['test_accuracy']) if evals else None
    cells = [run['label'], run['summary'].get('method', '?'),
             str(int(run['rows'][-1]['round'])) if run['rows'] else '0', _fmt(at),
             _fmt(evals[-1]['test_accuracy'] if evals else None),
             f'{_fmt(best["test_accuracy"])} ({int(best["round"])})' if best else '–']
    for t in targets:
      hit = next((int(r['round']) for r in evals if r['test_accuracy'] >= t), None)
      cells.append('–' if hit is None else str(hit))
    lines.append('| ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def gain_table(runs: list[dict]) -> str:
  """Markdown "Original vs Normalised (gain)" for consecutive (original, normalised) runs."""
  def accs(run):
    evals = [r['test_accuracy'] for r in run['rows'] if 'test_accuracy' in r]
    return (max(evals), evals[-1]) if evals else (None, None)

  lines = ['| scheme | original best | normalised best | gain | original final | '
           'normalised final | gain |', '|---|---|---|---|---|---|---|']
  for original, normalised in zip(runs[::2], runs[1::2]):
    (ob, of), (nb, nf) = accs(original), accs(normalised)
    gain = lambda a, b: '–' if a is None or b is None else f'{100 * (b - a):+.2f}'
    lines.append(f'| {original["summary"].get("method", original["label"])} | {_fmt(ob)} | '
                 f'{_fmt(nb)} | {gain(ob, nb)} | {_fmt(of)} | {_fmt(nf)} | {gain(of, nf)} |')
  return '\n'.join(lines)


# Local-accuracy columns, most specific first; 'mean_local_accuracy' is the single local
# column of runs made before the evaluation protocols.
LOCAL_COLUMNS = ('personal_local_accuracy', 'trained_local_accuracy', 'finetuned_local_accuracy',
                 'global_local_accuracy', 'mean_local_accuracy')


def headline_column(run: dict) -> Optional[str]:
  """The metrics.csv column of the run's headline protocol (summary.json), else None."""
  head = run.get('summary', {}).get('headline')
  return head.get('column') if isinstance(head, dict) else None


def _accuracy_key(run: dict) -> str:
  """The column a run's curve is drawn from: its headline protocol's, else central test
  accuracy, else its first local column."""
  head = headline_column(run)
  if head and any(head in r for r in run['rows']):
    return head
  if any('test_accuracy' in r for r in run['rows']):
    return 'test_accuracy'
  return local_key(run)


def local_key(run: dict) -> str:
  """The run's local (pFL) accuracy column: its headline protocol's when that is a local
  one, else the first local column it has."""
  head = headline_column(run)
  if head in LOCAL_COLUMNS and any(head in r for r in run['rows']):
    return head
  return next((c for c in LOCAL_COLUMNS if any(c in r for r in run['rows'])),
              'mean_local_accuracy')


def personalized_tables(runs: list[dict]) -> str:
  """Markdown in the layout of the KAPC paper's Tables 1–3 and 5 (one row per run)."""
  acc = ['| method | best mean accuracy (round) | final mean accuracy |', '|---|---|---|']
  comm = ['| method | U-Comm (MB) | D-Comm (MB) | total (MB) | MB until the best round |',
          '|---|---|---|---|---|']
  times = ['| method | download (s) | compute (s) | upload (s) | server (s) | round (s) | '
           'server memory (MB) |', '|---|---|---|---|---|---|---|']
  for run in runs:
    name = run['summary'].get('method', run['label'])
    if run['label'].startswith(name):  # E.g. 'kapc+bls (mu 0.5)' already names 'kapc+bls'.
      name = run['label']
    elif name != run['label']:
      name = f'{name} ({run["label"]})'
    key = local_key(run)
    rows = [r for r in run['rows'] if key in r]
    best = max(rows, key=lambda r: r[key]) if rows else None
    acc.append(f'| {name} ({key}) | ' + (f'{_fmt(best[key])} ({int(best["round"])})'
                                         if best else '–') +
               f' | {_fmt(rows[-1][key]) if rows else "–"} |')
    up = sum(r.get('bytes_up', 0) for r in run['rows']) / 1e6
    down = sum(r.get('bytes_down', 0) for r in run['rows']) / 1e6
    until = ('–' if best is None else
             f'{sum(r.get("bytes_up", 0) + r.get("bytes_down", 0) for r in run["rows"] if r["round"] <= best["round"]) / 1e6:.2f}')
    comm.append(f'| {name} | {up:.2f} | {down:.2f} | {up + down:.2f} | {until} |')
    mean = lambda key: (sum(r[key] for r in run['rows'] if key in r) /
                        max(1, sum(1 for r in run['rows'] if key in r)))
    if any('sim_round_seconds' in r for r in run['rows']):
      memory = run['summary'].get('server_memory_mb')
      times.append(f'| {name} | ' + ' | '.join(f'{mean("sim_" + k + "_seconds"):.3f}' for k in
                                                ('download', 'compute', 'upload', 'server',
                                                 'round')) +
                   f' | {"–" if memory is None else f"{memory:.2f}"} |')
  return '\n'.join(acc + [''] + comm + [''] + times)


def relationship_heatmap(run_dir: str, client: int, path: str, vmax: float = 1.0,
                         round_num=None) -> bool:
  """Fig. 7 (KAPC paper, §7.4): client `client`'s relationship matrix R[client] from the run's
  `relationship.npy` (the R saved with the last checkpoint, `PersonalizedAlgorithm.
  round_files`) as a PNG: layers on the vertical axis (layer 0 at the top), clients on the
  horizontal one, on a fixed colour scale [0, vmax] (R's entries lie in [0, 1]; the scale is not
  fitted to the matrix, so maps of different rounds and runs compare), with the values written
  in the cells when there are at most 20 clients. False when the run saved no R."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  source = os.path.join(run_dir, 'relationship.npy')
  if not os.path.exists(source):
    return False
  relation = np.load(source)
  if not 0 <= client < relation.shape[0]:
    raise ValueError(f'--heatmap_client={client} is not a client of {run_dir} '
                     f'(R has {relation.shape[0]}).')
  matrix = relation[client]                                   # [L, N]
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  layers, clients = matrix.shape
  fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * min(clients, 40) + 2.0),
                                  max(2.6, 0.45 * layers + 1.6)))
  image = ax.imshow(matrix, aspect='auto', cmap='viridis', vmin=0.0, vmax=vmax,
                    interpolation='nearest')
  step = max(1, clients // 20)
  ax.set_xticks(range(0, clients, step))
  ax.set_yticks(range(layers))
  ax.set_xlabel('client j')
  ax.set_ylabel('layer l')
  if clients <= 20:
    for l in range(layers):
      for j in range(clients):
        value = float(matrix[l, j])
        ax.text(j, l, f'{value:.2f}', ha='center', va='center', fontsize=7,
                color='black' if value > 0.6 * vmax else 'white')
  when = '' if round_num is None else f', round {int(round_num)}'
  entry = f'$r_{{{client}j}}^{{l}}$'
  ax.set_title(f'relationship matrix of client {client} ({entry}), '
               f'{os.path.basename(os.path.normpath(run_dir))}{when}', fontsize=9)
  bar = fig.colorbar(image, ax=ax)
  bar.set_label(f'{entry} (fixed scale 0–{vmax:g})')
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return True


def self_relation_plot(run: dict, path: str) -> bool:
  """r_ii^l by round, one line per layer: the mean over the round's participants of the
  self-relationship of the slice their s_i came from (metrics.csv's
  `kapc/self_relation_layer_<l>` columns). False when the run logged none."""
  prefix = 'kapc/self_relation_layer_'
  layers = sorted({int(k[len(prefix):]) for r in run['rows'] for k in r if k.startswith(prefix)})
  if not layers:
    return False
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(7, 4))
  for l in layers:
    rows = [r for r in run['rows'] if f'{prefix}{l}' in r]
    ax.plot([r['round'] for r in rows], [r[f'{prefix}{l}'] for r in rows], label=f'layer {l}')
  ax.set_xlabel('communication round')
  ax.set_ylabel('mean $r_{ii}^{l}$ over the round\'s clients')
  ax.set_title(f'self-relationship by layer: {run["label"]}', fontsize=9)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8, ncol=2)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


def _is_seed(binding: str) -> bool:
  return binding.endswith('.seed') or binding.endswith('.model_seed')


def seed_groups(paths: list[str]) -> list[list[int]]:
  """Indices of the runs whose `config.gin` differ only in seeds (`experiment.seed`,
  `experiment.model_seed`, `federated_data.seed`, any `<source>.seed`), in order of first
  appearance; a run without `config.gin` is a group of its own."""
  from fltff.simulation.outputs import config_bindings  # pylint: disable=g-import-not-at-top

  keys, groups = {}, []
  for i, path in enumerate(paths):
    try:
      with open(os.path.join(path, 'config.gin')) as f:
        bindings = config_bindings(f.read())
      key = tuple(sorted((k, v) for k, v in bindings.items() if not _is_seed(k)))
    except OSError:
      key = ('run', i)
    if key not in keys:
      keys[key] = len(groups)
      groups.append([])
    groups[keys[key]].append(i)
  return groups


def _seed_label(run: dict) -> str:
  seeds = run['summary'].get('seeds', {})
  return str(seeds.get('run', '?')) if isinstance(seeds, dict) else '?'


def seed_table(groups: list[list[int]], runs: list[dict]) -> str:
  """Markdown: per group of runs that differ only in seed, the headline accuracy's best and
  final value as mean ± sample std over the seeds."""
  from .reproduction import mean_std  # pylint: disable=g-import-not-at-top

  def pm(values):
    mean, std, n = mean_std(values)
    return '–' if mean is None else (f'{mean:.4f}' if std is None else
                                     f'{mean:.4f} ± {std:.4f}') + f' (n={n})'

  lines = ['| runs | method | seeds | accuracy | best: mean ± std | final: mean ± std |',
           '|---|---|---|---|---|---|']
  for group in groups:
    members = [runs[i] for i in group]
    key = _accuracy_key(members[0])
    curves = [[r[key] for r in run['rows'] if key in r] for run in members]
    lines.append(f'| {", ".join(run["label"] for run in members)} | '
                 f'{members[0]["summary"].get("method", "?")} | '
                 f'{", ".join(_seed_label(run) for run in members)} | {key} | '
                 f'{pm([max(c) for c in curves if c])} | {pm([c[-1] for c in curves if c])} |')
  return '\n'.join(lines)


def _accuracy_figure(runs: list[dict], path: str, draw) -> None:
  """One accuracy-by-round PNG: `draw(ax)` adds the curves; axes, legend and file are shared."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, ax = plt.subplots(figsize=(7, 4.5))
  draw(ax)
  ax.set_xlabel('communication round')
  ax.set_ylabel(_accuracy_axis(runs))
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def seed_band_plot(groups: list[list[int]], runs: list[dict], path: str) -> None:
  """Each group's mean curve over its seeds, with the band from the lowest to the highest."""
  from .reproduction import band  # pylint: disable=g-import-not-at-top

  def draw(ax):
    for group in groups:
      members = [runs[i] for i in group]
      x, mean, lo, hi = band(members, _accuracy_key)
      line, = ax.plot(x, mean, label=f'{members[0]["label"]} ({len(members)} seeds)')
      ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)

  _accuracy_figure(runs, path, draw)


def _accuracy_axis(runs: list[dict]) -> str:
  """The y-axis label: the protocol the curves show (runs may differ)."""
  names = {'test_accuracy': 'central test accuracy (global model)'}
  keys = sorted({_accuracy_key(run) for run in runs})
  return ' / '.join(names.get(k, k.replace('_', ' ')) for k in keys)


def plot(runs: list[dict], path: str) -> None:
  def draw(ax):
    for run in runs:
      key = _accuracy_key(run)
      evals = [r for r in run['rows'] if key in r]
      ax.plot([r['round'] for r in evals], [r[key] for r in evals], label=run['label'])

  _accuracy_figure(runs, path, draw)


def main(argv) -> int:
  del argv
  if _REPRODUCTION.value:
    from . import reproduction  # pylint: disable=g-import-not-at-top
    try:
      if _COLLECT_FROM.value:
        for name, state in reproduction.collect(_REPRODUCTION.value,
                                                _COLLECT_FROM.value).items():
          print(f'{name}: {state}')
      md = reproduction.write(_REPRODUCTION.value, sys.modules[__name__])
    except (OSError, KeyError, ValueError) as e:
      print(f'error: cannot write the reproduction report from {_REPRODUCTION.value}: '
            f'{type(e).__name__}: {e}', file=sys.stderr)
      return 2
    print(md)
    print(f'\nwrote {_REPRODUCTION.value}/reproduction.md and {_REPRODUCTION.value}/figures/')
    return 0
  if not _RUNS.value:
    print('error: pass --runs=dir1,dir2,...', file=sys.stderr)
    return 2
  try:
    runs = [load_run(p) for p in _RUNS.value]
  except FileNotFoundError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  if _TARGETS.value:
    targets = [float(t) for t in _TARGETS.value]
  else:
    targets = sorted({float(t) for r in runs
                      for t in r['summary'].get('rounds_to_target', {})})
  if _PAIRS.value and len(runs) % 2:
    print('error: --pairs needs an even number of runs (original, normalised, ...)',
          file=sys.stderr)
    return 2
  os.makedirs(_OUT.value, exist_ok=True)
  md = table(runs, _AT_ROUND.value, targets)
  if _PAIRS.value:
    md = gain_table(runs) + '\n\n' + md
  if _PERSONALIZED.value:
    md = personalized_tables(runs)
    figures = []
    for path, run in zip(_RUNS.value, runs):
      name = f'relationship_{run["label"]}_client{_HEATMAP_CLIENT.value}.png'
      last = run['rows'][-1]['round'] if run['rows'] else None
      try:
        drawn = relationship_heatmap(path, _HEATMAP_CLIENT.value, os.path.join(_OUT.value, name),
                                     _HEATMAP_VMAX.value, last)
      except ValueError as e:
        print(f'error: {e}', file=sys.stderr)
        return 2
      if drawn:
        figures.append(f'![relationship matrix of client {_HEATMAP_CLIENT.value}, '
                       f'{run["label"]}]({name})')
      name = f'self_relation_{run["label"]}.png'
      if self_relation_plot(run, os.path.join(_OUT.value, name)):
        figures.append(f'![r_ii per layer by round, {run["label"]}]({name})')
    if figures:
      md += ('\n\nRelationship cube (KAPC paper Fig. 7: one client\'s R after the last round, '
             'layers × clients; and r_ii per layer by round):\n\n' + '\n\n'.join(figures))
  # Groups of one run folder named twice are not seeds.
  groups = [g for g in seed_groups(_RUNS.value)
            if len({os.path.realpath(_RUNS.value[i]) for i in g}) > 1]
  if groups:
    md += ('\n\nRuns that differ only in seed (accuracy: each group\'s headline column; '
           'mean ± sample std over seeds; curves with their seed band in accuracy_seeds.png):'
           f'\n\n{seed_table(groups, runs)}\n\n'
           '![accuracy over seeds](accuracy_seeds.png)')
    seed_band_plot(groups, runs, os.path.join(_OUT.value, 'accuracy_seeds.png'))
  with open(os.path.join(_OUT.value, 'report.md'), 'w') as f:
    f.write(md + '\n')
  plot(runs, os.path.join(_OUT.value, 'accuracy.png'))
  print(md)
  print(f'\nwrote {_OUT.value}/report.md and {_OUT.value}/accuracy.png')
  return 0


if __name__ == '__main__':
  from fltff.cli import run_program  # pylint: disable=g-import-not-at-top
  run_program(main)
