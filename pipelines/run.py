r"""Runs one experiment from gin files.

  fltff run --gin_file=gin_configs/quickstart.gin \
      [--gin_bindings='experiment.rounds = 5'] [--output_dir=runs/x] [--resume]

(also `python -m fltff run`, and `python -m pipelines.run` in a checkout). A relative
--gin_file is looked up in the working directory, then among the configs fltff ships;
`include` lines beside the including file, in the working directory, then among those configs.
`fltff list` shows what a configuration can name: the methods (with their papers), models, data
sources and the shipped configs.

Bad input (unknown gin names, badly typed numbers, an unwritable or earlier run's output folder,
impossible partitions, missing data offline, divergence, no intact checkpoint, an unreachable
worker) ends with one `error: ...` line and exit status 2; completed rounds stay in the
checkpoint. SIGTERM/SIGINT ends with one `stopped: ...` line and exit status 143.
"""

import _thread
import os
import re
import signal
import sys
import threading
import time
from typing import Callable, Optional

# Silences TensorFlow's C++ start-up chatter (CUDA plugin registration on CPU machines).
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

# TensorFlow must be imported before absl's app.run: imported inside it, Keras' Flatten
# layer fails to build ("Attempt to convert a value (None)") (TF 2.14).
import tensorflow as tf  # pylint: disable=g-import-not-at-top,wrong-import-position,unused-import
from absl import flags  # pylint: disable=g-import-not-at-top,wrong-import-position
from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top,wrong-import-position

from fltff.cli import StopSignal  # pylint: disable=g-import-not-at-top,wrong-import-position
from fltff import runtime  # pylint: disable=g-import-not-at-top,wrong-import-position
from fltff.runtime import heap  # pylint: disable=g-import-not-at-top,wrong-import-position
from fltff.config_checks import short_gin_message  # pylint: disable=g-import-not-at-top,wrong-import-position
from fltff.errors import FltffError  # pylint: disable=g-import-not-at-top,wrong-import-position
from fltff.errors import StopNow  # pylint: disable=g-import-not-at-top,wrong-import-position
from fltff.errors import StopRequested  # pylint: disable=g-import-not-at-top,wrong-import-position
from fltff.errors import warn  # pylint: disable=g-import-not-at-top,wrong-import-position
from fltff.simulation import Checkpointer  # pylint: disable=g-import-not-at-top,wrong-import-position
from fltff.simulation import run_experiment  # pylint: disable=g-import-not-at-top,wrong-import-position
from fltff.simulation.checkpoint import kept_message  # pylint: disable=g-import-not-at-top,wrong-import-position
from fltff.simulation.experiment import configure  # pylint: disable=g-import-not-at-top,wrong-import-position
from fltff.simulation.outputs import prepare_output_dir  # pylint: disable=g-import-not-at-top,wrong-import-position
from fltff.simulation.outputs import release_output_dir  # pylint: disable=g-import-not-at-top,wrong-import-position
from fltff.simulation.outputs import remove_if_unused  # pylint: disable=g-import-not-at-top,wrong-import-position

_GIN_FILES = flags.DEFINE_multi_string('gin_file', [], 'Gin config file(s) of the experiment.')
_GIN_BINDINGS = flags.DEFINE_multi_string('gin_bindings', [],
                                          "Gin bindings overriding the files, e.g. "
                                          "'experiment.rounds = 5'.")
_OUTPUT_DIR = flags.DEFINE_string('output_dir', None,
                                  'Output directory (default: runs/<gin file name>).')
_RESUME = flags.DEFINE_bool('resume', False, 'Continue from the latest checkpoint.')
_ALLOW_CONFIG_CHANGE = flags.DEFINE_bool(
    'allow_config_change', False,
    'With --resume: continue although the configuration differs from the run\'s config.gin '
    '(beyond experiment.rounds, experiment.checkpoint_every, runtime.* and data paths); the '
    'differences are recorded in config_changes.txt.')

EXIT_USER_ERROR = 2
EXIT_STOPPED = 128 + 15  # As a process ended by SIGTERM reports it.


def _kept(output_dir: str) -> str:
  """Which rounds the output folder's checkpoints keep, and how to continue."""
  checkpointer = Checkpointer(output_dir)
  last = checkpointer.intact_round() or 0
  return (f'{kept_message(checkpointer.directory, last)}'
          f'{": rerun with --resume to continue" if last else ""}.')


def install_signal_handlers(
    on_second: Optional[Callable[[int], None]] = None) -> StopSignal:
  """SIGTERM/SIGINT: the first asks for a stop after the current round, a second stops now.

  Returns the `StopSignal` the first sets. A second runs its `before_exit` callables, then
  `on_second(signum)` (which may end the process with `os._exit`: an exception raised inside
  TFF's asyncio/gRPC machinery or a GC callback can be swallowed), else raises `StopNow`.

  Python runs a handler only when the main thread runs Python: while TensorFlow computes a
  round there (the in-process executor), two signals would merge into one late call. So every
  signal is counted as it arrives, on a thread of its own (`_SignalThread`); the second is
  acted on by the main thread if it answers within `SECOND_SIGNAL_GRACE_S`, else by that thread
  (with `on_second`; without one, `StopNow` waits for the main thread).
  """
  stop = StopSignal()
  received = []  # Signals counted so far.
  acting = threading.Lock()  # Taken once, by whichever thread acts on the second signal.

  def second(signum: int, main_thread: bool) -> None:
    if not acting.acquire(blocking=False):
      return
    for save in list(stop.before_exit):
      try:
        save()
      except Exception as e:  # pylint: disable=broad-except
        warn(f'could not checkpoint the last completed round: {type(e).__name__}: {e}')
    if on_second is not None:
      on_second(signum)
    if main_thread:
      raise StopNow(128 + signum)
    acting.release()  # `StopNow` is the main thread's to raise, when it runs Python again.
    _thread.interrupt_main(signum)

  def counted(signum: int) -> None:  # On the signal thread, once per signal.
    received.append(signum)
    if len(received) == 1:
      stop.set()
      warn(f'signal {signum}: stopping after the current round (send it again to stop at '
           'once).')
    elif len(received) == 2:
      _thread.interrupt_main(signum)  # Runs `handler` if the main thread runs Python.
      deadline = time.monotonic() + SECOND_SIGNAL_GRACE_S
      while time.monotonic() < deadline and not acting.locked():
        time.sleep(0.01)
      if not acting.locked():
        second(signum, main_thread=False)

  def handler(signum, frame):  # pylint: disable=unused-argument
    if len(received) >= 2:
      second(signum, main_thread=True)

  if threading.current_thread() is threading.main_thread():
    _SignalThread.start(counted, handler)
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
  return stop


# How long a second signal waits for the main thread to act on it, before its own thread does.
SECOND_SIGNAL_GRACE_S = 1.0


class _SignalThread:
  """One daemon thread reading the signals' wakeup fd (`signal.set_wakeup_fd`), to which the
  C-level handler writes every signal's number as it arrives, whatever the main thread does;
  it passes each to the latest `install_signal_handlers`' `counted` while that one's handler
  is installed."""

  _write_fd: Optional[int] = None
  _pid: Optional[int] = None  # A forked child has the fd but not the thread.
  _target: tuple = (None, None)

  @classmethod
  def start(cls, counted: Callable[[int], None], handler) -> None:
    cls._target = (counted, handler)
    if cls._pid != os.getpid():
      cls._pid = os.getpid()
      read_fd, cls._write_fd = os.pipe()
      os.set_blocking(cls._write_fd, False)
      threading.Thread(target=cls._run, args=(read_fd,), name='fltff-signals',
                       daemon=True).start()
    signal.set_wakeup_fd(cls._write_fd, warn_on_full_buffer=False)

  @classmethod
  def _run(cls, read_fd: int) -> None:
    while True:
      for signum in os.read(read_fd, 64):
        counted, handler = cls._target
        if counted is not None and signal.getsignal(signum) is handler:
          counted(signum)


def _unbound_parameters(error: RuntimeError) -> Optional[str]:
  """`a.x, a.y` for gin's error on a configurable called without its required parameters
  bound ("Required bindings for `a` not provided in config: ['x', 'y']"); None for any other."""
  found = re.fullmatch(r"Required bindings for `([\w.]+)` not provided in config: \[(.*)\]",
                       str(error).strip())
  if not found:
    return None
  names = re.findall(r"'([^']+)'", found.group(2))
  return ', '.join(f'{found.group(1)}.{n}' for n in names) + (' is' if len(names) == 1 else ' are')


def main(argv) -> int:
  del argv
  heap.pooled_tensors()  # Before the first TensorFlow op (fltff.runtime.heap).
  # Progress lines are ours (stdout); library INFO chatter (TFF, Keras) is not.
  absl_logging.set_verbosity(absl_logging.WARNING)
  output_dir = _OUTPUT_DIR.value or os.path.join(
      'runs', os.path.splitext(os.path.basename((_GIN_FILES.value or ['run'])[0]))[0])
  rt = None
  created = failed = reported = False

  def stop_now(signum: int) -> None:
    """A second signal: say what is checkpointed (unless the stop was already reported),
    stop our workers, exit at once."""
    del signum
    try:
      if not reported:
        print(f'stopped: at once by a second signal. {_kept(output_dir)}', file=sys.stderr,
              flush=True)
    finally:
      try:
        if rt is not None:
          rt.close()
      finally:
        os._exit(EXIT_STOPPED)  # pylint: disable=protected-access

  stop_event = install_signal_handlers(on_second=stop_now)
  try:
    configure(_GIN_FILES.value, _GIN_BINDINGS.value)
    created = prepare_output_dir(output_dir, _RESUME.value)  # Before the data and the worker.
    rt = runtime.make_runtime(log_dir=output_dir)
    summary = run_experiment(output_dir=output_dir, resume=_RESUME.value, runtime=rt,
                             stop_event=stop_event,
                             allow_config_change=_ALLOW_CONFIG_CHANGE.value)
  except StopRequested as e:
    print(f'stopped: {short_gin_message(e)}', file=sys.stderr, flush=True)
    reported = True  # A second signal during the shutdown below then only hastens it.
    return EXIT_STOPPED
  except StopNow:
    print(f'stopped: at once by a second signal. {_kept(output_dir)}', file=sys.stderr)
    return EXIT_STOPPED
  except FltffError as e:
    print(f'error: {short_gin_message(e)}', file=sys.stderr)
    failed = True
    return EXIT_USER_ERROR
  except RuntimeError as e:
    unbound = _unbound_parameters(e)
    if unbound is None:
      raise
    print(f'error: {unbound} not bound: bind them in the gin file or with --gin_bindings '
          '(fltff list shows the shipped configs).', file=sys.stderr)
    failed = True
    return EXIT_USER_ERROR
  except OSError as e:  # The machine's: a full disk, a folder made read-only, ...
    reason = os.strerror(e.errno) if e.errno else short_gin_message(e)
    where = f' ({e.filename})' if e.filename else ''
    print(f'error: {reason}{where}. {_kept(output_dir)}', file=sys.stderr)
    return EXIT_USER_ERROR
  finally:
    if rt is not None:
      rt.close()
    else:
      runtime.release_default_context()
    if failed and created:
      # A run that wrote nothing leaves no folder behind (its worker's log is closed by now).
      remove_if_unused(output_dir)
    release_output_dir(output_dir)  # The run is over (main may be called again in-process).
  head = summary['headline']
  value = head['value']
  where = f' (round {head["round"]})' if 'round' in head else ''
  print(f'done: {summary["rounds_completed"]} rounds, {head["protocol"]} accuracy by '
        f'{head["statistic"]}: {value if value is None else round(value, 4)}{where}; outputs in '
        f'{output_dir}')
  return 0


if __name__ == '__main__':
  from fltff.cli import run_program  # pylint: disable=g-import-not-at-top
  run_program(main)
