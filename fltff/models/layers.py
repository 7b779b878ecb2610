"""The layer grouping every layer-wise method uses, and per-neuron row views of weights.

`layer_groups` decides which weights form "layer l" for FedLap, FedLayerWise, KAPC, BLS,
pFedLA, FedBN, FedBABU, ...: the kernel and bias of a Dense/Conv layer form one layer, a
normalisation layer (BatchNorm gamma/beta plus its moving statistics) is a layer of its own
(FedBN keeps those local), and layers without weights are skipped.

`to_rows`, `row_cosine` and `row_squared_distance` give the per-neuron view that per-neuron rules
need, e.g. FedLap's regulariser `1/2 Σ_l <λ_l, d_l>` with `λ_lj = 1 − cos(w_lj^local,
w_lj^global)` and `d_lj = ||w_lj^local − w_lj^global||²`, where j runs over the rows of layer l.
"""

from collections.abc import Iterator, Sequence
import dataclasses

import tensorflow as tf

from fltff.errors import ConfigError


def _layer_types(*names: str) -> tuple[type, ...]:
  return tuple(getattr(tf.keras.layers, n) for n in names if hasattr(tf.keras.layers, n))


_DENSE_TYPES = _layer_types('Dense', 'EinsumDense')
_CONV_TYPES = _layer_types(
    'Conv1D', 'Conv2D', 'Conv3D', 'Conv1DTranspose', 'Conv2DTranspose', 'Conv3DTranspose',
    'DepthwiseConv1D', 'DepthwiseConv2D', 'SeparableConv1D', 'SeparableConv2D')
_NORM_TYPES = _layer_types('BatchNormalization', 'LayerNormalization', 'GroupNormalization')


@dataclasses.dataclass(frozen=True)
class LayerGroup:
  """The weights of one layer, as indices into a Keras model's flat weight lists.

  Attributes:
    name: Keras layer name (for nested models the innermost layer's own name).
    kind: 'dense', 'conv', 'norm' (BatchNorm, LayerNorm, GroupNorm) or 'other'.
    trainable_indices: Indices into `model.trainable_weights`, in that list's order (kernel
      first, then bias; gamma then beta).
    non_trainable_indices: Indices into `model.non_trainable_weights` (e.g. BatchNorm moving
      mean and variance, or the weights of a frozen layer).
  """
  name: str
  kind: str
  trainable_indices: tuple[int, ...]
  non_trainable_indices: tuple[int, ...]


def _kind(layer: tf.keras.layers.Layer) -> str:
  if isinstance(layer, _DENSE_TYPES):
    return 'dense'
  if isinstance(layer, _CONV_TYPES):
    return 'conv'
  if isinstance(layer, _NORM_TYPES):
    return 'norm'
  return 'other'


def _children(layer: tf.keras.layers.Layer) -> list[tf.keras.layers.Layer]:
  """Direct sub-layers of `layer`, in Keras' weight-collection order."""
  flatten = getattr(layer, '_flatten_layers', None)
  if flatten is not None:
    return list(flatten(include_self=False, recursive=False))
  return list(getattr(layer, 'layers', ()))  # pragma: no cover (older Keras)


def _leaf_layers(layer: tf.keras.layers.Layer) -> Iterator[tf.keras.layers.Layer]:
  """Layers without sub-layers, depth first in Keras' weight-collection order."""
  children = _children(layer)
  if not children:
    yield layer
    return
  for child in children:
    yield from _leaf_layers(child)


def layer_groups(model: tf.keras.Model) -> list[LayerGroup]:
  """Groups `model`'s weights into layers, ordered input → output.

  This is the one definition of "layer l" for every layer-wise method: each leaf Keras layer
  that owns weights is one group (kernel + bias of a Dense/Conv layer; gamma + beta + moving
  mean/variance of a BatchNorm layer, kind 'norm'). Nested models and custom blocks are
  descended into. A weight shared by several layers belongs to the first that owns it. A frozen
  layer (`trainable=False`, e.g. FedBABU's head) is still a group, with its weights in
  `non_trainable_indices` and empty `trainable_indices`.

  The groups partition `model.trainable_weights` (and `model.non_trainable_weights`): every
  index appears exactly once. For functional models the order is Keras' own weight order, i.e.
  the trainable indices of consecutive groups are consecutive.

  Args:
    model: A built Keras model.

  Returns:
    A list of `LayerGroup`s.

  Raises:
    ConfigError: If `model` is not built or owns weights no leaf layer accounts for.
  """
  if not model.built:
    raise ConfigError(f'Model {model.name!r} must be built before grouping its layers.')
  trainable = {v.ref(): i for i, v in enumerate(model.trainable_weights)}
  non_trainable = {v.ref(): i for i, v in enumerate(model.non_trainable_weights)}
  seen = set()
  groups = []
  for layer in _leaf_layers(model):
    t_idx, n_idx = [], []
    for v in layer.weights:
      ref = v.ref()
      if ref in seen:
        continue
      seen.add(ref)
      if ref in trainable:
        t_idx.append(trainable[ref])
      elif ref in non_trainable:
        n_idx.append(non_trainable[ref])
    if t_idx or n_idx:
      groups.append(LayerGroup(name=layer.name, kind=_kind(layer),
                               trainable_indices=tuple(t_idx),
                               non_trainable_indices=tuple(n_idx)))
  covered = sum(len(g.trainable_indices) + len(g.non_trainable_indices) for g in groups)
  if covered != len(trainable) + len(non_trainable):
    raise ConfigError(
        f'Model {model.name!r} has weights that belong to no layer; cannot group them.')
  return groups


def group_weights(weights: Sequence[tf.Tensor], groups: Sequence[LayerGroup], *,
                  trainable: bool = True) -> list[list[tf.Tensor]]:
  """Slices a flat weight list into per-layer lists, following `groups`.

  Args:
    weights: A list aligned with `model.trainable_weights` (or, with `trainable=False`, with
      `model.non_trainable_weights`): variables, tensors, updates, NumPy arrays, ...
    groups: `layer_groups(model)`.
    trainable: Which index set of the groups to use.

  Returns:
    One list per group (possibly empty, e.g. a norm layer's non-trainable list when
    `trainable=True` holds gamma and beta and the moving stats live in the other list).

  Raises:
    ConfigError: If `weights` does not have one entry per grouped weight.
  """
  key = 'trainable_indices' if trainable else 'non_trainable_indices'
  expected = sum(len(getattr(g, key)) for g in groups)
  if len(weights) != expected:
    raise ConfigError(
        f'Expected {expected} {"trainable" if trainable else "non-trainable"} weights for '
        f'{len(groups)} layers; got {len(weights)}.')
  return [[weights[i] for i in getattr(g, key)] for g in groups]


def to_rows(weight: tf.Tensor) -> tf.Tensor:
  """Reshapes a weight to the 2-D per-neuron view [rows, cols] that per-neuron rules use.

  *   Dense kernel [in, out] → unchanged: one row per INPUT neuron (its outgoing weights).
  *   Conv kernel [kh, kw, cin, cout] → [kh·kw·cin, cout]: one row per element of the input
      patch (spatial offset × input channel), holding its weights to every output channel.
      In general a rank-r tensor (r ≥ 2) becomes [prod(shape[:-1]), shape[-1]].
  *   1-D tensors (bias, BatchNorm gamma/beta) [n] → [1, n]: the whole vector is one row.
  *   Scalars → [1, 1].

  Args:
    weight: A tensor of statically known rank.

  Returns:
    The reshaped tensor (a view; no copy of values is implied).
  """
  weight = tf.convert_to_tensor(weight)
  rank = weight.shape.rank
  if rank is None:
    raise ConfigError('to_rows needs a tensor of statically known rank.')
  if rank == 0:
    return tf.reshape(weight, [1, 1])
  if rank == 1:
    return tf.reshape(weight, [1, -1])
  if rank == 2:
    return weight
  cols = weight.shape[-1]
  if cols is None:
    cols = tf.shape(weight)[-1]
  return tf.reshape(weight, [-1, cols])


def row_cosine(a: tf.Tensor, b: tf.Tensor, eps: float = 1e-8) -> tf.Tensor:
  """Cosine similarity of corresponding rows of `to_rows(a)` and `to_rows(b)`.

  FedLap's per-neuron weight `λ_lj = 1 − cos(w_lj^local, w_lj^global)` is `1 − row_cosine`.

  A row whose Euclidean norm is at most `eps` in either tensor has no direction; its cosine is
  defined as 1 (no dissimilarity, so FedLap adds no penalty for it); so is that of identical
  rows, exactly (not 1 up to rounding: FedLap's λ is 0 at local = global). The result is clipped to
  [-1, 1], always finite, and its gradient is finite everywhere (including zero rows, whose
  gradient is 0).

  Args:
    a: A weight tensor.
    b: A tensor of the same shape and dtype.
    eps: Norm at or below which a row counts as zero.

  Returns:
    A 1-D tensor with one value per row.
  """
  ra, rb = to_rows(a), to_rows(b)
  ra.shape.assert_is_compatible_with(rb.shape)
  sq_a = tf.reduce_sum(tf.square(ra), axis=1)
  sq_b = tf.reduce_sum(tf.square(rb), axis=1)
  dot = tf.reduce_sum(ra * rb, axis=1)
  eps_sq = tf.cast(eps, sq_a.dtype)**2
  valid = tf.logical_and(sq_a > eps_sq, sq_b > eps_sq)
  one = tf.ones_like(sq_a)
  # Safe denominators keep both where-branches (and so the gradients) finite.
  inv_a = tf.math.rsqrt(tf.where(valid, sq_a, one))
  inv_b = tf.math.rsqrt(tf.where(valid, sq_b, one))
  cos = tf.clip_by_value(dot * inv_a * inv_b, -1.0, 1.0)
  # Identical rows (a·b, |a|² and |b|² the same sums of the same products) have cosine exactly
  # 1; rsqrt's rounding would leave it a few ulps off (FedLap's λ at local = global, which its
  # Algorithm 1 takes as 0).
  same = tf.logical_and(tf.equal(dot, sq_a), tf.equal(dot, sq_b))
  return tf.where(tf.logical_and(valid, tf.logical_not(same)), cos, one)


def row_squared_distance(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
  """Squared Euclidean distance of corresponding rows of `to_rows(a)` and `to_rows(b)`.

  FedLap's per-neuron distance `d_lj = ||w_lj^local − w_lj^global||²`.

  Args:
    a: A weight tensor.
    b: A tensor of the same shape and dtype.

  Returns:
    A 1-D tensor with one value per row.
  """
  ra, rb = to_rows(a), to_rows(b)
  ra.shape.assert_is_compatible_with(rb.shape)
  return tf.reduce_sum(tf.square(ra - rb), axis=1)


def update_index_groups(groups: Sequence[LayerGroup]) -> list[list[int]]:
  """`layer_groups`' output as index groups into a model update (the trainable weights, as
  TFF's client work sends them); layers without trainable weights have no part in an update
  and are left out."""
  return [list(g.trainable_indices) for g in groups if g.trainable_indices]
