"""Bounded memory (issue 20): what the round loop builds per round must not accumulate."""

import collections

import numpy as np
import tensorflow as tf

from fltff.data import pipeline


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
      ours = _as_arrays(datasets.batches(k, seed))
      fresh = _as_arrays(pipeline.client_batches(*_arrays(k), 5, shuffle_seed=seed))
      assert len(ours) == len(fresh) == -(-(23 + k) // 5)
      for a, b in zip(ours, fresh):
        assert a['x'].dtype == np.float32 and a['y'].dtype == np.int32
        np.testing.assert_array_equal(a['x'], b['x'])
        np.testing.assert_array_equal(a['y'], b['y'])
  # Per element or per batch, the scaling is the same: x / 255 in float32.
  x, _ = _arrays(0)
  np.testing.assert_array_equal(_as_arrays(datasets.batches(0))[0]['x'],
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
      ds = datasets.batches(k, shuffle_seed=round_num)
      # The one traced function of a client's pipeline (the `map`) is the same every round.
      node = ds
      while not hasattr(node, '_map_func'):
        node = node._input_dataset  # pylint: disable=protected-access
      maps.add(id(node._map_func))  # pylint: disable=protected-access
  assert built == {1: 1, 2: 1}
  assert len(maps) == 2
