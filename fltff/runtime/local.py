"""TFF execution contexts whose `worker_binary` processes we own.

TFF's default local context (`tff.backends.native.create_sync_local_cpp_execution_context`)
starts the C++ `worker_binary` lazily and relies on `__del__` to stop it, which fails at
interpreter exit and leaves the worker running (see shared/notes/environment.md). fltff instead
starts the worker itself:

* the child gets `PR_SET_PDEATHSIG(SIGKILL)`, so it dies even if the driver is SIGKILLed;
* its stdout/stderr go to a log file, never to the parent's streams (a worker that inherits a
  pipe blocks the reader of that pipe until it dies);
* `TffRuntime.close()` (called by the context manager, an `atexit` hook and the pipeline's
  SIGTERM/SIGINT handlers) terminates it by PID and waits for it.

The execution context built on top is exactly TFF's own local one: a `RemoteExecutor` talking
gRPC to the worker, wrapped in a `SyncExecutionContext` with TFF's native compiler.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Optional

from absl import logging
import gin
import grpc

from fltff.errors import RuntimeUnavailableError

_PR_SET_PDEATHSIG = 1
_GRPC_OPTIONS = [
    ('grpc.max_message_length', 2**31 - 1),
    ('grpc.max_receive_message_length', 2**31 - 1),
    ('grpc.max_send_message_length', 2**31 - 1),
]


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
  try:
    libc = ctypes.CDLL('libc.so.6', use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
  except OSError:  # Non-glibc systems: atexit/close() still stop the worker.
    pass


class WorkerProcess:
  """One `worker_binary` process started and owned by this program."""

  def __init__(self,
               port: Optional[int] = None,
               host: str = '127.0.0.1',
               max_concurrent_computation_calls: int = -1,
               log_path: Optional[str] = None,
               die_with_parent: bool = True):
    import portpicker  # pylint: disable=g-import-not-at-top

    self.port = port or portpicker.pick_unused_port()
    self.host = host
    if log_path is None:
      fd, log_path = tempfile.mkstemp(prefix=f'fltff_worker_{self.port}_', suffix='.log')
      os.close(fd)
    self.log_path = log_path
    self._log = open(log_path, 'ab')  # pylint: disable=consider-using-with
    args = [
        worker_binary_path(),
        f'--port={self.port}',
        f'--max_concurrent_computation_calls={max_concurrent_computation_calls}',
    ]
    # Only pass preexec_fn from the main thread: PDEATHSIG fires when the *thread* that forked
    # the child exits, so forking from a short-lived thread would kill the worker early.
    use_deathsig = die_with_parent and threading.current_thread() is threading.main_thread()
    self.process = subprocess.Popen(  # pylint: disable=consider-using-with
        args,
        stdin=subprocess.DEVNULL,
        stdout=self._log,
        stderr=subprocess.STDOUT,
        preexec_fn=_die_with_parent if use_deathsig else None,
        close_fds=True)
    self.pid = self.process.pid

  @property
  def address(self) -> str:
    return f'{self.host}:{self.port}'

  def alive(self) -> bool:
    return self.process.poll() is None

  def stop(self, timeout: float = 10.0) -> None:
    """Terminates the worker (SIGINT, then SIGKILL) and reaps it."""
    if self.process.poll() is None:
      try:
        os.kill(self.pid, signal.SIGINT)
        self.process.wait(timeout=timeout)
      except subprocess.TimeoutExpired:
        os.kill(self.pid, signal.SIGKILL)
        self.process.wait()
      except ProcessLookupError:
        pass
    if not self._log.closed:
      self._log.close()


def _connect_stub(address: str, timeout: float):
  """A `tff.framework.RemoteExecutorGrpcStub` for `address`, once the worker answers."""
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

  channel = grpc.insecure_channel(address, _GRPC_OPTIONS)
  try:
    grpc.channel_ready_future(channel).result(timeout=timeout)
  except grpc.FutureTimeoutError as e:
    channel.close()
    raise RuntimeUnavailableError(
        f'TFF worker at {address} did not answer within {timeout:.0f} s.') from e
  return channel, tff.framework.RemoteExecutorGrpcStub(channel)


def _sync_context_for_stub(stub, default_num_clients: int = 0):
  """TFF's own local C++ context construction, over a stub we control."""
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top
  from tensorflow_federated.python.core.environments.tensorflow_frontend import tensorflow_computation  # pylint: disable=g-import-not-at-top

  def stack_fn(cardinalities):
    if cardinalities.get(tff.CLIENTS) is None:
      cardinalities[tff.CLIENTS] = default_num_clients
    ex = tff.framework.RemoteExecutor(stub)
    ex.set_cardinalities(cardinalities)
    return ex

  factory = tff.framework.ResourceManagingExecutorFactory(executor_stack_fn=stack_fn)
  return tff.framework.SyncExecutionContext(
      executor_fn=factory,
      compiler_fn=tff.backends.native.desugar_and_transform_to_native,
      transform_args=tensorflow_computation.transform_args,
      transform_result=tensorflow_computation.transform_result,
  )


class TffRuntime:
  """Owns a TFF execution context and the worker processes behind it.

  With no `workers`, starts one local `worker_binary` (TFF's local C++ runtime). `close()` is
  idempotent and is also registered with `atexit`.
  """

  def __init__(self, workers: Sequence[str] = (), connect_timeout: float = 60.0):
    import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

    self._tff = tff
    self._owned: list[WorkerProcess] = []
    self._channels = []
    self._closed = False
    self.workers = list(workers)
    if len(self.workers) > 1:
      raise RuntimeUnavailableError(
          'Several remote workers are not supported by this version of fltff yet; '
          'pass a single worker address (runtime.workers=["host:port"]).')
    atexit.register(self.close)
    try:
      if not self.workers:
        worker = WorkerProcess()
        self._owned.append(worker)
        address = worker.address
      else:
        address = self.workers[0]
      channel, stub = _connect_stub(address, connect_timeout)
      self._channels.append(channel)
      self.context = _sync_context_for_stub(stub)
      tff.framework.set_default_context(self.context)
      logging.info('TFF runtime ready (%s worker at %s).',
                   'local' if self._owned else 'remote', address)
    except BaseException:
      self.close()
      raise

  @property
  def worker_pids(self) -> list[int]:
    return [w.pid for w in self._owned]

  def close(self) -> None:
    """Replaces the default context, closes channels and stops the owned workers."""
    if self._closed:
      return
    self._closed = True
    try:
      # A fresh context object whose executor is never created: nothing is started by it.
      self._tff.framework.set_default_context(
          _sync_context_for_stub(stub=None))
    except Exception:  # pylint: disable=broad-except
      pass
    # Channels are not closed explicitly: the stub's connectivity-polling thread would raise
    # 'Channel closed!' in the background. They go with the process; the worker is stopped.
    self._channels = []
    for worker in self._owned:
      worker.stop()
    self._owned = []

  def __enter__(self) -> 'TffRuntime':
    return self

  def __exit__(self, *exc) -> None:
    self.close()


@gin.configurable('runtime')
def make_runtime(workers: Sequence[str] = (), connect_timeout: float = 60.0) -> TffRuntime:
  """Builds the experiment's runtime: local C++ worker (default) or a remote TFF worker."""
  return TffRuntime(workers=workers, connect_timeout=connect_timeout)


@contextlib.contextmanager
def local_runtime() -> Iterator[TffRuntime]:
  """Context manager: a local TFF runtime for the duration of the block."""
  runtime = TffRuntime()
  try:
    yield runtime
  finally:
    runtime.close()


def install_signal_handlers() -> None:
  """Turns SIGTERM (and SIGINT) into `SystemExit`, so `finally`/atexit cleanup runs.

  A driver killed by SIGTERM without a handler exits without running Python cleanup and would
  leave any worker it did not start with PDEATHSIG running.
  """

  def handler(signum, frame):  # pylint: disable=unused-argument
    raise SystemExit(128 + signum)

  if threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def wait_for_exit(pid: int, timeout: float = 10.0) -> bool:
  """True once process `pid` no longer exists (test helper)."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    try:
      os.kill(pid, 0)
    except ProcessLookupError:
      return True
    # A zombie child of ours still answers kill(0); check its state.
    try:
      with open(f'/proc/{pid}/stat') as f:
        if f.read().split()[2] == 'Z':
          return True
    except OSError:
      return True
    time.sleep(0.05)
  return False

