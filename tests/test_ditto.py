"""Ditto (`fltff.personalization.ditto`) against a NumPy reference, on both client works.

A softmax regression on random data, 2 clients, 2 rounds of plain SGD: the global model is
FedAvg's (example-weighted mean of the clients' trained copies of w^t); each personal model v_k
takes the same batches from its own v_k with the step `v − η (∇F_k(v) + λ (v − w^t))`.
"""

import collections
import os

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from fltff import methods
from fltff.errors import ConfigError
from fltff.learning import optimizers
from fltff.learning import protocol
from fltff.learning.model_spec import ModelSpec
from fltff.personalization import build_ditto
from fltff.runtime.in_process import InProcessContext
from fltff.simulation import RoundConfig
from fltff.simulation import RoundDriver
from fltff.simulation.evaluation import check_protocols
from fltff.simulation.state_store import ClientStateStore
from helpers import mnist_sample_split
from helpers import random_client_arrays
from helpers import read_csv

DIM, CLASSES, BATCH, LR = 5, 3, 4, 0.3
SIZES = (8, 6)  # Examples per client: 2 and 2 batches (the second client's last one short).


def _linear():
  init = tf.keras.initializers.GlorotUniform(seed=7)
  inputs = tf.keras.Input((DIM,))
  return tf.keras.Model(inputs, tf.keras.layers.Dense(
      CLASSES, kernel_initializer=init, bias_initializer=tf.keras.initializers.RandomNormal(
          stddev=0.1, seed=8))(inputs))


SPEC = ModelSpec(_linear, (DIM,), CLASSES)


def _batches(x, y):
  return tf.data.Dataset.from_tensor_slices(collections.OrderedDict(x=x, y=y)).batch(BATCH)


def _sgd_epoch(w, b, x, y, anchor=None, lam=0.0):
  """One epoch of minibatch SGD on the mean cross-entropy (plus `lam/2 ||θ − anchor||²`)."""
  for start in range(0, len(y), BATCH):
    xb, yb = x[start:start + BATCH].astype(np.float64), y[start:start + BATCH]
    logits = xb @ w + b
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(len(yb)), yb] -= 1.0
    gw, gb = xb.T @ p / len(yb), p.mean(axis=0)
    if anchor is not None:
      gw, gb = gw + lam * (w - anchor[0]), gb + lam * (b - anchor[1])
    w, b = w - LR * gw, b - LR * gb
  return w, b


def _numpy_ditto(clients, lam, rounds):
  """`(global (w, b), {client: personal (w, b)})` after `rounds` rounds of every client."""
  model = _linear()
  glob = tuple(np.asarray(t, np.float64) for t in model.get_weights())
  personal = {k: glob for k in range(len(clients))}
  for _ in range(rounds):
    trained = [_sgd_epoch(*glob, x, y) for x, y in clients]
    weights = np.array([len(y) for _, y in clients], np.float64)
    new_glob = tuple(sum(n * t[i] for n, t in zip(weights, trained)) / weights.sum()
                     for i in range(2))
    personal = {k: _sgd_epoch(*personal[k], x, y, anchor=glob, lam=lam)
                for k, (x, y) in enumerate(clients)}
    glob = new_glob
  return glob, personal


def _run(algorithm, clients, rounds):
  state = algorithm.initialize()
  store = ClientStateStore(algorithm.initial_client_state)
  for _ in range(rounds):
    out, _ = protocol.run_round(
        algorithm, state, [0, 1], batches_of=lambda k: _batches(*clients[k]),
        epochs_of=lambda k: 1, num_examples_of=lambda k: len(clients[k][1]),
        client_state_of=store.get)
    state = out.state
    for k, value in out.client_states.items():
      store.set(k, value)
  return state, store


@pytest.mark.parametrize('vectorised', [False, True])
@pytest.mark.parametrize('lam', [0.0, 0.5])
def test_ditto_equals_its_numpy_reference(vectorised, lam, cpp):
  clients = random_client_arrays(SIZES, seed=11, shape=DIM, classes=CLASSES)
  algorithm = build_ditto(SPEC, client_optimizer=optimizers.sgdm(LR),
                          lambda_=lam)
  if vectorised:
    algorithm = algorithm.with_vectorized_clients()
  tff.framework.set_default_context(InProcessContext() if vectorised else cpp)
  try:
    state, store = _run(algorithm, clients, rounds=2)
  finally:
    tff.framework.set_default_context(cpp)
  expected_global, expected_personal = _numpy_ditto(clients, lam, rounds=2)
  for actual, expected in zip(algorithm.global_model_weights(state).trainable, expected_global):
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)
  for k in range(2):
    personal = algorithm.personal_weights(state, store.get(k))['trainable']
    for actual, expected in zip(personal, expected_personal[k]):
      np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)
  # λ pulls the personal models towards the global one; they differ from it all the same.
  assert not np.allclose(personal[0], expected_global[0])


def test_ditto_global_model_is_fedavgs_and_the_registry_builds_it(cpp):
  clients = random_client_arrays(SIZES, seed=12, shape=DIM, classes=CLASSES)
  sgd = lambda: optimizers.sgdm(LR)
  ditto = methods.build('ditto', SPEC, client_optimizer=sgd(), lambda_=2.0)
  fedavg = methods.build('fedavg', SPEC, client_optimizer=sgd())
  assert ditto.name == 'ditto' and ditto.personal_models and not ditto.personalized
  tff.framework.set_default_context(cpp)
  state, _ = _run(ditto, clients, rounds=2)
  reference, _ = _run(fedavg, clients, rounds=2)
  for a, b in zip(ditto.global_model_weights(state).trainable,
                  fedavg.global_model_weights(reference).trainable):
    np.testing.assert_array_equal(a, b)
  # Personal models are evaluated with personal_local beside the global model's protocols.
  assert check_protocols(['personal_local', 'central'], False, True, True, personal_models=True)
  with pytest.raises(ConfigError, match='needs personal models'):
    check_protocols(['personal_local'], False, True, True)
  with pytest.raises(ConfigError, match='ditto.lambda_'):
    build_ditto(SPEC, lambda_=-1.0)


@pytest.mark.parametrize('vectorised', [False, True])
def test_ditto_runs_in_the_driver_with_personal_and_global_protocols(vectorised, tmp_path, cpp):
  # The driver's evaluator is built before the first round: nothing Ditto traces in a round may
  # invalidate it (a Keras model traced in a graph does), on either client work.
  from fltff.simulation import build_model_spec  # pylint: disable=g-import-not-at-top

  data = mnist_sample_split(4, seed=5, local_test_examples=20)
  spec = build_model_spec(data, 'mlp2', seed=0)
  algorithm = build_ditto(spec, client_optimizer=optimizers.sgdm(0.05),
                          lambda_=0.1)
  if vectorised:
    algorithm = algorithm.with_vectorized_clients()
  tff.framework.set_default_context(InProcessContext() if vectorised else cpp)
  try:
    config = RoundConfig(rounds=2, clients_per_round=2, batch_size=32, seed=1,
                         evaluation=('personal_local', 'global_local', 'central'))
    RoundDriver(algorithm, data, config, str(tmp_path), progress=lambda _: None).run()
  finally:
    tff.framework.set_default_context(cpp)
  rows = read_csv(os.path.join(tmp_path, 'metrics.csv'))
  assert len(rows) == 2
  for column in ('personal_local_accuracy', 'global_local_accuracy', 'test_accuracy',
                 'personalized_accuracy'):
    assert 0.0 < float(rows[-1][column]) <= 1.0, column
