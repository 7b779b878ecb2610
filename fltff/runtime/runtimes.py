"""Where a run's TFF computations execute: one `Runtime` class per executor, the one the
`runtime.*` settings name built by `make_runtime`."""

from __future__ import annotations

import atexit
import contextlib
import logging as std_logging
import os
from collections.abc import Sequence
from typing import Optional

from absl import logging
import gin
import grpc

from fltff.config_checks import check_choice
from fltff.config_checks import check_device
from fltff.config_checks import check_number
from fltff.errors import ConfigError
from fltff.errors import RuntimeUnavailableError
from fltff.errors import warn
from fltff.runtime import channels
from fltff.runtime import heap
from fltff.runtime import tls
from fltff.runtime.processes import IsolatedWorker
from fltff.runtime.processes import WorkerProcess

# After a lost worker, how long each remaining one has to answer before it counts as lost too.
RECONNECT_TIMEOUT_S = 5.0
# Adaptive RPC deadline (`rpc_timeout=None`): FIRST_RPC_TIMEOUT_S until a round completes (the
# first also compiles), then RPC_TIMEOUT_FACTOR x the slowest round, at least the floor.
FIRST_RPC_TIMEOUT_S = 3600.0
RPC_TIMEOUT_FACTOR = 10.0
RPC_TIMEOUT_FLOOR_S = 300.0


class Runtime(contextlib.AbstractContextManager):
  """A TFF execution context (`context`, TFF's default) and what it owns; `close()` (also a
  context manager, and at exit) stops it.

  `place(algorithm)` returns the runtime that runs `algorithm`'s rounds, `ConfigError` where
  its client work cannot run there; then `call(fn, ...)` runs each computation (repeated where
  a worker was lost), `after_round` follows each round and `description` says where they run.
  """

  description = ''  # The executor in words, e.g. for the run's summary.
  auto_vectorises = True  # Whether `experiment.client_work = 'auto'` vectorises here.
  per_client_on_cpp = True  # Whether TFF's client-by-client work runs on its C++ runtime.

  def __init__(self, device: Optional[str] = None,
               mmap_threshold_kib: int = heap.DEFAULT_MMAP_THRESHOLD_KIB):
    self.device = device  # The TensorFlow device of in-process computations (None: any).
    self.mmap_threshold_kib = int(mmap_threshold_kib)
    self.context = None
    self._closed = False
    atexit.register(self.close)

  @property
  def worker_pids(self) -> list[int]:  # The processes of the workers this runtime owns.
    return []

  def place(self, algorithm, keep_trained: bool = False) -> 'Runtime':
    """This runtime, for `algorithm`'s client work; fixes glibc's mmap threshold (`heap`) for
    client work that is not vectorised (vectorised rounds run faster on the adaptive one).
    `keep_trained`: the driver reads each participant's trained model (`trained_local`)."""
    if not algorithm.vectorized:
      heap.fix_mmap_threshold(self.mmap_threshold_kib)
    return self

  def call(self, fn, *args, **kwargs):
    """`fn(*args, **kwargs)`: a computation in this runtime's context."""
    return fn(*args, **kwargs)

  def after_round(self, round_num: int, round_seconds: Optional[float] = None) -> None:
    """After each round: trims the heap where its threshold is fixed (`heap`)."""
    if heap.threshold_fixed():
      heap.trim()

  def program_context(self):
    raise ConfigError("program_context needs TFF's C++ runtime (runtime.executor = 'tff_cpp').")

  def close(self) -> None:
    """Replaces TFF's default context and stops what this runtime owns (idempotent)."""
    if self._closed:
      return
    self._closed = True
    with contextlib.suppress(Exception):
      channels.release_default_context()
    self._stop()

  def _stop(self) -> None:
    pass

  def __exit__(self, *exc) -> None:
    self.close()


class InProcessRuntime(Runtime):
  """The in-process executor (`fltff.runtime.in_process.InProcessContext`) on `device`."""

  description = 'the in-process executor'
  per_client_on_cpp = False

  def __init__(self, device: Optional[str] = None,
               mmap_threshold_kib: int = heap.DEFAULT_MMAP_THRESHOLD_KIB):
    import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top
    from fltff.runtime.in_process import InProcessContext  # pylint: disable=g-import-not-at-top

    context = InProcessContext(device=device)  # First: it checks the device.
    super().__init__(device, mmap_threshold_kib)
    self.context = context
    tff.framework.set_default_context(self.context)
    logging.info('TFF runtime ready: in-process executor, device %s.', device or 'auto')

  def place(self, algorithm, keep_trained: bool = False) -> Runtime:
    if algorithm.vectorized:
      self.description = 'the in-process executor, vectorised clients'
    return super().place(algorithm)


class WorkerRuntime(Runtime):
  """TFF's C++ runtime on `worker_binary` workers (`workers`, reached by gRPC). One worker:
  TFF's remote executor on it; several: TFF's mergeable context, each round split into one
  sub-round per worker and the partial aggregates merged (hence fltff's single-pass
  aggregators). `call` repeats a computation whose worker was lost after `_recover`, up to
  `max_retries` times; the repeat is exact, as a round's inputs are deterministic. Mutual TLS
  with `credentials` (None: plaintext; `server_name`: the name to check in the certificates).
  Subclasses define `_recover(error)`, which makes the context whole again or raises
  `RuntimeUnavailableError`."""

  def __init__(self, workers: Sequence[str] = (), connect_timeout: float = 60.0,
               rpc_timeout: Optional[float] = None, max_retries: int = 2,
               mmap_threshold_kib: int = heap.DEFAULT_MMAP_THRESHOLD_KIB,
               credentials: Optional[grpc.ChannelCredentials] = None,
               server_name: Optional[str] = None):
    super().__init__(None, mmap_threshold_kib)
    std_logging.getLogger('asyncio').addFilter(channels.not_a_lost_worker_task)  # Same object.
    heap.fix_mmap_threshold(self.mmap_threshold_kib)
    self.workers = list(workers)
    self.connect_timeout = connect_timeout
    self.adaptive_rpc_timeout = rpc_timeout is None
    self.rpc_timeout = FIRST_RPC_TIMEOUT_S if rpc_timeout is None else float(rpc_timeout)
    self._slowest_round = 0.0
    self.max_retries = max_retries
    self._credentials, self._server_name = credentials, server_name
    self._channels, self._stubs, self.worker_contexts = [], [], []
    self.driver_context = None
    self.groups = None  # The `WorkerGroups` of the placed vectorised client work.
    try:
      self._start_worker()
      self._connect()
    except BaseException:
      self.close()
      raise

  def _start_worker(self) -> None:
    """Starts the worker this runtime owns, if any, and sets `workers`."""

  def _connect(self, timeout: Optional[float] = None) -> None:
    """Installs TFF's context over the workers; with `timeout`, a silent one raises
    `channels.WorkerLostError`."""
    import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

    for address in self.workers:
      try:
        channel, stub = channels.connect_stub(address, timeout or self.connect_timeout,
                                              self.rpc_timeout, self._credentials,
                                              self._server_name)
      except RuntimeUnavailableError:
        if timeout is None:
          raise
        raise channels.WorkerLostError(address, f'no answer within {timeout:.0f} s') from None
      self._channels.append(channel)
      self._stubs.append(stub)
    # One synchronous context a worker, which vectorised groups call from a thread each
    # (`groups.WorkerGroups`): TFF 0.87's remote executor blocks its event loop on every gRPC
    # call, so the mergeable context's sub-rounds run one after another.
    self.worker_contexts = [channels.context_for_stub(s) for s in self._stubs]
    if len(self._stubs) == 1:
      self.context = self.worker_contexts[0]
    else:  # TFF's mergeable-computation context: each round's clients split across the workers.
      self.context = tff.backends.native.create_mergeable_comp_execution_context(
          [channels.context_for_stub(s, asynchronous=True) for s in self._stubs])
    tff.framework.set_default_context(self.driver_context or self.context)
    logging.info('TFF runtime ready: worker(s) %s.', ', '.join(self.workers))

  def place(self, algorithm, keep_trained: bool = False) -> Runtime:
    """This runtime; vectorised client work trains as groups on the workers (`groups`), the
    rest of its rounds in this process (`driver_context`, `fltff.learning.groups`)."""
    import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top
    from fltff.learning import groups as groups_lib  # pylint: disable=g-import-not-at-top

    self.groups = self.driver_context = None
    if algorithm.vectorized:
      self.groups = groups_lib.WorkerGroups(algorithm.vectorized_work(), self, keep_trained)
      self.driver_context = groups_lib.DriverContext(self.groups)
    tff.framework.set_default_context(self.driver_context or self.context)
    return super().place(algorithm)

  @property
  def description(self) -> str:
    """The executor and, for vectorised client work, how many clients each call trains."""
    if self.groups is None:
      return self.executor_name
    workers = f'{len(self.workers)} worker{"s" if len(self.workers) > 1 else ""}'
    sizes = self.groups.last_sizes  # Of the last round.
    if not sizes:
      return f'{self.executor_name}, vectorised clients: one call per worker ({workers})'
    per_call = f'{min(sizes)}' if min(sizes) == max(sizes) else f'{min(sizes)}-{max(sizes)}'
    return f'{self.executor_name}, vectorised clients: {per_call} clients per call on {workers}'

  def program_context(self):
    """A `NativeFederatedContext` for TFF's program API, to install for the program (then
    reinstall `self.context`); one worker only, as TFF's mergeable context is synchronous."""
    import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

    if len(self._stubs) != 1:
      raise ConfigError(f'program_context needs one worker, this runtime has '
                        f'{len(self._stubs)}.')
    return tff.program.NativeFederatedContext(
        channels.context_for_stub(self._stubs[0], asynchronous=True))

  def call(self, fn, *args, **kwargs):
    for attempt in range(self.max_retries + 1):
      try:
        return fn(*args, **kwargs)
      except channels.WorkerLostError as e:
        if attempt >= self.max_retries:
          raise RuntimeUnavailableError(
              f'{e} Gave up after {self.max_retries} retries (runtime.max_retries); completed '
              'rounds are checkpointed: restart the worker(s) and rerun with --resume.') from None
        self._recover(e)
    raise AssertionError('unreachable')

  def after_round(self, round_num: int, round_seconds: Optional[float] = None) -> None:
    """Also adapts the RPC deadline to `round_seconds` (`rpc_timeout=None`)."""
    if self.adaptive_rpc_timeout and round_seconds:
      self._slowest_round = max(self._slowest_round, float(round_seconds))
      self.rpc_timeout = max(RPC_TIMEOUT_FLOOR_S, RPC_TIMEOUT_FACTOR * self._slowest_round)
      for stub in self._stubs:
        stub._rpc_timeout = self.rpc_timeout  # pylint: disable=protected-access
    super().after_round(round_num, round_seconds)

  def _release_connections(self) -> None:
    """Closes the channels to the current workers and frees what TFF compiled for them."""
    for channel in self._channels:
      with contextlib.suppress(Exception):
        channel.close()
    # A context's event-loop thread references its runner, whose `__del__` (which stops the
    # loop) therefore never runs: do its work here.
    for context in {id(c): c for c in (self.context, *self.worker_contexts)}.values():
      runner = getattr(context, '_async_runner', None)
      if runner is not None:
        with contextlib.suppress(Exception):
          runner._finalizer(runner._event_loop, runner._thread)  # pylint: disable=protected-access
    self._channels, self._stubs, self.context, self.worker_contexts = [], [], None, []
    # TFF 0.87's `CompilerPipeline.compile` cache is one `lru_cache` for all pipelines: else a
    # replaced context's compilations stay until 128 newer entries evict them. The live context
    # recompiles once.
    from tensorflow_federated.python.core.impl.execution_contexts import compiler_pipeline  # pylint: disable=g-import-not-at-top

    compiler_pipeline.CompilerPipeline.compile.cache_clear()

  _stop = _release_connections


class LocalWorkerRuntime(WorkerRuntime):
  """TFF's C++ runtime on a `worker_binary` on this host, started and owned here: an
  `IsolatedWorker` (not `isolated`: a `WorkerProcess` listening on every interface) logging to
  `<log_dir>/tff_worker.log` or a temporary file; restarted when lost, and replaced every
  `recycle_every` rounds (0: never) with unchanged results (docs/runtime.md)."""

  executor_name = "TFF's C++ runtime (local worker_binary)"
  auto_vectorises = False  # Pinned by `runtime.executor = 'tff_cpp'` or `recycle_every`.

  def __init__(self, log_dir: Optional[str] = None, isolated: bool = True,
               recycle_every: int = 0, **kwargs):
    self.log_dir = log_dir
    self.isolated = isolated
    self.recycle_every = int(recycle_every)
    self._worker = None
    super().__init__(**kwargs)

  @property
  def worker_pids(self) -> list[int]:
    """An isolated worker's relay and worker_binary, or the worker_binary."""
    return self._worker.pids if self._worker is not None else []

  def _start_worker(self) -> None:
    log_path = None if self.log_dir is None else os.path.join(self.log_dir, 'tff_worker.log')
    process = IsolatedWorker if self.isolated else WorkerProcess
    self._worker = process(log_path=log_path, mmap_threshold_kib=self.mmap_threshold_kib)
    if not self.isolated:
      warn(f'runtime.isolate_local_worker = False: the local worker_binary listens on port '
           f'{self._worker.port} of every interface, plaintext and unauthenticated; anyone who '
           'reaches it can run code on this host as you.')
    self.workers = [self._worker.address]

  def _recover(self, error: Optional[channels.WorkerLostError] = None) -> None:
    """Replaces the worker: after `error`, or to recycle it."""
    self._worker.stop()
    self._start_worker()
    self._release_connections()
    self._connect()
    if error is not None:
      logging.warning('%s Restarted the local worker at %s.', error, self.workers[0])

  def after_round(self, round_num: int, round_seconds: Optional[float] = None) -> None:
    super().after_round(round_num, round_seconds)
    if self.recycle_every > 0 and round_num % self.recycle_every == 0:
      self._recover()

  def _stop(self) -> None:
    super()._stop()
    if self._worker is not None:
      self._worker.stop()
      self._worker = None


class RemoteWorkersRuntime(WorkerRuntime):
  """TFF's C++ runtime on running workers (`python -m fltff.runtime.worker`) at `workers`
  (`host:port`). A lost worker is dropped and the computation repeated on the others; their
  processes are not this program's to stop."""

  executor_name = "TFF's C++ runtime (remote workers)"

  def __init__(self, workers: Sequence[str], **kwargs):
    self.lost: list[str] = []
    super().__init__(workers, **kwargs)

  def _recover(self, error: channels.WorkerLostError) -> None:
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
        self._connect(timeout=min(self.connect_timeout, RECONNECT_TIMEOUT_S))
      except channels.WorkerLostError as e:
        lost.append(e.address)
    logging.warning('%s Repeating the computation on %s.', error, ', '.join(self.workers))


class AutoRuntime(Runtime):
  """`runtime.executor = 'auto'`: `place` starts the in-process executor for vectorised client
  work (or any, on a GPU `device`), else a `LocalWorkerRuntime` (`local`: its settings)."""

  def __init__(self, device: Optional[str] = None,
               mmap_threshold_kib: int = heap.DEFAULT_MMAP_THRESHOLD_KIB, **local):
    super().__init__(device, mmap_threshold_kib)
    self.per_client_on_cpp = device != '/GPU:0'
    self._local = local
    self.placed: Optional[Runtime] = None

  def place(self, algorithm, keep_trained: bool = False) -> Runtime:
    self._stop()  # The runtime placed before, if any.
    if algorithm.vectorized or not self.per_client_on_cpp:
      self.placed = InProcessRuntime(self.device, self.mmap_threshold_kib)
    else:
      self.placed = LocalWorkerRuntime(mmap_threshold_kib=self.mmap_threshold_kib, **self._local)
    self.placed = self.placed.place(algorithm, keep_trained)
    logging.info("runtime.executor = 'auto': %s for %s.", self.placed.description,
                 algorithm.name)
    return self.placed

  def _stop(self) -> None:
    if self.placed is not None:
      self.placed.close()


@gin.configurable('runtime', denylist=['log_dir'])
def make_runtime(workers: Sequence[str] = (), connect_timeout: float = 60.0,
                 rpc_timeout: Optional[float] = None, max_retries: int = 2,
                 log_dir: Optional[str] = None,
                 tls_ca_file: Optional[str] = None, tls_cert_file: Optional[str] = None,
                 tls_key_file: Optional[str] = None, tls_server_name: Optional[str] = None,
                 insecure_plaintext: bool = False, recycle_every: int = 0,
                 executor: str = 'auto', device: str = 'auto',
                 mmap_threshold_kib: int = heap.DEFAULT_MMAP_THRESHOLD_KIB,
                 isolate_local_worker: bool = True) -> Runtime:
  """The experiment's runtime, of the class its settings name (docs/runtime.md,
  docs/multiple-machines.md); `ConfigError` for an invalid setting.

  Args:
    workers: `host:port` of running workers (`python -m fltff.runtime.worker`); empty: this host.
    connect_timeout: Seconds to wait for each worker to answer at start (inf: as long as it takes).
    rpc_timeout: Seconds before a worker silent in an RPC counts as lost; None: adaptive.
    max_retries: How often a round is repeated after losing a worker.
    log_dir: Folder of the local worker's log (`tff_worker.log`); None: a temporary file.
    tls_ca_file: Mutual TLS to remote workers: the CA of their certificates (PEM).
    tls_cert_file: This driver's certificate (PEM), signed by the workers' client CA.
    tls_key_file: This driver's private key (PEM).
    tls_server_name: The name to check in the workers' certificates, if not their host.
    insecure_plaintext: Plaintext to workers started with `--insecure_plaintext`.
    recycle_every: Replace the local worker_binary every this many rounds (0: never).
    executor: 'auto', 'tff_cpp' (TFF's C++ runtime) or 'in_process' (this process).
    device: 'auto', 'cpu' or 'gpu' (in process only: TFF issues 3709, 4600).
    mmap_threshold_kib: glibc's fixed mmap threshold (`fltff.runtime.heap`); 0: glibc's default.
    isolate_local_worker: Run the local `worker_binary` in a private network namespace
      (`IsolatedWorker`); False: it listens in plaintext on every interface.
  """
  for name, value in (('isolate_local_worker', isolate_local_worker),
                      ('insecure_plaintext', insecure_plaintext)):
    if not isinstance(value, bool):
      raise ConfigError(f'runtime.{name} must be True or False, got {value!r}.')
  check_number('runtime.connect_timeout', connect_timeout, low=0, open_low=True, hint='seconds',
               allow_inf=True)  # inf: wait for the workers as long as it takes.
  check_number('runtime.max_retries', max_retries, integer=True, low=0)
  check_number('runtime.rpc_timeout', rpc_timeout, allow_none=True, low=0, open_low=True,
               hint='seconds; None: adaptive')
  check_number('runtime.recycle_every', recycle_every, integer=True, low=0, hint='0: never')
  check_number('runtime.mmap_threshold_kib', mmap_threshold_kib, integer=True, low=0,
               hint="0: glibc's default")
  if executor == 'auto' and (workers or recycle_every):
    executor = 'tff_cpp'  # Only TFF's C++ runtime has workers to reach or to recycle.
  tf_device = check_executor(executor, device, workers, recycle_every)
  if isinstance(workers, str):
    workers = [workers]
  for address in workers:
    channels.check_worker_address(address)
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
  failover = dict(connect_timeout=connect_timeout, rpc_timeout=rpc_timeout,
                  max_retries=max_retries, mmap_threshold_kib=mmap_threshold_kib)
  if workers:
    return RemoteWorkersRuntime(workers, credentials=credentials, server_name=tls_server_name,
                                **failover)
  if executor == 'in_process':
    return InProcessRuntime(tf_device, mmap_threshold_kib)
  local = dict(log_dir=log_dir, isolated=isolate_local_worker, recycle_every=recycle_every)
  if executor == 'tff_cpp':
    return LocalWorkerRuntime(**local, **failover)
  return AutoRuntime(tf_device, **local, **failover)


def check_executor(executor: str, device: str, workers: Sequence[str] = (),
                   recycle_every: int = 0) -> Optional[str]:
  """Validates `runtime.executor`/`runtime.device`; returns the TensorFlow device (or None)."""
  check_choice('runtime.executor', executor, ('auto', 'tff_cpp', 'in_process'))
  check_choice('runtime.device', device, ('auto', 'cpu', 'gpu'))
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
    check_device(device, 'runtime.device')
    return '/GPU:0'
  return '/CPU:0' if device == 'cpu' else None
