"""The `fltff` command: `fltff run|report|sweep|reproduce|bench|list [flags]` (also
`python -m fltff ...`).

Each command is one of the runner's programs (`pipelines/`, installed as `fltff.pipelines`);
`fltff <command> --help` lists its flags.
"""

import importlib
import os
import sys
import time
from typing import Callable, Optional, Sequence

COMMANDS = {
    'run': 'one experiment from gin files: metrics, checkpoints, plots, TensorBoard',
    'report': 'tables (Markdown, CSV, LaTeX) and figures comparing finished runs over seeds',
    'sweep': 'a grid of settings × seeds, one run each (resumable, in parallel), then a report',
    'reproduce': "the planned runs of the papers' settings (results/plan.txt of a checkout)",
    'bench': 'round-time and checkpoint benchmarks, as ratios to a baseline in the same run',
    'list': 'the methods (with their papers), models, data sources and shipped gin configs',
}


def _parse_flags(argv: Sequence[str]) -> list[str]:
  from absl import flags  # pylint: disable=g-import-not-at-top

  try:
    return flags.FLAGS(list(argv))
  except flags.Error as e:
    print(f'error: {e} (--help lists the flags).', file=sys.stderr)
    sys.exit(2)


def run_program(main_fn: Callable[[list[str]], int], argv: Optional[Sequence[str]] = None
                ) -> None:
  """`absl.app.run(main_fn)`, exiting with the status it returns; a bad flag is one `error:`
  line and status 2 (absl prints a FATAL line and a hint, status 1)."""
  from absl import app  # pylint: disable=g-import-not-at-top

  app.run(lambda args: sys.exit(main_fn(args)), argv=argv, flags_parser=_parse_flags)


class StopSignal:
  """A program's stop request, set by a signal handler; `before_exit`: what `fltff run` runs
  before it exits at a second signal.

  A plain flag: `threading.Event.set` in a signal handler takes the lock the interrupted
  `Event.wait` may hold, which hangs the process."""

  def __init__(self):
    self._set = False
    self.before_exit: list[Callable[[], None]] = []

  def set(self) -> None:
    self._set = True

  def is_set(self) -> bool:
    return self._set

  def wait(self, timeout: float) -> bool:
    """`is_set()` after at most `timeout` seconds (sooner once set)."""
    deadline = time.monotonic() + timeout
    while not self._set and time.monotonic() < deadline:
      time.sleep(min(0.05, max(deadline - time.monotonic(), 0.0)))
    return self._set


def main(argv: Optional[Sequence[str]] = None) -> None:
  argv = list(sys.argv if argv is None else argv)
  # The working directory first on `sys.path`, as `python -m fltff` does, so that a gin file's
  # `import my_models` finds the user's module: the installed `fltff` script starts with its own
  # folder there instead. Nothing with `python -P` (PYTHONSAFEPATH), as for `python -m`.
  if not sys.flags.safe_path:
    cwd = os.getcwd()
    if not sys.path or os.path.abspath(sys.path[0] or os.curdir) != cwd:
      sys.path.insert(0, cwd)
  if len(argv) < 2 or argv[1] in ('-h', '--help', 'help'):
    print('usage: fltff <command> [flags]   (fltff <command> --help for its flags)\n\ncommands:')
    print('\n'.join(f'  {name:<10} {what}' for name, what in COMMANDS.items()))
    sys.exit(0 if len(argv) >= 2 else 2)
  command = argv[1]
  if command not in COMMANDS:
    print(f'error: unknown command {command!r}; one of {", ".join(COMMANDS)}.', file=sys.stderr)
    sys.exit(2)
  if command == 'run':  # A missing --gin_file exits before TensorFlow is imported.
    from fltff import resources  # pylint: disable=g-import-not-at-top
    from fltff.errors import ConfigError  # pylint: disable=g-import-not-at-top

    args = argv[2:]
    paths = [a.split('=', 1)[1] for a in args if a.startswith('--gin_file=')]
    try:
      resources.find_gin_files(paths + [b for a, b in zip(args, args[1:]) if a == '--gin_file'])
    except ConfigError as e:
      print(f'error: {e}', file=sys.stderr)
      sys.exit(2)
  try:
    program = importlib.import_module(f'fltff.pipelines.{command}')
  except ModuleNotFoundError as e:
    if e.name not in ('fltff.pipelines', f'fltff.pipelines.{command}'):
      raise
    # A checkout on sys.path that was not pip-installed: the runner is `pipelines`.
    program = importlib.import_module(f'pipelines.{command}')
  from absl import flags  # pylint: disable=g-import-not-at-top

  if {'-h', '--help', '-?'} & set(argv[2:]):
    print(f'{(program.__doc__ or "").strip()}\n\nflags of fltff {command}:\n'
          f'{flags.FLAGS.module_help(program.__name__)}')
    sys.exit(0)
  sys.argv = [f'fltff {command}'] + argv[2:]
  run_program(program.main, sys.argv)
