"""A round's participant batches as one example table, the input of vectorised local training."""

from __future__ import annotations

import collections
import weakref
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np
import tensorflow as tf

from fltff.data.pipeline import ClientBatches
from fltff.data.pipeline import preprocess_batch
from fltff.learning import client_work as client_work_lib


def _read_options() -> tf.data.Options:
  """tf.data's static optimisations off: they change no element or order, but rewrite each
  client's pipeline at iterator creation, most of a small client's read time."""
  options = tf.data.Options()
  options.experimental_optimization.apply_default_optimizations = False
  options.autotune.enabled = False
  return options


def stack_client_batches(client_inputs: Sequence[Any],
                         read_before: Optional[weakref.WeakSet] = None,
                         raw: bool = False) -> collections.OrderedDict:
  """The participants' batches for every local epoch, as rows of one example table.

  Returns `examples [N + 1, ...]` (float32) and `labels [N + 1]` (int32) tensors, the last row
  zeros (padding), and NumPy `index [E, S, K, B]` (epoch e, step s, client k's batch is
  `examples[index[e, s, k]]`), `mask [E, S, K, B]` (1: real example), `valid [E, S, K]` (client
  k trains at epoch e, step s) and `epochs [K]`.

  Datasets are read once per epoch, as TFF's client work iterates them (epoch 0 even for a
  client with no epochs, for CCN's latent mean); `ClientBatches` from their arrays (each
  example stored and preprocessed once). A dataset already in `read_before` is rebuilt first
  (`fresh_dataset`), restarting its shuffle as TFF's runtime does. `raw`: the table as NumPy
  arrays as read (uint8 images from `ClientBatches`), `preprocess_batch` still to apply (where
  they are sent elsewhere to train, `fltff.learning.groups`).
  """
  read_before = weakref.WeakSet() if read_before is None else read_before
  epochs = [client_work_lib.client_info_of_input(data)['epochs'] for data in client_inputs]
  passes = [max(e, 1) for e in epochs]
  sources = [data['batches'] for data in client_inputs]
  from_arrays = bool(sources) and all(isinstance(source, ClientBatches) for source in sources)
  if from_arrays:
    table_x, table_y, rows, sizes, counts = _read_client_batches(sources, passes)
  else:
    from fltff.runtime.in_process import fresh_dataset  # pylint: disable=g-import-not-at-top

    datasets = []
    for source in sources:
      dataset = source.dataset if isinstance(source, ClientBatches) else source
      # As TFF's runtime reads it: rebuilt if read here before.
      datasets.append(named_batches(fresh_dataset(dataset) if dataset in read_before
                                    else dataset))
      read_before.add(dataset)
    table_x, table_y, rows, sizes, counts = _read_datasets(datasets, passes)
  # Where each batch goes: client c's epochs one after another, each its steps in order.
  client = _round_choice(counts, passes)
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
  if not raw:
    if from_arrays:
      # The pipeline's elementwise preprocessing on the whole table (the padding row stays 0).
      processed = preprocess_batch(collections.OrderedDict(x=table_x, y=table_y))
      table_x, table_y = processed['x'], processed['y']
    # As tensors: the examples are copied once, into TensorFlow (a NumPy round trip is costly).
    table_x, table_y = tf.cast(table_x, tf.float32), tf.cast(table_y, tf.int32)
  return collections.OrderedDict(examples=table_x, labels=table_y, index=index, mask=mask,
                                 valid=valid, epochs=np.asarray(epochs, np.int32))


def named_batches(dataset: tf.data.Dataset) -> tf.data.Dataset:
  """`dataset`'s `(x, y)` batches as `{'x': x, 'y': y}`, the model's input as TFF's client
  work reads either form."""
  if isinstance(dataset.element_spec, tuple):
    return dataset.map(lambda x, y: collections.OrderedDict(x=x, y=y))
  return dataset


def _round_choice(counts: Sequence[int], passes: Sequence[int]) -> np.ndarray:
  """Each stream element's client: client after client, `counts[k] * passes[k]` elements."""
  return np.repeat(np.arange(len(counts), dtype=np.int64),
                   [c * p for c, p in zip(counts, passes)])


def _round_stream(datasets: Sequence[tf.data.Dataset], passes: Sequence[Any],
                  choice) -> tf.data.Dataset:
  """One tf.data pipeline for the round (`_round_choice`'s order), each dataset repeated for its
  passes (ints or scalar tensors): far cheaper than an eager iterator per client and epoch."""
  return tf.data.Dataset.choose_from_datasets(
      [ds if isinstance(p, int) and p == 1 else ds.repeat(p) for ds, p in zip(datasets, passes)],
      tf.data.Dataset.from_tensor_slices(choice), stop_on_empty_dataset=False)


@tf.function(reduce_retracing=True)
def _read_orders(orders: Sequence[tf.data.Dataset], passes: tf.Tensor,
                 choice: tf.Tensor) -> tf.Tensor:
  """`_round_stream` over the clients' order datasets, read as one vector; traced (again only
  for another client count) as building the pipeline eagerly costs more than reading it."""
  passes = [passes[i] for i in range(len(orders))]
  return _round_stream(orders, passes, choice).batch(
      tf.size(choice, out_type=tf.int64)).with_options(_read_options()).get_single_element()


def _read_client_batches(sources: Sequence[ClientBatches], passes: Sequence[int]):
  """`(table_x, table_y, rows, sizes, batches per epoch)` from the clients' arrays (≥ 1 client).

  The table holds each participant's raw examples once, client after client (`preprocess_batch`
  still to apply); `rows [T, B]` are each batch's table rows, each client's epochs in order (-1
  pads a short batch). One pipeline draws all epoch orders (indices only), much cheaper than
  the datasets' per-example map."""
  orders = [source.order() for source in sources]
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
  """`_read_client_batches`' result from datasets, the table holding every batch of every epoch
  as read."""
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
  elif not sum(c * p for c, p in zip(counts, passes)):  # Not one batch in the round.
    bx, by, sizes = np.zeros((0, 0), np.float32), np.zeros((0, 0), np.int32), np.zeros(0, np.int64)
  else:
    choice = _round_choice(counts, passes)
    stream = _round_stream(datasets, passes, choice).map(
        lambda b: (b['x'], b['y'], tf.shape(b['y'], out_type=tf.int64)[0]))
    bx, by, sizes = (t.numpy() for t in stream.padded_batch(len(choice)).with_options(
        _read_options()).get_single_element())
  batch = by.shape[1] if by.ndim > 1 else 0
  rows = np.arange(len(by) * batch, dtype=np.int64).reshape(len(by), batch)
  rows = np.where(np.arange(batch) < sizes[:, np.newaxis], rows, -1)
  return bx.reshape(-1, *bx.shape[2:]), by.reshape(-1), rows, sizes, counts


# A vectorised step of K clients costs about K + c client steps: the per-client weights and
# data, and c for what each step costs once (op dispatch, the loop), about the time of this many
# multiply-adds (our fit to FedAvg rounds of mlp2 and cnn2 at batch 32 on a 2-core CPU).
STEP_OVERHEAD_MACS = 2e8
# Groups are trained only where they cut that modelled cost by this fraction and by this many
# client steps: each new group size is one more trace of the training, seconds each.
MIN_GROUP_SAVING = 0.25
MIN_SAVED_STEPS = 100


def step_overhead(macs_per_example: float, batch: int) -> float:
  """c of `client_groups`: a step's fixed cost in client steps of `batch` examples of a model
  of `macs_per_example` forward multiply-adds (training: about 3x the forward pass)."""
  return STEP_OVERHEAD_MACS / max(3.0 * batch * macs_per_example, 1.0)


def client_groups(mask: np.ndarray, step_overhead: float,
                  min_saving: float = MIN_GROUP_SAVING,
                  min_saved_steps: float = MIN_SAVED_STEPS) -> list[np.ndarray]:
  """The participants of a round (`stack_client_batches`'s `mask [E, S, K, B]`) in groups that
  train one after another, each padded only to its own longest member (`cheapest_groups` of
  each client's epochs and steps)."""
  has_batch = np.asarray(mask).any(axis=-1)
  num_epochs, num_steps, _ = has_batch.shape
  epochs = (has_batch.any(axis=1) * np.arange(1, num_epochs + 1)[:, None]).max(axis=0, initial=0)
  steps = (has_batch.any(axis=0) * np.arange(1, num_steps + 1)[:, None]).max(axis=0, initial=0)
  return cheapest_groups(epochs, steps, step_overhead, min_saving, min_saved_steps)


def cheapest_groups(epochs: Sequence[int], steps: Sequence[int], step_overhead: float,
                    min_saving: float = MIN_GROUP_SAVING,
                    min_saved_steps: float = MIN_SAVED_STEPS) -> list[np.ndarray]:
  """Clients of `epochs` × `steps` (one entry each) in groups, each padded to its longest member;
  one group unless that saves `min_saving` of the round's modelled cost and `min_saved_steps`
  client steps.

  A group of n clients runs its longest member's epochs × steps at n + `step_overhead` client
  steps each (`step_overhead`). Clients sorted by their own epochs × steps are cut into
  contiguous groups of least total cost (dynamic programming, O(K²)). Each client's training does
  not depend on the others', so the grouping changes the arithmetic only as the batched kernels
  round.
  """
  epochs = np.maximum(np.asarray(epochs, np.int64), 1)
  steps = np.maximum(np.asarray(steps, np.int64), 1)
  k = len(steps)
  order = np.argsort(epochs * steps, kind='stable')
  epochs, steps = epochs[order], steps[order]

  best, cut = [0.0] + [np.inf] * k, [0] * (k + 1)
  for j in range(1, k + 1):
    longest_epochs = longest_steps = 0
    for i in range(j - 1, -1, -1):  # Groups i..j-1, their maxima kept as i falls.
      longest_epochs = max(longest_epochs, epochs[i])
      longest_steps = max(longest_steps, steps[i])
      c = best[i] + (j - i + step_overhead) * longest_epochs * longest_steps
      if c <= best[j]:  # `<=`: of equal costs the earliest cut, as an ascending search finds.
        best[j], cut[j] = c, i
  single = (k + step_overhead) * epochs.max() * steps.max() if k else 0.0
  if k < 2 or best[k] > (1.0 - min_saving) * single or single - best[k] < min_saved_steps:
    return [np.arange(k)]
  groups, j = [], k
  while j > 0:
    groups.append(np.sort(order[cut[j]:j]))
    j = cut[j]
  return groups[::-1]


def in_client_order(parts, groups):
  """The groups' outputs (`parts[g]`: `[len(groups[g]), ...]` per tensor) concatenated and put
  back in the round's client order."""
  position = np.argsort(np.concatenate(groups))
  return tf.nest.map_structure(lambda *group: tf.gather(tf.concat(group, 0), position), *parts)


def group_data(data: collections.OrderedDict, clients: np.ndarray) -> collections.OrderedDict:
  """`stack_client_batches`'s `data` for the participants `clients` only (the example table
  shared), cut to the epochs and steps any of them trains."""
  has_batch = data['mask'][:, :, clients].any(axis=(2, 3))
  num_epochs = max(int(has_batch.any(axis=1).nonzero()[0].max(initial=-1)) + 1, 1)
  num_steps = int(has_batch.any(axis=0).nonzero()[0].max(initial=-1)) + 1
  group = collections.OrderedDict(data)
  for key in ('index', 'mask', 'valid'):
    group[key] = data[key][:num_epochs, :num_steps, clients]
  group['epochs'] = data['epochs'][clients]
  return group


def round_specs(args: Sequence[Any], num_clients: Optional[int]) -> list:
  """`VectorizedClientWork._train_fn`'s arguments as `tf.TensorSpec`s for every round of
  `num_clients` participants (None: any): the global weights as they are, elsewhere only client
  axes known."""
  global_trainable, start, client_terms, statistics, examples, labels, index, mask, valid = args

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
          specs(statistics, None if start is None else 0),
          spec(examples, unknown=[0]), spec(labels, unknown=[0]),
          spec(index, unknown=[0, 1, 3], client_axis=2),
          spec(mask, unknown=[0, 1, 3], client_axis=2),
          spec(valid, unknown=[0, 1], client_axis=2)]
