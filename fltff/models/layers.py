"""The layer grouping every layer-wise method uses, and per-neuron row views of weights.

`layer_groups` defines "layer l" for FedLap, FedLayerWise, KAPC, BLS, pFedLA, FedBN, FedBABU,
...; `to_rows`, `row_cosine` and `row_squared_distance` give the per-neuron view of rules such
as FedLap's regulariser `1/2 Σ_l <λ_l, d_l>`, with `λ_lj = 1 − cos(w_lj^local, w_lj^global)`,
`d_lj = ||w_lj^local − w_lj^global||²` and j running over the rows of layer l.
"""

from collections.abc import Iterator, Sequence
import dataclasses

import numpy as np
import tensorflow as tf

from fltff.errors import ConfigError


# Keras layer classes of each `LayerGroup.kind`; any other layer is 'other'.
_KINDS = {
    kind: tuple(getattr(tf.keras.layers, n) for n in names) for kind, names in (
        ('dense', ('Dense', 'EinsumDense')),
        ('conv', ('Conv1D', 'Conv2D', 'Conv3D', 'Conv1DTranspose', 'Conv2DTranspose',
                  'Conv3DTranspose', 'DepthwiseConv1D', 'DepthwiseConv2D', 'SeparableConv1D',
                  'SeparableConv2D')),
        ('norm', ('BatchNormalization', 'LayerNormalization', 'GroupNormalization')))}


@dataclasses.dataclass(frozen=True)
class LayerGroup:
  """The weights of one layer, as indices into a Keras model's flat weight lists.

  Attributes:
    name: Keras layer name (in nested models, the innermost layer's own).
    kind: 'dense', 'conv', 'norm' (BatchNorm, LayerNorm, GroupNorm) or 'other'.
    trainable_indices: Into `model.trainable_weights`, in its order (kernel then bias; gamma
      then beta).
    non_trainable_indices: Into `model.non_trainable_weights` (e.g. BatchNorm moving mean and
      variance, or a frozen layer's weights).
  """
  name: str
  kind: str
  trainable_indices: tuple[int, ...]
  non_trainable_indices: tuple[int, ...]


def _leaf_layers(layer: tf.keras.layers.Layer) -> Iterator[tf.keras.layers.Layer]:
  """Layers without sub-layers, depth first in Keras' weight-collection order."""
  # pylint: disable=protected-access
  children = list(layer._flatten_layers(include_self=False, recursive=False))
  if not children:
    yield layer
    return
  for child in children:
    yield from _leaf_layers(child)


def layer_groups(model: tf.keras.Model) -> list[LayerGroup]:
  """Groups `model`'s weights into layers (the one "layer l"), ordered input → output.

  Each leaf Keras layer owning weights is one group: kernel + bias of a Dense/Conv layer; a
  norm layer's gamma, beta and moving statistics on their own (FedBN keeps them local). Nested
  models and custom blocks are descended into; a shared weight belongs to the first owner; a
  frozen layer (e.g. FedBABU's head) is a group with only `non_trainable_indices`. The groups
  partition `model.trainable_weights` and `model.non_trainable_weights`; in functional models
  consecutive groups have consecutive trainable indices (Keras' weight order).

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
      kind = next((k for k, types in _KINDS.items() if isinstance(layer, types)), 'other')
      groups.append(LayerGroup(name=layer.name, kind=kind,
                               trainable_indices=tuple(t_idx),
                               non_trainable_indices=tuple(n_idx)))
  covered = sum(len(g.trainable_indices) + len(g.non_trainable_indices) for g in groups)
  if covered != len(trainable) + len(non_trainable):
    raise ConfigError(
        f'Model {model.name!r} has weights that belong to no layer; cannot group them.')
  return groups


def group_weights(weights: Sequence[tf.Tensor], groups: Sequence[LayerGroup], *,
                  trainable: bool = True) -> list[list[tf.Tensor]]:
  """Slices a flat weight list into per-layer lists (possibly empty), following `groups`.

  Args:
    weights: Variables, tensors, updates, arrays, ... aligned with `model.trainable_weights`
      (with `trainable=False`: `model.non_trainable_weights`); one per grouped weight, else
      `ConfigError`.
    groups: `layer_groups(model)`.
  """
  key = 'trainable_indices' if trainable else 'non_trainable_indices'
  expected = sum(len(getattr(g, key)) for g in groups)
  if len(weights) != expected:
    raise ConfigError(
        f'Expected {expected} {"trainable" if trainable else "non-trainable"} weights for '
        f'{len(groups)} layers; got {len(weights)}.')
  return [[weights[i] for i in getattr(g, key)] for g in groups]


def to_rows(weight: tf.Tensor) -> tf.Tensor:
  """Reshapes a weight of static rank to the 2-D per-neuron view [rows, cols] (a reshape).

  *   Dense kernel [in, out]: unchanged, one row per INPUT neuron (its outgoing weights).
  *   Conv kernel [kh, kw, cin, cout] → [kh·kw·cin, cout]: one row per input-patch element
      (offset × input channel); any rank r ≥ 2 gives [prod(shape[:-1]), shape[-1]].
  *   1-D tensors (bias, BatchNorm gamma/beta) [n] → [1, n]; scalars → [1, 1].
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
  """Cosine similarity of corresponding rows of `to_rows(a)` and `to_rows(b)`, one per row.

  FedLap's `λ_lj` is `1 − row_cosine`. A row with norm ≤ `eps` in either tensor, and a pair of
  identical rows, get exactly 1 (no penalty; FedLap's λ is 0 at local = global). The result
  is in [-1, 1], with a finite gradient everywhere (0 at zero rows).
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
  # Identical rows (a·b, |a|², |b|² then equal sums) get exactly 1, not rsqrt's few-ulps-off
  # value: FedLap's Algorithm 1 takes λ as 0 at local = global.
  same = tf.logical_and(tf.equal(dot, sq_a), tf.equal(dot, sq_b))
  return tf.where(tf.logical_and(valid, tf.logical_not(same)), cos, one)


def row_squared_distance(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
  """Squared Euclidean distance of corresponding rows of `to_rows(a)` and `to_rows(b)`, one
  per row: FedLap's `d_lj = ||w_lj^local − w_lj^global||²`."""
  ra, rb = to_rows(a), to_rows(b)
  ra.shape.assert_is_compatible_with(rb.shape)
  return tf.reduce_sum(tf.square(ra - rb), axis=1)


def update_index_groups(groups: Sequence[LayerGroup]) -> list[list[int]]:
  """`layer_groups` as index groups into a model update (the trainable weights TFF's client
  work sends); layers without trainable weights are left out."""
  return [list(g.trainable_indices) for g in groups if g.trainable_indices]


def macs_per_example(keras_model) -> float:
  """Multiply-adds of one example's forward pass through `keras_model`'s kernels (Dense and
  convolutions, depthwise and separable included: each kernel's size times the output's spatial
  positions)."""
  total = 0.0
  for layer in keras_model._flatten_layers(include_self=False):  # pylint: disable=protected-access
    kernels = [k for k in (getattr(layer, name, None) for name in
                           ('kernel', 'depthwise_kernel', 'pointwise_kernel')) if k is not None]
    if not kernels:
      continue
    try:
      shape = layer.output_shape
    except AttributeError:  # A layer called more than once, or never in a graph.
      shape = (None, 1)
    positions = np.prod(shape[1:-1]) if isinstance(shape, tuple) and len(shape) > 2 else 1
    total += sum(float(np.prod(k.shape)) for k in kernels) * float(positions)
  return total
