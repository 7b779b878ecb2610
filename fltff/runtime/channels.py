"""gRPC to `worker_binary` workers: fail-fast stubs, connections whose TLS failures are
explained, and TFF's execution context over them (`fltff.runtime.runtimes.WorkerRuntime`)."""

from __future__ import annotations

import os
import time
import weakref
from typing import Optional

import grpc

from fltff.errors import ConfigError
from fltff.errors import RuntimeUnavailableError
from fltff.runtime.tls import MESSAGE_OPTIONS


class WorkerLostError(RuntimeUnavailableError):
  """A TFF worker (`address`) stopped answering; not a `tff.framework.RetryableError`, which
  TFF retries forever (a dead worker would hang the driver)."""

  def __init__(self, address: str, detail: str):
    super().__init__(f'TFF worker {address} was lost ({detail}).')
    self.address = address


_LOST_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
               grpc.StatusCode.CANCELLED)


def fail_fast_stub_class():
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


def connect_stub(address: str, timeout: float, rpc_timeout: float,
                  credentials: Optional[grpc.ChannelCredentials], server_name: Optional[str]):
  """A fail-fast executor stub for `address` once the worker answers; mutual TLS with
  `credentials` (`server_name`: the name to check in the worker's certificate)."""
  # gRPC's C core would log a failed connection or TLS handshake on stderr (`E1129 ...` lines),
  # which the errors below explain; read at gRPC's first channel. The user's setting wins.
  os.environ.setdefault('GRPC_VERBOSITY', 'NONE')
  if credentials is None:
    channel = grpc.insecure_channel(address, MESSAGE_OPTIONS)
  else:
    options = MESSAGE_OPTIONS + ([('grpc.ssl_target_name_override', server_name)]
                                 if server_name else [])
    channel = grpc.secure_channel(address, credentials, options)
  deadline = time.monotonic() + timeout
  ready = grpc.channel_ready_future(channel)
  try:
    while True:
      try:
        ready.result(timeout=max(min(1.0, deadline - time.monotonic()), 0.0))
        break
      except grpc.FutureTimeoutError:
        pass
      # gRPC's last error connecting: the detail of an RPC that does not wait for the
      # connection (any method: a worker answers UNIMPLEMENTED once connected).
      detail = ''
      try:
        channel.unary_unary('/fltff.Probe/Connect')(b'', timeout=1.0, wait_for_ready=False)
      except grpc.RpcError as e:
        if isinstance(e, grpc.Call) and e.code() == grpc.StatusCode.UNAVAILABLE:
          detail = (e.details() or '').split('last error: ', 1)[-1]
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
  return channel, fail_fast_stub_class()(channel, address, rpc_timeout)


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


def context_for_stub(stub, asynchronous: bool = False):
  """TFF's own local C++ context construction (its sync or async context), over a stub we
  control."""
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top
  from tensorflow_federated.python.core.environments.tensorflow_frontend import tensorflow_computation  # pylint: disable=g-import-not-at-top

  def stack_fn(cardinalities):
    if stub is None:  # `release_default_context`'s: a computation called with no runtime open.
      raise RuntimeUnavailableError('No TFF runtime is open (its runtime was closed): call TFF '
                                    'computations inside `with runtime.LocalWorkerRuntime():` '
                                    'or `with runtime.InProcessRuntime():`.')
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


def not_a_lost_worker_task(record) -> bool:
  """Filter dropping asyncio's 'Task exception was never retrieved' for a lost worker (TFF's
  mergeable context never awaits the other sub-rounds' failures; the runtime reports the loss
  once)."""
  exc = (record.exc_info or (None, None, None))[1]
  message = record.getMessage()
  return not (message.startswith('Task exception was never retrieved')
              and ('WorkerLostError' in message or isinstance(exc, RuntimeUnavailableError)))


def release_default_context() -> None:
  """Replaces TFF's import-time default context, whose `ServiceManager.__del__` fails at exit
  ("'NoneType' object has no attribute 'Popen'"), by one whose executor, never created,
  starts nothing: for programs exiting without a runtime, and a runtime's `close()`."""
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

  tff.framework.set_default_context(context_for_stub(stub=None))


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
