"""BLS: bidirectional layer selection of KAPC (server skips layers, clients upload a prefix).

Source: the KAPC + BLS paper (IEEE TMC 2024), §5. Client i keeps a personal model w_i of L
layers (a layer is the list of its tensors, e.g. kernel and bias). The server keeps the
relationship cube R `[N, L, N]` and sends client i its personalised server model, layer by
layer s_i^l = Σ_j r_ij^l w_j^l, which regularises the client's local training. BLS saves
communication in both directions:

* Server side (§5.1, Algorithm 3): layer l is not sent to client i when its self-relationship
  r_ii^l exceeds μ. The client then trains that layer without a regulariser.
  `server_skip_mask_tf`.
* Client side (§5.2, Definition 1, inequality (29), Algorithm 4): after local training client i
  uploads only its first Ω_i layers. `select_omega_tf` is Algorithm 4 for one client and round;
  `layer_bounds` gives Eqs. (30)–(31), `criterion_sides_tf`/`criterion_tf` inequality (29) at
  every Ω, `search_tf` Algorithm 4's search (lines 15–24), `layer_dimensions` the per-layer
  sizes (29) needs; `upload_mask_tf` turns Ω into the layers that are sent.

Everything here is TensorFlow, usable inside a `tf.function`/TFF computation; the NumPy
references of Algorithms 3–4 and (29) are the test oracles in tests/test_bls.py.

How Algorithm 4 and inequality (29) are read line by line, what is reconstructed from the
garbled text (R1–R4) and what fltff chooses where the paper is silent (C1–C7): the BLS
section of docs/methods/personalised.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Union

import numpy as np
import tensorflow as tf

from fltff.errors import ConfigError

TensorLike = Union[tf.Tensor, np.ndarray, float, int]


# ---------------------------------------------------------------------------------------------
# Validation helpers.


def _is_python_number(x) -> bool:
  return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def _as_dtype(x: TensorLike, dtype: tf.DType) -> tf.Tensor:
  """`x` as a tensor of `dtype`; Python numbers converted directly (no float32 round trip)."""
  if isinstance(x, (tf.Tensor, tf.Variable)):
    return tf.cast(x, dtype)
  return tf.cast(tf.convert_to_tensor(np.asarray(x, dtype.as_numpy_dtype)), dtype)


def _check_min_layers(min_layers, num_layers) -> None:
  if _is_python_number(min_layers):
    if int(min_layers) != min_layers:
      raise ConfigError(f'BLS min_layers must be an integer, got {min_layers}.')
    if num_layers is not None and not 1 <= min_layers <= num_layers:
      raise ConfigError(f'BLS min_layers must be in [1, L={num_layers}], got {min_layers}.')
    if num_layers is None and min_layers < 1:
      raise ConfigError(f'BLS min_layers must be >= 1, got {min_layers}.')


def _check_layer_structure(weights_layers, server_layers) -> None:
  if len(weights_layers) != len(server_layers):
    raise ConfigError(f'BLS: the client model has {len(weights_layers)} layers, the server '
                      f'model {len(server_layers)}.')
  if not weights_layers:
    raise ConfigError('BLS: a model needs at least one layer.')
  for l, (w, s) in enumerate(zip(weights_layers, server_layers)):
    if len(w) != len(s):
      raise ConfigError(f'BLS: layer {l} has {len(w)} tensors in the client model and '
                        f'{len(s)} in the server model.')
    for a, b in zip(w, s):
      sa, sb = tuple(a.shape), tuple(b.shape)
      if None not in sa and None not in sb and sa != sb:
        raise ConfigError(f'BLS: layer {l} has a tensor of shape {sa} in the client model and '
                          f'{sb} in the server model.')


def _check_dimensions(columns, out_dims, num_classes, num_layers) -> None:
  """n^l, d^l: L positive integers each; c a positive integer (Python values)."""
  for name, values in (('columns', columns), ('out_dims', out_dims)):
    values = list(values)
    if num_layers is not None and len(values) != num_layers:
      raise ConfigError(f'BLS {name} has {len(values)} entries for L={num_layers} layers.')
    if not values:
      raise ConfigError('BLS: a model needs at least one layer.')
    if any(int(v) != v or v < 1 for v in values):
      raise ConfigError(f'BLS {name} must be positive integers, got {values}.')
  if len(list(columns)) != len(list(out_dims)):
    raise ConfigError(f'BLS columns has {len(list(columns))} entries, out_dims '
                      f'{len(list(out_dims))}.')
  if num_classes is not None and (int(num_classes) != num_classes or num_classes < 1):
    raise ConfigError(f'BLS num_classes must be a positive integer, got {num_classes}.')


# ---------------------------------------------------------------------------------------------
# Per-layer quantities: Eqs. (30)–(31) and the sizes in (29).


def layer_bounds(weights_layers: Sequence[Sequence[TensorLike]],
                 server_layers: Sequence[Sequence[TensorLike]]) -> tuple[tf.Tensor, tf.Tensor]:
  """(B, τ) per layer, Eqs. (30)–(31): B^l = ||w^l||_F and τ^l = ||w^l − s^l||_F, the Frobenius
  norms over all tensors of layer l together.

  Args:
    weights_layers: L lists of tensors, the client's model after local training, by layer.
    server_layers: L lists of tensors of the same shapes, the regulariser the client received
      (for a layer the server skipped, the caller passes the client's own layer at the
      round's start: module docstring, C4).

  Returns:
    `(B, tau)`, two tensors `[L]` in the dtype of the client's weights.

  Raises:
    ConfigError: The two models do not have the same layers and shapes.
  """
  _check_layer_structure(weights_layers, server_layers)
  b, tau = [], []
  for w_layer, s_layer in zip(weights_layers, server_layers):
    w_layer = [tf.convert_to_tensor(w) for w in w_layer]
    s_layer = [tf.cast(tf.convert_to_tensor(s), w.dtype) for w, s in zip(w_layer, s_layer)]
    b.append(tf.sqrt(tf.add_n([tf.reduce_sum(tf.square(w)) for w in w_layer])))
    tau.append(tf.sqrt(tf.add_n([tf.reduce_sum(tf.square(w - s))
                                 for w, s in zip(w_layer, s_layer)])))
  return tf.stack(b), tf.stack(tau)


def layer_dimensions(layer_shapes: Sequence[Sequence[Sequence[int]]]
                     ) -> tuple[list[int], list[int]]:
  """(n^l, d^l) per layer from its tensors' static shapes (module docstring, C5).

  Args:
    layer_shapes: L lists of shapes (Keras layout), e.g. `[[(784, 200), (200,)], ...]`.

  Returns:
    `(columns, out_dims)`: n^l, the fan-in of the layer's kernel (the product of all its axes
    but the last), and d^l, its last axis; n^l = d^l = length for a layer of vectors only.

  Raises:
    ConfigError: No layers, a layer without tensors, or an unknown or zero dimension.
  """
  if not layer_shapes:
    raise ConfigError('BLS: a model needs at least one layer.')
  columns, out_dims = [], []
  for l, shapes in enumerate(layer_shapes):
    shapes = [tuple(s) for s in shapes]
    if not shapes:
      raise ConfigError(f'BLS: layer {l} has no tensors.')
    kernel = max(shapes, key=len)  # The first of the highest rank.
    if any(d is None or d < 1 for d in kernel):
      raise ConfigError(f'BLS: layer {l} has a kernel of shape {kernel}; sizes must be known '
                        'and positive.')
    if len(kernel) >= 2:
      columns.append(int(np.prod(kernel[:-1], dtype=np.int64)))
      out_dims.append(int(kernel[-1]))
    else:
      size = int(kernel[0]) if kernel else 1
      columns.append(size)
      out_dims.append(size)
  return columns, out_dims


# ---------------------------------------------------------------------------------------------
# Inequality (29).


def _log_half_ratio(tau: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
  """log(τ^l / (2 B^l)) with τ = 0 → −∞ (also for B = 0) and τ > 0, B = 0 → +∞ (C6)."""
  neg_inf = tf.fill(tf.shape(tau), tf.constant(-np.inf, tau.dtype))
  positive = tau > 0
  safe_tau = tf.where(positive, tau, tf.ones_like(tau))
  return tf.where(positive, tf.math.log(safe_tau) - tf.math.log(b) - np.log(2.0), neg_inf)


def _log_m_curve(tau: tf.Tensor, b: tf.Tensor, half_log_n: tf.Tensor) -> tf.Tensor:
  """log M̂(Ω) for Ω = 1..L: log Σ_{l≤Ω} τ^l/(2B^l) Π_{m=l+1}^{Ω} sqrt(n^m), as
  C(Ω) + logsumexp_{l≤Ω}(log(τ^l/(2B^l)) − C(l)) with C(Ω) = Σ_{m≤Ω} ½ log n^m."""
  cumulative = tf.cumsum(half_log_n)
  terms = _log_half_ratio(tau, b) - cumulative                                   # [l]
  num_layers = tf.shape(tau)[0]
  below = tf.range(num_layers)[None, :] <= tf.range(num_layers)[:, None]          # [Ω, l]
  masked = tf.where(below, tf.broadcast_to(terms[None, :], [num_layers, num_layers]),
                    tf.constant(-np.inf, tau.dtype))
  # `reduce_logsumexp` gives −∞ for a row of −∞ and +∞ for a row holding +∞.
  return cumulative + tf.reduce_logsumexp(masked, axis=1)


def criterion_sides_tf(b_hat: TensorLike, tau_hat: TensorLike, b: TensorLike, tau: TensorLike,
                       columns: Sequence[int], out_dims: Sequence[int],
                       num_classes: Union[int, None] = None) -> tuple[tf.Tensor, tf.Tensor]:
  """The logarithms of the two sides of inequality (29) at every Ω = 1..L (float64 `[L]`).

  Args:
    b_hat: B̂^l `[L]`, this round's layer norms (M̂(Ω), Algorithm 4 line 12).
    tau_hat: τ̂^l `[L]`, this round's distances to the received regulariser.
    b: B^l `[L]`, the stored full-layer bounds (M and the product on the right, line 13).
    tau: τ^l `[L]`, the stored full-layer bounds (M).
    columns: n^l, L positive integers (`layer_dimensions`).
    out_dims: d^l, L positive integers.
    num_classes: c (default d^L; module docstring, C5).

  Returns:
    `(log_lhs, log_rhs)`: entry Ω − 1 is log of `L d^Ω M̂(Ω) / (Ω c M 2^{L−Ω})` and of
    `Π_{l>Ω} B^l` (0 at Ω = L). NaN where the left side is undefined (C6).

  Raises:
    ConfigError: Bad sizes (checked in Python), or vectors of a static length other than L.
  """
  columns, out_dims = list(columns), list(out_dims)
  _check_dimensions(columns, out_dims, num_classes, None)
  num_layers = len(columns)
  vectors = [_as_dtype(x, tf.float64) for x in (b_hat, tau_hat, b, tau)]
  for name, x in zip(('b_hat', 'tau_hat', 'b', 'tau'), vectors):
    if x.shape.rank is not None and (x.shape.rank != 1 or
                                     x.shape[0] not in (None, num_layers)):
      raise ConfigError(f'BLS {name} must be a vector [L={num_layers}], got shape {x.shape}.')
  b_hat, tau_hat, b, tau = vectors
  c = float(out_dims[-1] if num_classes is None else num_classes)
  half_log_n = tf.constant(0.5 * np.log(np.asarray(columns, np.float64)))
  log_m_hat = _log_m_curve(tau_hat, b_hat, half_log_n)                           # [Ω]
  log_m_full = _log_m_curve(tau, b, half_log_n)[-1]
  omegas = np.arange(1, num_layers + 1, dtype=np.float64)
  constant = tf.constant(np.log(num_layers) + np.log(np.asarray(out_dims, np.float64)) -
                         np.log(omegas) - np.log(c) - (num_layers - omegas) * np.log(2.0))
  log_lhs = constant + log_m_hat - log_m_full
  log_b = tf.math.log(b)  # log 0 = −∞: a zero-norm layer makes the right side 0.
  # Σ_{l>Ω} log B^l: reversed exclusive cumulative sum.
  log_rhs = tf.cumsum(log_b, exclusive=True, reverse=True)
  return log_lhs, log_rhs


def criterion_tf(b_hat: TensorLike, tau_hat: TensorLike, b: TensorLike, tau: TensorLike,
                 columns: Sequence[int], out_dims: Sequence[int],
                 num_classes: Union[int, None] = None) -> tf.Tensor:
  """Whether inequality (29) holds at each Ω = 1..L (bool `[L]`); arguments as
  `criterion_sides_tf`. Undefined sides (NaN) count as not satisfied (C6)."""
  log_lhs, log_rhs = criterion_sides_tf(b_hat, tau_hat, b, tau, columns, out_dims,
                                        num_classes)
  return log_lhs < log_rhs


# ---------------------------------------------------------------------------------------------
# Algorithm 4.


def search_tf(satisfied: TensorLike, omega_prev: TensorLike,
              min_layers: TensorLike = 1) -> tuple[tf.Tensor, tf.Tensor]:
  """Algorithm 4, lines 15–24: the search from the previous Ω on (29)'s truth values.

  Starting at Ω_0 = Ω^{k−1} (clipped into [min_layers, L]): if (29) holds at Ω_0, Ω moves
  down one layer at a time and stops at the first Ω < Ω_0 where (29) fails; otherwise it moves
  up and stops at the first Ω > Ω_0 where (29) holds. Both loops take at least one step and
  stop at the ends of [min_layers, L] (module docstring, C3).

  Args:
    satisfied: bool `[L]`, entry Ω − 1 whether (29) holds at Ω (`criterion_tf`).
    omega_prev: Ω^{k−1}, int scalar (tensor or Python).
    min_layers: Smallest Ω, in [1, L].

  Returns:
    `(omega, steps)`: int32 scalars, Ω^k and |Ω^k − Ω_0|.

  Raises:
    ConfigError: `satisfied` is not a non-empty vector, or min_layers is outside [1, L]
      (checked where known in Python).
  """
  satisfied = tf.convert_to_tensor(satisfied)
  if satisfied.dtype != tf.bool:
    raise ConfigError(f'BLS satisfied must be a bool vector [L], got {satisfied.dtype}.')
  if satisfied.shape.rank not in (None, 1) or (satisfied.shape.rank == 1 and
                                               satisfied.shape[0] == 0):
    raise ConfigError(f'BLS satisfied must be a non-empty vector [L], got shape '
                      f'{satisfied.shape}.')
  _check_min_layers(min_layers, satisfied.shape[0] if satisfied.shape.rank == 1 else None)
  num_layers = tf.shape(satisfied, out_type=tf.int32)[0]
  min_layers = tf.cast(min_layers, tf.int32)
  start = tf.clip_by_value(tf.cast(omega_prev, tf.int32), min_layers, num_layers)
  omegas = tf.range(1, num_layers + 1)
  # Lines 16–19: the largest Ω in [min_layers, start − 1] where (29) fails, else min_layers.
  fails_below = (omegas < start) & (omegas >= min_layers) & tf.logical_not(satisfied)
  down = tf.reduce_max(tf.where(fails_below, omegas, min_layers))
  # Lines 20–23: the smallest Ω in [start + 1, L] where (29) holds, else L.
  holds_above = (omegas > start) & satisfied
  up = tf.reduce_min(tf.where(holds_above, omegas, num_layers))
  omega = tf.where(tf.gather(satisfied, start - 1), down, up)
  return omega, tf.abs(omega - start)


def select_omega_tf(b: TensorLike, tau: TensorLike, b_max: TensorLike, tau_max: TensorLike,
                    omega_prev: TensorLike, columns: Sequence[int], out_dims: Sequence[int],
                    num_classes: Union[int, None] = None, min_layers: TensorLike = 1
                    ) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor]:
  """Algorithm 4 for one client and round (module docstring): usable in a TFF computation.

  Branch A (Ω^{k−1} = L: the last upload was complete, or the client never took part — C2):
  the stored bounds become max(stored, this round's), Ω^k = L − 1 (at least min_layers), no
  search. Branch B (otherwise): the stored bounds are kept as they are, (29) is evaluated with
  this round's (B, τ) as (B̂, τ̂) and the stored ones as (B, τ), and `search_tf` runs from
  Ω^{k−1}. Both branches are computed and `tf.where` picks one (no data-dependent control flow
  in the graph); branch A's results do not depend on (29).

  Args:
    b: This round's B^l `[L]` (Eq. 30, `layer_bounds`).
    tau: This round's τ^l `[L]` (Eq. 31).
    b_max: The stored B^l `[L]` before this round (0 before the client's first selection).
    tau_max: The stored τ^l `[L]` before this round.
    omega_prev: Ω^{k−1} (L for a client that never took part).
    columns: n^l, L positive integers (`layer_dimensions`).
    out_dims: d^l, L positive integers.
    num_classes: c (default d^L).
    min_layers: Smallest Ω, in [1, L].

  Returns:
    `(omega, steps, b_max, tau_max)`: int32 Ω^k and its moves (0 in branch A), and the stored
    bounds to keep for the client's next selection, in the dtype of `b_max` (float32 unless
    it is a float tensor of another type).

  Raises:
    ConfigError: Bad sizes or min_layers (checked where known in Python).
  """
  columns, out_dims = list(columns), list(out_dims)
  _check_dimensions(columns, out_dims, num_classes, None)
  num_layers = len(columns)
  _check_min_layers(min_layers, num_layers)
  b_max = tf.convert_to_tensor(b_max)
  dtype = b_max.dtype if b_max.dtype.is_floating else tf.float32
  b, tau = _as_dtype(b, dtype), _as_dtype(tau, dtype)
  b_max, tau_max = _as_dtype(b_max, dtype), _as_dtype(tau_max, dtype)
  for name, x in (('b', b), ('tau', tau), ('b_max', b_max), ('tau_max', tau_max)):
    if x.shape.rank is not None and (x.shape.rank != 1 or
                                     x.shape[0] not in (None, num_layers)):
      raise ConfigError(f'BLS {name} must be a vector [L={num_layers}], got shape {x.shape}.')
  omega_prev = tf.cast(omega_prev, tf.int32)
  min_layers = tf.cast(min_layers, tf.int32)
  full = omega_prev >= num_layers  # Line 3 (C2: q = 0 is Ω = L in a new client's state).
  # Branch A (lines 4–9).
  b_a, tau_a = tf.maximum(b, b_max), tf.maximum(tau, tau_max)
  omega_a = tf.maximum(tf.constant(num_layers - 1, tf.int32), min_layers)
  # Branch B (lines 11–24): this round's values are B̂, τ̂; the stored ones stay.
  satisfied = criterion_tf(b, tau, b_max, tau_max, columns, out_dims, num_classes)
  omega_b, steps_b = search_tf(satisfied, omega_prev, min_layers)
  omega = tf.where(full, omega_a, omega_b)
  steps = tf.where(full, tf.constant(0, tf.int32), steps_b)
  return omega, steps, tf.where(full, b_a, b_max), tf.where(full, tau_a, tau_max)


# ---------------------------------------------------------------------------------------------
# Masks and communication.


def _check_mu(mu) -> None:
  if _is_python_number(mu) and not mu >= 0:
    raise ConfigError(f'BLS mu must be >= 0, got {mu}.')


def server_skip_mask_tf(self_relationship: TensorLike, mu: TensorLike) -> tf.Tensor:
  """Algorithm 3: True where layer l is NOT sent to the client, i.e. r_ii^l > μ.

  Args:
    self_relationship: r_ii^l, `[L]` for one client or `[P, L]` for P clients.
    mu: Threshold μ ≥ 0. With rows of R normalised (r_ii ≤ 1), μ ≥ 1 skips nothing.

  Raises:
    ConfigError: μ < 0 (or NaN), or `self_relationship` is not `[L]` or `[P, L]`.
  """
  _check_mu(mu)
  r = tf.convert_to_tensor(self_relationship)
  if not r.dtype.is_floating:
    r = tf.cast(r, tf.float32)
  if r.shape.rank not in (None, 1, 2):
    raise ConfigError(f'BLS self_relationship must be [L] or [P, L], got shape {r.shape}.')
  return r > _as_dtype(mu, r.dtype)


def upload_mask_tf(omega: TensorLike, num_layers: TensorLike) -> tf.Tensor:
  """bool `[L]`, True for the first Ω layers (the ones the client uploads). Ω and L may be
  tensors; checked when Python numbers."""
  if _is_python_number(num_layers) and _is_python_number(omega):
    if num_layers < 1:
      raise ConfigError(f'BLS num_layers must be >= 1, got {num_layers}.')
    if not 0 <= omega <= num_layers:
      raise ConfigError(f'BLS omega must be in [0, L={num_layers}], got {omega}.')
  return tf.range(tf.cast(num_layers, tf.int32)) < tf.cast(omega, tf.int32)
