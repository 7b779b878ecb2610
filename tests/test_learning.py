"""FedAvg / FedProx / SGDM against TFF's built-ins and a NumPy simulation."""

import collections

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from fltff import learning
from fltff.errors import ConfigError
from fltff.learning import ModelSpec
from fltff.learning import optimizers
from helpers import start_process
from helpers import tiny_mlp

DIM, CLASSES, BATCH = 6, 3, 5
CLIENT_SIZES = (10, 15, 20)


def _logistic_keras(seed=3):
  inputs = tf.keras.Input((DIM,))
  outputs = tf.keras.layers.Dense(
      CLASSES, kernel_initializer=tf.keras.initializers.GlorotUniform(seed=seed),
      bias_initializer=tf.keras.initializers.RandomNormal(stddev=0.1, seed=seed + 1))(inputs)
  return tf.keras.Model(inputs, outputs)


def _mlp_keras(seed=5):
  return tiny_mlp(DIM, CLASSES, seed)


def _client_arrays(seed=0, sizes=CLIENT_SIZES):
  rng = np.random.default_rng(seed)
  out = []
  for n in sizes:
    x = rng.normal(size=(n, DIM)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=n).astype(np.int32)
    out.append((x, y))
  return out


def _batches(x, y):
  return tf.data.Dataset.from_tensor_slices(collections.OrderedDict(x=x, y=y)).batch(BATCH)


def _max_abs_diff(a, b):
  return max(float(np.max(np.abs(np.asarray(u) - np.asarray(v)))) for u, v in zip(a, b))


def _run_ours(algorithm, data, epochs, rounds=2, return_metrics=False):
  process = algorithm.process
  state = process.initialize()
  state = process.set_model_weights(state, algorithm.model_spec.initial_weights())
  for _ in range(rounds):
    inputs = [learning.client_input(_batches(x, y), i, epochs) for i, (x, y) in enumerate(data)]
    output = process.next(state, inputs)
    state = output.state
  weights = process.get_model_weights(state).trainable
  if return_metrics:
    return weights, output.metrics['client_work']['train']
  return weights


@pytest.mark.parametrize('epochs', [1, 2])
def test_fedavg_equals_tff_weighted_fed_avg(epochs):
  spec = ModelSpec(_mlp_keras, (DIM,), CLASSES)
  data = _client_arrays()
  client_opt = optimizers.sgdm(learning_rate=0.1, momentum=0.9)
  ours, metrics = _run_ours(learning.build_fedavg(spec, client_optimizer=client_opt), data, epochs,
                           return_metrics=True)

  tff_process = tff.learning.algorithms.build_weighted_fed_avg(
      model_fn=spec.tff_model,
      client_optimizer_fn=client_opt,
      server_optimizer_fn=optimizers.sgdm(learning_rate=1.0))
  state = tff_process.initialize()
  state = tff_process.set_model_weights(state, spec.initial_weights())
  for _ in range(2):
    output = tff_process.next(state, [_batches(x, y).repeat(epochs) for x, y in data])
    state = output.state
  reference = tff_process.get_model_weights(state).trainable
  assert _max_abs_diff(ours, reference) <= 1e-5
  tff_metrics = output.metrics['client_work']['train']
  assert metrics['loss'] == pytest.approx(tff_metrics['loss'], abs=1e-5)
  assert metrics['accuracy'] == pytest.approx(tff_metrics['accuracy'], abs=1e-6)
  assert metrics['num_examples'] == tff_metrics['num_examples'] == epochs * sum(CLIENT_SIZES)
  # And training actually moved the model.
  assert _max_abs_diff(ours, spec.initial_weights().trainable) > 1e-2


def _numpy_fedprox(data, w0, b0, mu, lr, epochs, rounds, uniform=False):
  """Plain NumPy FedProx on multinomial logistic regression with local SGD (`uniform`: the
  paper's unweighted mean of the clients' models instead of the n_k-weighted one)."""
  w, b = w0.copy(), b0.copy()
  for _ in range(rounds):
    new, weights = [], []
    for x, y in data:
      wl, bl = w.copy(), b.copy()
      for _ in range(epochs):
        for s in range(0, len(x), BATCH):
          xb, yb = x[s:s + BATCH], y[s:s + BATCH]
          logits = xb @ wl + bl
          p = np.exp(logits - logits.max(axis=1, keepdims=True))
          p /= p.sum(axis=1, keepdims=True)
          p[np.arange(len(yb)), yb] -= 1.0
          gw = xb.T @ p / len(yb) + mu * (wl - w)
          gb = p.mean(axis=0) + mu * (bl - b)
          wl, bl = wl - lr * gw, bl - lr * gb
      new.append((wl, bl))
      weights.append(1 if uniform else len(x))
    total = float(sum(weights))
    w = sum(n / total * wl for n, (wl, _) in zip(weights, new))
    b = sum(n / total * bl for n, (_, bl) in zip(weights, new))
  return w, b


@pytest.mark.parametrize('mu', [0.0, 0.5])
def test_fedprox_equals_numpy_simulation(mu):
  spec = ModelSpec(_logistic_keras, (DIM,), CLASSES)
  data = _client_arrays(seed=1)
  lr, epochs = 0.2, 2
  algorithm = learning.build_fedprox(
      spec, mu=mu, client_optimizer=optimizers.sgdm(learning_rate=lr))
  ours = _run_ours(algorithm, data, epochs)
  w0, b0 = spec.initial_weights().trainable
  ref_w, ref_b = _numpy_fedprox(data, w0.astype(np.float64), b0.astype(np.float64), mu, lr,
                                epochs, rounds=2)
  assert _max_abs_diff(ours, [ref_w, ref_b]) <= 1e-5


def test_fedprox_mu_zero_equals_fedavg():
  spec = ModelSpec(_mlp_keras, (DIM,), CLASSES)
  data = _client_arrays(seed=2)
  opt = optimizers.sgdm(learning_rate=0.05, momentum=0.9)
  prox = _run_ours(learning.build_fedprox(spec, mu=0.0, client_optimizer=opt), data, 2)
  avg = _run_ours(learning.build_fedavg(spec, client_optimizer=opt), data, 2)
  assert _max_abs_diff(prox, avg) <= 1e-6


def test_fedprox_pulls_towards_global_model():
  """Large μ keeps clients near the global model (TFF 0.87's sign error pushes them away)."""
  spec = ModelSpec(_mlp_keras, (DIM,), CLASSES)
  data = _client_arrays(seed=3)
  opt = optimizers.sgdm(learning_rate=0.1, momentum=0.9)
  start = spec.initial_weights().trainable
  moved_avg = _max_abs_diff(_run_ours(learning.build_fedavg(spec, client_optimizer=opt), data, 2), start)
  moved_prox = _max_abs_diff(
      _run_ours(learning.build_fedprox(spec, mu=5.0, client_optimizer=opt), data, 2), start)
  assert moved_prox < 0.5 * moved_avg


@pytest.mark.parametrize('anchored', [False, True])
def test_proximal_regularizer_penalty_and_gradient(anchored):
  """μ/2 Σ_t m_t ||w_t − a_t||² against NumPy; the closed-form gradient equals the taped one.
  Anchored with a mask is KAPC's client term (a = s_i, m_t = 0 for BLS-skipped layers)."""
  rng = np.random.default_rng(0)
  local = [rng.normal(size=s).astype(np.float32) for s in ((4, 3), (3,))]
  glob = [rng.normal(size=w.shape).astype(np.float32) for w in local]
  anchor = [rng.normal(size=w.shape).astype(np.float32) for w in local]
  mask = [1.0, 0.0] if anchored else [1.0, 1.0]
  reg = learning.ProximalRegularizer(
      0.7, anchor=[tf.constant(a) for a in anchor] if anchored else None,
      tensor_mask=[tf.constant(m) for m in mask] if anchored else None)
  target = anchor if anchored else glob
  want = 0.35 * sum(m * np.sum((w - a) ** 2) for w, a, m in zip(local, target, mask))
  variables = [tf.Variable(w) for w in local]
  with tf.GradientTape() as tape:
    penalty = reg.penalty(variables, [tf.constant(g) for g in glob], ())
  np.testing.assert_allclose(penalty.numpy(), want, rtol=1e-5)
  taped = tape.gradient(penalty, variables)
  closed = reg.gradient([v.read_value() for v in variables], [tf.constant(g) for g in glob], ())
  scales, offsets = reg.affine_gradient([tf.constant(g) for g in glob], ())
  for a, b, w, t, m, s, o in zip(taped, closed, local, target, mask, scales, offsets):
    np.testing.assert_allclose(b.numpy(), 0.7 * m * (w - t), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-7)
    # The form the local loop uses: scale · w + offset.
    np.testing.assert_allclose(np.asarray(s) * w + np.asarray(o), b.numpy(), rtol=1e-5,
                               atol=1e-6)


def test_sgdm_server_momentum_matches_numpy():
  """SGDM: v ← βv + Δ, w ← w − η v, Δ the FedAvg delta; checked over 3 rounds against FedAvg."""
  spec = ModelSpec(_logistic_keras, (DIM,), CLASSES)
  data = _client_arrays(seed=4)
  lr, beta, eta = 0.1, 0.5, 1.0
  opt = optimizers.sgdm(learning_rate=lr)
  ours = _run_ours(learning.build_sgdm(spec, server_learning_rate=eta, server_momentum=beta,
                                 client_optimizer=opt), data, 1, rounds=3)
  # Reference: NumPy FedAvg deltas (FedProx with mu=0) combined with server momentum.
  w, b = [a.astype(np.float64) for a in spec.initial_weights().trainable]
  vw, vb = np.zeros_like(w), np.zeros_like(b)
  for _ in range(3):
    aw, ab = _numpy_fedprox(data, w, b, 0.0, lr, 1, rounds=1)
    vw, vb = beta * vw + (w - aw), beta * vb + (b - ab)
    w, b = w - eta * vw, b - eta * vb
  assert _max_abs_diff(ours, [w, b]) <= 1e-5


def _trained_alone(process, state, data, epochs):
  """Each client's trained model: a round with that client as the only participant (its
  update is applied whole by the server step of learning rate 1)."""
  return [process.get_model_weights(process.next(
      state, [learning.client_input(_batches(x, y), 0, epochs)]).state).trainable
          for x, y in data]


def test_uniform_fedavg_equals_tff_unweighted_fed_avg_and_numpy_mean():
  """Unequal client sizes: 'uniform' is TFF's unweighted FedAvg and the plain mean of the
  clients' trained models, and differs from the n_k-weighted mean."""
  spec = ModelSpec(_mlp_keras, (DIM,), CLASSES)
  data = _client_arrays(seed=5)
  client_opt = optimizers.sgdm(learning_rate=0.1, momentum=0.9)
  algorithm = learning.build_fedavg(spec, client_optimizer=client_opt, client_weighting='uniform')
  process, state = start_process(algorithm)
  inputs = [learning.client_input(_batches(x, y), i, 2) for i, (x, y) in enumerate(data)]
  ours = process.get_model_weights(process.next(state, inputs).state).trainable

  tff_process = tff.learning.algorithms.build_unweighted_fed_avg(
      model_fn=spec.tff_model,
      client_optimizer_fn=client_opt,
      server_optimizer_fn=optimizers.sgdm(learning_rate=1.0))
  tff_state = tff_process.set_model_weights(tff_process.initialize(), spec.initial_weights())
  tff_state = tff_process.next(tff_state, [_batches(x, y).repeat(2) for x, y in data]).state
  assert _max_abs_diff(ours, tff_process.get_model_weights(tff_state).trainable) <= 1e-5

  alone = _trained_alone(process, state, data, 2)
  mean = [np.mean([np.asarray(m[i]) for m in alone], axis=0) for i in range(len(ours))]
  assert _max_abs_diff(ours, mean) <= 1e-5
  sizes = np.asarray(CLIENT_SIZES, np.float64)
  weighted = [np.tensordot(sizes / sizes.sum(), [np.asarray(m[i]) for m in alone], axes=1)
              for i in range(len(ours))]
  assert _max_abs_diff(mean, weighted) > 1e-3  # The sizes matter: the test can tell.


def test_uniform_equals_num_examples_for_equal_client_sizes():
  spec = ModelSpec(_mlp_keras, (DIM,), CLASSES)
  data = _client_arrays(seed=6, sizes=(15, 15, 15))
  opt = optimizers.sgdm(learning_rate=0.1, momentum=0.9)
  uniform = _run_ours(learning.build_fedavg(spec, client_optimizer=opt, client_weighting='uniform'),
                      data, 1, rounds=1)
  weighted = _run_ours(learning.build_fedavg(spec, client_optimizer=opt), data, 1, rounds=1)
  assert _max_abs_diff(uniform, weighted) <= 1e-6


def test_uniform_fedprox_equals_numpy_unweighted_mean():
  """FedProx's Algorithm 2: w^{t+1} = 1/|S_t| Σ_k w_k^{t+1} (unequal client sizes)."""
  spec = ModelSpec(_logistic_keras, (DIM,), CLASSES)
  data = _client_arrays(seed=7)
  lr, epochs, mu = 0.2, 2, 0.5
  algorithm = learning.build_fedprox(spec, mu=mu, client_weighting='uniform',
                               client_optimizer=optimizers.sgdm(learning_rate=lr))
  ours = _run_ours(algorithm, data, epochs, rounds=1)
  w0, b0 = [a.astype(np.float64) for a in spec.initial_weights().trainable]
  uniform = _numpy_fedprox(data, w0, b0, mu, lr, epochs, rounds=1, uniform=True)
  weighted = _numpy_fedprox(data, w0, b0, mu, lr, epochs, rounds=1)
  assert _max_abs_diff(ours, uniform) <= 1e-5
  assert _max_abs_diff(uniform, weighted) > 1e-3


@pytest.mark.parametrize('builder', ['fedavg', 'fedprox', 'fedlap'])
def test_unknown_client_weighting_is_a_one_line_config_error(builder):
  spec = ModelSpec(_mlp_keras, (DIM,), CLASSES)
  with pytest.raises(ConfigError) as error:
    getattr(learning, f'build_{builder}')(spec, client_weighting='equal')
  # One line of ours; gin appends its 'In call to configurable ...' context (pipelines.run
  # drops it).
  lines = [l for l in str(error.value).splitlines()
           if l.strip() and not l.strip().startswith('In call to configurable')]
  assert len(lines) == 1, lines
  assert all(f"'{name}'" in lines[0] for name in ('num_examples', 'uniform', 'equal')), lines


def test_bytes_from_types():
  spec = ModelSpec(_mlp_keras, (DIM,), CLASSES)
  algorithm = learning.build_fedavg(spec)
  num_params = DIM * 8 + 8 + 8 * CLASSES + CLASSES
  assert algorithm.bytes_down_per_client == 4 * num_params
  # Update (same shapes as the trainable weights) plus one float32 weight.
  assert algorithm.bytes_up_per_client == 4 * num_params + 4


def _regularizers():
  from fltff.learning import fedlap  # pylint: disable=g-import-not-at-top
  from fltff.learning import moon  # pylint: disable=g-import-not-at-top
  from fltff.learning import regularizers  # pylint: disable=g-import-not-at-top
  from fltff.learning import scaffold  # pylint: disable=g-import-not-at-top

  anchor = [tf.zeros([2])]
  return {
      'fedprox': regularizers.ProximalRegularizer(0.1),
      'kapc': regularizers.ProximalRegularizer(0.1, anchor=anchor, tensor_mask=[1.0]),
      'fedlap_epoch': fedlap.FedLapRegularizer(refresh='epoch'),
      'fedlap_step': fedlap.FedLapRegularizer(refresh='step'),
      'scaffold': scaffold.ControlVariateCorrection(anchor),
      'moon': moon.ModelContrastiveRegularizer(lambda *a, **k: None, anchor, 1.0, 0.5),
  }


@pytest.mark.parametrize('name', sorted(_regularizers()))
def test_each_regularizer_declares_exactly_what_it_has(name):
  from fltff.learning.client_work import traits_of  # pylint: disable=g-import-not-at-top

  regularizer = _regularizers()[name]
  traits = regularizer.traits if isinstance(regularizer, type) else traits_of(regularizer)
  assert traits.analytic == hasattr(regularizer, 'gradient')
  # FedLap's class has the affine form of its per-epoch mode; per step (λ follows the
  # weights) it does not declare it.
  assert traits.affine == (hasattr(regularizer, 'affine_gradient') and name != 'fedlap_step')
  assert traits.own_anchor == hasattr(regularizer, 'offset_anchor')
  assert traits.batch_term == hasattr(regularizer, 'batch_penalty')
  assert traits.measures == hasattr(regularizer, 'measurements')
  # Where the offsets are −scale ⊙ global, the affine gradient says so.
  assert traits.global_anchor == (name in ('fedprox', 'fedlap_epoch'))
  assert traits.per_tensor_scales == (name in ('fedprox', 'kapc'))


def test_regularizer_traits_refuse_what_cannot_be_and_default_to_the_penalty():
  from fltff.learning import client_work  # pylint: disable=g-import-not-at-top

  with pytest.raises(ValueError, match='analytic'):
    client_work.RegularizerTraits(affine=True)
  with pytest.raises(ValueError, match='batch term'):
    client_work.RegularizerTraits(reads_latent=True)

  class Own:  # A user's regulariser declaring nothing: its penalty is differentiated.
    def epoch_start(self, local, global_):
      return ()

    def penalty(self, local, global_, context):
      return tf.add_n([tf.reduce_sum(w) for w in local])

  assert client_work.traits_of(Own()) is client_work.PENALTY_ONLY
  assert client_work.traits_of(None) is None


@pytest.mark.parametrize('names', [(), ('client_index',), ('latent_mean',),
                                   ('local_steps', 'client_index', 'latent_mean')])
def test_client_result_type_is_the_traced_client_works(spec, names):
  """`build_algorithm` creates the aggregator from `client_result_type` without tracing the
  client work: it must be the type the client work returns, statistics in the declared order."""
  from fltff.aggregators import contribution_normalization as ccn  # pylint: disable=g-import-not-at-top
  from fltff.learning import client_work  # pylint: disable=g-import-not-at-top

  known = {s.name: s for s in (client_work.CLIENT_INDEX, ccn.LATENT_MEAN, ccn.LOCAL_STEPS)}
  statistics = [known[name] for name in names]
  work = client_work.build_client_work(spec, optimizers.sgdm(0.1), client_statistics=statistics)
  result_type = client_work.client_result_type(spec, statistics)
  assert result_type == work.next.type_signature.result.result.member
  if names:
    assert [name for name, _ in tff.structure.iter_elements(result_type.update_weight)] == [
        'num_examples', *names]


def test_a_specs_model_facts_come_from_one_built_model(spec):
  """`ModelSpec`'s weights type, batch type, trainable specs, unfinalized-metric specs, metric
  finalizers and architecture fingerprint are those of a freshly built TFF model, read off one model built once
  per spec (each process builder asks for them)."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  from fltff.learning.model_spec import architecture_fingerprint  # pylint: disable=g-import-not-at-top

  built = []
  counted = dataclasses.replace(spec, keras_fn=lambda: built.append(1) or spec.keras_fn())
  with tf.Graph().as_default():
    model = spec.tff_model()
    expected = dict(
        weights_type=tff.learning.models.weights_type_from_model(model),
        element_type=tff.types.tensorflow_to_type(model.input_spec),
        trainable_specs=[tf.TensorSpec(v.shape, v.dtype) for v in model.trainable_variables],
        unfinalized=tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype),
                                          model.report_local_unfinalized_metrics()),
        finalizers=list(model.metric_finalizers()))
  assert counted.weights_type() == expected['weights_type']
  assert counted.element_type() == expected['element_type']
  assert counted.trainable_specs() == expected['trainable_specs']
  assert counted.unfinalized_metric_specs() == expected['unfinalized']
  assert list(counted.metric_finalizers()) == expected['finalizers']
  assert counted.architecture() == architecture_fingerprint(spec.keras_fn())
  assert built == [1]
  assert counted.weights_type() is counted.weights_type() and built == [1]


@pytest.mark.parametrize('name, momentum', [('sgd', None), ('sgdm', 0.9)])
def test_weight_decay_steps_on_the_decayed_gradient_as_numpy(name, momentum):
  from fltff.learning.optimizers import build_optimizer  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(0)
  w = [rng.normal(size=(3, 2)).astype(np.float32), rng.normal(size=2).astype(np.float32)]
  grads = [[rng.normal(size=x.shape).astype(np.float32) for x in w] for _ in range(3)]
  optimizer = build_optimizer(name, 0.1, momentum or 0.9, weight_decay=1e-2)
  state = optimizer.initialize([tf.TensorSpec(x.shape, tf.float32) for x in w])
  weights, expected = [tf.constant(x) for x in w], [x.astype(np.float64) for x in w]
  accumulators = [np.zeros_like(x) for x in expected]
  for g in grads:
    state, weights = optimizer.next(state, weights, [tf.constant(x) for x in g])
    for i, x in enumerate(expected):
      step = g[i] + 1e-2 * x  # PyTorch's SGD weight_decay: the decay joins the gradient.
      if momentum:
        accumulators[i] = momentum * accumulators[i] + step
        step = accumulators[i]
      expected[i] = x - 0.1 * step
  for got, want in zip(weights, expected):
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5)
  with pytest.raises(ConfigError, match='client_optimizer.weight_decay must be >= 0'):
    build_optimizer('sgd', 0.1, weight_decay=-1.0, role='client_optimizer')


@pytest.mark.parametrize('name, binding', [('sgd', 'momentum = 0.5'), ('sgdm', 'beta_1 = 0.8'),
                                           ('adam', 'momentum = 0.99')])
def test_an_optimizer_setting_the_named_optimizer_does_not_use_is_refused(name, binding):
  import gin  # pylint: disable=g-import-not-at-top
  from fltff.learning import optimizers  # pylint: disable=g-import-not-at-top

  gin.clear_config()
  try:  # Silently ignored before: SGD with `momentum = 0.5` stepped as plain SGD.
    gin.parse_config(f"client_optimizer.name = '{name}'\nclient_optimizer.{binding}")
    with pytest.raises(ConfigError, match=rf'client_optimizer\.{binding} has no effect with '
                                          rf"client_optimizer\.name = '{name}'"):
      optimizers.client_optimizer()
    # A run's config.gin binds every parameter, unused ones at their defaults: accepted.
    gin.parse_config('client_optimizer.momentum = 0.9\nclient_optimizer.beta_1 = 0.9\n'
                     'client_optimizer.beta_2 = 0.999\nclient_optimizer.epsilon = 1e-07\n'
                     f"server_optimizer.name = '{name}'")
    assert optimizers.client_optimizer() is not None
    assert optimizers.server_optimizer() is not None
  finally:
    gin.clear_config()
