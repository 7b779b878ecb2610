"""SCAFFOLD: zero controls equal FedAvg, option II, the server control, CCN over it, resume."""

import collections

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from fltff import aggregators
from fltff import learning
from fltff.learning import ModelSpec
from fltff.learning import client_state
from fltff.learning.scaffold import server_control_update
from fltff.learning import optimizers
from helpers import start_process
from helpers import tiny_mlp

DIM, CLASSES, LR = 5, 3, 0.1
SPEC = ModelSpec(lambda: tiny_mlp(DIM, CLASSES, 17), (DIM,), CLASSES)


def _datasets(sizes, seed=4):
  rng = np.random.default_rng(seed)
  return [tf.data.Dataset.from_tensor_slices(collections.OrderedDict(
      x=rng.normal(size=(n, DIM)).astype(np.float32),
      y=rng.integers(0, CLASSES, n).astype(np.int32))).batch(4) for n in sizes]


def _sgd():
  return optimizers.sgdm(learning_rate=LR)


def _controls(gathered):
  return client_state.unpack_client_states(gathered)


def test_zero_controls_round_one_equals_fedavg():
  sizes, epochs = (12, 8, 16), (2, 1, 3)
  avg_process, avg_state = start_process(learning.build_fedavg(SPEC, client_optimizer=_sgd()))
  sc = learning.build_scaffold(SPEC, num_clients=3, client_optimizer=_sgd())
  sc_process, sc_state = start_process(sc)
  zero = sc.client_state_init()
  avg = avg_process.next(avg_state, [learning.client_input(d, i, e) for i, (d, e) in
                                     enumerate(zip(_datasets(sizes), epochs))])
  out = sc_process.next(sc_state, [learning.client_input(d, i, e, client_state=zero)
                                   for i, (d, e) in enumerate(zip(_datasets(sizes), epochs))])
  for a, b in zip(avg_process.get_model_weights(avg.state).trainable,
                  sc_process.get_model_weights(out.state).trainable):
    np.testing.assert_allclose(a, b, atol=1e-6)
  assert max(float(np.max(np.abs(w - s))) for w, s in zip(
      SPEC.initial_weights().trainable,
      sc_process.get_model_weights(out.state).trainable)) > 1e-3


def test_option_two_control_and_server_control_match_numpy():
  """Round 2 with non-zero c and c_i: c_i⁺ = c_i − c + (x − y)/(K η) and c⁺ = c + ΣΔc/N."""
  num_clients = 2
  sc = learning.build_scaffold(SPEC, num_clients=num_clients, client_optimizer=_sgd())
  process, state = start_process(sc)
  zero = sc.client_state_init()
  # Round 1: both clients, from zero controls.
  out = process.next(state, [learning.client_input(d, i, 1, client_state=zero)
                             for i, d in enumerate(_datasets((12, 8)))])
  controls = _controls(out.metrics['client_work']['client_states'])
  server_c = [np.asarray(c) for c in out.state.client_work]
  want_c = server_control_update(zero, [controls[0][j] + controls[1][j]
                                        for j in range(len(zero))], num_clients)
  for a, b in zip(server_c, want_c):
    np.testing.assert_allclose(a, b, atol=1e-6)
  # Round 2: client 0 alone, 2 epochs of 3 batches (K = 6 steps); c ≠ c_0 since N = 2.
  x = [np.asarray(w) for w in process.get_model_weights(out.state).trainable]
  out2 = process.next(out.state, [learning.client_input(_datasets((12,), seed=8)[0], 0, 2,
                                                        client_state=controls[0])])
  y = [np.asarray(w) for w in process.get_model_weights(out2.state).trainable]
  new = _controls(out2.metrics['client_work']['client_states'])[0]
  steps = 6
  for j in range(len(x)):
    want = controls[0][j] - server_c[j] + (x[j] - y[j]) / (steps * LR)
    np.testing.assert_allclose(new[j], want, rtol=1e-4, atol=1e-5)
  # The correction was applied: without it, (x − y)/(Kη) would be the raw gradient mean.
  assert max(float(np.max(np.abs(controls[0][j] - server_c[j]))) for j in range(len(x))) > 1e-3
  for a, c, n, o in zip(out2.state.client_work, server_c, new, controls[0]):
    np.testing.assert_allclose(a, c + (n - o) / num_clients, atol=1e-6)


def test_scaffold_with_ccn_compiles_to_mergeable_form():
  algorithm = learning.build_scaffold(
      SPEC, num_clients=4, model_aggregator=aggregators.contribution_normalization_factory())
  form = tff.backends.native.compile_to_mergeable_comp_form(algorithm.process.next)
  assert isinstance(form, tff.framework.MergeableCompForm)
  plain = learning.build_scaffold(SPEC, num_clients=4)
  assert algorithm.bytes_up_per_client > plain.bytes_up_per_client  # + the latent mean.
  avg = learning.build_fedavg(SPEC)
  control_bytes = sum(np.asarray(w).nbytes for w in SPEC.initial_weights().trainable)
  assert plain.bytes_down_per_client == avg.bytes_down_per_client + control_bytes
  assert plain.bytes_up_per_client == avg.bytes_up_per_client + control_bytes
