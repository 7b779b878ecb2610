"""The Reproduction report: our runs beside what the papers report.

  python -m pipelines.report --reproduction=results [--collect_from=~/fltff-runs]

(`--collect_from` first copies the small files of every finished run the manifest names from a
folder of `pipelines.run` outputs into `results/runs/`) reads `results/reproduction.json` (which
runs form which comparison), `results/paper_numbers.json` (the papers' own numbers and claims,
each with its source) and the runs under `results/runs/` (each `metrics.csv`, `summary.json`,
`config.gin` as `pipelines.run` wrote them, and `measurements.jsonl` where a section asks for
it), and writes `results/reproduction.md` and one accuracy-curve PNG per comparison under
`results/figures/` (mean over the seeds present, with their min–max band).

A run the manifest lists but `results/runs/` lacks is reported as "not run", never skipped.
Every number of ours is a run's headline (`summary.json`: protocol, column and statistic) or,
for runs made before the evaluation protocols (no headline), the best round of the column
`report.local_key` / central test accuracy picks, marked as an earlier run. Seeds are the
`_s<k>` suffix of the run names: each cell over seeds is the mean ± sample std (n − 1) over the
seeds present, with n; in a KAPC table row with runs of both kinds, only the runs with a recorded
headline (an earlier run's reading is another quantity: it is listed per seed and as a run to
redo).

Section kinds (`"kind"` in the manifest): `paper_table` (KAPC Tables 1–2: the paper's value per
method beside our headline), `claim_gaps` (FedLap: per-seed gaps against the abstract's claims),
`rounds_to_target` (FedLayerWise Table I), `pairs` (CCN: original vs normalised per temperature,
with the spread of the contribution factors), `ablation` (why KAPC trails: each declared point
beside its paper-settings base, with the verdict rule of its intro, and two figures; the
section's `last_rounds` k adds the mean over the last k rounds; a point with
`equal_while_self_relation_at_most` μ reads runs of another method that equal it while no r_ii
exceeds μ, and is void otherwise) and
`out_of_reach` (settings whose data are not here, with their configs and the paper numbers they
would compare with).

`write` also regenerates the per-paper summary of `docs/reproduction.md` (between its markers)
when a `docs/` folder sits beside the results folder, so the page's numbers come from here.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import shutil
import types
from typing import Optional

NOT_RUN = 'not run'
TEST = 'test_accuracy'
DASH = '–'

# The protocol each metrics.csv accuracy column belongs to (fltff.simulation.evaluation's
# PROTOCOL_COLUMNS, inverted; 'mean_local_accuracy' is the one local column of earlier runs).
COLUMN_PROTOCOLS = {
    'test_accuracy': 'central',
    'global_local_accuracy': 'global_local',
    'personal_local_accuracy': 'personal_local',
    'trained_local_accuracy': 'trained_local',
    'finetuned_local_accuracy': 'finetuned_local',
    'mean_local_accuracy': 'mean_local (earlier run)',
}
STATISTICS = {'best_round_mean': 'best-round mean', 'mean_client_best': 'mean of client bests'}


# -- runs and curves ---------------------------------------------------------------------------

def _load(report: types.ModuleType, runs_dir: str, name: str) -> Optional[dict]:
  path = os.path.join(runs_dir, name)
  if not os.path.exists(os.path.join(path, 'metrics.csv')):
    return None
  run = report.load_run(path)
  run['label'] = name
  run['dir'] = path
  return run


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


def rounds_done(run: dict) -> int:
  return int(run['rows'][-1]['round']) if run['rows'] else 0


def _best(run: dict, key: str = TEST) -> Optional[tuple[int, float]]:
  points = curve(run, key)
  return max(points, key=lambda p: p[1]) if points else None


def _final(run: dict, key: str = TEST) -> Optional[float]:
  points = curve(run, key)
  return points[-1][1] if points else None


def seed_key(name: str) -> str:
  """'s<k>' from a run name ending in `_s<k>`, else '' (a run without seeds: one run)."""
  match = re.search(r'_(s\d+)$', name)
  return match.group(1) if match else ''


def seed_of(name: str) -> str:
  """The seed label of a run for the report: 's<k>'; a run without a seed binding is seed 0
  (results/plan.txt)."""
  return seed_key(name) or 's0'


def _as_list(value) -> list[str]:
  return list(value) if isinstance(value, list) else [value]


def headline(run: dict, report: types.ModuleType, local: bool) -> dict:
  """The run's headline: {value, column, protocol, statistic, round, recorded}.

  `recorded` is False for runs made before the evaluation protocols (no `headline` in
  summary.json): then the best round of the local column `report.local_key` picks (`local`) or
  of central test accuracy.
  """
  head = run.get('summary', {}).get('headline')
  if isinstance(head, dict):  # value None: the run evaluated nothing
    return dict(head, recorded=True)
  column = report.local_key(run) if local else TEST
  best = _best(run, column)
  return {'value': best[1] if best else None, 'round': best[0] if best else None,
          'column': column, 'protocol': COLUMN_PROTOCOLS.get(column, column),
          'statistic': 'best_round_mean', 'recorded': False}


def _describe(heads: list[dict]) -> str:
  names = []
  for h in heads:
    name = f'{h["protocol"]}, {STATISTICS.get(h["statistic"], h["statistic"])}'
    if name not in names:
      names.append(name)
  return ' / '.join(names) + (' (mixed over seeds)' if len(names) > 1 else '')


def readings(run: dict, head: dict) -> dict[str, float]:
  """Every other reading of the run: {'<protocol> <statistic>': value}.

  The headline column under the mean of client bests (its best-round mean has a column of its
  own in the KAPC tables), and each other accuracy column under both
  (best-round from metrics.csv, mean of client bests from summary.json where recorded).
  """
  out = {}
  summary = run.get('summary', {})
  for column, protocol in COLUMN_PROTOCOLS.items():
    best = _best(run, column)
    client_best = summary.get(f'mean_client_best_{column}')
    if best and column != head['column']:  # the headline column's: its own table column
      out[f'{protocol} best-round'] = best[1]
    if client_best is not None and not (column == head['column'] and
                                        head['statistic'] == 'mean_client_best'):
      out[f'{protocol} client-best'] = client_best
  return out


# -- numbers -----------------------------------------------------------------------------------

def mean_std(values: list[float]) -> tuple[Optional[float], Optional[float], int]:
  """(mean, sample std or None for fewer than 2 values, n)."""
  if not values:
    return None, None, 0
  mean = sum(values) / len(values)
  if len(values) < 2:
    return mean, None, len(values)
  return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)), len(values)


def _pm(values: list[float], signed: bool = False, digits: int = 2) -> str:
  """'m ± s (n=k)', 'm (n=1, no std)' or '–' (values already in the unit shown)."""
  mean, std, n = mean_std(values)
  if mean is None:
    return DASH
  m = f'{mean:+.{digits}f}' if signed else f'{mean:.{digits}f}'
  return f'{m} (n=1, no std)' if std is None else f'{m} ± {std:.{digits}f} (n={n})'


def _pct(x: Optional[float]) -> str:
  return DASH if x is None else f'{100 * x:.2f}'


def _fmt(x: Optional[float], digits: int = 4) -> str:
  return DASH if x is None else f'{x:.{digits}f}'


def _claims(paper: dict, key: Optional[str]) -> dict:
  return {c['id']: c for c in paper.get(key, {}).get('claims', [])} if key else {}


def _paper_line(paper: dict, key: Optional[str]) -> str:
  entry = paper.get(key or '', {})
  if not entry:
    return ''
  lines = [f'Paper: {entry["paper"]}.']
  if entry.get('transcription'):
    lines.append(entry['transcription'])
  return ' '.join(lines)


def _group_runs(group: dict, runs: dict, key: str) -> tuple[list[dict], list[str]]:
  """(runs present, names missing) of `group['runs'][key]`."""
  names = _as_list(group['runs'][key])
  return [runs[n] for n in names if runs.get(n)], [n for n in names if not runs.get(n)]


def _present_cell(present: list[dict]) -> str:
  """The seeds of the runs present ('s0, s1'), or '1 run' for runs without seeds."""
  if all(not seed_key(r['label']) for r in present):
    return f'{len(present)} run' + ('s' if len(present) > 1 else '')
  return ', '.join(seed_of(r['label']) for r in present)


def _missing_cell(missing: list[str]) -> str:
  return ', '.join(missing) if missing else 'none'


# -- KAPC Tables 1-2: the paper's value per method beside our headline --------------------------

def last_rounds_mean(run: dict, column: str, k: int) -> Optional[float]:
  """Mean of `column` over the run's last `k` evaluated rounds (None with fewer than k)."""
  points = curve(run, column)
  return sum(a for _, a in points[-k:]) / k if len(points) >= k else None


def _paper_row(group: dict, runs: dict, row: str, report: types.ModuleType) -> dict:
  """One method of a KAPC table: its runs, headlines and every statistic the table shows."""
  present, missing = _group_runs(group, runs, row)
  heads = [headline(r, report, local=True) for r in present]
  got = [(r, h) for r, h in zip(present, heads) if h['value'] is not None]
  # Earlier runs (no recorded headline) measured another quantity: beside recorded ones they
  # are listed, not averaged in, and counted as runs to redo.
  earlier = [r['label'] for r, h in got if not h['recorded']] if any(
      h['recorded'] for _, h in got) else []
  counted = [(r, h) for r, h in got if r['label'] not in earlier]
  best_round = [100 * b[1] for b in (_best(r, h['column']) for r, h in counted) if b]
  k = group.get('last_rounds')
  last = [100 * v for v in (last_rounds_mean(r, h['column'], k) for r, h in counted)
          if v is not None] if k else []
  return {'present': present, 'missing': missing, 'got': got, 'earlier': earlier,
          'counted': counted, 'values': [100 * h['value'] for _, h in counted],
          'best_round': best_round, 'last': last}


def ranks(group: dict, runs: dict, report: types.ModuleType) -> dict[str, int]:
  """{row: rank by the mean best-round mean over its seeds} over the group's ranked rows (all
  but `unranked`, alternative readings of a row ranked already) that have runs; 1 = highest."""
  means = {}
  for row in group['runs']:
    if row in group.get('unranked', ()):
      continue
    values = _paper_row(group, runs, row, report)['best_round']
    if values:
      means[row] = sum(values) / len(values)
  order = sorted(means, key=lambda r: -means[r])
  return {row: order.index(row) + 1 for row in means}


def paper_table(section: dict, runs: dict, paper: dict, report: types.ModuleType) -> str:
  """One table per group (paper table, dataset, α): paper value, ours, gap, seeds, readings.

  "ours %" is the run's headline, under the statistic the paper uses for that method (the mean
  of client bests for local training and FedAvg, §7.1, the best-round mean for the others,
  §7.2), so it is the number to set beside the paper's; cells under another statistic than the
  best-round mean are marked. Methods are compared and ranked on one statistic, the best-round
  mean of each method's headline protocol, in its own column. A group with `last_rounds` k also
  shows the mean over the last k rounds (with 10 of 100 clients a round, a best-round mean is
  the best of the rounds' draws of participants).
  """
  entry = paper[section['paper']]
  out = []
  for group in section['groups']:
    source = group['table']
    cells = entry['values'][source][group['dataset']][group['alpha']]
    flags = {f['cell']: f['note'] for f in entry.get('flags', [])}
    k = group.get('last_rounds')
    last_head = f' mean over the last {k} rounds % |' if k else ''
    out += [f'### {group["label"]}', '',
            f'| method | paper % ({source}) | ours % | our headline | gap (points) | '
            'seeds: mean ± std | per seed | ours, best-round mean % (every row) | rank by '
            f'best-round mean |{last_head} other readings, % (mean over seeds) | runs missing |',
            '|' + '---|' * (11 + bool(k))]
    notes = []
    rank = ranks(group, runs, report)
    ranked = len(rank)
    marked = False
    for row in group['runs']:
      paper_key = group['paper_rows'][row]
      value = cells.get(paper_key)
      flag = flags.get(f'{source}/{group["dataset"]}/{group["alpha"]}/{paper_key}')
      paper_cell = DASH if value is None else f'{value[0]:.2f} ± {value[1]:.2f}'
      if flag:
        paper_cell += f' [{len(notes) + 1}]'
        notes.append(f'[{len(notes) + 1}] {flag}')
      r = _paper_row(group, runs, row, report)
      if not r['present']:
        out.append(f'| {row} | {paper_cell} | ' + ' | '.join([NOT_RUN] * (8 + bool(k))) +
                   f' | {_missing_cell(r["missing"])} |')
        continue
      counted, earlier = r['counted'], r['earlier']
      mean = mean_std(r['values'])[0]
      client_best = any(h['statistic'] != 'best_round_mean' for _, h in counted)
      marked |= client_best
      ours = DASH if mean is None else f'{mean:.2f}' + (' *' if client_best else '')
      gap = DASH if mean is None or value is None else f'{mean - value[0]:+.2f}'
      per_seed = ', '.join(
          f'{seed_of(run["label"])} {100 * h["value"]:.2f}'
          + (' (earlier run, not averaged)' if run['label'] in earlier else '')
          for run, h in r['got'])
      other = {}
      for run, h in counted:
        for key, v in readings(run, h).items():
          other.setdefault(key, []).append(v)
      other_cell = '; '.join(f'{key} {100 * sum(v) / len(v):.2f}' for key, v in other.items())
      redo = r['missing'] + [f'{name} (earlier run)' for name in earlier]
      rank_cell = f'{rank[row]} of {ranked}' if row in rank else DASH
      last_cell = f' {_pm(r["last"])} |' if k else ''
      out.append(f'| {row} | {paper_cell} | {ours} | {_describe([h for _, h in counted])} | '
                 f'{gap} | {_pm(r["values"])} | {per_seed or DASH} | {_pm(r["best_round"])} | '
                 f'{rank_cell} |{last_cell} {other_cell or DASH} | {_missing_cell(redo)} |')
    out.append('')
    if marked:
      out.append('\\* mean of client bests, the paper\'s statistic for this method (§7.1): the '
                 'number to set beside the paper\'s, not to rank against the best-round means of '
                 'the other rows; rank by the best-round mean column, the same statistic for '
                 'every row.\n')
    out += [n + '\n' for n in notes]
  note = entry.get('plusminus')
  if note:
    out.append(note + '\n')
  out += self_relation_table(section, runs)
  for text in section.get('notes', []):
    out.append(text + '\n')
  return '\n'.join(out)


def self_relations(run: dict) -> Optional[list[tuple[int, list[float]]]]:
  """[(round, mean over clients of r_ii per layer)] from the run's measurements.jsonl (KAPC's
  `kapc/self_relation`, one row per client, one column per layer), or None."""
  rounds = [(int(record['round']), [sum(column) / len(column) for column in zip(*rows)])
            for record in measurement_records(run)
            for rows in [record.get('kapc/self_relation')] if rows]
  return rounds or None


def measurement_records(run: dict) -> list[dict]:
  """The records of the run's measurements.jsonl, one per round ([] without the file)."""
  path = os.path.join(run.get('dir', ''), 'measurements.jsonl')
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f]


def self_relation_table(section: dict, runs: dict) -> list[str]:
  """Lines of a table: per run of a KAPC row ('KAPC…') with measurements, mean r_ii per
  layer, first → last round (whether R learns; local training's fixed R = I is left out)."""
  out = []
  for group in section['groups']:
    for row in group['runs']:
      if not row.startswith('KAPC'):
        continue
      for run in _group_runs(group, runs, row)[0]:
        measured = self_relations(run)
        if not measured:
          continue
        (first, start), (last, end) = measured[0], measured[-1]
        if not out:
          out += ["KAPC's self-relationships r_ii (mean over clients), per layer from the first "
                  'to the last measured round (runs with measurements.jsonl):', '',
                  '| run | rounds | r_ii per layer, first → last |', '|---|---|---|']
        layers = ', '.join(f'{a:.3f} → {b:.3f}' for a, b in zip(start, end))
        out.append(f'| {run["label"]} | {first}–{last} | {layers} |')
  return out + [''] if out else []


# -- FedLap: per-seed gaps against the claims ---------------------------------------------------

def gap_statistics(run: dict, base: dict, first_rounds: int,
                   key: str = TEST) -> dict[str, Optional[tuple]]:
  """In points (100 × accuracy), over the rounds both runs evaluated:

  'mean_first': mean of (run − base) over rounds 1..first_rounds (None unless both reached it);
  'max': (largest per-round gap, its round); 'final': the gap at the last common round.
  """
  a, b = dict(curve(run, key)), dict(curve(base, key))
  common = sorted(set(a) & set(b))
  diffs = [(r, 100 * (a[r] - b[r])) for r in common]
  first = [d for r, d in diffs if r <= first_rounds]
  reached = bool(common) and common[-1] >= first_rounds
  return {'mean_first': (sum(first) / len(first),) if first and reached else None,
          'max': max(diffs, key=lambda p: p[1])[::-1] if diffs else None,
          'final': (diffs[-1][1], diffs[-1][0]) if diffs else None}


def _seed_pairs(group: dict, runs: dict, a: str, b: str):
  """[(seed, run a, run b)] for the seeds both have, and the seeds either lacks."""
  first = {seed_of(n): runs.get(n) for n in _as_list(group['runs'][a])}
  second = {seed_of(n): runs.get(n) for n in _as_list(group['runs'][b])}
  # A run without a seed suffix is seed 0: it pairs with the other seed-0 run.
  pairs, missing = [], []
  for seed in sorted(set(first) | set(second)):
    if first.get(seed) and second.get(seed):
      pairs.append((seed, first[seed], second[seed]))
    else:
      missing.append(seed)
  return pairs, missing


GAP_STATISTICS = (
    ('mean_first', 'mean gap, rounds 1–{k} (declared)'),
    ('max', 'largest per-round gap (declared)'),
    ('final', 'gap at the last round (descriptive)'),
)


def claim_gaps(section: dict, runs: dict, paper: dict, report=None) -> str:
  """FedLap: per-run accuracy, then per comparison and seed the declared gap statistics."""
  k = section['first_rounds']
  target = section.get('rounds_to')
  claims = _claims(paper, section.get('paper'))
  head = (f'| setting | method | seeds present | acc@{k} % | mean acc rounds 1–{k} % | best % | '
          'final % |' + (f' rounds to {100 * target:g} % |' if target else '') + ' runs missing |')
  out = [head, '|' + '---|' * (head.count('|') - 1)]
  gaps = ['| setting | comparison | statistic | per seed (points) | mean ± std over seeds | '
          'paper |', '|---|---|---|---|---|---|']
  for group in section['groups']:
    for name in group['runs']:
      present, missing = _group_runs(group, runs, name)
      if not present:
        out.append(f'| {group["label"]} | {name} | {NOT_RUN} | ' +
                   ' | '.join([NOT_RUN] * (5 if target else 4)) + f' | {_missing_cell(missing)} |')
        continue
      seeds = _present_cell(present)
      ms = lambda fn: _pm([100 * v for v in (fn(r) for r in present) if v is not None])
      cells = [ms(lambda r: accuracy_at(r, k)), ms(lambda r: mean_until(r, k)),
               ms(lambda r: (_best(r) or (None, None))[1]), ms(_final)]
      if target:
        cells.append(', '.join(
            f'{seed_of(r["label"])} ' + (str(rounds_to(r, target)) if rounds_to(r, target)
                                          else f'> {rounds_done(r)}') for r in present))
      out.append(f'| {group["label"]} | {name} | {seeds} | ' + ' | '.join(cells) +
                 f' | {_missing_cell(missing)} |')
    for a, b, claim_ids in group['comparisons']:
      pairs, missing = _seed_pairs(group, runs, a, b)
      for stat, label in GAP_STATISTICS:
        text = '; '.join(f'{claims[c].get("short", claims[c]["text"])} [{c}]' for c in claim_ids
                         if c in claims and claims[c].get('statistic') == stat) or DASH
        if not pairs:
          gaps.append(f'| {group["label"]} | {a} − {b} | {label.format(k=k)} | {NOT_RUN} | '
                      f'{NOT_RUN} | {text} |')
          continue
        values, seeds = [], []
        for seed, ra, rb in pairs:
          got = gap_statistics(ra, rb, k)[stat]
          if got is None:
            seeds.append(f'{seed} {DASH}')
            continue
          values.append(got[0])
          seeds.append(f'{seed} {got[0]:+.2f}' + (f' (r{got[1]})' if len(got) > 1 and
                                                    stat == 'max' else ''))
        if missing:
          seeds.append('not run: ' + ', '.join(missing))
        spread = _pm(values, signed=True)
        gaps.append(f'| {group["label"]} | {a} − {b} | {label.format(k=k)} | '
                    f'{", ".join(seeds)} | {spread} | {text} |')
  lines = out + [''] + gaps
  used = {c for group in section['groups'] for _, _, ids in group['comparisons'] for c in ids}
  listed = [c for c in claims.values() if c['id'] in used or c.get('statistic') == 'rounds_to']
  if listed:
    lines += ['', 'The claims (our words):'] + [
        f'- [{c["id"]}] {c["text"]} ({c["source"]})' +
        (f'; ours: the rounds-to-{100 * target:g} % column above' if c.get('statistic') ==
         'rounds_to' else '') for c in listed]
  for text in section.get('notes', []):
    lines += ['', text]
  return '\n'.join(lines)


# -- FedLayerWise Table I: rounds to target ------------------------------------------------------

def _reduction(ours: Optional[int], ours_done: int, base: Optional[int], base_done: int) -> str:
  """Fewer rounds than `base`, in % of base; a bound where a run never reached the target."""
  if ours is not None and base is not None:
    return f'{100 * (base - ours) / base:+.1f} %'
  if ours is not None:  # base needs at least base_done + 1 rounds
    return f'≥ {100 * (base_done + 1 - ours) / (base_done + 1):+.1f} %'
  if base is not None:  # ours needs at least ours_done + 1 rounds
    return f'≤ {100 * (base - ours_done - 1) / base:+.1f} %'
  return 'neither reached'


def rounds_to_target(section: dict, runs: dict, paper: dict, report=None) -> str:
  """Per group: paper rounds to its target beside ours to each of our targets; reductions."""
  table = paper[section['paper']]['table_I']
  out = []
  for group in section['groups']:
    targets = group.get('targets', section['targets'])
    paper_rounds = table['rounds'].get(group.get('paper_key'), {})
    tcols = ' | '.join(f'ours: rounds to {100 * t:g} %' for t in targets)
    out += [f'### {group["label"]}', '',
            f'| method | paper: rounds to {100 * table["target"]:g} % on {table["dataset"]} '
            f'({table["source"]}) | {tcols} | best % (round) | rounds run | runs missing |',
            '|---|---|' + '---|' * len(targets) + '---|---|---|']
    first = {}
    for name in group['runs']:
      present, missing = _group_runs(group, runs, name)
      paper_cell = str(paper_rounds.get(name, DASH))
      if not present:
        out.append(f'| {name} | {paper_cell} | ' + ' | '.join([NOT_RUN] * (len(targets) + 2)) +
                   f' | {_missing_cell(missing)} |')
        continue
      first[name] = present
      cells = []
      for t in targets:
        cells.append(', '.join(
            (f'{seed_of(r["label"])} ' if len(present) > 1 else '') +
            (str(rounds_to(r, t)) if rounds_to(r, t) else f'> {rounds_done(r)}')
            for r in present))
      best = ', '.join(f'{_pct(b[1])} ({b[0]})' for b in (_best(r) for r in present) if b)
      out.append(f'| {name} | {paper_cell} | ' + ' | '.join(cells) +
                 f' | {best or DASH} | {", ".join(str(rounds_done(r)) for r in present)} | '
                 f'{_missing_cell(missing)} |')
    out.append('')
    if group.get('note'):
      out += [group['note'], '']
    comparisons = section['comparisons']
    out += ['Fewer rounds than the baseline, in % of its rounds (positive = faster); the paper\'s '
            f'from {table["source"]} ({100 * table["target"]:g} % on {table["dataset"]}).', '',
            '| target | ' + ' | '.join(f'{m} vs {b}: ours | paper' for m, b in comparisons) + ' |',
            '|---|' + '---|---|' * len(comparisons)]
    for t in targets:
      cells = []
      for m, b in comparisons:
        p_m, p_b = paper_rounds.get(m), paper_rounds.get(b)
        paper_cell = (f'{100 * (p_b - p_m) / p_b:+.1f} % ({p_b} → {p_m})'
                      if p_m is not None and p_b is not None else DASH)
        if m not in first or b not in first:
          ours = NOT_RUN
        else:
          pairs = _seed_pairs(group, runs, m, b)[0]
          ours = ', '.join(
              (f'{s} ' if len(pairs) > 1 else '') +
              _reduction(rounds_to(rm, t), rounds_done(rm), rounds_to(rb, t), rounds_done(rb))
              for s, rm, rb in pairs) or DASH
        cells += [ours, paper_cell]
      out.append(f'| {100 * t:g} % | ' + ' | '.join(cells) + ' |')
    out.append('')
  claims = list(_claims(paper, section.get('paper')).values()) + list(
      _claims(paper, section.get('also_paper')).values())
  if claims:
    out += ['What the papers say (our words):'] + [f'- {c["text"]} ({c["source"]})'
                                                   for c in claims] + ['']
  for text in section.get('notes', []):
    out += [text, '']
  return '\n'.join(out)


# -- CCN: original vs normalised per temperature, and the contribution factors -------------------

def ccn_measurements(run: dict) -> Optional[list[dict]]:
  """Per round {'contribution': Λ, 'weight': ω} from the run's measurements.jsonl, or None.

  The keys are matched on their last part ('…/contribution', '…/weight'), as
  fltff.aggregators.contribution_normalization measures them.
  """
  rounds = []
  for record in measurement_records(run):
    found = {}
    for key, value in record.items():
      last = key.rsplit('/', 1)[-1]
      if last in ('contribution', 'weight') and isinstance(value, list):
        found[last] = [float(v) for v in value]
    if 'contribution' in found and 'weight' in found:
      rounds.append(found)
  return rounds or None


def weight_shift(contribution: list[float], weight: list[float]) -> Optional[dict]:
  """What CCN did to one round's aggregation weights.

  ω_r = Λ_r ν_r / Σ Λ_q ν_q, so the base scheme's normalised weights are p_r ∝ ω_r / Λ_r.
  Returns p, the total weight moved (½ Σ |ω − p|), the range of ω_r / p_r, and the bound
  p_max (1 − p_min) / (1 − p_max) on the weight moved (= 1/N with equal base weights).
  None when some Λ_r is 0 (one participant: CCN kept the base weights).
  """
  if any(c <= 0 for c in contribution):
    return None
  raw = [w / c for w, c in zip(weight, contribution)]
  total = sum(raw)
  if total <= 0:
    return None
  p = [x / total for x in raw]
  ratio = [w / q for w, q in zip(weight, p) if q > 0]
  p_max, p_min = max(p), min(p)
  return {'p': p, 'moved': 0.5 * sum(abs(w - q) for w, q in zip(weight, p)),
          'ratio': (min(ratio), max(ratio)),
          'bound': p_max * (1 - p_min) / (1 - p_max) if p_max < 1 else 1.0}


def _spread_row(scheme: str, label: str, run: Optional[dict]) -> str:
  if run is None:
    return f'| {scheme} | {label} | {NOT_RUN} |' + f' {DASH} |' * 5
  rounds = ccn_measurements(run)
  if not rounds:
    return (f'| {scheme} | {label} | not recorded (no measurements.jsonl with contribution and '
            'weight in the run folder) |' + f' {DASH} |' * 5)
  lam = [v for r in rounds for v in r['contribution']]
  spreads = [max(r['contribution']) - min(r['contribution']) for r in rounds]
  shifts = [s for s in (weight_shift(r['contribution'], r['weight']) for r in rounds) if s]
  moved = [s['moved'] for s in shifts]
  left_out = len(rounds) - len(shifts)  # a Λ_r of 0 hides that client's base weight
  return (f'| {scheme} | {label} | {len(rounds)} rounds, {len(rounds[0]["contribution"])} '
          f'clients in round 1' + (f' ({left_out} rounds with a Λ_r = 0 left out of the weight '
                                   'columns)' if left_out else '') +
          f' | {min(lam):.4f} – {max(lam):.4f} | '
          f'{sum(spreads) / len(spreads):.4f} (max {max(spreads):.4f}) | ' +
          (f'{min(s["ratio"][0] for s in shifts):.4f} – {max(s["ratio"][1] for s in shifts):.4f} | '
           f'{100 * sum(moved) / len(moved):.3f} / {100 * max(moved):.3f} | '
           f'{100 * max(s["bound"] for s in shifts):.3f} |' if shifts else f' {DASH} |' * 3))


def pairs(section: dict, runs: dict, paper: dict, report: types.ModuleType) -> str:
  """Per scheme: the original and each normalised variant (gain in points, best and final)."""
  original = section.get('original', 'original')
  entry = paper.get(section.get('paper', ''), {})
  out = ['| scheme | variant | runs present | best % | final % | gain, best (points) | '
         'gain, final (points) | runs missing |', '|---|---|---|---|---|---|---|---|']
  gains = {}
  for group in section['groups']:
    base, _ = _group_runs(group, runs, original)
    base_by_seed = {seed_of(r['label']): r for r in base}
    for variant in group['runs']:
      present, missing = _group_runs(group, runs, variant)
      if not present:
        out.append(f'| {group["label"]} | {variant} | {NOT_RUN} |' + f' {NOT_RUN} |' * 4 +
                   f' {_missing_cell(missing)} |')
        continue
      best = [(_best(r) or (None, None))[1] for r in present]
      final = [_final(r) for r in present]
      gain_best, gain_final = [], []
      if variant != original:
        for r in present:
          b = base_by_seed.get(seed_of(r['label']))
          if b is None:
            continue
          if _best(r) and _best(b):
            gain_best.append(100 * (_best(r)[1] - _best(b)[1]))
          if _final(r) is not None and _final(b) is not None:
            gain_final.append(100 * (_final(r) - _final(b)))
        gains.setdefault(group['label'], {})[variant] = (gain_best, gain_final)
      is_base = variant == original
      out.append(f'| {group["label"]} | {variant} | '
                 f'{_present_cell(present)} | '
                 f'{_pm([100 * v for v in best if v is not None])} | '
                 f'{_pm([100 * v for v in final if v is not None])} | '
                 f'{DASH if is_base else _pm(gain_best, signed=True)} | '
                 f'{DASH if is_base else _pm(gain_final, signed=True)} | '
                 f'{_missing_cell(missing)} |')
  text = out
  tables = entry.get('tables', {})
  if tables:
    columns = [(t, col) for t, spec in tables.items() for col in spec['columns']]
    variants = [v for v in section['groups'][0]['runs'] if v != original] if section[
        'groups'] else []
    text += ['', 'Gain Normalized − Original in points: the paper (computed from its tables; '
             'no Fashion-MNIST there) beside ours (best round; mean over the seeds present).', '',
             '| scheme | ' + ' | '.join(f'{tables[t]["dataset"]} {col} ({t})'
                                       for t, col in columns) +
             ' | ' + ' | '.join(f'ours {v}' for v in variants) + ' |',
             '|---|' + '---|' * (len(columns) + len(variants))]
    notes = []
    for group in section['groups']:
      cells = []
      for t, col in columns:
        c = tables[t]['columns'][col].get(group.get('paper_row', group['label']))
        if c is None:
          cells.append(DASH)
          continue
        gain = c['normalized'] - c['original']
        cell = f'{gain:+.2f}'
        printed = c.get('gain_printed')
        if printed is not None and abs(printed - gain) > 0.005:
          notes.append(f'[{len(notes) + 1}] {t}, {col}, {group["label"]}: the paper prints '
                       f'{printed:.2f} in brackets; its own Original and Normalized give '
                       f'{gain:.2f}.')
          cell += f' [{len(notes)}]'
        cells.append(cell)
      ours = []
      for v in variants:
        g = gains.get(group['label'], {}).get(v, ([], []))[0]
        ours.append(DASH if not g else f'{sum(g) / len(g):+.2f}')
      text.append(f'| {group["label"]} | ' + ' | '.join(cells + ours) + ' |')
    ranges = []
    for t, spec in tables.items():
      all_gains = [c['normalized'] - c['original'] for col in spec['columns'].values()
                   for c in col.values()]
      ranges.append(f'{spec["dataset"]} ({t}) {min(all_gains):.2f} to {max(all_gains):.2f}')
    text += [''] + notes + ([''] if notes else []) + [
        'Range of the paper\'s gains: ' + '; '.join(ranges) + '.']
  # The contribution factors Λ and how much weight CCN moved.
  text += ['', '#### Contribution factors Λ and the weight CCN moves', '',
           '| scheme | variant | Λ recorded | Λ range (all rounds, clients) | mean per-round '
           'spread max − min | ω_r / p_r range | weight moved per round, mean / max (%) | '
           'bound on the weight moved (%) |', '|---|---|---|---|---|---|---|---|']
  for group in section['groups']:
    for variant in group['runs']:
      if variant == original:
        continue
      present, _ = _group_runs(group, runs, variant)
      for run in present or [None]:
        label = variant + (f' {seed_of(run["label"])}' if run and len(present) > 1 else '')
        text.append(_spread_row(group['label'], label, run))
  for note in section.get('notes', []):
    text += ['', note]
  return '\n'.join(text)


# -- settings whose data are not reachable here -------------------------------------------------

def _kapc_cells(entry: dict, table: str, dataset: str) -> str:
  columns = entry['values'][table][dataset]
  return '; '.join(f'α = {a}: ' + ', '.join(f'{m} {v[0]:.2f}' for m, v in cells.items())
                   for a, cells in columns.items())


def _ccn_cells(spec: dict) -> str:
  return '; '.join(f'{col}: ' + ', '.join(
      f'{m} {c["original"]:.2f} → {c["normalized"]:.2f}' for m, c in cells.items())
                   for col, cells in spec['columns'].items())


def out_of_reach(section: dict, runs: dict, paper: dict, report=None,
                 repo_root: Optional[str] = None) -> str:
  """Per setting: its configs here (glob, with the count that exists) and the paper numbers."""
  root = repo_root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = ['| setting | data (not here) | our configs | paper numbers it would compare with |',
         '|---|---|---|---|']
  for item in section['entries']:
    found = sorted(os.path.relpath(p, root) for pattern in item['configs']
                   for p in glob.glob(os.path.join(root, pattern)))
    configs = (', '.join(f'`{p}`' for p in item['configs']) +
               f' ({len(found)} files)' if found else
               ', '.join(f'`{p}`' for p in item['configs']) + ' (none here)')
    numbers = []
    entry = paper.get(item.get('paper', ''), {})
    for ref in item.get('numbers', []):
      kind = ref['kind']
      if kind == 'kapc_table':
        numbers.append(f'{ref["table"]} {ref["dataset"]}: {_kapc_cells(entry, ref["table"], ref["dataset"])}')
      elif kind == 'ccn_table':
        spec = entry['tables'][ref['table']]
        numbers.append(f'{ref["table"]} ({spec["dataset"]}, original → normalised): '
                       f'{_ccn_cells(spec)}')
      elif kind == 'rounds_table':
        t = entry['table_I']
        numbers.append(f'{t["source"]} (rounds to {100 * t["target"]:g} %): ' + '; '.join(
            f'{s}: ' + ', '.join(f'{m} {r}' for m, r in v.items()) for s, v in t['rounds'].items()))
      elif kind == 'claim':
        c = _claims(paper, item['paper'])[ref['id']]
        numbers.append(f'{c["text"]} ({c["source"]})')
      elif kind == 'system':
        numbers.append(entry['system'][ref['key']]['summary'])
    out.append(f'| {item["setting"]} | {item["data"]} | {configs} | '
               f'{"<br>".join(numbers) or DASH} |')
  for text in section.get('notes', []):
    out += ['', text]
  return '\n'.join(out)


# -- Why KAPC trails: one factor at a time against the paper-settings base ---------------------

SELF_RELATION = 'kapc/self_relation_mean'


def _runs_cell(names: list[str]) -> str:
  """`stem_s{0,1,2}` for names that differ only in their seed suffix, else the names."""
  stems = {re.sub(r'_s\d+$', '', n) for n in names}
  if len(stems) == 1 and all(seed_key(n) for n in names):
    return f'{stems.pop()}_s{{{",".join(seed_key(n)[1:] for n in names)}}}'
  return ', '.join(names)


def _final_of(run: dict, bls_column: str) -> Optional[float]:
  """BLS's column at the last round: `bls/<column>`, or `kapc/<column>` in runs logged before
  BLS's measurements had a group of their own."""
  return next((v for v in (_final(run, f'{group}/{bls_column}') for group in ('bls', 'kapc'))
               if v is not None), None)


def _layers_without_bls(run: dict) -> Optional[int]:
  """For a run of KAPC without BLS (summary.json's method 'kapc'), which uploads every layer
  (Ω = L) and skips none by the method and logs neither: L, as many as its
  `kapc/self_relation_layer_<l>` columns (0 if it logs none). None for any other run."""
  if run['summary'].get('method') != 'kapc':
    return None
  return len({k for row in run['rows'] for k in row if k.startswith('kapc/self_relation_layer_')})


def ablation_point(group: dict, runs: dict, column: str, last_rounds: int = 1) -> dict:
  """Per seed of one ablation entry: best-round mean, the mean over the last `last_rounds`
  rounds, r_ii last and max (the mean over clients and layers), the largest r_ii of any client,
  layer and round, Ω and the skipped-layer fraction at the last round as BLS logs them, L for
  KAPC without BLS (`_layers_without_bls`) ({seed: {...}}), and the names missing."""
  present, missing = _group_runs(group, runs, next(iter(group['runs'])))
  per_seed = {}
  for run in present:
    best = _best(run, column)
    rii = [a for _, a in curve(run, SELF_RELATION)]
    per_seed[seed_of(run['label'])] = {
        'best': best[1] if best else None, 'last': last_rounds_mean(run, column, last_rounds),
        'rii_last': rii[-1] if rii else None, 'rii_max': max(rii) if rii else None,
        'rii_peak': max((a for _, a in curve(run, 'kapc/self_relation_max')), default=None),
        'omega': _final_of(run, 'omega_mean'), 'skipped': _final_of(run, 'skipped_layer_fraction'),
        'all_layers': _layers_without_bls(run)}
  return {'seeds': per_seed, 'missing': missing, 'names': _as_list(group['runs'][next(iter(
      group['runs']))])}


def ablation_verdict(point: dict, base: dict, seeds: int) -> tuple[str, Optional[float]]:
  """(verdict, effect in points or None), the rule of the section's intro.

  'pending (k/3)' until the point has `seeds` finished seeds; 'pending base (k/3)' while its base
  has fewer; else the effect, the mean over the point's seeds of (point − base, same seed) in
  points: 'tested, no effect' when |effect| ≤ the sample std of the base's best-round means over
  its seeds, else the signed effect.
  """
  done = [s for s, v in point['seeds'].items() if v['best'] is not None]
  if len(done) < seeds:
    return f'pending ({len(done)}/{seeds})', None
  base_best = {s: v['best'] for s, v in base['seeds'].items() if v['best'] is not None}
  if len(base_best) < seeds or not set(done) <= set(base_best):
    return f'pending base ({len(base_best)}/{seeds})', None
  effect = mean_std([100 * (point['seeds'][s]['best'] - base_best[s]) for s in done])[0]
  threshold = mean_std([100 * v for v in base_best.values()])[1]
  if abs(effect) <= threshold:
    return 'tested, no effect', effect
  return f'{effect:+.2f} points', effect


def _paired(point: dict, base: dict, key: str) -> list[float]:
  """(point − base) in points for `key`, per seed both have."""
  out = []
  for s, v in point['seeds'].items():
    b = base['seeds'].get(s)
    if v[key] is not None and b and b[key] is not None:
      out.append(100 * (v[key] - b[key]))
  return out


def _ablation_cells(point: dict, base: Optional[dict]) -> list[str]:
  values = point['seeds'].values()
  got = lambda k: [v[k] for v in values if v[k] is not None]
  omega, skipped, layers = got('omega'), got('skipped'), got('all_layers')
  if values and len(layers) == len(values):  # KAPC without BLS: Ω = L, nothing skipped.
    bls = f'all {max(layers) or "L"}, none (no BLS)'
  else:
    bls = (f'{sum(omega) / len(omega):.2f}, {sum(skipped) / len(skipped):.2f}'
           if omega and skipped else DASH)
  return [_pm([100 * v for v in got('best')]),
          DASH if base is None else _pm(_paired(point, base, 'best'), signed=True),
          _pm([100 * v for v in got('last')]),
          DASH if base is None else _pm(_paired(point, base, 'last'), signed=True),
          _pm(got('rii_last'), digits=3), _pm(got('rii_max'), digits=3), bls]


def ablation_points(section: dict, runs: dict) -> tuple[dict, list[tuple[dict, dict, str]]]:
  """({base id: its point}, [(group, point, verdict)] for the declared points, in order)."""
  k = section.get('last_rounds', 1)
  bases = {g['id']: ablation_point(g, runs, g['column'], k) for g in section['groups']
           if g.get('role') == 'base'}
  columns = {g['id']: g['column'] for g in section['groups'] if g.get('role') == 'base'}
  out = []
  for group in section['groups']:
    if group.get('role') == 'base':
      continue
    point = ablation_point(group, runs, columns[group['base']], k)
    verdict, effect = ablation_verdict(point, bases[group['base']], section['seeds'])
    # A point read from KAPC's runs ("KAPC+BLS with Ω = L is KAPC") holds only while no client's
    # r_ii in those runs exceeds BLS's μ (there Algorithm 3 would have skipped a layer): a run
    # above μ, or one that does not log r_ii, voids its finished verdict.
    mu = group.get('equal_while_self_relation_at_most')
    peaks = [v['rii_peak'] for v in point['seeds'].values()]
    if mu is not None and not verdict.startswith('pending') and (
        None in peaks or max(peaks) > mu):
      verdict, effect = ('void: a run does not log kapc/self_relation_max' if None in peaks else
                         f'void: a client\'s r_ii reached {max(peaks):.2f} > μ = {mu:g}'), None
    point['effect'] = effect
    out.append((group, point, verdict))
  return bases, out


def ablation(section: dict, runs: dict, paper: dict, report=None) -> str:
  """The declared ablation points beside their base: one row per point, finished or not."""
  seeds = section['seeds']
  bases, points = ablation_points(section, runs)
  k = section.get('last_rounds', 1)
  last = 'final-round mean' if k == 1 else f'mean over the last {k} rounds'
  out = ['| suspect | setting | runs | seeds finished | best-round mean % | − base, same seeds '
         f'(points) | {last} % | − base, {last}, same seeds (points) | r_ii, last round | r_ii, '
         'max over rounds | Ω mean, skipped-layer fraction (last round) | verdict |',
         '|' + '---|' * 12]
  for group in section['groups']:
    if group.get('role') != 'base':
      continue
    point = bases[group['id']]
    std = mean_std([100 * v['best'] for v in point['seeds'].values() if v['best'] is not None])[1]
    out.append(f'| base | {group["label"]} | {_runs_cell(point["names"])} | '
               f'{len(point["seeds"])}/{seeds} | ' + ' | '.join(_ablation_cells(point, None)) +
               ' | ' + ('seed std ' + f'{std:.2f}' if std is not None else 'seed std –') + ' |')
  for group, point, verdict in points:
    out.append(f'| {group["suspect"]} | {group["label"]} | {_runs_cell(point["names"])} | '
               f'{len(point["seeds"])}/{seeds} | ' +
               ' | '.join(_ablation_cells(point, bases[group['base']])) + f' | {verdict} |')
  for text in section.get('notes', []):
    out += ['', text]
  return '\n'.join(out)


def plot_ablation(section: dict, runs: dict, figures_dir: str) -> list[str]:
  """Two PNGs: r_ii per layer over rounds (one panel per base and point, mean over its seeds),
  and the best-round mean against each varied factor (points per seed, mean ± std). Points
  without runs are drawn as 'pending'. Returns the file names written."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  bases, points = ablation_points(section, runs)
  columns = {g['id']: g['column'] for g in section['groups'] if g.get('role') == 'base'}
  seeds = section['seeds']
  written = []
  # r_ii per layer: every entry with an R (FedProx has none).
  panels = [(g['label'], g) for g in section['groups']
            if columns.get(g.get('id', g.get('base'))) == 'personal_local_accuracy']
  cols = 4
  rows = -(-len(panels) // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False)
  for i, (label, group) in enumerate(panels):
    ax = axes[i // cols][i % cols]
    present = _group_runs(group, runs, next(iter(group['runs'])))[0]
    title = (('base: ' if group.get('role') == 'base' else '') + label)
    ax.set_title(f'{title[:48]} (n={len(present)}/{seeds})', fontsize=7)
    layers = sorted({k for r in present for row in r['rows'] for k in row
                     if k.startswith('kapc/self_relation_layer_')},
                    key=lambda k: int(k.rsplit('_', 1)[1]))
    for key in layers:
      x, mean, lo, hi = band(present, lambda r, key=key: key)
      if x:
        line, = ax.plot(x, mean, linewidth=1.0, label=f'layer {key.rsplit("_", 1)[1]}')
        if len(present) > 1:
          ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.15, linewidth=0)
    if not layers:
      ax.text(0.5, 0.5, f'pending ({len(present)}/{seeds})', ha='center', va='center',
              transform=ax.transAxes, fontsize=9, color='0.4')
    else:
      ax.legend(fontsize=5)
    ax.grid(alpha=0.3)
    ax.tick_params(labelsize=6)
    if i % cols == 0:
      ax.set_ylabel('r_ii, mean over clients', fontsize=7)
    if i // cols == rows - 1:
      ax.set_xlabel('round', fontsize=7)
  written.append(_save_panels(fig, axes, len(panels), figures_dir,
                              f'{section["id"]}_self_relation.png'))
  # Accuracy against each varied factor: the base's tick, then the points' ticks.
  factors = {}
  labels = {g['id']: g['label'] for g in section['groups'] if g.get('role') == 'base'}
  for group, point, verdict in points:
    entries = factors.setdefault(group['factor'], [])
    if not any(e[0] == group['base_tick'] for e in entries):
      entries.append((group['base_tick'], bases[group['base']], labels[group['base']]))
    entries.append((group['tick'] + (' (void)' if verdict.startswith('void') else ''), point,
                    group['label']))
  cols = 4
  rows = -(-len(factors) // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
  for i, (factor, entries) in enumerate(factors.items()):
    ax = axes[i // cols][i % cols]
    for x, (tick, point, _) in enumerate(entries):
      values = [100 * v['best'] for v in point['seeds'].values() if v['best'] is not None]
      if not values:
        ax.annotate('pending', (x, 0.5), xycoords=('data', 'axes fraction'), ha='center',
                    fontsize=7, color='0.4', rotation=90)
        continue
      ax.scatter([x + 0.08 * (j - (len(values) - 1) / 2) for j in range(len(values))], values,
                 s=10, color='C0', alpha=0.6, zorder=3)
      mean, std, n = mean_std(values)
      ax.errorbar([x + 0.3], [mean], yerr=[std or 0.0], fmt='s', color='C3', markersize=4,
                  capsize=3, zorder=4)
      ax.annotate(f'n={n}/{seeds}', (x, mean), textcoords='offset points', xytext=(8, -10),
                  fontsize=5, color='0.3')
    ax.set_xticks(range(len(entries)))
    ax.set_xticklabels([e[0] for e in entries], fontsize=6, rotation=15, ha='right')
    ax.set_xlim(-0.6, len(entries) - 0.2)
    ax.set_title(factor, fontsize=8)
    ax.grid(alpha=0.3, axis='y')
    ax.tick_params(axis='y', labelsize=6)
    if i % cols == 0:
      ax.set_ylabel('best-round mean %', fontsize=7)
  written.append(_save_panels(fig, axes, len(factors), figures_dir,
                              f'{section["id"]}_factors.png'))
  return written


def _save_panels(fig, axes, used: int, figures_dir: str, name: str) -> str:
  """Hides the grid's unused panels, saves the figure as `name` and closes it."""
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  cols = len(axes[0])
  for j in range(used, len(axes) * cols):
    axes[j // cols][j % cols].axis('off')
  fig.tight_layout()
  fig.savefig(os.path.join(figures_dir, name), dpi=90)
  plt.close(fig)
  return name


KINDS = {'paper_table': paper_table, 'claim_gaps': claim_gaps,
         'rounds_to_target': rounds_to_target, 'pairs': pairs, 'out_of_reach': out_of_reach,
         'ablation': ablation}


# -- the five-minute summary (docs/reproduction.md) ---------------------------------------------

def within(values: list[float], low: float, high: float) -> bool:
  """Whether ours (mean ± sample std; the mean alone with one value) overlaps [low, high]."""
  mean, std, _ = mean_std(values)
  std = std or 0.0
  return mean is not None and mean - std <= high and mean + std >= low


def _interval(claim: dict, override: Optional[list]) -> Optional[tuple[float, float]]:
  low, high = override if override else (claim.get('low_points'), claim.get('high_points'))
  if low is None and high is None:
    return None
  return (-math.inf if low is None else low, math.inf if high is None else high)


def _fedlap_summary(section: dict, runs: dict, paper: dict) -> tuple[list[str], list[str]]:
  claims = _claims(paper, section.get('paper'))
  groups = {g['label']: g for g in section['groups']}
  spec = section.get('summary', {})
  rows, found = [], {}
  for label, a, b, claim_id in spec.get('rows', []):
    claim = claims[claim_id]
    pairs_, missing = _seed_pairs(groups[label], runs, a, b)
    values = [v[0] for v in (gap_statistics(ra, rb, section['first_rounds'])[claim['statistic']]
                             for _, ra, rb in pairs_) if v is not None]
    found[(label, a, b, claim_id)] = values
    interval = _interval(claim, spec.get('intervals', {}).get(claim_id))
    verdict = ('not run' if not values else 'within spread' if interval and within(
        values, *interval) else 'untested')
    stat = dict(GAP_STATISTICS)[claim['statistic']].format(k=section['first_rounds'])
    rows.append(f'| {a} − {b}, {label}: {stat} | {claim.get("short", claim["text"])} | '
                f'{_pm(values, signed=True)} | {verdict} |')
  table = ['| claim | paper (points) | ours (points, mean ± std over seeds) | verdict |',
           '|---|---|---|---|'] + rows
  # FedProx − FedAvg over the μ grid: the thesis calls FedProx slower.
  slower = []
  for label, group in groups.items():
    for a, b, ids in group['comparisons']:
      if 'fedprox_slower' in ids and b == 'fedavg':
        values = [v[0] for v in (gap_statistics(ra, rb, section['first_rounds'])['mean_first']
                                 for _, ra, rb in _seed_pairs(group, runs, a, b)[0]) if v]
        if values and mean_std(values)[0] < 0:
          slower.append(f'{a} ({label}, {_pm(values, signed=True)})')
  lead = [b for (_, a, b, c), v in found.items() if claims[c]['statistic'] == 'mean_first' and
          b.startswith('fedprox') and v and _interval(claims[c], None) and
          within(v, *_interval(claims[c], None))]
  findings = [
      'FedProx − FedAvg over rounds 1–20 is negative, the thesis\'s "FedProx converges more '
      'slowly", only for ' + (', '.join(slower) or 'no FedProx run') + '.',
      'The claimed 3–5-point lead of FedLap over FedProx in the first 20 rounds is within our '
      'spread for ' + (', '.join(lead) or 'no μ of the grid') + '.']
  return table, findings


def _kapc_summary(section: dict, why: Optional[dict], runs: dict, paper: dict,
                  report: types.ModuleType) -> tuple[list[str], list[str]]:
  entry = paper[section['paper']]
  bases, points = ablation_points(why, runs) if why else ({}, [])
  base_rows = {(g['row']['table'], g['row']['alpha'], g['row']['paper_row']): g['id']
               for g in (why or {}).get('groups', []) if g.get('row')}
  rows, rank_cells = [], []
  for group in section['groups']:
    cells = entry['values'][group['table']][group['dataset']][group['alpha']]
    rank = ranks(group, runs, report)
    column = f'{group["table"]}, α = {group["alpha"]}'
    for row, key in group['paper_rows'].items():
      if key not in ('kapc', 'kapc_bls') or row in group.get('unranked', ()):
        continue
      value = cells[key]
      values = _paper_row(group, runs, row, report)['values']
      base = base_rows.get((group['table'], group['alpha'], key))
      if not values:
        verdict = 'not run'
      elif within(values, value[0] - value[1], value[0] + value[1]):
        verdict = 'within spread'
      elif base is None:
        verdict = 'untested'
      else:
        mine = [(g, p, v) for g, p, v in points if g['base'] == base]
        done = [f'{g["label"]}: {v}' for g, p, v in mine if not v.startswith('pending')]
        verdict = (f'ablation: {len(done)} of {len(mine)} points with 3 seeds' +
                   (' (' + '; '.join(done) + ')' if done else '') +
                   (', the others pending' if len(done) < len(mine) else ''))
      rows.append(f'| {row}, {column} | {value[0]:.2f} ± {value[1]:.2f} | {_pm(values)} | '
                  f'{verdict} |')
      if key == 'kapc':
        rank_cells.append(f'{column}: {rank.get(row, DASH)} of {len(rank)}')
  rows.append('| KAPC has the best accuracy (§7.2): its rank by best-round mean | first or '
              f'second in every column | {"; ".join(rank_cells)} | untested |')
  table = ['| claim | paper % | ours % (mean ± std over seeds) | verdict |',
           '|---|---|---|---|'] + rows
  findings = []
  if why:
    done = [(g, p, v) for g, p, v in points if not v.startswith('pending')]
    started = []
    for g, p, v in points:
      base = bases[g['base']]['seeds']
      diff = [100 * (x['best'] - base[s]['best']) for s, x in p['seeds'].items()
              if s in base and x['best'] is not None and base[s]['best'] is not None]
      if v.startswith('pending') and diff:
        started.append(f'{g["label"]} {_pm(diff, signed=True)}')
    by_kind = {kind: [f'{g["label"]} ({v})' if kind == 'with an effect' else g['label']
                      for g, _, v in done if test(v)]
               for kind, test in (('with an effect', lambda v: v.endswith(' points')),
                                  ('tested, no effect', lambda v: v == 'tested, no effect'),
                                  ('void', lambda v: v.startswith('void')))}
    findings.append(
        f'Why KAPC trails (the results\' "Why KAPC trails" table): {len(done)} of {len(points)} '
        'declared points have their 3 seeds.' +
        ''.join(f' {kind.capitalize()}: {"; ".join(names)}.' for kind, names in by_kind.items()
                if names) +
        (' Still running (the point or its base), point − base in points over the seeds '
         'finished (not a verdict): ' +
         '; '.join(started) + '.' if started else ''))
    bls = bases.get('kapc_bls')
    if bls and bls['seeds']:
      omega = [v['omega'] for v in bls['seeds'].values() if v['omega'] is not None]
      skipped = [v['skipped'] for v in bls['seeds'].values() if v['skipped'] is not None]
      if omega and skipped:
        findings.append(
            f'KAPC+BLS as printed (Algorithm 4, inequality (29)): at the last round a client '
            f'uploads {sum(omega) / len(omega):.2f} layers on average and the download skips '
            f'{100 * sum(skipped) / len(skipped):.0f} % of the layers (mean over '
            f'{len(omega)} seeds); the paper\'s Fig. 8 has most layers uploaded.')
  return table, findings


def _rtt_summary(section: dict, runs: dict, paper: dict) -> tuple[list[str], list[str]]:
  table_i = paper[section['paper']]['table_I']
  rows = []
  for group in section['groups']:
    if group.get('summary') is False:
      continue
    paper_rounds = table_i['rounds'].get(group.get('paper_key'), {})
    targets = group.get('targets', section['targets'])
    for m, b in section['comparisons']:
      if m != 'fedlayerwise':
        continue
      p_m, p_b = paper_rounds.get(m), paper_rounds.get(b)
      paper_cell = f'{100 * (p_b - p_m) / p_b:+.1f} %' if p_m and p_b else DASH
      pairs_ = _seed_pairs(group, runs, m, b)[0]
      ours = '; '.join(f'{100 * t:g} %: ' + ', '.join(
          _reduction(rounds_to(rm, t), rounds_done(rm), rounds_to(rb, t), rounds_done(rb))
          for _, rm, rb in pairs_) for t in targets) if pairs_ else NOT_RUN
      rows.append(f'| FedLayerWise needs fewer rounds than {b}, {group["label"]} | {paper_cell} '
                  f'({table_i["dataset"]}, {100 * table_i["target"]:g} %) | {ours} (n='
                  f'{len(pairs_)}) | untested |')
  return ['| claim | paper | ours (FMNIST, fewer rounds in %) | verdict |', '|---|---|---|---|'
          ] + rows, []


def _ccn_summary(section: dict, runs: dict, paper: dict) -> tuple[list[str], list[str]]:
  original = section.get('original', 'original')
  tables = paper[section['paper']]['tables']
  spec = tables[section.get('summary', {}).get('paper_table', 'Table I')]
  paper_gains = [c['normalized'] - c['original'] for col in spec['columns'].values()
                 for c in col.values()]
  low, high = min(paper_gains), max(paper_gains)
  variants = [v for v in section['groups'][0]['runs'] if v != original]
  rows, moved = [], []
  for variant in variants:
    gains = []
    for group in section['groups']:
      for _, rv, rb in _seed_pairs(group, runs, variant, original)[0]:
        if _best(rv) and _best(rb):
          gains.append(100 * (_best(rv)[1] - _best(rb)[1]))
      for run in _group_runs(group, runs, variant)[0]:
        for record in ccn_measurements(run) or []:
          shift = weight_shift(record['contribution'], record['weight'])
          if shift:
            moved.append(shift['moved'])
    ours = (f'{min(gains):+.2f} to {max(gains):+.2f} over {len(gains)} runs'
            if gains else NOT_RUN)
    verdict = ('not run' if not gains else 'within spread' if min(gains) <= high and
               max(gains) >= low else 'untested')
    rows.append(f'| CCN gain over the original (best round), {variant} | {low:+.2f} to '
                f'{high:+.2f} ({spec["dataset"]}, its six schemes) | {ours} | {verdict} |')
  findings = []
  if moved:
    findings.append(
        f'CCN moves little aggregation weight: {100 * sum(moved) / len(moved):.1f} % a round on '
        f'average, at most {100 * max(moved):.1f} % (rounds with Λ and ω recorded); with N '
        'participants of equal weight it cannot move 1/N or more (derived in the results).')
  return ['| claim | paper (points) | ours (points) | verdict |', '|---|---|---|---|'] + rows, \
      findings


def summary(results_dir: str, report: types.ModuleType) -> str:
  """The per-paper summary for docs/reproduction.md, from the same runs and manifest."""
  with open(os.path.join(results_dir, 'reproduction.json')) as f:
    manifest = json.load(f)
  with open(os.path.join(results_dir, 'paper_numbers.json')) as f:
    paper = json.load(f)
  runs = {n: _load(report, os.path.join(results_dir, 'runs'), n)
          for n in manifest_runs(results_dir)}
  by_kind = {}
  for section in manifest['sections']:
    by_kind.setdefault(section['kind'], section)
  out = ['Generated by `python -m pipelines.report --reproduction=results` from `results/` '
         '(do not edit between these markers). Verdict: "within spread" when our mean ± std '
         '(the mean alone for one seed) overlaps the paper\'s value ± its printed spread (or the '
         'claimed range); otherwise the cause our ablation tested, or "untested".', '']
  blocks = []
  if 'claim_gaps' in by_kind:
    blocks.append(('FedLap', _fedlap_summary(by_kind['claim_gaps'], runs, paper)))
  if 'rounds_to_target' in by_kind:
    blocks.append(('FedLayerWise', _rtt_summary(by_kind['rounds_to_target'], runs, paper)))
  if 'pairs' in by_kind:
    blocks.append(('CCN', _ccn_summary(by_kind['pairs'], runs, paper)))
  if 'paper_table' in by_kind:
    blocks.append(('KAPC', _kapc_summary(by_kind['paper_table'], by_kind.get('ablation'), runs,
                                         paper, report)))
  for title, (table, findings) in blocks:
    out += [f'### {title}', ''] + table + ['']
    out += [f'- {f}' for f in findings] + ([''] if findings else [])
  return '\n'.join(out)


DOCS_MARKERS = ('<!-- results:start -->', '<!-- results:end -->')


def write_docs_summary(results_dir: str, report: types.ModuleType) -> Optional[str]:
  """Replaces the generated block of `docs/reproduction.md` beside `results_dir` (between
  DOCS_MARKERS); returns the page's path, or None where there is no such page."""
  path = os.path.join(os.path.dirname(os.path.abspath(results_dir)), 'docs', 'reproduction.md')
  if not os.path.exists(path):
    return None
  with open(path) as f:
    text = f.read()
  start, end = DOCS_MARKERS
  if start not in text or end not in text:
    return None
  head, rest = text.split(start, 1)
  tail = rest.split(end, 1)[1]
  with open(path, 'w') as f:
    f.write(f'{head}{start}\n{summary(results_dir, report)}\n{end}{tail}')
  return path


# -- figures: mean over the seeds present with a min–max band ------------------------------------

def band(run_list: list[dict], key_of) -> tuple[list[int], list[float], list[float], list[float]]:
  """(rounds, mean, min, max) over `run_list` at the rounds every run evaluated; `key_of(run)`
  is the metrics.csv column of each run."""
  curves = [dict(curve(r, key_of(r))) for r in run_list]
  if not curves:
    return [], [], [], []
  rounds = sorted(set.intersection(*(set(c) for c in curves)))
  values = [[c[r] for c in curves] for r in rounds]
  return (rounds, [sum(v) / len(v) for v in values], [min(v) for v in values],
          [max(v) for v in values])


def _panel_key(section: dict, report: types.ModuleType):
  if section['kind'] == 'paper_table':
    return lambda r: headline(r, report, local=True)['column']
  return lambda r: TEST


def plot_section(section: dict, runs: dict, path: str, report: types.ModuleType) -> bool:
  """One panel per group, one curve per entry (mean over its seeds, min–max band when n > 1);
  False if no run of the section exists."""
  groups = [g for g in section.get('groups', [])
            if any(runs.get(n) for v in g['runs'].values() for n in _as_list(v))]
  if not groups:
    return False
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  cols = min(len(groups), 3)
  rows = -(-len(groups) // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(5.4 * cols, 4.0 * rows), squeeze=False)
  key_of = _panel_key(section, report)
  for i, group in enumerate(groups):
    ax = axes[i // cols][i % cols]
    if len(group['runs']) > 10:  # the default cycle repeats after 10 colours
      ax.set_prop_cycle(color=[plt.cm.tab20(j) for j in range(20)])
    for name, value in group['runs'].items():
      present = [runs[n] for n in _as_list(value) if runs.get(n)]
      if not present:
        continue
      x, mean, lo, hi = band(present, key_of)
      if not x:
        continue
      style = '--' if section['kind'] == 'pairs' and name != section.get('original',
                                                                          'original') else '-'
      line, = ax.plot(x, mean, style, linewidth=1.2, label=f'{name} (n={len(present)})')
      if len(present) > 1:
        ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.18, linewidth=0)
    ax.set_title(group['label'], fontsize=9)
    ax.set_xlabel('communication round')
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    if i % cols == 0:
      ax.set_ylabel(section.get('ylabel', 'central test accuracy'))
  for j in range(len(groups), rows * cols):
    axes[j // cols][j % cols].axis('off')
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)
  return True


# -- collecting and writing ---------------------------------------------------------------------

RUN_FILES = ('metrics.csv', 'summary.json', 'config.gin')


def _sections(results_dir: str) -> list[dict]:
  with open(os.path.join(results_dir, 'reproduction.json')) as f:
    return json.load(f)['sections']


def manifest_runs(results_dir: str) -> list[str]:
  """Every run name `reproduction.json` refers to, sorted."""
  names = set()
  for section in _sections(results_dir):
    for group in section.get('groups', []):
      for value in group['runs'].values():
        names.update(_as_list(value))
  return sorted(names)


def unshown_runs(results_dir: str) -> list[str]:
  """The runs the report leaves out, a line each: a run of `plan.txt` or `runs/` that
  `reproduction.json` names nowhere, and a seed (`<stem>_s<k>`) planned or present whose stem a
  row lists without it (a row written before that seed was planned)."""
  from .plan import read_plan  # pylint: disable=g-import-not-at-top (plan imports this module)
  plan_file = os.path.join(results_dir, 'plan.txt')
  runs_dir = os.path.join(results_dir, 'runs')
  known = dict.fromkeys([r.name for r in read_plan(plan_file)] if os.path.exists(plan_file)
                        else [])
  known.update(dict.fromkeys(sorted(n for n in os.listdir(runs_dir) if os.path.isdir(
      os.path.join(runs_dir, n)))) if os.path.isdir(runs_dir) else {})
  listed = set(manifest_runs(results_dir))
  lines = [f'{name} (planned or in runs/) is in no comparison of reproduction.json'
           for name in known if name not in listed]
  stem = lambda name: re.sub(r'_s\d+$', '', name)
  for section in _sections(results_dir):
    for group in section.get('groups', []):
      for row, value in group['runs'].items():
        names = _as_list(value)
        stems = {stem(n) for n in names}
        left = [n for n in known if seed_key(n) and stem(n) in stems and n not in names]
        if left:
          lines.append(f'{section["id"]}, {group.get("label", "")} row "{row}" lists '
                       f'{names[0] if len(names) == 1 else _runs_cell(names)} but not {", ".join(left)}')
  return lines


def extra_files(results_dir: str) -> dict[str, tuple[str, ...]]:
  """{run name: files beyond RUN_FILES its section asks `collect` to copy when present}."""
  out = {}
  for section in _sections(results_dir):
    extra = tuple(section.get('extra_files', ()))
    for group in section.get('groups', []):
      for value in group['runs'].values():
        for name in _as_list(value):
          out[name] = tuple(dict.fromkeys(out.get(name, ()) + extra))
  return out


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
  for; unfinished runs are reported (to `--resume` them) and not copied. Besides RUN_FILES, a
  section's `extra_files` (e.g. CCN's measurements.jsonl) are copied where the run has them.
  Returns {run name: 'copied' | 'in progress k/N' | 'absent'}.
  """
  status = {}
  extra = extra_files(results_dir)
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
    for file in RUN_FILES + extra.get(name, ()):
      if file in RUN_FILES or os.path.exists(os.path.join(src, file)):
        shutil.copyfile(os.path.join(src, file), os.path.join(dst, file))
    status[name] = 'copied'
  return status


def write(results_dir: str, report: types.ModuleType, repo_root: Optional[str] = None) -> str:
  """Writes `<results_dir>/reproduction.md` and figures; returns the Markdown.

  `report` is `pipelines.report` (its run loader and `local_key`), passed in because that
  module is usually `__main__` when this runs. `repo_root` is where the out-of-reach section
  looks for configs (default: this repository).
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
  parts += [p + '\n' for p in manifest.get('preamble', [])]
  for section in manifest['sections']:
    parts.append(f'## {section["title"]}\n')
    line = _paper_line(paper, section.get('paper'))
    if line:
      parts.append(line + '\n')
    for text in section.get('intro', []):
      parts.append(text + '\n')
    kind = KINDS[section['kind']]
    if section['kind'] == 'out_of_reach':
      parts.append(kind(section, runs, paper, report, repo_root=repo_root) + '\n')
    else:
      parts.append(kind(section, runs, paper, report) + '\n')
    if section['kind'] == 'ablation':
      for name in plot_ablation(section, runs, os.path.join(results_dir, 'figures')):
        parts.append(f'![{name[:-4]}](figures/{name})\n')
      parts.append('First figure: r_ii per layer, mean over the seeds present (band: their '
                   'min–max), one panel per base and point. Second: the best-round mean per '
                   'seed (dots) and mean ± std over seeds (square) against each varied factor; '
                   '"pending": no seed finished.\n')
      continue
    png = os.path.join(results_dir, 'figures', f'{section["id"]}.png')
    if section['kind'] != 'out_of_reach' and plot_section(section, runs, png,
                                                                          report):
      parts.append(f'![{section["id"]}](figures/{section["id"]}.png)\n\n'
                   f'Lines: mean over the seeds present (n in the legend); band: their min–max.'
                   '\n')
  md = '\n'.join(parts)
  with open(os.path.join(results_dir, 'reproduction.md'), 'w') as f:
    f.write(md)
  write_docs_summary(results_dir, report)
  return md
