"""The round driver on 2 loopback workers equals the local runtime.

The same algorithm object runs 3 rounds with the round driver (training, evaluation every
round, checkpoints) on the local runtime and on 2 workers (in-process: one trace per method),
on an uneven Dirichlet split with partial participation, and every metric and every array of
the final checkpoint (server state, client states) must agree. The rounds of one method of each
shape of what is merged on workers are in `test_vectorized.py`'s executor matrix
(`ON_TWO_WORKERS`); here the driver's path: a global method (FedAvg, a weighted mean) and a
personalised one with client states and a server step (KAPC+BLS).
"""

import functools
import os

import numpy as np
import pytest
import tensorflow_federated as tff

from fltff import methods
from fltff.runtime import RemoteWorkersRuntime
from fltff.simulation import RoundConfig
from fltff.simulation import RoundDriver
from fltff.simulation import build_model_spec
from fltff.learning import optimizers
from helpers import mnist_sample_split
from helpers import read_csv
from test_remote import Worker

NUM_CLIENTS = 6
SGD = functools.partial(tff.learning.optimizers.build_sgdm, learning_rate=0.05)
NAMES = ['fedavg', 'kapc+bls']
SETTINGS = {'kapc+bls': {'bls_mu': 0.3}}


def _build(name, spec):
  return methods.build(name, spec, NUM_CLIENTS, SGD(), **SETTINGS.get(name, {}))


@pytest.fixture(scope='module')
def data():
  return mnist_sample_split(NUM_CLIENTS, seed=3, local_test_examples=20)


@pytest.fixture(scope='module')
def two_workers():
  ws = [Worker(), Worker()]
  runtime = RemoteWorkersRuntime(workers=[w.address for w in ws])
  yield runtime
  runtime.close()
  for w in ws:
    w.stop()


def _run(algorithm, data, runtime, out):
  tff.framework.set_default_context(runtime.context)
  config = RoundConfig(rounds=3, clients_per_round=4, local_epochs=1, batch_size=16,
                       eval_every=1, checkpoint_every=3, seed=1)
  RoundDriver(algorithm, data, config, str(out), progress=lambda _: None,
              runtime=runtime).run()
  checkpoint = np.load(os.path.join(out, 'checkpoints', 'round_00003.npz'))
  return read_csv(os.path.join(out, 'metrics.csv')), {k: checkpoint[k] for k in checkpoint}


def test_split_is_uneven(data):
  sizes = sorted(len(i) for i in data.train_indices)
  assert sizes[-1] > 1.5 * sizes[0]


@pytest.mark.parametrize('method', NAMES)
def test_two_workers_equal_local_runtime(method, data, two_workers, tff_runtime, tmp_path):
  algorithm = _build(method, build_model_spec(data, 'mlp2', seed=0))
  local_rows, local_arrays = _run(algorithm, data, tff_runtime, tmp_path / 'local')
  rows, arrays = _run(algorithm, data, two_workers, tmp_path / 'two')
  assert len(rows) == len(local_rows) == 3
  skip = {'round_seconds'} | {k for k in rows[0] if k.startswith('sim_')}
  for a, b in zip(rows, local_rows):
    assert a.keys() == b.keys()
    for key in a.keys() - skip:
      if a[key] in ('', None) or b[key] in ('', None):
        assert a[key] == b[key], (a['round'], key)
        continue
      assert float(a[key]) == pytest.approx(float(b[key]), rel=1e-5, abs=1e-6), (a['round'],
                                                                                  key)
  assert arrays.keys() == local_arrays.keys()
  for key in arrays:
    np.testing.assert_allclose(arrays[key], local_arrays[key], rtol=1e-5, atol=1e-6,
                               err_msg=key)
