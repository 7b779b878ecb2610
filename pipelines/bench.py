r"""Round-time benchmarks, always as ratios against a baseline measured in the same run.

  python -m pipelines.bench [--rounds=8] [--clients=10] [--examples=600]
      fltff's FedAvg on TFF's local runtime vs a plain TensorFlow loop (see below).
  python -m pipelines.bench --compare=fedadp,fedlayerwise [--model=cnn_mnist_582k --batch_size=16]
      each listed method's round vs fltff's FedAvg round (same data, same client steps), e.g.
      the cost of an aggregation factory relative to FedAvg's weighted mean.
  python -m pipelines.bench --compare=fedlap,fedlayerwise --vectorize_clients
      the same with every method (FedAvg too) on vectorised clients (experiment.client_work).
  python -m pipelines.bench --executors [--executor_shapes=mlp2:10x600,mlp2:100x60,cnn2:10x600]
      FedAvg rounds of TFF's built-in `build_weighted_fed_avg`, of fltff on TFF's C++ runtime, on
      the in-process executor (`runtime.executor`) and with vectorised clients
      (`experiment.client_work`), as ratios to the built-in.
  python -m pipelines.bench --executors --executor_baseline=fltff_vectorized_cpu
      --executor_variants=fltff_vectorized_gpu --executor_methods=
      vectorised FedAvg rounds on the GPU as ratios to the same rounds on this machine's CPU
      (what `python -m pipelines.gpu_check` runs).
  python -m pipelines.bench --runtimes [--runtime_shapes=mlp2:100x60,cnn2:20x300]
      a FedAvg round on the local runtime and on 1 and 2 remote TFF workers (started here, on
      loopback, each pinned to a core of its own), client by client and vectorised in groups
      (one per worker, `fltff.learning.groups`), with the tensor bytes to and from each worker.
  python -m pipelines.bench --checkpoints [--model=mlp2 --clients=10 --checkpoint_changed=20
      --checkpoint_dir=DIR]
      the cost of durable checkpoints: saving the global model and each client's state (a
      personal model and the server's copy, as KAPC keeps) with the store's fingerprint, as a
      run saves, vs without `fsync` of file and folder, and vs hashing every state anew instead
      of only the changed ones, in DIR (default: a temporary folder; pass a folder on the disk
      your runs write to).

Both sides do the same work per round: every client starts from the global MLP (784-200-10),
runs `--epochs` epochs of SGD with momentum over its `--examples` examples in batches of
`--batch_size` (reshuffled per round, identical batches on both sides), and the server takes
the sample-weighted mean. The plain loop is a single-process `tf.function` per client with the
same `Dataset.reduce` step. Rounds alternate between the two (this machine is shared and
noisy); the first round of each is tracing and is excluded. The medians of the remaining
rounds and their ratio are printed. Data are random MNIST-shaped uint8 images (seeded): speed
does not depend on pixel values, and no download is needed.
"""

import contextlib
import functools
import itertools
import os
import statistics
import sys
import time
from typing import Sequence

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position
import tensorflow as tf  # pylint: disable=g-import-not-at-top,wrong-import-position
from absl import flags  # pylint: disable=g-import-not-at-top,wrong-import-position
from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top,wrong-import-position

from fltff import learning  # pylint: disable=g-import-not-at-top,wrong-import-position
from fltff import methods as method_registry  # pylint: disable=g-import-not-at-top,wrong-import-position
from fltff import runtime  # pylint: disable=g-import-not-at-top,wrong-import-position
from fltff.errors import ConfigError  # pylint: disable=g-import-not-at-top,wrong-import-position
from fltff.data.pipeline import ClientDatasets  # pylint: disable=g-import-not-at-top,wrong-import-position
from fltff.learning import protocol  # pylint: disable=g-import-not-at-top,wrong-import-position
from fltff.models import build_model  # pylint: disable=g-import-not-at-top,wrong-import-position
from fltff.runtime import heap  # pylint: disable=g-import-not-at-top,wrong-import-position
from fltff.simulation.state_store import ClientStateStore  # pylint: disable=g-import-not-at-top,wrong-import-position
from . import capacity  # pylint: disable=g-import-not-at-top,wrong-import-position
from . import memory_bench  # pylint: disable=g-import-not-at-top,wrong-import-position
from . import torch_reference  # pylint: disable=g-import-not-at-top,wrong-import-position

_ROUNDS = flags.DEFINE_integer('rounds', 8, 'Rounds per variant (the first is excluded).')
_CLIENTS = flags.DEFINE_integer('clients', 10, 'Clients per round.')
_EXAMPLES = flags.DEFINE_integer('examples', 600, 'Examples per client.')
_BATCH = flags.DEFINE_integer('batch_size', 10, 'Local batch size.')
_EPOCHS = flags.DEFINE_integer('epochs', 1, 'Local epochs.')
_MODEL = flags.DEFINE_string('model', 'mlp2', 'Model zoo name (28x28x1 inputs).')
_COMPARE = flags.DEFINE_list('compare', [], 'Methods to time against fltff FedAvg '
                             '(fedprox, sgdm, fedlap, fedadp, fedlayerwise, fednova, fedbabu, scaffold, '
                             'moon, <base>+ccn, kapc, kapc+bls, fedamp, fedbn, local, pfedla); empty: '
                             'FedAvg vs plain TF.')
_VECTORIZE = flags.DEFINE_bool('vectorize_clients', False, 'For --compare: every method '
                               '(FedAvg too) with vectorised clients on the in-process executor '
                               "(experiment.client_work = 'vectorised').")
_RUNTIMES = flags.DEFINE_bool('runtimes', False, 'Compare local vs 1 and 2 remote workers.')
_RUNTIME_SHAPES = flags.DEFINE_list('runtime_shapes', ['mlp2:100x60', 'cnn2:20x300'],
                                    'model:CLIENTSxEXAMPLES for --runtimes.')
_CAPACITY_SHAPES = flags.DEFINE_list(
    'capacity_shapes', ['resnet18:2x50'], 'For --runtimes: model:CLIENTSxEXAMPLES timed '
    'vectorised in process only, for the capacity projection of models not run on workers.')
_CAPACITY_CLIENTS = flags.DEFINE_integer('capacity_clients', 1000, 'For --runtimes: the '
                                         'participants per round of the capacity projection.')
_EXECUTORS = flags.DEFINE_bool('executors', False, "FedAvg rounds of TFF's built-in process, "
                                'fltff on the C++ runtime and fltff on the in-process executor, '
                                'for each --executor_shapes entry.')
_EXECUTOR_SHAPES = flags.DEFINE_list('executor_shapes', ['mlp2:10x600', 'mlp2:100x60',
                                                         'cnn2:10x600'],
                                     'model:CLIENTSxEXAMPLES (examples per client) or '
                                     'model:CLIENTSxFEWEST-MOST (unequal clients, sizes spread '
                                     'evenly), for --executors.')
_EXECUTOR_VARIANTS = flags.DEFINE_list(
    'executor_variants', ['fltff_tff_cpp', 'fltff_in_process', 'fltff_vectorized',
                          'one_model_floor'],
    "For --executors: the fltff variants to time beside the baseline (e.g. one at a time, "
    'for the peak RSS of that variant alone), fltff_vectorized_one_group: vectorised with every '
    'client padded to the longest (no groups of unequal clients), fltff_vectorized_cpu and '
    "fltff_vectorized_gpu: vectorised on '/CPU:0' or '/GPU:0' (fltff_vectorized: TensorFlow's "
    'choice, the GPU where it sees one), and one_model_floor: one model '
    "trained on every client's batch at once, no per-client weights (the arithmetic's floor, "
    'not FL).')
_EXECUTOR_BASELINE = flags.DEFINE_string(
    'executor_baseline', 'tff_builtin',
    "For --executors: the column every ratio is to, timed first: tff_builtin (TFF's "
    "build_weighted_fed_avg on TFF's C++ runtime) or one of the variants (TFF's built-in and the "
    'PyTorch reference columns are then not timed).')
_EXECUTOR_BUDGET = flags.DEFINE_float(
    'executor_budget_s', 0.0, 'For --executors: start no further shape once this many seconds '
    'have passed since the first one started (0: no limit); the table holds the shapes timed.')
_EXECUTOR_METHODS = flags.DEFINE_list(
    'executor_methods', ['fedlap', 'fedlayerwise', 'kapc'],
    "For --executors: methods (as --compare names them) also timed with vectorised clients "
    "on the in-process executor, as ratios to the same run's TFF built-in FedAvg.")
_CHECKPOINTS = flags.DEFINE_bool('checkpoints', False, 'Time durable checkpoint saves (fsync) '
                                  'against the same saves without fsync.')
_CHECKPOINT_CHANGED = flags.DEFINE_integer(
    'checkpoint_changed', 20, 'For --checkpoints: client states replaced between two saves (a '
    "round's participants times experiment.checkpoint_every).")
_CHECKPOINT_DIR = flags.DEFINE_string('checkpoint_dir', None, 'For --checkpoints: where to '
                                      'write (default: a temporary folder).')
_MEMORY = flags.DEFINE_list('memory', [], 'Memory per round of the driver and its worker for '
                            'these runs (tff_fedavg, fedavg, fedlayerwise, kapc; "all": every '
                            'one), each in its own process (pipelines/memory_bench.py).')
_MEMORY_ROUNDS = flags.DEFINE_integer('memory_rounds', 300, 'Rounds per run for --memory.')
_RECYCLE_EVERY = flags.DEFINE_integer('recycle_every', 0, 'For --memory: recycle the local '
                                      'worker every this many rounds (0: never).')
_MMAP_THRESHOLD = flags.DEFINE_integer(
    'mmap_threshold_kib', heap.DEFAULT_MMAP_THRESHOLD_KIB, "For --memory: runtime.mmap_threshold_kib (0: glibc's default "
    'malloc, no heap trim; fltff.runtime.heap).')
_MEMORY_PROBE = flags.DEFINE_string('memory_probe', None, 'Internal: one --memory run.')
_LR = 0.01
_MOMENTUM = 0.9


class _BenchClients(list):
  """The clients' `(x, y)` arrays, with their datasets built as the pipeline driver builds
  them (`ClientDatasets`: each client's example pipeline once, a shuffle per round)."""

  def __init__(self, arrays):
    super().__init__(arrays)
    self.datasets = ClientDatasets(self.__getitem__, _BATCH.value)


def input_shape(model: str) -> tuple[int, int, int]:
  """(H, W, C) of the bench's images for `model`: CIFAR-shaped for resnet18, else MNIST-shaped
  (`torch_reference.input_shape`, channels last)."""
  channels, height, width = torch_reference.input_shape(model)
  return height, width, channels


def _client_data(num_clients, examples, seed=0, shape=(28, 28, 1)) -> _BenchClients:
  """`examples` per client, or with `examples = (fewest, most)` sizes spread evenly between
  them (unequal clients, as a label-skewed partition makes them)."""
  rng = np.random.default_rng(seed)
  if isinstance(examples, tuple):
    sizes = np.linspace(*examples, num_clients).round().astype(int)
  else:
    sizes = [examples] * num_clients
  return _BenchClients([(rng.integers(0, 256, size=(n, *shape), dtype=np.uint8),
                         rng.integers(0, 10, size=n).astype(np.int32)) for n in sizes])


class PlainTfFedAvg:
  """FedAvg written directly in TensorFlow: one Keras model reused for every client."""

  def __init__(self, keras_fn):
    self.model = keras_fn()
    self.loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    variables = self.model.trainable_variables

    @tf.function
    def train_client(dataset):
      velocity = tuple(tf.zeros_like(v) for v in variables)

      def step(state, batch):
        velocity = state
        with tf.GradientTape() as tape:
          loss = self.loss_fn(batch['y'], self.model(batch['x'], training=True))
        grads = tape.gradient(loss, variables)
        velocity = tuple(_MOMENTUM * m + g for m, g in zip(velocity, grads))
        for v, m in zip(variables, velocity):
          v.assign_sub(_LR * m)
        return velocity

      for _ in tf.range(_EPOCHS.value):
        velocity = dataset.reduce(velocity, step)
      return tuple(v.read_value() for v in variables)

    self._train_client = train_client

  def round(self, global_weights, datasets, sizes):
    total = float(sum(sizes))
    new = [np.zeros_like(w) for w in global_weights]
    for batches, n in zip(datasets, sizes):
      for v, w in zip(self.model.trainable_variables, global_weights):
        v.assign(w)
      trained = self._train_client(batches.dataset)
      for acc, w in zip(new, trained):
        acc += (n / total) * w.numpy()
    return new


class OneModelFloor:
  """The round's arithmetic without federated learning, as a floor for the executors: ONE Keras
  model trained (SGD with momentum) on all the clients' examples in batches of clients × batch
  examples (as many steps as one client's epoch when the clients are equal). Per-client
  weights make the same FLOPs as K small convolutions/matmuls instead of one K-times-larger
  one; this is how fast that one larger one runs here."""

  def __init__(self, keras_fn, data: _BenchClients):
    self.model = keras_fn()
    variables = self.model.trainable_variables
    x = np.concatenate([x for x, _ in data])
    y = np.concatenate([y for _, y in data])
    batch = min(_BATCH.value * len(data), len(y))
    steps = len(y) // batch  # Full batches (a smaller last one is dropped).
    self._x = tf.constant(x[:steps * batch].reshape(steps, batch, *x.shape[1:]).astype(
        np.float32) / 255.0)
    self._y = tf.constant(y[:steps * batch].reshape(steps, batch))

    @tf.function
    def epoch(x, y):
      velocity = tuple(tf.zeros_like(v) for v in variables)
      for s in tf.range(tf.shape(x)[0]):
        with tf.GradientTape() as tape:
          loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
              y[s], self.model(x[s], training=True)))
        grads = tape.gradient(loss, variables)
        velocity = tuple(_MOMENTUM * m + g for m, g in zip(velocity, grads))
        for v, m in zip(variables, velocity):
          v.assign_sub(_LR * m)
      return loss

    self._epoch = epoch

  def round(self, datasets):
    del datasets  # The examples are held as one tensor (not read per round).
    for _ in range(_EPOCHS.value):
      self._epoch(self._x, self._y).numpy()


def _round_datasets(data: _BenchClients, r):
  return [data.datasets.batches(k, shuffle_seed=r * 1000 + k) for k in range(len(data))]


def _round_fn(algorithm, sizes=None):
  """One round of any method (`protocol.run_round`, the driver's core) on given datasets, with
  all clients taking part (`sizes`: their example counts, default `--examples` each); its
  state (server state, client states) carries over."""
  holder = {'state': algorithm.initialize()}
  store = ClientStateStore(algorithm.initial_client_state)

  def one_round(datasets):
    out, _ = protocol.run_round(
        algorithm, holder['state'], range(len(datasets)), batches_of=lambda k: datasets[k],
        epochs_of=lambda k: _EPOCHS.value,
        num_examples_of=lambda k: _EXAMPLES.value if sizes is None else sizes[k],
        client_state_of=store.get)
    holder['state'] = out.state
    for k, value in out.client_states.items():
      store.set(k, value)

  return one_round


def method_builders(spec, num_clients: int) -> dict:
  """`{method name: build(client_optimizer)}` for every method and variant of the registry
  (`fltff.methods`): the methods the bench can time."""
  return {name: functools.partial(
      lambda opt, name: method_registry.build(name, spec, num_clients, opt), name=name)
          for name in method_registry.names(variants=True)}


def compare_methods(spec, data) -> int:
  """Median round time of each `--compare` method relative to FedAvg, alternating rounds."""
  builders = method_builders(spec, len(data))
  names = ['fedavg'] + [m for m in _COMPARE.value if m != 'fedavg']
  unknown = [m for m in names if m not in builders]
  if unknown:
    print(f'error: unknown method(s) {unknown}; choose from {sorted(builders)}', file=sys.stderr)
    return 2
  with runtime.InProcessRuntime() if _VECTORIZE.value else runtime.LocalWorkerRuntime():
    opt = learning.client_optimizer(name='sgdm', learning_rate=_LR, momentum=_MOMENTUM)
    algorithms = {m: builders[m](opt) for m in names}
    if _VECTORIZE.value:
      try:
        algorithms = {m: a.with_vectorized_clients() for m, a in algorithms.items()}
      except ConfigError as e:
        print(f'error: {e}', file=sys.stderr)
        return 2
    rounds = {m: _round_fn(a) for m, a in algorithms.items()}
    times = {m: [] for m in names}
    for r in range(_ROUNDS.value):
      datasets = _round_datasets(data, r)
      for m in (names if r % 2 == 0 else names[::-1]):  # Alternate the order too.
        t0 = time.perf_counter()
        rounds[m](datasets)
        times[m].append(time.perf_counter() - t0)
      print(f'round {r + 1}: ' + ', '.join(f'{m} {times[m][-1]:.3f} s' for m in names),
            flush=True)
  med = {m: statistics.median(v[1:]) for m, v in times.items()}
  print(f'\nRound time, {len(data)} clients x {_EXAMPLES.value} examples, {spec.name}, batch '
        f'{_BATCH.value}, {_EPOCHS.value} epoch(s)'
        f'{", vectorised clients" if _VECTORIZE.value else ""}; median of rounds '
        f'2-{_ROUNDS.value}:')
  for m in names:
    print(f'  {m:14s} {med[m]:.3f} s   ratio vs fedavg {med[m] / med["fedavg"]:.3f}')
  return 0


def _torch_importable() -> bool:
  import importlib.util  # pylint: disable=g-import-not-at-top

  return importlib.util.find_spec('torch') is not None


def _torch_round(model: str, data: _BenchClients, style: str):
  """A `rounds[name](datasets)` callable of the PyTorch reference on the same examples (NCHW,
  scaled as fltff's pipeline scales them), on this machine's CPU."""
  arrays = [(x.transpose(0, 3, 1, 2).astype(np.float32) / 255.0, y.astype(np.int64))
            for x, y in data]
  runner = torch_reference.FedAvgRound(model, arrays, style, 'cpu', _BATCH.value, _EPOCHS.value)
  counter = itertools.count()
  return lambda datasets: runner(next(counter))


def _parse_shape(text: str):
  """`(model, clients, examples)` of `model:CLIENTSxEXAMPLES`, or of
  `model:CLIENTSxFEWEST-MOST` (unequal clients, `examples = (fewest, most)`)."""
  try:
    model, dims = text.split(':')
    clients, examples = dims.lower().split('x')
    clients = int(clients)
    examples = (tuple(int(v) for v in examples.split('-')) if '-' in examples
                else int(examples))
    if clients < 1 or min(np.atleast_1d(examples)) < 1 or np.size(examples) > 2:
      raise ValueError
  except ValueError:
    raise ValueError(f'--executor_shapes entry {text!r} is not model:CLIENTSxEXAMPLES or '
                     'model:CLIENTSxFEWEST-MOST, e.g. mlp2:10x600, cnn2:10x100-1100') from None
  return model, clients, examples


def compare_executors() -> int:
  """Median FedAvg round of TFF's built-in process (C++ runtime), fltff on the C++ runtime,
  fltff on the in-process executor and fltff with vectorised clients (in-process, on the CPU,
  the GPU or TensorFlow's choice), alternating, per shape; ratios against `--executor_baseline`
  (TFF's built-in unless told otherwise)."""
  import resource  # pylint: disable=g-import-not-at-top

  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top
  from fltff.runtime.in_process import InProcessContext  # pylint: disable=g-import-not-at-top
  from fltff.runtime.runtimes import check_executor  # pylint: disable=g-import-not-at-top

  try:
    shapes = [_parse_shape(t) for t in _EXECUTOR_SHAPES.value]
  except ValueError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  known = ('fltff_tff_cpp', 'fltff_in_process', 'fltff_vectorized', 'fltff_vectorized_one_group',
           'fltff_vectorized_cpu', 'fltff_vectorized_gpu', 'one_model_floor')
  unknown = [v for v in _EXECUTOR_VARIANTS.value if v not in known]
  if unknown or not _EXECUTOR_VARIANTS.value:
    print(f'error: --executor_variants {unknown or "(empty)"}: choose from {list(known)}',
          file=sys.stderr)
    return 2
  baseline = _EXECUTOR_BASELINE.value
  if baseline not in ('tff_builtin', *known):
    print(f'error: --executor_baseline {baseline!r}: tff_builtin or one of {list(known)}',
          file=sys.stderr)
    return 2
  methods = [m for m in _EXECUTOR_METHODS.value if m != 'fedavg']
  unknown = [m for m in methods if m not in method_builders(None, 1)]
  if unknown:
    print(f'error: --executor_methods {unknown}: choose from '
          f'{sorted(method_builders(None, 1))}', file=sys.stderr)
    return 2
  # Where each in-process column runs (`runtime.device`); the others: TensorFlow's choice.
  variants = [baseline, *_EXECUTOR_VARIANTS.value]
  devices = {}
  for v, device in (('fltff_vectorized_cpu', 'cpu'), ('fltff_vectorized_gpu', 'gpu')):
    if v in variants:
      try:
        devices[v] = check_executor('in_process', device)
      except ConfigError as e:  # No GPU that TensorFlow sees.
        print(f'error: {v}: {e}', file=sys.stderr)
        return 2
  # The baseline is always measured: every ratio is against it. The PyTorch reference rounds
  # (`pipelines.torch_reference`) join TFF's built-in where torch imports; fltff never needs it.
  torch_styles = (torch_reference.STYLES if baseline == 'tff_builtin' and _torch_importable()
                  else ())
  names = (baseline, *[v for v in known if v in variants and v != baseline], *torch_styles,
           *(f'vectorized:{m}' for m in methods))
  results = []
  start = time.perf_counter()
  with runtime.LocalWorkerRuntime() as rt:
    cpp_context = rt.context
    in_process = {device: InProcessContext(device=device)
                  for device in {devices.get(n) for n in names}}
    contexts = {n: cpp_context if n in ('tff_builtin', 'fltff_tff_cpp')
                else in_process[devices.get(n)] for n in names}
    for model, clients, examples in shapes:
      label = f'{model} {clients}x' + '-'.join(str(n) for n in np.atleast_1d(examples))
      if _EXECUTOR_BUDGET.value and time.perf_counter() - start > _EXECUTOR_BUDGET.value:
        print(f'{label}: not timed (--executor_budget_s={_EXECUTOR_BUDGET.value:.0f} spent)',
              flush=True)
        continue
      shape = input_shape(model)
      keras_fn = functools.partial(build_model, model, input_shape=shape, num_classes=10, seed=0)
      spec = learning.ModelSpec(keras_fn, shape, 10, name=model)
      data = _client_data(clients, examples, shape=shape)
      opt = learning.client_optimizer(name='sgdm', learning_rate=_LR, momentum=_MOMENTUM)
      rounds = {}
      if 'tff_builtin' in names:
        builtin = tff.learning.algorithms.build_weighted_fed_avg(
            spec.tff_model,
            client_optimizer_fn=tff.learning.optimizers.build_sgdm(_LR, _MOMENTUM),
            server_optimizer_fn=tff.learning.optimizers.build_sgdm(1.0))
        tff.framework.set_default_context(cpp_context)
        builtin_state = {'state': builtin.initialize()}

        def builtin_round(datasets, holder=builtin_state, process=builtin):
          # TFF's built-in trains one pass over each dataset: --epochs passes are a repeat (a
          # reshuffling dataset reshuffles on each, as fltff's epochs do).
          datasets = [d.dataset for d in datasets]
          if _EPOCHS.value > 1:
            datasets = [d.repeat(_EPOCHS.value) for d in datasets]
          holder['state'] = process.next(holder['state'], datasets).state

        rounds['tff_builtin'] = builtin_round
      builders = method_builders(spec, clients)
      for name in names:
        if name == 'tff_builtin':
          continue
        if name == 'one_model_floor':
          rounds[name] = OneModelFloor(keras_fn, data).round
          continue
        if name in torch_styles:
          if model not in torch_reference.MODELS:
            continue  # No PyTorch twin of this zoo model.
          rounds[name] = _torch_round(model, data, name)
          continue
        tff.framework.set_default_context(contexts[name])
        method = name.split(':')[1] if name.startswith('vectorized:') else 'fedavg'
        algorithm = builders[method](opt)
        if name.startswith('fltff_vectorized') or method != 'fedavg':
          try:
            # experiment.client_work = 'vectorised', on the column's device.
            algorithm = algorithm.with_vectorized_clients(devices.get(name))
          except ConfigError as e:
            print(f'{name} on {model}: not timed ({e})', flush=True)
            continue
          if name == 'fltff_vectorized_one_group':
            # Every client padded to the longest: the baseline of the grouping of unequal
            # clients (which the others do on a CPU, as `'auto'` does).
            algorithm.vectorized_work().group_clients = False
        rounds[name] = _round_fn(algorithm, [len(y) for _, y in data])
      measured = [n for n in names if n in rounds]
      times = {n: [] for n in measured}
      for r in range(_ROUNDS.value):
        datasets = _round_datasets(data, r)
        for n in (measured if r % 2 == 0 else measured[::-1]):
          tff.framework.set_default_context(contexts[n])
          # A CPU column's eager ops between its computations (stacking the round's batches)
          # too, which TensorFlow would otherwise place on a GPU.
          cpu = devices.get(n) == '/CPU:0'
          t0 = time.perf_counter()
          with tf.device('/CPU:0') if cpu else contextlib.nullcontext():
            rounds[n](datasets)
          times[n].append(time.perf_counter() - t0)
        print(f'{label} round {r + 1}: '
              + ', '.join(f'{n} {times[n][-1]:.3f} s' for n in measured), flush=True)
      results.append((label,
                      {n: statistics.median(v[1:]) for n, v in times.items()}))
    tff.framework.set_default_context(cpp_context)
    worker_mib = sum(memory_bench.rss_mib(p) for p in rt.worker_pids)
  peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
  fedavg_names = [n for n in names if not n.startswith('vectorized:')]
  print(f'\nFedAvg round, batch {_BATCH.value}, {_EPOCHS.value} epoch(s), SGD {_LR} momentum '
        f'{_MOMENTUM}; median of rounds 2-{_ROUNDS.value}, ratio to {_column(baseline)}:')
  print('\n'.join(executor_table(results, fedavg_names, baseline)))
  if methods:
    print(f'\nOther methods with vectorised clients (in-process), same runs: ratio to '
          f'{_column(baseline)} FedAvg [and to fltff_vectorized FedAvg]:')
    print(f'  {"shape":18s}' + ''.join(f'{m:>32s}' for m in methods))
    for label, med in results:
      ours = med.get('fltff_vectorized')
      print(f'  {label:18s}' + ''.join(
          (f'{med["vectorized:" + m]:>11.3f} s ({med["vectorized:" + m] / med[baseline]:6.3f}x'
           + (f' [{med["vectorized:" + m] / ours:5.2f}x])' if ours else ')' + ' ' * 9))
          if 'vectorized:' + m in med else f'{"-":>32s}' for m in methods))
  print(f'  peak RSS of this process (driver + in-process executor): {peak_mib:.0f} MiB; '
        f'worker_binary at the end: {worker_mib:.0f} MiB')
  return 0


def executor_table(results: Sequence[tuple[str, dict]], names: Sequence[str],
                   baseline: str) -> list[str]:
  """The executors table: a header of `names`, then per `(shape, {name: median seconds})` of
  `results` each column's seconds and its ratio to the `baseline` column's ('-': not timed)."""
  lines = [f'  {"shape":18s}' + ''.join(f'{n:>24s}' for n in names)]
  for label, med in results:
    lines.append(f'  {label:18s}' + ''.join(
        f'{med[n]:>11.3f} s ({med[n] / med[baseline]:6.3f}x)' if n in med else f'{"-":>24s}'
        for n in names))
  return lines


def _column(name: str) -> str:
  """How the executors table names its baseline column."""
  return "TFF's built-in" if name == 'tff_builtin' else name


def _pin(pids: Sequence[int], *cores: int) -> None:
  """Every thread of `pids` on CPUs `cores` only (`taskset -a -p -c cores pid`)."""
  for pid in pids:
    for task in os.listdir(f'/proc/{pid}/task'):
      os.sched_setaffinity(int(task), set(cores))


def compare_runtimes() -> int:
  """Median FedAvg round per `--runtime_shapes` entry on the local runtime and on 1 and 2
  loopback workers, client by client and vectorised in groups, and vectorised in process,
  alternating; each worker pinned to a core of its own (the cores taken in turn). Then the
  capacity model (`pipelines/capacity.py`) fitted to these rounds, its check against them and
  its projection to `--capacity_clients` participants."""
  from fltff.runtime.processes import WorkerProcess  # pylint: disable=g-import-not-at-top

  cores = sorted(os.sched_getaffinity(0))
  servers = [WorkerProcess() for _ in range(3)]
  for server, core in zip(servers, (0, 0, 1)):
    _pin([server.pid], cores[core % len(cores)])
  variants = {'local': (None, False), '1 worker': ([0], False), '2 workers': ([1, 2], False),
              'vectorised 1 worker': ([0], True), 'vectorised 2 workers': ([1, 2], True),
              'vectorised in process': ((), True)}
  runtimes = {}
  summary = []
  try:
    runtimes['local'] = runtime.LocalWorkerRuntime()
    _pin(runtimes['local'].worker_pids, cores[0])
    for name, (used, _) in variants.items():
      if used == ():
        runtimes[name] = runtime.InProcessRuntime()
      elif used is not None:
        runtimes[name] = runtime.RemoteWorkersRuntime(
            workers=[servers[i].address for i in used])
    shapes = [(s, False) for s in _RUNTIME_SHAPES.value] + [
        (s, True) for s in _CAPACITY_SHAPES.value]
    for shape, in_process_only in shapes:
      used = {n: rt for n, rt in runtimes.items()
              if not in_process_only or n == 'vectorised in process'}
      med, times, sent = _time_runtimes(shape, used, {n: variants[n][1] for n in used})
      print(f'{shape}: ' + ', '.join(
          f'{n} {med[n]:.3f} s (first round {times[n][0]:.1f} s)' for n in used), flush=True)
      summary.append((shape, med, sent))
  finally:
    for rt in runtimes.values():
      rt.close()
    for s in servers:
      s.stop()
  print(f'\nFedAvg round on loopback workers ({_BATCH.value} examples a batch, each worker on '
        f'one of cores {cores}); median of rounds 2-{_ROUNDS.value}:')
  for shape, med, sent in summary:
    if '1 worker' not in med:
      print(f'  {shape}: vectorised in process {med["vectorised in process"]:.3f} s')
      continue
    per_client = med['1 worker']
    print(f'  {shape}: local {med["local"]:.3f} s | client by client: 1 worker '
          f'{per_client:.3f} s, 2 workers {med["2 workers"]:.3f} s | vectorised: 1 worker '
          f'{med["vectorised 1 worker"]:.3f} s, 2 workers {med["vectorised 2 workers"]:.3f} s'
          f' | vectorised in process {med["vectorised in process"]:.3f} s')
    print(f'    vectorised on 1 worker: {per_client / med["vectorised 1 worker"]:.2f}x the '
          f'clients per second of client by client; on 2 workers '
          f'{med["vectorised 1 worker"] / med["vectorised 2 workers"]:.2f}x of 1 worker')
    for name, per_worker in sent.items():
      print(f'    {name}: MB to / from each worker per round: ' + ', '.join(
          f'{down / 1e6:.2f} / {up / 1e6:.2f}' for down, up in per_worker))
  print('\n'.join(capacity_report(summary)))
  return 0


def _time_runtimes(shape: str, runtimes: dict, vectorised: dict) -> tuple[dict, dict, dict]:
  """`(median seconds, every round's seconds, bytes to and from each worker)` per runtime of
  FedAvg rounds of `shape` (model:CLIENTSxEXAMPLES), the runtimes alternating."""
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

  model, num_clients, examples = _parse_shape(shape)
  image = input_shape(model)
  keras_fn = functools.partial(build_model, model, input_shape=image, num_classes=10, seed=0)
  spec = learning.ModelSpec(keras_fn, image, 10, name=model)
  data = _client_data(num_clients, examples, shape=image)
  opt = learning.client_optimizer(name='sgdm', learning_rate=_LR, momentum=_MOMENTUM)
  rounds, times, groups = {}, {name: [] for name in runtimes}, {}
  for name, rt in runtimes.items():
    algorithm = method_registry.build('fedavg', spec, client_optimizer=opt)
    if vectorised[name]:
      algorithm = algorithm.with_vectorized_clients()
    rt.place(algorithm)
    groups[name] = getattr(rt, 'groups', None)
    rounds[name] = _round_fn(algorithm, [examples] * num_clients)
  contexts = {name: getattr(rt, 'driver_context', None) or rt.context
              for name, rt in runtimes.items()}
  cores = sorted(os.sched_getaffinity(0))
  for r in range(_ROUNDS.value):
    datasets = _round_datasets(data, r)
    order = list(runtimes) if r % 2 == 0 else list(runtimes)[::-1]
    for name in order:
      tff.framework.set_default_context(contexts[name])
      one_core = name == 'vectorised in process'  # On one core, as each worker trains.
      if one_core:
        _pin([os.getpid()], cores[0])
      t0 = time.perf_counter()
      rounds[name](datasets)
      times[name].append(time.perf_counter() - t0)
      if one_core:
        _pin([os.getpid()], *cores)
  med = {name: statistics.median(v[1:]) for name, v in times.items()}
  return med, times, {n: g.last_bytes for n, g in groups.items() if g}


def capacity_report(summary: Sequence[tuple[str, dict, dict]]) -> list[str]:
  """The capacity model fitted to `compare_runtimes`' rounds: its coefficients, its 1- and
  2-worker predictions against the measured rounds, and a round of `--capacity_clients`
  participants on 4, 16 and 64 such workers."""
  shapes, timed_alone = [], []
  for text, med, sent in summary:
    model, clients, examples = _parse_shape(text)
    shape = capacity.Shape(model, clients, examples, med['vectorised in process'],
                           med.get('vectorised 1 worker'), med.get('vectorised 2 workers'),
                           sent.get('vectorised 1 worker', ()), sent.get('vectorised 2 workers', ()))
    (shapes if shape.bytes_two else timed_alone).append(shape)
  if not shapes:
    return []
  t_call, t_byte = driver = capacity.driver_costs(shapes)
  lines = ['\nCapacity model (pipelines/capacity.py): T(W, N) = t_call W + t_byte B(W, N) + t_0 + '
           't_client ceil(N/W); t_0 and t_client from the in-process rounds on one core; the '
           f'driver {t_call * 1e3:.1f} ms a worker call, {t_byte * 1e9:.2f} ns a byte:']
  fits = {}
  for key in dict.fromkeys((s.model, s.examples) for s in shapes):
    fits[key] = f = capacity.fit([s for s in shapes if (s.model, s.examples) == key], driver)
    lines.append(f'  {key[0]}, {key[1]} examples a client: t_0 {f.t_0:.3f} s, t_client '
                 f'{f.t_client * 1e3:.1f} ms, a worker {f.b_model / 1e6:.2f} MB, a client '
                 f'{f.b_client / 1e6:.2f} MB')
  lines.append('  check (predicted / measured round):')
  for s, workers, predicted, measured in capacity.validation(shapes):
    lines.append(f'    {s.model}:{s.clients}x{s.examples} on {workers} worker(s): '
                 f'{predicted:.3f} s / {measured:.3f} s ({100 * (predicted / measured - 1):+.0f} %)')
  base_key = max(fits, key=lambda k: fits[k].t_client)  # The heaviest model run on workers.
  base = fits[base_key]
  model_bytes = lambda model: 4 * sum(int(np.prod(w.shape)) for w in build_model(
      model, input_shape=input_shape(model), num_classes=10, seed=0).trainable_weights)
  for s in timed_alone:
    per_example = (capacity.example_bytes(base, base_key[1])
                   - int(np.prod(input_shape(base_key[0]))) + int(np.prod(input_shape(s.model))))
    fits[(s.model, s.examples)] = capacity.scaled(base, s, model_bytes(s.model), per_example)
  n = _CAPACITY_CLIENTS.value
  lines.append(f'  projection, {n} participants a round, each worker as one core here; FedAvg '
               "(the group's mean update back) | a method that needs each client's model back:")
  for (model, examples), f in fits.items():
    for name, g in (('group means', f), ("clients' models", f.with_client_models(
        model_bytes(model)))):
      rows = ', '.join(f'{w} workers {t:.1f} s ({gb:.2f} GB, driver {100 * share:.0f} %)'
                       for w, t, gb, share in capacity.projection(g, n))
      bound = g.driver_bound_from(n)
      lines.append(f'    {model}, {examples} examples a client, {name}: {rows}; the driver is '
                   f'the limit from {bound or "no"} worker{"" if bound == 1 else "s"}')
  return lines


def compare_checkpoints(spec) -> int:
  """Median seconds per checkpoint of `--clients` client states as the driver saves it (the
  store's fingerprint, then `Checkpointer.save`): durable (`fsync`), without `fsync`, and
  durable with every state's digest computed anew (the cost without the store's cached
  digests), in turn; between two saves `--checkpoint_changed` clients get new states."""
  import tempfile  # pylint: disable=g-import-not-at-top

  from fltff.simulation.checkpoint import Checkpointer  # pylint: disable=g-import-not-at-top

  weights = [np.asarray(w) for w in spec.initial_weights().trainable]
  # A personal model and the server's copy apart (KAPC+BLS's of a layer not uploaded).
  state = lambda c: {'model': [w + np.float32(c) for w in weights], 'server_copy': weights}
  store = ClientStateStore(state)
  for c in range(_CLIENTS.value):
    store.get(c)
  changed = min(_CHECKPOINT_CHANGED.value, _CLIENTS.value)
  megabytes = sum(a.nbytes for a in weights + list(store.checkpoint(0).values())) / 2**20
  kinds = ('durable', 'without fsync', 'durable, every state hashed')
  times = {kind: [] for kind in kinds}
  with tempfile.TemporaryDirectory(dir=_CHECKPOINT_DIR.value) as folder:
    savers = {kind: Checkpointer(os.path.join(folder, str(i)), durable=kind != 'without fsync')
              for i, kind in enumerate(kinds)}
    for r in range(1, _ROUNDS.value + 1):
      for kind in kinds[r % 3:] + kinds[:r % 3]:  # Each goes first in turn.
        store.set_many({(r * changed + j) % _CLIENTS.value: state(r) for j in range(changed)}, r)
        if kind == 'durable, every state hashed':  # The same arrays set anew: no digest kept.
          store.set_many({c: store.get(c) for c in range(_CLIENTS.value)}, r)
        t0 = time.perf_counter()
        savers[kind].save(r, weights, {'client_states': store.fingerprint(r)}, store.checkpoint(r))
        times[kind].append(time.perf_counter() - t0)
    where = _CHECKPOINT_DIR.value or tempfile.gettempdir()
  medians = {kind: statistics.median(times[kind][1:]) for kind in kinds}
  print(f'checkpoint of {megabytes:.1f} MB ({_MODEL.value}, global model + {_CLIENTS.value} '
        f'client states of 2 models, {changed} new between saves) in {where}; median of saves '
        f'2-{_ROUNDS.value}:')
  for kind in kinds:
    print(f'  {kind + ":":28s} {medians[kind]:.4f} s  (ratio to durable: '
          f'{medians[kind] / medians["durable"]:.3f})')
  return 0


def main(argv) -> int:
  del argv
  heap.pooled_tensors()  # Before the first TensorFlow op, as `fltff run` (fltff.runtime.heap).
  absl_logging.set_verbosity(absl_logging.WARNING)
  # Every comparison installs the contexts it times; TFF's import-time one is never used (and
  # would print a traceback at exit after an early `error:` return).
  runtime.release_default_context()
  if _MEMORY_PROBE.value:
    return memory_bench.run_probe(_MEMORY_PROBE.value, _MEMORY_ROUNDS.value, _RECYCLE_EVERY.value,
                                  _MMAP_THRESHOLD.value)
  if _MEMORY.value:
    methods = memory_bench.METHODS if _MEMORY.value == ['all'] else _MEMORY.value
    return memory_bench.compare(methods, _MEMORY_ROUNDS.value, _RECYCLE_EVERY.value,
                                _MMAP_THRESHOLD.value)
  if _ROUNDS.value < 2:
    print(f'error: --rounds={_ROUNDS.value}: the first round traces and is left out of the '
          'median, so a comparison needs --rounds=2 or more.', file=sys.stderr)
    return 2
  if _EXECUTORS.value:
    return compare_executors()
  keras_fn = lambda: build_model(_MODEL.value, input_shape=(28, 28, 1), num_classes=10, seed=0)
  spec = learning.ModelSpec(keras_fn, (28, 28, 1), 10, name=_MODEL.value)
  if _RUNTIMES.value or _CHECKPOINTS.value:  # Either or both, in one process.
    return max((compare() for compare, asked in ((compare_runtimes, _RUNTIMES.value),
                                                 (lambda: compare_checkpoints(spec),
                                                  _CHECKPOINTS.value)) if asked), default=0)
  data = _client_data(_CLIENTS.value, _EXAMPLES.value)
  if _COMPARE.value:
    return compare_methods(spec, data)
  sizes = [len(y) for _, y in data]
  with runtime.LocalWorkerRuntime():
    client_opt = learning.client_optimizer(name='sgdm', learning_rate=_LR, momentum=_MOMENTUM)
    algorithm = method_registry.build('fedavg', spec, client_optimizer=client_opt)
    fltff_round = _round_fn(algorithm)
    plain = PlainTfFedAvg(keras_fn)
    plain_weights = [np.asarray(w) for w in spec.initial_weights().trainable]
    times = {'fltff_tff': [], 'plain_tf': []}
    for r in range(_ROUNDS.value):
      datasets = _round_datasets(data, r)
      t0 = time.perf_counter()
      fltff_round(datasets)
      times['fltff_tff'].append(time.perf_counter() - t0)
      t0 = time.perf_counter()
      plain_weights = plain.round(plain_weights, datasets, sizes)
      times['plain_tf'].append(time.perf_counter() - t0)
      print(f'round {r + 1}: fltff/TFF {times["fltff_tff"][-1]:.3f} s, '
            f'plain TF {times["plain_tf"][-1]:.3f} s', flush=True)
  med = {k: statistics.median(v[1:]) for k, v in times.items()}
  print(f'\nFedAvg round, {_CLIENTS.value} clients x {_EXAMPLES.value} examples, {_MODEL.value}, '
        f'batch {_BATCH.value}, {_EPOCHS.value} epoch(s); median of rounds 2-{_ROUNDS.value}:')
  print(f'  fltff on TFF local runtime: {med["fltff_tff"]:.3f} s')
  print(f'  plain TensorFlow loop:      {med["plain_tf"]:.3f} s')
  print(f'  ratio fltff/plain:          {med["fltff_tff"] / med["plain_tf"]:.3f}  (target <= 1.25)')
  return 0


if __name__ == '__main__':
  from fltff.cli import run_program  # pylint: disable=g-import-not-at-top
  run_program(main)
