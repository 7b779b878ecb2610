"""fltff programs (`pipelines.run`, `pipelines.report`, ...) as processes of their own, forked
from a server that imported TensorFlow, TFF and fltff once per test process.

A program started here is a real process, as `python -m pipelines.run ...` is: its own PID,
exit status, signals, file descriptors, environment and worker processes. What it skips is the
interpreter's start and the imports (about 8 CPU-seconds of each of the suite's many runs); the
interpreter's entry point itself (`python -m`, the installed `fltff` command) is run as a user
runs it by `test_docs.py` and `test_install.py`.
"""

import atexit
import importlib
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import subprocess
import sys
import tempfile
import time

from helpers import REPO
from helpers import pipeline_env

# What the server imports before it forks: everything a program imports before its `main`, and
# matplotlib, which every run imports at its end for its plots (its backend is chosen there).
PRELOAD = ['tensorflow', 'tensorflow_federated', 'matplotlib.pyplot', 'fltff', 'fltff.simulation',
           'pipelines.run', 'pipelines.bench', 'pipelines.report', 'pipelines.reproduce',
           'pipelines.sweep']

_context = None


def _server():
  """This test process's fork server, started on first use with the programs' environment
  (variables read once at import, such as TensorFlow's log level, are the programs')."""
  global _context
  if _context is None:
    context = multiprocessing.get_context('forkserver')
    context.set_forkserver_preload(PRELOAD)
    saved = dict(os.environ)
    os.environ.update(pipeline_env())
    try:
      multiprocessing.forkserver.ensure_running()
    finally:
      os.environ.clear()
      os.environ.update(saved)
    _context = context
  return _context


def _program_main(module, args, cwd, env, stdout, stderr):
  """The child: the program's environment, folder and output files, then its flags and its
  `main` under absl as `python -m module args` runs them, and the interpreter's exit hooks."""
  from fltff.cli import run_program as run  # pylint: disable=g-import-not-at-top

  os.environ.clear()
  os.environ.update(env)
  os.chdir(cwd)
  for fd, path in ((1, stdout), (2, stderr)):
    if path is None:
      path = os.devnull
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(target, fd)
    os.close(target)
  program = importlib.import_module(module)
  if hasattr(program, 'define_flags'):  # Its flags are defined when it runs, not at import.
    program.define_flags()
  code = 0
  try:
    run(program.main, [module, *args])  # As its `__main__` runs it: a bad flag is one line.
  except SystemExit as e:
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
  finally:
    atexit._run_exitfuncs()  # pylint: disable=protected-access
    sys.stdout.flush()
    sys.stderr.flush()
  os._exit(code)  # pylint: disable=protected-access


class Program:
  """A started program, with `subprocess.Popen`'s calls the tests use: `pid`, `poll`, `wait`,
  `communicate` (its stdout and stderr as text), `send_signal`, `terminate`, `kill`."""

  def __init__(self, module: str, *args: str, env=None, cwd: str = REPO,
               capture: bool = True):
    self.args = [module, *args]
    self._dir = tempfile.mkdtemp(prefix='fltff_program_')
    self._out = os.path.join(self._dir, 'stdout') if capture else None
    self._err = os.path.join(self._dir, 'stderr') if capture else None
    self._process = _server().Process(
        target=_program_main,
        args=(module, list(args), cwd, dict(pipeline_env() if env is None else env),
              self._out, self._err))
    self._process.start()
    self.pid = self._process.pid
    self.returncode = None

  def poll(self):
    if self.returncode is None and not self._process.is_alive():
      self._process.join()
      self.returncode = self._process.exitcode
    return self.returncode

  def wait(self, timeout=None):
    self._process.join(timeout)
    if self.poll() is None:
      raise subprocess.TimeoutExpired(self.args, timeout)
    return self.returncode

  def _read(self, path):
    if path is None:
      return None
    if not os.path.exists(path):  # The child has not opened it yet.
      return ''
    with open(path, errors='replace') as f:
      return f.read()

  def output(self):
    """`(stdout, stderr)` so far, as text."""
    return self._read(self._out), self._read(self._err)

  def communicate(self, timeout=None):
    self.wait(timeout)
    return self.output()

  def send_signal(self, sig):
    if self.poll() is None:
      os.kill(self.pid, sig)

  def terminate(self):
    self.send_signal(signal.SIGTERM)

  def kill(self):
    self.send_signal(signal.SIGKILL)

  def __del__(self):
    for path in (self._out, self._err):
      if path is not None and os.path.exists(path):
        os.unlink(path)
    if os.path.isdir(self._dir):
      os.rmdir(self._dir)


def run_program(module: str, *args: str, env=None, cwd: str = REPO,
                timeout: float = 600) -> subprocess.CompletedProcess:
  """`python -m module args` to its end, as `subprocess.run(..., capture_output=True,
  text=True, timeout=timeout)` returns it; killed and `TimeoutExpired` after `timeout`."""
  program = Program(module, *args, env=env, cwd=cwd)
  try:
    program.wait(timeout)
  except subprocess.TimeoutExpired:
    program.kill()
    program.wait(30)
    raise
  stdout, stderr = program.output()
  return subprocess.CompletedProcess(program.args, program.returncode, stdout, stderr)


def wait_until(predicate, program: Program, timeout: float, what: str):
  """Polls `predicate()` until true; fails with the program's stderr if the program ends or
  `timeout` passes first."""
  deadline = time.monotonic() + timeout
  while not predicate():
    ended = program.poll() is not None
    if ended and predicate():  # It did what was awaited, then ended.
      return
    if ended or time.monotonic() > deadline:
      raise AssertionError(f'{what}: exit {program.poll()}; {program.output()[1][-3000:]}')
    time.sleep(0.2)
