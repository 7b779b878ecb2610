"""Client-vectorised local training: one round's participants trained in one TensorFlow step.

TFF maps the client work over participants one at a time (one graph call per client; on the
C++ runtime also one serialised dataset and one gRPC call each). Here the participants'
weights get a leading client axis and every local step is one `tf.vectorized_map` over the
clients: a batched matmul/convolution instead of K small ones. It is the same
computation as `client_work.build_local_training` — the same regulariser hooks, frozen
tensors, metrics and update weight, and the same optimizer arithmetic (`stacked_optimizer`:
TFF's SGD(M) in place on the stacked weights, any other optimizer's `next` mapped over the
clients) — so a round's results equal TFF's to float rounding (tests/test_vectorized.py).

Clients differ in batch count, last-batch size and epochs: the round's batches are padded to
`[epochs, steps, clients, batch, ...]`, padded examples are masked out of the loss (the mean
is over the real examples only) and a client with no batch at a step keeps its weights and
optimizer state (`tf.where`), so padding changes nothing.

When every client starts from the global model with the shared regulariser, the first epoch's
regulariser context is the same for all of them and is computed once; an epoch whose anchored
term `s ⊙ (w − global)` has every scale zero (FedLap's first epoch: λ = 0 at local = global)
takes the plain update. Both are exact: the same numbers, less work.

Scope (anything else raises a `ConfigError` naming it): models whose variables are all
trainable (no BatchNorm statistics) and have no layer losses; the default client work of
`process.build_algorithm` (FedAvg, FedProx, FedLap, SGDM, FedAdp, FedLayerWise, FedNova,
FedBABU, CCN); SCAFFOLD (`scaffold.VectorizedScaffoldWork`: per-client corrections, the
gradient mean tracked); and, through `fltff.personalization.vectorized` (per-client start
weights and regularisers), the personalised process (KAPC with or without BLS, FedAMP, Local,
pFedLA); MOON (`moon.VectorizedMoonWork`: a per-client regulariser with a batch-dependent
term, the contrastive loss over the batch's representations, masked to its real examples).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import weakref
from collections.abc import Sequence
from typing import Any, Callable, Optional

import numpy as np
import tensorflow as tf

from fltff.errors import ConfigError
from fltff.learning import client_work as client_work_lib
from fltff.learning import factored_dense
from fltff.data.pipeline import ArraySource
from fltff.data.pipeline import array_source
from fltff.data.pipeline import preprocess_batch
from fltff.learning.model_spec import ModelSpec
from fltff.learning.stacked_optimizer import Anchor
from fltff.learning.stacked_optimizer import FusedSGDM
from fltff.learning.stacked_optimizer import broadcast_clients
from fltff.learning.stacked_optimizer import stacked_optimizer
from fltff.runtime.in_process import StackedClients
from fltff.runtime.in_process import aligned_stack
from fltff.runtime.in_process import stacked_tensor
from fltff.runtime.in_process import clients_argument


def functional_apply(keras_model: tf.keras.Model, weights_model: Optional[tf.keras.Model] = None):
  """`apply(trainable, x, training)`: `keras_model`'s output with the trainable weights of
  `weights_model` (default: `keras_model`; e.g. the full model when `keras_model` is its
  latent sub-model, which shares its layers) replaced by the tensors `trainable` (in
  `trainable_weights` order).

  Each weight is found as an attribute of its layer (Dense's `kernel`, Conv2D's `bias`, ...)
  and swapped for the call, so the layers' own `call` code runs on plain tensors, which
  `tf.vectorized_map` can stack along a client axis. Raises `ConfigError` for models this
  cannot express (non-trainable weights, layer losses, weights not held as layer attributes).
  """
  weights_model = keras_model if weights_model is None else weights_model
  slots = weight_slots(keras_model, weights_model)

  def apply(trainable: Sequence[tf.Tensor], x: tf.Tensor, training: bool = True,
            kernel_products: Optional[dict[int, Callable]] = None) -> tf.Tensor:
    """`kernel_products` (`{trainable index: product}`, plain `Dense` kernels only): that
    layer computes `product(x)` in place of `x @ kernel` (`factored_dense.dense_call`)."""
    saved = [getattr(layer, name) for layer, name in slots]
    products = kernel_products or {}
    try:
      for (layer, name), value in zip(slots, trainable):
        object.__setattr__(layer, name, value)  # No Keras tracking: restored below.
      for i, product in products.items():
        layer = slots[i][0]
        object.__setattr__(layer, 'call', factored_dense.dense_call(layer, product))
      return keras_model(x, training=training)
    finally:
      for (layer, name), value in zip(slots, saved):
        object.__setattr__(layer, name, value)
      for i in products:
        object.__delattr__(slots[i][0], 'call')  # The class's `call` again.

  apply.slots = slots
  return apply


def weight_slots(keras_model: tf.keras.Model, weights_model: tf.keras.Model
                 ) -> list[tuple[Any, str]]:
  """`(layer, attribute)` holding each of `weights_model`'s trainable weights, for
  `functional_apply` (`ConfigError` for what it cannot express)."""
  if weights_model.non_trainable_weights:
    raise ConfigError(
        f'vectorised clients need a model whose weights are all trainable; {keras_model.name} '
        f'has non-trainable weights (e.g. BatchNorm statistics): use '
        f'runtime.vectorize_clients = False.')
  if weights_model.losses:
    raise ConfigError(f'vectorised clients do not support layer losses ({keras_model.name}).')
  slots = []
  for variable in weights_model.trainable_weights:
    slot = next(((layer, name) for layer in weights_model.layers
                 for name, value in vars(layer).items() if value is variable), None)
    if slot is None:
      raise ConfigError(f'vectorised clients cannot find the layer attribute holding '
                        f'{variable.name} in {keras_model.name}.')
    slots.append(slot)
  return slots


def _read_options() -> tf.data.Options:
  """tf.data's static graph optimisations off: they rewrite each client's pipeline when its
  iterator is created (most of a small client's read time), and change no element or
  order."""
  options = tf.data.Options()
  options.experimental_optimization.apply_default_optimizations = False
  options.autotune.enabled = False
  return options


def stack_client_batches(client_inputs: Sequence[Any],
                         read_before: Optional[weakref.WeakSet] = None) -> collections.OrderedDict:
  """The participants' batches for every local epoch, as rows of one example table.

  Returns `examples [N + 1, ...]` (float32) and `labels [N + 1]` (int32) as tensors, whose last
  row is zeros (padding), and NumPy arrays `index [E, S, K, B]` (the row of each batch
  position: epoch e, step s, client k's batch is `examples[index[e, s, k]]`), `mask
  [E, S, K, B]` (1 for a real example), `valid [E, S, K]` (client k trains at epoch e, step s),
  `epochs [K]`. `round_batches` gives the batches themselves.

  Each client's dataset is read once per epoch, as the client work iterates it inside a TFF
  computation (a dataset that reshuffles every iteration gives the same epoch orders as its
  `repeat`). Epoch 0's batches are kept even for a client with no epochs (they feed CCN's
  latent mean, computed over the data after training).

  Datasets made by `ClientDatasets` (the pipeline driver's) are read from their arrays: one
  pipeline draws the shuffled orders of indices, the table holds each participant's examples
  once (whatever the number of epochs) and `preprocess_batch` runs once on it
  (`data.pipeline.ArraySource`). Other datasets are read through tf.data, and the table holds
  every batch as read (one copy per epoch).

  A dataset in `read_before` (which collects every dataset read here) is rebuilt from its graph
  first (`fresh_dataset`): TFF's runtime deserialises every dataset it gets, so a dataset
  passed again starts its shuffle afresh there, not where its last read left it.
  """
  read_before = weakref.WeakSet() if read_before is None else read_before
  epochs = [client_work_lib.client_info_of_input(data)['epochs'] for data in client_inputs]
  passes = [max(e, 1) for e in epochs]
  sources = [array_source(data['batches']) for data in client_inputs]
  from_arrays = bool(sources) and all(source is not None for source in sources)
  if from_arrays:
    table_x, table_y, rows, sizes, counts = _read_array_sources(sources, passes, read_before)
  else:
    table_x, table_y, rows, sizes, counts = _read_datasets(
        [_as_tff_reads(data['batches'], read_before) for data in client_inputs], passes)
  # Where each batch goes: client c's epochs one after another, each its steps in order.
  client = np.repeat(np.arange(len(counts)), [c * p for c, p in zip(counts, passes)])
  epoch = np.concatenate([np.repeat(np.arange(p), c) for c, p in zip(counts, passes)] or [[]])
  step = np.concatenate([np.tile(np.arange(c), p) for c, p in zip(counts, passes)] or [[]])
  client, epoch, step = (a.astype(np.int64) for a in (client, epoch, step))
  num_epochs = max(passes, default=1)
  steps = max(counts, default=0)
  k = len(counts)
  batch = rows.shape[1] if rows.ndim > 1 else 0
  padding = len(table_y)  # The zero row appended below.
  index = np.full((num_epochs, steps, k, batch), padding, np.int64)
  mask = np.zeros((num_epochs, steps, k, batch), np.float32)
  valid = np.zeros((num_epochs, steps, k), bool)
  index[epoch, step, client] = np.where(rows >= 0, rows, padding)
  mask[epoch, step, client] = np.arange(batch) < sizes[:, np.newaxis]
  valid[epoch, step, client] = epoch < np.asarray(epochs, np.int64)[client]
  table_x = np.concatenate([table_x, np.zeros((1, *table_x.shape[1:]), table_x.dtype)])
  table_y = np.concatenate([table_y, np.zeros(1, table_y.dtype)])
  if from_arrays:
    # The pipeline's per-example preprocessing, on the whole table at once (elementwise, so
    # the same values; the padding row stays zeros).
    processed = preprocess_batch(collections.OrderedDict(x=table_x, y=table_y))
    table_x, table_y = processed['x'], processed['y']
  # As tensors: the round's examples are copied once, into TensorFlow (a NumPy round trip of
  # a 100-client round's images would cost a noticeable part of the round).
  return collections.OrderedDict(
      examples=tf.cast(table_x, tf.float32), labels=tf.cast(table_y, tf.int32), index=index,
      mask=mask, valid=valid, epochs=np.asarray(epochs, np.int32))


def round_batches(data: collections.OrderedDict) -> tuple[np.ndarray, np.ndarray]:
  """`(x [E, S, K, B, ...], y [E, S, K, B])`: the batches of a `stack_client_batches` result
  (padding positions zeros), e.g. to inspect a round."""
  return (np.asarray(data['examples'])[data['index']], np.asarray(data['labels'])[data['index']])


def _as_tff_reads(dataset: tf.data.Dataset, read_before: weakref.WeakSet) -> tf.data.Dataset:
  """`dataset` as TFF's runtime would read it: rebuilt from its graph (`fresh_dataset`) when it
  was read here before, since TFF deserialises every dataset it gets anew."""
  from fltff.runtime.in_process import fresh_dataset  # pylint: disable=g-import-not-at-top

  fresh = fresh_dataset(dataset) if dataset in read_before else dataset
  read_before.add(dataset)
  return fresh


def _round_choice(counts: Sequence[int], passes: Sequence[int]) -> np.ndarray:
  """Which client's dataset each element of the round's stream comes from: client after
  client, `counts` elements per pass, `passes` passes each."""
  return np.repeat(np.arange(len(counts), dtype=np.int64),
                   [c * p for c, p in zip(counts, passes)])


def _round_stream(datasets: Sequence[tf.data.Dataset], passes: Sequence[Any],
                  choice) -> tf.data.Dataset:
  """One tf.data pipeline for the whole round (`_round_choice`'s order), each dataset repeated
  for its passes (Python ints or scalar tensors): about ten times cheaper than an eager
  iterator per client and epoch."""
  return tf.data.Dataset.choose_from_datasets(
      [ds if isinstance(p, int) and p == 1 else ds.repeat(p) for ds, p in zip(datasets, passes)],
      tf.data.Dataset.from_tensor_slices(choice), stop_on_empty_dataset=False)


@tf.function(reduce_retracing=True)
def _read_orders(orders: Sequence[tf.data.Dataset], passes: tf.Tensor,
                 choice: tf.Tensor) -> tf.Tensor:
  """`_round_stream` over the clients' order datasets, read as one vector. Built inside a
  traced function, traced again only for another participant count (the passes are a
  tensor): constructing the pipeline over 100 datasets eagerly every round costs more than
  reading it."""
  passes = [passes[i] for i in range(len(orders))]
  return _round_stream(orders, passes, choice).batch(
      tf.size(choice, out_type=tf.int64)).with_options(_read_options()).get_single_element()


def _read_array_sources(sources: Sequence[ArraySource], passes: Sequence[int],
                        read_before: weakref.WeakSet):
  """`(table_x, table_y, rows, sizes, batches per epoch)` of the round from the clients' arrays
  (at least one client): the table is the participants' examples, each once, one client after
  another (the raw arrays' values: `preprocess_batch` still to apply); `rows [T, B]` is each
  batch's table rows (each client's epochs' batches in order; -1 pads a short batch). One
  tf.data pipeline draws every client's epoch orders (indices only), several times cheaper
  than going through the datasets' per-example map."""
  orders = [_as_tff_reads(source.order, read_before) for source in sources]
  sizes_n = [source.num_examples for source in sources]
  choice = _round_choice(sizes_n, passes)
  flat = (_read_orders(orders, np.asarray(passes, np.int64), choice).numpy() if len(choice)
          else np.zeros(0, np.int64))
  xs, ys, rows, sizes, counts = [], [], [], [], []
  offset = table_offset = 0
  batch = max(source.batch_size for source in sources)
  for source, n, p in zip(sources, sizes_n, passes):
    x, y = source.arrays()
    xs.append(x)
    ys.append(y)
    steps = -(-n // source.batch_size)
    order = flat[offset:offset + n * p].reshape(p, n)
    offset += n * p
    # Each epoch's order cut into batches of `batch_size`, the last one padded (index -1).
    index = np.full((p, steps, batch), -1, np.int64)
    for s in range(steps):
      chunk = order[:, s * source.batch_size:(s + 1) * source.batch_size]
      index[:, s, :chunk.shape[1]] = chunk + table_offset
    index = index.reshape(p * steps, batch)
    table_offset += len(y)
    rows.append(index)
    sizes.append((index >= 0).sum(axis=1))
    counts.append(steps)
  return (np.concatenate(xs), np.concatenate(ys), np.concatenate(rows), np.concatenate(sizes),
          counts)


def _read_datasets(datasets: Sequence[tf.data.Dataset], passes: Sequence[int]):
  """`(table_x, table_y, rows, sizes, batches per epoch)` of the round from the clients'
  datasets (see `_read_array_sources`): the table holds every batch as read (each client's
  epochs' batches in order, padded to the largest batch)."""
  bx, by, sizes, counts = _read_dataset_batches(datasets, passes)
  batch = by.shape[1] if by.ndim > 1 else 0
  rows = np.arange(len(by) * batch, dtype=np.int64).reshape(len(by), batch)
  rows = np.where(np.arange(batch) < sizes[:, np.newaxis], rows, -1)
  return bx.reshape(-1, *bx.shape[2:]), by.reshape(-1), rows, sizes, counts


def _read_dataset_batches(datasets: Sequence[tf.data.Dataset], passes: Sequence[int]):
  """`(x, y, sizes, batches per epoch)` of the round from the clients' datasets: x `[T, B,
  ...]` (each client's epochs' batches in order, padded), y `[T, B]`, sizes `[T]`."""
  counts = [int(dataset.cardinality()) for dataset in datasets]
  if any(c < 0 for c in counts):
    # Unknown batch counts (e.g. a `filter`): read the clients one by one.
    batches = [[[(b['x'].numpy(), b['y'].numpy()) for b in ds.with_options(_read_options())]
                for _ in range(p)] for ds, p in zip(datasets, passes)]
    counts = [len(b[0]) for b in batches]
    flat = [batch for client in batches for epoch in client for batch in epoch]
    batch = max((len(y) for _, y in flat), default=0)
    example = flat[0][0].shape[1:] if flat else ()
    bx = np.zeros((len(flat), batch, *example), np.float32)
    by = np.zeros((len(flat), batch), np.int32)
    sizes = np.zeros(len(flat), np.int64)
    for t, (x, y) in enumerate(flat):
      bx[t, :len(y)], by[t, :len(y)], sizes[t] = x, y, len(y)
    return bx, by, sizes, counts
  choice = _round_choice(counts, passes)
  stream, length = _round_stream(datasets, passes, choice), len(choice)
  if not length:
    return np.zeros((0, 0), np.float32), np.zeros((0, 0), np.int32), np.zeros(0, np.int64), counts
  stream = stream.map(lambda b: (b['x'], b['y'], tf.shape(b['y'], out_type=tf.int64)[0]))
  bx, by, sizes = (t.numpy() for t in stream.padded_batch(length).with_options(
      _read_options()).get_single_element())
  return bx, by, sizes, counts


# How many distinct client counts `_train_fn` is traced for with the count fixed (one trace
# each, a few seconds); rounds with further counts share one trace with a dynamic axis.
MAX_STATIC_CLIENT_COUNTS = 4


def with_clients(structure: Any, num_clients: Optional[int], axis: int = 0) -> Any:
  """`structure`'s tensors with their client axis `axis` fixed at `num_clients` (unchanged
  when None).

  `tf.vectorized_map` hands each client its row through `gather(x, i)`, which pfor turns
  back into `x` itself only when both `x`'s leading dimension and the number of clients are
  known at trace time; otherwise it copies every mapped argument, the stacked weights
  included, at every local step (a tenth of a round's op time and more).
  """
  if num_clients is None or structure is None:
    return structure

  def fix(t):
    t = tf.convert_to_tensor(t)
    shape = t.shape.as_list()
    shape[axis] = num_clients
    return tf.ensure_shape(t, shape)

  return tf.nest.map_structure(fix, structure)


def stack_clients(values: Sequence[Any]) -> Any:
  """The participants' values (one nested structure of arrays each: client states, local
  models) stacked along a new leading client axis, as tensors."""
  return tf.nest.map_structure(lambda *rows: stacked_tensor(aligned_stack(rows)), *values)


def _round_specs(args: Sequence[Any], num_clients: Optional[int]) -> list:
  """`_train_fn`'s arguments as `tf.TensorSpec`s for a trace that serves every round with
  `num_clients` participants (None: any number): the global weights as they are; the starts
  and client terms (`[K, ...]`) with their client axis `num_clients`; the round's example
  table and its `[E, S, K, B]` batch index, mask and `[E, S, K]` step flags with only the
  client axis fixed."""
  global_trainable, start, client_terms, examples, labels, index, mask, valid, epochs = args

  def spec(t, unknown=(), client_axis=None):
    shape = list(np.shape(t))
    for axis in unknown:
      shape[axis] = None
    if client_axis is not None:
      shape[client_axis] = num_clients
    return tf.TensorSpec(shape, tf.as_dtype(t.dtype))

  def specs(structure, client_axis=None):
    return None if structure is None else tf.nest.map_structure(
        lambda t: spec(t, client_axis=client_axis), structure)

  return [specs(global_trainable), specs(start, 0), specs(client_terms, 0),
          spec(examples, unknown=[0]), spec(labels, unknown=[0]),
          spec(index, unknown=[0, 1, 3], client_axis=2),
          spec(mask, unknown=[0, 1, 3], client_axis=2),
          spec(valid, unknown=[0, 1], client_axis=2), spec(epochs, client_axis=0)]


class _EveryDataset:
  """A `read_before` set that holds every dataset (`train(..., read_before_elsewhere=True)`)."""

  def __contains__(self, dataset) -> bool:
    return True

  def add(self, dataset) -> None:
    del dataset


class VectorizedClientWork:
  """`client_work.build_client_work`'s computation for all of a round's participants at once.

  `__call__(global_weights, client_inputs, call)` returns `(results, train_metrics,
  regularizer_stats)`: the participants' `ClientResult`s (`StackedClientResults`: update
  `global − trained`, weight as `client_work.client_result`), the round's training metrics (the participants'
  unfinalized metrics through `tff.learning.metrics.sum_then_finalize`, run by `call`), and
  the participants' mean regulariser measurements (None without them).
  """

  def __init__(self, model_spec: ModelSpec, optimizer,
               regularizer: Optional[client_work_lib.LocalRegularizer] = None,
               weight_fields: Sequence[str] = (), frozen: Sequence[int] = (),
               client_weighting: str = 'num_examples', device: Optional[str] = None,
               client_regularizer: Optional[Callable[[Any], Any]] = None,
               track_gradient_mean: bool = False, latent: bool = False,
               factor_dense: bool = True):
    import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

    client_work_lib.check_weight_fields(weight_fields)
    client_work_lib.check_client_weighting(client_weighting)
    if regularizer is not None and client_regularizer is not None:
      raise ValueError('give a shared regularizer or a client_regularizer, not both.')
    if regularizer is not None and client_work_lib.traits_of(regularizer).batch_term:
      raise ConfigError(f'vectorised clients do not support a shared regulariser with a batch '
                        f'term ({type(regularizer).__name__}).')
    with tf.Graph().as_default():
      tff_model = model_spec.tff_model()
      unfinalized = tff_model.report_local_unfinalized_metrics()
      known = {'accuracy', 'loss', 'num_examples', 'num_batches'}
      if set(unfinalized) != known:
        raise ConfigError(f'vectorised clients compute the metrics {sorted(known)}; the model '
                          f'reports {sorted(unfinalized)}.')
      self._metric_dtypes = {name: [v.dtype.as_numpy_dtype for v in values]
                             for name, values in unfinalized.items()}
      metrics_type = tff.types.tensorflow_to_type(tf.nest.map_structure(
          lambda t: tf.TensorSpec(t.shape, t.dtype), unfinalized))
      metrics_aggregation_fn = tff.learning.metrics.sum_then_finalize(
          tff_model.metric_finalizers(), metrics_type)

    # The client work's own metrics aggregation (sum over participants, then the model's
    # finalizers), run by the round's `call` as TFF runs it.
    @tff.federated_computation(tff.FederatedType(metrics_type, tff.CLIENTS))
    def aggregate_metrics(model_outputs):
      return metrics_aggregation_fn(model_outputs)

    self._aggregate_metrics = aggregate_metrics
    # Built after the graph-mode model above: Keras invalidates eager models made before one.
    self._keras_fn = model_spec.keras_fn
    self._keras_model = model_spec.keras_fn()
    self._apply = functional_apply(self._keras_model)
    self._latent = None
    self._latent_and_output = None
    if latent or 'latent_mean' in weight_fields:
      # Built here, eagerly, like the model (not while `_train` is traced).
      from fltff.models import latent_model  # pylint: disable=g-import-not-at-top
      latent_keras = latent_model(self._keras_model)
      self._latent = (functional_apply(latent_keras, self._keras_model),
                      int(latent_keras.output_shape[-1]))
    if latent:
      # The latent layer and the logits from one forward pass (a regulariser that contrasts
      # the training pass's representation, MOON, gets it without a second pass).
      self._latent_and_output = functional_apply(
          tf.keras.Model(self._keras_model.inputs,
                         [latent_keras.output, self._keras_model.output]), self._keras_model)
    self._updater = stacked_optimizer(optimizer, frozenset(frozen))
    # Dense kernels that rounds with a short history train in factored form (`factored_dense`).
    self._dense_kernels = (factored_dense.dense_kernels(self._apply.slots, frozenset(frozen))
                           if factor_dense and isinstance(self._updater, FusedSGDM)
                           and not track_gradient_mean else {})
    self._regularizer = regularizer
    self._client_regularizer = client_regularizer
    self._weight_fields = tuple(weight_fields)
    self._frozen = frozenset(frozen)
    self._client_weighting = client_weighting
    self._track_gradient_mean = track_gradient_mean
    self._device = device
    self._train = tf.function(self._train_fn, reduce_retracing=True)
    self._static_client_counts: set[int] = set()
    self._traced_for: set[tuple[Optional[int], frozenset]] = set()
    self._read_before = weakref.WeakSet()
    # The factored kernel sets the training was traced with (`factored_dense`), for inspection.
    self.factored_traces: set[tuple[int, ...]] = set()

  @property
  def latent_apply(self):
    """`apply(trainable, x, training)` of the model's latent layer (`models.latent_model`,
    sharing the model's layers; `functional_apply`): CCN's latent mean, MOON's
    representation. Needs `latent=True` (or a `latent_mean` weight field)."""
    if self._latent is None:
      raise ValueError('VectorizedClientWork(latent=True) builds the latent-layer model.')
    return self._latent[0]

  def _restore_tf2_layer_classes(self) -> None:
    """Makes the eager Keras model callable again after a model was built in a graph.

    Building a Keras model inside a `tf.Graph` (TFF traces every computation that way) swaps
    the Keras layer classes to their TF1 implementations, and a model built eagerly before then
    refuses to be called ("invalid state") — e.g. when `_train` retraces for a new round shape.
    Building one model eagerly swaps the classes back.
    """
    from keras.src.engine import base_layer_v1  # pylint: disable=g-import-not-at-top

    if any(isinstance(layer, base_layer_v1.Layer)
           for layer in (self._keras_model, *self._keras_model.layers)):
      self._keras_fn()

  # -- the TensorFlow part -----------------------------------------------------------------
  def _train_fn(self, global_trainable, start, client_terms, examples, labels, index, mask,
                valid, epochs, num_clients=None, factored=frozenset()):
    """Local training of every participant (`build_local_training` with a client axis); each
    step gathers its batches from the round's example table (`stack_client_batches`).

    The clients start from `global_trainable` (FedAvg family) or, when given, from their own
    `start` weights `[K, ...]` (personalised methods, whose clients keep a model). With
    `client_terms` (a structure with a leading client axis), each client's regulariser is
    `client_regularizer(its terms)` (KAPC's proximal term towards the client's own s_i);
    otherwise every client uses the shared `regularizer` towards `global_trainable`.
    """
    frozen = self._frozen
    shared = self._regularizer
    # Which gradient path the regularisers take is a property of their class, the same for
    # every client: read it off the shared one, or off the first client's.
    probe = shared
    if client_terms is not None:
      probe = self._client_regularizer(tf.nest.map_structure(lambda t: t[0], client_terms))
    traits = client_work_lib.traits_of(probe) or client_work_lib.PENALTY_ONLY
    analytic_gradient, has_affine, batch_dependent = (traits.analytic, traits.affine,
                                                      traits.batch_term)
    # Offsets `−scale ⊙ global` (FedProx, FedLap): only the scales cross the map; the update
    # reads the one global model (`stacked_optimizer.Anchor`).
    global_anchor = has_affine and client_terms is None and traits.global_anchor
    # Offsets `−scale ⊙ a_i` with each client's own anchor (KAPC's s_i): the update reads the
    # stacked anchors as they came in, instead of offsets formed per epoch.
    client_anchor = has_affine and client_terms is not None and traits.own_anchor
    # A batch term that reads the training pass's latent representation (`batch['latent']`).
    latent_in_batch = traits.reads_latent
    if latent_in_batch and self._latent_and_output is None:
      raise ValueError('a regulariser that reads the latent layer needs latent=True.')
    plan = self._factored_plan(factored, probe, global_anchor or client_anchor, start)
    # `num_clients` (a Python int, when given) fixes the client axis at trace time (see
    # `with_clients`): `train` traces the arguments with it (`_round_specs`); the weights read
    # from the updater's `[None, ...]` variables get it here.
    clients = functools.partial(with_clients, num_clients=num_clients)
    k = tf.shape(valid)[2] if num_clients is None else num_clients
    if start is None:
      global_trainable = tuple(global_trainable)
      weights = tuple(broadcast_clients(g, k) for g in global_trainable)
    else:
      weights = tuple(start)
    updater = self._updater
    carry = updater.start(weights)
    read_weights = lambda carry: clients(updater.weights(carry))
    zero = tf.zeros([k], tf.float32)
    # Per client: Σ batch-loss·n, examples, correct predictions, batches.
    sums = (zero, tf.zeros([k], tf.int64), zero, tf.zeros([k], tf.int64))
    # What the mapped functions get per client: the terms of its own regulariser, if any.
    terms = () if client_terms is None else client_terms

    def regularizer_of(client):
      return shared if client_terms is None else self._client_regularizer(client)

    def epoch_context(args):
      local, client = args
      regularizer = regularizer_of(client)
      if regularizer is None:
        return (), ()
      context = regularizer.epoch_start(tuple(local), global_trainable)
      affine = regularizer.affine_gradient(global_trainable, context) if has_affine else ()
      # `None` scales (no w-term, SCAFFOLD's correction) cannot cross vectorized_map: a
      # scalar zero per client, which broadcasts (not a model-sized zero tensor).
      if global_anchor:
        affine = affine[:1]
      elif client_anchor:
        affine = (affine[0], tuple(regularizer.offset_anchor(global_trainable)))
      if has_affine:
        affine = tuple(tuple(tf.zeros([], w.dtype) if a is None else a
                             for a, w in zip(part, local)) for part in affine)
      return context, affine

    # A factored kernel's start W_0 and anchor A (`factored_dense`), from the clients' weights
    # and the plan's anchors (one client's inside the map, stacked outside it).
    def factored_base(i, weights_now):
      return global_trainable[i] if start is None else weights_now[i]

    def factored_anchor(n, i, anchors):
      if not plan.with_anchor:
        return None
      return anchors[n] if client_anchor else global_trainable[i]

    def client_gradients(args):
      local, bx, by, bmask, trains, context, client, rows, anchors = args
      regularizer = regularizer_of(client)
      products, inputs, probes = {}, {}, {}
      with tf.GradientTape() as tape:
        tape.watch(local)
        for n, i in enumerate(plan.indices if plan else ()):
          # The factored kernel's `x w_t` (`factored_dense`); the gradient with respect to a
          # zero added to the pre-activations is δ, the kernel's own gradient never formed.
          probes[i] = tf.zeros([tf.shape(bx)[0], local[i].shape[-1]], local[i].dtype)
          tape.watch(probes[i])
          base, anchor = factored_base(i, local), factored_anchor(n, i, anchors)

          def product(x, n=n, i=i, base=base, anchor=anchor):
            inputs[i] = x
            return plan.product(x, base, rows[n], anchor, probes[i])

          products[i] = product
        if latent_in_batch:
          latent, logits = self._latent_and_output(local, bx, training=True)
        else:
          logits = self._apply(local, bx, training=True, kernel_products=products)
        n = tf.reduce_sum(bmask)
        per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=tf.cast(by, tf.int64), logits=logits)
        data_loss = tf.reduce_sum(per_example * bmask) / tf.maximum(n, 1.0)
        loss = data_loss
        if regularizer is not None and not analytic_gradient:
          loss += regularizer.penalty(local, global_trainable, context)
        if batch_dependent:  # MOON's contrastive term, over the batch's real examples.
          batch = collections.OrderedDict(x=bx, y=by, mask=bmask)
          if latent_in_batch:
            batch['latent'] = latent
          loss += regularizer.batch_penalty(local, global_trainable, batch, context)
      # An affine regulariser's terms are added by the updater (fused with the update there).
      sources = [w for i, w in enumerate(local) if i not in probes]
      found = iter(tape.gradient(loss, sources + [probes[i] for i in sorted(probes)]))
      # A factored kernel's place holds a scalar zero (the updater skips it).
      gradients = [tf.zeros([], w.dtype) if i in probes else next(found)
                   for i, w in enumerate(local)]
      deltas = list(found)
      gradients = client_work_lib.step_gradients(
          gradients, local, None if has_affine else regularizer,
          global_trainable, context, None, frozen)
      correct = tf.reduce_sum(bmask * tf.cast(
          tf.equal(tf.argmax(logits, axis=-1, output_type=tf.int32), by), tf.float32))
      count = tf.cast(trains, tf.float32)
      step_sums = (data_loss * n * count, tf.cast(n * count, tf.int64), correct * count,
                   tf.cast(trains, tf.int64))
      factors = tuple((inputs[i], d) for i, d in zip(sorted(probes), deltas))
      return tuple(gradients), step_sums, factors

    # SCAFFOLD's new control: the data gradients summed over each client's steps (an empty
    # tuple when not tracked, so the loop carries nothing extra). A client without a batch at
    # a step adds exactly zero: its masked loss is 0.
    gradient_sum = (tuple(tf.zeros(tf.shape(w), w.dtype) for w in weights)
                    if self._track_gradient_mean else ())
    # The first epoch's context when every client starts from the global model with the shared
    # regulariser: one client's, the same for all (FedLap's λ at local = global), computed
    # once instead of per client.
    same_first_context = start is None and client_terms is None
    if same_first_context:
      first_context = tf.nest.map_structure(
          lambda t: broadcast_clients(t, k), epoch_context((global_trainable, ())))
    # Kernels trained in factored form this round (`factored_dense`), their history and
    # coefficients carried through the loop.
    factored_state = ()
    plan_anchors = ()
    if plan is not None:
      factored_state = plan.initial_state(
          weights, k, tf.shape(valid)[0] * tf.shape(valid)[1], tf.shape(index)[3])
      if plan.with_anchor and client_anchor:
        # Each client's anchor (KAPC's s_i), fixed for the round.
        offset_anchors = tf.vectorized_map(
            lambda client: tuple(regularizer_of(client).offset_anchor(global_trainable)), terms)
        plan_anchors = tuple(offset_anchors[i] for i in plan.indices)
    skip = frozenset(plan.indices) if plan is not None else frozenset()
    anchored = tf.constant(True)  # Set per epoch below (autograph wants it before the loop).
    for e in tf.range(tf.shape(valid)[0]):
      if same_first_context:
        context, affine = tf.cond(
            tf.equal(e, 0), lambda: first_context,
            lambda: tf.vectorized_map(epoch_context, (read_weights(carry), terms)))
      else:
        context, affine = tf.vectorized_map(epoch_context, (read_weights(carry), terms))
      if client_anchor:
        affine = (affine[0], tuple(Anchor(a) for a in affine[1]))
      if global_anchor:
        affine = (affine[0], tuple(Anchor(g) for g in global_trainable))
        # `s ⊙ (w − global)` with every scale zero adds exactly nothing: the epoch takes the
        # plain update (FedLap's first epoch, where λ = 0 at local = global; FedProx, μ = 0).
        anchored = tf.reduce_any([tf.reduce_any(tf.not_equal(scale, 0.0))
                                  for scale in affine[0]])
      for s in tf.range(tf.shape(valid)[1]):
        trains = valid[e, s]
        t = e * tf.shape(valid)[1] + s  # The step's place in the round's history.
        # The clients' gradients in one vectorised step, then the optimizer's update of all of
        # them (`stacked_optimizer`: in place for TFF's SGD(M)).
        gradients, step_sums, factors = tf.vectorized_map(
            client_gradients, (read_weights(carry), tf.gather(examples, index[e, s]),
                               tf.gather(labels, index[e, s]), mask[e, s], trains,
                               context, terms,
                               plan.client_rows(factored_state, t) if plan else (),
                               plan_anchors))
        if global_anchor:
          carry = tf.cond(
              anchored,
              lambda: updater.step(carry, gradients, trains, affine, skip),  # pylint: disable=cell-var-from-loop
              lambda: updater.step(carry, gradients, trains, None, skip))  # pylint: disable=cell-var-from-loop
        else:
          carry = updater.step(carry, gradients, trains, affine if has_affine else None, skip)
        if plan is not None:
          # The regulariser's scale per client (zeros without one; `s ⊙ (w − a)`'s s).
          scales = tuple(affine[0][i] if has_affine else tf.zeros([k], weights[i].dtype)
                         for i in plan.indices)
          factored_state = plan.advance(factored_state, t, factors, scales, trains)
        sums = tuple(a + b for a, b in zip(sums, step_sums))
        if self._track_gradient_mean:
          gradient_sum = tuple(a + g for a, g in zip(gradient_sum, gradients))
    weights = clients(updater.finish(carry))
    if plan is not None:
      # The factored kernels formed once: the updater left them at the round's start.
      formed = plan.kernels(
          factored_state, [factored_base(i, weights) for i in plan.indices],
          [factored_anchor(n, i, plan_anchors) for n, i in enumerate(plan.indices)])
      weights = list(weights)
      for i, kernel in zip(plan.indices, formed):
        weights[i] = kernel
      weights = clients(tuple(weights))

    out = collections.OrderedDict(trained=weights, sums=sums)
    if self._track_gradient_mean:
      # `build_local_training`'s `gradient_mean`: over the client's own steps (at least 1).
      steps = tf.maximum(sums[3], 1)
      out['gradient_mean'] = tuple(
          g / tf.reshape(tf.cast(steps, g.dtype), [-1] + [1] * (g.shape.rank - 1))
          for g in gradient_sum)
    if start is None:
      # The update `global − trained`, computed here: the result stays a TensorFlow tensor on
      # its way to the aggregator (copying the model-sized stacked arrays out to NumPy and
      # back would cost a large part of a 100-client round).
      out['update'] = tuple(g[tf.newaxis] - w for g, w in zip(global_trainable, weights))
    if 'latent_mean' in self._weight_fields:
      latent_apply, latent_dim = self._latent

      def latent_sums(args):
        local, bx, bmask = args
        z = latent_apply(local, bx, training=False)
        return tf.reduce_sum(z * bmask[:, tf.newaxis], axis=0), tf.reduce_sum(bmask)

      total = tf.zeros([k, latent_dim])
      count = tf.zeros([k])
      for s in tf.range(tf.shape(valid)[1]):
        step_total, step_count = tf.vectorized_map(
            latent_sums, (weights, tf.gather(examples, index[0, s]), mask[0, s]))
        total += step_total
        count += step_count
      out['latent_mean'] = total / tf.maximum(count, 1.0)[:, tf.newaxis]
    if shared is not None and client_work_lib.traits_of(shared).measures:
      out['regularizer'] = tf.vectorized_map(
          lambda local: shared.measurements(tuple(local), global_trainable), weights)
    return out

  def factored_kernels(self, data) -> frozenset:
    """The trainable indices of the Dense kernels worth training in factored form in the round
    of `data` (`stack_client_batches`): `factored_dense.worth_factoring` for its history of
    epochs × steps × batch rows."""
    epochs, steps, _, batch = np.shape(data['index'])
    rows = epochs * steps * batch
    return frozenset(i for i, (fan_in, fan_out) in self._dense_kernels.items()
                     if rows and factored_dense.worth_factoring(fan_in, fan_out, rows))

  def _factored_plan(self, requested: frozenset, regularizer, anchored: bool, start
                     ) -> Optional[factored_dense.FactoredKernels]:
    """The round's `FactoredKernels`, or None: factoring needs no regulariser, or an affine one
    anchored at the global model or each client's own anchor with one scale per tensor
    (`RegularizerTraits.per_tensor_scales`: FedProx, KAPC), whose gradient is not taken
    through the loss."""
    if not requested:
      return None
    if regularizer is not None and not (
        anchored and client_work_lib.traits_of(regularizer).per_tensor_scales):
      return None
    learning_rate, momentum = self._updater.hyperparameters
    self.factored_traces.add(tuple(sorted(requested)))
    return factored_dense.FactoredKernels(
        tuple(sorted(requested)), learning_rate, momentum,
        with_anchor=regularizer is not None and start is not None)

  # -- the round ----------------------------------------------------------------------------
  def traced_client_count(self, k: int) -> Optional[int]:
    """`k`, for tracing the round's functions with a fixed client axis (`with_clients`), for
    up to `MAX_STATIC_CLIENT_COUNTS` distinct counts; None (a dynamic axis) beyond them."""
    if k in self._static_client_counts or len(
        self._static_client_counts) < MAX_STATIC_CLIENT_COUNTS:
      self._static_client_counts.add(k)
      return k
    return None

  def train(self, client_inputs: Sequence[Any], global_trainable=None, start=None,
            client_terms=None, read_before_elsewhere: bool = False
            ) -> tuple[collections.OrderedDict, collections.OrderedDict]:
    """`(out, data)`: the participants' local training (`_train_fn`'s outputs: `trained`,
    the metric `sums`, with a global model `update`, ...) and their round data
    (`stack_client_batches`). `read_before_elsewhere`: the inputs' datasets were read already
    this round (FedLap personalisation's local models train on the data its method's clients
    read): each is rebuilt first, as TFF deserialises it afresh for every computation."""
    self._restore_tf2_layer_classes()
    data = stack_client_batches(
        client_inputs, _EveryDataset() if read_before_elsewhere else self._read_before)
    self._updater.prepare([tf.TensorSpec(w.shape, w.dtype)
                           for w in self._keras_model.trainable_weights], self._device)
    k = self.traced_client_count(len(client_inputs))
    factored = self.factored_kernels(data)
    args = (global_trainable, start, client_terms, data['examples'], data['labels'],
            data['index'], data['mask'], data['valid'], data['epochs'])
    with tf.device(self._device) if self._device else contextlib.nullcontext():
      if (k, factored) not in self._traced_for:
        # Traced once for every round of this client count: the round's example count, epochs,
        # steps and batch size left unknown. Traced on the first round's exact shapes instead,
        # `reduce_retracing` traced again in the next rounds as those changed (seconds of
        # tracing in round 2 as well).
        self._train.get_concrete_function(*_round_specs(args, k), num_clients=k,
                                          factored=factored)
        self._traced_for.add((k, factored))
      out = self._train(*args, num_clients=k, factored=factored)
    return out, data

  def model_outputs(self, sums) -> collections.OrderedDict:
    """The participants' unfinalized metrics (`[K]` arrays, the model's dtypes) from the
    training's per-client sums."""
    loss_sum, examples, correct, batches = (np.asarray(t) for t in sums)
    return collections.OrderedDict(
        (name, [np.asarray(v).astype(d) for v, d in zip(values, self._metric_dtypes[name])])
        for name, values in (('accuracy', [correct, examples]), ('loss', [loss_sum, examples]),
                             ('num_examples', [examples]), ('num_batches', [batches])))

  def __call__(self, global_weights, client_inputs: Sequence[Any], call=None):
    return self.round_results(global_weights, client_inputs, call)[:3]

  def next(self, state, global_weights, client_inputs: Sequence[Any], call=None):
    """The client work process's `next` for the participants together: `(state, results,
    measurements)`, the state unchanged (the default client work keeps none) and the
    measurements `train` and, with a measuring regulariser, `regularizer`."""
    results, train, regularizer_stats, _ = self.round_results(global_weights, client_inputs,
                                                              call)
    measurements = collections.OrderedDict(train=train)
    if regularizer_stats is not None:
      measurements['regularizer'] = regularizer_stats
    return state, results, measurements

  def round_results(self, global_weights, client_inputs: Sequence[Any], call=None,
                    client_terms=None):
    """`(results, train, regularizer_stats, out)`: `__call__`'s results and the training's
    outputs `out` (`trained`, `sums`, `gradient_mean` when tracked); with `client_terms`
    (a leading client axis), each client's regulariser is `client_regularizer(its row)`."""
    call = call or (lambda fn, *args: fn(*args))
    if global_weights.non_trainable:
      raise ConfigError('vectorised clients need a model without non-trainable weights.')
    global_trainable = tuple(np.asarray(w) for w in global_weights.trainable)
    out, data = self.train(client_inputs, global_trainable, client_terms=client_terms)
    _, examples, _, batches = (t.numpy() for t in out['sums'])
    epochs = data['epochs']
    k = len(client_inputs)
    update = tf.nest.pack_sequence_as(list(global_weights.trainable), list(out['update']))
    weight = (np.ones(k, np.float32) if self._client_weighting == 'uniform'
              else client_work_lib.examples_per_epoch(examples, epochs).numpy().astype(
                  np.float32))
    if self._weight_fields:
      weight = collections.OrderedDict(num_examples=weight)
      if 'client_index' in self._weight_fields:
        weight['client_index'] = np.asarray(
            [client_work_lib.client_index_of_input(c) for c in client_inputs], np.int32)
      if 'latent_mean' in self._weight_fields:
        weight['latent_mean'] = out['latent_mean'].numpy()
      if 'local_steps' in self._weight_fields:
        weight['local_steps'] = batches.astype(np.int32)
    results = StackedClientResults(update, weight, k)
    # The participants' trained models, kept for the `trained_local` evaluation protocol.
    self.last_trained = out['trained']
    train = call(self._aggregate_metrics,
                 clients_argument(StackedClients(self.model_outputs(out['sums']), k)))
    regularizer_stats = None
    if 'regularizer' in out:
      regularizer_stats = tf.nest.map_structure(lambda t: np.float32(np.mean(t.numpy())),
                                                out['regularizer'])
    return results, train, regularizer_stats, out


class StackedClientResults(Sequence):
  """A round's `ClientResult`s, stacked: `update` and `update_weight` hold the participants'
  arrays along a leading axis (the layout the in-process context aggregates without splitting,
  `runtime.in_process.StackedClients`); `results[k]` is participant k's `ClientResult`."""

  def __init__(self, update, update_weight, num_clients: int):
    self.update, self.update_weight, self._num_clients = update, update_weight, num_clients

  def __len__(self) -> int:
    return self._num_clients

  def __getitem__(self, k):
    import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

    if isinstance(k, slice):
      return [self[i] for i in range(*k.indices(self._num_clients))]
    if not -self._num_clients <= k < self._num_clients:
      raise IndexError(k)
    pick = lambda a: a[k].numpy() if tf.is_tensor(a) else np.asarray(a)[k]
    weight = tf.nest.map_structure(pick, self.update_weight)
    return tff.learning.templates.ClientResult(
        update=tf.nest.map_structure(pick, self.update),
        update_weight=weight if isinstance(weight, collections.OrderedDict) else np.float32(weight))

  def aggregator_arguments(self) -> tuple:
    """`(updates, weights)` as the aggregator's `next` takes them in the current context."""
    return (clients_argument(StackedClients(self.update, self._num_clients)),
            clients_argument(StackedClients(self.update_weight, self._num_clients)))
