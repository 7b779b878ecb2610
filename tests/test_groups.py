"""Vectorised client work as groups on TFF's workers (`fltff.learning.groups`).

Each method runs 3 rounds vectorised in this process and as groups on 1 local worker and on 2
loopback workers (one group per worker, through TFF's remote executor and mergeable context),
from the same initial state; every metric, client state and the final state must agree to 1e-5
of each tensor's scale. A lost worker mid-round: `test_remote.test_lost_worker_round_repeats_on_the_other`
(remote workers train vectorised groups under `experiment.client_work = 'auto'`).
"""

import collections

import numpy as np
import pytest
import tensorflow_federated as tff

from fltff.learning.groups import group_table
from fltff.learning.groups import split_clients
from fltff.learning.model_spec import ModelSpec
from fltff.runtime import LocalWorkerRuntime
from fltff.runtime import make_runtime
from fltff.runtime.in_process import InProcessContext
from fltff.simulation import build_model_spec
from fltff.simulation.experiment import choose_client_work
from helpers import EQUALITY_CLIENTS
from helpers import assert_equal_runs
from helpers import equality_methods
from helpers import mnist_sample_split
from helpers import run_rounds
from test_remote import Worker
from test_vectorized import _small_batchnorm_model

# One method of each kind of vectorised client work: a weighted mean (FedAvg), per-client
# server memory (FedLayerWise), client state with per-client corrections and CCN's latent mean
# (SCAFFOLD+CCN), per-client starts, anchors and layer masks (KAPC+BLS), BatchNorm: the
# server's statistics (FedAvg) and each client's own (FedBN), cnn2's convolutions before a
# factored dense kernel (FedAvg; `fltff.learning.factored_dense`), and a global method's groups
# beside personal models trained in this process (Ditto).
METHODS = [('fedavg', 'mlp2'), ('fedlayerwise', 'mlp2'), ('scaffold+ccn', 'mlp2'),
           ('kapc+bls', 'mlp2'), ('fedavg', 'batchnorm'), ('fedbn', 'batchnorm'),
           ('fedavg', 'cnn2'), ('ditto', 'mlp2')]


@pytest.fixture(scope='module')
def two_workers():
  ws = [Worker(), Worker()]
  yield [w.address for w in ws]
  for w in ws:
    w.stop()


def _vectorised(method, spec):
  return equality_methods()[method](spec).with_vectorized_clients()


def _on(runtime, algorithm, data):
  placed = runtime.place(algorithm)
  assert placed is runtime and runtime.groups.work is algorithm.vectorized_work()
  return run_rounds(algorithm, data, runtime.driver_context, EQUALITY_CLIENTS)


@pytest.mark.parametrize('method,model', METHODS)
def test_groups_on_one_and_two_workers_equal_the_in_process_vectorised_rounds(
    method, model, data, spec, two_workers, cpp):
  if model == 'batchnorm':
    spec = ModelSpec(_small_batchnorm_model, (28, 28, 1), 10)
  elif model == 'cnn2':  # A tenth of the examples: rounds short enough to factor dense1.
    data = mnist_sample_split(EQUALITY_CLIENTS, seed=3, local_test_examples=10, data_fraction=0.1)
    spec = build_model_spec(data, 'cnn2', seed=0)
  expected = run_rounds(_vectorised(method, spec), data, InProcessContext(), EQUALITY_CLIENTS)
  try:
    with LocalWorkerRuntime() as one:
      algorithm = _vectorised(method, spec)
      on_one = _on(one, algorithm, data)
      if model == 'cnn2':
        assert algorithm.vectorized_work().factored_traces == {(4, 6)}  # Both dense kernels.
      assert one.description == ("TFF's C++ runtime (local worker_binary), vectorised "
                                 'clients: 3 clients per call on 1 worker')
    # 'auto' client work vectorises on remote workers.
    with make_runtime(workers=two_workers, insecure_plaintext=True) as two:
      algorithm, _ = choose_client_work(equality_methods()[method](spec), 'auto', True, two)
      assert algorithm.vectorized
      on_two = _on(two, algorithm, data)
      groups = two.groups
      assert sorted(groups.last_sizes) == [1, 2]  # Each round's 3 participants, 2 groups.
      # To each worker the global model and the group's data; back, each client's model, or
      # for a plain weighted mean (FedAvg's, Ditto's global model) the group's mean update.
      summed = groups.work.mean_aggregation
      assert summed == (method in ('fedavg', 'ditto'))
      model_bytes = sum(w.nbytes for w in spec.initial_weights().trainable)
      assert len(groups.last_bytes) == 2 and all(
          down > model_bytes and (model_bytes < up < 2 * model_bytes if summed
                                  else up > n * model_bytes)
          for (down, up), n in zip(groups.last_bytes, groups.last_sizes))
      assert two.description.endswith('vectorised clients: 1-2 clients per call on 2 workers')
  finally:
    tff.framework.set_default_context(cpp)
  assert_equal_runs(expected, on_one, f'{method} on {model} (1 worker)', rtol=1e-5)
  assert_equal_runs(expected, on_two, f'{method} on {model} (2 workers)', rtol=1e-5)


def test_clients_trained_models_come_back_when_the_driver_reads_them(data, spec, cpp):
  # `trained_local` evaluates each participant's trained model: the groups send their clients'
  # models, not the group's mean update, and they equal the in-process ones.
  in_process = _vectorised('fedavg', spec)
  expected = run_rounds(in_process, data, InProcessContext(), EQUALITY_CLIENTS, rounds=1)
  try:
    with LocalWorkerRuntime() as one:
      algorithm = _vectorised('fedavg', spec)
      assert one.place(algorithm, keep_trained=True) is one
      trace = run_rounds(algorithm, data, one.driver_context, EQUALITY_CLIENTS, rounds=1)
      (_, up), = one.groups.last_bytes
  finally:
    tff.framework.set_default_context(cpp)
  assert up > 3 * sum(w.nbytes for w in spec.initial_weights().trainable)
  assert_equal_runs(expected, trace, 'fedavg, trained models back', rtol=1e-5)
  for want, got in zip(in_process.trained_weights().trainable,
                       algorithm.trained_weights().trainable):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_groups_table_holds_only_its_clients_rows_and_reads_the_same_batches():
  rng = np.random.default_rng(0)
  # 4 clients, 2 epochs, 3 steps, batch 2; client c's examples are rows 10c..10c+9.
  k, epochs, steps, batch = 4, 2, 3, 2
  padding = 40
  index = np.full((epochs, steps, k, batch), padding, np.int64)
  mask = np.zeros((epochs, steps, k, batch), np.float32)
  work = [1, 3, 2, 0]  # Steps each client trains per epoch (client 3: none).
  for c in range(k):
    for s in range(work[c]):
      index[:, s, c] = rng.choice(10, size=(epochs, batch), replace=False) + 10 * c
      mask[:, s, c] = 1.0
  data = collections.OrderedDict(
      examples=rng.integers(0, 255, (41, 2, 2), dtype=np.uint8),
      labels=np.arange(41, dtype=np.int32), index=index, mask=mask,
      valid=mask.any(axis=-1), epochs=np.array([2, 2, 2, 0], np.int32))
  data['examples'][padding] = 0
  groups = split_clients(data, 2)
  assert [list(g) for g in groups] == [[0, 3], [1, 2]]  # The least work together.
  for clients in groups:
    group = group_table(data, clients)
    cut = len(group['labels'])
    assert cut == len(np.unique(index[:, :, clients])) + (padding not in index[:, :, clients])
    steps_kept = max(work[c] for c in clients)
    np.testing.assert_array_equal(group['examples'][group['index']],
                                  data['examples'][index[:, :steps_kept, clients]])
    np.testing.assert_array_equal(group['labels'][-1], padding)  # The padding row stays last.
    np.testing.assert_array_equal(group['epochs'], data['epochs'][clients])
