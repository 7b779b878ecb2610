"""The client optimizer's local step for a round's stacked participants (vectorised clients).

`learning.vectorized` trains every participant at once, their weights stacked along a leading
client axis `[K, ...]`. Each step computes all clients' gradients in one `tf.vectorized_map`
and then applies the client optimizer through one of these updaters:

* `MappedOptimizer`: any TFF optimizer, `optimizer.next` per client in one
  `tf.vectorized_map`, a client without a batch at this step keeping its weights and state.
* `FusedSGDM`: TFF's `build_sgdm` (with or without momentum) applied in place to variables
  holding the stacked weights and accumulators: TensorFlow's fused training kernels
  (`ResourceApplyMomentum`, `ResourceApplyGradientDescent`; their sparse forms on the
  training clients' rows when some client has no batch at the step). The arithmetic is
  `_SGD.next`'s (a ← μ·a + g, w ← w − η·a; without momentum w ← w − η·g), but one pass over
  weights, accumulator and gradient per step instead of elementwise ops that each write a
  fresh model-sized `[K, ...]` tensor, which is faster than the mapped update.

An affine regulariser's gradient terms (`client_work.step_gradients`: `g + s ⊙ w + o`; FedProx,
FedLap, KAPC) are passed to `step` instead of being added inside the clients' map. `FusedSGDM`
adds them in the same pass as the update, one XLA-compiled elementwise function, when every
client trains at the step (fewer passes over the stacked weights). The XLA function has no
idle-client select: with one (a broadcast `tf.where`) it is slower than the separate ops.
Where the offset is `−s ⊙ global` (FedProx, FedLap), it is given as an `Anchor`, the one global
model, and the term is `s ⊙ (w − global)`: no `[K, ...]` offset formed per epoch and read at
every step, a model-sized read and write less per epoch.

An updater is used as `carry = start(weights)`, then per step `weights(carry)` and
`carry = step(carry, gradients, trains, affine)`, and `finish(carry)` for the trained weights.
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
  """A stacked per-client term `[K, *shape]` shaped to broadcast against the stacked weight
  `[K, ...]` as one client's term broadcasts against its weight (trailing axes aligned)."""
  term = tf.convert_to_tensor(term, weight.dtype)
  missing = weight.shape.rank - term.shape.rank
  if missing <= 0:
    return term
  return tf.reshape(term, tf.concat([tf.shape(term)[:1], tf.ones([missing], tf.int32),
                                     tf.shape(term)[1:]], 0))


def _affine_gradient(gradient, weight, scale, offset) -> tf.Tensor:
  """`g + s ⊙ w + o` for one stacked tensor, in `client_work.step_gradients`'s order; with
  `offset` an `Anchor`, `g + s ⊙ (w − a)` for the one anchor `a` every client shares."""
  if isinstance(offset, Anchor):
    return gradient + _per_client(scale, weight) * (weight - offset.value)
  return tf.add_n([gradient, _per_client(scale, weight) * weight, _per_client(offset, weight)])


class Anchor:
  """An offset given as `−s ⊙ a` by the anchor `a`: one all clients share, without a client
  axis (the global model: FedProx, FedLap, `RegularizerTraits.global_anchor`), or each client's
  own, stacked `[clients, ...]` (KAPC's s_i, `offset_anchor`). Read at every step as it is,
  not from a `[clients, ...]` offset formed per epoch."""

  def __init__(self, value: tf.Tensor):
    self.value = value


def add_affine(gradients, weights, affine, skip: frozenset = frozenset()) -> list:
  """`g + s ⊙ w + o` per tensor for stacked clients: `client_work.step_gradients`'s affine
  regulariser terms (`affine = (scales, offsets)`, each with a leading client axis; an offset
  may be an `Anchor`); the tensors in `skip` as they are."""
  if affine is None:
    return list(gradients)
  return [g if i in skip else _affine_gradient(g, w, a, o)
          for i, (g, w, a, o) in enumerate(zip(gradients, weights, *affine))]


class MappedOptimizer:
  """Any `tff.learning.optimizers.Optimizer`, run per client in one `tf.vectorized_map`.

  The carry is `(weights, optimizer_state)`, both stacked. Frozen tensors keep their values.
  """

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
    if skip:
      raise ValueError('factored kernels (`skip`) need TFF\'s SGD(M) (`FusedSGDM`).')
    weights, state = carry
    gradients = add_affine(gradients, weights, affine)
    new_state, updated = tf.vectorized_map(
        lambda args: self._optimizer.next(*args), (state, weights, tuple(gradients)))
    updated = tuple(w if i in self._frozen else u
                    for i, (w, u) in enumerate(zip(weights, updated)))

    def select():
      # A client without a batch at this step (fewer batches or epochs) is left unchanged.
      return tf.nest.map_structure(
          lambda n, o: tf.where(client_mask(trains, n.shape.rank), n, o),
          (updated, new_state), (weights, state))

    # Skipped when every client trains: a full-size select per tensor and step.
    return tf.cond(tf.reduce_all(trains), lambda: (updated, new_state), select)

  def finish(self, carry) -> tuple:
    return carry[0]


def sgdm_hyperparameters(optimizer) -> Optional[tuple[float, Optional[float]]]:
  """`(learning_rate, momentum or None)` when `optimizer` is TFF's `build_sgdm`, else None.

  Recognised by its module and its state's keys: `_SGD` is private to TFF, and an optimizer
  that merely resembles it must not get `FusedSGDM`'s arithmetic.
  """
  if type(optimizer).__module__ != 'tensorflow_federated.python.learning.optimizers.sgdm':
    return None
  state = optimizer.initialize((tf.TensorSpec([], tf.float32),))
  keys = set(state)
  if keys == {'learning_rate'}:
    return float(state['learning_rate']), None
  if keys == {'learning_rate', 'momentum', 'accumulator'}:
    return float(state['learning_rate']), float(state['momentum'])
  return None


class FusedSGDM:
  """TFF's SGD(M) applied in place to variables holding the stacked weights and accumulators.

  The variables (shape `[None, ...]`, any number of clients) are made by `prepare`, outside
  the training function; `start` writes the round's starting weights (zero accumulators),
  `finish` reads the trained weights and empties the variables, so nothing model-sized stays
  held between rounds. A step where some client has no batch applies to the training clients'
  rows only (the sparse kernels: the same arithmetic per row).
  """

  def __init__(self, learning_rate: float, momentum: Optional[float],
               frozen: frozenset = frozenset()):
    self._learning_rate, self._momentum, self._frozen = learning_rate, momentum, frozen
    self._weights: Optional[list[tf.Variable]] = None
    self._accumulators: list[tf.Variable] = []
    self._affine_update = tf.function(self._affine_update_fn, jit_compile=True, autograph=False)
    self._affine_gradients = tf.function(self._affine_gradients_fn, jit_compile=True,
                                         autograph=False)

  @property
  def hyperparameters(self) -> tuple[float, Optional[float]]:
    """`(learning_rate, momentum or None)`."""
    return self._learning_rate, self._momentum

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

  # The carry is a token threaded through start, steps and finish: every read and update
  # waits for it, so the order of the variables' writes is data flow, not left to automatic
  # control dependencies across the training loop and its conditional.
  def start(self, weights: Sequence[tf.Tensor]) -> tf.Tensor:
    assigned = [variable.assign(value) for variable, value in zip(self._weights, weights)]
    # `tf.zeros` of the shape, not `tf.zeros_like(value)`: traced with an unknown client
    # count, the latter left the accumulators empty at the first step (seen in TF 2.14,
    # tests/test_stacked_optimizer.py; the cause was not pinned down).
    assigned += [accumulator.assign(tf.zeros(tf.shape(value), value.dtype))
                 for accumulator, value in zip(self._accumulators, weights)]
    with tf.control_dependencies([a.op if hasattr(a, 'op') else a for a in assigned]):
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
    """Every client's step with the affine terms, `g + s ⊙ w + o` (in `step_gradients`'s
    order; `g + s ⊙ (w − a)` with shared `anchors` instead of `offsets`) and the update in one
    XLA-compiled elementwise pass per tensor."""
    for i, (variable, gradient) in enumerate(zip(self._weights, gradients)):
      if i in self._frozen or i in skip:
        continue
      w = variable.read_value()
      offset = Anchor(anchors[i]) if anchors else offsets[i]
      gradient = _affine_gradient(gradient, w, scales[i], offset)
      lr = tf.cast(self._learning_rate, w.dtype)
      if self._momentum is None:
        variable.assign(w - lr * gradient)
        continue
      accumulator = self._accumulators[i]
      a = tf.cast(self._momentum, w.dtype) * accumulator.read_value() + gradient
      accumulator.assign(a)
      variable.assign(w - lr * a)
    return tf.constant(True)

  def _affine_gradients_fn(self, gradients, weights, scales, offsets, anchors, skip) -> list:
    """`add_affine` compiled with XLA, for the steps where some client is idle. Not as TF ops:
    in the graph, Grappler may turn the model-sized sum into a named temporary variable, which
    this branch, when not taken, creates and never destroys, and the training loop's next
    step fails with AlreadyExistsError (tests/test_stacked_optimizer.py)."""
    offsets = tuple(Anchor(a) for a in anchors) if anchors else offsets
    return add_affine(gradients, weights, (scales, offsets), skip)

  def step(self, carry: tf.Tensor, gradients: Sequence[tf.Tensor], trains: tf.Tensor,
           affine=None, skip: frozenset = frozenset()) -> tf.Tensor:
    """One local step of every client; `affine` (an affine regulariser's `(scales, offsets)`,
    stacked) is added to the gradients here, fused with the update when every client trains.
    (A broadcast `tf.where` for idle clients inside the XLA function made it slower than the
    separate ops, so steps with idle clients take the sparse kernels.) The tensors in `skip`
    are left as they are (kernels trained in factored form, `factored_dense`)."""
    gradients = tuple(gradients)
    skip = frozenset(skip)

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
  """The updater for `optimizer`: `FusedSGDM` for TFF's SGD(M), else `MappedOptimizer`."""
  sgdm = sgdm_hyperparameters(optimizer)
  if sgdm is None:
    return MappedOptimizer(optimizer, frozen)
  return FusedSGDM(*sgdm, frozen=frozen)
