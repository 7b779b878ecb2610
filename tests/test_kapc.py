"""KAPC + BLS and the personalised baselines: equations vs NumPy, special cases, bytes, runs."""

import collections
import importlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from fltff import learning
from fltff.learning import ModelSpec
from helpers import REPO
from helpers import pipeline_env
from helpers import run_and_resume
from helpers import tiny_mlp

# The package exports the `kapc` builder under the module's name.
kapc_lib = importlib.import_module('fltff.personalization.kapc')
RNG = np.random.default_rng(5)
DIM, CLASSES, LR = 5, 3, 0.1
SPEC = ModelSpec(lambda: tiny_mlp(DIM, CLASSES, 23), (DIM,), CLASSES)
LAYER_OF = [0, 0, 1, 1]


def _np_normalize(r):
  r = np.maximum(r, 0)
  return r / r.sum(-1, keepdims=True)


def _models(p):
  return [RNG.normal(size=(p, *np.shape(w))).astype(np.float32)
          for w in SPEC.initial_weights().trainable]


def _relation(p, layers=2):
  return _np_normalize(RNG.uniform(size=(p, layers, p))).astype(np.float32)


def test_personalized_server_models_match_numpy():
  models, rel = _models(3), _relation(3)
  got = kapc_lib.personalized_server_models(tf.constant(rel), [tf.constant(m) for m in models],
                                            LAYER_OF)
  for t, (g, w) in enumerate(zip(got, models)):
    want = np.einsum('ij,j...->i...', rel[:, LAYER_OF[t], :], w)
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-6)


def test_relationship_gradient_matches_numpy_and_rows_stay_normalised():
  models, rel = _models(3), _relation(3)
  lam, beta = 0.7, 0.3
  r = tf.constant(rel)
  with tf.GradientTape() as tape:
    tape.watch(r)
    loss = kapc_lib.relationship_objective(r, [tf.constant(m) for m in models], LAYER_OF, lam,
                                           beta)
  grad = tape.gradient(loss, r).numpy()
  want = np.zeros_like(rel, np.float64)
  for l in range(2):
    flat = np.concatenate([models[t].reshape(3, -1) for t in range(4) if LAYER_OF[t] == l], 1)
    s = rel[:, l, :] @ flat
    # ∂/∂r_ij: 2λ <s_i − w_i, w_j> + β (r_ij − 1/P)
    want[:, l, :] = 2 * lam * (s - flat) @ flat.T + beta * (rel[:, l, :] - 1 / 3)
  np.testing.assert_allclose(grad, want, rtol=2e-4, atol=1e-3)
  updated = kapc_lib.update_relationship(r, [tf.constant(m) for m in models], LAYER_OF, lam,
                                         beta, 0.01, 3).numpy()
  np.testing.assert_allclose(updated.sum(-1), 1.0, atol=1e-6)
  assert updated.min() >= 0
  step = kapc_lib.update_relationship(r, [tf.constant(m) for m in models], LAYER_OF, lam,
                                      beta, 1e-4, 1).numpy()
  np.testing.assert_allclose(step, _np_normalize(rel - 1e-4 * want), atol=1e-5)


def test_slice_and_scatter_keep_full_rows_normalised():
  n = 6
  full = _relation(n)
  clients = np.array([4, 1, 3], np.int32)
  sl = kapc_lib.slice_relationship(tf.constant(full), tf.constant(clients)).numpy()
  np.testing.assert_allclose(sl, full[clients][:, :, clients])
  new = _relation(3)
  out = kapc_lib.scatter_relationship(tf.constant(full), tf.constant(clients),
                                      tf.constant(new)).numpy()
  np.testing.assert_allclose(out.sum(-1), 1.0, atol=1e-6)
  others = [k for k in range(n) if k not in clients]
  np.testing.assert_allclose(out[others], full[others])               # Non-participants' rows.
  for p, i in enumerate(clients):
    mass = full[i][:, clients].sum(-1, keepdims=True)
    np.testing.assert_allclose(out[i][:, clients], new[p] * mass, rtol=1e-5)
    rest = [k for k in range(n) if k not in clients]
    np.testing.assert_allclose(out[i][:, rest], full[i][:, rest], rtol=1e-5)


def test_attentive_relationship_matches_fedamp_formula():
  models = _models(3)
  xi = kapc_lib.attentive_relationship([tf.constant(m) for m in models], 2, 5.0, 0.2).numpy()
  flat = np.concatenate([m.reshape(3, -1) for m in models], 1).astype(np.float64)
  d = ((flat[:, None] - flat[None]) ** 2).sum(-1)
  off = 0.2 * np.exp(-d / 5.0) / 5.0
  np.fill_diagonal(off, 0)
  want = off + np.diag(1 - off.sum(1))
  np.testing.assert_allclose(xi[:, 0], _np_normalize(want), rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(xi[:, 1], xi[:, 0])


# --- the process ------------------------------------------------------------------------------
def _datasets(sizes, seed):
  rng = np.random.default_rng(seed)
  return [tf.data.Dataset.from_tensor_slices(collections.OrderedDict(
      x=rng.normal(size=(n, DIM)).astype(np.float32),
      y=rng.integers(0, CLASSES, n).astype(np.int32))).batch(4) for n in sizes]


class Sim:
  """A minimal personalised-process loop (the driver's logic, without files)."""

  def __init__(self, algorithm, num_clients):
    self.algorithm = algorithm
    self.states = {k: algorithm.new_client_state() for k in range(num_clients)}
    self.state = algorithm.process.initialize()

  def models(self, k):
    return self.states[k]['model']['trainable']

  def copies(self, k):
    return self.states[k]['server_copy']

  def round(self, clients, datasets, epochs=1):
    inputs = [self.algorithm.client_input(d, k, epochs, self.states[k])
              for k, d in zip(clients, datasets)]
    server_input = self.algorithm.server_input(clients, [self.states[k] for k in clients],
                                               [8.0] * len(clients))
    out = self.algorithm.process.next(self.state, server_input, inputs)
    self.state = out.state
    self.states.update(self.algorithm.next_client_states(out.result, self.states.get))
    return out


def _sgd():
  return tff.learning.optimizers.build_sgdm(learning_rate=LR)


def test_identity_relationship_is_local_training_with_proximal_term_to_own_model():
  """R fixed to the identity: s_i = w_i's previous model, so each client runs FedProx(μ = 2λ)
  towards its own previous model — checked against our FedProx on that client alone."""
  lam = 0.3
  algorithm = kapc_lib.build_personalized_process(
      SPEC, 3, _sgd(), rule='fixed', lambda_=lam, relationship_init='identity')
  sim = Sim(algorithm, 3)
  prox = learning.fedprox(SPEC, client_optimizer=_sgd(), mu=2 * lam)
  for r in range(2):
    data = _datasets((8, 12, 6), seed=r)
    before = {k: list(sim.models(k)) for k in range(3)}
    sim.round([0, 1, 2], data, epochs=2)
    for k in range(3):
      state = prox.process.set_model_weights(
          prox.process.initialize(),
          tff.learning.models.ModelWeights(trainable=before[k], non_trainable=[]))
      out = prox.process.next(state, [learning.client_input(data[k], k, 2)])
      for a, b in zip(prox.process.get_model_weights(out.state).trainable, sim.models(k)):
        np.testing.assert_allclose(a, b, atol=1e-5)
  np.testing.assert_allclose(np.asarray(sim.state['relation']),
                             kapc_lib.initial_relationship(3, 2, 'identity'))


def test_bls_with_mu_above_one_and_full_upload_equals_kapc():
  plain = Sim(kapc_lib.kapc(SPEC, 4, client_optimizer=_sgd()), 4)
  bls = Sim(kapc_lib.kapc(SPEC, 4, client_optimizer=_sgd(), bls_mu=1.5, min_upload_layers=2),
            4)
  for r, clients in enumerate(([0, 1, 2, 3], [1, 3], [0, 2, 3])):
    data = _datasets([8] * len(clients), seed=10 + r)
    a, b = plain.round(clients, data), bls.round(clients, _datasets([8] * len(clients),
                                                                   seed=10 + r))
    np.testing.assert_allclose(a.result['bytes_up'], b.result['bytes_up'])
  for k in range(4):
    for x, y in zip(plain.models(k), bls.models(k)):
      np.testing.assert_allclose(x, y, atol=1e-6)
  np.testing.assert_allclose(plain.state['relation'], bls.state['relation'], atol=1e-6)
  relation = np.asarray(plain.state['relation'])
  np.testing.assert_allclose(relation.sum(-1), 1.0, atol=1e-5)      # Rows stay normalised.
  assert np.abs(relation - 0.25).max() > 1e-4                        # R was learned.


def test_byte_counts_equal_the_tensors_exchanged():
  algorithm = kapc_lib.kapc(SPEC, 3, client_optimizer=_sgd(), bls_mu=0.5, bls_kappa=0.0)
  sim = Sim(algorithm, 3)
  sizes = [sum(np.asarray(w).nbytes for w in SPEC.initial_weights().trainable[t:t + 2])
           for t in (0, 2)]
  assert algorithm.layer_sizes_bytes == sizes
  for r in range(3):
    out = sim.round([0, 1, 2], _datasets((8, 8, 8), seed=r))
    rel = np.asarray(out.measurements['kapc']['self_relation_mean'])
    assert np.isfinite(rel)
    omega = np.asarray(out.result['omega'])
    # κ = 0: the bound is the bias term alone, which grows with Ω: every client uploads Ω = 1.
    np.testing.assert_array_equal(omega, 1)
    np.testing.assert_allclose(out.result['bytes_up'], [sizes[0]] * 3)
  # Round 1: R uniform (r_ii = 1/3 ≤ 0.5): every layer is sent.
  sim2 = Sim(algorithm, 3)
  out = sim2.round([0, 1, 2], _datasets((8, 8, 8), seed=0))
  np.testing.assert_allclose(out.result['bytes_down'], [sum(sizes)] * 3)
  # Layers not uploaded keep the server's stale copy.
  np.testing.assert_allclose(sim2.copies(0)[2], SPEC.initial_weights().trainable[2])
  assert np.abs(sim2.copies(0)[0] - SPEC.initial_weights().trainable[0]).max() > 1e-4
  # ... and the server's R step used exactly those copies (uniform R, all clients: the slice
  # is the whole cube, so R⁺ = one projected step from 1/3 on the copies the driver keeps).
  stacked = [tf.constant(np.stack([sim2.copies(k)[t] for k in range(3)])) for t in range(4)]
  want = kapc_lib.update_relationship(
      tf.constant(kapc_lib.initial_relationship(3, 2, 'uniform')), stacked,
      algorithm.tensor_layers, 0.5, 0.1, 0.01, 1)
  np.testing.assert_allclose(sim2.state['relation'], want.numpy(), atol=1e-6)
  # μ = 0 skips every layer once r_ii > 0: nothing is sent down.
  skip_all = Sim(kapc_lib.kapc(SPEC, 3, client_optimizer=_sgd(), bls_mu=0.0), 3)
  out = skip_all.round([0, 1, 2], _datasets((8, 8, 8), seed=0))
  np.testing.assert_allclose(out.result['bytes_down'], 0.0)
  local = Sim(kapc_lib.local_training(SPEC, 3, client_optimizer=_sgd()), 3)
  out = local.round([0, 1, 2], _datasets((8, 8, 8), seed=0))
  np.testing.assert_allclose(out.result['bytes_down'], 0.0)
  np.testing.assert_allclose(out.result['bytes_up'], 0.0)


def test_fedbn_without_norm_layers_equals_fedavg():
  """All clients, no normalisation layers: every personal model is FedAvg's local model of
  the next round's start — here: the server aggregate equals FedAvg's global model."""
  fedbn = Sim(kapc_lib.fedbn(SPEC, 3, client_optimizer=_sgd()), 3)
  avg = learning.fedavg(SPEC, client_optimizer=_sgd())
  state = avg.process.set_model_weights(avg.process.initialize(), SPEC.initial_weights())
  for r in range(2):
    fedbn.round([0, 1, 2], _datasets((8, 8, 8), seed=r))
    state = avg.process.next(state, [learning.client_input(d, k, 1) for k, d in
                                     enumerate(_datasets((8, 8, 8), seed=r))]).state
  # FedBN's clients start round 3 from r_i · W = the sample-weighted mean of their models.
  mean = [np.mean([fedbn.copies(k)[t] for k in range(3)], axis=0) for t in range(4)]
  for a, b in zip(avg.process.get_model_weights(state).trainable, mean):
    np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize('builder', ['kapc', 'fedamp', 'fedbn'])
def test_personalized_processes_compile_to_mergeable_form(builder):
  kwargs = {'bls_mu': 0.5} if builder == 'kapc' else {}
  algorithm = getattr(kapc_lib, builder)(SPEC, 4, client_optimizer=_sgd(), **kwargs)
  form = tff.backends.native.compile_to_mergeable_comp_form(algorithm.process.next)
  assert isinstance(form, tff.framework.MergeableCompForm)


def test_kapc_pipeline_with_client_selection_channel_and_resume(tmp_path):
  args = ['--gin_file=gin_configs/kapc/offline_mnist1003_kapc_bls0.5.gin',
          '--gin_bindings=experiment.rounds = 4',
          '--gin_bindings=experiment.local_epochs = 1',
          '--gin_bindings=experiment.clients_per_round = 4',
          '--gin_bindings=experiment.checkpoint_every = 2']
  rows, resumed, stdout = run_and_resume(args, tmp_path, stop_round=2)
  full = tmp_path / 'full'
  assert 'final mean local accuracy' in stdout
  for row in rows:
    assert row['clients'] == '4'
    assert float(row['mean_local_accuracy']) > 0.2
    assert float(row['sim_round_seconds']) > float(row['sim_compute_seconds'])
  assert float(rows[-1]['mb_down_cumulative']) == pytest.approx(
      sum(int(r['bytes_down']) for r in rows) / 1e6)
  with open(os.path.join(full, 'summary.json')) as f:
    summary = json.load(f)
  assert summary['best_mean_local_accuracy'] == max(float(r['mean_local_accuracy'])
                                                    for r in rows)
  # R [10, 2, 10] float32 + one mlp2 copy (784·200 + 200 + 200·10 + 10 floats) per client.
  assert summary['server_memory_mb'] == pytest.approx((4 * 10 * 2 * 10 + 10 * 4 * 159010) / 1e6)
  assert [r['round'] for r in resumed] == [r['round'] for r in rows]
  for a, b in zip(resumed, rows):
    assert abs(float(a['mean_local_accuracy']) - float(b['mean_local_accuracy'])) < 1e-6
    assert a['bytes_up'] == b['bytes_up']
  # The report's pFL tables and the relationship heatmap.
  report = subprocess.run(
      [sys.executable, '-m', 'pipelines.report', '--personalized', f'--runs={full}',
       f'--out={tmp_path / "report"}', '--heatmap_client=1'], cwd=REPO, env=pipeline_env(),
      capture_output=True, text=True, timeout=120)
  assert report.returncode == 0, report.stderr[-2000:]
  lines = open(tmp_path / 'report' / 'report.md').read().splitlines()
  best = [c.strip() for c in lines[2].strip('|').split('|')]
  assert best[1] == f'{summary["best_mean_local_accuracy"]:.4f} ({summary["best_mean_local_round"]})'
  comm = [c.strip() for c in lines[6].strip('|').split('|')]
  assert float(comm[1]) == pytest.approx(summary['mb_up_total'], abs=0.01)
  assert float(comm[2]) == pytest.approx(summary['mb_down_total'], abs=0.01)
  timing = [c.strip() for c in lines[10].strip('|').split('|')]
  assert float(timing[5]) == pytest.approx(summary['sim_round_seconds_mean'], rel=1e-3)
  relation = np.load(full / 'relationship.npy')
  assert relation.shape == (10, 2, 10)  # mlp2: two dense layers.
  np.testing.assert_allclose(relation.sum(-1), 1.0, atol=1e-5)
  assert os.path.getsize(tmp_path / 'report' / f'relationship_{full.name}_client1.png') > 1000
