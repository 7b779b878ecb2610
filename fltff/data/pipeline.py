"""tf.data pipelines from client arrays to the batches the client work trains on."""

from __future__ import annotations

import collections
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


def client_batches(x: np.ndarray, y: np.ndarray, batch_size: int,
                   shuffle_seed: Optional[int] = None) -> tf.data.Dataset:
  """Batched dataset of one client's examples; reshuffled every epoch when a seed is given.

  With a seed, the order of every epoch is a deterministic function of the seed, so a run
  resumed from a checkpoint sees exactly the batches an uninterrupted run would.
  """
  ds = tf.data.Dataset.from_tensor_slices(collections.OrderedDict(x=x, y=y))
  if shuffle_seed is not None:
    ds = ds.shuffle(len(x), seed=int(shuffle_seed), reshuffle_each_iteration=True)
  return ds.batch(batch_size).map(preprocess_batch)
