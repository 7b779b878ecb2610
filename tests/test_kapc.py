"""KAPC + BLS and the personalised baselines: equations vs NumPy, special cases, bytes, runs."""

import collections
import json
import os

import gin
import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from fltff import learning
from fltff.errors import ConfigError
from fltff.learning import ModelSpec
from fltff.personalization import bls as bls_lib
from fltff.simulation import driver as driver_lib
from helpers import REPO
from helpers import random_client_datasets
from helpers import run_and_resume
from helpers import tiny_mlp
from launcher import run_program

from fltff.personalization import fedamp as fedamp_lib
from fltff.personalization import fedbn as fedbn_lib
from fltff.personalization import kapc as kapc_lib
from fltff.personalization import local as local_lib
from fltff.personalization import process as process_lib
from fltff.personalization.process import personalized_server_models
from fltff.learning import optimizers
RNG = np.random.default_rng(5)
DIM, CLASSES, LR = 5, 3, 0.1
SPEC = ModelSpec(lambda: tiny_mlp(DIM, CLASSES, 23), (DIM,), CLASSES)
LAYER_OF = [0, 0, 1, 1]


def _layer_squares(differences, layer_of):
  """`[P, L]` sums of squares per participant and layer of `differences` (each `[P, ...]`)."""
  per_tensor = [tf.reduce_sum(tf.reshape(tf.square(d), [tf.shape(d)[0], -1]), axis=1)
                for d in differences]
  return tf.stack([tf.add_n([q for q, l in zip(per_tensor, layer_of) if l == layer])
                   for layer in range(max(layer_of) + 1)], axis=1)


def relationship_objective(relation, models, layer_of, lambda_, beta, coaching_loss='norm'):
  """The oracle the R step's gradients are checked against (by autodiff): KAPC Eq. (11) summed
  over i, `Σ_i [λ Σ_l f_s(s_i^l(R), w_i^l) + β/2 Σ_l ||r_i^l − 1/P||²]`; f_s the L2 norm of
  `s_i^l − w_i^l` over the layer's tensors (`'norm'`, §4.2) or its square."""
  s = personalized_server_models(relation, models, layer_of)
  squares = _layer_squares([a - w for a, w in zip(s, models)], layer_of)
  fit = tf.reduce_sum(tf.sqrt(squares) if coaching_loss == 'norm' else squares)
  num = tf.cast(tf.shape(relation)[-1], relation.dtype)
  return lambda_ * fit + 0.5 * beta * tf.reduce_sum(tf.square(relation - 1.0 / num))


def _np_normalize(r):
  r = np.maximum(r, 0)
  return r / r.sum(-1, keepdims=True)


def _models(p):
  return [RNG.normal(size=(p, *np.shape(w))).astype(np.float32)
          for w in SPEC.initial_weights().trainable]


def _relation(p, layers=2):
  return _np_normalize(RNG.uniform(size=(p, layers, p))).astype(np.float32)


def _np_flat(models, layer):
  """Layer `layer` of stacked models `[P, ...]` as `[P, size]` (float64)."""
  return np.concatenate([np.reshape(m, (np.shape(m)[0], -1)) for m, l in zip(models, LAYER_OF)
                         if l == layer], 1).astype(np.float64)


def _np_relationship_gradient(r, flats, lam, beta, coaching_loss='norm'):
  """KAPC's R gradient (Eqs. (12)–(13)) in NumPy, per layer l with `d_i = s_i − w_i`:
  'norm' (f_s = ||·||, §4.2): λ <d_i, w_j> / ||d_i|| (0 where d_i = 0) + β (r_ij − 1/P);
  'squared': 2λ <d_i, w_j> + β (r_ij − 1/P).

  `d_i = s_i − w_i` as the paper writes it: with float32 rows, whose sums are 1 only to
  ~1e-7, identical models give `d_i ≈ 1e-7 w_i`, not 0, so "zero" here is ||d_i|| at most
  1e-6 of the largest ||w_j||."""
  grads = []
  for l, f in enumerate(flats):
    d = r[:, l] @ f - f
    inner = d @ f.T
    if coaching_loss == 'norm':
      norm = np.linalg.norm(d, axis=1, keepdims=True)
      zero = norm <= 1e-6 * np.linalg.norm(f, axis=1).max()
      fit = np.divide(inner, norm, out=np.zeros_like(inner), where=~zero)
    else:
      fit = 2 * inner
    grads.append(lam * fit + beta * (r[:, l] - 1 / r.shape[0]))
  return np.stack(grads, 1)


def _np_relationship_steps(rel, models, lam, beta, lr, steps, coaching_loss='norm'):
  """E_r projected gradient steps on KAPC's R objective in NumPy (Eq. (12)): the gradient of
  `_np_relationship_gradient`, then clip at 0 and renormalise."""
  r = np.asarray(rel, np.float64)
  flats = [_np_flat(models, l) for l in range(r.shape[1])]
  for _ in range(steps):
    r = _np_normalize(r - lr * _np_relationship_gradient(r, flats, lam, beta, coaching_loss))
  return r


# The defaults of `build_kapc` / `KapcRule` (λ, β of gin_configs/kapc/kapc_dir0.1_common.gin).
LAM, BETA = 1.0, 0.005


def _np_server_models(rel, models):
  """s_i^l = Σ_j r_ij^l w_j^l (Algorithm 1) in NumPy."""
  return [np.einsum('ij,j...->i...', np.asarray(rel, np.float64)[:, LAYER_OF[t]], m)
          for t, m in enumerate(models)]


def _np_scatter(full, clients, new):
  """`scatter_relationship` in NumPy: the slice scaled by its previous mass, rows renormalised."""
  out = np.array(full, np.float64)
  for p, i in enumerate(clients):
    mass = out[i][:, clients].sum(-1, keepdims=True)
    out[i][:, clients] = new[p] * mass
  return _np_normalize(out)


def _np_norms(a, b=None):
  """Per layer ||a^l − b^l||_F for one client's list of tensors (||a^l||_F when b is None)."""
  b = b if b is not None else [np.zeros_like(x) for x in a]
  return np.array([np.sqrt(sum(np.sum((np.float64(a[t]) - b[t]) ** 2)
                               for t in range(len(a)) if LAYER_OF[t] == l)) for l in range(2)])


def test_personalized_server_models_match_numpy():
  models, rel = _models(3), _relation(3)
  got = process_lib.personalized_server_models(tf.constant(rel), [tf.constant(m) for m in models],
                                            LAYER_OF)
  for t, (g, w) in enumerate(zip(got, models)):
    want = np.einsum('ij,j...->i...', rel[:, LAYER_OF[t], :], w)
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-6)


def test_squared_relationship_gradient_matches_numpy_and_rows_stay_normalised():
  """`coaching_loss='squared'` (fltff's earlier reading of f_s)."""
  models, rel = _models(3), _relation(3)
  lam, beta = 0.7, 0.3
  r = tf.constant(rel)
  with tf.GradientTape() as tape:
    tape.watch(r)
    loss = relationship_objective(r, [tf.constant(m) for m in models], LAYER_OF, lam,
                                           beta, coaching_loss='squared')
  grad = tape.gradient(loss, r).numpy()
  want = np.zeros_like(rel, np.float64)
  for l in range(2):
    flat = np.concatenate([models[t].reshape(3, -1) for t in range(4) if LAYER_OF[t] == l], 1)
    s = rel[:, l, :] @ flat
    # ∂/∂r_ij: 2λ <s_i − w_i, w_j> + β (r_ij − 1/P)
    want[:, l, :] = 2 * lam * (s - flat) @ flat.T + beta * (rel[:, l, :] - 1 / 3)
  np.testing.assert_allclose(grad, want, rtol=2e-4, atol=1e-3)
  # The closed form the R step uses (through the layers' Gram matrices) is the same gradient.
  closed = kapc_lib.relationship_gradient(
      r, kapc_lib.layer_grams([tf.constant(m) for m in models], LAYER_OF), lam, beta).numpy()
  np.testing.assert_allclose(closed, want, rtol=2e-4, atol=1e-3)
  np.testing.assert_allclose(closed, grad, rtol=2e-4, atol=1e-3)
  tf_models = [tf.constant(m) for m in models]
  updated = kapc_lib.update_relationship(r, tf_models, LAYER_OF, lam, beta, 0.01, 3,
                                         coaching_loss='squared').numpy()
  np.testing.assert_allclose(updated.sum(-1), 1.0, atol=1e-6)
  assert updated.min() >= 0
  step = kapc_lib.update_relationship(r, tf_models, LAYER_OF, lam, beta, 1e-4, 1,
                                      coaching_loss='squared').numpy()
  np.testing.assert_allclose(step, _np_normalize(rel - 1e-4 * want), atol=1e-5)


def test_norm_relationship_gradient_matches_numpy_and_autodiff():
  """The R step with f_s the L2 norm (§4.2; Eqs. (11)–(13)) on N = 3 clients, 2 layers:
  `relationship_gradient_norm` = a NumPy reference of the paper's gradient
  λ <d_i^l, w_j^l> / ||d_i^l|| + β (r_ij^l − 1/N), d_i^l = s_i^l − w_i^l, = the gradient of
  `relationship_objective(coaching_loss='norm')`; `update_relationship` = NumPy's steps."""
  models, rel = _models(3), _relation(3)
  lam, beta = 0.7, 0.3
  r = tf.constant(rel)
  tf_models = [tf.constant(m) for m in models]
  flats = [_np_flat(models, l) for l in range(2)]
  want = _np_relationship_gradient(np.float64(rel), flats, lam, beta)
  # Written out for client 0, layer 1, entry j = 2 (independent of the vectorised reference).
  d = sum(rel[0, 1, j] * flats[1][j] for j in range(3)) - flats[1][0]
  assert want[0, 1, 2] == pytest.approx(
      lam * d @ flats[1][2] / np.sqrt(d @ d) + beta * (rel[0, 1, 2] - 1 / 3))
  got = kapc_lib.relationship_gradient_norm(r, tf_models, LAYER_OF, lam, beta).numpy()
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  with tf.GradientTape() as tape:
    tape.watch(r)
    loss = relationship_objective(r, tf_models, LAYER_OF, lam, beta)
  np.testing.assert_allclose(tape.gradient(loss, r).numpy(), want, rtol=1e-3, atol=1e-3)
  # The objective itself: λ Σ_i Σ_l ||d_i^l|| + β/2 ||R − 1/N||².
  fit = sum(np.linalg.norm(rel[:, l] @ f - f, axis=1).sum() for l, f in enumerate(flats))
  assert float(loss) == pytest.approx(lam * fit + beta / 2 * ((rel - 1 / 3) ** 2).sum(),
                                      rel=1e-5)
  # It is not the squared loss's gradient (the test would not notice a silent fallback).
  assert np.abs(want - _np_relationship_gradient(np.float64(rel), flats, lam, beta,
                                                 'squared')).max() > 0.1
  for lr, steps in ((1e-3, 1), (0.01, 3)):
    updated = kapc_lib.update_relationship(r, tf_models, LAYER_OF, lam, beta, lr, steps).numpy()
    np.testing.assert_allclose(updated, _np_relationship_steps(rel, models, lam, beta, lr, steps),
                               atol=1e-5)
    np.testing.assert_allclose(updated.sum(-1), 1.0, atol=1e-6)
    assert updated.min() >= 0


def test_norm_relationship_gradient_at_zero_is_the_beta_term():
  """Where d_i^l = s_i^l − w_i^l = 0 the norm has no gradient: the fit term contributes 0 (its
  minimum-norm subgradient) and the step is β's alone — finite, not NaN. Three cases:
  every copy the initial model (round 1), one layer identical across clients, and a row that
  is the identity (s_i = w_i whatever the other models)."""
  lam, beta = 0.7, 0.3
  rel = _relation(3)
  base = _models(1)
  same = [np.repeat(m, 3, axis=0) for m in base]
  got = kapc_lib.relationship_gradient_norm(tf.constant(rel), [tf.constant(m) for m in same],
                                            LAYER_OF, lam, beta).numpy()
  np.testing.assert_allclose(got, beta * (rel - 1 / 3), atol=1e-7)
  # Uniform R on identical models: the step changes nothing (the Algorithm 5 order's round 1).
  uniform = tf.constant(np.full((3, 2, 3), 1 / 3, np.float32))
  np.testing.assert_allclose(
      kapc_lib.update_relationship(uniform, [tf.constant(m) for m in same], LAYER_OF, lam,
                                   beta, 0.01, 3).numpy(), 1 / 3, atol=1e-7)
  # Layer 0 identical across clients, layer 1 not: only layer 1 has a fit term.
  mixed = [same[0], same[1], *_models(3)[2:]]
  got = kapc_lib.relationship_gradient_norm(tf.constant(rel), [tf.constant(m) for m in mixed],
                                            LAYER_OF, lam, beta).numpy()
  want = _np_relationship_gradient(np.float64(rel), [_np_flat(mixed, l) for l in range(2)], lam,
                                   beta)
  assert np.isfinite(got).all()
  np.testing.assert_allclose(got[:, 0], beta * (rel[:, 0] - 1 / 3), atol=1e-6)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  assert np.abs(got[:, 1] - beta * (rel[:, 1] - 1 / 3)).max() > 0.1
  # Client 1's rows are e_1: d_1 = 0 in both layers; the other clients keep their fit terms.
  models = _models(3)
  rel_eye = rel.copy()
  rel_eye[1] = np.eye(3, dtype=np.float32)[1]
  got = kapc_lib.relationship_gradient_norm(tf.constant(rel_eye),
                                            [tf.constant(m) for m in models], LAYER_OF, lam,
                                            beta).numpy()
  np.testing.assert_allclose(got[1], beta * (rel_eye[1] - 1 / 3), atol=1e-6)
  np.testing.assert_allclose(
      got, _np_relationship_gradient(np.float64(rel_eye), [_np_flat(models, l) for l in range(2)],
                                     lam, beta), rtol=1e-4, atol=1e-4)


def test_random_initial_relationship_is_seeded_with_normalised_rows():
  """§4.4: R starts random. Ours: U(0, 1) entries, each row r_i^l (over clients) divided by its
  sum; the same seed gives the same cube."""
  r = process_lib.initial_relationship(5, 3, 'random', seed=7)
  assert r.shape == (5, 3, 5) and r.dtype == np.float32
  np.testing.assert_allclose(r.sum(-1), 1.0, atol=1e-6)
  assert r.min() > 0
  want = np.random.default_rng(7).uniform(size=(5, 3, 5))
  np.testing.assert_allclose(r, want / want.sum(-1, keepdims=True), rtol=1e-6)
  np.testing.assert_array_equal(r, process_lib.initial_relationship(5, 3, 'random', seed=7))
  assert np.abs(r - process_lib.initial_relationship(5, 3, 'random', seed=8)).max() > 0.01
  assert np.abs(r - 0.2).max() > 0.05                     # Not the uniform start.
  assert np.abs(r[:, 0] - r[:, 1]).max() > 0.01          # Each layer drawn on its own.
  np.testing.assert_array_equal(process_lib.initial_relationship(4, 2, 'uniform'), 0.25)
  with pytest.raises(ConfigError, match='relationship_init'):
    process_lib.initial_relationship(4, 2, 'gaussian')
  # KAPC starts from it by default, seeded by `relationship_seed`; 'uniform' stays available.
  for kwargs, want in (({}, process_lib.initial_relationship(4, 2, 'random', 0)),
                       ({'relationship_seed': 3},
                        process_lib.initial_relationship(4, 2, 'random', 3)),
                       ({'relationship_init': 'uniform'}, np.full((4, 2, 4), 0.25))):
    algorithm = kapc_lib.build_kapc(SPEC, 4, client_optimizer=_sgd(), **kwargs)
    np.testing.assert_array_equal(algorithm.process.initialize()['relation'],
                                  np.float32(want))
  with pytest.raises(ConfigError, match='relationship_init'):
    kapc_lib.build_kapc(SPEC, 4, client_optimizer=_sgd(), relationship_init='gaussian')
  with pytest.raises(ConfigError, match='coaching_loss'):
    kapc_lib.build_kapc(SPEC, 4, client_optimizer=_sgd(), coaching_loss='l1')


def test_slice_and_scatter_keep_full_rows_normalised():
  n = 6
  full = _relation(n)
  clients = np.array([4, 1, 3], np.int32)
  sl = process_lib.slice_relationship(tf.constant(full), tf.constant(clients)).numpy()
  np.testing.assert_allclose(sl, full[clients][:, :, clients])
  new = _relation(3)
  out = process_lib.scatter_relationship(tf.constant(full), tf.constant(clients),
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
  xi = fedamp_lib.attentive_relationship([tf.constant(m) for m in models], 2, 5.0, 0.2).numpy()
  flat = np.concatenate([m.reshape(3, -1) for m in models], 1).astype(np.float64)
  d = ((flat[:, None] - flat[None]) ** 2).sum(-1)
  off = 0.2 * np.exp(-d / 5.0) / 5.0
  np.fill_diagonal(off, 0)
  want = off + np.diag(1 - off.sum(1))
  np.testing.assert_allclose(xi[:, 0], _np_normalize(want), rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(xi[:, 1], xi[:, 0])


@pytest.mark.parametrize('offset', [0.0, 30.0])
def test_attentive_relationship_of_nearby_large_models_has_no_cancellation(offset):
  # Models 1e-3 apart with norms of up to ~3e4: the expanded ||a||² + ||b||² − 2ab would lose
  # the distances to float32 rounding of the norms.
  rng = np.random.default_rng(3)
  base = rng.normal(size=(1, 1000)).astype(np.float32) + offset
  models = base + 1e-3 * rng.normal(size=(3, 1000)).astype(np.float32)
  xi = fedamp_lib.attentive_relationship([tf.constant(models)], 1, 1.0, 0.1).numpy()[:, 0]
  flat = models.astype(np.float64)
  d = ((flat[:, None] - flat[None]) ** 2).sum(-1)
  off = 0.1 * np.exp(-d)
  np.fill_diagonal(off, 0)
  np.testing.assert_allclose(xi, _np_normalize(off + np.diag(1 - off.sum(1))), rtol=1e-6)


# --- the process ------------------------------------------------------------------------------
def _datasets(sizes, seed):
  return random_client_datasets(sizes, seed, DIM, CLASSES, batch=4)


class Sim:
  """A minimal personalised-process loop (the driver's logic, without files)."""

  def __init__(self, algorithm, num_clients):
    self.algorithm = algorithm
    self.states = {k: algorithm.initial_client_state(k) for k in range(num_clients)}
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
    self.states.update(self.algorithm.next_client_states(out.result, server_input))
    return out

  def driver_round(self, clients, datasets, epochs=1):
    """The round through `PersonalizedAlgorithm.next`, as the driver runs it."""
    inputs = [self.algorithm.client_input(d, k, epochs, self.states[k])
              for k, d in zip(clients, datasets)]
    server_input = self.algorithm.server_input(clients, [self.states[k] for k in clients],
                                               [8.0] * len(clients))
    out = self.algorithm.next(self.state, server_input, inputs)
    self.state = out.state
    self.states.update(out.client_states)
    return out


def _sgd(learning_rate=LR):
  return optimizers.sgdm(learning_rate=learning_rate)


def _random_models(clients, scale=0.3, seed=0):
  """`{client: random trainable weights}`."""
  rng = np.random.default_rng(seed)
  shapes = [np.shape(w) for w in SPEC.initial_weights().trainable]
  return {k: [(scale * rng.normal(size=s)).astype(np.float32) for s in shapes]
          for k in clients}


def _randomize(sim, models):
  """Gives clients the personal `models`, and the server the same models as its copies."""
  for k, m in models.items():
    sim.states[k]['model']['trainable'] = [w.copy() for w in m]
    sim.states[k]['server_copy'] = [w.copy() for w in m]


def _snapshot(sim, clients):
  """(R, the server's copies of `clients` stacked `[P, ...]`) before a round."""
  return (np.asarray(sim.state['relation']),
          [np.stack([sim.copies(k)[t] for k in clients]) for t in range(4)])


def test_identity_relationship_is_local_training_with_proximal_term_to_own_model():
  """R fixed to the identity: s_i = w_i's previous model, so each client runs FedProx(μ = 2λ)
  towards its own previous model — checked against our FedProx on that client alone."""
  lam = 0.3
  algorithm = process_lib.build_personalized_process(
      SPEC, 3, _sgd(), local_lib.FixedRelation(lambda_=lam, relationship_init='identity'))
  sim = Sim(algorithm, 3)
  prox = learning.build_fedprox(SPEC, client_optimizer=_sgd(), mu=2 * lam)
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
                             process_lib.initial_relationship(3, 2, 'identity'))


@pytest.mark.parametrize('order', kapc_lib.RELATIONSHIP_UPDATES)
def test_bls_with_mu_one_and_full_upload_equals_kapc(order):
  """μ = 1 skips nothing (r_ii <= 1, skipped where r_ii > μ); min_upload_layers = L forces Ω = L (Algorithm 4's restart from
  L − 1 is clipped back to min_upload_layers = L), so KAPC+BLS is KAPC, in either order."""
  plain = Sim(kapc_lib.build_kapc(SPEC, 4, client_optimizer=_sgd(), relationship_update=order), 4)
  bls = Sim(kapc_lib.build_kapc(SPEC, 4, client_optimizer=_sgd(), bls_mu=1.0, min_upload_layers=2,
                          relationship_update=order), 4)
  for r, clients in enumerate(([0, 1, 2, 3], [1, 3], [0, 2, 3])):
    data = _datasets([8] * len(clients), seed=10 + r)
    a, b = plain.round(clients, data), bls.round(clients, _datasets([8] * len(clients),
                                                                   seed=10 + r))
    np.testing.assert_allclose(a.result['bytes_up'], b.result['bytes_up'])
    np.testing.assert_array_equal(b.result['omega'], 2)
  for k in range(4):
    for x, y in zip(plain.models(k), bls.models(k)):
      np.testing.assert_allclose(x, y, atol=1e-6)
  np.testing.assert_allclose(plain.state['relation'], bls.state['relation'], atol=1e-6)
  relation = np.asarray(plain.state['relation'])
  np.testing.assert_allclose(relation.sum(-1), 1.0, atol=1e-5)      # Rows stay normalised.
  start = process_lib.initial_relationship(4, 2, 'random')
  assert np.abs(relation - start).max() > 1e-4                       # R was learned.


def test_byte_counts_equal_the_tensors_exchanged():
  # R starts uniform here (not KAPC's random start): r_ii = 1/3 ≤ μ in round 1.
  algorithm = kapc_lib.build_kapc(SPEC, 3, client_optimizer=_sgd(), bls_mu=0.5,
                                  relationship_init='uniform')
  sim = Sim(algorithm, 3)
  sizes = [sum(np.asarray(w).nbytes for w in SPEC.initial_weights().trainable[t:t + 2])
           for t in (0, 2)]
  assert list(algorithm.parts.layer_sizes_bytes) == sizes
  for r in range(3):
    out = sim.round([0, 1, 2], _datasets((8, 8, 8), seed=r))
    rel = np.asarray(out.measurements['kapc']['self_relation_mean'])
    assert np.isfinite(rel)
    omega = np.asarray(out.result['omega'])
    if r == 0:  # Algorithm 4 on a first selection: Ω = L − 1 = 1.
      np.testing.assert_array_equal(omega, 1)
    np.testing.assert_allclose(out.result['bytes_up'], [sum(sizes[:w]) for w in omega])
  # Round 1: R uniform (r_ii = 1/3 ≤ 0.5): every layer is sent; Ω = 1 (first selection).
  sim2 = Sim(algorithm, 3)
  out = sim2.round([0, 1, 2], _datasets((8, 8, 8), seed=0))
  np.testing.assert_allclose(out.result['bytes_down'], [sum(sizes)] * 3)
  # Layers not uploaded keep the server's stale copy.
  np.testing.assert_allclose(sim2.copies(0)[2], SPEC.initial_weights().trainable[2])
  assert np.abs(sim2.copies(0)[0] - SPEC.initial_weights().trainable[0]).max() > 1e-4
  # Default order (Algorithm 5): round 1 stepped R on the copies held *before* it — all the
  # initial model, so s_i = w_i, the norm's term is 0 and so is β's at the uniform R: the step
  # leaves R unchanged — and stored the fresh uploads without stepping on them; round 2 steps
  # on exactly those stored copies.
  uniform = process_lib.initial_relationship(3, 2, 'uniform')
  np.testing.assert_allclose(sim2.state['relation'], uniform, atol=1e-6)

  def one_step(relation, sim):
    stacked = [tf.constant(np.stack([sim.copies(k)[t] for k in range(3)])) for t in range(4)]
    return kapc_lib.update_relationship(tf.constant(relation), stacked,
                                        algorithm.parts.layer_of, LAM, BETA, 0.01, 1).numpy()

  want = one_step(uniform, sim2)
  sim2.round([0, 1, 2], _datasets((8, 8, 8), seed=1))
  np.testing.assert_allclose(sim2.state['relation'], want, atol=1e-6)
  # The earlier order ('after_training'): the server's R step after round 1 used exactly the
  # copies it stored in that round (uniform R, all clients: the slice is the whole cube, so
  # R⁺ = one projected step from 1/3 on the copies the driver keeps).
  old = Sim(kapc_lib.build_kapc(SPEC, 3, client_optimizer=_sgd(), bls_mu=0.5,
                                relationship_update='after_training',
                                relationship_init='uniform'), 3)
  old.round([0, 1, 2], _datasets((8, 8, 8), seed=0))
  np.testing.assert_allclose(old.state['relation'], one_step(uniform, old), atol=1e-6)
  # μ = 0 skips every layer once r_ii > 0: nothing is sent down.
  skip_all = Sim(kapc_lib.build_kapc(SPEC, 3, client_optimizer=_sgd(), bls_mu=0.0), 3)
  out = skip_all.round([0, 1, 2], _datasets((8, 8, 8), seed=0))
  np.testing.assert_allclose(out.result['bytes_down'], 0.0)
  local = Sim(local_lib.build_local(SPEC, 3, client_optimizer=_sgd()), 3)
  out = local.round([0, 1, 2], _datasets((8, 8, 8), seed=0))
  np.testing.assert_allclose(out.result['bytes_down'], 0.0)
  np.testing.assert_allclose(out.result['bytes_up'], 0.0)


# --- Algorithm 5's order and Algorithm 4's state ---------------------------------------------
def test_default_order_sends_s_from_r_stepped_on_the_server_copies():
  """Algorithm 5: R' = E_r steps on the server's copies, then s_i = Σ_j r'_ij w_j is sent.

  Clients start from s_i (`start_from='server'`, every layer sent) with learning rate 0, so
  each one's new model *is* the s_i it received; R after the round is R' written back."""
  lam, beta, lr, steps = 0.5, 0.1, 0.02, 2
  algorithm = process_lib.build_personalized_process(
      SPEC, 5, _sgd(0.0), kapc_lib.KapcRule(
          lambda_=lam, beta=beta, relationship_learning_rate=lr, relationship_steps=steps,
          start_from='server'))
  sim = Sim(algorithm, 5)
  _randomize(sim, _random_models(range(5)))
  for r, clients in enumerate(([3, 0, 4], [4, 1, 3])):  # Round 2: 4, 3 hold round 1's s_i.
    relation, copies = _snapshot(sim, clients)
    current = _np_normalize(relation[clients][:, :, clients].astype(np.float64))
    stepped = _np_relationship_steps(current, copies, lam, beta, lr, steps)
    want = _np_server_models(stepped, copies)
    unstepped = _np_server_models(current, copies)
    sim.round(clients, _datasets([8] * 3, seed=r))
    for p, k in enumerate(clients):
      for t in range(4):
        np.testing.assert_allclose(sim.models(k)[t], want[t][p], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(sim.copies(k)[t], want[t][p], rtol=1e-4, atol=1e-5)
    assert max(np.abs(w - u).max() for w, u in zip(want, unstepped)) > 1e-2  # Order matters.
    np.testing.assert_allclose(sim.state['relation'], _np_scatter(relation, clients, stepped),
                               rtol=1e-4, atol=1e-5)


def test_default_order_skips_layers_by_the_stepped_self_relationship():
  """BLS (Algorithm 3) reads r'_ii^l of the stepped slice: with R uniform (r_ii = 1/3 ≤ μ)
  the earlier order sends every layer, the default skips where r'_ii^l > μ (μ is set between
  the stepped values, so that both happen)."""
  clients = [2, 0, 3]
  models = _random_models(range(4), scale=1.0, seed=1)
  copies = [np.stack([models[k][t] for k in clients]) for t in range(4)]
  stepped = _np_relationship_steps(np.full((3, 2, 3), 1 / 3), copies, LAM, BETA, 0.01, 1)
  stepped_self = stepped[np.arange(3), :, np.arange(3)]
  mu = float(np.median(stepped_self))
  assert mu > 1 / 3 + 1e-2
  down = {}
  for order, self_rel in (('before_send', stepped_self),
                          ('after_training', np.full((3, 2), 1 / 3))):
    sim = Sim(kapc_lib.build_kapc(SPEC, 4, client_optimizer=_sgd(), bls_mu=mu,
                                  relationship_update=order, relationship_init='uniform'), 4)
    _randomize(sim, models)
    sizes = np.array(sim.algorithm.parts.layer_sizes_bytes, np.float64)
    out = sim.round(clients, _datasets([8] * 3, seed=0))
    down[order] = np.asarray(out.result['bytes_down'])
    kapc_stats = out.measurements['kapc']
    np.testing.assert_allclose(kapc_stats['self_relation_mean'], self_rel.mean(), rtol=1e-4)
    # r_ii^l logged per layer: the participants' mean (CSV) and every value (`[P, L]`, JSONL).
    for l in range(2):
      np.testing.assert_allclose(kapc_stats[f'self_relation_layer_{l}'], self_rel[:, l].mean(),
                                 rtol=1e-4)
    np.testing.assert_allclose(kapc_stats['self_relation'], self_rel, rtol=1e-4)
    scalars, arrays = driver_lib.split_measurements(out.measurements)
    assert {f'kapc/self_relation_layer_{l}' for l in range(2)} <= set(scalars)
    assert arrays['kapc/self_relation'].shape == (3, 2)
    assert 'omega_mean' not in kapc_stats  # BLS's measurements are its own group.
    np.testing.assert_allclose(out.measurements['bls']['skipped_layer_fraction'],
                               (self_rel > mu).mean())
    np.testing.assert_allclose(down[order], ((self_rel <= mu) * sizes).sum(1))
  np.testing.assert_allclose(down['after_training'], sizes.sum())
  assert (down['before_send'] < sizes.sum()).any()  # The stepped R crossed μ somewhere.


def test_relationship_update_is_validated_and_gin_configurable():
  with pytest.raises(ConfigError, match='relationship_update'):
    kapc_lib.build_kapc(SPEC, 3, client_optimizer=_sgd(), relationship_update='sideways')
  gin.clear_config()
  try:
    gin.bind_parameter('kapc.relationship_update', 'sideways')
    with pytest.raises(ConfigError, match='relationship_update'):
      kapc_lib.build_kapc(SPEC, 3, client_optimizer=_sgd())
  finally:
    gin.clear_config()


def test_bls_algorithm4_in_rounds_matches_select_omega_tf():
  """Algorithm 4 in the process: the B^l = ||w^l||, τ^l = ||w^l − s^l|| each client computes,
  the Ω and stored bounds it keeps, round after round, equal `bls.select_omega_tf` on NumPy
  norms (itself tested line by line in test_bls.py). Round 1 is every client's first selection
  (branch A: Ω = L − 1 = 1, no search, stored bounds = this round's); later rounds go through
  branch B (Ω^{k−1} = 1), where the stored bounds must not change."""
  algorithm = kapc_lib.build_kapc(SPEC, 4, client_optimizer=_sgd(), bls_mu=1.0)  # Nothing skipped.
  columns, out_dims = bls_lib.layer_dimensions(
      [[np.shape(w) for w in SPEC.initial_weights().trainable[t:t + 2]] for t in (0, 2)])
  assert (columns, out_dims) == ([DIM, 8], [8, CLASSES])
  sim = Sim(algorithm, 4)
  state = sim.states[0]
  assert int(state['omega']) == 2
  np.testing.assert_array_equal(state['b_max'], np.zeros(2, np.float32))
  np.testing.assert_array_equal(state['tau_max'], np.zeros(2, np.float32))
  branches = []
  for r, clients in enumerate(([0, 1, 2, 3], [1, 3], [0, 2, 3], [3, 1], [0, 1, 2, 3])):
    relation, copies = _snapshot(sim, clients)
    stepped = _np_relationship_steps(
        _np_normalize(relation[clients][:, :, clients].astype(np.float64)), copies, LAM, BETA,
        0.01, 1)
    s = _np_server_models(stepped, copies)
    before = {k: {key: np.array(sim.states[k][key]) for key in ('omega', 'b_max', 'tau_max')}
              for k in clients}
    out = sim.round(clients, _datasets([8] * len(clients), seed=20 + r))
    steps = []
    for p, k in enumerate(clients):
      b = _np_norms(sim.models(k))
      tau = _np_norms(sim.models(k), [x[p] for x in s])
      omega, step, b_max, tau_max = bls_lib.select_omega_tf(
          b.astype(np.float32), tau.astype(np.float32), before[k]['b_max'],
          before[k]['tau_max'], int(before[k]['omega']), columns, out_dims)
      assert int(np.asarray(out.result['omega'])[p]) == int(omega) == int(sim.states[k]['omega'])
      np.testing.assert_allclose(sim.states[k]['b_max'], b_max, rtol=1e-5)
      np.testing.assert_allclose(sim.states[k]['tau_max'], tau_max, rtol=1e-4, atol=1e-6)
      steps.append(int(step))
      if int(before[k]['omega']) == 2:  # Branch A: Ω = 1, the stored bounds take maxima.
        branches.append('A')
        assert int(omega) == 1 and int(step) == 0
        np.testing.assert_allclose(sim.states[k]['b_max'],
                                   np.maximum(before[k]['b_max'], b), rtol=1e-5)
      else:  # Branch B: the stored bounds are kept bit for bit.
        branches.append('B')
        np.testing.assert_array_equal(sim.states[k]['b_max'], before[k]['b_max'])
        np.testing.assert_array_equal(sim.states[k]['tau_max'], before[k]['tau_max'])
    assert float(out.measurements['bls']['search_steps_mean']) == pytest.approx(np.mean(steps))
    np.testing.assert_array_equal(out.measurements['bls']['omega'], out.result['omega'])
    if r == 0:
      np.testing.assert_array_equal(out.result['omega'], 1)
      assert float(out.measurements['bls']['search_steps_mean']) == 0.0
  assert branches[:4] == ['A'] * 4 and 'B' in branches


def test_bls_stale_server_layers_measurement():
  """`bls/stale_server_layers`: the participants' layers whose server copy still equals the
  initial model after the round. Round 1 (first selections) uploads Ω = L − 1 = 1 layer, so
  each participant's second layer is stale: 3 of 3 · 2 layers."""
  algorithm = kapc_lib.build_kapc(SPEC, 4, client_optimizer=_sgd(), bls_mu=0.5)
  initial = SPEC.initial_weights().trainable
  sim = Sim(algorithm, 4)

  def count(states):
    return sum(all(np.array_equal(st['server_copy'][t], initial[t])
                   for t in range(4) if LAYER_OF[t] == l)
               for st in states.values() for l in range(2))

  out = sim.driver_round([0, 2, 3], _datasets([8] * 3, seed=0))
  assert out.measurements['bls']['stale_server_layers'] == 3 == count(out.client_states)
  assert out.measurements['bls']['stale_server_layer_fraction'] == pytest.approx(0.5)
  assert 'omega_mean' in out.measurements['bls']  # The process's own measurements stay.
  for r, clients in enumerate(([1, 2], [0, 1, 2, 3])):
    out = sim.driver_round(clients, _datasets([8] * len(clients), seed=r + 1))
    want = count(out.client_states)
    assert out.measurements['bls']['stale_server_layers'] == want
    assert out.measurements['bls']['stale_server_layer_fraction'] == pytest.approx(
        want / (2 * len(clients)))
    # A layer is stale only if it was not uploaded this round.
    omega = dict(zip(out.clients, out.measurements['bls']['omega']))
    assert want <= sum(2 - int(omega[k]) for k in clients)
  # Bit for bit: one changed element makes the layer fresh; every tensor of it counts.
  states = {0: collections.OrderedDict(server_copy=[w.copy() for w in initial])}
  assert algorithm.stale_server_layers(states) == 2
  states[0]['server_copy'][3] = states[0]['server_copy'][3].copy()
  states[0]['server_copy'][3][-1] += 1e-7  # The bias of layer 2, last element.
  assert algorithm.stale_server_layers(states) == 1
  # Without BLS nothing is measured (every participant uploads every layer): no `bls` group.
  plain = Sim(kapc_lib.build_kapc(SPEC, 4, client_optimizer=_sgd()), 4)
  out = plain.driver_round([0, 1], _datasets([8] * 2, seed=0))
  assert set(out.measurements) == {'kapc'} and 'omega' not in out.arrays
  assert not {'omega_mean', 'stale_server_layers'} & set(out.measurements['kapc'])


def test_fedbn_without_norm_layers_equals_fedavg():
  """All clients, no normalisation layers: every personal model is FedAvg's local model of
  the next round's start — here: the server aggregate equals FedAvg's global model."""
  fedbn = Sim(fedbn_lib.build_fedbn(SPEC, 3, client_optimizer=_sgd()), 3)
  avg = learning.build_fedavg(SPEC, client_optimizer=_sgd())
  state = avg.process.set_model_weights(avg.process.initialize(), SPEC.initial_weights())
  for r in range(2):
    fedbn.round([0, 1, 2], _datasets((8, 8, 8), seed=r))
    state = avg.process.next(state, [learning.client_input(d, k, 1) for k, d in
                                     enumerate(_datasets((8, 8, 8), seed=r))]).state
  # FedBN's clients start round 3 from r_i · W = the sample-weighted mean of their models.
  mean = [np.mean([fedbn.copies(k)[t] for k in range(3)], axis=0) for t in range(4)]
  for a, b in zip(avg.process.get_model_weights(state).trainable, mean):
    np.testing.assert_allclose(a, b, atol=1e-5)


# KAPC+BLS with its default relationship update runs on two workers in
# test_workers_equality; compiling is the first thing such a run does.
@pytest.mark.parametrize('builder,kwargs', [
    (kapc_lib.build_kapc, {'bls_mu': 0.5, 'relationship_update': 'after_training'}),
    (fedamp_lib.build_fedamp, {}), (fedbn_lib.build_fedbn, {})])
def test_personalized_processes_compile_to_mergeable_form(builder, kwargs):
  algorithm = builder(SPEC, 4, client_optimizer=_sgd(), **kwargs)
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
  assert 'personal_local accuracy by best_round_mean' in stdout
  # The default executor ('auto') vectorises KAPC's clients (equal to TFF's C++ runtime, client
  # by client: test_vectorized.py, KAPC+BLS's rounds and a pipeline's).
  assert 'runs on the in-process executor, vectorised clients.' in stdout
  assert len(rows) == 4
  for row in rows:
    assert row['clients'] == '4'
    assert float(row['personal_local_accuracy']) > 0.2
    assert float(row['sim_round_seconds']) > float(row['sim_compute_seconds'])
  assert float(rows[-1]['mb_down_cumulative']) == pytest.approx(
      sum(int(r['bytes_down']) for r in rows) / 1e6)
  with open(os.path.join(full, 'summary.json')) as f:
    summary = json.load(f)
  assert summary['best_personal_local_accuracy'] == max(float(r['personal_local_accuracy'])
                                                    for r in rows)
  # R [10, 2, 10] float32 + one mlp2 copy (784·200 + 200 + 200·10 + 10 floats) per client.
  assert summary['server_memory_mb'] == pytest.approx((4 * 10 * 2 * 10 + 10 * 4 * 159010) / 1e6)
  assert [r['round'] for r in resumed] == [r['round'] for r in rows]
  for a, b in zip(resumed, rows):
    assert abs(float(a['personal_local_accuracy']) - float(b['personal_local_accuracy'])) < 1e-6
    assert a['bytes_up'] == b['bytes_up']
  # The report's pFL tables and the relationship heatmap.
  report = run_program('pipelines.report', '--personalized', f'--runs={full}',
                       f'--out={tmp_path / "report"}', '--heatmap_client=1', timeout=120)
  assert report.returncode == 0, report.stderr[-2000:]
  lines = open(tmp_path / 'report' / 'report.md').read().splitlines()
  best = [c.strip() for c in lines[2].strip('|').split('|')]
  assert best[1] == f'{summary["best_personal_local_accuracy"]:.4f} ({summary["best_personal_local_accuracy_round"]})'
  comm = [c.strip() for c in lines[6].strip('|').split('|')]
  assert float(comm[1]) == pytest.approx(summary['mb_up_total'], abs=0.01)
  assert float(comm[2]) == pytest.approx(summary['mb_down_total'], abs=0.01)
  timing = [c.strip() for c in lines[10].strip('|').split('|')]
  assert float(timing[5]) == pytest.approx(summary['sim_round_seconds_mean'], rel=1e-3)
  relation = np.load(full / 'relationship.npy')
  assert relation.shape == (10, 2, 10)  # mlp2: two dense layers.
  np.testing.assert_allclose(relation.sum(-1), 1.0, atol=1e-5)
  assert os.path.getsize(tmp_path / 'report' / f'relationship_{full.name}_client1.png') > 1000
  # r_ii per layer, every round: CSV columns (means over the round's 4 clients) and the JSONL
  # arrays (`[P, L]`, in the order of the round's `clients`); their mean is the CSV value.
  with open(full / 'measurements.jsonl') as f:
    records = [json.loads(line) for line in f]
  assert [r['round'] for r in records] == [int(r['round']) for r in rows]
  for row, record in zip(rows, records):
    values = np.asarray(record['kapc/self_relation'])
    assert values.shape == (4, 2) and len(record['clients']) == 4
    for l in range(2):
      assert float(row[f'kapc/self_relation_layer_{l}']) == pytest.approx(values[:, l].mean(),
                                                                          rel=1e-5)
  assert float(rows[-1]['kapc/self_relation_mean']) == pytest.approx(
      np.mean([float(rows[-1][f'kapc/self_relation_layer_{l}']) for l in range(2)]), rel=1e-5)
  # The report links the heat map and the r_ii-by-round plot.
  text = '\n'.join(lines)
  assert f'(relationship_{full.name}_client1.png)' in text
  assert f'(self_relation_{full.name}.png)' in text
  assert os.path.getsize(tmp_path / 'report' / f'self_relation_{full.name}.png') > 1000


@pytest.mark.parametrize('alpha,beta', [('0.1', 0.005), ('0.3', 0.5)])
def test_kapc_paper_configs_bind_r_settings(alpha, beta, monkeypatch):
  """Every KAPC paper config: R starts random (seeded by the run seed), the R step uses the
  norm, η_r = 0.01, E_r = 1 (§4.2, §4.4, §7.1), and λ, β of its α (ours, from the §7.3.1
  ablation)."""
  import glob  # pylint: disable=g-import-not-at-top
  import fltff  # pylint: disable=g-import-not-at-top
  monkeypatch.chdir(REPO)
  fltff.register_configurables()
  paths = sorted(glob.glob(f'gin_configs/kapc/*_dir{alpha}_kapc*.gin'))
  if alpha == '0.1':
    paths.append('gin_configs/kapc/offline_mnist1003_kapc.gin')
  assert len(paths) == 50 + (alpha == '0.1')  # 4 datasets × 2 N × 5 (+ FMNIST IDX twins).
  want = {'lambda_': 1.0, 'beta': beta, 'relationship_learning_rate': 0.01,
          'relationship_steps': 1, 'coaching_loss': 'norm', 'relationship_init': 'random'}
  for path in paths:
    gin.clear_config()
    try:
      gin.parse_config_files_and_bindings([path], [], skip_unknown=False)
      got = {k: gin.query_parameter(f'kapc.{k}') for k in want}
      assert got == want, path
      with pytest.raises(ValueError):  # R's seed is the run's (`build_method`), not bound.
        gin.query_parameter('kapc.relationship_seed')
    finally:
      gin.clear_config()


def _simplex_projection_by_bisection(v: np.ndarray) -> np.ndarray:
  """Reference: the θ with Σ max(v − θ, 0) = 1 found by bisection (no sorting)."""
  low, high = v.min() - 1.0, v.max()
  for _ in range(200):
    theta = (low + high) / 2
    if np.maximum(v - theta, 0).sum() > 1:
      low = theta
    else:
      high = theta
  return np.maximum(v - (low + high) / 2, 0)


@pytest.mark.parametrize('seed', [0, 1, 2])
def test_project_rows_to_simplex_is_the_euclidean_projection(seed):
  from fltff.personalization.process import normalize_rows  # pylint: disable=g-import-not-at-top
  from fltff.personalization.process import project_rows_to_simplex  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(seed)
  rows = rng.normal(scale=0.6, size=(4, 3, 5)).astype(np.float64)
  rows[0, 0] = [0.1, 0.2, 0.3, 0.2, 0.2]  # Already on the simplex: unchanged.
  projected = project_rows_to_simplex(tf.constant(rows)).numpy()
  expected = np.apply_along_axis(_simplex_projection_by_bisection, -1, rows)
  np.testing.assert_allclose(projected, expected, atol=1e-9)
  np.testing.assert_allclose(projected.sum(-1), 1.0, atol=1e-12)
  np.testing.assert_allclose(projected[0, 0], rows[0, 0], atol=1e-12)
  # Clip-and-renormalise is another map: it keeps the positive entries' ratios.
  renormalised = normalize_rows(tf.constant(rows)).numpy()
  assert np.abs(renormalised - projected).max() > 1e-3
  # The projection is nearer the input than any other simplex point tried.
  others = rng.dirichlet(np.ones(5), size=(200,))
  for i, j in np.ndindex(4, 3):
    nearest = np.linalg.norm(rows[i, j] - projected[i, j])
    assert (np.linalg.norm(others - rows[i, j], axis=1) >= nearest - 1e-12).all()


def test_kapc_r_step_with_the_simplex_projection_matches_numpy():
  from fltff.personalization import kapc  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(3)
  relation = rng.dirichlet(np.ones(3), size=(3, 2)).astype(np.float32)  # [P, L, P]
  models = [rng.normal(size=(3, 4, 2)).astype(np.float32), rng.normal(size=(3, 5)).astype(np.float32)]
  stepped = kapc.update_relationship(tf.constant(relation), [tf.constant(m) for m in models],
                                     [0, 1], lambda_=1.0, beta=0.5, learning_rate=0.3, steps=1,
                                     coaching_loss='squared', projection='simplex').numpy()
  grams = np.stack([np.einsum('id,jd->ij', m.reshape(3, -1), m.reshape(3, -1)) for m in models],
                   axis=1)
  gradient = (2 * (np.einsum('ilk,klj->ilj', relation, grams) - grams)
              + 0.5 * (relation - 1 / 3))
  expected = np.apply_along_axis(_simplex_projection_by_bisection, -1,
                                 (relation - 0.3 * gradient).astype(np.float64))
  np.testing.assert_allclose(stepped, expected, atol=2e-5)
  with pytest.raises(ConfigError, match="relationship_projection must be one of 'renormalize', "
                     "'simplex'"):
    kapc.KapcRule(relationship_projection='euclid').check('kapc')
