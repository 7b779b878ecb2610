"""tf.data pipelines from client arrays to the batches the client work trains on."""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable
from typing import Optional

import numpy as np
import tensorflow as tf


def preprocess_batch(batch):
  """uint8 images → float32 in [0, 1]; other inputs → float32; labels → int32. Runs inside the
  client's dataset graph, so images travel to the TFF worker as uint8."""
  x = batch['x']
  if x.dtype == tf.uint8:
    x = tf.cast(x, tf.float32) / 255.0
  else:
    x = tf.cast(x, tf.float32)
  return collections.OrderedDict(x=x, y=tf.cast(batch['y'], tf.int32))


def client_examples(x: np.ndarray, y: np.ndarray) -> tf.data.Dataset:
  """One client's examples, each through `preprocess_batch` in the dataset graph."""
  return tf.data.Dataset.from_tensor_slices(collections.OrderedDict(x=x, y=y)).map(
      preprocess_batch)


def batch_examples(examples: tf.data.Dataset, num_examples: int, batch_size: int,
                   shuffle_seed: Optional[int] = None) -> tf.data.Dataset:
  """`examples` batched and, given a seed, reshuffled every epoch in an order fixed by the seed
  (a run resumed from a checkpoint sees the batches an uninterrupted run would)."""
  if shuffle_seed is not None:
    examples = examples.shuffle(num_examples, seed=int(shuffle_seed),
                                reshuffle_each_iteration=True)
  return examples.batch(batch_size)


@dataclasses.dataclass(frozen=True)
class ArraySource:
  """What a `ClientDatasets` round dataset holds, for readers that skip tf.data.

  `order` yields indices 0..n-1 in the dataset's order, one pass (epoch) per iteration: the
  same-seeded shuffle gives the same permutation (tf.data's shuffle draws positions, whatever
  the elements). The batches are `preprocess_batch` of `(x[i], y[i])` over consecutive
  `batch_size` chunks of `order`, `(x, y) = arrays()` (a call, so no second copy of the data
  outlives a round). The vectorised client work (`learning/vectorized.py`) reads rounds this way.
  """
  arrays: Callable[[], tuple[np.ndarray, np.ndarray]]
  order: tf.data.Dataset
  batch_size: int
  num_examples: int  # n, `order`'s length (no cardinality op per read).


_ARRAY_SOURCE = '_fltff_array_source'


def array_source(dataset: tf.data.Dataset) -> Optional[ArraySource]:
  """The `ArraySource` of a dataset made by `ClientDatasets.batches`, else None."""
  return getattr(dataset, _ARRAY_SOURCE, None)


class ClientDatasets:
  """Each client's batches per round, with its examples dataset built once.

  Every `Dataset.map` traces a function TensorFlow's eager runtime never frees, so rebuilding
  client datasets every round would grow the driver every round; a round here adds only
  `shuffle` and `batch`, which trace nothing: memory grows with distinct clients, not rounds.
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
    # The same shuffle (seeds resolved now, like the examples') over the indices: readers of
    # `array_source` get the batches' order without the per-example map.
    order = tf.data.Dataset.range(num_examples)
    if shuffle_seed is not None:
      order = order.shuffle(num_examples, seed=int(shuffle_seed), reshuffle_each_iteration=True)
    setattr(batches, _ARRAY_SOURCE, ArraySource(
        functools.partial(self._arrays_of, client_index), order, self._batch_size, num_examples))
    return batches
