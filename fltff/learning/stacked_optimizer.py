"""The client optimizer's local step for a round's stacked participants (vectorised clients).

An updater applies the client optimizer to the clients' stacked `[K, ...]` weights after each
step's `tf.vectorized_map` of gradients (`learning.vectorized`): `MappedOptimizer` maps any TFF
optimizer's `next` over the clients; `FusedSGDM` applies SGD(M) as `optimizers.sgdm` declares
it (a ← μ·a + g, w ← w − η·a; without momentum w ← w − η·g) in place with TensorFlow's fused
kernels, one pass per tensor. An affine regulariser's terms (`g + s ⊙ w + o`; an offset
`−s ⊙ global` as an `Anchor`, added as `s ⊙ (w − global)`) go to `step`, where `FusedSGDM`
fuses them into the update. A client without a batch at a step keeps its weights and state.

Use: `carry = start(weights)`, per step `weights(carry)` and
`carry = step(carry, gradients, trains, affine)`, then `finish(carry)` for the trained weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, Optional

import tensorflow as tf


def broadcast_clients(value, k):
  """`value` repeated along a new leading client axis of size `k`."""
  value = tf.convert_to_tensor(value)
  return tf.broadcast_to(value[tf.newaxis], tf.concat([[k], tf.shape(value)], 0))


def client_mask(trains: tf.Tensor, rank: int) -> tf.Tensor:
  """`trains [K]` shaped to select per client in a `[K, ...]` tensor of `rank`."""
  return tf.reshape(trains, [-1] + [1] * (rank - 1))


def _per_client(term, weight: tf.Tensor) -> tf.Tensor:
  """Per-client `term [K, *shape]` reshaped to broadcast against `weight [K, ...]` as one
  client's term does against its weight (trailing axes aligned)."""
  term = tf.convert_to_tensor(term, weight.dtype)
  missing = weight.shape.rank - term.shape.rank
  if missing <= 0:
    return term
  return tf.reshape(term, tf.concat([tf.shape(term)[:1], tf.ones([missing], tf.int32),
                                     tf.shape(term)[1:]], 0))


class Anchor:
  """The anchor `a` of an offset `−s ⊙ a`: shared, without a client axis (the global model,
  `RegularizerTraits.global_anchor`), or each client's own `[K, ...]` (KAPC's s_i)."""

  def __init__(self, value: tf.Tensor):
    self.value = value


def add_affine(gradients, weights, affine, skip: frozenset = frozenset()) -> list:
  """Stacked gradients plus the affine terms `affine = (scales, offsets)` (`[K, ...]`), except
  for the tensors in `skip`: `g + s ⊙ w + o` (`step_gradients`'s order), `g + s ⊙ (w − a)` for
  an `Anchor` offset."""
  if affine is None:
    return list(gradients)
  out = list(gradients)
  for i, (g, w, s, o) in enumerate(zip(gradients, weights, *affine)):
    if i not in skip:
      out[i] = (g + _per_client(s, w) * (w - o.value) if isinstance(o, Anchor)
                else tf.add_n([g, _per_client(s, w) * w, _per_client(o, w)]))
  return out


class MappedOptimizer:
  """Any `tff.learning.optimizers.Optimizer`, run per client in one `tf.vectorized_map`; the
  carry is the stacked `(weights, optimizer_state)`."""

  def __init__(self, optimizer, frozen: frozenset = frozenset()):
    self._optimizer, self._frozen = optimizer, frozen

  def prepare(self, specs: Sequence[tf.TensorSpec], device: Optional[str] = None) -> None:
    """Nothing to build outside the training function."""
    del specs, device

  def start(self, weights: Sequence[tf.Tensor]) -> Any:
    k = tf.shape(weights[0])[0]
    state = self._optimizer.initialize(tuple(tf.TensorSpec(w.shape[1:], w.dtype) for w in weights))
    return tuple(weights), tf.nest.map_structure(lambda s: broadcast_clients(s, k), state)

  def weights(self, carry) -> tuple:
    return carry[0]

  def step(self, carry, gradients: Sequence[tf.Tensor], trains: tf.Tensor, affine=None,
           skip: frozenset = frozenset()):
    del skip  # Only `FusedSGDM` trains factored kernels (`VectorizedClientWork`).
    weights, state = carry
    gradients = add_affine(gradients, weights, affine)
    new_state, updated = tf.vectorized_map(
        lambda args: self._optimizer.next(*args), (state, weights, tuple(gradients)))
    updated = tuple(w if i in self._frozen else u
                    for i, (w, u) in enumerate(zip(weights, updated)))

    def select():
      # Idle clients (fewer batches or epochs) stay unchanged.
      return tf.nest.map_structure(
          lambda n, o: tf.where(client_mask(trains, n.shape.rank), n, o),
          (updated, new_state), (weights, state))

    # Skipped when every client trains: a full-size select per tensor and step.
    return tf.cond(tf.reduce_all(trains), lambda: (updated, new_state), select)

  finish = weights  # The trained weights; nothing held to release.


class FusedSGDM:
  """TFF's SGD(M) applied in place to variables holding the stacked weights and accumulators.

  `prepare` makes them (`[None, ...]`) outside the training function; `finish` empties them, so
  nothing model-sized is held between rounds."""

  def __init__(self, learning_rate: float, momentum: Optional[float],
               frozen: frozenset = frozenset()):
    self._learning_rate, self._momentum, self._frozen = learning_rate, momentum, frozen
    self._weights: Optional[list[tf.Variable]] = None
    self._accumulators: list[tf.Variable] = []
    self._affine_update = tf.function(self._affine_update_fn, jit_compile=True, autograph=False)
    self._affine_gradients = tf.function(self._affine_gradients_fn, jit_compile=True,
                                         autograph=False)

  def prepare(self, specs: Sequence[tf.TensorSpec], device: Optional[str] = None) -> None:
    """Makes the variables (once) for one client's weight `specs`."""
    if self._weights is not None:
      if [tuple(v.shape[1:]) for v in self._weights] != [tuple(s.shape) for s in specs]:
        raise ValueError('FusedSGDM was prepared for other weight shapes.')
      return

    def empty(spec):
      return tf.Variable(tf.zeros([0, *spec.shape], spec.dtype), trainable=False,
                         shape=tf.TensorShape([None, *spec.shape]))

    with tf.device(device) if device else contextlib.nullcontext():
      self._weights = [empty(s) for s in specs]
      if self._momentum is not None:
        self._accumulators = [empty(s) for s in specs]

  # The carry is a token threaded through start, steps and finish, so the variables' writes
  # are ordered by data flow, not by automatic control dependencies across loop and cond.
  def start(self, weights: Sequence[tf.Tensor]) -> tf.Tensor:
    assigned = [variable.assign(value, read_value=False)
                for variable, value in zip(self._weights, weights)]
    # Not `tf.zeros_like(value)`: traced with an unknown client count it left the accumulators
    # empty at the first step (TF 2.14, cause unknown; tests/test_stacked_optimizer.py).
    assigned += [accumulator.assign(tf.zeros(tf.shape(value), value.dtype), read_value=False)
                 for accumulator, value in zip(self._accumulators, weights)]
    with tf.control_dependencies(assigned):
      return tf.constant(True)

  def weights(self, carry: tf.Tensor) -> tuple:
    with tf.control_dependencies([carry]):
      return tuple(v.read_value() for v in self._weights)

  def _apply(self, gradients, rows: Optional[tf.Tensor], skip: frozenset) -> tf.Tensor:
    applied = []
    for i, (variable, gradient) in enumerate(zip(self._weights, gradients)):
      if i in self._frozen or i in skip:
        continue
      lr = tf.cast(self._learning_rate, gradient.dtype)
      if rows is not None:
        gradient = tf.gather(gradient, rows)
      if self._momentum is None:
        if rows is None:
          applied.append(tf.raw_ops.ResourceApplyGradientDescent(
              var=variable.handle, alpha=lr, delta=gradient))
        else:
          applied.append(tf.raw_ops.ResourceScatterSub(
              resource=variable.handle, indices=rows, updates=lr * gradient))
        continue
      momentum = tf.cast(self._momentum, gradient.dtype)
      if rows is None:
        applied.append(tf.raw_ops.ResourceApplyMomentum(
            var=variable.handle, accum=self._accumulators[i].handle, lr=lr, grad=gradient,
            momentum=momentum))
      else:
        applied.append(tf.raw_ops.ResourceSparseApplyMomentum(
            var=variable.handle, accum=self._accumulators[i].handle, lr=lr, grad=gradient,
            indices=rows, momentum=momentum))
    with tf.control_dependencies(applied):
      return tf.constant(True)

  def _affine_update_fn(self, gradients, scales, offsets, anchors, skip) -> tf.Tensor:
    """Every client's step with the affine terms (`_affine_gradients_fn`) in one XLA-compiled
    elementwise pass per tensor."""
    weights = tuple(v.read_value() for v in self._weights)
    return self._apply(self._affine_gradients_fn(gradients, weights, scales, offsets, anchors,
                                                 skip), None, skip)

  def _affine_gradients_fn(self, gradients, weights, scales, offsets, anchors, skip) -> list:
    """`add_affine` under XLA, for steps with an idle client. As plain TF ops, Grappler may make
    the sum a named temporary variable that the untaken branch never destroys: the next step
    fails with AlreadyExistsError (tests/test_stacked_optimizer.py)."""
    offsets = tuple(Anchor(a) for a in anchors) if anchors else offsets
    return add_affine(gradients, weights, (scales, offsets), skip)

  def step(self, carry: tf.Tensor, gradients: Sequence[tf.Tensor], trains: tf.Tensor,
           affine=None, skip: frozenset = frozenset()) -> tf.Tensor:
    """One local step of every client, `affine` (stacked `(scales, offsets)`) added here and
    fused with the update when every client trains (an idle-client `tf.where` in the XLA
    function is slower: those steps use the sparse kernels). `skip`: tensors left as they are
    (factored kernels, `factored_dense`)."""
    gradients = tuple(gradients)
    if affine is None:
      every = lambda: self._apply(gradients, None, skip)
      some_idle = lambda: self._apply(gradients, tf.where(trains)[:, 0], skip)
    else:
      scales, offsets = (tuple(part) for part in affine)
      # The XLA functions take tensors: anchors as their own argument.
      anchors = tuple(o.value for o in offsets) if isinstance(offsets[0], Anchor) else ()
      offsets = () if anchors else offsets
      every = lambda: self._affine_update(gradients, scales, offsets, anchors, skip)
      some_idle = lambda: self._apply(
          self._affine_gradients(gradients, self.weights(carry), scales, offsets, anchors,
                                 skip),
          tf.where(trains)[:, 0], skip)
    with tf.control_dependencies([carry]):
      return tf.cond(tf.reduce_all(trains), every, some_idle)

  def finish(self, carry: tf.Tensor) -> tuple:
    trained = self.weights(carry)
    # The returned tensors keep the buffers; the variables let go of them.
    with tf.control_dependencies(trained):
      for variable in (*self._weights, *self._accumulators):
        variable.assign(tf.zeros([0, *variable.shape[1:]], variable.dtype))
    return trained


def stacked_optimizer(optimizer, frozen: frozenset = frozenset()):
  """The updater for `optimizer`: `FusedSGDM` for one declaring SGD(M)'s `hyperparameters`
  (`optimizers.sgdm`), else `MappedOptimizer`."""
  sgdm = getattr(optimizer, 'hyperparameters', None)
  if sgdm is None:
    return MappedOptimizer(optimizer, frozen)
  return FusedSGDM(*sgdm, frozen=frozen)
