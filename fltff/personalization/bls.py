"""BLS: KAPC's bidirectional layer selection (the KAPC + BLS paper, IEEE TMC 2024, §5).

Server (§5.1, Algorithm 3, `server_skip_mask_tf`): layer l is not sent to client i when
r_ii^l > μ. Client (§5.2, Definition 1, Algorithm 4, `select_omega_tf`): upload only the first
Ω_i layers; Eqs. (30)–(31) `layer_bounds`, inequality (29) `criterion_sides_tf`, lines 15–24
`search_tf`. `BidirectionalSelection` is both, KAPC+BLS's `process.LayerSelection`. Our reading,
reconstructions (R1–R4) and choices (C1–C7): docs/methods/personalised.md.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Union

import numpy as np
import tensorflow as tf

from fltff.config_checks import check_number
from fltff.personalization import process

TensorLike = Union[tf.Tensor, np.ndarray, float, int]


def _as_dtype(x: TensorLike, dtype: tf.DType) -> tf.Tensor:
  """`x` as a tensor of `dtype`; Python numbers converted directly (no float32 round trip)."""
  if isinstance(x, (tf.Tensor, tf.Variable)):
    return tf.cast(x, dtype)
  return tf.cast(tf.convert_to_tensor(np.asarray(x, dtype.as_numpy_dtype)), dtype)


def layer_bounds(weights_layers: Sequence[Sequence[TensorLike]],
                 server_layers: Sequence[Sequence[TensorLike]]) -> tuple[tf.Tensor, tf.Tensor]:
  """Returns `(B, τ)`, Eqs. (30)–(31): `[L]` Frobenius norms of w^l and w^l − s^l (weights' dtype).

  Args:
    weights_layers: By layer, the client's tensors after local training.
    server_layers: Same shapes: the regulariser received; for a layer the server skipped, the
      client's own layer at the round's start (C4).
  """
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
  """Returns `(columns, out_dims)`, n^l and d^l per layer (C5: the kernel's fan-in and last
  axis), from each layer's static shapes (Keras layout), e.g. `[[(784, 200), (200,)], ...]`."""
  columns, out_dims = [], []
  for shapes in layer_shapes:
    kernel = max((tuple(s) for s in shapes), key=len)  # The first of the highest rank.
    if len(kernel) >= 2:
      columns.append(int(np.prod(kernel[:-1], dtype=np.int64)))
      out_dims.append(int(kernel[-1]))
    else:
      size = int(kernel[0]) if kernel else 1
      columns.append(size)
      out_dims.append(size)
  return columns, out_dims


def _log_m_curve(tau: tf.Tensor, b: tf.Tensor, half_log_n: tf.Tensor) -> tf.Tensor:
  """log M̂(Ω) for Ω = 1..L: log Σ_{l≤Ω} τ^l/(2B^l) Π_{m=l+1}^{Ω} sqrt(n^m), as
  C(Ω) + logsumexp_{l≤Ω}(log(τ^l/(2B^l)) − C(l)) with C(Ω) = Σ_{m≤Ω} ½ log n^m."""
  cumulative = tf.cumsum(half_log_n)
  # log(τ^l / (2 B^l)) with τ = 0 → −∞ (also for B = 0) and τ > 0, B = 0 → +∞ (C6).
  positive = tau > 0
  log_half_ratio = tf.where(positive, tf.math.log(tf.where(positive, tau, tf.ones_like(tau))) -
                            tf.math.log(b) - np.log(2.0), tf.constant(-np.inf, tau.dtype))
  terms = log_half_ratio - cumulative                                            # [l]
  num_layers = tf.shape(tau)[0]
  below = tf.range(num_layers)[None, :] <= tf.range(num_layers)[:, None]          # [Ω, l]
  masked = tf.where(below, tf.broadcast_to(terms[None, :], [num_layers, num_layers]),
                    tf.constant(-np.inf, tau.dtype))
  # `reduce_logsumexp` gives −∞ for a row of −∞ and +∞ for a row holding +∞.
  return cumulative + tf.reduce_logsumexp(masked, axis=1)


def criterion_sides_tf(b_hat: TensorLike, tau_hat: TensorLike, b: TensorLike, tau: TensorLike,
                       columns: Sequence[int], out_dims: Sequence[int]
                       ) -> tuple[tf.Tensor, tf.Tensor]:
  """`(log_lhs, log_rhs)`: logs of inequality (29)'s sides at every Ω = 1..L (float64 `[L]`).

  Entry Ω − 1 is log `L d^Ω M̂(Ω) / (Ω c M 2^{L−Ω})` (c = d^L, C5; NaN where undefined, C6) and
  log `Π_{l>Ω} B^l` (0 at Ω = L). M̂(Ω) from this round's B̂, τ̂ (`b_hat`, `tau_hat`), M and the
  right side from the stored B, τ (Algorithm 4 lines 12–13); n^l, d^l from `layer_dimensions`.
  """
  num_layers = len(columns)
  b_hat, tau_hat, b, tau = (_as_dtype(x, tf.float64) for x in (b_hat, tau_hat, b, tau))
  half_log_n = tf.constant(0.5 * np.log(np.asarray(columns, np.float64)))
  log_m_hat = _log_m_curve(tau_hat, b_hat, half_log_n)                           # [Ω]
  log_m_full = _log_m_curve(tau, b, half_log_n)[-1]
  omegas = np.arange(1, num_layers + 1, dtype=np.float64)
  constant = tf.constant(np.log(num_layers) + np.log(np.asarray(out_dims, np.float64)) -
                         np.log(omegas) - np.log(out_dims[-1]) - (num_layers - omegas) * np.log(2.0))
  log_lhs = constant + log_m_hat - log_m_full
  # Σ_{l>Ω} log B^l, reversed exclusive cumulative sum (log 0 = −∞: a zero-norm layer gives 0).
  log_rhs = tf.cumsum(tf.math.log(b), exclusive=True, reverse=True)
  return log_lhs, log_rhs


def search_tf(satisfied: TensorLike, omega_prev: TensorLike,
              min_layers: TensorLike = 1) -> tuple[tf.Tensor, tf.Tensor]:
  """Algorithm 4, lines 15–24: `(Ω^k, |Ω^k − Ω_0|)` (int32) from (29)'s truth values.

  From Ω_0 = Ω^{k−1} clipped into [min_layers, L]: if (29) holds at Ω_0, Ω moves down and stops at
  the first Ω < Ω_0 where (29) fails, else up to the first Ω > Ω_0 where it holds. Both loops
  take at least one step and stop at the ends of [min_layers, L] (C3).

  Args:
    satisfied: bool `[L]`, entry Ω − 1 whether (29) holds at Ω (`criterion_sides_tf`).
    min_layers: Smallest Ω, in [1, L] (`BidirectionalSelection.check`).
  """
  satisfied = tf.convert_to_tensor(satisfied)
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
                    min_layers: TensorLike = 1
                    ) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor]:
  """Algorithm 4 for one client and round (branches A and B: docs/methods/personalised.md) from
  this round's B^l, τ^l `[L]` (`layer_bounds`), the stored ones (`b_max`, `tau_max`) and
  Ω^{k−1} (L for a new client, C2). `tf.where` picks one of both computed branches.

  Returns `(omega, steps, b_max, tau_max)`: int32 Ω^k and its moves (0 in branch A, C7), and the
  stored bounds for the next selection, in `b_max`'s dtype (float32 unless a float tensor).
  """
  num_layers = len(columns)
  b_max = tf.convert_to_tensor(b_max)
  dtype = b_max.dtype if b_max.dtype.is_floating else tf.float32
  b, tau, b_max, tau_max = (_as_dtype(x, dtype) for x in (b, tau, b_max, tau_max))
  omega_prev = tf.cast(omega_prev, tf.int32)
  min_layers = tf.cast(min_layers, tf.int32)
  full = omega_prev >= num_layers  # Line 3 (C2: q = 0 is Ω = L in a new client's state).
  # Branch A (lines 4–9).
  b_a, tau_a = tf.maximum(b, b_max), tf.maximum(tau, tau_max)
  omega_a = tf.maximum(tf.constant(num_layers - 1, tf.int32), min_layers)
  # Branch B (lines 11–24): this round's values are B̂, τ̂; the stored ones stay.
  log_lhs, log_rhs = criterion_sides_tf(b, tau, b_max, tau_max, columns, out_dims)
  satisfied = log_lhs < log_rhs  # Undefined sides (NaN) count as not satisfied (C6).
  omega_b, steps_b = search_tf(satisfied, omega_prev, min_layers)
  omega = tf.where(full, omega_a, omega_b)
  steps = tf.where(full, tf.constant(0, tf.int32), steps_b)
  return omega, steps, tf.where(full, b_a, b_max), tf.where(full, tau_a, tau_max)


def server_skip_mask_tf(self_relationship: TensorLike, mu: TensorLike) -> tf.Tensor:
  """Algorithm 3: True where layer l is NOT sent to the client, i.e. r_ii^l > μ.

  Args:
    self_relationship: r_ii^l, `[L]` for one client or `[P, L]` for P clients.
    mu: Threshold μ ≥ 0 (`BidirectionalSelection.check`). With rows of R normalised (r_ii ≤ 1),
      μ ≥ 1 skips nothing.
  """
  r = tf.convert_to_tensor(self_relationship)
  return r > _as_dtype(mu, r.dtype)


@dataclasses.dataclass(frozen=True)
class BidirectionalSelection(process.LayerSelection):
  """BLS in the personalised round: layers with r_ii^l > μ not sent, the first Ω_i uploaded;
  clients keep Algorithm 4's stored B^l, τ^l (`b_max`, `tau_max`, 0 at first: C1); a skipped
  layer's τ is against the own start model (C4). Measured: Ω (mean, per client), search steps,
  skipped fraction."""
  mu: float = 0.5
  min_layers: int = 1  # Ω's lower limit, in [1, L] (C3).
  name = 'bls'
  partial = True

  def check(self, name: str, num_layers: int) -> None:
    # The server compares μ with self-relations r_ii <= 1: above 1 it would never skip a layer.
    check_number(f'{name}.bls_mu', self.mu, low=0, high=1, hint='None disables BLS')
    check_number(f'{name}.min_upload_layers', self.min_layers, integer=True, low=1,
                 high=num_layers)

  def initial_client_state(self, num_layers: int) -> collections.OrderedDict:
    return collections.OrderedDict(b_max=np.zeros([num_layers], np.float32),
                                   tau_max=np.zeros([num_layers], np.float32))

  def skip(self, self_relation):
    return server_skip_mask_tf(self_relation, self.mu)

  def upload(self, personal, trained, reference):
    columns, out_dims = layer_dimensions([[w.shape.as_list() for w in layer] for layer in trained])
    b, tau = layer_bounds(trained, reference)
    omega, steps, b_max, tau_max = select_omega_tf(
        b, tau, personal['b_max'], personal['tau_max'], personal['omega'], columns, out_dims,
        min_layers=self.min_layers)
    return omega, collections.OrderedDict(search_steps=steps, b_max=b_max, tau_max=tau_max)

  def measurements(self, omega, skip, uploads):
    return collections.OrderedDict(
        omega_mean=tf.reduce_mean(tf.cast(omega, tf.float32)),
        search_steps_mean=tf.reduce_mean(tf.cast(uploads['search_steps'], tf.float32)),
        skipped_layer_fraction=tf.reduce_mean(tf.cast(skip, tf.float32)), omega=omega)
