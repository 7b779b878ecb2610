"""Dense kernels trained in factored form on vectorised clients.

A dense layer's kernel gradient at a step is the rank-B product `G_t = x_tᵀ δ_t` of its inputs
`x_t [B, in]` and the loss's gradient `δ_t [B, out]` at its pre-activations. Under TFF's SGD(M)
(`a ← μ a + g`, `w ← w − η a`), with no regulariser (FedAvg) or an affine one with one scale `c`
per tensor (`g = G_t + c (w − A)`: FedProx towards the global model, KAPC towards s_i), every
client's kernel and momentum stay in the span of `D = W_0 − A` and the `G_j`:
`w_t = W_0 + α_t D + Σ_j β_tj G_j`, `a_t = a_t^D D + Σ_j γ_tj G_j`, and a step updates the
coefficients in closed form (`FactoredKernels.advance`). The forward pass computes
`x w_t = x W_0 + α (x W_0 − x A) + ((x Xᵀ) ⊙ β) Δ` from the round's history `X [T·B, in]` of
inputs and `Δ [T·B, out]` of δs (the gradient w.r.t. a zero added to the pre-activations); the
kernel is formed once, at the round's end. When every client starts from the global model,
`x W_0` is one matmul.

Per step this trades the `[K, in, out]` kernel gradients and SGD(M) pass (about seven
kernel-sized memory passes) for products with the growing `[K, T·B, in + out]` history: worth
it while `T·B (in + out) ≤ in · out` (`worth_factoring`; mlp2's 784 × 200 kernel: ≤ 159 rows).
Equal to the per-step update to float rounding (tests/test_factored_dense.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Callable, Optional

import tensorflow as tf

from fltff.errors import ConfigError
from fltff.learning.stacked_optimizer import client_mask


def dense_kernels(slots: Sequence[tuple[object, str]], frozen: frozenset = frozenset()
                  ) -> dict[int, tuple[int, int]]:
  """`{trainable index: (in, out)}` of the unfrozen plain `Dense` kernels among `slots`."""
  return {i: tuple(int(d) for d in layer.kernel.shape) for i, (layer, name) in enumerate(slots)
          if i not in frozen and type(layer) is tf.keras.layers.Dense and name == 'kernel'}


def worth_factoring(fan_in: int, fan_out: int, rows: int) -> bool:
  """Whether `rows` history rows (steps × batch) make factoring an `[in, out]` kernel cheaper
  (module docstring)."""
  return rows * (fan_in + fan_out) <= fan_in * fan_out


def dense_call(layer: tf.keras.layers.Dense, product: Callable[[tf.Tensor], tf.Tensor]):
  """`layer`'s `Dense.call` with `product(x)` for `x @ kernel`; `ConfigError` unless rank 2."""

  def call(inputs):
    inputs = tf.convert_to_tensor(inputs)
    if inputs.shape.rank != 2:
      raise ConfigError(f'factored dense kernels need rank-2 inputs to {layer.name}; got '
                        f'shape {inputs.shape}.')
    inputs = tf.cast(inputs, layer.compute_dtype)
    outputs = product(inputs)
    if layer.use_bias:
      outputs = tf.nn.bias_add(outputs, layer.bias)
    if layer.activation is not None:
      outputs = layer.activation(outputs)
    return outputs

  return call


@dataclasses.dataclass(frozen=True)
class FactoredKernels:
  """One round's factored kernels (`learning.vectorized`); `with_anchor`: they carry the
  `D = W_0 − A` term (clients with their own start weights and an anchored regulariser)."""

  indices: tuple[int, ...]
  learning_rate: float
  momentum: Optional[float]
  with_anchor: bool

  def initial_state(self, weights: Sequence[tf.Tensor], k, steps, batch) -> tuple:
    """Per index `(X, Δ, β [K, T], γ [K, T], α [K], a^D [K])`, zeros, for T = `steps` of `batch`
    examples; X, Δ are `tf.TensorArray`s of `[K, B, in|out]` per step (a write copies nothing)."""
    state = []
    for i in self.indices:
      fan_in, fan_out = weights[i].shape[-2], weights[i].shape[-1]
      dtype = weights[i].dtype

      def history(width, dtype=dtype):
        # Zeros: every step's element exists when the prefix is gathered.
        return tf.TensorArray(dtype, size=steps, clear_after_read=False,
                              element_shape=tf.TensorShape([None, None, width])).unstack(
                                  tf.zeros([steps, k, batch, width], dtype))

      state.append((history(fan_in), history(fan_out),
                    tf.zeros([k, steps], dtype), tf.zeros([k, steps], dtype),
                    tf.zeros([k], dtype), tf.zeros([k], dtype)))
    return tuple(state)

  @staticmethod
  def client_rows(state, t) -> tuple:
    """The clients' map's input per index at step `t`: `(X [K, t', B, in], Δ [K, t', B, out],
    β [K, t'], α [K])` for the steps before `t` only (t' = max(t, 1): one zero step at 0)."""
    steps = tf.maximum(t, 1)

    def prefix(history):
      return tf.transpose(history.gather(tf.range(steps)), [1, 0, 2, 3])

    return tuple((prefix(x), prefix(d), beta[:, :steps], alpha)
                 for x, d, beta, _, alpha, _ in state)

  @staticmethod
  def product(x: tf.Tensor, base: tf.Tensor, rows, anchor: Optional[tf.Tensor],
              probe: tf.Tensor) -> tf.Tensor:
    """One client's `x w_t` (module docstring) plus `probe` (zeros: its gradient is δ); `base`
    W_0 (gradient stopped), `rows` `(X [T, B, in], Δ [T, B, out], β [T], α)`, `anchor` A or None."""
    history_x, history_d, beta, alpha = rows
    z = tf.matmul(x, tf.stop_gradient(base))
    if anchor is not None:
      z += alpha * (z - tf.matmul(x, tf.stop_gradient(anchor)))
    steps, batch = tf.shape(history_x)[0], tf.shape(history_x)[1]
    history_x = tf.reshape(history_x, [steps * batch, history_x.shape[-1]])
    history_d = tf.reshape(history_d, [steps * batch, history_d.shape[-1]])
    weight = tf.reshape(tf.repeat(beta, batch), [1, -1])
    return z + tf.matmul(tf.matmul(x, history_x, transpose_b=True) * weight, history_d) + probe

  def advance(self, state, t, factors, scales, trains: tf.Tensor) -> tuple:
    """The state after step `t`: `factors` `(x_t, δ_t)` (`[K, B, ...]` per index) written to the
    history, coefficients stepped with scales `c` (`[K]` per index; zeros without a
    regulariser); clients not in `trains` keep theirs. `ValueError` unless `c` is `[K]`."""
    lr = self.learning_rate
    new_state = []
    for (hx, hd, beta, gamma, alpha, alpha_acc), (x, d), c in zip(state, factors, scales):
      hx, hd = hx.write(t, x), hd.write(t, d)
      c = tf.convert_to_tensor(c, beta.dtype)
      if c.shape.rank != 1:
        raise ValueError(f'factored kernels need one regulariser scale per client and tensor; '
                         f'got shape {c.shape}.')
      new_step = tf.one_hot(t, tf.shape(beta)[1], dtype=beta.dtype)[tf.newaxis]
      if self.momentum is None:
        new_beta = beta - lr * (new_step + c[:, tf.newaxis] * beta)
        new_alpha = alpha - lr * c * (1.0 + alpha)
        new_gamma, new_alpha_acc = gamma, alpha_acc
      else:
        new_gamma = self.momentum * gamma + new_step + c[:, tf.newaxis] * beta
        new_alpha_acc = self.momentum * alpha_acc + c * (1.0 + alpha)
        new_beta = beta - lr * new_gamma
        new_alpha = alpha - lr * new_alpha_acc
      keep = lambda new, old: tf.where(client_mask(trains, new.shape.rank), new, old)
      new_state.append((hx, hd, keep(new_beta, beta), keep(new_gamma, gamma),
                        keep(new_alpha, alpha), keep(new_alpha_acc, alpha_acc)))
    return tuple(new_state)

  def kernels(self, state, bases: Sequence[tf.Tensor], anchors: Sequence[Optional[tf.Tensor]]
              ) -> list[tf.Tensor]:
    """The trained kernels `[K, in, out]`, `W_0 + α D + Xᵀ (β ⊙ Δ)`, from start kernels `bases`
    (`[K, in, out]`, or `[in, out]` shared) and `anchors`."""
    out = []
    for (hx, hd, beta, _, alpha, _), base, anchor in zip(state, bases, anchors):
      hx = tf.transpose(hx.stack(), [1, 0, 2, 3])
      hd = tf.transpose(hd.stack(), [1, 0, 2, 3])
      k, steps, batch = tf.shape(hx)[0], tf.shape(hx)[1], tf.shape(hx)[2]
      history_x = tf.reshape(hx, [k, steps * batch, hx.shape[-1]])
      history_d = tf.reshape(hd * beta[:, :, tf.newaxis, tf.newaxis],
                             [k, steps * batch, hd.shape[-1]])
      kernel = base + tf.matmul(history_x, history_d, transpose_a=True)
      if anchor is not None:
        kernel += alpha[:, tf.newaxis, tf.newaxis] * (base - anchor)
      out.append(kernel)
    return out
