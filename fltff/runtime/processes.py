"""The `worker_binary` processes this program starts and owns, unlike TFF's local context: killed
with their parent (`PR_SET_PDEATHSIG`), logging to a file, stopped by PID (docs/runtime.md)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional

from fltff.errors import RuntimeUnavailableError
from fltff.runtime import heap

_PR_SET_PDEATHSIG = 1

def worker_binary_path() -> str:
  """Path of the C++ `worker_binary` shipped inside the tensorflow-federated wheel."""
  import tensorflow_federated  # pylint: disable=g-import-not-at-top

  path = os.path.join(os.path.dirname(tensorflow_federated.__file__), 'data', 'worker_binary')
  if not os.path.isfile(path):
    raise RuntimeUnavailableError(
        f'TFF worker_binary not found at {path}; reinstall tensorflow-federated==0.87.0.')
  return path


def _die_with_parent() -> None:
  """`preexec_fn`: ask the kernel to SIGKILL the child when its parent dies."""
  with contextlib.suppress(OSError):  # Non-glibc systems: atexit/close() still stop the worker.
    ctypes.CDLL('libc.so.6', use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _spawn(args: list[str], env: dict, **kwargs) -> subprocess.Popen:
  """`Popen(args)` without stdin, killed by the kernel when this program dies: only when started
  from the main thread, as PDEATHSIG fires when the forking *thread* exits."""
  main_thread = threading.current_thread() is threading.main_thread()
  return subprocess.Popen(  # pylint: disable=consider-using-with
      args, stdin=subprocess.DEVNULL, env=env,
      preexec_fn=_die_with_parent if main_thread else None, **kwargs)


def _end(process: subprocess.Popen, sig: int, timeout: float) -> None:
  """Sends `sig` to a running `process`, SIGKILL if it has not exited after `timeout` seconds;
  reaps it."""
  if process.poll() is None:
    process.send_signal(sig)
    try:
      process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      process.kill()
      process.wait()


class WorkerProcess:
  """One `worker_binary` process started and owned by this program."""

  def __init__(self,
               port: Optional[int] = None,
               host: str = '127.0.0.1',
               max_concurrent_computation_calls: int = -1,
               log_path: Optional[str] = None,
               mmap_threshold_kib: int = heap.DEFAULT_MMAP_THRESHOLD_KIB,
               binary: Optional[str] = None):
    import portpicker  # pylint: disable=g-import-not-at-top

    self.port = port or portpicker.pick_unused_port()
    self.address = f'{host}:{self.port}'
    self._log = (  # pylint: disable=consider-using-with
        open(log_path, 'ab') if log_path is not None else tempfile.NamedTemporaryFile(
            'ab', prefix=f'fltff_worker_{self.port}_', suffix='.log', delete=False))
    self.log_path = self._log.name
    self.process = _spawn(
        [binary or worker_binary_path(), f'--port={self.port}',
         f'--max_concurrent_computation_calls={max_concurrent_computation_calls}'],
        heap.worker_environment(mmap_threshold_kib),  # See fltff.runtime.heap.
        stdout=self._log, stderr=subprocess.STDOUT)
    self.pid = self.process.pid
    self.pids = [self.pid]

  def alive(self) -> bool:
    return self.process.poll() is None

  def stop(self, timeout: float = 10.0) -> None:
    """Terminates the worker (SIGINT, then SIGKILL), reaps it and removes an empty log."""
    _end(self.process, signal.SIGINT, timeout)
    self._log.close()
    with contextlib.suppress(OSError):
      if os.path.getsize(self.log_path) == 0:
        os.remove(self.log_path)


class IsolatedWorker:
  """A `worker_binary` (which runs any graph it is sent, on every interface) in a private
  network namespace whose only interface is a private loopback, reached only by a Unix socket
  in a 0700 folder that `fltff.runtime.isolated` relays (docs/multiple-machines.md)."""

  def __init__(self, max_concurrent_computation_calls: int = -1,
               log_path: Optional[str] = None,
               mmap_threshold_kib: int = heap.DEFAULT_MMAP_THRESHOLD_KIB):
    # A Unix socket's path may not exceed 107 bytes: a deep TMPDIR falls back to /tmp.
    base = tempfile.gettempdir()
    if len(os.path.join(base, 'fltff_worker_xxxxxxxx', 'worker.sock')) > 100:
      base = '/tmp'
    self.folder = tempfile.mkdtemp(prefix='fltff_worker_', dir=base)
    self.socket_path = os.path.join(self.folder, 'worker.sock')
    self.address = f'unix:{self.socket_path}'
    self._own_log = log_path is None
    self.log_path = log_path or os.path.join(self.folder, 'worker_binary.log')
    self._log = open(self.log_path, 'ab')  # pylint: disable=consider-using-with
    env = heap.worker_environment(mmap_threshold_kib)
    env.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
    self.process = _spawn(
        ['unshare', '--user', '--map-root-user', '--net', '--', sys.executable, '-m',
         'fltff.runtime.isolated', f'--socket={self.socket_path}',
         f'--worker_binary={worker_binary_path()}',
         f'--max_concurrent_computation_calls={max_concurrent_computation_calls}',
         f'--mmap_threshold_kib={mmap_threshold_kib}', f'--log_file={self.log_path}'],
        env, stdout=subprocess.PIPE, stderr=self._log, text=True)
    self.pid = self.process.pid
    self.worker_pid = None
    # The relay's 'ready <worker_binary pid>', awaited for up to a minute.
    ready = select.select([self.process.stdout], [], [], 60.0)[0]
    words = self.process.stdout.readline().split() if ready else []
    if len(words) != 2 or words[0] != 'ready':
      self.stop()
      detail = ''  # The log's last line, if the folder is still there (a non-empty log).
      with contextlib.suppress(OSError), open(self.log_path, errors='replace') as f:
        detail = next((l.strip() for l in reversed(f.read().splitlines()) if l.strip()), '')
      raise RuntimeUnavailableError(
          'cannot start worker_binary in a private network namespace (`unshare --user '
          '--map-root-user --net`; unprivileged user namespaces may be disabled on this host'
          f'{": " + detail if detail else ""}). Enable them, '
          "use runtime.executor = 'in_process' (no worker at all), or set "
          'runtime.isolate_local_worker = False (worker_binary then listens on every '
          'interface: only behind a firewall).')
    self.worker_pid = int(words[1])

  @property
  def pids(self) -> list[int]:
    """The relay's and `worker_binary`'s (both count towards the worker's memory)."""
    return [self.pid] + ([self.worker_pid] if self.worker_pid else [])

  def alive(self) -> bool:
    return self.process.poll() is None

  def stop(self, timeout: float = 15.0) -> None:
    """Stops the relay and so `worker_binary`; removes the socket, and the folder unless it
    holds a non-empty log of ours (`worker_binary`'s own stop removes an empty one)."""
    _end(self.process, signal.SIGTERM, timeout)
    if self.worker_pid and not wait_for_exit(self.worker_pid, timeout=5.0):
      with contextlib.suppress(ProcessLookupError):
        os.kill(self.worker_pid, signal.SIGKILL)
    self.process.stdout.close()
    self._log.close()
    with contextlib.suppress(OSError):
      os.remove(self.socket_path)
    if (not self._own_log or not os.path.exists(self.log_path)
        or os.path.getsize(self.log_path) == 0):
      shutil.rmtree(self.folder, ignore_errors=True)


def wait_for_exit(pid: int, timeout: float = 10.0) -> bool:
  """True once process `pid` has exited (gone, or a zombie not yet reaped by its parent) within
  `timeout` seconds."""
  deadline = time.monotonic() + timeout
  while True:  # Looked at once even with no time left.
    try:
      with open(f'/proc/{pid}/stat') as f:
        if f.read().split()[2] == 'Z':
          return True
    except OSError:
      return True
    if time.monotonic() >= deadline:
      return False
    time.sleep(0.05)
