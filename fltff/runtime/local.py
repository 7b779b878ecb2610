"""TFF execution contexts whose `worker_binary` processes we own.

TFF's default local context stops its worker in `__del__`, which fails at interpreter exit and
leaves it running. fltff starts the worker with `PR_SET_PDEATHSIG(SIGKILL)` (it dies even with
a SIGKILLed driver), its output in a log file (an inherited pipe would block its reader until
the worker dies), and `TffRuntime.close()` (context manager, `atexit`, signal handlers) stops it.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging as std_logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import _thread
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Optional

from absl import logging
import gin
import grpc

from fltff.config_checks import check_choice
from fltff.config_checks import check_number
from fltff.errors import ConfigError
from fltff.errors import RuntimeUnavailableError
from fltff.errors import StopNow
from fltff.errors import warn
from fltff.runtime import heap

_PR_SET_PDEATHSIG = 1
# After a lost worker, how long each remaining one has to answer before it counts as lost too.
RECONNECT_TIMEOUT_S = 5.0
# Adaptive RPC deadline (`rpc_timeout=None`): FIRST_RPC_TIMEOUT_S until a round completes (the
# first also compiles), then RPC_TIMEOUT_FACTOR x the slowest round, at least the floor.
FIRST_RPC_TIMEOUT_S = 3600.0
RPC_TIMEOUT_FACTOR = 10.0
RPC_TIMEOUT_FLOOR_S = 300.0
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
    self.host = host
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

  @property
  def address(self) -> str:
    return f'{self.host}:{self.port}'

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
  """A `worker_binary` in a private network namespace, reached only by a Unix socket.

  `worker_binary` runs any TensorFlow graph it is sent and listens on every interface; in its
  own unprivileged namespace (`unshare --user --map-root-user --net`) the only one is a private
  loopback, and the socket's folder has mode 0700: neither the network nor another local user
  reaches it. `fltff.runtime.isolated` runs inside and relays the socket.
  """

  def __init__(self, max_concurrent_computation_calls: int = -1,
               log_path: Optional[str] = None,
               mmap_threshold_kib: int = heap.DEFAULT_MMAP_THRESHOLD_KIB):
    import sys  # pylint: disable=g-import-not-at-top

    # A Unix socket's path may not exceed 107 bytes: a deep TMPDIR falls back to /tmp.
    base = tempfile.gettempdir()
    if len(os.path.join(base, 'fltff_worker_xxxxxxxx', 'worker.sock')) > 100:
      base = '/tmp'
    self.folder = tempfile.mkdtemp(prefix='fltff_worker_', dir=base)
    self.socket_path = os.path.join(self.folder, 'worker.sock')
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
    first_line = []  # The relay's 'ready <worker_binary pid>', awaited for up to a minute.
    reader = threading.Thread(target=lambda: first_line.append(self.process.stdout.readline()),
                              daemon=True)
    reader.start()
    reader.join(60.0)
    words = ''.join(first_line).split()
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
  def address(self) -> str:
    return f'unix:{self.socket_path}'

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


class WorkerLostError(RuntimeUnavailableError):
  """A TFF worker (`address`) stopped answering; not a `tff.framework.RetryableError`, which
  TFF retries forever (a dead worker would hang the driver)."""

  def __init__(self, address: str, detail: str):
    super().__init__(f'TFF worker {address} was lost ({detail}).')
    self.address = address


_LOST_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
               grpc.StatusCode.CANCELLED)


def _fail_fast_stub_class():
  """`RemoteExecutorGrpcStub` whose RPCs have a deadline and fail fast on a lost worker."""
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

  class FailFastStub(tff.framework.RemoteExecutorGrpcStub):
    """Raises `WorkerLostError` instead of TFF's endlessly retried `RetryableGRPCError`."""

    def __init__(self, channel, address: str, rpc_timeout: float):  # pylint: disable=super-init-not-called
      # Not TFF's __init__: its connectivity subscription (for an unused `is_ready`) starts a
      # thread holding channel and stub for good: a replaced worker's channel would leak.
      from tensorflow_federated.proto.v0 import executor_pb2_grpc  # pylint: disable=g-import-not-at-top

      self._stub = executor_pb2_grpc.ExecutorGroupStub(channel)
      self.address = address
      self._rpc_timeout = rpc_timeout
      self.lost = None  # The status code that lost the worker: later calls fail at once.

    def _call(self, method: str, request):
      # Once one call found the worker lost, the others fail at once: TFF's tasks still pending
      # (the round's other values) and its disposals would each wait a deadline of their own,
      # so a hung worker was lost after several deadlines instead of one.
      if self.lost is None:
        try:
          return getattr(self._stub, method)(request, timeout=self._rpc_timeout)
        except grpc.RpcError as e:
          code = e.code() if isinstance(e, grpc.Call) else None
          if code not in _LOST_CODES:
            raise
          self.lost = code.name
      if method.startswith('Dispose'):
        # Nothing to free on a lost worker; TFF disposes from garbage-collection finalizers,
        # where an error would print a traceback at exit.
        return None
      raise WorkerLostError(self.address, self.lost) from None

  # TFF's stub methods, each the RPC of its name in CamelCase through `_call`.
  for name in ('get_executor', 'create_value', 'create_struct', 'create_call', 'create_selection',
               'compute', 'dispose', 'dispose_executor'):
    rpc = name.title().replace('_', '')
    setattr(FailFastStub, name, lambda self, request, rpc=rpc: self._call(rpc, request))
  return FailFastStub


def _connect_stub(address: str, timeout: float, rpc_timeout: float,
                  credentials: Optional[grpc.ChannelCredentials], server_name: Optional[str]):
  """A fail-fast executor stub for `address` once the worker answers; mutual TLS with
  `credentials` (`server_name`: the name to check in the worker's certificate)."""
  if credentials is None:
    channel = grpc.insecure_channel(address, _GRPC_OPTIONS)
  else:
    options = list(_GRPC_OPTIONS) + ([('grpc.ssl_target_name_override', server_name)]
                                     if server_name else [])
    channel = grpc.secure_channel(address, credentials, options)
  deadline = time.monotonic() + timeout
  ready = grpc.channel_ready_future(channel)
  detail = ''
  try:
    while True:
      try:
        ready.result(timeout=max(min(1.0, deadline - time.monotonic()), 0.0))
        break
      except grpc.FutureTimeoutError:
        pass
      detail = _connection_error(channel)
      refusal = _refusal(detail, tls=credentials is not None)
      if refusal:
        raise RuntimeUnavailableError(f'TFF worker at {address} {refusal}')
      if time.monotonic() >= deadline:
        raise RuntimeUnavailableError(
            f'TFF worker at {address} did not answer within {timeout:.0f} s'
            f'{f" ({detail})" if detail else ""}; is `python -m fltff.runtime.worker '
            '--port=...` running there and the port open?')
  except RuntimeUnavailableError:
    ready.cancel()
    channel.close()
    raise
  return channel, _fail_fast_stub_class()(channel, address, rpc_timeout)


def _connection_error(channel: grpc.Channel) -> str:
  """gRPC's last error connecting `channel` ('' if none): the detail of an RPC that does not
  wait for the connection (any method: a worker answers UNIMPLEMENTED once connected)."""
  try:
    channel.unary_unary('/fltff.Probe/Connect')(b'', timeout=1.0, wait_for_ready=False)
  except grpc.RpcError as e:
    if isinstance(e, grpc.Call) and e.code() == grpc.StatusCode.UNAVAILABLE:
      detail = e.details() or ''
      return detail.split('last error: ', 1)[-1]
  return ''


def _refusal(detail: str, tls: bool) -> Optional[str]:
  """What a connection error of gRPC's says about TLS, as the end of a sentence on the worker;
  None unless it is a TLS failure, which no wait mends."""
  text = detail.lower()
  if 'certificate_verify_failed' in text:
    return ("failed the TLS handshake: its certificate is not signed by runtime.tls_ca_file's "
            f'CA, or has expired ({detail}).')
  if 'peer name' in text:
    return ('failed the TLS handshake: its certificate does not name the host dialled; set '
            f'runtime.tls_server_name to a name it holds ({detail}).')
  if 'wrong_version_number' in text:
    return ('does not speak TLS: it was started with --insecure_plaintext (then set '
            'runtime.insecure_plaintext = True, on a trusted network only) or is no fltff '
            f'worker ({detail}).')
  if 'socket closed' in text:
    if tls:
      return ("closed the connection at the TLS handshake: it refused this driver's "
              "certificate (runtime.tls_cert_file is not signed by the worker's "
              '--tls_client_ca).')
    return ('closed the plaintext connection at once: it expects mutual TLS (a fltff worker '
            'started without --insecure_plaintext); set runtime.tls_ca_file, '
            'runtime.tls_cert_file and runtime.tls_key_file.')
  if 'handshake' in text or 'ssl' in text:
    return f'failed the TLS handshake ({detail}).'
  return None


_COMPILED = weakref.WeakKeyDictionary()


def _compile_once(comp):
  """TFF's native compilation of `comp`, shared by all contexts (it depends on none): each
  context's `CompilerPipeline` would redo it, and keep its graphs, after every recycle."""
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

  if comp not in _COMPILED:
    _COMPILED[comp] = tff.backends.native.desugar_and_transform_to_native(comp)
  return _COMPILED[comp]


def _context_for_stub(stub, asynchronous: bool = False):
  """TFF's own local C++ context construction (its sync or async context), over a stub we
  control."""
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top
  from tensorflow_federated.python.core.environments.tensorflow_frontend import tensorflow_computation  # pylint: disable=g-import-not-at-top

  def stack_fn(cardinalities):
    if cardinalities.get(tff.CLIENTS) is None:
      cardinalities[tff.CLIENTS] = 0
    ex = tff.framework.RemoteExecutor(stub)
    ex.set_cardinalities(cardinalities)
    return ex

  context = (tff.framework.AsyncExecutionContext if asynchronous
             else tff.framework.SyncExecutionContext)
  return context(executor_fn=tff.framework.ResourceManagingExecutorFactory(stack_fn),
                 compiler_fn=_compile_once,
                 transform_args=tensorflow_computation.transform_args,
                 transform_result=tensorflow_computation.transform_result)


def _not_a_lost_worker_task(record) -> bool:
  """Filter dropping asyncio's 'Task exception was never retrieved' for a lost worker (TFF's
  mergeable context never awaits the other sub-rounds' failures; the runtime reports the loss
  once)."""
  exc = (record.exc_info or (None, None, None))[1]
  message = record.getMessage()
  return not (message.startswith('Task exception was never retrieved')
              and ('WorkerLostError' in message or isinstance(exc, RuntimeUnavailableError)))


class TffRuntime:
  """Owns a TFF execution context and the worker processes behind it (`make_runtime`).

  No `workers`: a local `worker_binary`. One: TFF's remote executor on it. Several: TFF's
  mergeable context, each round split into one sub-round per worker and the partial aggregates
  merged (hence fltff's single-pass aggregators). `call` fails over, dropping a lost worker (or
  restarting a local one). `close()` is idempotent and registered with `atexit`.
  """

  def __init__(self, workers: Sequence[str] = (), connect_timeout: float = 60.0,
               rpc_timeout: Optional[float] = None, max_retries: int = 2,
               log_dir: Optional[str] = None,
               credentials: Optional[grpc.ChannelCredentials] = None,
               server_name: Optional[str] = None, recycle_every: int = 0,
               executor: str = 'tff_cpp', device: Optional[str] = None,
               mmap_threshold_kib: int = heap.DEFAULT_MMAP_THRESHOLD_KIB,
               isolate_local_worker: bool = True):
    import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

    self._tff = tff
    std_logging.getLogger('asyncio').addFilter(_not_a_lost_worker_task)  # Once: same object.
    self._owned: list = []  # `IsolatedWorker`s (or `WorkerProcess`es, not isolated).
    self.isolate_local_worker = isolate_local_worker
    self._channels = []
    self._closed = False
    self.remote = bool(workers)
    self.workers = list(workers)
    self.lost: list[str] = []
    self.connect_timeout = connect_timeout
    self.adaptive_rpc_timeout = rpc_timeout is None
    self.rpc_timeout = FIRST_RPC_TIMEOUT_S if rpc_timeout is None else float(rpc_timeout)
    self._slowest_round = 0.0
    self.max_retries = max_retries
    self.log_dir = log_dir
    self._credentials = credentials if workers else None  # Remote workers only.
    self._server_name = server_name
    self.recycle_every = int(recycle_every)
    self.executor = executor
    self.device = device
    self.vectorised = False  # Set by `bind`: whether the method's clients are vectorised.
    self.mmap_threshold_kib = int(mmap_threshold_kib)
    self._stubs = []
    self.context = None
    atexit.register(self.close)
    if executor == 'auto':
      return  # The executor is chosen for the method: `bind`.
    if executor == 'tff_cpp':
      heap.fix_mmap_threshold(self.mmap_threshold_kib)
    self._start()

  def _start(self) -> None:
    """Installs the context of `self.executor` ('tff_cpp' or 'in_process')."""
    if self.executor == 'in_process':
      from fltff.runtime.in_process import InProcessContext  # pylint: disable=g-import-not-at-top

      self.context = InProcessContext(device=self.device)
      self._tff.framework.set_default_context(self.context)
      logging.info('TFF runtime ready: in-process executor, device %s%s.', self.device or 'auto',
                   ', vectorised clients' if self.vectorised else '')
      return
    try:
      if not self.remote:
        self._start_worker()
      self._install_context()
    except BaseException:
      self.close()
      raise

  @property
  def runs_in_process(self) -> bool:
    """Whether client work can run in this process: 'in_process', or 'auto' before `bind`."""
    return self.executor in ('auto', 'in_process')

  def bind(self, algorithm) -> None:
    """Places `algorithm`'s rounds (the driver calls this first): 'auto' runs vectorised client
    work, and any with `device` '/GPU:0', in process, the rest on TFF's C++ runtime. Raises
    `ConfigError` for vectorised client work on 'tff_cpp'."""
    self.vectorised = bool(algorithm.vectorized)
    if not self.vectorised:  # Vectorised rounds here run faster on glibc's adaptive threshold.
      heap.fix_mmap_threshold(self.mmap_threshold_kib)
    if self.executor != 'auto':
      if self.vectorised and self.executor != 'in_process':
        raise ConfigError(f"{algorithm.name}'s clients are vectorised: they train in this "
                          f"process, which needs runtime.executor = 'auto' or 'in_process'.")
      return
    self.executor = ('in_process' if self.vectorised or self.device == '/GPU:0'
                     else 'tff_cpp')
    logging.info("runtime.executor = 'auto': %s for %s.", self.description, algorithm.name)
    self._start()

  @property
  def description(self) -> str:
    """The executor in words, e.g. for the run's summary."""
    if self.executor == 'in_process':
      return ('the in-process executor, vectorised clients' if self.vectorised
              else 'the in-process executor')
    if self.executor == 'tff_cpp':
      return f"TFF's C++ runtime ({'remote workers' if self.remote else 'local worker_binary'})"
    return 'not chosen yet (auto)'

  def _start_worker(self) -> None:
    """Starts the local worker: an `IsolatedWorker` (or a `WorkerProcess` on all interfaces if
    not `isolate_local_worker`) logging to `<log_dir>/tff_worker.log` or a temporary file."""
    log_path = None if self.log_dir is None else os.path.join(self.log_dir, 'tff_worker.log')
    if self.isolate_local_worker:
      worker = IsolatedWorker(log_path=log_path, mmap_threshold_kib=self.mmap_threshold_kib)
    else:
      worker = WorkerProcess(log_path=log_path, mmap_threshold_kib=self.mmap_threshold_kib)
      warn(f'runtime.isolate_local_worker = False: the local worker_binary listens on port '
           f'{worker.port} of every interface, plaintext and unauthenticated; anyone who '
           'reaches it can run code on this host as you.')
    self._owned = [worker]
    self.workers = [worker.address]

  def _install_context(self, timeout: Optional[float] = None) -> None:
    """Installs TFF's context over the workers; with `timeout`, a silent one raises
    `WorkerLostError`."""
    stubs = []
    for address in self.workers:
      try:
        channel, stub = _connect_stub(address, timeout or self.connect_timeout,
                                      self.rpc_timeout, self._credentials, self._server_name)
      except RuntimeUnavailableError:
        if timeout is None:
          raise
        raise WorkerLostError(address, f'no answer within {timeout:.0f} s') from None
      self._channels.append(channel)
      stubs.append(stub)
    self._stubs = stubs
    if len(stubs) == 1:
      self.context = _context_for_stub(stubs[0])
    else:  # TFF's mergeable-computation context: each round's clients split across the workers.
      self.context = self._tff.backends.native.create_mergeable_comp_execution_context(
          [_context_for_stub(s, asynchronous=True) for s in stubs])
    self._tff.framework.set_default_context(self.context)
    logging.info('TFF runtime ready: %s worker(s) %s.', 'remote' if self.remote else 'local',
                 ', '.join(self.workers))

  def program_context(self):
    """A `NativeFederatedContext` for TFF's program API, to install for the program (then
    reinstall `self.context`); one worker only, as TFF's mergeable context is synchronous."""

    if self.executor != 'tff_cpp':
      raise ConfigError("program_context needs TFF's C++ runtime (runtime.executor = 'tff_cpp').")
    if len(self._stubs) != 1:
      raise ConfigError(f'program_context needs one worker, this runtime has '
                        f'{len(self._stubs)}.')
    return self._tff.program.NativeFederatedContext(
        _context_for_stub(self._stubs[0], asynchronous=True))

  @property
  def worker_pids(self) -> list[int]:
    """The processes of the local workers (an isolated worker's relay and worker_binary)."""
    return [pid for w in self._owned for pid in getattr(w, 'pids', [w.pid])]

  def call(self, fn, *args, **kwargs):
    """`fn(*args, **kwargs)` with failover across workers (see class docstring)."""
    for attempt in range(self.max_retries + 1):
      try:
        return fn(*args, **kwargs)
      except WorkerLostError as e:
        self._handle_lost(e, attempt)
    raise AssertionError('unreachable')

  def _handle_lost(self, error: WorkerLostError, attempt: int) -> None:
    if attempt >= self.max_retries:
      raise RuntimeUnavailableError(
          f'{error} Gave up after {self.max_retries} retries (runtime.max_retries); completed '
          'rounds are checkpointed: restart the worker(s) and rerun with --resume.') from None
    if not self.remote:
      self._restart_local_worker()
      logging.warning('%s Restarted the local worker at %s.', error, self.workers[0])
      return
    lost = [error.address]
    while lost:  # Drop the lost worker(s), reconnect to the others.
      self._release_connections()
      self.lost.append(lost.pop())
      self.workers = [w for w in self.workers if w not in self.lost]
      if not self.workers:
        raise RuntimeUnavailableError(
            f'{error} No TFF worker is left (lost: {", ".join(self.lost)}); completed rounds '
            'are checkpointed: restart the workers and rerun with --resume.') from None
      try:
        self._install_context(timeout=min(self.connect_timeout, RECONNECT_TIMEOUT_S))
      except WorkerLostError as e:
        lost.append(e.address)
    logging.warning('%s Repeating the computation on %s.', error, ', '.join(self.workers))

  def _restart_local_worker(self) -> None:
    for worker in self._owned:
      worker.stop()
    self._start_worker()
    self._release_connections()
    self._install_context()

  def _release_connections(self) -> None:
    """Closes the channels to the current workers and frees what TFF compiled for them."""
    for channel in self._channels:
      with contextlib.suppress(Exception):
        channel.close()
    # The context's event-loop thread references its runner, whose `__del__` (which stops
    # the loop) therefore never runs: do its work here.
    runner = getattr(getattr(self, 'context', None), '_async_runner', None)
    if runner is not None:
      with contextlib.suppress(Exception):
        runner._finalizer(runner._event_loop, runner._thread)  # pylint: disable=protected-access
    self._channels, self._stubs, self.context = [], [], None
    # TFF 0.87's `CompilerPipeline.compile` cache is one `lru_cache` for all pipelines: else a
    # replaced context's compilations stay until 128 newer entries evict them. The live context
    # recompiles once.
    from tensorflow_federated.python.core.impl.execution_contexts import compiler_pipeline  # pylint: disable=g-import-not-at-top

    compiler_pipeline.CompilerPipeline.compile.cache_clear()

  def after_round(self, round_num: int, round_seconds: Optional[float] = None) -> None:
    """After each round: adapts the RPC deadline to `round_seconds`, trims the heap and, with
    `recycle_every` = K > 0, replaces the local `worker_binary` every K rounds (its memory,
    which TFF's C++ runtime grows each round, starts over; all state is in the driver, so
    results are unchanged). Remote workers are never recycled."""
    if self.adaptive_rpc_timeout and round_seconds:
      self._slowest_round = max(self._slowest_round, float(round_seconds))
      self.rpc_timeout = max(RPC_TIMEOUT_FLOOR_S, RPC_TIMEOUT_FACTOR * self._slowest_round)
      for stub in self._stubs:
        stub._rpc_timeout = self.rpc_timeout  # pylint: disable=protected-access
    if heap.threshold_fixed():
      heap.trim()
    if (self.recycle_every > 0 and not self.remote and self.executor == 'tff_cpp'
        and round_num % self.recycle_every == 0):
      self._restart_local_worker()

  def close(self) -> None:
    """Replaces the default context and stops the owned workers."""
    if self._closed:
      return
    self._closed = True
    with contextlib.suppress(Exception):
      release_default_context()
    self._release_connections()
    for worker in self._owned:
      worker.stop()
    self._owned = []

  def __enter__(self) -> 'TffRuntime':
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def release_default_context() -> None:
  """Replaces TFF's import-time default context, whose `ServiceManager.__del__` fails at exit
  ("'NoneType' object has no attribute 'Popen'"), by one whose executor, never created,
  starts nothing: for programs exiting without a `TffRuntime`, and its `close()`."""
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

  tff.framework.set_default_context(_context_for_stub(stub=None))


def check_worker_address(address) -> None:
  """Raises a one-line `ConfigError` unless `address` is `host:port` (IPv6 as `[addr]:port`)."""

  if not isinstance(address, str) or not address.strip():
    raise ConfigError(f'runtime.workers entries must be "host:port" strings, got {address!r}.')
  host, sep, port = address.strip().rpartition(':')
  if not sep or not port or not host or host.endswith(':') or (':' in host and not host.startswith('[')):
    raise ConfigError(f'runtime.workers entry {address!r} has no port; write host:port, e.g. '
                      f'\'{address.strip()}:8000\' (the port the worker printed when it '
                      'started).')
  if not port.isdigit() or not 0 < int(port) < 65536:
    raise ConfigError(f'runtime.workers entry {address!r} has port {port!r}; a port is a '
                      'number from 1 to 65535.')


@gin.configurable('runtime', denylist=['log_dir'])
def make_runtime(workers: Sequence[str] = (), connect_timeout: float = 60.0,
                 rpc_timeout: Optional[float] = None, max_retries: int = 2,
                 log_dir: Optional[str] = None,
                 tls_ca_file: Optional[str] = None, tls_cert_file: Optional[str] = None,
                 tls_key_file: Optional[str] = None, tls_server_name: Optional[str] = None,
                 insecure_plaintext: bool = False, recycle_every: int = 0,
                 executor: str = 'auto', device: str = 'auto',
                 mmap_threshold_kib: int = heap.DEFAULT_MMAP_THRESHOLD_KIB,
                 isolate_local_worker: bool = True) -> TffRuntime:
  """Builds the experiment's runtime; `ConfigError` for an invalid setting.

  Args:
    workers: `host:port` of running TFF workers (`python -m fltff.runtime.worker`); empty:
      the local C++ runtime.
    connect_timeout: Seconds to wait for each worker to answer at start.
    rpc_timeout: Seconds after which a worker silent in an RPC counts as lost. None: an hour
      until a round completes, then 10 x the slowest round, at least 5 minutes.
    max_retries: How often a round is repeated after losing a worker.
    log_dir: Folder of the local worker's log (`tff_worker.log`); None: a temporary file.
    tls_ca_file: Mutual TLS to remote workers (the default): the CA of the workers'
      certificates (PEM).
    tls_cert_file: This driver's certificate (PEM), signed by the workers' client CA.
    tls_key_file: This driver's private key (PEM).
    tls_server_name: The name to check in the workers' certificates, if not their host.
    insecure_plaintext: Plaintext to workers started with `--insecure_plaintext`: only on a
      trusted network.
    recycle_every: Replace the local worker_binary every this many rounds (0: never), bounding
      its memory; results unchanged.
    executor: 'auto': the in-process executor for vectorised client work without `workers` or
      `recycle_every`, else 'tff_cpp' (TFF's C++ runtime, local or remote). 'in_process': the
      same computations in this process (`fltff.runtime.in_process`; equal results, slower
      client by client on CPUs).
    device: 'auto' (TensorFlow's choice), 'cpu' or 'gpu' (in process only: TFF's C++ runtime
      never uses a GPU, TFF issues 3709, 4600).
    mmap_threshold_kib: glibc serves blocks of this many KiB or more with mmap in the local
      worker and in the driver (with 'auto' or 'in_process': from `bind`, and only for clients
      that are not vectorised), which then trims its heap after each round
      (`fltff.runtime.heap`; results unchanged). 0: glibc's default.
    isolate_local_worker: Run the local `worker_binary` in a private network namespace,
      behind a Unix socket only this user can open (`IsolatedWorker`; needs unprivileged user
      namespaces). False: it listens in plaintext on every interface, where anyone reaching
      the port can run code on this host; only behind a firewall.
  """
  if not isinstance(isolate_local_worker, bool):
    raise ConfigError(f'runtime.isolate_local_worker must be True or False, got '
                      f'{isolate_local_worker!r}.')
  check_number('runtime.rpc_timeout', rpc_timeout, allow_none=True, low=0, open_low=True,
               hint='seconds; None: adaptive')
  check_number('runtime.recycle_every', recycle_every, integer=True, low=0, hint='0: never')
  check_number('runtime.mmap_threshold_kib', mmap_threshold_kib, integer=True, low=0,
               hint="0: glibc's default")
  if executor == 'auto' and (workers or recycle_every):
    executor = 'tff_cpp'  # Only TFF's C++ runtime has workers to reach or to recycle.
  tf_device = check_executor(executor, device, workers, recycle_every)
  from fltff.runtime import tls  # pylint: disable=g-import-not-at-top

  if isinstance(workers, str):
    workers = [workers]
  for address in workers:
    check_worker_address(address)
  credentials = None
  tls_files = (tls_ca_file, tls_cert_file, tls_key_file)
  if workers and not insecure_plaintext:
    if not all(tls_files):
      raise ConfigError('Remote workers are reached over mutual TLS: set runtime.tls_ca_file, '
                        'runtime.tls_cert_file and runtime.tls_key_file (README, "Running on '
                        'several machines"), or runtime.insecure_plaintext = True for workers '
                        'started with --insecure_plaintext on a trusted network.')
    credentials = tls.channel_credentials(*tls_files)
  elif workers and any(tls_files):
    raise ConfigError('runtime.insecure_plaintext = True and TLS files are both set: choose one.')
  return TffRuntime(workers=workers, connect_timeout=connect_timeout, rpc_timeout=rpc_timeout,
                    max_retries=max_retries, log_dir=log_dir, credentials=credentials,
                    server_name=tls_server_name, recycle_every=recycle_every,
                    executor=executor, device=tf_device,
                    mmap_threshold_kib=mmap_threshold_kib,
                    isolate_local_worker=isolate_local_worker)


EXECUTORS = ('auto', 'tff_cpp', 'in_process')
DEVICES = ('auto', 'cpu', 'gpu')


def check_executor(executor: str, device: str, workers: Sequence[str] = (),
                   recycle_every: int = 0) -> Optional[str]:
  """Validates `runtime.executor`/`runtime.device`; returns the TensorFlow device (or None)."""
  check_choice('runtime.executor', executor, EXECUTORS)
  check_choice('runtime.device', device, DEVICES)
  if executor == 'tff_cpp':
    if device == 'gpu':
      raise ConfigError("runtime.device = 'gpu' needs runtime.executor = 'in_process': TFF's "
                        'C++ runtime never uses a GPU (TFF issues 3709, 4600).')
    return None
  if workers:
    raise ConfigError("runtime.executor = 'in_process' runs everything in this process: remove "
                      "runtime.workers, or use runtime.executor = 'tff_cpp' for remote workers.")
  if recycle_every:
    raise ConfigError("runtime.recycle_every recycles TFF's local worker_binary; the in-process "
                      'executor has none (set it to 0).')
  if device == 'gpu':
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    if not tf.config.list_physical_devices('GPU'):
      raise ConfigError("runtime.device = 'gpu' but TensorFlow sees no GPU (TensorFlow 2.14 "
                        'needs an NVIDIA driver and the CUDA 11.8 / cuDNN 8.7 libraries: '
                        '`make setup-gpu` in a checkout installs them, `python -m '
                        "pipelines.gpu_check` says what is missing; or use 'auto').")
    return '/GPU:0'
  return '/CPU:0' if device == 'cpu' else None


@contextlib.contextmanager
def local_runtime(executor: str = 'tff_cpp', device: str = 'auto') -> Iterator[TffRuntime]:
  """Context manager: a local TFF runtime for the duration of the block."""
  runtime = TffRuntime(executor=executor, device=check_executor(executor, device))
  try:
    yield runtime
  finally:
    runtime.close()


class StopSignal:
  """Set by the first SIGTERM/SIGINT; `before_exit`: what a second one runs before the exit.

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


def wait_for_exit(pid: int, timeout: float = 10.0) -> bool:
  """True once process `pid` has exited (gone, or a zombie not yet reaped by its parent) within
  `timeout` seconds."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    try:
      with open(f'/proc/{pid}/stat') as f:
        if f.read().split()[2] == 'Z':
          return True
    except OSError:
      return True
    time.sleep(0.05)
  return False

