r"""Runs the reproduction plan one run after another, resuming what a stopped session left.

  python -m pipelines.reproduce [--plan=results/plan.txt] [--runs_dir=~/fltff-runs] \
      [--only=fedlap_,kapc_] [--gin_bindings=...] [--dry_run]

Each line of the plan is `run_name gin_file [binding; binding; ...]` (`#` starts a comment).
For every line, in order: a run whose metrics.csv already has all its rounds is skipped; one
with checkpoints is continued with `--resume`, and one that stopped before its first checkpoint
is rerun from round 1 in place (also `--resume`); otherwise it starts in `<runs_dir>/<run_name>`.
Each run is its own `python -m pipelines.run` process (its log: `<runs_dir>/<run_name>.log`), so
a failing run is reported and the next one starts. Afterwards
`python -m pipelines.report --reproduction=results --collect_from=<runs_dir>` copies the
finished runs' small files into `results/runs/` and rebuilds the report.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time

from absl import flags

from . import reproduction

_PLAN = flags.DEFINE_string('plan', 'results/plan.txt', 'The list of runs.')
_RUNS_DIR = flags.DEFINE_string('runs_dir', '~/fltff-runs', 'Where run folders go.')
_ONLY = flags.DEFINE_list('only', [], 'Only runs whose name starts with one of these.')
_DRY_RUN = flags.DEFINE_bool('dry_run', False, 'Print what would run, run nothing.')
# `run` has a flag of this name and meaning: a program that imports both (the test suite runs
# `run` in process) keeps one of them.
_BINDINGS = flags.DEFINE_multi_string(
    'gin_bindings', [], 'Bindings added to every run, e.g. '
    "\"idx_source.path = '/data/fashion-mnist'\".", allow_override=True)


@dataclasses.dataclass(frozen=True)
class PlannedRun:
  name: str
  gin_file: str
  bindings: tuple[str, ...] = ()


def read_plan(path: str) -> list[PlannedRun]:
  """Parses the plan; raises ValueError naming the line for a malformed one."""
  runs = []
  with open(path) as f:
    for number, line in enumerate(f, start=1):
      line = line.split('#', 1)[0].strip()
      if not line:
        continue
      parts = line.split(None, 2)
      if len(parts) < 2 or not parts[1].endswith('.gin'):
        raise ValueError(f'{path}:{number}: expected "run_name gin_file [bindings]", got '
                         f'{line!r}')
      bindings = tuple(b.strip() for b in parts[2].split(';') if b.strip()) if len(
          parts) == 3 else ()
      runs.append(PlannedRun(parts[0], parts[1], bindings))
  names = [r.name for r in runs]
  duplicates = sorted({n for n in names if names.count(n) > 1})
  if duplicates:
    raise ValueError(f'{path}: run names appear twice: {", ".join(duplicates)}')
  return runs


def command(run: PlannedRun, runs_dir: str,
            extra_bindings: tuple[str, ...] = ()) -> tuple[list[str], str]:
  """The `pipelines.run` command for `run`, and its state.

  The state is 'done', 'resume' (checkpoints to continue from), 'restart' (a run that stopped
  before its first checkpoint left files: `--resume` reruns it from round 1 in place) or 'start'.
  """
  out = os.path.join(runs_dir, run.name)
  done, wanted = reproduction.run_progress(out)
  if wanted is not None and done >= wanted:
    return [], 'done'
  # The executor is the default's choice ('auto': vectorised clients where the model allows;
  # summary.json names it). `extra_bindings` (e.g. where the data lie) come before the plan's.
  args = [sys.executable, '-m', f'{__package__}.run', f'--gin_file={run.gin_file}',
          f'--output_dir={out}'] + [f'--gin_bindings={b}'
                                    for b in tuple(extra_bindings) + run.bindings]
  if os.path.isdir(os.path.join(out, 'checkpoints')):
    return args + ['--resume'], 'resume'
  if os.path.isdir(out) and os.listdir(out):
    return args + ['--resume'], 'restart'
  return args, 'start'


def check_gin_files(runs: list[PlannedRun]) -> None:
  """`ConfigError` naming the first run whose gin file, or a file it includes, is missing: found
  before the first run starts, not hours later when its turn comes."""
  from fltff import resources  # pylint: disable=g-import-not-at-top
  from fltff.errors import ConfigError  # pylint: disable=g-import-not-at-top

  for run in runs:
    try:
      resources.find_gin_files([run.gin_file])
    except ConfigError as e:
      raise ConfigError(f'planned run {run.name}: {e}') from None


def _error_line(log_path: str) -> str:
  """The last `error:` line of a run's log ('' if none)."""
  with open(log_path, errors='replace') as f:
    errors = [line.strip() for line in f if line.startswith('error: ')]
  return errors[-1] if errors else ''


def main(argv) -> int:
  del argv
  from fltff.errors import ConfigError  # pylint: disable=g-import-not-at-top

  try:
    plan = [run for run in read_plan(_PLAN.value)
            if not _ONLY.value or any(run.name.startswith(p) for p in _ONLY.value)]
    check_gin_files(plan)
  except OSError as e:
    print(f'error: cannot read the plan {_PLAN.value}: {e.strerror or e}.', file=sys.stderr)
    return 2
  except (ConfigError, ValueError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  runs_dir = os.path.expanduser(_RUNS_DIR.value)
  os.makedirs(runs_dir, exist_ok=True)
  failed = []
  for run in plan:
    args, state = command(run, runs_dir, tuple(_BINDINGS.value))
    print(f'{time.strftime("%H:%M:%S")} {run.name}: {state}', flush=True)
    if state == 'done' or _DRY_RUN.value:
      continue
    start = time.monotonic()
    log_path = os.path.join(runs_dir, f'{run.name}.log')
    with open(log_path, 'a') as log:
      rc = subprocess.call(args, stdout=log, stderr=subprocess.STDOUT)
    print(f'{time.strftime("%H:%M:%S")} {run.name}: exit {rc} after '
          f'{time.monotonic() - start:.0f} s{"; " + _error_line(log_path) if rc else ""}',
          flush=True)
    if rc:
      failed.append(run.name)
      if rc == 143:  # Stopped by SIGTERM/SIGINT: checkpointed; do not start the next run.
        break
  if failed:
    print(f'error: {len(failed)} run(s) did not finish: {", ".join(failed)} (see their .log '
          f'in {runs_dir}; rerun this command to resume them)', file=sys.stderr)
    return 1
  return 0


if __name__ == '__main__':
  from fltff.cli import run_program  # pylint: disable=g-import-not-at-top
  run_program(main)
