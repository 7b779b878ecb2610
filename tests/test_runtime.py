"""The owned TFF runtime: workers never outlive the program that started them."""

import os
import socket

import numpy as np
import pytest
import tensorflow_federated as tff

from fltff.errors import RuntimeUnavailableError
from fltff.runtime import LocalWorkerRuntime
from fltff.runtime import RemoteWorkersRuntime
from fltff.runtime.processes import wait_for_exit
from helpers import REPO
from launcher import Program
from launcher import wait_until


def _alive(pid):
  return not wait_for_exit(pid, timeout=0.0)


def test_runtime_runs_computation_and_close_stops_worker(tff_runtime):
  runtime = LocalWorkerRuntime()
  try:
    pids = runtime.worker_pids  # The isolated worker's relay and its worker_binary.
    assert len(pids) == 2 and all(_alive(pid) for pid in pids)

    @tff.federated_computation(tff.FederatedType(np.float32, tff.CLIENTS))
    def mean(x):
      return tff.federated_mean(x)

    assert mean([1.0, 2.0, 6.0]) == pytest.approx(3.0)
    runtime.close()
    with pytest.raises(RuntimeUnavailableError, match=r'No TFF runtime is open.*LocalWorker'):
      mean([1.0])  # After its runtime closed: a clear error, not TFF's AttributeError.
  finally:
    runtime.close()
    tff.framework.set_default_context(tff_runtime.context)  # Back to the session runtime.
  assert all(wait_for_exit(pid) for pid in pids)
  runtime.close()  # Idempotent.


def _listening_inodes(table: str) -> set:
  """Socket inodes in LISTEN state in a /proc/<pid>/net/tcp{,6} table."""
  inodes = set()
  with open(table) as f:
    for line in f.readlines()[1:]:
      fields = line.split()
      if fields[3] == '0A':  # TCP_LISTEN
        inodes.add(fields[9])
  return inodes


def _listening_ports(table: str) -> set:
  """Ports in LISTEN state in a /proc/<pid>/net/tcp{,6} table."""
  with open(table) as f:
    return {int(line.split()[1].rsplit(':', 1)[1], 16) for line in f.readlines()[1:]
            if line.split()[3] == '0A'}


def _socket_inodes(pid: int) -> set:
  found = set()
  for fd in os.listdir(f'/proc/{pid}/fd'):
    target = os.readlink(f'/proc/{pid}/fd/{fd}')
    if target.startswith('socket:['):
      found.add(target[8:-1])
  return found


def test_the_local_worker_is_reachable_only_through_its_owners_unix_socket(tff_runtime):
  # worker_binary listens on every interface of its network namespace: a private one, whose
  # only interface is its own loopback. The driver's way in is a 0600 socket in a 0700 folder.
  runtime = LocalWorkerRuntime()
  try:
    relay, worker = runtime.worker_pids
    assert runtime.workers[0].startswith('unix:')
    path = runtime.workers[0][len('unix:'):]
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert os.stat(os.path.dirname(path)).st_mode & 0o777 == 0o700
    assert os.readlink(f'/proc/{worker}/ns/net') != os.readlink('/proc/self/ns/net')
    with open(f'/proc/{worker}/net/dev') as f:
      interfaces = [line.split(':')[0].strip() for line in f.readlines()[2:]]
    assert interfaces == ['lo']
    # It does listen, in there; nothing of its listens in this namespace.
    inside = _listening_inodes(f'/proc/{worker}/net/tcp6') | _listening_inodes(
        f'/proc/{worker}/net/tcp')
    assert inside & _socket_inodes(worker)
    outside = _listening_inodes('/proc/self/net/tcp6') | _listening_inodes('/proc/self/net/tcp')
    assert not outside & (_socket_inodes(worker) | _socket_inodes(relay))
    # And a client out here that tries worker_binary's port is refused, on every address.
    ports = _listening_ports(f'/proc/{worker}/net/tcp6') | _listening_ports(
        f'/proc/{worker}/net/tcp')
    assert ports
    addresses = {'127.0.0.1', socket.gethostbyname(socket.gethostname())}
    for port in ports:
      for address in addresses:
        with pytest.raises(ConnectionRefusedError):
          socket.create_connection((address, port), timeout=5).close()

    @tff.federated_computation(tff.FederatedType(np.float32, tff.CLIENTS))
    def total(x):
      return tff.federated_sum(x)

    assert total([1.0, 2.0]) == pytest.approx(3.0)
  finally:
    runtime.close()
    tff.framework.set_default_context(tff_runtime.context)
  assert not os.path.exists(os.path.dirname(path))


def test_a_worker_not_isolated_says_its_port_is_open(tff_runtime, capsys):
  runtime = LocalWorkerRuntime(isolated=False)
  try:
    [pid] = runtime.worker_pids
    assert os.readlink(f'/proc/{pid}/ns/net') == os.readlink('/proc/self/ns/net')
    line = capsys.readouterr().err.strip()
    assert line.startswith('warning: runtime.isolate_local_worker = False') and 'every interface' in line
    # The contrast to the isolated worker: here a client from outside gets in.
    port = int(runtime.workers[0].rsplit(':', 1)[1])
    socket.create_connection((socket.gethostbyname(socket.gethostname()), port), timeout=5).close()
  finally:
    runtime.close()
    tff.framework.set_default_context(tff_runtime.context)
  assert wait_for_exit(pid)


@pytest.mark.parametrize('how', ['exit', 'sigkill'])
def test_worker_dies_with_its_program(how):
  # A program of its own (`runtime_child.py`, forked from the fork server: `launcher.py`).
  proc = Program('runtime_child', 'exit' if how == 'exit' else 'hang')
  wait_until(lambda: proc.output()[0].endswith('\n'), proc, 120, 'the runtime start')
  pids = [int(p) for p in proc.output()[0].split()]  # Relay and worker_binary.
  assert len(pids) == 2
  if how == 'sigkill':
    assert all(_alive(pid) for pid in pids)
    proc.kill()
  proc.wait(timeout=120)
  if how == 'exit':
    assert proc.returncode == 0
  for pid in pids:
    assert wait_for_exit(pid, timeout=10), f'worker {pid} outlived its program ({how})'


def test_unreachable_remote_worker_is_a_clear_error():
  from fltff.errors import RuntimeUnavailableError  # pylint: disable=g-import-not-at-top
  import portpicker  # pylint: disable=g-import-not-at-top

  port = portpicker.pick_unused_port()
  with pytest.raises(RuntimeUnavailableError, match=f'127.0.0.1:{port}'):
    RemoteWorkersRuntime(workers=[f'127.0.0.1:{port}'], connect_timeout=1.0)


def test_the_default_rpc_deadline_follows_the_rounds(tff_runtime):
  from fltff.runtime import runtimes  # pylint: disable=g-import-not-at-top

  runtime = LocalWorkerRuntime()
  try:
    [stub] = runtime._stubs  # pylint: disable=protected-access
    assert runtime.rpc_timeout == stub._rpc_timeout == runtimes.FIRST_RPC_TIMEOUT_S  # pylint: disable=protected-access
    runtime.after_round(1, 12.0)
    assert stub._rpc_timeout == runtimes.RPC_TIMEOUT_FLOOR_S  # 10 x 12 s is under the floor.  # pylint: disable=protected-access
    runtime.after_round(2, 95.0)
    runtime.after_round(3, 40.0)  # The slowest round counts.
    assert stub._rpc_timeout == 950.0  # pylint: disable=protected-access
  finally:
    runtime.close()
    tff.framework.set_default_context(tff_runtime.context)
  fixed = LocalWorkerRuntime(rpc_timeout=7.0)
  try:
    fixed.after_round(1, 100.0)
    assert fixed._stubs[0]._rpc_timeout == 7.0  # pylint: disable=protected-access
  finally:
    fixed.close()
    tff.framework.set_default_context(tff_runtime.context)


def test_a_hung_worker_is_lost_after_one_deadline_of_the_documented_rule(tff_runtime,
                                                                         monkeypatch):
  """10 x the slowest round, at least `RPC_TIMEOUT_FLOOR_S` (2 s here, not 5 minutes), once:
  the call that waits that long loses the worker, and the calls TFF still has pending on it
  (the round's other values, its disposals) fail at once instead of waiting a deadline each
  (a hung worker of 0.15-s rounds was lost after 601.6 s, two deadlines)."""
  import threading  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  from concurrent import futures  # pylint: disable=g-import-not-at-top

  import grpc  # pylint: disable=g-import-not-at-top
  from tensorflow_federated.proto.v0 import executor_pb2  # pylint: disable=g-import-not-at-top

  from fltff.runtime import channels  # pylint: disable=g-import-not-at-top
  from fltff.runtime import runtimes  # pylint: disable=g-import-not-at-top

  release = threading.Event()

  def hang(request, context):
    del request, context
    release.wait(30)  # A stopped worker: connected, never answering.
    return b''

  class Hung(grpc.GenericRpcHandler):

    def service(self, handler_call_details):
      return grpc.unary_unary_rpc_method_handler(hang)

  server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), handlers=[Hung()])
  port = server.add_insecure_port('127.0.0.1:0')
  server.start()
  monkeypatch.setattr(runtimes, 'RPC_TIMEOUT_FLOOR_S', 2.0)
  runtime = runtimes.RemoteWorkersRuntime([f'127.0.0.1:{port}'])  # A plaintext "worker".
  [stub] = runtime._stubs  # pylint: disable=protected-access
  try:
    runtime.after_round(1, 0.15)
    assert runtime.rpc_timeout == stub._rpc_timeout == 2.0  # pylint: disable=protected-access
    seconds = []
    for call in (lambda: stub.create_value(executor_pb2.CreateValueRequest()),
                 lambda: stub.create_value(executor_pb2.CreateValueRequest()),
                 lambda: stub.compute(executor_pb2.ComputeRequest())):
      start = time.monotonic()
      with pytest.raises(channels.WorkerLostError, match='DEADLINE_EXCEEDED'):
        call()
      seconds.append(time.monotonic() - start)
    start = time.monotonic()
    assert stub.dispose_executor(executor_pb2.DisposeExecutorRequest()) is None
    seconds.append(time.monotonic() - start)
    assert 1.9 < seconds[0] < 10 and max(seconds[1:]) < 0.5, seconds
  finally:
    release.set()
    runtime.close()
    server.stop(grace=None)
    tff.framework.set_default_context(tff_runtime.context)


# A signal handler that stops the main thread's wait, as the workers' SIGTERM handlers do; a
# timer signal every 2 ms makes the handler land inside the wait's own code many times.
_STOP_IN_A_HANDLER = '''
import signal, sys, time
sys.setrecursionlimit(200)
from fltff.cli import StopSignal
stop = StopSignal()
signal.signal(signal.SIGALRM, lambda *_: stop.set())
signal.setitimer(signal.ITIMER_REAL, 0.002, 0.002)
start, waits = time.monotonic(), 0
while time.monotonic() - start < 2.0:
  stop._set = False
  stop.wait(0.001)
  waits += 1
signal.setitimer(signal.ITIMER_REAL, 0)
print('waits', waits)
'''


def test_a_stop_set_by_a_signal_handler_never_hangs_the_wait():
  """With `threading.Event` in its place most runs of this hang or overflow the stack (nested
  handlers blocked on the lock the interrupted wait holds): a worker that never stopped on
  SIGTERM."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top

  result = subprocess.run([sys.executable, '-c', _STOP_IN_A_HANDLER], capture_output=True,
                          text=True, timeout=60, cwd=REPO)
  assert result.returncode == 0, result.stderr[-2000:]
  assert int(result.stdout.split()[-1]) > 100
