"""tf.data pipelines from client arrays to the batches the client work trains on."""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable
from typing import Optional

import numpy as np
import tensorflow as tf


def example_shape(x: np.ndarray) -> tuple[int, ...]:
  """Shape of one preprocessed example (what the model's input layer receives)."""
  return tuple(x.shape[1:])


def preprocess_batch(batch):
  """uint8 images → float32 in [0, 1]; other inputs → float32; labels → int32.

  Applied after batching and inside the client's dataset graph, so images travel to the TFF
  worker as uint8 (4x fewer bytes than float32).
  """
  x = batch['x']
  if x.dtype == tf.uint8:
    x = tf.cast(x, tf.float32) / 255.0
  else:
    x = tf.cast(x, tf.float32)
  return collections.OrderedDict(x=x, y=tf.cast(batch['y'], tf.int32))


def client_examples(x: np.ndarray, y: np.ndarray) -> tf.data.Dataset:
  """One client's preprocessed examples (`preprocess_batch` per example, in the dataset graph:
  images still travel to the TFF worker as uint8)."""
  return tf.data.Dataset.from_tensor_slices(collections.OrderedDict(x=x, y=y)).map(
      preprocess_batch)


def batch_examples(examples: tf.data.Dataset, num_examples: int, batch_size: int,
                   shuffle_seed: Optional[int] = None) -> tf.data.Dataset:
  """`examples` batched; reshuffled every epoch when a seed is given.

  With a seed, the order of every epoch is a deterministic function of the seed, so a run
  resumed from a checkpoint sees exactly the batches an uninterrupted run would.
  """
  if shuffle_seed is not None:
    examples = examples.shuffle(num_examples, seed=int(shuffle_seed),
                                reshuffle_each_iteration=True)
  return examples.batch(batch_size)


def client_batches(x: np.ndarray, y: np.ndarray, batch_size: int,
                   shuffle_seed: Optional[int] = None) -> tf.data.Dataset:
  """Batched dataset of one client's examples (see `batch_examples`); for one-off use —
  round loops use `ClientDatasets`."""
  return batch_examples(client_examples(x, y), len(x), batch_size, shuffle_seed)


@dataclasses.dataclass(frozen=True)
class ArraySource:
  """What one of `ClientDatasets`' round datasets holds, for a reader that skips tf.data.

  `order` yields the example indices 0..n-1 in the dataset's order, one pass per iteration: a
  shuffle with the same seeds, so each iteration (epoch) gives the same permutation as the
  dataset's own (tf.data's shuffle draws positions, whatever the elements). The dataset's
  batches are `preprocess_batch` of `(x[i], y[i])` for consecutive `batch_size` chunks of the
  order, with `(x, y) = arrays()` (a call, so that nothing holds a second copy of the client's
  data between rounds). The vectorised client work reads rounds this way
  (`learning/vectorized.py`).
  """
  arrays: Callable[[], tuple[np.ndarray, np.ndarray]]
  order: tf.data.Dataset
  batch_size: int
  num_examples: int  # n, the length of `order` (known here: no cardinality op per read).


_ARRAY_SOURCE = '_fltff_array_source'


def array_source(dataset: tf.data.Dataset) -> Optional[ArraySource]:
  """The `ArraySource` of a dataset made by `ClientDatasets.batches`, else None."""
  return getattr(dataset, _ARRAY_SOURCE, None)


class ClientDatasets:
  """Each client's batches per round, with its examples dataset built once.

  Why: every `Dataset.map` traces a new function that TensorFlow's eager runtime never frees
  (tens of KiB each, whatever the data size), so building client datasets from scratch every
  round grows the driver with every round; here a round only adds `shuffle` and `batch`, which
  trace nothing. A client's first round still
  costs one traced function: memory grows with the distinct clients seen, not with rounds.
  """

  def __init__(self, arrays_of: Callable[[int], tuple[np.ndarray, np.ndarray]],
               batch_size: int):
    self._arrays_of = arrays_of
    self._batch_size = batch_size
    self._examples: dict[int, tuple[tf.data.Dataset, int]] = {}

  def batches(self, client_index: int, shuffle_seed: Optional[int] = None) -> tf.data.Dataset:
    if client_index not in self._examples:
      x, y = self._arrays_of(client_index)
      self._examples[client_index] = (client_examples(x, y), len(x))
    examples, num_examples = self._examples[client_index]
    batches = batch_examples(examples, num_examples, self._batch_size, shuffle_seed)
    # The same shuffle (its seeds resolved now, as the examples' shuffle's just were) over the
    # indices: a reader of `array_source` gets the batches' order without the per-example map.
    order = tf.data.Dataset.range(num_examples)
    if shuffle_seed is not None:
      order = order.shuffle(num_examples, seed=int(shuffle_seed), reshuffle_each_iteration=True)
    setattr(batches, _ARRAY_SOURCE, ArraySource(
        functools.partial(self._arrays_of, client_index), order, self._batch_size, num_examples))
    return batches
