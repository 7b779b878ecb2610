"""Dense kernels trained in factored form on vectorised clients.

A dense layer's kernel gradient at a local step is the rank-B product `G_t = x_tᵀ δ_t` of the
step's layer inputs `x_t [B, in]` and the loss's gradient `δ_t [B, out]` with respect to the
layer's pre-activations. Under TFF's SGD(M) (`a ← μ a + g`, `w ← w − η a`), with an affine
regulariser term whose scale `c` is one number per tensor (`g = G_t + c (w − A)`: FedProx
towards the global model, KAPC's proximal term towards the client's s_i; none for FedAvg),
every client's kernel and momentum stay in the span of `D = W_0 − A` and the `G_j`:

    w_t = W_0 + α_t D + Σ_j β_tj G_j,        a_t = a_t^D D + Σ_j γ_tj G_j,

and the step maps the span to itself: `γ ← μ γ + e_t + c β`, `a^D ← μ a^D + c (1 + α)`,
`β ← β − η γ`, `α ← α − η a^D` (without momentum `β ← β − η (e_t + c β)`, `α ← α − η c (1 + α)`).
So the clients' kernels need not be formed at every step. The forward pass computes

    x w_t = x W_0 + α (x W_0 − x A) + ((x Xᵀ) ⊙ β) Δ

from the round's history `X [T·B, in]` of layer inputs and `Δ [T·B, out]` of pre-activation
gradients (`δ` is read as the gradient of the loss with respect to a zero tensor added to the
pre-activations), and the kernel is formed once, at the end of the round. When every client
starts from the global model, `x W_0` is one matmul for all clients.

This pays where the round's history is small against the kernel: it replaces, per step, the
`[K, in, out]` kernel gradients and the SGD(M) pass over the clients' kernels and
accumulators (about seven kernel-sized memory passes) by products with the `[K, T·B, in +
out]` history, whose cost grows with the step. `worth_factoring` takes a kernel when the
round's rows `T·B` satisfy `T·B (in + out) ≤ in · out` (mlp2's 784 × 200 hidden kernel: up to
159 rows, e.g. 6 steps of 10 at 100 clients × 60 examples; not the 600 rows of 10 × 600).
The numbers are the per-step update's up to float rounding (tests/test_factored_dense.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Callable, Optional

import tensorflow as tf

from fltff.errors import ConfigError


def dense_kernels(slots: Sequence[tuple[object, str]], frozen: frozenset = frozenset()
                  ) -> dict[int, tuple[int, int]]:
  """`{trainable index: (in, out)}` of the kernels of plain Keras `Dense` layers among the
  weight `slots` (`(layer, attribute)` per trainable weight), frozen ones left out."""
  kernels = {}
  for i, (layer, name) in enumerate(slots):
    if i not in frozen and type(layer) is tf.keras.layers.Dense and name == 'kernel':
      fan_in, fan_out = (int(d) for d in layer.kernel.shape)
      kernels[i] = (fan_in, fan_out)
  return kernels


def worth_factoring(fan_in: int, fan_out: int, rows: int) -> bool:
  """Whether a round with `rows` history rows (steps × batch) trains an `[in, out]` kernel
  cheaper in factored form: the history's products `rows·(in + out)` per example against the
  kernel's `in·out` (module docstring)."""
  return rows * (fan_in + fan_out) <= fan_in * fan_out


def dense_call(layer: tf.keras.layers.Dense, product: Callable[[tf.Tensor], tf.Tensor]):
  """A `call` for `layer` that computes `product(x)` in place of `x @ kernel`, then the
  layer's bias and activation, as `Dense.call` does for rank-2 inputs."""

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
  """The factored kernels of one round's training (`learning.vectorized`): which trainable
  indices, the SGD(M) hyperparameters, and whether the kernels carry the `D = W_0 − A` term
  (clients with their own start weights and an anchored regulariser)."""

  indices: tuple[int, ...]
  learning_rate: float
  momentum: Optional[float]
  with_anchor: bool

  def initial_state(self, weights: Sequence[tf.Tensor], k, steps, batch) -> tuple:
    """Per index `(X, Δ, β [K, T], γ [K, T], α [K], a^D [K])`, zeros, for `steps` (T) steps of
    `batch` examples: the histories are `tf.TensorArray`s of a `[K, B, in]` (`[K, B, out]`)
    element per step, so writing a step does not copy the history."""
    state = []
    for i in self.indices:
      fan_in, fan_out = weights[i].shape[-2], weights[i].shape[-1]
      dtype = weights[i].dtype

      def history(width, dtype=dtype):
        # Zeros to start with: every step's element exists when the prefix is gathered.
        return tf.TensorArray(dtype, size=steps, clear_after_read=False,
                              element_shape=tf.TensorShape([None, None, width])).unstack(
                                  tf.zeros([steps, k, batch, width], dtype))

      state.append((history(fan_in), history(fan_out),
                    tf.zeros([k, steps], dtype), tf.zeros([k, steps], dtype),
                    tf.zeros([k], dtype), tf.zeros([k], dtype)))
    return tuple(state)

  @staticmethod
  def client_rows(state, t) -> tuple:
    """What the clients' map gets per index at step `t`: `(X [K, t', B, in], Δ [K, t', B,
    out], β [K, t'], α [K])` for the steps before `t` (t' = max(t, 1): at step 0 one step of
    zeros), not the later ones (zeros; reading them cost as much again)."""
    steps = tf.maximum(t, 1)

    def prefix(history):
      return tf.transpose(history.gather(tf.range(steps)), [1, 0, 2, 3])

    return tuple((prefix(x), prefix(d), beta[:, :steps], alpha)
                 for x, d, beta, _, alpha, _ in state)

  @staticmethod
  def product(x: tf.Tensor, base: tf.Tensor, rows, anchor: Optional[tf.Tensor],
              probe: tf.Tensor) -> tf.Tensor:
    """One client's `x w_t` (module docstring) plus `probe` (zeros: its gradient is δ).
    `base` is W_0 (gradient stopped: the kernel's own gradient is never formed), `rows` the
    client's `(X [T, B, in], Δ [T, B, out], β [T], α)`, `anchor` A when D is carried."""
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
    """The state after step `t`: each client's `(x_t, δ_t)` (`factors`, per index, `[K, B,
    ...]`) written into the history and the coefficients stepped with the regulariser's
    scales `c` (`[K]` per index; zeros without one). A client that does not train at the step
    (`trains`) keeps its state."""
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
      keep = lambda new, old: tf.where(  # pylint: disable=g-long-lambda
          tf.reshape(trains, [-1] + [1] * (new.shape.rank - 1)), new, old)
      new_state.append((hx, hd, keep(new_beta, beta), keep(new_gamma, gamma),
                        keep(new_alpha, alpha), keep(new_alpha_acc, alpha_acc)))
    return tuple(new_state)

  def kernels(self, state, bases: Sequence[tf.Tensor], anchors: Sequence[Optional[tf.Tensor]]
              ) -> list[tf.Tensor]:
    """The trained kernels `[K, in, out]`: `W_0 + α D + Xᵀ (β ⊙ Δ)` per index, from the
    clients' start kernels `bases` (`[K, in, out]`, or `[in, out]` shared) and anchors."""
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
