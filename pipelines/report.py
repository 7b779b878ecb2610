r"""Compares finished runs: tables (Markdown, CSV, LaTeX) and accuracy-by-round figures.

  fltff report --runs=runs/a,runs/b,runs/c [--out=runs/report] [--at_round=20] \
      [--targets=0.6,0.7,0.8]

(`python -m pipelines.report` in a checkout). Reads each run's metrics.csv, summary.json and
config.gin (written by `fltff run`); a folder `fltff sweep` wrote stands for its finished runs.
Runs whose config.gin differ only in seeds (and in what a resume may change: rounds,
checkpointing, runtime, data paths; a parameter one records at its default and another does
not is the same) and whose data are the same (summary.json's
`source_fingerprint`) form a group, named by its method and the settings that tell it from the
other groups of that method (`fedprox (mu=0.01)`, `fedavg (data=<its first 8 hex digits>)`).
Every table is one evaluation protocol (`central`, `personal_local`, ...; a run without that
protocol's reading is marked, never mixed in) at one round: `--at_round`, by default the last
round all runs evaluated (the report says which). Per protocol, a methods table (mean ± sample
std over each group's seeds, n) and a runs table. Writes `<out>/report.md`, `<out>/report.tex`
(booktabs), `<out>/<protocol>-methods.csv` and `<out>/<protocol>-runs.csv`, and
`<out>/accuracy.png` and `.pdf` (one panel per protocol, one colour per group in all panels,
seed bands).

  python -m pipelines.report --pairs --runs=runs/ccn/fedavg,runs/ccn/fedavg_ccn,...

With `--pairs` the runs are (original, normalised) pairs and the report adds the CCN paper's
"Original vs Normalised (gain)" table (best and final test accuracy, gain in points) first.

  python -m pipelines.report --personalized --runs=runs/kapc/kapc,runs/kapc/local,... \
      [--heatmap_client=0]

With `--personalized` report.md starts with the KAPC paper's tables: best mean accuracy of the
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
import dataclasses
import json
import os
import re
import sys
import textwrap
from typing import Optional, Sequence

from absl import flags

# TensorFlow, imported where a run's config.gin is read (fltff), without its C++ start-up chatter.
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

_RUNS = flags.DEFINE_list('runs', [], 'Run directories to compare; a folder `fltff sweep` wrote '
                          'stands for its finished runs.')
_OUT = flags.DEFINE_string('out', 'runs/report', 'Where report.md, report.tex, the CSV tables '
                           'and accuracy.png/.pdf go.')
_AT_ROUND = flags.DEFINE_integer('at_round', None, 'Compare the runs at this round (default: the '
                                  'last round all of them evaluated).')
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
  """Metrics rows (floats), summary and config.gin bindings (None without the file) of one run
  directory."""
  metrics = os.path.join(path, 'metrics.csv')
  if not os.path.exists(metrics):
    raise FileNotFoundError(f'{path} has no metrics.csv: is it a pipelines.run output dir?')
  with open(metrics) as f:
    reader = csv.DictReader(f)
    try:
      rows = [{k: float(v) for k, v in r.items() if v != ''} for r in reader]
    except (TypeError, ValueError):  # A row cut short or longer than the header, not a number.
      raise ValueError(f'{metrics}, line {reader.line_num}: not a row of numbers under its '
                       'header (a damaged or hand-edited metrics.csv)') from None
  summary = {}
  if os.path.exists(os.path.join(path, 'summary.json')):
    with open(os.path.join(path, 'summary.json')) as f:
      summary = json.load(f)
  config = None
  if os.path.exists(os.path.join(path, 'config.gin')):
    from fltff.simulation.outputs import config_bindings  # pylint: disable=g-import-not-at-top
    with open(os.path.join(path, 'config.gin')) as f:
      config = config_bindings(f.read())
  return {'label': os.path.basename(os.path.normpath(path)), 'rows': rows, 'summary': summary,
          'dir': path, 'config': config}


def _fmt(x) -> str:
  return '–' if x is None else f'{x:.4f}'


# -- comparing runs: one protocol per table, one round for all runs ----------------------------

DASH = '–'
NOT_EVALUATED = 'not evaluated'

# What each protocol's accuracy is: the tables' captions and the figures' panel titles.
PROTOCOL_TEXT = {
    'central': ('the global model on the central test set', 'global model, central test set'),
    'global_local': ("the global model on each of the round's participants' local test split "
                     '(their mean)', 'global model, local test splits'),
    'personal_local': ("each participant's own model on its local test split (their mean)",
                       'own models, local test splits'),
    'trained_local': ("each participant's model right after its local training, on its local "
                      'test split (their mean)', 'trained models, local test splits'),
    'finetuned_local': ("the global model after the method's fine-tuning, on each participant's "
                        'local test split (their mean)', 'fine-tuned models, local test splits'),
    'mean_local (earlier run)': ('the mean local accuracy of runs made before the evaluation '
                                 'protocols', 'mean local accuracy'),
}


def _protocol(column: str) -> str:
  from .reproduction import COLUMN_PROTOCOLS  # pylint: disable=g-import-not-at-top
  return COLUMN_PROTOCOLS.get(column, column)


def compared_columns(runs: list[dict]) -> list[str]:
  """The accuracy columns (one per protocol) any run has: the columns of more runs' headlines
  first, then in the order of `reproduction.COLUMN_PROTOCOLS`."""
  from .reproduction import COLUMN_PROTOCOLS  # pylint: disable=g-import-not-at-top
  order = list(COLUMN_PROTOCOLS)
  present = [c for c in order if any(c in r for run in runs for r in run['rows'])]
  heads = [headline_column(run) for run in runs]
  return sorted(present, key=lambda c: (-heads.count(c), order.index(c)))


def evaluated(run: dict, column: str) -> dict[int, float]:
  """{round: accuracy} of the rounds the run evaluated `column` in."""
  return {int(r['round']): r[column] for r in run['rows'] if column in r}


def _evaluated_rounds(run: dict) -> set[int]:
  from .reproduction import COLUMN_PROTOCOLS  # pylint: disable=g-import-not-at-top
  return {int(r['round']) for r in run['rows'] if any(c in r for c in COLUMN_PROTOCOLS)}


def comparison_round(runs: list[dict]) -> int:
  """The last round every run evaluated (if they share none, the last round of the run that
  stopped first)."""
  rounds = [_evaluated_rounds(run) for run in runs]
  common = set.intersection(*rounds) if rounds else set()
  if common:
    return max(common)
  return min((max(r) for r in rounds if r), default=0)


def _is_seed(binding: str) -> bool:
  return binding.endswith('.seed') or binding.endswith('.model_seed')


def _settings(run: dict) -> Optional[dict]:
  """What decides what a run computes but its seeds: config.gin without seeds and without what
  a resume may change (`outputs.is_resumable_change`: rounds, checkpointing, runtime, data
  paths), and as `data` what its data are wherever they lie (summary.json's
  `source_fingerprint`, its first 8 hex digits). None without config.gin."""
  from fltff.simulation.outputs import is_resumable_change  # pylint: disable=g-import-not-at-top
  if run.get('config') is None:
    return None
  settings = {k: v for k, v in run['config'].items()
              if not _is_seed(k) and not is_resumable_change(k)}
  if run['summary'].get('source_fingerprint'):
    settings['data'] = run['summary']['source_fingerprint'][:8]
  return settings


def _differences(a: dict, b: dict) -> set[str]:
  """The settings in which two runs' `_settings` differ as a resume compares configurations
  (`outputs.config_changes`): one recorded at its default by one run only (a parameter fltff
  added since, the channel model's settings some versions left out) is no difference."""
  import fltff  # pylint: disable=g-import-not-at-top
  from fltff.simulation.outputs import config_changes  # pylint: disable=g-import-not-at-top

  fltff.register_configurables()  # Their defaults.
  text = lambda settings: ''.join(f'{k} = {v}\n' for k, v in settings.items())
  return {key for key, _, _ in config_changes(text(a), text(b))}


def _same(a: dict, b: dict) -> bool:
  """Whether two runs' `_settings` are the same (`_differences`; quick where a binding both
  record differs)."""
  return a == b or (all(a[k] == b[k] for k in a.keys() & b.keys()) and not _differences(a, b))


def _seeds(run: dict) -> tuple:
  config = run.get('config') or {}
  return tuple(sorted((k, v) for k, v in config.items() if _is_seed(k)))


def seed_groups(runs: list[dict]) -> list[list[int]]:
  """Indices of runs whose `config.gin` differ only in seeds (`experiment.seed`,
  `experiment.model_seed`, `federated_data.seed`, any `<source>.seed`) and in what a resume may
  change (a run continued to more rounds stays in its group), on the same data (`_settings`;
  compared by `_same`),
  in order of first appearance. A run with the seeds of a run already in its group (the same
  run twice, or a copy) starts another group; a run without `config.gin` is a group of its
  own."""
  groups, settings = [], [_settings(run) for run in runs]
  for i, run in enumerate(runs):
    for group in groups:
      if (settings[i] is not None and settings[group[0]] is not None
          and _same(settings[group[0]], settings[i])
          and _seeds(run) not in {_seeds(runs[j]) for j in group}):
        group.append(i)
        break
    else:
      groups.append([i])
  return groups


def _method(run: dict) -> str:
  return str(run['summary'].get('method', '?'))


def _value_text(value: str) -> str:
  return value.strip('\'"')


def group_names(runs: list[dict], groups: list[list[int]]) -> list[str]:
  """A name per group: its method, and where several groups share a method, the settings in
  which they differ (`fedprox (mu=0.01)`; a binding's last part where that is unambiguous);
  groups alike in both (the same run twice) add their first run's folder name."""
  methods = [_method(runs[g[0]]) for g in groups]
  names = []
  for i, group in enumerate(groups):
    config = _settings(runs[group[0]])
    same = [_settings(runs[groups[j][0]]) or {} for j, m in enumerate(methods)
            if m == methods[i]]
    differing = []
    if config is not None and len(same) > 1:
      differing = sorted({k for c in same for k in _differences(config, c)} & set(config))
    short = [k.rsplit('.', 1)[-1] for k in differing]
    settings = [f'{s if short.count(s) == 1 else k}={_value_text(config[k])}'
                for k, s in zip(differing, short)]
    names.append(methods[i] + (f' ({", ".join(settings)})' if settings else ''))
  return [f'{name} [{runs[group[0]]["label"]}]' if names.count(name) > 1 else name
          for name, group in zip(names, groups)]


# Settings of the partitioners that shape the split (their others are technical).
_PARTITION_TECHNICAL = ('max_tries', 'min_samples_per_client', 'seed')


def setting(runs: list[dict]) -> str:
  """What every run shares, for the figure's title: data set, model, clients per round and the
  partition (a part the runs differ in is left out: the group names carry it)."""
  def common(get):
    values = {get(run) for run in runs}
    value = values.pop() if len(values) == 1 else None
    return None if value in (None, 'None') else value

  config = lambda run: run.get('config') or {}
  parts = [common(lambda r: r['summary'].get('dataset')),
           common(lambda r: r['summary'].get('model'))]
  clients = common(lambda r: config(r).get('federated_data.num_clients'))
  per_round = common(lambda r: config(r).get('experiment.clients_per_round'))
  fraction = common(lambda r: config(r).get('experiment.client_fraction'))
  if clients:
    parts.append(f'{clients} clients' + (f', {per_round} per round' if per_round else
                                         f', fraction {fraction} per round' if fraction else ''))
  partitioner = common(lambda r: config(r).get('federated_data.partitioner'))
  if partitioner:
    scope = partitioner.lstrip('@')
    options = common(lambda r: tuple(sorted(
        (k.split('.', 1)[1], _value_text(v)) for k, v in config(r).items()
        if k.startswith(scope + '.') and k.split('.', 1)[1] not in _PARTITION_TECHNICAL)))
    parts.append(scope.replace('_', ' ') + (
        f' ({", ".join(f"{k}={v}" for k, v in options)})' if options else ''))
  return ' · '.join(str(p) for p in parts if p)


@dataclasses.dataclass
class Table:
  """A table for report.md, a CSV file and LaTeX.

  `columns` are (title, kind): 'text' cells are strings; 'pct' a percentage (float); 'stat' a
  list of percentages (mean ± sample std, n); 'best' a (percentage, round) pair. A string in a
  number's column is a mark ('not evaluated', 'no round 20').
  """
  name: str
  number: int
  caption: str
  columns: list[tuple[str, str]]
  rows: list[list]


def _stat_text(values: list[float]) -> str:
  from .reproduction import mean_std  # pylint: disable=g-import-not-at-top
  mean, std, n = mean_std(values)
  return f'{mean:.2f} (n={n})' if std is None else f'{mean:.2f} ± {std:.2f} (n={n})'


def _cell_text(value, kind: str) -> str:
  if isinstance(value, str):
    return value
  if kind == 'pct':
    return f'{value:.2f}'
  if kind == 'stat':
    return _stat_text(value)
  if kind == 'best':
    return f'{value[0]:.2f} ({value[1]})'
  return str(value)


def markdown(table: Table) -> str:
  """The table with its caption as 'Table n.'."""
  lines = [f'**Table {table.number}.** {table.caption}', '',
           '| ' + ' | '.join(t for t, _ in table.columns) + ' |',
           '|' + '---|' * len(table.columns)]
  lines += ['| ' + ' | '.join(_cell_text(v, k) for v, (_, k) in zip(row, table.columns)) + ' |'
            for row in table.rows]
  return '\n'.join(lines)


_LATEX_SPECIAL = {'\\': r'\textbackslash{}', '&': r'\&', '%': r'\%', '$': r'\$', '#': r'\#',
                  '_': r'\_', '{': r'\{', '}': r'\}', '~': r'\textasciitilde{}',
                  '^': r'\textasciicircum{}', '–': '--', '≤': r'$\le$', '·': r'$\cdot$'}


def _latex_text(text: str) -> str:
  """`text` in LaTeX: special characters escaped, `code` in typewriter type."""
  parts = [''.join(_LATEX_SPECIAL.get(ch, ch) for ch in part) for part in text.split('`')]
  return ''.join(f'\\texttt{{{p}}}' if i % 2 else p for i, p in enumerate(parts)).replace(
      '±', r'$\pm$')


def latex(table: Table) -> str:
  r"""A `table` float (booktabs rules) with the caption and `\label{tab:<name>}`."""
  align = ''.join('l' if kind == 'text' else 'r' for _, kind in table.columns)
  row = lambda cells: '    ' + ' & '.join(cells) + r' \\'
  lines = [r'\begin{table}[t]', r'  \centering',
           f'  \\caption{{{_latex_text(table.caption)}}}',
           f'  \\label{{tab:{table.name}}}', f'  \\begin{{tabular}}{{{align}}}', r'    \toprule',
           row([_latex_text(t) for t, _ in table.columns]), r'    \midrule']
  lines += [row([_latex_text(_cell_text(v, k)) for v, (_, k) in zip(cells, table.columns)])
            for cells in table.rows]
  lines += [r'    \bottomrule', r'  \end{tabular}', r'\end{table}']
  return '\n'.join(lines)


def write_csv(table: Table, path: str) -> None:
  """The table with its numbers as numbers: a 'stat' column as `<title> mean`, `std`, `n`, a
  'best' one as `<title>` and `<title> round`; a mark in the first of them."""
  from .reproduction import mean_std  # pylint: disable=g-import-not-at-top
  widths = {'stat': 3, 'best': 2}
  head = []
  for title, kind in table.columns:
    head += {'stat': [f'{title} mean', f'{title} std', f'{title} n'],
             'best': [title, 'its round']}.get(kind, [title])
  with open(path, 'w', newline='') as f:
    writer = csv.writer(f)
    writer.writerow(head)
    for cells in table.rows:
      out = []
      for value, (_, kind) in zip(cells, table.columns):
        if isinstance(value, str):
          out += [value] + [''] * (widths.get(kind, 1) - 1)
        elif kind == 'stat':
          mean, std, n = mean_std(value)
          out += [f'{mean:.4f}', '' if std is None else f'{std:.4f}', n]
        elif kind == 'best':
          out += [f'{value[0]:.4f}', value[1]]
        else:
          out.append(f'{value:.4f}')
      writer.writerow(out)


def _seed_text(run: dict) -> str:
  seeds = run['summary'].get('seeds', {})
  return str(seeds.get('run', '?')) if isinstance(seeds, dict) else '?'


def _at_and_best(run: dict, column: str, at_round: int):
  """(accuracy at `at_round`, (best accuracy up to it, its round)) in %, or a mark for both."""
  points = evaluated(run, column)
  if not points:
    return NOT_EVALUATED, NOT_EVALUATED
  if at_round not in points:
    return f'no round {at_round}', f'no round {at_round}'
  best = max((r for r in points if r <= at_round), key=lambda r: (points[r], -r))
  return 100 * points[at_round], (100 * points[best], best)


def comparison_tables(runs: list[dict], groups: list[list[int]], names: list[str],
                      at_round: int, targets: list[float]) -> list[Table]:
  """Per protocol (`compared_columns`): the methods table (per group of seeds: accuracy at
  `at_round` and at the best round up to it, mean ± sample std over the seeds, n) and the runs
  table (per run: the same, and the first round reaching each target up to `at_round`). A run
  without the protocol's column, or without round `at_round`, is marked, not averaged in."""
  tables = []
  at, best_head = f'at round {at_round} (%)', f'best round ≤ {at_round} (%)'
  for number, column in enumerate(compared_columns(runs)):
    protocol = _protocol(column)
    what = PROTOCOL_TEXT.get(protocol, (column, column))[0]
    rows = []
    for name, group in zip(names, groups):
      cells = [_at_and_best(runs[i], column, at_round) for i in group]
      ats = [a for a, _ in cells if not isinstance(a, str)]
      bests = [b[0] for _, b in cells if not isinstance(b, str)]
      mark = next((a for a, _ in cells if isinstance(a, str) and a != NOT_EVALUATED),
                  NOT_EVALUATED)
      rows.append([name, ', '.join(_seed_text(runs[i]) for i in group),
                   ats or mark, bests or mark])
    heads = {headline_column(run) == column and
             run['summary']['headline'].get('statistic') for run in runs}
    client_best = (' Runs whose headline is the mean of client bests (summary.json) are read '
                   'here, as all others, by the clients\' mean of each round.'
                   if 'mean_client_best' in heads else '')
    intro = (f'`{protocol}` protocol: {what} (metrics.csv `{column}`).')
    tables.append(Table(
        f'{protocol}-methods', 2 * number + 1, f'{intro} Accuracy (%) at round '
        f'{at_round} and at the best round up to round {at_round}: mean ± sample std over the '
        f'seeds (n runs); "{NOT_EVALUATED}": no run of the group has this protocol\'s '
        f'reading.{client_best}',
        [('method', 'text'), ('seeds', 'text'), (at, 'stat'), (best_head, 'stat')], rows))
    rows = []
    for run in runs:
      at_value, best = _at_and_best(run, column, at_round)
      points = evaluated(run, column)
      hits = [next((r for r in sorted(points) if r <= at_round and points[r] >= t), None)
              for t in targets]
      rows.append([run['label'], _method(run), _seed_text(run),
                   str(int(run['rows'][-1]['round'])) if run['rows'] else '0', at_value, best]
                  + [DASH if h is None else str(h) for h in hits])
    tables.append(Table(
        f'{protocol}-runs', 2 * number + 2, f'{intro} Per run: accuracy (%) at round '
        f'{at_round}, at the best round up to it (in brackets: that round)' +
        (f' and the first round up to {at_round} reaching each target ({DASH}: none)'
         if targets else '') + '.',
        [('run', 'text'), ('method', 'text'), ('seed', 'text'), ('rounds', 'text'),
         (at, 'pct'), (best_head, 'best')] +
        [(f'rounds to {100 * t:g}%', 'text') for t in targets], rows))
  return tables


def _round_note(runs: list[dict], at_round: int, chosen: bool) -> str:
  """Which round the tables compare, and why."""
  if chosen:
    missing = [run['label'] for run in runs if at_round not in _evaluated_rounds(run)]
    return (f'Compared at round {at_round} (`--at_round`).' + (
        f' Runs without an evaluation in round {at_round} are marked "no round {at_round}": '
        f'{", ".join(missing)}.' if missing else ''))
  further = [f'{run["label"]} ({int(run["rows"][-1]["round"])})' for run in runs
             if run['rows'] and run['rows'][-1]['round'] > at_round]
  return (f'Compared at round {at_round}, the last round all {len(runs)} runs evaluated '
          '(`--at_round` chooses another).' + (
              f' Runs that went further (their rounds): {", ".join(further)}; the tables '
              f'compare round {at_round}.' if further else ''))


def _colours(count: int) -> list:
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  cmap = plt.cm.tab10 if count <= 10 else plt.cm.tab20
  return [cmap(i % cmap.N) for i in range(count)]


def comparison_figure(runs: list[dict], groups: list[list[int]], names: list[str],
                      at_round: int, stem: str) -> list[str]:
  """`<stem>.png` and `<stem>.pdf`: one panel per protocol, one curve per group (the mean over
  its seeds at the rounds all of them evaluated, their min–max band), one colour per group in
  every panel, integer rounds, a dotted line at the compared round, the shared setting as the
  title and one legend under the panels. Returns the files written."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  from matplotlib.ticker import MaxNLocator  # pylint: disable=g-import-not-at-top
  from .reproduction import band  # pylint: disable=g-import-not-at-top

  columns = compared_columns(runs)
  if not columns:
    return []
  colours = _colours(len(groups))
  width = max(6.4, 4.6 * len(columns))
  fig, axes = plt.subplots(1, len(columns), figsize=(width, 4.2), squeeze=False,
                           layout='constrained', sharey=True)
  handles = {}
  for ax, column in zip(axes[0], columns):
    for g, (name, group) in enumerate(zip(names, groups)):
      members = [runs[i] for i in group if evaluated(runs[i], column)]
      x, mean, lo, hi = band(members, lambda r, c=column: c)
      if not x:
        continue
      line, = ax.plot(x, [100 * v for v in mean], color=colours[g], linewidth=1.4,
                      marker='o' if len(x) <= 12 else None, markersize=3)
      if len(members) > 1:
        ax.fill_between(x, [100 * v for v in lo], [100 * v for v in hi], color=colours[g],
                        alpha=0.18, linewidth=0)
      handles.setdefault(g, (line, f'{name}, n={len(members)}'))
    ax.axvline(at_round, color='0.4', linestyle=':', linewidth=1)
    protocol = _protocol(column)
    ax.set_title(f'{protocol}: {PROTOCOL_TEXT.get(protocol, (column, column))[1]}', fontsize=9)
    ax.set_xlabel('communication round')
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
  axes[0][0].set_ylabel('accuracy (%)')
  title = setting(runs)
  if title:
    fig.suptitle(textwrap.fill(title, width=int(width * 14)), fontsize=10)
  labels = [handles[g][1] for g in sorted(handles)]
  if labels:
    longest = max(len(label) for label in labels)
    ncol = max(1, min(len(labels), int(width * 72 / (5.2 * longest + 40))))
    fig.legend([handles[g][0] for g in sorted(handles)], labels, loc='outside lower center',
               ncol=ncol, fontsize=8, frameon=False)
  written = []
  for suffix, dpi in (('png', 130), ('pdf', None)):
    fig.savefig(f'{stem}.{suffix}', dpi=dpi)
    written.append(f'{stem}.{suffix}')
  plt.close(fig)
  return written


def run_dirs(paths: list[str]) -> list[str]:
  """The run folders `paths` name: a folder with metrics.csv is one run; a folder `fltff sweep`
  wrote (a plan.txt and no metrics.csv) stands for its finished runs (`plan.finished`), in the
  plan's order."""
  from .plan import finished  # pylint: disable=g-import-not-at-top
  from .plan import read_plan  # pylint: disable=g-import-not-at-top
  out = []
  for path in paths:
    plan = os.path.join(path, 'plan.txt')
    if not os.path.exists(os.path.join(path, 'metrics.csv')) and os.path.exists(plan):
      out += [os.path.join(path, run.name) for run in finished(read_plan(plan), path)]
    else:
      out.append(path)
  return out


def write_report(runs: list[dict], out: str, at_round: Optional[int] = None,
                 targets: Sequence[float] = (), before: str = '', after: str = '') -> str:
  """Writes the comparison of `runs` to `out`: report.md (with `before` and `after` around the
  tables), report.tex, one CSV per table and accuracy.png/.pdf; returns the Markdown.
  `at_round` None: the last round all runs evaluated."""
  os.makedirs(out, exist_ok=True)
  chosen = at_round is not None
  at_round = at_round if chosen else comparison_round(runs)
  groups = seed_groups(runs)
  names = group_names(runs, groups)
  tables = comparison_tables(runs, groups, names, at_round, list(targets))
  for t in tables:
    write_csv(t, os.path.join(out, f'{t.name}.csv'))
  with open(os.path.join(out, 'report.tex'), 'w') as f:
    f.write('% fltff report: \\usepackage{booktabs}\n\n' +
            '\n\n'.join(latex(t) for t in tables) + '\n')
  figures = comparison_figure(runs, groups, names, at_round, os.path.join(out, 'accuracy'))
  title = setting(runs)
  parts = [before, ''] if before else []
  parts += [f'# Comparison of {len(runs)} runs' + (f': {title}' if title else ''), '']
  parts += [_round_note(runs, at_round, chosen), '']
  for t in tables:
    parts += [markdown(t), '']
  if figures:
    parts += [f'![accuracy by round](accuracy.png)', '',
              f'Figure: accuracy by round per protocol; lines: mean over the seeds (n in the '
              f'legend), band: their min–max; dotted: round {at_round}. Also accuracy.pdf; '
              'tables as CSV (one file per table) and LaTeX (report.tex).', '']
  parts += [after, ''] if after else []
  md = '\n'.join(parts).rstrip() + '\n'
  with open(os.path.join(out, 'report.md'), 'w') as f:
    f.write(md)
  return md


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
  `<rule>/self_relation_layer_<l>` columns, e.g. `fedamp/`; `kapc/` for every personalised rule
  in older runs). False when the run logged none."""
  columns = {int(m.group(1)): k for r in run['rows'] for k in r
             for m in [re.fullmatch(r'[^/]+/self_relation_layer_(\d+)', k)] if m}
  if not columns:
    return False
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(7, 4))
  for l, column in sorted(columns.items()):
    rows = [r for r in run['rows'] if column in r]
    ax.plot([r['round'] for r in rows], [r[column] for r in rows], label=f'layer {l}')
  ax.set_xlabel('communication round')
  ax.set_ylabel('mean $r_{ii}^{l}$ over the round\'s clients')
  ax.set_title(f'self-relationship by layer: {run["label"]}', fontsize=9)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8, ncol=2)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


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
      unshown = reproduction.unshown_runs(_REPRODUCTION.value)
    except (OSError, KeyError, ValueError) as e:
      print(f'error: cannot write the reproduction report from {_REPRODUCTION.value}: '
            f'{type(e).__name__}: {e}', file=sys.stderr)
      return 2
    print(md)
    print(f'\nwrote {_REPRODUCTION.value}/reproduction.md and {_REPRODUCTION.value}/figures/')
    for line in unshown:  # Last, where the eye lands after the report.
      print(f'warning: not in the report: {line}', file=sys.stderr)
    return 0
  if not _RUNS.value:
    print('error: pass --runs=dir1,dir2,...', file=sys.stderr)
    return 2
  try:
    paths = run_dirs(_RUNS.value)
    if not paths:
      raise FileNotFoundError(f'no finished run in {", ".join(_RUNS.value)}')
    runs = [load_run(p) for p in paths]
  except (FileNotFoundError, ValueError) as e:
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
  before = ''
  if _PAIRS.value:
    before = gain_table(runs)
  if _PERSONALIZED.value:
    before = personalized_tables(runs)
    figures = []
    for path, run in zip(paths, runs):
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
      before += ('\n\nRelationship cube (KAPC paper Fig. 7: one client\'s R after the last '
                 'round, layers × clients; and r_ii per layer by round):\n\n' +
                 '\n\n'.join(figures))
  md = write_report(runs, _OUT.value, _AT_ROUND.value, targets, before=before)
  print(md)
  print(f'wrote {_OUT.value}/report.md, report.tex, <protocol>-methods.csv, '
        '<protocol>-runs.csv, accuracy.png and accuracy.pdf')
  return 0


if __name__ == '__main__':
  from fltff.cli import run_program  # pylint: disable=g-import-not-at-top
  run_program(main)
