r"""Runs a grid of settings × seeds, one run folder per point, then reports over them.

  fltff sweep --gin_file=exp.gin --grid='fedprox.mu=[0.001, 0.01, 0.1]' \
      --grid='experiment.local_epochs=[1, 5]' --seeds=0,1,2 --sweep_dir=sweeps/mu \
      [--parallel=2] [--gin_bindings='experiment.rounds = 50'] [--dry_run]
  fltff sweep --sweep_dir=sweeps/mu      # continues the sweep planned there

(`python -m pipelines.sweep` in a checkout). Every `--grid` is one gin binding and its values,
`name=[v1, v2, ...]` or `name=v1,v2,...`, each value as gin reads it (a list value inside the
brackets: `experiment.evaluation=[['central'], ['central', 'global_local']]`); `--seeds` binds
`experiment.seed`. The cartesian product of the grids × the seeds is one `fltff run` each, in
`<sweep_dir>/<name>`, named by its point (`fedprox.mu=0.01,experiment.local_epochs=5,seed=1`).
Every point's configuration is read, as `fltff run` reads it, before anything runs: a malformed
grid, an unknown gin name, a badly typed value or a grid no point reads (another method's,
partitioner's or source's parameter) is one `error:` line and nothing runs.

The plan goes to `<sweep_dir>/plan.txt` (the format of `fltff reproduce --plan`); running the
command again continues it: finished runs are skipped, stopped ones resumed (`--resume`,
exactly as `fltff reproduce` decides; a finished run the gin file now asks more rounds of
too), points new to the grid (another seed) added; a point planned there with other settings,
or whose run there was computed with settings the gin file no longer gives (it was edited
since), is refused. Up to `--parallel` runs go at once, each its own process with its log in
`<sweep_dir>/<name>.log`; SIGTERM/Ctrl-C stops them after their current round, checkpointed (a
second signal: at once). At the end `fltff report` compares the finished runs in
`<sweep_dir>/report/` (`fltff report --runs=<sweep_dir>` does it again).
"""

from __future__ import annotations

import itertools
import os
import re
import sys
from typing import Optional, Sequence

from absl import flags

# TensorFlow, imported where the configurations are read, without its C++ start-up chatter.
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

from . import report
from .plan import PlannedRun
from .plan import check_configurations
from .plan import finished
from .plan import outcome_message
from .plan import read_plan
from .plan import run_plan

PLAN_FILE = 'plan.txt'

# `run` and `reproduce` have flags of these names and meanings: a program that imports several
# (the test suite) keeps one of each.
_GIN_FILE = flags.DEFINE_multi_string('gin_file', [], 'The gin file of the experiment (one).',
                                      allow_override=True)
_BINDINGS = flags.DEFINE_multi_string(
    'gin_bindings', [], "Bindings of every run of the sweep, e.g. 'experiment.rounds = 50'.",
    allow_override=True)
_DRY_RUN = flags.DEFINE_bool('dry_run', False, 'Print what would run, run nothing.',
                             allow_override=True)
_GRID = flags.DEFINE_multi_string(
    'grid', [], "A gin binding and its values: 'fedprox.mu=[0.001, 0.01]' (repeat for a "
    'cartesian product).')
_SEEDS = flags.DEFINE_list('seeds', [], 'Values of experiment.seed: each point runs once per '
                           'seed (default: the gin file\'s seed, once).')
_SWEEP_DIR = flags.DEFINE_string('sweep_dir', None, 'Where the plan, the run folders, their logs '
                                 'and the report go.')
_PARALLEL = flags.DEFINE_integer('parallel', 1, 'How many runs at once.', lower_bound=1)

_NAME = re.compile(r'[A-Za-z_][\w./]*\.[A-Za-z_]\w*')


def split_values(text: str) -> list[str]:
  """The comma-separated values of `text`, commas inside brackets or quotes kept."""
  values, depth, quote, start = [], 0, None, 0
  for i, ch in enumerate(text):
    if quote:
      quote = None if ch == quote else quote
    elif ch in '\'"':
      quote = ch
    elif ch in '([{':
      depth += 1
    elif ch in ')]}':
      depth -= 1
    elif ch == ',' and depth == 0:
      values.append(text[start:i].strip())
      start = i + 1
  if depth or quote:
    raise ValueError(f'unbalanced brackets or quotes in {text!r}')
  values.append(text[start:].strip())
  return values


def parse_grid(specs: Sequence[str]) -> list[tuple[str, list[str]]]:
  """[(binding name, [value texts])] of the `--grid` flags; ValueError for a malformed one."""
  axes = []
  for spec in specs:
    name, sep, values = (part.strip() for part in spec.partition('='))
    if not sep or not _NAME.fullmatch(name):
      raise ValueError(f"--grid={spec!r}: expected 'configurable.parameter=[value, ...]'")
    try:
      parsed = split_values(values)
      if len(parsed) == 1 and parsed[0].startswith('[') and parsed[0].endswith(']'):
        parsed = split_values(parsed[0][1:-1])  # 'name=[v1, v2]' rather than 'name=v1,v2'.
    except ValueError as e:
      raise ValueError(f'--grid={spec!r}: {e}') from None
    if not all(parsed):
      raise ValueError(f'--grid={spec!r}: a value is empty')
    if len(set(parsed)) < len(parsed):
      raise ValueError(f'--grid={spec!r}: a value appears twice')
    if name in [n for n, _ in axes]:
      raise ValueError(f'--grid names {name} twice')
    axes.append((name, parsed))
  return axes


def _name_part(value: str) -> str:
  """A value as part of a folder name: quotes dropped, each run of characters other than
  letters, digits and `._+-@` one `_` (none at the ends)."""
  return re.sub(r'[^\w.+@-]+', '_', re.sub('[\'"]', '', value)).strip('_') or '_'


def plan_points(gin_file: str, axes: list[tuple[str, list[str]]], seeds: Sequence[int],
                bindings: Sequence[str] = ()) -> list[PlannedRun]:
  """One `PlannedRun` per point of the grids × seeds (seeds vary fastest), named by its point,
  with `bindings` before the point's own."""
  if not axes and not seeds:
    raise ValueError('nothing to sweep: pass --grid and/or --seeds')
  if seeds and 'experiment.seed' in [n for n, _ in axes]:
    raise ValueError('experiment.seed is both a --grid and --seeds')
  for text in [v for _, values in axes for v in values] + list(bindings):
    if ';' in text or '#' in text:
      raise ValueError(f'{text!r}: a sweep\'s values and bindings cannot contain ";" or "#" '
                       '(the plan file\'s separators)')
  runs = []
  for values in itertools.product(*[v for _, v in axes]):
    point = [(name, value) for (name, _), value in zip(axes, values)]
    for seed in seeds or [None]:
      names = [f'{n}={_name_part(v)}' for n, v in point]
      own = [f'{n} = {v}' for n, v in point]
      if seed is not None:
        names.append(f'seed={seed}')
        own.append(f'experiment.seed = {seed}')
      runs.append(PlannedRun(','.join(names), gin_file, tuple(bindings) + tuple(own)))
  names = [r.name for r in runs]
  alike = sorted({n for n in names if names.count(n) > 1})
  if alike:
    raise ValueError(f'grid values give the same folder name: {", ".join(alike)}')
  too_long = [n for n in names if len(n) > 200]
  if too_long:
    raise ValueError(f'a run folder name is longer than 200 characters: {too_long[0][:60]}...')
  return runs


def merge_plans(planned: list[PlannedRun], existing: list[PlannedRun],
                sweep_dir: str) -> list[PlannedRun]:
  """The plan already in `sweep_dir` with the runs new to it appended; ValueError for a run
  planned there with other settings."""
  old = {r.name: r for r in existing}
  for run in planned:
    if run.name in old and old[run.name] != run:
      raise ValueError(
          f'{sweep_dir} already plans {run.name} as "{old[run.name].line()}", not "{run.line()}"'
          f'; continue it with --sweep_dir={sweep_dir} alone, or sweep into another folder')
  return existing + [r for r in planned if r.name not in old]


def write_plan(runs: list[PlannedRun], path: str) -> None:
  """The plan file (atomically: a stopped write leaves the previous one)."""
  with open(path + '.tmp', 'w') as f:
    f.write('# fltff sweep: one run a line, "run_name gin_file binding; binding; ...".\n'
            f'# `fltff sweep --sweep_dir={os.path.dirname(path)}` continues it.\n')
    f.writelines(run.line() + '\n' for run in runs)
  os.replace(path + '.tmp', path)


def _gin_file(path: str) -> str:
  """The gin file as the plan names it: the absolute path of a file found here, so that the
  plan works from any folder; a shipped config by its shipped name."""
  from fltff import resources  # pylint: disable=g-import-not-at-top
  [found] = resources.find_gin_files([path])
  where = path if os.path.exists(path) else found
  where = os.path.abspath(where)
  if any(ch.isspace() for ch in where) or not where.endswith('.gin'):
    raise ValueError(f'--gin_file={path}: a sweep needs a path without spaces that ends in .gin')
  return where


def _plan(sweep_dir: str) -> list[PlannedRun]:
  """The sweep's plan: the flags' points merged into the plan in `sweep_dir`, or that plan."""
  path = os.path.join(sweep_dir, PLAN_FILE)
  existing = read_plan(path) if os.path.exists(path) else []
  if not _GIN_FILE.value:
    if _GRID.value or _SEEDS.value:
      raise ValueError('--grid and --seeds need --gin_file')
    if not existing:
      raise ValueError(f'no sweep is planned in {sweep_dir} (no {PLAN_FILE}): pass --gin_file '
                       'and --grid and/or --seeds')
    return existing
  if len(_GIN_FILE.value) > 1:
    raise ValueError('a sweep takes one --gin_file (include the others in it)')
  try:
    seeds = [int(s) for s in _SEEDS.value]
  except ValueError:
    raise ValueError(f'--seeds={",".join(_SEEDS.value)}: expected integers') from None
  planned = plan_points(_gin_file(_GIN_FILE.value[0]), parse_grid(_GRID.value), seeds,
                        _BINDINGS.value)
  return merge_plans(planned, existing, sweep_dir)


# The settings that choose one configurable among its siblings (the methods; the partitioners,
# the sources: each a module's): a grid over a sibling's parameter changes nothing in the run.
CHOOSERS = ('experiment.method', 'federated_data.partitioner', 'federated_data.source')


def inert_points(runs: list[PlannedRun], axis: str) -> dict[str, str]:
  """`{run name: the chooser binding}` of the runs whose configuration never reads the grid
  `axis` (`moon.mu` where `experiment.method = @fedprox`), read as `fltff run` reads it."""
  import gin  # pylint: disable=g-import-not-at-top
  from fltff import methods  # pylint: disable=g-import-not-at-top
  from fltff.config_checks import configurables  # pylint: disable=g-import-not-at-top
  from fltff.config_checks import gin_binds  # pylint: disable=g-import-not-at-top
  from fltff.simulation.experiment import configure  # pylint: disable=g-import-not-at-top

  method_names = {m.gin_name for m in methods.METHODS.values()}
  owner = axis.rsplit('/', 1)[-1].rsplit('.', 1)[0]
  module = lambda name: getattr(getattr(configurables().get(name), 'wrapped', None),
                                '__module__', name)
  inert = {}
  for run in runs:
    try:
      configure([run.gin_file], list(run.bindings))
      for chooser in CHOOSERS:
        chosen = gin.query_parameter(chooser) if gin_binds(chooser) else None
        name = getattr(getattr(chosen, 'configurable', None), 'name', owner)
        siblings = ({owner, name} <= method_names if chooser == 'experiment.method'
                    else module(owner) == module(name))
        if name != owner and siblings:
          inert[run.name] = f'{chooser} = @{name}'
    finally:
      gin.clear_config()
  return inert


def check_axes(runs: list[PlannedRun], axes: list[tuple[str, list[str]]]) -> None:
  """`ConfigError` for a grid axis no point reads (every value would run the same experiment);
  a warning naming the points that do not read it."""
  from fltff.errors import ConfigError  # pylint: disable=g-import-not-at-top
  from fltff.errors import warn  # pylint: disable=g-import-not-at-top

  for axis, _ in axes:
    inert = inert_points(runs, axis)
    if len(inert) == len(runs):
      raise ConfigError(f'--grid {axis}: no point reads it ({sorted(set(inert.values()))[0]} '
                        'does not use it), so every value would run the same experiment.')
    if inert:
      warn(f'--grid {axis}: {len(inert)} of the {len(runs)} points do not read it (e.g. '
           f'{next(iter(inert))}: {next(iter(inert.values()))}); their values run the same '
           'experiment.')


def write_sweep_report(runs: list[PlannedRun], sweep_dir: str,
                       rounds: dict[str, int]) -> Optional[str]:
  """`fltff report` over the finished runs (`plan.finished`) into `<sweep_dir>/report/`; its
  report.md, or None when no run has finished."""
  done = finished(runs, sweep_dir, rounds)
  if not done:
    return None
  missing = [r.name for r in runs if r not in done]
  before = (f'Sweep `{sweep_dir}`: {len(done)} of the {len(runs)} planned runs finished' +
            (f'; not finished (not in the tables): {", ".join(missing)}.' if missing else '.'))
  out = os.path.join(sweep_dir, 'report')
  report.write_report([report.load_run(os.path.join(sweep_dir, r.name)) for r in done], out,
                      before=before)
  return os.path.join(out, 'report.md')


def main(argv) -> int:
  del argv
  from fltff.errors import ConfigError  # pylint: disable=g-import-not-at-top

  if not _SWEEP_DIR.value:
    print('error: pass --sweep_dir (where the sweep\'s runs go).', file=sys.stderr)
    return 2
  sweep_dir = os.path.expanduser(_SWEEP_DIR.value)
  try:
    runs = _plan(sweep_dir)
    rounds = check_configurations(runs, sweep_dir, what='sweep point')
    check_axes(runs, parse_grid(_GRID.value))
  except OSError as e:
    print(f'error: {sweep_dir}: {e.strerror or e}.', file=sys.stderr)
    return 2
  except (ConfigError, ValueError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  if _DRY_RUN.value:
    run_plan(runs, sweep_dir, dry_run=True, rounds=rounds)
    return 0
  try:
    os.makedirs(sweep_dir, exist_ok=True)
    write_plan(runs, os.path.join(sweep_dir, PLAN_FILE))
  except OSError as e:
    print(f'error: cannot write the plan into {sweep_dir}: {e.strerror or e}.', file=sys.stderr)
    return 2
  print(f'sweep of {len(runs)} runs in {sweep_dir} (plan: {PLAN_FILE}), {_PARALLEL.value} at '
        'a time', flush=True)
  outcome = run_plan(runs, sweep_dir, parallel=_PARALLEL.value, rounds=rounds)
  again = f'fltff sweep --sweep_dir={_SWEEP_DIR.value}'
  message = outcome_message(outcome, sweep_dir, again)
  if outcome.stopped:
    print(message, file=sys.stderr)
    return 143
  written = write_sweep_report(runs, sweep_dir, rounds)
  if written:
    print(f'wrote the report over the finished runs: {written}', flush=True)
  if message:
    print(message, file=sys.stderr)
    return 1
  return 0


if __name__ == '__main__':
  from fltff.cli import run_program as _run  # pylint: disable=g-import-not-at-top
  _run(main)
