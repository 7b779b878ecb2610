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
  x = tf.cast(batch['x'], tf.float32)
  if batch['x'].dtype == tf.uint8:
    x = x / 255.0
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


@dataclasses.dataclass(frozen=True, eq=False)
class ClientBatches:
  """One client's batches for a round (`ClientDatasets.batches`): the tf.data `dataset` that
  TFF's client work reads, and what it holds, for readers that skip tf.data (the vectorised
  client work, `learning/round_data.py`).

  `dataset`'s batches are `preprocess_batch` of `(x[i], y[i])` over consecutive `batch_size`
  chunks of `order()`'s indices, `(x, y) = arrays()` (a call, so no second copy of the data
  outlives a round).
  """
  dataset: tf.data.Dataset
  arrays: Callable[[], tuple[np.ndarray, np.ndarray]]
  batch_size: int
  num_examples: int  # n (no cardinality op per read).
  shuffle_seed: Optional[int]

  def order(self) -> tf.data.Dataset:
    """Indices 0..n-1 in `dataset`'s order, one pass (epoch) per iteration, built afresh as TFF's
    runtime deserialises a dataset for each computation: the same-seeded shuffle gives the same
    permutation (tf.data's shuffle draws positions, whatever the elements)."""
    order = tf.data.Dataset.range(self.num_examples)
    if self.shuffle_seed is None:
      return order
    return order.shuffle(self.num_examples, seed=self.shuffle_seed, reshuffle_each_iteration=True)


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

  def batches(self, client_index: int, shuffle_seed: Optional[int] = None) -> ClientBatches:
    if client_index not in self._examples:
      x, y = self._arrays_of(client_index)
      self._examples[client_index] = (client_examples(x, y), len(x))
    examples, num_examples = self._examples[client_index]
    # Seeds resolved now, like the examples'.
    shuffle_seed = None if shuffle_seed is None else int(shuffle_seed)
    return ClientBatches(
        batch_examples(examples, num_examples, self._batch_size, shuffle_seed),
        functools.partial(self._arrays_of, client_index), self._batch_size, num_examples,
        shuffle_seed)
