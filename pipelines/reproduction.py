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
with the spread of the contribution factors) and `out_of_reach` (settings whose data are not
here, with their configs and the paper numbers they would compare with).
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

  The headline column under the other statistic, and each other accuracy column under both
  (best-round from metrics.csv, mean of client bests from summary.json where recorded).
  """
  out = {}
  summary = run.get('summary', {})
  for column, protocol in COLUMN_PROTOCOLS.items():
    best = _best(run, column)
    client_best = summary.get(f'mean_client_best_{column}')
    if best and not (column == head['column'] and head['statistic'] == 'best_round_mean'):
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

def paper_table(section: dict, runs: dict, paper: dict, report: types.ModuleType) -> str:
  """One table per group (paper table, dataset, α): paper value, ours, gap, seeds, readings."""
  entry = paper[section['paper']]
  out = []
  for group in section['groups']:
    source = group['table']
    cells = entry['values'][source][group['dataset']][group['alpha']]
    flags = {f['cell']: f['note'] for f in entry.get('flags', [])}
    out += [f'### {group["label"]}', '',
            f'| method | paper % ({source}) | ours % | our headline | gap (points) | '
            'seeds: mean ± std | per seed | other readings, % (mean over seeds) | runs missing |',
            '|---|---|---|---|---|---|---|---|---|']
    notes = []
    for row, names in group['runs'].items():
      paper_key = group['paper_rows'][row]
      value = cells.get(paper_key)
      flag = flags.get(f'{source}/{group["dataset"]}/{group["alpha"]}/{paper_key}')
      paper_cell = DASH if value is None else f'{value[0]:.2f} ± {value[1]:.2f}'
      if flag:
        paper_cell += f' [{len(notes) + 1}]'
        notes.append(f'[{len(notes) + 1}] {flag}')
      present, missing = _group_runs(group, runs, row)
      if not present:
        out.append(f'| {row} | {paper_cell} | ' + ' | '.join([NOT_RUN] * 6) +
                   f' | {_missing_cell(missing)} |')
        continue
      heads = [headline(r, report, local=True) for r in present]
      got = [(r, h) for r, h in zip(present, heads) if h['value'] is not None]
      # Earlier runs (no recorded headline) measured another quantity: beside recorded ones
      # they are listed, not averaged in, and counted as runs to redo.
      earlier = [r['label'] for r, h in got if not h['recorded']] if any(
          h['recorded'] for _, h in got) else []
      counted = [(r, h) for r, h in got if r['label'] not in earlier]
      values = [100 * h['value'] for _, h in counted]
      mean = mean_std(values)[0]
      ours = DASH if mean is None else f'{mean:.2f}'
      gap = DASH if mean is None or value is None else f'{mean - value[0]:+.2f}'
      spread = _pm(values)
      per_seed = ', '.join(
          f'{seed_of(r["label"])} {100 * h["value"]:.2f}'
          + (' (earlier run, not averaged)' if r['label'] in earlier else '') for r, h in got)
      other = {}
      for r, h in counted:
        for k, v in readings(r, h).items():
          other.setdefault(k, []).append(v)
      other_cell = '; '.join(f'{k} {100 * sum(v) / len(v):.2f}' for k, v in other.items())
      redo = missing + [f'{name} (earlier run)' for name in earlier]
      out.append(f'| {row} | {paper_cell} | {ours} | {_describe([h for _, h in counted])} | '
                 f'{gap} | {spread} | {per_seed or DASH} | {other_cell or DASH} | '
                 f'{_missing_cell(redo)} |')
    out.append('')
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


KINDS = {'paper_table': paper_table, 'claim_gaps': claim_gaps,
         'rounds_to_target': rounds_to_target, 'pairs': pairs, 'out_of_reach': out_of_reach}


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
    png = os.path.join(results_dir, 'figures', f'{section["id"]}.png')
    if section['kind'] != 'out_of_reach' and plot_section(section, runs, png,
                                                                          report):
      parts.append(f'![{section["id"]}](figures/{section["id"]}.png)\n\n'
                   f'Lines: mean over the seeds present (n in the legend); band: their min–max.'
                   '\n')
  md = '\n'.join(parts)
  with open(os.path.join(results_dir, 'reproduction.md'), 'w') as f:
    f.write(md)
  return md
