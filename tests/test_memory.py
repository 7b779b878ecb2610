"""Bounded memory (issue 20): what the round loop builds per round must not accumulate."""

import collections
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from fltff.data import pipeline
from fltff.errors import ConfigError
from fltff.learning import optimizers
from helpers import client_batches


def _arrays(k):
  rng = np.random.default_rng(k)
  return (rng.integers(0, 256, size=(23 + k, 28, 28), dtype=np.uint8),
          rng.integers(0, 10, size=23 + k).astype(np.int64))


def _as_arrays(ds):
  return [tf.nest.map_structure(np.asarray, b) for b in ds]


def test_client_datasets_give_the_batches_of_building_each_round_anew():
  datasets = pipeline.ClientDatasets(_arrays, batch_size=5)
  for k in (0, 3):
    for seed in (None, 7, 8):
      ours = _as_arrays(datasets.batches(k, seed).dataset)
      fresh = _as_arrays(client_batches(*_arrays(k), 5, shuffle_seed=seed))
      assert len(ours) == len(fresh) == -(-(23 + k) // 5)
      for a, b in zip(ours, fresh):
        assert a['x'].dtype == np.float32 and a['y'].dtype == np.int32
        np.testing.assert_array_equal(a['x'], b['x'])
        np.testing.assert_array_equal(a['y'], b['y'])
  # Per element or per batch, the scaling is the same: x / 255 in float32.
  x, _ = _arrays(0)
  np.testing.assert_array_equal(_as_arrays(datasets.batches(0).dataset)[0]['x'],
                                x[:5].astype(np.float32) / np.float32(255.0))


def test_a_client_examples_dataset_is_built_once_however_many_rounds():
  built = collections.Counter()

  def arrays_of(k):
    built[k] += 1
    return _arrays(k)

  datasets = pipeline.ClientDatasets(arrays_of, batch_size=4)
  maps = set()
  for round_num in range(5):
    for k in (1, 2):
      ds = datasets.batches(k, shuffle_seed=round_num).dataset
      # The one traced function of a client's pipeline (the `map`) is the same every round.
      node = ds
      while not hasattr(node, '_map_func'):
        node = node._input_dataset  # pylint: disable=protected-access
      maps.add(id(node._map_func))  # pylint: disable=protected-access
  assert built == {1: 1, 2: 1}
  assert len(maps) == 2


def _rss_kib() -> int:
  with open('/proc/self/status') as f:
    return next(int(line.split()[1]) for line in f if line.startswith('VmRSS:'))


def test_recycling_leaves_no_thread_channel_or_compiled_computation_behind():
  """Each recycle used to keep the old context's event-loop thread, its gRPC channel (held by
  a connectivity-polling thread) and, in TFF's lru_cache, everything it compiled: ~2.2 MiB per
  recycle for mlp2 FedAvg, ~12 MiB for FedLayerWise (issue 20)."""
  import gc  # pylint: disable=g-import-not-at-top
  import threading  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top

  import grpc  # pylint: disable=g-import-not-at-top
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top
  from tensorflow_federated.python.core.impl.execution_contexts import compiler_pipeline  # pylint: disable=g-import-not-at-top

  from fltff.runtime import LocalWorkerRuntime  # pylint: disable=g-import-not-at-top

  @tff.federated_computation(tff.FederatedType(np.float32, tff.CLIENTS))
  def mean(x):
    return tff.federated_mean(x)

  def live_channels():
    gc.collect()
    return sum(isinstance(o, grpc.Channel) for o in gc.get_objects())

  rt = LocalWorkerRuntime(recycle_every=1)
  try:
    assert mean([1.0, 2.0, 6.0]) == 3.0
    threads, channels = threading.active_count(), live_channels()
    for r in range(1, 6):
      rt.after_round(r)  # A fresh worker and context every round.
      assert mean([1.0, 2.0, 6.0]) == 3.0
    assert len(rt.worker_pids) == 2  # One isolated worker: its relay and worker_binary.
    # gRPC's connect-time polling thread may take a moment to end; leaked ones never do.
    deadline = time.monotonic() + 15
    while threading.active_count() > threads and time.monotonic() < deadline:
      time.sleep(0.2)
    assert threading.active_count() <= threads, [t.name for t in threading.enumerate()]
    assert live_channels() <= channels
    assert compiler_pipeline.CompilerPipeline.compile.cache_info().currsize <= 2
  finally:
    rt.close()


def test_tensorboard_rows_keep_no_memory_and_read_back(tmp_path):
  """`tf.summary` kept ~0.18 KiB per scalar for the whole run (7 KiB per 40-column row); the
  event writer builds the same events as protobufs and keeps nothing."""
  import gc  # pylint: disable=g-import-not-at-top

  from fltff.simulation.outputs import RunOutputs  # pylint: disable=g-import-not-at-top

  outputs = RunOutputs(str(tmp_path))
  row = {'round': 0, **{f'metric_{i}': 0.25 * i for i in range(40)}}
  for r in range(1, 101):
    outputs.log_scalars(dict(row, round=r))
  gc.collect()
  before = _rss_kib()
  for r in range(101, 1601):
    outputs.log_scalars(dict(row, round=r))
    outputs.log_arrays(r, {'relationship': np.full((4, 4), 0.5)})
  gc.collect()
  grown = _rss_kib() - before
  outputs.close()
  assert grown < 3 * 1024, f'{grown} KiB for 1500 rows (tf.summary: ~10,500 KiB)'
  values = {}
  events = tmp_path / 'tensorboard'
  for name in os.listdir(events):
    for event in tf.compat.v1.train.summary_iterator(str(events / name)):
      for value in event.summary.value:
        if value.tag == 'metric_3':
          values[event.step] = float(tf.make_ndarray(value.tensor))
  assert len(values) == 1600 and values[1600] == 0.75


def test_recycling_the_local_worker_changes_no_number_and_leaves_no_worker(tmp_path, monkeypatch):
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

  from fltff import learning  # pylint: disable=g-import-not-at-top
  from fltff.runtime import LocalWorkerRuntime  # pylint: disable=g-import-not-at-top
  from fltff.runtime.processes import wait_for_exit  # pylint: disable=g-import-not-at-top
  from fltff.simulation import RoundConfig  # pylint: disable=g-import-not-at-top
  from fltff.simulation import RoundDriver  # pylint: disable=g-import-not-at-top
  from fltff.simulation import build_model_spec  # pylint: disable=g-import-not-at-top
  from helpers import mnist_sample_split  # pylint: disable=g-import-not-at-top
  from helpers import read_csv  # pylint: disable=g-import-not-at-top

  data = mnist_sample_split(5, seed=1)
  algorithm = learning.build_scaffold(build_model_spec(data, 'mlp2', seed=0), num_clients=5,
                                      client_optimizer=optimizers.sgdm(0.05))
  config = RoundConfig(rounds=5, clients_per_round=3, batch_size=32, checkpoint_every=5)
  pids_seen = []

  class Recorder(LocalWorkerRuntime):

    def after_round(self, round_num, round_seconds=None):
      pids_seen.append(tuple(self.worker_pids))
      super().after_round(round_num, round_seconds)

  runs = {}
  for name, recycle_every, mmap_kib in (('plain', 0, 128), ('recycled', 2, 128),
                                        ('glibc_default_malloc', 0, 0)):
    if name == 'glibc_default_malloc':
      # And the worker's tensors from malloc, not TensorFlow's pooling allocator.
      monkeypatch.setenv('TF_CPU_ALLOCATOR_USE_BFC', 'false')
    rt = Recorder(recycle_every=recycle_every, mmap_threshold_kib=mmap_kib)
    try:
      RoundDriver(algorithm, data, config, str(tmp_path / name), progress=lambda _: None,
                  runtime=rt).run()
      last = rt.worker_pids
    finally:
      rt.close()
    assert wait_for_exit(last[0])
    runs[name] = read_csv(tmp_path / name / 'metrics.csv')
  recycled_pids = pids_seen[4:8]
  assert len(set(recycled_pids)) == 2  # Rounds 1-2 on one worker, 3-4 on the next.
  for pid in set(recycled_pids):
    assert wait_for_exit(pid[0])
  columns = ('train_loss', 'train_accuracy', 'test_accuracy')
  plain = [[r[c] for c in columns] for r in runs['plain']]
  assert [[r[c] for c in columns] for r in runs['recycled']] == plain
  # Where malloc takes memory from (fltff.runtime.heap) changes no number either.
  assert [[r[c] for c in columns] for r in runs['glibc_default_malloc']] == plain


def test_programs_and_the_local_worker_pool_tensor_memory_unless_told_otherwise(monkeypatch):
  from fltff.runtime import heap  # pylint: disable=g-import-not-at-top
  from helpers import run_program_here  # pylint: disable=g-import-not-at-top

  # This test process takes its tensors from the pooling allocator (tests/conftest.py), whose
  # statistics TensorFlow reports (the malloc allocator keeps none).
  tf.constant(1.0) + 1.0  # pylint: disable=expression-not-assigned
  assert tf.config.experimental.get_memory_info('CPU:0')['peak'] > 0
  monkeypatch.delenv('TF_CPU_ALLOCATOR_USE_BFC', raising=False)
  assert heap.worker_environment(0, base={})['TF_CPU_ALLOCATOR_USE_BFC'] == 'true'
  # `fltff run` asks for it before its first op (a bad flag returns right after).
  result = run_program_here('pipelines.run', '--gin_file=no_such_config.gin')
  assert result.returncode == 2 and 'error:' in result.stderr
  assert os.environ['TF_CPU_ALLOCATOR_USE_BFC'] == 'true'
  # A value the user set wins, in the program and in its local worker.
  monkeypatch.setenv('TF_CPU_ALLOCATOR_USE_BFC', 'false')
  assert run_program_here('pipelines.bench', '--executors', '--rounds=1').returncode == 2
  assert os.environ['TF_CPU_ALLOCATOR_USE_BFC'] == 'false'
  assert heap.worker_environment(128)['TF_CPU_ALLOCATOR_USE_BFC'] == 'false'


def test_the_local_worker_and_a_driver_without_vectorised_clients_get_the_fixed_mmap_threshold():
  from fltff.runtime import LocalWorkerRuntime  # pylint: disable=g-import-not-at-top
  from fltff.runtime import heap  # pylint: disable=g-import-not-at-top
  from fltff.runtime import make_runtime  # pylint: disable=g-import-not-at-top

  def worker_env(rt):
    with open(f'/proc/{rt.worker_pids[-1]}/environ', 'rb') as f:
      return dict(item.split(b'=', 1) for item in f.read().split(b'\0') if b'=' in item)

  with LocalWorkerRuntime() as rt:
    assert worker_env(rt)[b'MALLOC_MMAP_THRESHOLD_'] == b'131072'
    assert worker_env(rt)[b'TF_CPU_ALLOCATOR_USE_BFC'] == b'true'
    assert heap.threshold_fixed()
    rt.after_round(1)  # Trims the driver's heap; nothing else happens without recycling.
  # With 'auto' the driver's threshold follows the method's clients: glibc's adaptive one when
  # they are vectorised in this process (faster rounds, the same memory), else fixed. The
  # setting is per process and for good, so a fresh one shows it.
  program = (
      'from fltff import learning\nfrom fltff.runtime import heap\n'
      'from fltff.runtime import make_runtime\n'
      'from fltff.simulation import build_model_spec\nfrom helpers import mnist_sample_split\n'
      "spec = build_model_spec(mnist_sample_split(3, seed=1), 'mlp2', seed=0)\n"
      'for vectorised in (True, False):\n'
      '  with make_runtime() as rt:\n'
      '    algorithm = learning.build_fedavg(spec)\n'
      '    if vectorised:\n'
      '      algorithm = algorithm.with_vectorized_clients()\n'
      '    placed = type(rt.place(algorithm)).__name__\n'
      '    print(vectorised, heap.threshold_fixed(), placed)\n')
  tests_dir = os.path.dirname(os.path.abspath(__file__))
  result = subprocess.run([sys.executable, '-c', program], capture_output=True, text=True,
                          timeout=300, cwd=os.path.dirname(tests_dir),
                          env=dict(os.environ, PYTHONPATH=tests_dir, TF_CPP_MIN_LOG_LEVEL='3'))
  assert result.stdout.splitlines() == ['True False InProcessRuntime',
                                        'False True LocalWorkerRuntime'], (
      result.stdout, result.stderr[-2000:])
  with LocalWorkerRuntime(mmap_threshold_kib=0) as rt:
    assert b'MALLOC_MMAP_THRESHOLD_' not in worker_env(rt) or 'MALLOC_MMAP_THRESHOLD_' in os.environ
  assert heap.fix_mmap_threshold(128)  # glibc here: mallopt accepted the setting.
  assert not heap.fix_mmap_threshold(0)
  assert heap.worker_environment(64, {})['MALLOC_MMAP_THRESHOLD_'] == str(64 * 1024)
  assert heap.worker_environment(0, {}) == {'TF_CPU_ALLOCATOR_USE_BFC': 'true'}
  for bad in (-1, 1.5, True):
    with pytest.raises(ConfigError, match='runtime.mmap_threshold_kib'):
      make_runtime(mmap_threshold_kib=bad)


def _tree(seed):
  rng = np.random.default_rng(seed)
  return collections.OrderedDict(model=[rng.normal(size=(3, 2)).astype(np.float32)],
                                 omega=np.int32(seed))


def test_sqlite_store_keeps_versions_by_round_and_restores_any_kept_checkpoint(tmp_path):
  from fltff.simulation import state_store  # pylint: disable=g-import-not-at-top

  init = lambda k: _tree(1000 + k)
  store = state_store.SqliteClientStateStore(str(tmp_path), init, cache_size=2)
  assert 7 not in store and len(store) == 0
  np.testing.assert_array_equal(store.get(7)['model'][0], _tree(1007)['model'][0])
  for r in range(1, 7):  # Client k changes in the rounds r with r % (k + 1) == 0.
    store.set_many({k: _tree(100 * r + k) for k in range(4) if r % (k + 1) == 0}, r)
    assert len(store._cache) <= 2  # pylint: disable=protected-access
    if r % 2 == 0:
      store.checkpoint(r)
      store.prune([max(2, r - 2), r])  # Two checkpoints kept.
  assert len(store) == 4 and 7 not in store
  assert int(store.get(3)['omega']) == 403 and int(store.get(2)['omega']) == 602
  marker = store.checkpoint(6)
  store.close()
  # A new process: restoring round 4 drops rounds 5-6, every client is as after round 4.
  store = state_store.SqliteClientStateStore(str(tmp_path), init)
  store.restore(4, marker, init)
  expected = {0: 400, 1: 401, 2: 302, 3: 403}
  for k, omega in expected.items():
    assert int(store.get(k)['omega']) == omega
    np.testing.assert_array_equal(store.get(k)['model'][0], _tree(omega)['model'][0])
  with pytest.raises(ConfigError, match="client_state_store = 'memory'"):
    store.restore(4, {}, init)
  store.close()
  with pytest.raises(ConfigError, match="client_state_store = 'sqlite'"):
    state_store.ClientStateStore(init).restore(4, marker, init)


def test_a_damaged_sqlite_store_is_one_checkpoint_error(tmp_path):
  import sqlite3  # pylint: disable=g-import-not-at-top

  from fltff.errors import CheckpointError  # pylint: disable=g-import-not-at-top
  from fltff.simulation import state_store  # pylint: disable=g-import-not-at-top

  init = lambda k: _tree(1000 + k)
  store = state_store.SqliteClientStateStore(str(tmp_path / 'a'), init)
  store.set_many({0: _tree(1), 1: _tree(2)}, 1)
  store.close()
  # A tampered state: its bytes cut short.
  with sqlite3.connect(tmp_path / 'a' / 'client_states.sqlite') as db:
    db.execute('UPDATE states SET leaves = substr(leaves, 1, 20) WHERE client = 1')
  store = state_store.SqliteClientStateStore(str(tmp_path / 'a'), init)
  np.testing.assert_array_equal(store.get(0)['model'][0], _tree(1)['model'][0])
  with pytest.raises(CheckpointError, match='for client 1 that is not the one stored for it'):
    store.get(1)
  store.close()
  # A store written before states carried their checksum: the damage shows when unpacking.
  with sqlite3.connect(tmp_path / 'a' / 'client_states.sqlite') as db:
    db.execute('UPDATE states SET digest = NULL')
  store = state_store.SqliteClientStateStore(str(tmp_path / 'a'), init)
  with pytest.raises(CheckpointError, match='damaged state for client 1'):
    store.get(1)
  store.close()
  # A file that is not a database at all.
  (tmp_path / 'b').mkdir()
  (tmp_path / 'b' / 'client_states.sqlite').write_bytes(b'not a database' * 100)
  with pytest.raises(CheckpointError, match='damaged or not fltff'):
    state_store.SqliteClientStateStore(str(tmp_path / 'b'), init)


def test_kill_9_then_resume_with_the_sqlite_store_gives_the_uninterrupted_numbers(tmp_path):
  import os  # pylint: disable=g-import-not-at-top
  import signal  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top

  from helpers import read_csv  # pylint: disable=g-import-not-at-top
  from helpers import run_pipeline_here  # pylint: disable=g-import-not-at-top
  from launcher import Program  # pylint: disable=g-import-not-at-top

  # SCAFFOLD keeps client states (its controls); plain SGD and one epoch keep the runs short.
  args = ['--gin_file=gin_configs/ccn/offline_mnist1003_scaffold.gin',
          '--gin_bindings=experiment.rounds = 5',
          "--gin_bindings=client_optimizer.name = 'sgd'",
          '--gin_bindings=client_optimizer.learning_rate = 0.05',
          '--gin_bindings=experiment.local_epochs = 1',
          '--gin_bindings=experiment.checkpoint_every = 2',
          "--gin_bindings=experiment.client_state_store = 'sqlite'"]
  full = run_pipeline_here(*args, f'--output_dir={tmp_path / "full"}')
  assert full.returncode == 0, full.stderr[-2000:]
  assert os.path.exists(tmp_path / 'full' / 'client_states.sqlite')
  part = tmp_path / 'part'
  proc = Program('pipelines.run', *args, f'--output_dir={part}', capture=False)
  deadline = time.time() + 300
  while time.time() < deadline:  # Killed once round 3 is done: its states are in the store,
    try:                          # newer than the checkpoint of round 2.
      if len(read_csv(part / 'metrics.csv')) >= 3:
        break
    except (OSError, KeyError):
      pass
    time.sleep(0.05)
  os.kill(proc.pid, signal.SIGKILL)
  proc.wait()
  resumed = run_pipeline_here(*args, f'--output_dir={part}', '--resume')
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  assert 'Resumed from the checkpoint of round' in resumed.stdout
  columns = ('train_loss', 'train_accuracy', 'test_accuracy')
  assert [[r[c] for c in columns] for r in read_csv(part / 'metrics.csv')] == [
      [r[c] for c in columns] for r in read_csv(tmp_path / 'full' / 'metrics.csv')]


def _scale_run(out, rounds: int, *bindings) -> dict:
  """`scale/fmnist_fedamp.gin` with `bindings` for `rounds` rounds into `out`; its summary."""
  import json  # pylint: disable=g-import-not-at-top

  from helpers import run_pipeline_here  # pylint: disable=g-import-not-at-top

  result = run_pipeline_here(
      '--gin_file=gin_configs/scale/fmnist_fedamp.gin',
      *[f'--gin_bindings={b}' for b in bindings],
      f'--gin_bindings=experiment.rounds = {rounds}', '--gin_bindings=experiment.eval_every = 1',
      f'--output_dir={out}')
  assert result.returncode == 0, result.stderr[-2000:]
  summary = json.loads((out / 'summary.json').read_text())
  assert summary['rounds_completed'] == rounds
  assert (out / 'client_states.sqlite').stat().st_size > 0
  return summary


def test_scale_config_runs_two_rounds_with_10000_clients(tmp_path):
  """The scale config (a personalised method, client states in SQLite) at its documented 10,000
  clients (IDX files the test writes: 20,000 training and 10,000 test images, so 2 training
  examples and 1 local test example each)."""
  import json  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top

  from test_idx_source import _write_set  # pylint: disable=g-import-not-at-top

  _write_set(tmp_path / 'idx', n_train=20000, n_test=10000, compress=False)
  out = tmp_path / 'run'
  summary = _scale_run(out, 2, f"idx_source.path = '{tmp_path / 'idx'}'",
                       'federated_data.num_clients = 10000',
                       'federated_data.local_test_examples = 1')
  assert json.loads((out / 'partition.json').read_text())['num_clients'] == 10000
  # The checkpoint holds the server state, not 10,000 clients' models (SQLite holds those),
  # and FedAMP writes no N x N relationship file.
  assert 0 < summary['checkpoint_megabytes'] < 1.0 and summary['checkpoint_seconds_max'] >= 0
  with np.load(out / 'checkpoints' / 'round_00002.npz') as arrays:
    assert not [k for k in arrays.files if k.startswith('client/')]
  assert not os.path.exists(out / 'relationship.npy')
  assert 0.0 <= summary['best_personal_local_accuracy'] <= 1.0
  assert summary['driver_peak_rss_mib'] > 100 and summary['round_seconds_median'] > 0
