"""BLS (KAPC §5): Algorithm 4 branch by branch on hand-made values, inequality (29) and the
search against NumPy references written here, Eqs. (30)–(31), masks and bytes."""

import numpy as np
import pytest
import tensorflow as tf

from fltff.errors import ConfigError
from fltff.personalization import bls

SHAPES = [[(5, 4), (4,)], [(3, 3, 2, 4), (4,)], [(4, 3), (3,)]]  # L = 3 layers


def random_layers(rng, shapes=SHAPES):
  return [[rng.normal(size=s).astype(np.float32) for s in layer] for layer in shapes]


# --- NumPy references (the paper's formulas and Algorithm 4 as written, float64 loops) -------


def np_layer_bounds(weights_layers, server_layers):
  """Eqs. (30)–(31): B^l = ||w^l||_F, τ^l = ||w^l − s^l||_F over the layer's tensors."""
  b, tau = [], []
  for w_layer, s_layer in zip(weights_layers, server_layers):
    flat_w = np.concatenate([np.ravel(t).astype(np.float64) for t in w_layer])
    flat_s = np.concatenate([np.ravel(t).astype(np.float64) for t in s_layer])
    b.append(np.linalg.norm(flat_w))
    tau.append(np.linalg.norm(flat_w - flat_s))
  return np.array(b), np.array(tau)


def np_m(tau, b, columns, omega):
  """M̂(Ω) in the paper's form: τ^Ω/(2B^Ω) + Σ_{k=1}^{Ω−1} τ^{Ω−k} Π_{j=1}^{k} sqrt(n^{Ω+1−j})
  / (2B^{Ω−k}) (layers 1-based; τ/B with τ = 0 is 0, τ > 0 with B = 0 is ∞)."""
  def ratio(l):
    t, bb = tau[l - 1], b[l - 1]
    return 0.0 if t == 0 else (np.inf if bb == 0 else t / (2 * bb))
  total = ratio(omega)
  for k in range(1, omega):
    product = 1.0
    for j in range(1, k + 1):
      product *= np.sqrt(columns[omega + 1 - j - 1])
    total += ratio(omega - k) * product
  return total


def np_criterion_sides(b_hat, tau_hat, b, tau, columns, out_dims):
  """Both sides of inequality (29), not in logarithms, for Ω = 1..L."""
  length = len(columns)
  c = out_dims[-1]  # C5
  m_full = np_m(tau, b, columns, length)
  lhs, rhs = [], []
  for omega in range(1, length + 1):
    with np.errstate(divide='ignore', invalid='ignore'):
      lhs.append(length * out_dims[omega - 1] * np_m(tau_hat, b_hat, columns, omega) /
                 (omega * c * m_full * 2.0**(length - omega)))
    rhs.append(float(np.prod(b[omega:])))
  return np.array(lhs), np.array(rhs)


def np_select_omega(b, tau, b_max, tau_max, omega_prev, columns, out_dims, min_layers=1):
  """Algorithm 4 line by line (docs/methods/personalised.md), Ω kept in [min_layers, L] (C3).

  Returns (Ω, steps, stored B, stored τ)."""
  length = len(columns)
  b_max, tau_max = np.array(b_max, np.float64), np.array(tau_max, np.float64)
  if omega_prev >= length:                                   # line 3 (q = 0 is Ω = L, C2)
    for l in range(length):                                  # lines 4–7
      b_max[l] = max(b[l], b_max[l])
      tau_max[l] = max(tau[l], tau_max[l])
    return max(length - 1, min_layers), 0, b_max, tau_max    # lines 8–9
  # Lines 11–14: this round's values are B̂, τ̂; the stored ones are the full-layer bounds.
  lhs, rhs = np_criterion_sides(b, tau, b_max, tau_max, columns, out_dims)

  def holds(omega):
    return bool(lhs[omega - 1] < rhs[omega - 1])

  omega = start = min(max(omega_prev, min_layers), length)   # line 15
  if holds(omega):                                           # line 16
    while True:                                              # lines 17–19
      if omega == min_layers:
        break
      omega -= 1
      if not holds(omega):
        break
  else:
    while True:                                              # lines 21–23
      if omega == length:
        break
      omega += 1
      if holds(omega):
        break
  return omega, abs(omega - start), b_max, tau_max           # lines 26–27


def np_search(satisfied, omega_prev, min_layers=1):
  """Lines 15–24 on given truth values of (29)."""
  length = len(satisfied)
  omega = start = min(max(omega_prev, min_layers), length)
  step = -1 if satisfied[omega - 1] else 1
  want = not satisfied[omega - 1]  # Down: stop where (29) fails; up: where it holds.
  while min_layers <= omega + step <= length:
    omega += step
    if satisfied[omega - 1] == want:
      break
  return omega, abs(omega - start)


def tf_select(*args, **kwargs):
  omega, steps, b_max, tau_max = bls.select_omega_tf(*args, **kwargs)
  return int(omega), int(steps), b_max.numpy(), tau_max.numpy()


# --- Eqs. (30)–(31) and the sizes ------------------------------------------------------------


@pytest.mark.parametrize('seed', range(4))
def test_layer_bounds_match_direct_norms(seed):
  rng = np.random.default_rng(seed)
  w, s = random_layers(rng), random_layers(rng)
  b_np, tau_np = np_layer_bounds(w, s)
  b_tf, tau_tf = bls.layer_bounds(w, s)
  assert b_tf.dtype == tf.float32 and b_tf.shape == (len(SHAPES),)
  np.testing.assert_allclose(b_tf.numpy(), b_np, rtol=1e-5)
  np.testing.assert_allclose(tau_tf.numpy(), tau_np, rtol=1e-5)
  b_fn, tau_fn = tf.function(bls.layer_bounds)(w, s)
  np.testing.assert_allclose(b_fn.numpy(), b_np, rtol=1e-5)
  np.testing.assert_allclose(tau_fn.numpy(), tau_np, rtol=1e-5)
  _, tau_same = bls.layer_bounds(w, w)
  np.testing.assert_array_equal(tau_same.numpy(), np.zeros(len(SHAPES)))


@pytest.mark.parametrize('shapes,columns,out_dims', [
    ([[(784, 200), (200,)], [(200, 10), (10,)]], [784, 200], [200, 10]),      # mlp2
    ([[(5, 5, 1, 32), (32,)], [(16,), (16,)]], [25, 16], [32, 16]),           # conv, norm
    ([[(3, 3, 2, 4), (4,)], [(7,)], [()]], [18, 7, 1], [4, 7, 1]),            # bias only, scalar
])
def test_layer_dimensions(shapes, columns, out_dims):
  assert bls.layer_dimensions(shapes) == (columns, out_dims)


# --- inequality (29) on hand-made values -----------------------------------------------------
#
# L = 3, n = (4, 9, 16) (square roots 2, 3, 4), d = (8, 4, 2), c = d^3 = 2. Stored bounds
# B = (1, 0.5, 4), τ = (2, 1, 8): every τ^l/(2B^l) = 1, so M = 3·4 + 4 + 1 = 17, and the right
# side Π_{l>Ω} B^l is 2, 4, 1 for Ω = 1, 2, 3. With this round's B̂ = 1 and τ̂ = 2x,
# τ̂^l/(2B̂^l) = x_l and M̂ = (x1, 3x1 + x2, 12x1 + 4x2 + x3), so (29) reads
#   Ω = 1: 3·8·x1 / (1·2·17·4) = 3x1/17 < 2                 ⟺ x1 < 11.33
#   Ω = 2: 3·4·(3x1 + x2) / (2·2·17·2) < 4                  ⟺ 3x1 + x2 < 45.33
#   Ω = 3: 3·2·M̂(3) / (3·2·17·1) < 1                        ⟺ 12x1 + 4x2 + x3 < 17
COLUMNS, OUT_DIMS = [4, 9, 16], [8, 4, 2]
B_STORED, TAU_STORED = np.array([1.0, 0.5, 4.0]), np.array([2.0, 1.0, 8.0])
B_ROUND = np.ones(3)
X = {  # x = τ̂/(2B̂) for the truth pattern of (29) at Ω = 1, 2, 3
    'TTT': [1.0, 0.0, 0.0],     # 3/17 < 2; 3 < 45.3; 12 < 17
    'TTF': [1.0, 2.0, 0.0],     # 3/17 < 2; 5 < 45.3; 20 ≥ 17
    'FTF': [12.0, 0.0, 0.0],    # 36/17 ≥ 2; 36 < 45.3; 144 ≥ 17
    'FFF': [12.0, 10.0, 0.0],   # 36/17 ≥ 2; 46 ≥ 45.3; 184 ≥ 17
    'TTE': [1.0, 1.0, 1.0],     # at Ω = 3 both sides are 1 (M̂(3) = 12 + 4 + 1 = M): fails
}


def criterion(*args):
  """Whether inequality (29) holds at each Ω (NaN sides: not satisfied, C6)."""
  log_lhs, log_rhs = bls.criterion_sides_tf(*args)
  return log_lhs < log_rhs


def tau_round(pattern):
  return 2.0 * np.array(X[pattern])


@pytest.mark.parametrize('pattern', sorted(X))
def test_criterion_on_hand_made_values(pattern):
  tau_hat = tau_round(pattern)
  x = np.array(X[pattern])
  m_hat = np.array([x[0], 3 * x[0] + x[1], 12 * x[0] + 4 * x[1] + x[2]])
  want_lhs = 3 * np.array([8, 4, 2]) * m_hat / (np.array([1, 2, 3]) * 2 * 17 * 2.0**np.array(
      [2, 1, 0]))
  want_rhs = np.array([2.0, 4.0, 1.0])
  np.testing.assert_allclose(np_criterion_sides(B_ROUND, tau_hat, B_STORED, TAU_STORED,
                                                COLUMNS, OUT_DIMS), (want_lhs, want_rhs))
  log_lhs, log_rhs = bls.criterion_sides_tf(B_ROUND, tau_hat, B_STORED, TAU_STORED, COLUMNS,
                                            OUT_DIMS)
  assert log_lhs.dtype == tf.float64 and log_lhs.shape == (3,)
  with np.errstate(divide='ignore'):
    np.testing.assert_allclose(log_lhs.numpy(), np.log(want_lhs), rtol=1e-12, atol=1e-12)
  np.testing.assert_allclose(log_rhs.numpy(), np.log(want_rhs), rtol=1e-12, atol=1e-12)
  got = criterion(B_ROUND, tau_hat, B_STORED, TAU_STORED, COLUMNS, OUT_DIMS).numpy()
  assert ''.join('T' if g else 'F' for g in got) == pattern.replace('E', 'F')


def test_criterion_strictness():
  # At Ω = 3 of 'TTE' both sides are 1 (c = d^3): 1 < 1 fails.
  tau_hat = tau_round('TTE')
  default = criterion(B_ROUND, tau_hat, B_STORED, TAU_STORED, COLUMNS, OUT_DIMS)
  np.testing.assert_array_equal(default.numpy(), [True, True, False])


@pytest.mark.parametrize('b_hat,tau_hat,b,tau,want', [
    # A layer with τ̂ = 0 adds nothing to M̂ (also when B̂ = 0): x = (0, 0, 0) → M̂ = 0 < ...
    ([0.0, 1.0, 1.0], [0.0, 0.0, 0.0], B_STORED, TAU_STORED, [True, True, True]),
    # τ̂ > 0 with B̂ = 0: M̂ = ∞ from that layer on.
    ([1.0, 0.0, 1.0], [0.0, 1.0, 0.0], B_STORED, TAU_STORED, [True, False, False]),
    # Stored τ = 0 everywhere: M = 0, 0/0 and x/0 are not "less than": nothing holds.
    ([1.0, 1.0, 1.0], [0.0, 1.0, 0.0], B_STORED, [0.0, 0.0, 0.0], [False, False, False]),
    # A stored B^3 = 0 makes the right side 0 for Ω = 1, 2: nothing is below 0.
    ([1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1.0, 0.5, 0.0], TAU_STORED, [False, False, True]),
])
def test_criterion_zero_conventions(b_hat, tau_hat, b, tau, want):
  got = criterion(b_hat, tau_hat, b, tau, COLUMNS, OUT_DIMS).numpy()
  np.testing.assert_array_equal(got, want)
  lhs, rhs = np_criterion_sides(b_hat, tau_hat, b, tau, COLUMNS, OUT_DIMS)
  np.testing.assert_array_equal(lhs < rhs, want)


def random_sizes(rng, length):
  return ([int(v) for v in rng.integers(1, 600, length)],
          [int(v) for v in rng.integers(1, 300, length)])


@pytest.mark.parametrize('seed', range(12))
def test_criterion_tf_matches_numpy(seed):
  rng = np.random.default_rng(300 + seed)
  length = int(rng.integers(1, 9))
  columns, out_dims = random_sizes(rng, length)
  b_hat, tau_hat, b, tau = (rng.uniform(0.05, 5, length) for _ in range(4))
  tau_hat[rng.random(length) < 0.2] = 0.0
  lhs, rhs = np_criterion_sides(b_hat, tau_hat, b, tau, columns, out_dims)
  log_lhs, log_rhs = tf.function(bls.criterion_sides_tf, reduce_retracing=True)(
      tf.constant(b_hat), tf.constant(tau_hat), tf.constant(b), tf.constant(tau), columns,
      out_dims)
  with np.errstate(divide='ignore'):
    np.testing.assert_allclose(log_lhs.numpy(), np.log(lhs), rtol=1e-10, atol=1e-10)
  np.testing.assert_allclose(log_rhs.numpy(), np.log(rhs), rtol=1e-10, atol=1e-10)
  np.testing.assert_array_equal(
      criterion(b_hat, tau_hat, b, tau, columns, out_dims).numpy(), lhs < rhs)


def test_criterion_does_not_overflow_for_deep_models():
  """ResNet-like sizes, 40 layers: Π sqrt(n) ≈ 68^39 and Π B^l overflow float32 (and the plain
  formula's products reach 1e71); in logarithms (29) is still decided."""
  length = 40
  columns, out_dims = [4608] * length, [512] * (length - 1) + [10]
  b = np.full(length, 60.0)
  got = criterion(b, 0.1 * b, b, 0.2 * b, columns, out_dims).numpy()
  assert got.shape == (length,) and got[:-1].all()   # Π_{l>Ω} 60 is huge for Ω < L
  assert got[-1]                                      # M̂(L) = M / 2 < M


# --- Algorithm 4's search (lines 15–24) ------------------------------------------------------

T, F = True, False


@pytest.mark.parametrize('satisfied,start,min_layers,expected', [
    ([T, T, F, T, T], 5, 1, (3, 2)),   # holds at 5 → 4 holds → 3 fails: stop on 3
    ([T, T, F, T, T], 4, 1, (3, 1)),
    ([T, T, F, T, T], 3, 1, (4, 1)),   # fails at 3 → 4 holds: stop on 4
    ([T, T, F, T, T], 2, 1, (1, 1)),   # holds → 1 holds too → min_layers reached (C3)
    ([T, T, F, T, T], 1, 1, (1, 0)),   # holds at min_layers: cannot go lower
    ([F, T, T, T, T], 4, 1, (1, 3)),   # down to the first failing Ω, not the last holding one
    ([F, T, T, T, T], 4, 2, (2, 2)),   # ... unless min_layers stops it first
    ([T, T, T, T, T], 4, 2, (2, 2)),
    ([F, F, F, F, F], 2, 1, (5, 3)),   # never holds: up to L (C3)
    ([F, F, F, F, T], 1, 1, (5, 4)),
    ([F, T, F, F, F], 4, 1, (5, 1)),   # up only: a holding Ω below the start is not looked at
    ([F, F, F, F, F], 5, 1, (5, 0)),   # fails at L: cannot go higher
    ([F, F, T, F, F], 0, 1, (3, 2)),   # the start is clipped into [min_layers, L]
    ([T, F, T, F, F], 9, 1, (5, 0)),
    ([F, F, T, F, F], 1, 2, (3, 1)),
    ([T], 1, 1, (1, 0)), ([F], 1, 1, (1, 0)),
])
def test_search_branches(satisfied, start, min_layers, expected):
  assert np_search(satisfied, start, min_layers) == expected
  omega, steps = bls.search_tf(np.array(satisfied), start, min_layers)
  assert omega.dtype == tf.int32 and steps.dtype == tf.int32
  assert (int(omega), int(steps)) == expected


@tf.function(input_signature=[tf.TensorSpec([None], tf.bool), tf.TensorSpec([], tf.int32),
                              tf.TensorSpec([], tf.int32)])
def search_in_graph(satisfied, start, min_layers):
  return bls.search_tf(satisfied, start, min_layers)


def random_patterns(count=120):
  rng = np.random.default_rng(2024)
  for _ in range(count):
    length = int(rng.integers(1, 10))
    yield (list(rng.random(length) < rng.uniform(0.1, 0.9)), int(rng.integers(-1, length + 2)),
           int(rng.integers(1, length + 1)))


@pytest.mark.parametrize('satisfied,start,min_layers', list(random_patterns()))
def test_search_tf_matches_numpy(satisfied, start, min_layers):
  omega, steps = search_in_graph(tf.constant(satisfied), tf.constant(start),
                                 tf.constant(min_layers))
  assert (int(omega), int(steps)) == np_search(satisfied, start, min_layers)


# --- Algorithm 4, branch by branch -----------------------------------------------------------


@pytest.mark.parametrize('pattern', sorted(X))
@pytest.mark.parametrize('omega_prev', [3, 4])
def test_branch_a_first_selection_returns_l_minus_1_without_search(pattern, omega_prev):
  """Lines 3–9: a client that never took part (Ω = L in its state, stored bounds 0) gets
  Ω = L − 1 whatever (29) says, no search steps, and the stored bounds are this round's."""
  tau = tau_round(pattern)
  want = (2, 0, B_ROUND, tau)
  got = tf_select(B_ROUND, tau, np.zeros(3), np.zeros(3), omega_prev, COLUMNS, OUT_DIMS)
  ref = np_select_omega(B_ROUND, tau, np.zeros(3), np.zeros(3), omega_prev, COLUMNS, OUT_DIMS)
  for result in (got, ref):
    assert result[:2] == want[:2]
    np.testing.assert_array_equal(result[2], want[2])
    np.testing.assert_array_equal(result[3], want[3])


def test_branch_a_after_full_upload_takes_elementwise_maxima():
  """Lines 4–6 after Ω = L: per layer, separately for B and τ, the larger of stored and new."""
  stored_b = np.array([2.0, 0.5, 1.0], np.float32)
  stored_tau = np.array([0.25, 3.0, 0.0], np.float32)
  b, tau = np.array([1.0, 0.75, 4.0]), np.array([0.5, 1.0, 5.0])
  omega, steps, b_max, tau_max = tf_select(b, tau, stored_b, stored_tau, 3, COLUMNS, OUT_DIMS)
  assert (omega, steps) == (2, 0)
  np.testing.assert_array_equal(b_max, [2.0, 0.75, 4.0])
  np.testing.assert_array_equal(tau_max, [0.5, 3.0, 5.0])
  assert b_max.dtype == np.float32  # The dtype of the stored bounds (client state).
  ref = np_select_omega(b, tau, stored_b, stored_tau, 3, COLUMNS, OUT_DIMS)
  np.testing.assert_array_equal(ref[2], b_max)
  np.testing.assert_array_equal(ref[3], tau_max)


@pytest.mark.parametrize('length,min_layers,expected', [
    (1, 1, 1),   # L − 1 = 0 is raised to min_layers (C3)
    (3, 3, 3),   # min_layers = L: always every layer
    (3, 2, 2),
    (4, 1, 3),
])
def test_branch_a_l_minus_1_within_bounds(length, min_layers, expected):
  ones = np.ones(length)
  got = tf_select(ones, ones, np.zeros(length), np.zeros(length), length, [4] * length,
                  [3] * length, min_layers=min_layers)
  assert got[:2] == (expected, 0)
  ref = np_select_omega(ones, ones, np.zeros(length), np.zeros(length), length, [4] * length,
                        [3] * length, min_layers=min_layers)
  assert ref[:2] == (expected, 0)


@pytest.mark.parametrize('pattern,omega_prev,min_layers,expected', [
    ('TTT', 2, 1, (1, 1)),   # holds at 2 → 1 holds too → min_layers: stop (C3)
    ('TTF', 2, 1, (1, 1)),
    ('FTF', 2, 1, (1, 1)),   # holds at 2 → 1 fails: the loop ends on the failing Ω = 1
    ('FTF', 1, 1, (2, 1)),   # fails at 1 → 2 holds
    ('FFF', 1, 1, (3, 2)),   # fails everywhere → up to L
    ('FFF', 2, 1, (3, 1)),
    ('TTT', 1, 1, (1, 0)),   # holds at min_layers: stays
    ('TTT', 2, 2, (2, 0)),   # ... also when min_layers is 2
    ('TTE', 2, 1, (1, 1)),
    ('TTE', 1, 1, (1, 0)),
])
def test_branch_b_searches_and_keeps_stored_bounds(pattern, omega_prev, min_layers, expected):
  """Lines 10–27: Ω^{k−1} < L: (29) with this round's (B̂, τ̂) and the stored (B, τ), the
  search from Ω^{k−1}, and the stored bounds returned unchanged (no maxima here)."""
  tau = tau_round(pattern)
  got = tf_select(B_ROUND, tau, B_STORED, TAU_STORED, omega_prev, COLUMNS, OUT_DIMS,
                  min_layers=min_layers)
  ref = np_select_omega(B_ROUND, tau, B_STORED, TAU_STORED, omega_prev, COLUMNS, OUT_DIMS,
                        min_layers=min_layers)
  for result in (got, ref):
    assert result[:2] == expected
    np.testing.assert_array_equal(result[2], B_STORED)
    np.testing.assert_array_equal(result[3], TAU_STORED)


def test_branch_b_ignores_larger_values_of_this_round():
  """This round's B, τ exceed the stored ones: branch B still keeps the stored values (the
  maxima are taken in branch A only), and they are what (29) compares against."""
  tau = tau_round('FTF') * 10
  b = B_ROUND * 10  # x unchanged: τ̂/(2B̂) = (12, 0, 0)
  omega, steps, b_max, tau_max = tf_select(b, tau, B_STORED, TAU_STORED, 1, COLUMNS, OUT_DIMS)
  assert (omega, steps) == (2, 1)
  np.testing.assert_array_equal(b_max, B_STORED)
  np.testing.assert_array_equal(tau_max, TAU_STORED)


def test_a_client_over_rounds_alternates_branches():
  """Round 1 (first selection): A → Ω = 2, stored = this round's. Round 2: B from Ω = 2 on
  'FFF' climbs to L = 3. Round 3: Ω^{k−1} = L: A again → Ω = 2 and new maxima. Round 4: B."""
  b_max, tau_max, omega = np.zeros(3, np.float32), np.zeros(3, np.float32), 3
  seen = []
  for b, tau in ((B_STORED, TAU_STORED), (B_ROUND, tau_round('FFF')),
                 (B_ROUND * 3, TAU_STORED * 0.5), (B_ROUND, tau_round('TTT'))):
    omega, steps, b_max, tau_max = tf_select(b, tau, b_max, tau_max, omega, COLUMNS, OUT_DIMS)
    seen.append((omega, steps, list(b_max), list(tau_max)))
  assert seen[0] == (2, 0, list(B_STORED), list(TAU_STORED))
  assert seen[1] == (3, 1, list(B_STORED), list(TAU_STORED))
  assert seen[2] == (2, 0, [3.0, 3.0, 4.0], list(TAU_STORED))
  # Round 4: stored B = (3, 3, 4), τ = (2, 1, 8): (29) recomputed against them.
  ref = np_select_omega(B_ROUND, tau_round('TTT'), seen[2][2], seen[2][3], 2, COLUMNS,
                        OUT_DIMS)
  assert seen[3][:2] == ref[:2]


def random_rounds(count=40):
  rng = np.random.default_rng(77)
  for _ in range(count):
    length = int(rng.integers(1, 7))
    columns, out_dims = random_sizes(rng, length)
    min_layers = int(rng.integers(1, length + 1))
    rounds = [(rng.uniform(0.1, 4, length), rng.uniform(0, 2, length) *
               (rng.random(length) > 0.15)) for _ in range(6)]
    yield length, columns, out_dims, min_layers, rounds


@tf.function(reduce_retracing=True)
def select_in_graph(b, tau, b_max, tau_max, omega_prev, columns, out_dims, min_layers):
  return bls.select_omega_tf(b, tau, b_max, tau_max, omega_prev, columns, out_dims,
                             min_layers=min_layers)


@pytest.mark.parametrize('length,columns,out_dims,min_layers,rounds', list(random_rounds()))
def test_select_omega_tf_matches_numpy_over_rounds(length, columns, out_dims, min_layers,
                                                   rounds):
  """A client's rounds in a `tf.function` (float64 state) against the line-by-line reference."""
  b_max, tau_max, omega = np.zeros(length), np.zeros(length), length
  tf_state = (tf.zeros([length], tf.float64), tf.zeros([length], tf.float64), length)
  for b, tau in rounds:
    omega, steps, b_max, tau_max = np_select_omega(b, tau, b_max, tau_max, omega, columns,
                                                   out_dims, min_layers=min_layers)
    got = select_in_graph(tf.constant(b), tf.constant(tau), tf_state[0], tf_state[1],
                          tf.constant(tf_state[2]), columns, out_dims, tf.constant(min_layers))
    assert (int(got[0]), int(got[1])) == (omega, steps)
    np.testing.assert_array_equal(got[2].numpy(), b_max)
    np.testing.assert_array_equal(got[3].numpy(), tau_max)
    tf_state = (got[2], got[3], int(got[0]))


def test_select_omega_runs_in_a_tff_computation():
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

  f32 = tff.TensorType(np.float32, [3])

  @tff.tensorflow.computation(f32, f32, f32, f32, np.int32)
  def select(b, tau, b_max, tau_max, omega_prev):
    omega, steps, b_max, tau_max = bls.select_omega_tf(b, tau, b_max, tau_max, omega_prev,
                                                       COLUMNS, OUT_DIMS)
    return omega, steps, b_max, tau_max, tf.range(3) < omega  # The upload mask (process.py).

  f = lambda x: np.asarray(x, np.float32)
  omega, steps, b_max, tau_max, mask = select(f(B_ROUND), f(tau_round('FTF')), f(B_STORED),
                                              f(TAU_STORED), 1)
  assert (int(omega), int(steps)) == (2, 1)
  np.testing.assert_array_equal(b_max, B_STORED)
  np.testing.assert_array_equal(mask, [True, True, False])
  omega, steps, b_max, tau_max, _ = select(f(B_ROUND), f(tau_round('FTF')), f(np.zeros(3)),
                                           f(np.zeros(3)), 3)
  assert (int(omega), int(steps)) == (2, 0)
  np.testing.assert_array_equal(tau_max, tau_round('FTF'))


# --- masks and bytes -------------------------------------------------------------------------
# NumPy references: r_ii^l from R, Algorithm 3's skip mask, the upload prefix and the bytes sent.


def self_relationships(relationship):
  """r_ii^l `[N, L]` from the relationship cube R `[N, L, N]` (R[i, l, j] = r_ij^l)."""
  n = relationship.shape[0]
  return relationship[np.arange(n), :, np.arange(n)]


def server_skip_mask(self_relationship, mu):
  return np.asarray(self_relationship) > mu


def upload_mask(omega, num_layers):
  return np.arange(num_layers) < omega


def layer_sizes(layers):
  return [int(sum(np.asarray(t).nbytes for t in layer)) for layer in layers]


def layer_bytes(sizes, mask):
  return int(np.sum(np.asarray(sizes, np.int64)[np.asarray(mask, bool)]))


def test_self_relationships_extracts_diagonal():
  rng = np.random.default_rng(0)
  cube = rng.uniform(size=(4, 3, 4))
  r = self_relationships(cube)
  assert r.shape == (4, 3)
  for i in range(4):
    np.testing.assert_array_equal(r[i], cube[i, :, i])


def test_server_skip_mask_mu_above_one_skips_nothing():
  rng = np.random.default_rng(0)
  cube = rng.uniform(size=(5, 4, 5))
  cube /= cube.sum(axis=2, keepdims=True)  # rows of R normalised: r_ij^l sums to 1 over j
  r = self_relationships(cube)
  assert not bls.server_skip_mask_tf(r, 1.01).numpy().any()
  assert not bls.server_skip_mask_tf(np.ones(4), 1.0).numpy().any()  # strict: r_ii = μ is sent


def test_server_skip_mask_constructed():
  r = np.array([[0.9, 0.5, 0.2, 0.51],
                [0.1, 1.0, 0.5, 0.0]])
  expected = np.array([[True, False, False, True],
                       [False, True, False, False]])
  np.testing.assert_array_equal(server_skip_mask(r, 0.5), expected)
  np.testing.assert_array_equal(bls.server_skip_mask_tf(r, 0.5).numpy(), expected)
  np.testing.assert_array_equal(bls.server_skip_mask_tf(r[0], 0.5).numpy(), expected[0])
  np.testing.assert_array_equal(
      bls.server_skip_mask_tf(tf.constant(r, tf.float32), 0.5).numpy(), expected)


def test_layer_bytes_reference():
  rng = np.random.default_rng(0)
  sizes = layer_sizes(random_layers(rng))
  assert sizes == [(5 * 4 + 4) * 4, (3 * 3 * 2 * 4 + 4) * 4, (4 * 3 + 3) * 4]
  assert layer_bytes(sizes, [True, False, True]) == sizes[0] + sizes[2]
  assert layer_bytes(sizes, upload_mask(2, 3)) == sizes[0] + sizes[1]
  skipped = bls.server_skip_mask_tf(np.array([0.9, 0.1, 0.1]), 0.5).numpy()
  assert layer_bytes(sizes, ~skipped) == sizes[1] + sizes[2]


@pytest.mark.parametrize('mu,min_layers,match', [
    (-0.1, 1, r'bls_mu must be in \[0, 1\]'), (float('nan'), 1, 'bls_mu'), (1.5, 1, 'bls_mu'),
    (0.5, 0, r'min_upload_layers must be in \[1, 3\]'), (0.5, 4, 'min_upload_layers'),
    (0.5, 1.5, 'min_upload_layers must be an integer'),
])
def test_selection_checks_its_settings_once(mu, min_layers, match):
  """μ and min_layers are checked where the method is built (the functions trust them)."""
  with pytest.raises(ConfigError, match=match):
    bls.BidirectionalSelection(mu, min_layers).check('kapc+bls', 3)
  bls.BidirectionalSelection(0.5, 3).check('kapc+bls', 3)
