r"""Runs the reproduction plan one run after another, resuming what a stopped session left.

  python -m pipelines.reproduce [--plan=results/plan.txt] [--runs_dir=~/fltff-runs] \
      [--only=fedlap_,kapc_] [--gin_bindings=...] [--dry_run]

Each line of the plan is `run_name gin_file [binding; binding; ...]` (`#` starts a comment).
Every line's configuration (the gin file, `--gin_bindings`, then the line's bindings) is read
before anything runs: a missing gin file, a bad binding, or a run folder holding a run computed
with other settings than the line gives now (an edited gin file or line) is one `error:` line,
and nothing runs (move that run folder away to run it again); `--dry_run` checks the same.
For every line, in order: a run whose metrics.csv already has all its rounds is skipped; one
with checkpoints is continued with `--resume`, and one that stopped before its first checkpoint
is rerun from round 1 in place (also `--resume`); otherwise it starts in `<runs_dir>/<run_name>`.
Each run is its own `python -m pipelines.run` process (its log: `<runs_dir>/<run_name>.log`), so
a failing run is reported and the next one starts; a SIGTERM/Ctrl-C is passed on to the running
one, which stops after its round, checkpointed (`pipelines/plan.py` runs plans, here and for
`fltff sweep`). Afterwards
`python -m pipelines.report --reproduction=results --collect_from=<runs_dir>` copies the
finished runs' small files into `results/runs/` and rebuilds the report.
"""

from __future__ import annotations

import os
import sys

from absl import flags

# TensorFlow, imported where the configurations are read, without its C++ start-up chatter.
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

from .plan import check_configurations
from .plan import outcome_message
from .plan import read_plan
from .plan import run_plan

_PLAN = flags.DEFINE_string('plan', 'results/plan.txt', 'The list of runs.')
_RUNS_DIR = flags.DEFINE_string('runs_dir', '~/fltff-runs', 'Where run folders go.')
_ONLY = flags.DEFINE_list('only', [], 'Only runs whose name starts with one of these.')
_DRY_RUN = flags.DEFINE_bool('dry_run', False, 'Print what would run, run nothing.')
# `run` has a flag of this name and meaning: a program that imports both (the test suite runs
# `run` in process) keeps one of them.
_BINDINGS = flags.DEFINE_multi_string(
    'gin_bindings', [], 'Bindings added to every run, e.g. '
    "\"idx_source.path = '/data/fashion-mnist'\".", allow_override=True)


def main(argv) -> int:
  del argv
  from fltff.errors import ConfigError  # pylint: disable=g-import-not-at-top

  try:
    plan = [run for run in read_plan(_PLAN.value)
            if not _ONLY.value or any(run.name.startswith(p) for p in _ONLY.value)]
    runs_dir = os.path.expanduser(_RUNS_DIR.value)
    rounds = check_configurations(plan, runs_dir, tuple(_BINDINGS.value))
  except OSError as e:
    print(f'error: cannot read the plan {_PLAN.value}: {e.strerror or e}.', file=sys.stderr)
    return 2
  except (ConfigError, ValueError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  outcome = run_plan(plan, runs_dir, tuple(_BINDINGS.value), dry_run=_DRY_RUN.value,
                     rounds=rounds)
  message = outcome_message(outcome, runs_dir, 'rerunning this command')
  if message:
    print(message, file=sys.stderr)
    return 143 if outcome.stopped else 1
  return 0


if __name__ == '__main__':
  from fltff.cli import run_program  # pylint: disable=g-import-not-at-top
  run_program(main)
