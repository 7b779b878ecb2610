"""Remote TFF workers on loopback: same metrics as the local runtime, surviving worker loss.

Workers are real `fltff.runtime.worker` processes and the driver a real `pipelines.run` process,
both forked from the test process's fork server (`launcher.py`).
"""

import json
import os
import signal
import subprocess
import time

import portpicker
import pytest

from helpers import SMALL
from helpers import assert_one_line_error
from helpers import read_csv
from helpers import run_pipeline
from helpers import tagged_worker_pids
from launcher import Program
from launcher import wait_until

FEDAVG = SMALL  # Its local-runtime run: the session's `small_run`.
METRICS = ('train_loss', 'train_accuracy', 'test_loss', 'test_accuracy', 'examples')


class Worker:
  """`python -m fltff.runtime.worker` on 127.0.0.1 (forked from the test process's fork server,
  `launcher.py`: a process of its own, as a user starts it); `flags` default to a plaintext
  worker."""

  def __init__(self, *flags: str):
    self.port = portpicker.pick_unused_port()
    self.proc = Program('fltff.runtime.worker', f'--port={self.port}',
                        *(flags or ('--insecure_plaintext',)))
    try:
      wait_until(lambda: 'listening on' in self.proc.output()[0], self.proc, 120, 'worker start')
    except AssertionError:
      self.crash()
      raise
    self.line = self.proc.output()[0].splitlines()[0]
    self.address = f'127.0.0.1:{self.port}'

  def stop(self):
    if self.proc.poll() is None:
      self.proc.send_signal(signal.SIGTERM)
      try:
        code = self.proc.wait(timeout=30)
      except subprocess.TimeoutExpired:
        self.crash()  # Never left running, port open, after the test.
        raise AssertionError('the worker did not stop within 30 s of SIGTERM') from None
      assert code == 0  # Clean exit on SIGTERM.

  def crash(self):
    self.proc.kill()  # SIGKILL: PDEATHSIG takes its worker_binary down too.
    self.proc.wait(timeout=30)


@pytest.fixture
def workers():
  started = []

  def start(n):
    new = [Worker() for _ in range(n)]
    started.extend(new)
    return new

  yield start
  for w in started:
    w.stop()
  deadline = time.monotonic() + 10
  while tagged_worker_pids() and time.monotonic() < deadline:
    time.sleep(0.1)
  assert not tagged_worker_pids(), 'a worker_binary outlived the test'


def _binding(ws):
  """The workers' addresses (plaintext workers on loopback: `--insecure_plaintext` on both
  sides; TLS is tested in test_tls.py)."""
  return [f"--gin_bindings=runtime.workers = {[w.address for w in ws]!r}",
          '--gin_bindings=runtime.insecure_plaintext = True']


def _local(small_run):
  return read_csv(os.path.join(small_run[0], 'metrics.csv'))


def _assert_same_metrics(run_dir, reference):
  rows = read_csv(os.path.join(run_dir, 'metrics.csv'))
  assert [r['round'] for r in rows] == [r['round'] for r in reference]
  for a, b in zip(rows, reference):
    for key in METRICS:
      assert float(a[key]) == pytest.approx(float(b[key]), rel=1e-4, abs=1e-5), (a['round'], key)


def _wait_for_round(run_dir, proc, round_num):
  latest = os.path.join(run_dir, 'checkpoints', 'latest.json')
  deadline = time.monotonic() + 300
  while time.monotonic() < deadline and proc.poll() is None:
    if os.path.exists(latest) and json.load(open(latest))['round'] >= round_num:
      return
    time.sleep(0.05)
  raise AssertionError(f'round {round_num} never checkpointed')


# End to end through pipelines.run on 2 workers: the rounds (vectorised groups) before and after
# one is lost equal the local runtime's (the driver's rounds of FedAvg and KAPC+BLS on 2 workers, in-process:
# test_workers_equality.py; one method per shape of what is merged: test_vectorized.py).
def test_lost_worker_round_repeats_on_the_other(workers, small_run, tmp_path):
  ws = workers(2)
  out = str(tmp_path)
  proc = Program('pipelines.run', *FEDAVG, *_binding(ws), f'--output_dir={out}')
  _wait_for_round(out, proc, 1)
  ws[1].crash()
  stdout, stderr = proc.communicate(timeout=300)
  assert proc.returncode == 0, stderr[-3000:]
  assert f'TFF worker {ws[1].address} was lost' in stderr
  assert 'round    3/3' in stdout
  # 'auto' client work on remote workers: vectorised, one group of clients per worker.
  assert 'vectorised clients: one call per worker (2 workers)' in stdout
  _assert_same_metrics(out, _local(small_run))


def test_all_workers_lost_stops_cleanly_then_resume(workers, small_run, tmp_path):
  # Both workers killed: the second is found gone within seconds (not connect_timeout's 60),
  # and the line names both, not TLS.
  pair = workers(2)
  out = str(tmp_path)
  proc = Program('pipelines.run', *FEDAVG, *_binding(pair), f'--output_dir={out}')
  _wait_for_round(out, proc, 1)
  for w in pair:
    w.crash()
  crashed = time.monotonic()
  _, stderr = proc.communicate(timeout=300)
  assert time.monotonic() - crashed < 30, stderr[-3000:]
  result = subprocess.CompletedProcess(proc.args, proc.returncode, '', stderr)
  line = assert_one_line_error(result, pair[0].address, pair[1].address, '--resume')
  assert 'TLS' not in line, line
  saved = json.load(open(os.path.join(out, 'checkpoints', 'latest.json')))['round']
  completed = len(read_csv(os.path.join(out, 'metrics.csv')))
  assert saved == completed >= 1

  [replacement] = workers(1)
  resumed = run_pipeline(*FEDAVG, *_binding([replacement]), f'--output_dir={out}', '--resume')
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  _assert_same_metrics(out, _local(small_run))


def test_unreachable_worker_at_start_is_one_error(tmp_path):
  port = portpicker.pick_unused_port()
  result = run_pipeline(*FEDAVG, f"--gin_bindings=runtime.workers = ['127.0.0.1:{port}']",
                        '--gin_bindings=runtime.insecure_plaintext = True',
                        '--gin_bindings=runtime.connect_timeout = 2', f'--output_dir={tmp_path}')
  assert_one_line_error(result, f'127.0.0.1:{port}')


def test_silent_worker_is_declared_lost_within_the_rpc_deadline(workers, tmp_path):
  """A worker that stops answering (SIGSTOP: no connection reset, like a host that vanished)
  ends the run after about `runtime.rpc_timeout`, once (not once per RPC TFF had pending on
  it), with one line saying what is kept."""
  [w] = workers(1)
  out = str(tmp_path)
  proc = Program('pipelines.run', *FEDAVG, *_binding([w]),
                 '--gin_bindings=runtime.rpc_timeout = 10.0',
                 '--gin_bindings=experiment.rounds = 50', f'--output_dir={out}')
  _wait_for_round(out, proc, 1)
  frozen = [w.proc.pid] + [int(p) for p in subprocess.run(
      ['pgrep', '-P', str(w.proc.pid)], capture_output=True, text=True).stdout.split()]
  for pid in frozen:
    os.kill(pid, signal.SIGSTOP)
  start = time.monotonic()
  try:
    _, stderr = proc.communicate(timeout=120)
  finally:
    for pid in frozen:
      os.kill(pid, signal.SIGCONT)
  # One 10 s deadline, plus the round that was running and the run's end (it took three).
  assert time.monotonic() - start < 20
  line = assert_one_line_error(subprocess.CompletedProcess(proc.args, proc.returncode, '',
                                                           stderr),
                               w.address, 'was lost', 'checkpointed', '--resume')
  assert 'DEADLINE_EXCEEDED' in line


def test_a_lost_worker_fails_computations_but_not_disposals():
  """TFF disposes remote values from garbage-collection finalizers, also at exit after a
  worker is gone: there a `WorkerLostError` would print a traceback, so disposal is a no-op."""
  import grpc  # pylint: disable=g-import-not-at-top
  from tensorflow_federated.proto.v0 import executor_pb2  # pylint: disable=g-import-not-at-top

  from fltff.runtime import WorkerLostError  # pylint: disable=g-import-not-at-top
  from fltff.runtime.channels import fail_fast_stub_class  # pylint: disable=g-import-not-at-top

  address = f'127.0.0.1:{portpicker.pick_unused_port()}'  # Nothing listens there.
  channel = grpc.insecure_channel(address)
  try:
    stub = fail_fast_stub_class()(channel, address, rpc_timeout=5.0)
    assert stub.dispose(executor_pb2.DisposeRequest()) is None
    assert stub.dispose_executor(executor_pb2.DisposeExecutorRequest()) is None
    with pytest.raises(WorkerLostError, match='was lost'):
      stub.compute(executor_pb2.ComputeRequest())
  finally:
    channel.close()
