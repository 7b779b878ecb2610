"""Errors for bad input or environment, which the pipeline reports as one line and an exit code.

`pipelines.run` catches `FltffError` and prints `error: <message>` without a traceback; anything
else is a bug and keeps its traceback. Faults a run survives (a damaged checkpoint skipped, an
exploding loss) are one `warning:` line (`warn`).
"""

import sys


class FltffError(Exception):
  """Base class for errors caused by the user's input or environment, not by a bug."""


class ConfigError(FltffError, ValueError):
  """An experiment's configuration is invalid (unknown name, impossible value)."""


class DataError(FltffError):
  """A data source is missing, unprepared or unusable (e.g. TFDS data offline)."""


class DivergenceError(FltffError):
  """Training produced a non-finite loss or weights; the last good round is checkpointed."""


class RuntimeUnavailableError(FltffError):
  """The TFF runtime (local worker_binary or a remote worker) cannot be reached."""


class StopRequested(FltffError):
  """The run was asked to stop (SIGTERM/SIGINT); completed rounds are checkpointed."""


class StopNow(SystemExit):
  """A second SIGTERM/SIGINT: the run stops at once (a `SystemExit`, so nothing swallows it)."""


class CheckpointError(FltffError):
  """No intact checkpoint is left to resume from."""


def warn(message: str) -> None:
  """Prints one `warning: <message>` line on stderr (a fault the run survives)."""
  print(f'warning: {message}', file=sys.stderr, flush=True)
