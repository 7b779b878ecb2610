r"""Compares finished runs: one accuracy-per-round PNG and a Markdown table.

  python -m pipelines.report --runs=runs/a,runs/b,runs/c [--out=runs/report] \
      [--at_round=20] [--targets=0.6,0.7,0.8]

Reads each run's metrics.csv and summary.json (written by `pipelines.run`); the label of a run
is its directory name. Writes `<out>/report.md` and `<out>/accuracy.png` and prints the table.

  python -m pipelines.report --pairs --runs=runs/ccn/fedavg,runs/ccn/fedavg_ccn,...

With `--pairs` the runs are (original, normalised) pairs and the report adds the CCN paper's
"Original vs Normalised (gain)" table (best and final test accuracy, gain in points).
"""

import csv
import json
import os
import sys

from absl import app
from absl import flags

_RUNS = flags.DEFINE_list('runs', [], 'Run directories to compare.')
_OUT = flags.DEFINE_string('out', 'runs/report', 'Where report.md and accuracy.png go.')
_AT_ROUND = flags.DEFINE_integer('at_round', 20, 'Report the test accuracy at this round.')
_TARGETS = flags.DEFINE_list('targets', [], 'Target accuracies (default: each run\'s own).')
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


def plot(runs: list[dict], path: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, ax = plt.subplots(figsize=(7, 4.5))
  for run in runs:
    evals = [r for r in run['rows'] if 'test_accuracy' in r]
    ax.plot([r['round'] for r in evals], [r['test_accuracy'] for r in evals], label=run['label'])
  ax.set_xlabel('communication round')
  ax.set_ylabel('test accuracy')
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv) -> int:
  del argv
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
  with open(os.path.join(_OUT.value, 'report.md'), 'w') as f:
    f.write(md + '\n')
  plot(runs, os.path.join(_OUT.value, 'accuracy.png'))
  print(md)
  print(f'\nwrote {_OUT.value}/report.md and {_OUT.value}/accuracy.png')
  return 0


if __name__ == '__main__':
  app.run(lambda argv: sys.exit(main(argv)))
