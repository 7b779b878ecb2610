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


def test_recycling_the_local_worker_changes_no_number_and_leaves_no_worker(tmp_path):
  import functools  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top

  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

  from fltff import learning  # pylint: disable=g-import-not-at-top
  from fltff.data import build_federated_data  # pylint: disable=g-import-not-at-top
  from fltff.data import dirichlet_partition  # pylint: disable=g-import-not-at-top
  from fltff.data import npz_source  # pylint: disable=g-import-not-at-top
  from fltff.runtime import TffRuntime  # pylint: disable=g-import-not-at-top
  from fltff.runtime.local import wait_for_exit  # pylint: disable=g-import-not-at-top
  from fltff.simulation import RoundConfig  # pylint: disable=g-import-not-at-top
  from fltff.simulation import RoundDriver  # pylint: disable=g-import-not-at-top
  from fltff.simulation import build_model_spec  # pylint: disable=g-import-not-at-top
  from helpers import REPO  # pylint: disable=g-import-not-at-top
  from helpers import read_csv  # pylint: disable=g-import-not-at-top

  data = build_federated_data(
      source=functools.partial(npz_source, path=os.path.join(REPO, '..', 'shared', 'data',
                                                             'mnist_first1003.npz')),
      partitioner=functools.partial(dirichlet_partition, alpha=0.5), num_clients=5, seed=1)
  algorithm = learning.build_scaffold(build_model_spec(data, 'mlp2', seed=0), num_clients=5,
                                      client_optimizer=tff.learning.optimizers.build_sgdm(0.05))
  config = RoundConfig(rounds=5, clients_per_round=3, batch_size=32, checkpoint_every=5)
  pids_seen = []

  class Recorder(TffRuntime):

    def after_round(self, round_num):
      pids_seen.append(tuple(self.worker_pids))
      super().after_round(round_num)

  runs = {}
  for name, recycle_every in (('plain', 0), ('recycled', 2)):
    rt = Recorder(recycle_every=recycle_every)
    try:
      RoundDriver(algorithm, data, config, str(tmp_path / name), progress=lambda _: None,
                  runtime=rt).run()
      last = rt.worker_pids
    finally:
      rt.close()
    assert wait_for_exit(last[0])
    runs[name] = read_csv(tmp_path / name / 'metrics.csv')
  recycled_pids = pids_seen[4:]
  assert len(set(recycled_pids)) == 2  # Rounds 1-2 on one worker, 3-4 on the next.
  for pid in set(recycled_pids):
    assert wait_for_exit(pid[0])
  columns = ('train_loss', 'train_accuracy', 'test_accuracy')
  assert [[r[c] for c in columns] for r in runs['recycled']] == [[r[c] for c in columns]
                                                                 for r in runs['plain']]
