"""`ModelSpec`, what every process builder receives: a Keras model builder bridged to TFF's
`VariableModel`, with the input spec of one preprocessed batch.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import inspect
import json
import re
from collections.abc import Callable, Sequence
from typing import Optional

import numpy as np
import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """A Keras model builder and the element spec of the batches it trains on.

  Attributes:
    keras_fn: No-arg callable returning a fresh Keras model with logit outputs, initialised
      identically on every call (so every computation that rebuilds it gets the same model).
    input_shape: Shape of one example after preprocessing (float32).
    name: The zoo name, for logs.
  """

  keras_fn: Callable[[], tf.keras.Model]
  input_shape: Sequence[int]
  num_classes: int
  name: str = 'model'

  @property
  def input_spec(self) -> collections.OrderedDict:
    return collections.OrderedDict(
        x=tf.TensorSpec([None, *self.input_shape], tf.float32),
        y=tf.TensorSpec([None], tf.int32),
    )

  def tff_model(self, keras_model: Optional[tf.keras.Model] = None):
    """A `tff.learning.models.VariableModel` wrapping `keras_model` (default: a fresh one),
    for TFF's types and metric finalizers; training and evaluation use `batch_loss`."""
    import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

    return tff.learning.models.from_keras_model(
        self.keras_fn() if keras_model is None else keras_model,
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        input_spec=self.input_spec,
        metrics=[tf.keras.metrics.SparseCategoricalAccuracy(name='accuracy')],
    )

  @functools.cached_property  # A cache in the instance's __dict__, not a dataclass field.
  def _facts(self) -> dict:
    """What process builders read off a model (types, specs, finalizers), built once per spec in
    a throwaway graph: each graph-mode Keras build is costly, and the facts never change."""
    import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top
    from fltff.models import check_logits  # pylint: disable=g-import-not-at-top

    with tf.Graph().as_default():
      keras_model = self.keras_fn()
      check_logits(keras_model, self.num_classes, 'ModelSpec.keras_fn')
      model = self.tff_model(keras_model)
      unfinalized = model.report_local_unfinalized_metrics()
      return dict(
          architecture=architecture_fingerprint(keras_model),
          weights_type=tff.learning.models.weights_type_from_model(model),
          element_type=tff.types.tensorflow_to_type(model.input_spec),
          trainable_specs=[tf.TensorSpec(v.shape, v.dtype) for v in model.trainable_variables],
          unfinalized_metric_specs=tf.nest.map_structure(
              lambda t: tf.TensorSpec(t.shape, t.dtype), unfinalized),
          metric_finalizers=model.metric_finalizers())

  def architecture(self) -> str:
    """The model's `architecture_fingerprint`: a resume refuses another (`check_resume`)."""
    return self._facts['architecture']

  def weights_type(self):
    """TFF type of `tff.learning.models.ModelWeights` for this model."""
    return self._facts['weights_type']

  def element_type(self):
    """TFF type of one batch (`input_spec`)."""
    return self._facts['element_type']

  def trainable_specs(self) -> list[tf.TensorSpec]:
    """`TensorSpec`s of the model's trainable weights, in order."""
    return list(self._facts['trainable_specs'])

  def unfinalized_metric_specs(self):
    """`TensorSpec`s of the TFF model's unfinalized metrics (`report_local_unfinalized_metrics`)."""
    return self._facts['unfinalized_metric_specs']

  def metric_finalizers(self):
    """The TFF model's metric finalizers (functions of the unfinalized values)."""
    return self._facts['metric_finalizers']

  def trainable_layers(self) -> tuple[list[list[int]], list[str]]:
    """`(layers, names)`: per layer with trainable weights, input to output, its indices into
    the trainable weights (= an update's tensors) and Keras name (`fltff.models.layer_groups`)."""
    from fltff.models import layer_groups  # pylint: disable=g-import-not-at-top
    from fltff.models import update_index_groups  # pylint: disable=g-import-not-at-top

    groups = [g for g in layer_groups(self.keras_fn()) if g.trainable_indices]
    return update_index_groups(groups), [g.name for g in groups]

  def initial_weights(self):
    """`ModelWeights` (NumPy) of a fresh `keras_fn()` model: identical on every call."""
    import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

    model = self.keras_fn()
    return tff.learning.models.ModelWeights(
        trainable=[np.asarray(w) for w in model.trainable_weights],
        non_trainable=[np.asarray(w) for w in model.non_trainable_weights],
    )


def architecture_fingerprint(model: tf.keras.Model) -> str:
  """sha256 of `model.to_json()` less the Keras version, the input shapes a layer records once
  called, and the layer and model names Keras numbers per process ('dense', 'dense_3'), which
  become their order. Initializers stay: after a resume, clients without a state yet start
  from the initial model (personal models, MOON). A subclassed model's config holds only its
  constructor's arguments, so its code counts too (`_class_code`)."""
  names = {}

  def read(node: dict) -> dict:  # Inner objects first.
    node.pop('build_config', None)
    names.setdefault(node.get('name'), f'#{len(names)}')
    return node

  try:
    config = json.loads(model.to_json(), object_hook=read)
    del config['keras_version'], config['backend']
  except NotImplementedError:  # A layer of the user's without `get_config`: the classes only.
    config = [type(layer).__qualname__ for layer in model.submodules]
  # Layers name the layers they read (inbound nodes, inputs, outputs): each name is replaced.
  text = re.sub(r'"((?:[^"\\]|\\.)*)"', lambda m: f'"{names.get(m[1], m[1])}"',
                json.dumps(config, sort_keys=True))
  classes = {c for m in (model, *model.submodules) for c in type(m).__mro__
             if c.__module__.partition('.')[0] not in ('keras', 'tensorflow', 'builtins')}
  if type(model) in classes:  # Subclassed (a Functional or Sequential model's config is all).
    text += ''.join(sorted('\n' + _class_code(c) for c in classes))
  return hashlib.sha256(text.encode()).hexdigest()


def _class_code(cls: type) -> str:
  """`cls`'s source; without one (a class typed into an interpreter or notebook, or `exec`'d), the
  bytecode, names and constants of the functions it defines, which hold no file or line."""
  def code(c) -> tuple:  # A frozenset's order would vary with the process's hash seed.
    return (c.co_code, c.co_names, tuple(code(k) if inspect.iscode(k) else sorted(k, key=repr)
                                         if isinstance(k, frozenset) else k for k in c.co_consts))
  try:
    return inspect.getsource(cls)
  except (OSError, TypeError):
    functions = (getattr(f, '__func__', getattr(f, 'fget', f)) for f in vars(cls).values())
    return f'{cls.__qualname__} {[code(f.__code__) for f in functions if inspect.isfunction(f)]}'


def batch_loss(logits: tf.Tensor, labels: tf.Tensor, mask: Optional[tf.Tensor] = None
               ) -> tuple[tf.Tensor, tuple[tf.Tensor, tf.Tensor, tf.Tensor]]:
  """The loss of every client step and evaluation: `(mean, (loss sum, examples, correct))` of the
  sparse softmax cross-entropy of `logits` over the examples where `mask` (`[B]`) is 1 (all
  without one), float32; the mean is Keras's `SparseCategoricalCrossentropy`'s bit for bit."""
  if mask is None:
    mask = tf.ones(tf.shape(labels), tf.float32)
  per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=tf.cast(labels, tf.int64), logits=logits)
  n = tf.reduce_sum(mask)
  mean = tf.reduce_sum(per_example * mask) / tf.maximum(n, 1.0)
  correct = tf.reduce_sum(mask * tf.cast(
      tf.equal(tf.argmax(logits, axis=-1, output_type=tf.int32), tf.cast(labels, tf.int32)),
      tf.float32))
  return mean, (mean * n, n, correct)


def unfinalized_metrics(sums) -> collections.OrderedDict:
  """`ModelSpec.tff_model`'s unfinalized metrics from the summed `(loss sum, examples (int64),
  correct, batches (int64))` of `batch_loss` (one client's scalars or `[K]` vectors)."""
  loss_sum, examples, correct, batches = sums
  n = tf.cast(examples, tf.float32)
  return collections.OrderedDict(accuracy=[correct, n], loss=[loss_sum, n],
                                 num_examples=[examples], num_batches=[batches])


def type_num_bytes(tff_type) -> int:
  """Bytes of one value of `tff_type` as exchanged (sum over its tensors; placements ignored);
  `ValueError` for a tensor of unknown shape or an unsupported type."""
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

  if isinstance(tff_type, tff.FederatedType):
    return type_num_bytes(tff_type.member)
  if isinstance(tff_type, tff.TensorType):
    if not tff.types.is_shape_fully_defined(tff_type.shape):
      raise ValueError(f'Cannot count bytes of a tensor with unknown shape: {tff_type}')
    return int(np.prod(tff_type.shape, dtype=np.int64)) * np.dtype(tff_type.dtype).itemsize
  if isinstance(tff_type, tff.StructType):
    return sum(type_num_bytes(t) for _, t in tff.structure.iter_elements(tff_type))
  raise ValueError(f'Cannot count bytes of type {tff_type}')
