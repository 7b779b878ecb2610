"""MOON: the contrastive loss, FedAvg equivalences, the regulariser's gradient, the client state,
mergeable form and an end-to-end pipeline run."""

import collections
import functools
import json
import math
import os

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from fltff import learning
from fltff.learning import ModelSpec
from fltff.learning import client_state
from fltff.learning.moon import ModelContrastiveRegularizer
from fltff.learning.moon import model_contrastive_loss
from fltff.learning import optimizers
from fltff.learning.vectorized import functional_apply
from fltff.models import latent_model
from helpers import random_client_arrays
from helpers import random_client_datasets
from helpers import read_csv
from helpers import run_pipeline
from helpers import start_process
from helpers import tagged_worker_pids
from helpers import tiny_mlp

DIM, CLASSES, LR, TAU = 5, 3, 0.1, 0.5
SPEC = ModelSpec(lambda: tiny_mlp(DIM, CLASSES, 17), (DIM,), CLASSES)


def _arrays(sizes, seed=4):
  return random_client_arrays(sizes, seed, DIM, CLASSES)


def _datasets(sizes, seed=4):
  return random_client_datasets(sizes, seed, DIM, CLASSES, batch=4)


def _sgd():
  return optimizers.sgdm(learning_rate=LR)


def _states(output):
  return client_state.unpack_client_states(output.metrics['client_work']['client_states'])


def _trainable(process, state):
  return [np.asarray(w) for w in process.get_model_weights(state).trainable]


def _moon_round(algorithm, process, state, states, clients, sizes, epochs, seed=4):
  inputs = [learning.client_input(d, k, e, client_state=states.get(k,
                                                                    algorithm.client_state_init()))
            for k, d, e in zip(clients, _datasets(sizes, seed), epochs)]
  out = process.next(state, inputs)
  states = {**states, **_states(out)}
  return out.state, states


def _fedavg_round(process, state, clients, sizes, epochs, seed=4):
  return process.next(state, [learning.client_input(d, k, e) for k, d, e in
                              zip(clients, _datasets(sizes, seed), epochs)]).state


def _numpy_loss(z, z_glob, z_prev, tau):
  def cos(a, b):
    return np.sum(a * b, -1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))
  pos, neg = np.exp(cos(z, z_glob) / tau), np.exp(cos(z, z_prev) / tau)
  return float(np.mean(-np.log(pos / (pos + neg))))


@pytest.mark.parametrize('seed', [0, 1, 2])
@pytest.mark.parametrize('tau', [0.5, 0.1, 2.0])
def test_model_contrastive_loss_matches_numpy(seed, tau):
  rng = np.random.default_rng(seed)
  z, z_glob, z_prev = (rng.normal(size=(7, 6)).astype(np.float32) for _ in range(3))
  got = model_contrastive_loss(tf.constant(z), tf.constant(z_glob), tf.constant(z_prev), tau)
  np.testing.assert_allclose(got.numpy(), _numpy_loss(z, z_glob, z_prev, tau), rtol=1e-5)
  # z_prev = z_glob: both terms equal, ℓ_con = log 2 whatever z is.
  same = model_contrastive_loss(tf.constant(z), tf.constant(z_glob), tf.constant(z_glob), tau)
  np.testing.assert_allclose(same.numpy(), math.log(2.0), rtol=1e-6)
  # z aligned with z_glob and opposite to z_prev: cos = ±1.
  aligned = model_contrastive_loss(tf.constant(z_glob), tf.constant(2 * z_glob),
                                   tf.constant(-z_glob), tau)
  np.testing.assert_allclose(aligned.numpy(), math.log1p(math.exp(-2.0 / tau)), rtol=1e-5,
                             atol=1e-7)


def test_mu_zero_equals_fedavg_over_two_rounds():
  algorithm = learning.build_moon(SPEC, num_clients=3, client_optimizer=_sgd(), mu=0.0)
  process, state = start_process(algorithm)
  avg_process, avg_state = start_process(learning.build_fedavg(SPEC, client_optimizer=_sgd()))
  states = {}
  for clients, sizes, epochs, seed in (([0, 1, 2], (12, 8, 16), (2, 1, 3), 4),
                                       ([2, 0], (16, 12), (1, 2), 5)):
    state, states = _moon_round(algorithm, process, state, states, clients, sizes, epochs, seed)
    avg_state = _fedavg_round(avg_process, avg_state, clients, sizes, epochs, seed)
    for a, b in zip(_trainable(avg_process, avg_state), _trainable(process, state)):
      np.testing.assert_allclose(a, b, atol=1e-5)
  assert sorted(states) == [0, 1, 2]


def test_round_one_equals_fedavg_and_round_two_differs():
  """The previous model of a new client is the initial model = w^1: ℓ_con = log 2, no gradient
  in round 1; in round 2 the previous local models differ from the global one."""
  algorithm = learning.build_moon(SPEC, num_clients=3, client_optimizer=_sgd(), mu=5.0)
  initial = SPEC.initial_weights().trainable
  for a, b in zip(algorithm.client_state_init(), initial):
    np.testing.assert_array_equal(a, b)
  process, state = start_process(algorithm)
  avg_process, avg_state = start_process(learning.build_fedavg(SPEC, client_optimizer=_sgd()))
  state, states = _moon_round(algorithm, process, state, {}, [0, 1, 2], (12, 8, 16), (2, 1, 3))
  avg_state = _fedavg_round(avg_process, avg_state, [0, 1, 2], (12, 8, 16), (2, 1, 3))
  moved = 0.0
  for a, b, w in zip(_trainable(avg_process, avg_state), _trainable(process, state), initial):
    np.testing.assert_allclose(a, b, atol=1e-5)
    moved = max(moved, float(np.max(np.abs(b - w))))
  assert moved > 1e-3
  # Round 2 from the same global model (FedAvg set to MOON's round-1 model).
  avg_state = avg_process.set_model_weights(avg_process.initialize(),
                                            process.get_model_weights(state))
  state, _ = _moon_round(algorithm, process, state, states, [0, 1, 2], (12, 8, 16), (1, 1, 1), 5)
  avg_state = _fedavg_round(avg_process, avg_state, [0, 1, 2], (12, 8, 16), (1, 1, 1), 5)
  diff = max(float(np.max(np.abs(a - b))) for a, b in
             zip(_trainable(avg_process, avg_state), _trainable(process, state)))
  assert diff > 1e-4


def _latent_numpy(params, x):
  w, b = params
  return np.maximum(x @ w + b, 0.0)


def _regularizer_on_three_models(seeds, mu):
  """`(local model, global ModelWeights, previous trainable weights, regulariser)`: three
  tiny_mlps with these seeds, the regulariser the per-client one of the local model."""
  local, glob, prev = (tiny_mlp(DIM, CLASSES, s) for s in seeds)
  glob_weights = tff.learning.models.ModelWeights(
      trainable=[w.numpy() for w in glob.trainable_weights], non_trainable=[])
  prev_trainable = [w.numpy() for w in prev.trainable_weights]
  reg = ModelContrastiveRegularizer(
      functools.partial(functional_apply(latent_model(local), local), training=False),
      prev_trainable, mu, TAU)
  return local, glob_weights, prev_trainable, reg


def _batch(local, x, mask=None):
  """A batch as the training loops give it: the training pass's latent, the real examples."""
  mask = np.ones(len(x), np.float32) if mask is None else np.asarray(mask, np.float32)
  return collections.OrderedDict(x=tf.constant(x), latent=latent_model(local)(x, training=True),
                                 mask=tf.constant(mask))


def test_regularizer_gradient_matches_finite_differences():
  """∂(μ ℓ_con)/∂w of `batch_penalty` against central differences of a float64 NumPy ℓ_con; the
  head gets no gradient (the latent layer is tiny_mlp's first Dense layer)."""
  mu = 3.0
  rng = np.random.default_rng(11)
  local, glob_weights, prev_trainable, reg = _regularizer_on_three_models((17, 18, 19), mu)
  x = rng.normal(size=(6, DIM)).astype(np.float32)
  variables = local.trainable_weights
  with tf.GradientTape() as tape:
    penalty = reg.batch_penalty(variables, glob_weights.trainable, _batch(local, x), ())
  grads = tape.gradient(penalty, variables)

  x64 = x.astype(np.float64)
  z_glob = _latent_numpy([w.astype(np.float64) for w in glob_weights.trainable[:2]], x64)
  z_prev = _latent_numpy([w.astype(np.float64) for w in prev_trainable[:2]], x64)

  def loss(params):
    return mu * _numpy_loss(_latent_numpy(params, x64), z_glob, z_prev, TAU)

  params = [v.numpy().astype(np.float64) for v in variables[:2]]
  np.testing.assert_allclose(penalty.numpy(), loss(params), rtol=1e-5)
  eps = 1e-6
  for t, p in enumerate(params):
    numeric = np.zeros_like(p)
    for idx in np.ndindex(p.shape):
      plus = [q.copy() for q in params]
      minus = [q.copy() for q in params]
      plus[t][idx] += eps
      minus[t][idx] -= eps
      numeric[idx] = (loss(plus) - loss(minus)) / (2 * eps)
    np.testing.assert_allclose(grads[t].numpy(), numeric, rtol=1e-3, atol=1e-5)
    assert np.max(np.abs(numeric)) > 1e-3
  for g in grads[2:]:
    assert g is None or not np.any(g.numpy())


def test_term_on_a_padded_batch_equals_the_term_on_its_real_examples():
  """MOON's term on a batch padded from 4 to 6 examples (as vectorised clients pad it, masked
  mean): the value and the gradient of the term on the 4 real ones."""
  mu = 2.0
  rng = np.random.default_rng(5)
  local, glob_weights, _, reg = _regularizer_on_three_models((21, 22, 23), mu)
  x = rng.normal(size=(4, DIM)).astype(np.float32)
  padded = np.concatenate([x, rng.normal(size=(2, DIM)).astype(np.float32)])
  variables = local.trainable_weights
  values, grads = [], []
  for batch_x, mask in ((x, None), (padded, [1., 1, 1, 1, 0, 0])):
    with tf.GradientTape() as tape:
      values.append(reg.batch_penalty(variables, glob_weights.trainable,
                                      _batch(local, batch_x, mask), ()))
    grads.append(tape.gradient(values[-1], variables))
  np.testing.assert_allclose(values[1].numpy(), values[0].numpy(), rtol=1e-6)
  assert values[0].numpy() > 0
  for a, b in zip(*grads):
    if b is None:
      assert a is None or not np.any(a.numpy())
    else:
      np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-7)


def _reference_local_training(global_trainable, previous, x, y, epochs, mu):
  """Independent eager MOON client: SGD on CE + μ ℓ_con, ℓ_con written out with tf ops."""
  model = tiny_mlp(DIM, CLASSES, 50)
  for v, w in zip(model.trainable_weights, global_trainable):
    v.assign(w)
  ce = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

  def latent(params, xb):
    return tf.nn.relu(tf.matmul(xb, params[0]) + params[1])

  def cos(a, b):
    return tf.reduce_sum(a * b, 1) / (tf.norm(a, axis=1) * tf.norm(b, axis=1))

  for _ in range(epochs):
    for start in range(0, len(y), 4):
      xb, yb = tf.constant(x[start:start + 4]), tf.constant(y[start:start + 4])
      z_glob, z_prev = latent(global_trainable, xb), latent(previous, xb)
      with tf.GradientTape() as tape:
        z = latent(model.trainable_weights, xb)
        pos = tf.exp(cos(z, z_glob) / TAU)
        neg = tf.exp(cos(z, z_prev) / TAU)
        loss = ce(yb, model(xb)) + mu * tf.reduce_mean(-tf.math.log(pos / (pos + neg)))
      for v, g in zip(model.trainable_weights, tape.gradient(loss, model.trainable_weights)):
        v.assign_sub(LR * g)
  return [v.numpy() for v in model.trainable_weights]


def test_new_client_state_is_the_trained_model():
  """One participant with a previous model ≠ global, FedAvg aggregation with server lr 1: the
  new global model, the gathered new state and an independent eager MOON client agree."""
  mu = 2.0
  algorithm = learning.build_moon(SPEC, num_clients=4, client_optimizer=_sgd(), mu=mu)
  process, state = start_process(algorithm)
  rng = np.random.default_rng(3)
  previous = [w + rng.normal(scale=0.3, size=w.shape).astype(np.float32)
              for w in algorithm.client_state_init()]
  (x, y), = _arrays((10,), seed=6)
  out = process.next(state, [learning.client_input(_datasets((10,), seed=6)[0], 3, 2,
                                                   client_state=previous)])
  new_states = _states(out)
  assert list(new_states) == [3]
  new_global = _trainable(process, out.state)
  for a, b in zip(new_global, new_states[3]):
    np.testing.assert_allclose(a, b, atol=1e-6)
  want = _reference_local_training(SPEC.initial_weights().trainable, previous, x, y, 2, mu)
  for a, b in zip(new_states[3], want):
    np.testing.assert_allclose(a, b, atol=1e-5)
  # The contrastive term mattered: plain FedAvg's client ends elsewhere.
  fedavg_client = _reference_local_training(SPEC.initial_weights().trainable, previous, x, y, 2,
                                            0.0)
  assert max(float(np.max(np.abs(a - b))) for a, b in zip(want, fedavg_client)) > 1e-3


def test_moon_compiles_to_mergeable_form_and_sends_what_fedavg_sends():
  algorithm = learning.build_moon(SPEC, num_clients=4)
  form = tff.backends.native.compile_to_mergeable_comp_form(algorithm.process.next)
  assert isinstance(form, tff.framework.MergeableCompForm)
  avg = learning.build_fedavg(SPEC)
  assert algorithm.bytes_down_per_client == avg.bytes_down_per_client
  assert algorithm.bytes_up_per_client == avg.bytes_up_per_client
  assert algorithm.has_client_state and algorithm.num_clients == 4


def test_moon_offline_twin_pipeline(tmp_path):
  out = tmp_path / 'moon'
  before = tagged_worker_pids()
  result = run_pipeline('--gin_file=gin_configs/kapc/offline_mnist1003_moon.gin',
                        '--gin_bindings=experiment.rounds = 2',
                        '--gin_bindings=experiment.local_epochs = 1', f'--output_dir={out}')
  assert result.returncode == 0, result.stderr[-3000:]
  assert not tagged_worker_pids() - before
  # The default executor ('auto') vectorises MOON's clients (equal to the C++ runtime:
  # tests/test_vectorized.py).
  assert 'moon runs on the in-process executor, vectorised clients.' in result.stdout
  rows = read_csv(os.path.join(out, 'metrics.csv'))
  assert [r['round'] for r in rows] == ['1', '2']
  for r in rows:
    assert 0.0 <= float(r['test_accuracy']) <= 1.0
    assert 0.0 <= float(r['global_local_accuracy']) <= 1.0
  summary = json.load(open(os.path.join(out, 'summary.json')))
  assert summary['method'] == 'moon'
  assert math.isfinite(summary['best_global_local_accuracy'])


def _bn_mlp():
  init = lambda i: tf.keras.initializers.GlorotUniform(seed=40 + i)
  inputs = tf.keras.Input((DIM,))
  h = tf.keras.layers.Dense(8, kernel_initializer=init(0))(inputs)
  h = tf.keras.layers.BatchNormalization(momentum=0.5)(h)
  h = tf.keras.layers.ReLU(name='latent')(h)
  return tf.keras.Model(inputs, tf.keras.layers.Dense(CLASSES, kernel_initializer=init(1))(h))


def test_latent_pass_leaves_batchnorm_statistics_to_the_forward_pass():
  """MOON's term reads the training pass's latent and the inference-mode latents of the fixed
  models: with μ = 0, local training ends with exactly the statistics of plain local
  training."""
  spec = ModelSpec(_bn_mlp, (DIM,), CLASSES)
  initial = spec.initial_weights()
  previous = [w + 0.2 for w in initial.trainable]
  info = tf.data.Dataset.from_tensors(collections.OrderedDict(client_index=np.int32(0),
                                                              epochs=np.int32(2)))
  outs = []
  for with_moon in (False, True):
    keras_model = spec.keras_fn()
    reg = None
    if with_moon:
      # As `client_state.build_stateful_client_work` builds it: the global statistics.
      apply = functional_apply(latent_model(keras_model), keras_model, batch_norm=True)
      reg = ModelContrastiveRegularizer(
          lambda w, x: apply(w, x, training=False, statistics=initial.non_trainable),
          previous, 0.0, TAU)
    outs.append(learning.build_local_training(keras_model, _sgd(), reg)(
        initial, _datasets((12,))[0], info))
  plain, moon = outs
  assert len(plain['non_trainable']) == 2
  for key in ('trained', 'non_trainable'):
    for a, b in zip(plain[key], moon[key]):
      np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)
  assert np.max(np.abs(plain['non_trainable'][0].numpy() - initial.non_trainable[0])) > 1e-3
