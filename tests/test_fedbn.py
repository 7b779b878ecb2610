"""FedBN on a model with BatchNorm (`cnn2_bn`, issue 36): the BN layers stay local, the rest is
the sample-weighted average (checked against NumPy), and the pipeline runs it end to end."""

import collections
import json
import os

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from fltff import models
from fltff.learning import ModelSpec
from fltff.personalization import fedbn as fedbn_lib
from fltff.learning import optimizers
from helpers import read_csv
from helpers import run_pipeline
from helpers import tagged_worker_pids

SHAPE, CLASSES = (8, 8, 1), 3
SPEC = ModelSpec(lambda: models.build_model('cnn2_bn', SHAPE, CLASSES, seed=3), SHAPE, CLASSES,
                 name='cnn2_bn')


def _datasets(sizes, seed):
  """Client k's images are shifted and scaled differently (feature skew), so each client's
  BatchNorm statistics and affine parameters end up its own."""
  rng = np.random.default_rng(seed)
  return [tf.data.Dataset.from_tensor_slices(collections.OrderedDict(
      x=(k + 1.0) * rng.normal(loc=k, size=(n, *SHAPE)).astype(np.float32),
      y=rng.integers(0, CLASSES, n).astype(np.int32))).batch(4) for k, n in enumerate(sizes)]


class Sim:
  """The driver's bookkeeping of a personalised method, without files."""

  def __init__(self, algorithm, num_clients):
    self.algorithm = algorithm
    self.states = {k: algorithm.initial_client_state(k) for k in range(num_clients)}
    self.state = algorithm.process.initialize()

  def round(self, clients, datasets, num_examples, epochs):
    inputs = [self.algorithm.client_input(d, k, epochs, self.states[k])
              for k, d in zip(clients, datasets)]
    server_input = self.algorithm.server_input(clients, [self.states[k] for k in clients],
                                               num_examples)
    out = self.algorithm.process.next(self.state, server_input, inputs)
    self.state = out.state
    self.states.update(self.algorithm.next_client_states(out.result, server_input))
    return out


def _norm_tensors():
  """Whether each trainable tensor of the model belongs to a BatchNorm layer."""
  model = SPEC.keras_fn()
  norm = [False] * len(model.trainable_weights)
  for g in models.layer_groups(model):
    for i in g.trainable_indices:
      norm[i] = g.kind == 'norm'
  return norm


def test_fedbn_keeps_batchnorm_local_averages_the_rest_by_examples_and_sends_no_bn_bytes():
  """Round 1 trains three clients on differently skewed data. Round 2 (0 local epochs: each
  client's model after it is the model FedBN starts it from) must give client k, in NumPy:
  its own gamma/beta and moving statistics, and Σ_j n_j w_j / Σ_j n_j for every other tensor.
  The BN layers never cross the network (the KAPC paper's Table 6 counts FedBN's
  communication without them): 4 bytes per parameter of the other layers, by hand."""
  norm = _norm_tensors()
  assert sum(norm) == 8  # gamma and beta of bn1..bn4
  algorithm = fedbn_lib.build_fedbn(SPEC, 3, client_optimizer=optimizers.sgdm(
      learning_rate=0.1))
  conv1, conv2 = 5 * 5 * 1 * 32 + 32, 5 * 5 * 32 * 64 + 64
  dense1, dense2, logits = 2 * 2 * 64 * 512 + 512, 512 * 128 + 128, 128 * CLASSES + CLASSES
  shared = 4 * (conv1 + conv2 + dense1 + dense2 + logits)
  bn = 4 * 2 * (32 + 64 + 512 + 128)
  assert sum(algorithm.parts.layer_sizes_bytes) == shared + bn
  assert algorithm.bytes_down_per_client == algorithm.bytes_up_per_client == shared
  sim = Sim(algorithm, 3)
  initial = SPEC.initial_weights()
  out = sim.round([0, 1, 2], _datasets((8, 12, 4), seed=0), [8.0, 12.0, 4.0], epochs=1)
  np.testing.assert_array_equal(out.result['bytes_down'], [shared] * 3)
  np.testing.assert_array_equal(out.result['bytes_up'], [shared] * 3)
  trained = {k: [np.array(w) for w in sim.states[k]['model']['trainable']] for k in range(3)}
  stats = {k: [np.array(w) for w in sim.states[k]['model']['non_trainable']] for k in range(3)}
  for k in range(3):
    # Each client trained its BN layers and statistics, differently from the others.
    assert [w.shape for w in stats[k]] == [np.shape(w) for w in initial.non_trainable]
    for t, w in enumerate(stats[k]):
      assert not np.allclose(w, initial.non_trainable[t])
      assert not np.allclose(w, stats[(k + 1) % 3][t])

  # Round 2, the participants listed out of index order, with unequal sample counts.
  clients, n = [2, 0, 1], np.array([3.0, 5.0, 12.0])
  out = sim.round(clients, _datasets((4, 4, 4), seed=1), list(n), epochs=0)
  share = n / n.sum()
  for p, k in enumerate(clients):
    model = sim.states[k]['model']
    for t, w in enumerate(model['trainable']):
      mean = sum(s * trained[j][t].astype(np.float64) for s, j in zip(share, clients))
      want = trained[k][t] if norm[t] else mean
      np.testing.assert_allclose(w, want, rtol=1e-5, atol=1e-6, err_msg=f'client {k}, {t}')
      if norm[t]:  # The test tells local from averaged BN layers ...
        assert np.abs(mean - trained[k][t]).max() > 1e-4
      elif w.ndim >= 2:  # ... and the sample-weighted mean from the plain one (kernels: the
        # biases before a BN get no gradient, the BN removes their effect).
        plain = np.mean([trained[j][t] for j in clients], axis=0)
        assert np.abs(mean - plain).max() > 1e-4
    for t, w in enumerate(model['non_trainable']):
      np.testing.assert_array_equal(w, stats[k][t])  # The statistics never left the client.
  np.testing.assert_array_equal(out.result['clients'], clients)


def test_pipeline_runs_fedbn_on_cnn2_bn_and_evaluates_each_clients_own_statistics(tmp_path):
  # Client by client on TFF's C++ runtime: tracing cnn2_bn's vectorised step costs more than
  # two rounds here. 'auto' vectorises it on clients of about equal size (test_vectorized.py:
  # the choice, and the clients' own statistics equal to these).
  result = run_pipeline(
      '--gin_file=gin_configs/kapc/offline_mnist1003_fedbn_cnn2_bn.gin',
      '--gin_bindings=experiment.rounds = 2', '--gin_bindings=experiment.local_epochs = 1',
      '--gin_bindings=experiment.client_work = "per_client"',
      '--gin_bindings=federated_data.num_clients = 4', f'--output_dir={tmp_path}')
  assert result.returncode == 0, result.stderr[-3000:]
  with open(os.path.join(tmp_path, 'summary.json')) as f:
    summary = json.load(f)
  assert summary['executor'].startswith("TFF's C++ runtime")
  rows = read_csv(os.path.join(tmp_path, 'metrics.csv'))
  assert len(rows) == 2
  assert float(rows[-1]['personal_local_accuracy']) > 0.2
  assert not tagged_worker_pids()
