"""The in-process executor (`runtime.executor = 'in_process'`, issue 19) against TFF's C++ runtime.

Every method runs 3 rounds on both (in test_vectorized, beside vectorised clients), from the
same initial state, on clients of unequal sizes;
every number that comes out (round metrics, new client states, the server state with the
global model) must agree (`helpers.assert_equal_runs`: 3e-4 of each tensor's scale). The
executor runs the graphs TFF compiled; the only differences are the CPU kernels and their
floating-point rounding.
"""

import collections
import os
import re

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from fltff import aggregators
from fltff import runtime
from fltff.errors import ConfigError
from fltff.runtime.in_process import InProcessContext
from fltff.runtime.runtimes import check_executor
from helpers import EQUALITY_CLIENTS
from helpers import SMALL
from helpers import assert_one_line_error
from helpers import equality_methods
from helpers import leaves
from helpers import read_csv
from helpers import run_and_resume
from helpers import run_pipeline_here
from helpers import run_rounds
from helpers import tagged_worker_pids

NUM_CLIENTS = EQUALITY_CLIENTS

# The 16 method families, each once.
METHODS = {name: build for name, build in equality_methods().items()
           if name not in ('fedavg_uniform', 'kapc', 'scaffold')}


@pytest.fixture(scope='module')
def contexts(tff_runtime):
  # The session's C++ runtime (conftest) against the in-process executor.
  return {'tff_cpp': tff_runtime.context, 'in_process': InProcessContext()}


# Every method family's rounds on this executor against TFF's C++ runtime:
# test_vectorized.test_three_rounds_on_every_executor_equal_the_cpp_runtime (one C++
# reference for both executors).


def test_pipeline_in_process_equals_cpp_and_resumes_without_a_worker(small_run, tmp_path):
  # Client by client: 'auto' would vectorise FedAvg here (that run is test_vectorized's).
  args = [*SMALL, '--gin_bindings=runtime.executor = "in_process"',
          '--gin_bindings=experiment.client_work = "per_client"']
  full, resumed, stdout = run_and_resume(args, tmp_path, stop_round=2)
  assert 'runs on the in-process executor.' in stdout, stdout
  cpp = read_csv(os.path.join(small_run[0], 'metrics.csv'))  # SMALL on the C++ runtime.
  assert len(full) == len(resumed) == len(cpp) == 3
  for a, b, c in zip(full, resumed, cpp):
    for column in ('train_loss', 'train_accuracy', 'test_accuracy', 'test_loss'):
      assert float(a[column]) == float(b[column])  # Resume is exact on one executor.
      np.testing.assert_allclose(float(a[column]), float(c[column]), rtol=1e-5)
    assert a['examples'] == c['examples'] and a['bytes_up'] == c['bytes_up']
  assert not tagged_worker_pids()


def test_in_process_starts_no_worker():
  before = set(os.listdir('/proc'))
  with runtime.InProcessRuntime() as rt:
    assert rt.worker_pids == [] and isinstance(rt.context, InProcessContext)
    started = [p for p in set(os.listdir('/proc')) - before if p.isdigit()]
    for pid in started:
      try:
        with open(f'/proc/{pid}/cmdline', 'rb') as f:
          assert b'worker_binary' not in f.read()
      except OSError:
        pass
    with pytest.raises(ConfigError, match='tff_cpp'):
      rt.program_context()


@pytest.mark.parametrize('kwargs, fragment', [
    (dict(executor='tff_grpc', device='auto'), "runtime.executor must be one of"),
    (dict(executor='in_process', device='tpu'), "runtime.device must be one of"),
    (dict(executor='tff_cpp', device='gpu'), 'never uses a GPU'),
    (dict(executor='in_process', device='auto', workers=['h:1']), 'remove runtime.workers'),
    (dict(executor='in_process', device='auto', recycle_every=5), 'recycle_every'),
])
def test_executor_settings_are_checked(kwargs, fragment):
  with pytest.raises(ConfigError, match=fragment):
    check_executor(**kwargs)


def test_devices_map_to_tensorflow_devices():
  assert check_executor('tff_cpp', 'auto') is None
  assert check_executor('tff_cpp', 'cpu') is None
  assert check_executor('in_process', 'auto') is None
  assert check_executor('in_process', 'cpu') == '/CPU:0'


def test_pipeline_refuses_an_unknown_executor_in_one_line(tmp_path):
  result = run_pipeline_here(*SMALL, '--gin_bindings=runtime.executor = "tff_gpu"',
                        f'--output_dir={tmp_path}')
  assert_one_line_error(result, 'runtime.executor must be one of')


GPUS = tf.config.list_physical_devices('GPU')
needs_gpu = pytest.mark.skipif(not GPUS, reason='TensorFlow sees no GPU on this machine')


@pytest.fixture
def float32_matmuls():
  """On an Ampere or newer GPU TensorFlow multiplies float32 matrices (and convolves) in
  TensorFloat-32, 10 mantissa bits, by default: the equality tests compare float32 arithmetic."""
  enabled = tf.config.experimental.tensor_float_32_execution_enabled()
  tf.config.experimental.enable_tensor_float_32_execution(False)
  yield
  tf.config.experimental.enable_tensor_float_32_execution(enabled)


@pytest.mark.gpu
@needs_gpu
def test_gpu_in_process_equals_cpu(data, spec, float32_matmuls):
  cpu = run_rounds(METHODS['fedavg'](spec), data, InProcessContext(device='/CPU:0'), NUM_CLIENTS)
  gpu = run_rounds(METHODS['fedavg'](spec), data, InProcessContext(device='/GPU:0'), NUM_CLIENTS)
  for x, y in zip(leaves(cpu), leaves(gpu)):
    np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@needs_gpu
def test_gpu_vectorised_clients_equal_cpu(data, spec, float32_matmuls):
  # What the GPU check times (pipelines.gpu_check): vectorised clients on each device.
  runs = []
  for device in ('/CPU:0', '/GPU:0'):
    algorithm = METHODS['fedavg'](spec).with_vectorized_clients(device)
    runs.append(run_rounds(algorithm, data, InProcessContext(device=device), NUM_CLIENTS))
  for x, y in zip(*(leaves(run) for run in runs)):
    np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_gpu_is_refused_without_one():
  if GPUS:
    assert check_executor('in_process', 'gpu') == '/GPU:0'
  else:
    with pytest.raises(ConfigError, match='sees no GPU'):
      check_executor('in_process', 'gpu')


@pytest.mark.gpu
@pytest.mark.skipif(bool(GPUS), reason='TensorFlow sees a GPU here')
def test_a_device_tensorflow_lacks_is_refused_when_built_naming_the_devices_it_sees(spec):
  # TensorFlow's soft placement ran computations placed on a missing GPU on the CPU, silently:
  # `with_vectorized_clients('gpu')` or `InProcessRuntime('/GPU:0')` "measured a GPU" on a CPU.
  seen = ', '.join(d.name for d in tf.config.list_logical_devices())
  context = tff.framework.get_context_stack().current
  for device, missing in (('gpu', 'GPU'), ('/GPU:0', 'GPU:0'), ('/CPU:1', 'CPU:1')):
    message = re.escape(f"device = {device!r} but TensorFlow sees no {missing}, only {seen}")
    for method in ('fedavg', 'scaffold+ccn', 'fedamp', 'ditto'):
      with pytest.raises(ConfigError, match=message):
        METHODS[method](spec).with_vectorized_clients(device)
    with pytest.raises(ConfigError, match=message):
      runtime.InProcessRuntime(device)
    assert tff.framework.get_context_stack().current is context  # No runtime was installed.
  with pytest.raises(ConfigError, match=re.escape(
      f"runtime.device = 'gpu' but TensorFlow sees no GPU, only {seen} (`make setup-gpu`")):
    runtime.make_runtime(executor='auto', device='gpu')
  assert METHODS['fedavg'](spec).with_vectorized_clients('/CPU:0').vectorized


def test_clients_are_mapped_and_folded_in_one_call_with_tffs_numbers(contexts):
  # federated_map runs as one vectorised call (pfor) over the stacked clients, or else one
  # looped call (the same graph per client, in order); federated_aggregate's fold as one
  # looped call. TFF's weighted mean (a map, then a fold) over 5 clients: equal to the C++
  # runtime, and bit-equal to going client by client either way.
  value_type = tff.StructType([('a', tff.TensorType(np.float32, [3])),
                               ('b', tff.TensorType(np.float32, [2, 2]))])
  mean = tff.aggregators.MeanFactory().create(value_type, tff.TensorType(np.float32))
  rng = np.random.default_rng(0)
  values = [collections.OrderedDict(a=rng.normal(size=3).astype(np.float32),
                                    b=rng.normal(size=(2, 2)).astype(np.float32))
            for _ in range(5)]
  weights = [np.float32(w) for w in (1, 7, 2, 9, 4)]
  context = InProcessContext()
  results = {}
  for name, ctx in (('tff_cpp', contexts['tff_cpp']), ('vectorized', context)):
    tff.framework.set_default_context(ctx)
    results[name] = mean.next(mean.initialize(), values, weights).result
  functions = [fn for _, fn in context._functions.values()]  # pylint: disable=protected-access
  # pylint: disable=protected-access
  assert any(fn._looped.get('vectorized_map') is not None for fn in functions)
  assert any(fn._looped.get('looped_fold') is not None for fn in functions)
  for fn in functions:  # The looped map from here on.
    fn._looped['vectorized_map'] = None
  results['looped'] = mean.next(mean.initialize(), values, weights).result
  assert any(fn._looped.get('looped_map') is not None for fn in functions)
  for fn in functions:  # Client by client from here on.
    fn._looped['looped_map'] = fn._looped['looped_fold'] = None
  # pylint: enable=protected-access
  results['one_by_one'] = mean.next(mean.initialize(), values, weights).result
  tff.framework.set_default_context(contexts['tff_cpp'])
  expected = {k: sum(w * v[k] for w, v in zip(weights, values)) / sum(weights) for k in 'ab'}
  for name in ('tff_cpp', 'vectorized', 'looped', 'one_by_one'):
    for k in 'ab':
      np.testing.assert_allclose(results[name][k], expected[k], rtol=1e-5, err_msg=name)
  for k in 'ab':
    np.testing.assert_array_equal(results['vectorized'][k], results['one_by_one'][k])
    np.testing.assert_array_equal(results['looped'][k], results['one_by_one'][k])
    np.testing.assert_allclose(results['looped'][k], results['tff_cpp'][k], rtol=1e-6)


def test_tensor_results_return_tensors_that_go_back_in_without_a_copy(contexts):
  # Inside `tensor_results()` a computation returns TensorFlow tensors (the same numbers as
  # the NumPy it returns outside), and a tensor passed back in is used as it is.
  from fltff.runtime.in_process import tensor_results  # pylint: disable=g-import-not-at-top

  @tff.tensorflow.computation(tff.TensorType(np.float32, [3]), tff.TensorType(np.float32, [3]))
  def scaled_pair(x, y):
    return x * 2.0, x + y

  x = np.array([1.0, -2.0, 0.5], np.float32)
  tff.framework.set_default_context(InProcessContext())
  try:
    plain = scaled_pair(x, x)
    with tensor_results() as keeping:
      assert keeping
      kept = scaled_pair(x, x)
      again = scaled_pair(kept[0], kept[1])
    after = scaled_pair(x, x)
  finally:
    tff.framework.set_default_context(contexts['tff_cpp'])
  assert all(isinstance(v, np.ndarray) for v in (*plain, *after))
  assert all(tf.is_tensor(v) and not isinstance(v, np.ndarray) for v in (*kept, *again))
  np.testing.assert_array_equal(kept[0].numpy(), plain[0])
  np.testing.assert_array_equal(again[0].numpy(), 4.0 * x)
  np.testing.assert_array_equal(again[1].numpy(), 4.0 * x)
  # In any other context it is a no-op: the C++ runtime returns NumPy as always.
  with tensor_results() as keeping:
    assert not keeping
    assert all(isinstance(v, np.ndarray) for v in scaled_pair(x, x))


def test_results_are_not_held_in_reference_cycles(contexts):
  # A result's tensors are freed when the caller drops them, not when Python's cycle
  # collector next runs: a recursive closure in the result's unflattening once made every
  # call a reference cycle that held its tensors (~320 MB a KAPC round at 100 × 60 mlp2).
  import gc  # pylint: disable=g-import-not-at-top

  @tff.tensorflow.computation(tff.TensorType(np.float32, [3]))
  def nested(x):
    return x * 2.0, (x + 1.0, x - 1.0)

  x = np.array([1.0, -2.0, 0.5], np.float32)
  tff.framework.set_default_context(InProcessContext())
  enabled = gc.isenabled()
  try:
    nested(x)  # Imported and traced before counting.
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    for _ in range(3):
      nested(x)
    gc.collect()
    held = [o for o in gc.garbage if tf.is_tensor(o)]
  finally:
    gc.set_debug(0)
    gc.garbage.clear()
    if enabled:
      gc.enable()
    tff.framework.set_default_context(contexts['tff_cpp'])
  assert not held, f'{len(held)} result tensors were only reachable through reference cycles'


def _count_stacked_splits(monkeypatch) -> list:
  """From now on, records the size of every stacked CLIENTS value the in-process executor
  splits into per-client values (none when it stays stacked)."""
  from fltff.runtime import in_process  # pylint: disable=g-import-not-at-top

  splits = []
  original = in_process._members  # pylint: disable=protected-access

  def counting_members(value):
    if isinstance(value, in_process.StackedClients):
      splits.append(value.num_clients)
    return original(value)

  monkeypatch.setattr(in_process, '_members', counting_members)
  return splits


def test_stacked_clients_stay_stacked_and_equal_the_per_client_list(contexts, monkeypatch):
  # A vectorised client work hands the aggregator its participants' values as one stacked
  # structure (`StackedClients`); zip, map and fold keep it stacked (no per-participant
  # split) and give the numbers of the per-participant list, bit for bit. A computation that
  # returns a CLIENTS value gives it back per participant.
  from fltff.runtime import in_process  # pylint: disable=g-import-not-at-top

  value_type = tff.StructType([('a', tff.TensorType(np.float32, [3])),
                               ('b', tff.TensorType(np.float32, [2, 2]))])
  mean = tff.aggregators.MeanFactory().create(value_type, tff.TensorType(np.float32))
  rng = np.random.default_rng(1)
  stacked = collections.OrderedDict(a=rng.normal(size=(6, 3)).astype(np.float32),
                                    b=rng.normal(size=(6, 2, 2)).astype(np.float32))
  weights = rng.uniform(1, 9, size=6).astype(np.float32)
  values = in_process.StackedClients(stacked, 6).members()
  assert len(values) == 6 and np.array_equal(values[4]['b'], stacked['b'][4])
  context = InProcessContext()
  tff.framework.set_default_context(context)
  splits = _count_stacked_splits(monkeypatch)
  from_stacked = mean.next(mean.initialize(), in_process.StackedClients(stacked, 6),
                           in_process.StackedClients(weights, 6)).result
  assert not splits  # Zipped, mapped and folded stacked.
  assert in_process.clients_argument(in_process.StackedClients(weights, 6)).num_clients == 6
  from_list = mean.next(mean.initialize(), values, list(weights)).result

  @tff.federated_computation(tff.FederatedType(value_type, tff.CLIENTS))
  def identity(x):
    return x

  returned = identity(in_process.StackedClients(stacked, 6))
  tff.framework.set_default_context(contexts['tff_cpp'])
  as_list = in_process.clients_argument(in_process.StackedClients(weights, 6))
  assert isinstance(as_list, list) and np.array_equal(np.stack(as_list), weights)
  for k in 'ab':
    np.testing.assert_array_equal(from_stacked[k], from_list[k])
    np.testing.assert_allclose(
        from_stacked[k], np.tensordot(weights, stacked[k], axes=1) / weights.sum(), rtol=1e-5)
    assert len(returned) == 6
    for i in range(6):
      np.testing.assert_array_equal(returned[i][k], stacked[k][i])


def test_a_mapped_graph_with_random_draws_gives_every_call_the_first_draw(contexts):
  # TFF's runtime runs a graph afresh for a call, so a stateful random op gives the call its
  # first draw (TFF's C++ runtime runs participants concurrently on shared kernels, and which
  # of them see a later draw varies from run to run: measured here). In process, every call
  # gets the first draw: never vectorised (one draw for all) or looped (the state advances).
  @tff.tensorflow.computation(np.float32)
  def add_noise(x):
    return x + tf.random.stateless_uniform([], seed=[1, 2]) + tf.random.uniform([], seed=7)

  @tff.federated_computation(tff.FederatedType(np.float32, tff.CLIENTS))
  def noisy(values):
    return tff.federated_map(add_noise, values)

  values = np.arange(1, 5, dtype=np.float32)
  context = InProcessContext()
  tff.framework.set_default_context(contexts['tff_cpp'])
  first_draw = add_noise(np.float32(0))  # One call: the first draw.
  tff.framework.set_default_context(context)
  results = [noisy(list(values)) for _ in range(2)]
  tff.framework.set_default_context(contexts['tff_cpp'])
  functions = [fn for _, fn in context._functions.values()]  # pylint: disable=protected-access
  # pylint: disable=protected-access
  assert all(fn._looped.get(name) is None for fn in functions
             for name in ('vectorized_map', 'looped_map'))
  # pylint: enable=protected-access
  for result in results:
    np.testing.assert_allclose(result, values + first_draw, rtol=1e-6)


def test_a_layerwise_aggregation_folds_stacked_clients_in_one_call(contexts, monkeypatch):
  # FedLayerWise's single-pass aggregate gathers every participant's update; TFF's compiler
  # wraps its accumulate in a lambda (`x -> let v = C(x) in v`), which the executor runs as C
  # itself, and C only appends rows, so the fold is one concatenation: no per-participant
  # split, the C++ runtime's numbers.
  from fltff.runtime import in_process  # pylint: disable=g-import-not-at-top

  value_type = tff.types.tensorflow_to_type(
      [tf.TensorSpec([4, 3], tf.float32), tf.TensorSpec([3], tf.float32)])
  weight_type = tff.types.tensorflow_to_type(collections.OrderedDict(
      num_examples=tf.TensorSpec([], tf.float32), client_index=tf.TensorSpec([], tf.int32)))
  process = aggregators.layerwise_adaptive_factory([[0, 1]], num_clients=8).create(
      value_type, weight_type)
  rng = np.random.default_rng(2)
  updates = [rng.normal(size=(6, 4, 3)).astype(np.float32),
             rng.normal(size=(6, 3)).astype(np.float32)]
  weights = collections.OrderedDict(num_examples=rng.uniform(1, 9, 6).astype(np.float32),
                                    client_index=np.array([5, 0, 7, 2, 1, 3], np.int32))
  stacked = (in_process.StackedClients(updates, 6), in_process.StackedClients(weights, 6))
  tff.framework.set_default_context(contexts['tff_cpp'])
  expected = process.next(process.initialize(), stacked[0].members(), stacked[1].members())
  context = InProcessContext()
  tff.framework.set_default_context(context)
  splits = _count_stacked_splits(monkeypatch)
  try:
    actual = process.next(process.initialize(), *stacked)
  finally:
    tff.framework.set_default_context(contexts['tff_cpp'])
  assert not splits
  # The gathering fold was one concatenation (it appends each client's value as a row).
  assert any(fn._append_columns for _, fn in context._functions.values())  # pylint: disable=protected-access
  for a, b in zip(tf.nest.flatten(actual.result), tf.nest.flatten(expected.result)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  for name in ('psi', 'smoothed_angle'):
    np.testing.assert_allclose(actual.measurements[name], expected.measurements[name],
                               rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize('dtype', [np.float32, np.int64, np.bool_])
def test_aligned_stack_equals_np_stack_and_its_tensor_shares_the_buffer(dtype):
  from fltff.runtime.in_process import aligned_stack  # pylint: disable=g-import-not-at-top
  from fltff.runtime.in_process import stacked_tensor  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(0)
  rows = [(rng.normal(size=(300, 1000)) * 10).astype(dtype) for _ in range(3)]
  stacked = aligned_stack(rows)
  np.testing.assert_array_equal(stacked, np.stack(rows))
  assert stacked.dtype == np.stack(rows).dtype and stacked.ctypes.data % 64 == 0
  tensor = stacked_tensor(stacked)
  np.testing.assert_array_equal(tensor.numpy(), np.stack(rows))
  if dtype is np.bool_:  # Not a DLPack dtype here: copied.
    return
  # Shared, not copied (what makes it cheap): a write to the array shows in the tensor. The
  # array stays alive while the tensor does.
  stacked[1, 2, 3] = 7
  assert tensor[1, 2, 3].numpy() == 7
  del stacked
  assert tensor[1, 2, 3].numpy() == 7


def test_stacked_tensor_copies_what_tensorflow_cannot_take_as_it_is():
  from fltff.runtime.in_process import stacked_tensor  # pylint: disable=g-import-not-at-top

  raw = np.zeros(300 * 1000 * 4 + 64 + 4, np.uint8)
  start = (-raw.ctypes.data) % 64 + 4  # 4 bytes past a 64-byte boundary.
  misaligned = raw[start:start + 300 * 1000 * 4].view(np.float32).reshape(300, 1000)
  misaligned[:] = 1.5
  for value in (misaligned, misaligned[:, ::2], np.ones(10, np.float32)):
    tensor = stacked_tensor(value)  # A misaligned buffer shared would abort the process.
    np.testing.assert_array_equal(tensor.numpy(), value)
    if value.size > 10:
      value[0, 0] = 3.0
      assert tensor[0, 0].numpy() == 1.5  # A copy.
      value[0, 0] = 1.5


def test_results_are_read_only_views_of_the_computations_tensors(tff_runtime):
  # A model-sized result is handed back without a copy (`_to_python`), read-only so nothing
  # writes into a buffer TensorFlow may share; the values are the computation's.
  @tff.tensorflow.computation(tff.TensorType(np.float32, [300, 200]))
  def double(x):
    return x * 2.0

  x = np.arange(60000, dtype=np.float32).reshape(300, 200)
  context = InProcessContext()
  tff.framework.set_default_context(context)
  try:
    result = double(x)
  finally:
    tff.framework.set_default_context(tff_runtime.context)
  np.testing.assert_array_equal(result, 2.0 * x)
  assert not result.flags.writeable
  with pytest.raises(ValueError, match='read-only'):
    result[0, 0] = 1.0
  assert result.copy().flags.writeable  # A copy is the caller's own.
