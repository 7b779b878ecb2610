"""Sampling, state store, checkpoints and summary helpers of the round driver."""

import numpy as np
import pytest

from fltff.errors import ConfigError
from fltff.simulation import Checkpointer
from fltff.simulation import ClientStateStore
from fltff.simulation import sampling
from fltff.simulation.outputs import rounds_to_targets


def test_sampling_is_deterministic_per_round_and_without_replacement():
  a = [sampling.sample_clients(100, 10, seed=7, round_num=r) for r in range(1, 6)]
  b = [sampling.sample_clients(100, 10, seed=7, round_num=r) for r in range(5, 0, -1)][::-1]
  for x, y in zip(a, b):  # Independent of the order rounds are asked for (resume).
    np.testing.assert_array_equal(x, y)
    assert len(np.unique(x)) == 10 and x.min() >= 0 and x.max() < 100
  assert not all(np.array_equal(a[0], x) for x in a[1:])
  np.testing.assert_array_equal(sampling.sample_clients(5, 5, 0, 1), np.arange(5))


@pytest.mark.parametrize('count,fraction,expected', [(None, None, 100), (7, None, 7),
                                                     (None, 0.1, 10), (None, 0.001, 1)])
def test_num_participants(count, fraction, expected):
  assert sampling.num_participants(100, count, fraction) == expected


@pytest.mark.parametrize('count,fraction', [(0, None), (101, None), (None, 0.0), (None, 1.5),
                                            (5, 0.1)])
def test_num_participants_rejects_bad_values(count, fraction):
  with pytest.raises(ConfigError):
    sampling.num_participants(100, count, fraction)


def test_client_state_store_roundtrip():
  store = ClientStateStore(init_fn=lambda i: {'w': np.full((2, 3), i, np.float32),
                                              'n': np.int32(0)})
  assert store.get(4)['w'][0, 0] == 4.0
  store.set(9, {'w': np.ones((2, 3), np.float32), 'n': np.int32(3)})
  arrays = store.checkpoint(1)
  restored = ClientStateStore(init_fn=lambda i: {'w': np.zeros((2, 3), np.float32),
                                                 'n': np.int32(-1)})
  restored.restore(1, arrays, template_fn=lambda i: {'w': 0, 'n': 0})
  assert len(restored) == 2 and 9 in restored and 5 not in restored
  np.testing.assert_array_equal(restored.get(9)['w'], np.ones((2, 3)))
  assert int(restored.get(9)['n']) == 3 and restored.get(4)['w'][0, 0] == 4.0


def test_the_fingerprint_is_that_of_the_states_held_after_every_kind_of_change():
  """The store keeps each state's digest between checkpoints: every change must drop it."""
  init = lambda i: {'w': np.full((2, 3), i, np.float32)}
  store = ClientStateStore(init)

  def from_scratch():  # A fresh store holding the same states digests each one anew.
    fresh = ClientStateStore(init)
    fresh.restore(1, store.checkpoint(1), init)
    return fresh.fingerprint(1)

  for k in (1, 2, 3):
    store.get(k)
  first = store.fingerprint(1)
  assert first == from_scratch() and store.fingerprint(2) == first
  store.set(2, {'w': np.full((2, 3), 7, np.float32)})  # Replaced after a checkpoint.
  second = store.fingerprint(3)
  assert second != first and second == from_scratch()
  store.set_many({3: {'w': np.zeros((2, 3), np.float32)}}, 4)
  store.get(5)  # A new client.
  third = store.fingerprint(4)
  assert third['clients'] == 4 and third != second and third == from_scratch()
  # States 1 and 2 restored into each other's place: the restored store's fingerprint says so.
  arrays = store.checkpoint(4)
  arrays['client/1/0'], arrays['client/2/0'] = arrays['client/2/0'], arrays['client/1/0']
  store.restore(4, arrays, init)
  assert store.fingerprint(4)['contents'] != third['contents'] and store.fingerprint(4) == (
      from_scratch())
  store.reset()
  store.get(1)
  assert store.fingerprint(5) == from_scratch() and store.fingerprint(5)['clients'] == 1


def test_checkpointer_roundtrip_and_pruning(tmp_path):
  ckpt = Checkpointer(str(tmp_path), keep=2)
  template = {'a': np.zeros(3, np.float32), 'b': [np.zeros((2, 2)), np.int64(0)]}
  for r in range(1, 5):
    state = {'a': np.full(3, r, np.float32), 'b': [np.eye(2) * r, np.int64(r)]}
    ckpt.save(r, state, {'rows': [{'round': i} for i in range(1, r + 1)]},
              {'client/0/0': np.array([r])})
  assert ckpt.latest_round() == 4
  round_num, state, meta, extra = ckpt.restore(template)
  assert round_num == 4 and len(meta['rows']) == 4
  np.testing.assert_array_equal(state['a'], np.full(3, 4.0))
  np.testing.assert_array_equal(state['b'][0], np.eye(2) * 4)
  assert int(extra['client/0/0'][0]) == 4
  kept = sorted(p.name for p in (tmp_path / 'checkpoints').glob('round_*.npz'))
  assert kept == ['round_00003.npz', 'round_00004.npz']
  with pytest.raises(ValueError, match='shape'):
    ckpt.restore({'a': np.zeros(4, np.float32), 'b': [np.zeros((2, 2)), np.int64(0)]})


def test_rounds_to_targets():
  rows = [{'round': 1, 'test_accuracy': 0.5}, {'round': 2},
          {'round': 3, 'test_accuracy': 0.81}, {'round': 4, 'test_accuracy': 0.95}]
  assert rounds_to_targets(rows, [0.5, 0.8, 0.9, 0.99]) == {
      '0.5': 1, '0.8': 3, '0.9': 4, '0.99': None}
