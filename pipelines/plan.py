"""A plan of runs: read it, decide what each run needs, run them (`fltff reproduce`, `fltff sweep`).

A plan file has one run a line, `run_name gin_file [binding; binding; ...]` (`#` starts a
comment). Each run is a `pipelines.run` process of its own in `<runs_dir>/<run_name>`, its log
`<runs_dir>/<run_name>.log`: a run whose metrics.csv has all its rounds is skipped, one with
checkpoints continued with `--resume`, one that stopped before its first checkpoint rerun from
round 1 in place (also `--resume`), any other started. Before that, `check_configurations`
reads every line's configuration as `fltff run` does and refuses a plan with a bad one, or with
a run folder holding a run computed with other settings than its line gives now.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from typing import Optional, Sequence

from . import reproduction

# How often running runs are polled for their end (seconds).
_POLL_SECONDS = 0.1


@dataclasses.dataclass(frozen=True)
class PlannedRun:
  name: str
  gin_file: str
  bindings: tuple[str, ...] = ()

  def line(self) -> str:
    """The run as a line of a plan file (`read_plan` reads it back)."""
    return ' '.join([self.name, self.gin_file, '; '.join(self.bindings)]).rstrip()


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


def command(run: PlannedRun, runs_dir: str, extra_bindings: tuple[str, ...] = (),
            rounds: Optional[int] = None) -> tuple[list[str], str]:
  """The `pipelines.run` command for `run`, and its state.

  The state is 'done' (its config.gin's rounds, and `rounds`, in metrics.csv), 'resume'
  (checkpoints to continue from), 'restart' (a run that stopped before its first checkpoint
  left files: `--resume` reruns it from round 1 in place) or 'start'.
  """
  out = os.path.join(runs_dir, run.name)
  done, wanted = reproduction.run_progress(out)
  if wanted is not None and done >= max(wanted, rounds or 0):
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


def finished(runs: Sequence[PlannedRun], runs_dir: str,
             rounds: Optional[dict[str, int]] = None) -> list[PlannedRun]:
  """The runs of the plan whose metrics.csv has all their rounds (`rounds`: by run name, the
  rounds its configuration asks for now, where known)."""
  return [r for r in runs if command(r, runs_dir, (), (rounds or {}).get(r.name))[1] == 'done']


def check_configurations(runs: Sequence[PlannedRun], runs_dir: str,
                         extra_bindings: tuple[str, ...] = (),
                         what: str = 'planned run') -> dict[str, int]:
  """Reads every run's configuration as `fltff run` does (`extra_bindings` before the run's, as
  `command` passes them), before any run starts; `ConfigError` naming the first run (as `what`)
  whose configuration is refused (a missing gin file, an unknown name, a badly typed value,
  ...), or whose folder holds a run computed with other settings (`outputs.config_changes`: the
  gin file or the bindings changed since), which would otherwise be skipped as done or fail its
  `--resume`. Returns the rounds each run's configuration binds (`experiment.rounds`), by run
  name: a finished run continues to more."""
  import gin  # pylint: disable=g-import-not-at-top
  from fltff.config_checks import gin_binds  # pylint: disable=g-import-not-at-top
  from fltff.errors import ConfigError  # pylint: disable=g-import-not-at-top
  from fltff.simulation.experiment import configure  # pylint: disable=g-import-not-at-top
  from fltff.simulation.outputs import changes_text  # pylint: disable=g-import-not-at-top
  from fltff.simulation.outputs import config_changes  # pylint: disable=g-import-not-at-top

  rounds = {}
  for run in runs:
    try:
      configure([run.gin_file], list(extra_bindings + run.bindings))
      value = gin.query_parameter('experiment.rounds') if gin_binds('experiment.rounds') else 0
      if isinstance(value, int):  # Not a macro's reference.
        rounds[run.name] = value
      recorded = os.path.join(runs_dir, run.name, 'config.gin')
      if os.path.exists(recorded):
        with open(recorded) as f:
          changes = config_changes(f.read(), gin.config_str(), parsed=True)
        if changes:
          raise ConfigError(
              f'its run in {os.path.dirname(recorded)} was computed with other settings than '
              f'{run.gin_file} and the bindings give now ({changes_text(changes)}); move that '
              'run folder away to run it again, or run into another folder.')
    except ConfigError as e:
      raise ConfigError(f'{what} {run.name}: {e}') from None
    finally:
      gin.clear_config()
  return rounds


def error_line(log_path: str) -> str:
  """The last `error:` line of a run's log ('' if none)."""
  with open(log_path, errors='replace') as f:
    errors = [line.strip() for line in f if line.startswith('error: ')]
  return errors[-1] if errors else ''


def _say(text: str) -> None:
  print(f'{time.strftime("%H:%M:%S")} {text}', flush=True)


@dataclasses.dataclass
class Outcome:
  """What `run_plan` did: runs that ended with a non-zero status, and whether a signal (to this
  process, or one that stopped a run) ended the plan early."""
  failed: list[str]
  stopped: bool


def run_plan(plan: Sequence[PlannedRun], runs_dir: str, extra_bindings: tuple[str, ...] = (),
             parallel: int = 1, dry_run: bool = False,
             rounds: Optional[dict[str, int]] = None) -> Outcome:
  """Runs the plan's runs that are not done (`finished`'s `rounds`), in order, up to `parallel`
  at a time, each as its own process (in a process group of its own, so that a Ctrl-C reaches
  it only through here).

  Prints one line per run when it starts (`name: state, pid N`) or is found done, and one when
  it ends (exit status, seconds, its last `error:` line). A first SIGTERM/SIGINT to this process
  starts no further run and sends SIGTERM to each running one by its PID (each stops after its
  current round, checkpointed); a second sends another (each stops at once, after checkpointing
  every completed round). A run stopped by a signal of its own (status 143) ends the plan the
  same way. Returns once every started run has ended.
  """
  pending = []
  for run in plan:
    args, state = command(run, runs_dir, extra_bindings, (rounds or {}).get(run.name))
    if state == 'done' or dry_run:
      _say(f'{run.name}: {state}')
    else:
      pending.append((run, args, state))
  if dry_run or not pending:
    return Outcome([], False)
  os.makedirs(runs_dir, exist_ok=True)
  running: dict[int, tuple[PlannedRun, subprocess.Popen, float, object]] = {}
  signals = []
  failed = []

  def forward(signum, frame):  # pylint: disable=unused-argument
    signals.append(signum)
    pids = sorted(running)
    print(f'warning: signal {signum}: ' + (
        f'stopping the running runs (pid {", ".join(map(str, pids))}) after their current round'
        if len(signals) == 1 else 'stopping the running runs at once') +
          '; no further run starts.', file=sys.stderr, flush=True)
    for pid in pids:
      try:
        os.kill(pid, signal.SIGTERM)
      except ProcessLookupError:
        pass

  previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
  try:
    while pending or running:
      while pending and len(running) < parallel and not signals:
        run, args, state = pending.pop(0)
        log = open(os.path.join(runs_dir, f'{run.name}.log'), 'a')  # pylint: disable=R1732
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                   process_group=0)
        running[process.pid] = (run, process, time.monotonic(), log)
        _say(f'{run.name}: {state}, pid {process.pid}')
      if signals and not running:
        break
      time.sleep(_POLL_SECONDS)
      for pid, (run, process, start, log) in list(running.items()):
        rc = process.poll()
        if rc is None:
          continue
        del running[pid]
        log.close()
        log_path = os.path.join(runs_dir, f'{run.name}.log')
        _say(f'{run.name}: exit {rc} after {time.monotonic() - start:.0f} s'
             f'{"; " + error_line(log_path) if rc else ""}')
        if rc:
          failed.append(run.name)
        if rc == 143 and not signals:  # Stopped by a signal of its own: checkpointed.
          signals.append(signal.SIGTERM)
  finally:
    # Runs left by an exception here are stopped, not orphaned.
    for _, process, _, log in running.values():
      process.send_signal(signal.SIGTERM)
      process.wait()
      log.close()
    for number, handler in previous.items():
      signal.signal(number, handler)
  return Outcome(failed, bool(signals))


def outcome_message(outcome: Outcome, runs_dir: str, again: str) -> Optional[str]:
  """The closing line of a plan that did not finish ('stopped: ...' or 'error: ...'), else
  None; `again` is the command that continues it."""
  if outcome.stopped:
    return (f'stopped: by a signal; the runs stopped are checkpointed ({runs_dir}); '
            f'{again} resumes them.')
  if outcome.failed:
    return (f'error: {len(outcome.failed)} run(s) did not finish: {", ".join(outcome.failed)} '
            f'(see their .log in {runs_dir}; {again} resumes them)')
  return None
