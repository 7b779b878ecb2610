"""The Reproduction report: our runs beside what the papers report.

  python -m pipelines.report --reproduction=results [--collect_from=~/fltff-runs]

(`--collect_from` first copies the small files of every finished run the manifest names from a
folder of `pipelines.run` outputs into `results/runs/`) reads `results/reproduction.json` (which runs form which comparison), `results/paper_numbers.json`
(the papers' own numbers and claims, each with its source) and the runs under `results/runs/`
(each `metrics.csv`, `summary.json`, `config.gin` as `pipelines.run` wrote them), and writes
`results/reproduction.md` and one accuracy-curve PNG per comparison under `results/figures/`.
A run the manifest lists but `results/runs/` lacks is reported as "not run", never skipped.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import types
from typing import Optional

NOT_RUN = 'not run'


def _load(report: types.ModuleType, runs_dir: str, name: str) -> Optional[dict]:
  path = os.path.join(runs_dir, name)
  if not os.path.exists(os.path.join(path, 'metrics.csv')):
    return None
  run = report.load_run(path)
  run['label'] = name
  return run


TEST = 'test_accuracy'


def curve(run: dict, key: str = TEST) -> list[tuple[int, float]]:
  """(round, accuracy) of the evaluated rounds; `key` is a metrics.csv column."""
  return [(int(r['round']), r[key]) for r in run['rows'] if key in r]


def accuracy_at(run: dict, rnd: int, key: str = TEST) -> Optional[float]:
  return next((a for r, a in curve(run, key) if r == rnd), None)


def mean_until(run: dict, rnd: int, key: str = TEST) -> Optional[float]:
  """Mean accuracy over the evaluated rounds 1..rnd (None if the run stopped before rnd)."""
  points = curve(run, key)
  values = [a for r, a in points if r <= rnd]
  return sum(values) / len(values) if values and points[-1][0] >= rnd else None


def rounds_to(run: dict, target: float, key: str = TEST) -> Optional[int]:
  return next((r for r, a in curve(run, key) if a >= target), None)


def _best(run: dict, key: str = TEST) -> Optional[tuple[int, float]]:
  points = curve(run, key)
  return max(points, key=lambda p: p[1]) if points else None


def _fmt(x: Optional[float], digits: int = 4) -> str:
  return '–' if x is None else f'{x:.{digits}f}'


def _points(x: Optional[float]) -> str:
  return '–' if x is None else f'{100 * x:+.2f}'


def _complete(run: Optional[dict]) -> str:
  if run is None:
    return NOT_RUN
  done = int(run['rows'][-1]['round']) if run['rows'] else 0
  return f'{done} rounds'


def _claims(paper: dict, key: Optional[str]) -> dict:
  return {c['id']: c for c in paper.get(key, {}).get('claims', [])} if key else {}


def _paper_line(paper: dict, key: Optional[str]) -> str:
  entry = paper.get(key or '', {})
  if not entry:
    return ''
  lines = [f'Paper: {entry["paper"]}.']
  if entry.get('not_available'):
    lines.append('Not available to us (paper PDF not reachable here): ' +
                 '; '.join(entry['not_available']) + '.')
  return ' '.join(lines)


def early_gain(section: dict, runs: dict, paper: dict, report=None) -> str:
  """FedLap-style: accuracy at round k, mean over rounds 1..k, final, best; gain in points."""
  k, method = section['at_round'], section['method']
  claims = _claims(paper, section.get('paper'))
  out = ['| setting | method | run | acc@%d | mean acc rounds 1–%d | final | best (round) |'
         % (k, k), '|---|---|---|---|---|---|---|']
  gains = ['| setting | %s minus | at round %d (points) | mean over rounds 1–%d | final | '
           'paper says |' % (method, k, k), '|---|---|---|---|---|---|']
  final = lambda run: curve(run)[-1][1] if curve(run) else None
  for group in section['groups']:
    for name, run_name in group['runs'].items():
      run = runs.get(run_name)
      best = _best(run) if run else None
      out.append(f'| {group["label"]} | {name} | {_complete(run)} | '
                 f'{_fmt(accuracy_at(run, k) if run else None)} | '
                 f'{_fmt(mean_until(run, k) if run else None)} | '
                 f'{_fmt(final(run) if run else None)} | '
                 + (f'{best[1]:.4f} ({best[0]})' if best else '–') + ' |')
    ours = runs.get(group['runs'][method])
    claim = claims.get(group.get('claim'), {}).get('text', '–')
    for baseline in section['baselines']:
      base = runs.get(group['runs'][baseline])
      if ours is None or base is None:
        gains.append(f'| {group["label"]} | {baseline} | {NOT_RUN} | {NOT_RUN} | {NOT_RUN} | '
                     f'{claim} |')
        continue

      def gain(fn):
        mine, theirs = fn(ours), fn(base)
        return None if mine is None or theirs is None else mine - theirs

      gains.append(f'| {group["label"]} | {baseline} | '
                   f'{_points(gain(lambda r: accuracy_at(r, k)))} | '
                   f'{_points(gain(lambda r: mean_until(r, k)))} | {_points(gain(final))} | '
                   f'{claim} |')
  return '\n'.join(out + [''] + gains)


def _reduction(ours: Optional[int], base: Optional[int]) -> str:
  if ours is None or base is None:
    return '–'
  return f'{100 * (base - ours) / base:+.1f} %'


def rounds_to_target(section: dict, runs: dict, paper: dict, report=None) -> str:
  """FedLayerWise Table I style: rounds to targets, and the reduction in rounds."""
  targets, target = section['targets'], section['target']
  out = ['| clients | method | run | ' + ' | '.join(f'rounds to {t:g}' for t in targets) +
         ' | final | best (round) |', '|---|---|---|' + '---|' * len(targets) + '---|---|']
  reductions = ['| clients | target | FedLayerWise vs FedAvg | FedLayerWise vs FedAdp | '
                'FedAdp vs FedAvg |', '|---|---|---|---|---|']
  for group in section['groups']:
    for name, run_name in group['runs'].items():
      run = runs.get(run_name)
      best = _best(run) if run else None
      cells = [('–' if run is None or rounds_to(run, t) is None else str(rounds_to(run, t)))
               for t in targets]
      out.append(f'| {group["label"]} | {name} | {_complete(run)} | ' + ' | '.join(cells) +
                 f' | {_fmt(curve(run)[-1][1] if run and curve(run) else None)} | ' +
                 (f'{best[1]:.4f} ({best[0]})' if best else '–') + ' |')
    for t in targets:
      r = {m: (rounds_to(runs[n], t) if runs.get(n) else None)
           for m, n in group['runs'].items()}
      mark = ' (main)' if t == target else ''
      reductions.append(f'| {group["label"]} | {t:g}{mark} | '
                        f'{_reduction(r.get("fedlayerwise"), r.get("fedavg"))} | '
                        f'{_reduction(r.get("fedlayerwise"), r.get("fedadp"))} | '
                        f'{_reduction(r.get("fedadp"), r.get("fedavg"))} |')
  claims = list(_claims(paper, section.get('paper')).values()) + list(
      _claims(paper, section.get('also_paper')).values())
  paper_rows = [f'- {c["text"]} ({c["source"]})' for c in claims]
  note = [section['target_note'], ''] if section.get('target_note') else []
  return '\n'.join(out + [''] + note + reductions +
                   ['', 'The papers say (fewer rounds = positive):'] + paper_rows)


def personalized(section: dict, runs: dict, paper: dict, report: types.ModuleType) -> str:
  present, missing = [], []
  for group in section['groups']:
    for name, run_name in group['runs'].items():
      run = runs.get(run_name)
      if run is None:
        missing.append(f'{name} ({run_name})')
      else:
        present.append(dict(run, label=name))
  text = report.personalized_tables(present) if present else ''
  text += ('\n\nPaper Table 1 values: not available to us (see the paper line above).')
  if missing:
    text += '\n\nNot run yet: ' + ', '.join(missing) + '.'
  return text


def pairs(section: dict, runs: dict, paper: dict, report: types.ModuleType) -> str:
  present, missing = [], []
  for group in section['groups']:
    for name, (original, normalised) in group['runs'].items():
      a, b = runs.get(original), runs.get(normalised)
      if a is None or b is None:
        missing.append(name)
      else:
        present += [a, b]
  text = report.gain_table(present) if present else ''
  if missing:
    text += '\n\nNot run yet: ' + ', '.join(missing) + ' (original and/or normalised).'
  return text


def _mean_std(values: list[float]) -> str:
  if not values:
    return '–'
  mean = sum(values) / len(values)
  if len(values) == 1:  # No spread from one seed: say so instead of printing ± nan.
    return f'{mean:.4f} (n=1, no std)'
  std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
  return f'{mean:.4f} ± {std:.4f} (n={len(values)})'


def seeds(section: dict, runs: dict, paper: dict, report=None) -> str:
  out = ['| comparison | method | best accuracy | final accuracy | runs missing |',
         '|---|---|---|---|---|']
  for group in section['groups']:
    key = group.get('metric', TEST)
    for name, names in group['runs'].items():
      got = [runs[n] for n in names if runs.get(n)]
      best = [_best(r, key)[1] for r in got if _best(r, key)]
      final = [curve(r, key)[-1][1] for r in got if curve(r, key)]
      missing = [n for n in names if not runs.get(n)]
      out.append(f'| {group["label"]} | {name} | {_mean_std(best)} | {_mean_std(final)} | '
                 f'{", ".join(missing) or "none"} |')
  out.append('\nstd is the sample standard deviation over seeds (n − 1).')
  return '\n'.join(out)


KINDS = {'early_gain': early_gain, 'rounds_to_target': rounds_to_target,
         'personalized': personalized, 'pairs': pairs, 'seeds': seeds}


def plot_section(section: dict, runs: dict, path: str, report: types.ModuleType) -> bool:
  """One panel per group, one curve per method; False if no run of the section exists."""
  groups = [g for g in section['groups']
            if any(runs.get(n) for v in g['runs'].values()
                   for n in (v if isinstance(v, list) else [v]))]
  if not groups:
    return False
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(1, len(groups), figsize=(5.2 * len(groups), 3.8), squeeze=False)
  for ax, group in zip(axes[0], groups):
    for name, value in group['runs'].items():
      for i, run_name in enumerate(value if isinstance(value, list) else [value]):
        run = runs.get(run_name)
        if run is None:
          continue
        points = curve(run, report.local_key(run) if section['kind'] == 'personalized' else TEST)
        label = name if not isinstance(value, list) else (
            f'{name} ({"CCN" if i else "original"})' if section['kind'] == 'pairs'
            else (name if i == 0 else None))
        ax.plot([p[0] for p in points], [p[1] for p in points], label=label,
                linestyle='--' if section['kind'] == 'pairs' and i else '-', linewidth=1.2)
    ax.set_title(group['label'], fontsize=10)
    ax.set_xlabel('communication round')
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  axes[0][0].set_ylabel('mean local accuracy' if section['kind'] == 'personalized'
                        else 'test accuracy')
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)
  return True


RUN_FILES = ('metrics.csv', 'summary.json', 'config.gin')


def manifest_runs(results_dir: str) -> list[str]:
  """Every run name `reproduction.json` refers to, sorted."""
  with open(os.path.join(results_dir, 'reproduction.json')) as f:
    manifest = json.load(f)
  names = set()
  for section in manifest['sections']:
    for group in section['groups']:
      for value in group['runs'].values():
        names.update(value if isinstance(value, list) else [value])
  return sorted(names)


def run_progress(run_dir: str) -> tuple[int, Optional[int]]:
  """(rounds in metrics.csv, rounds the resolved config.gin asks for)."""
  done = 0
  metrics = os.path.join(run_dir, 'metrics.csv')
  if os.path.exists(metrics):
    with open(metrics) as f:
      done = max(0, sum(1 for _ in f) - 1)
  wanted = None
  config = os.path.join(run_dir, 'config.gin')
  if os.path.exists(config):
    with open(config) as f:
      match = re.search(r'^experiment\.rounds = (\d+)', f.read(), re.M)
    wanted = int(match.group(1)) if match else None
  return done, wanted


def collect(results_dir: str, source_dir: str) -> dict[str, str]:
  """Copies the small files of every finished manifest run from `source_dir` into results.

  A run counts as finished when its metrics.csv has as many rounds as its config.gin asks
  for; unfinished runs are reported (to `--resume` them) and not copied. Returns
  {run name: 'copied' | 'in progress k/N' | 'absent'}.
  """
  status = {}
  for name in manifest_runs(results_dir):
    src = os.path.join(os.path.expanduser(source_dir), name)
    if not os.path.isdir(src):
      status[name] = 'absent'
      continue
    done, wanted = run_progress(src)
    if wanted is None or done < wanted:
      status[name] = f'in progress {done}/{wanted or "?"}'
      continue
    dst = os.path.join(results_dir, 'runs', name)
    os.makedirs(dst, exist_ok=True)
    for file in RUN_FILES:
      shutil.copyfile(os.path.join(src, file), os.path.join(dst, file))
    status[name] = 'copied'
  return status


def write(results_dir: str, report: types.ModuleType) -> str:
  """Writes `<results_dir>/reproduction.md` and figures; returns the Markdown.

  `report` is `pipelines.report` (its run loader and KAPC/CCN tables), passed in because that
  module is usually `__main__` when this runs.
  """
  with open(os.path.join(results_dir, 'reproduction.json')) as f:
    manifest = json.load(f)
  with open(os.path.join(results_dir, 'paper_numbers.json')) as f:
    paper = json.load(f)
  runs_dir = os.path.join(results_dir, 'runs')
  runs = {n: _load(report, runs_dir, n) for n in manifest_runs(results_dir)}
  os.makedirs(os.path.join(results_dir, 'figures'), exist_ok=True)
  parts = ['# Reproduction on the full Fashion-MNIST\n',
           'Generated by `python -m pipelines.report --reproduction=results` from '
           '`results/runs/` (each run\'s metrics.csv, summary.json, config.gin), '
           '`results/reproduction.json` and `results/paper_numbers.json`.\n']
  for section in manifest['sections']:
    parts.append(f'## {section["title"]}\n')
    line = _paper_line(paper, section.get('paper'))
    if line:
      parts.append(line + '\n')
    parts.append(KINDS[section['kind']](section, runs, paper, report) + '\n')
    png = os.path.join(results_dir, 'figures', f'{section["id"]}.png')
    if section['kind'] != 'seeds' and plot_section(section, runs, png, report):
      parts.append(f'![{section["id"]}](figures/{section["id"]}.png)\n')
  md = '\n'.join(parts)
  with open(os.path.join(results_dir, 'reproduction.md'), 'w') as f:
    f.write(md)
  return md
