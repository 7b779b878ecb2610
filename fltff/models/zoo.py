"""Keras model zoo of the layer-aware FL papers fltff reproduces.

Every model is a functional `tf.keras.Model` mapping float32 inputs (images in [0, 1], or a flat
feature vector such as Synthetic(α, β)'s `(60,)`) to LOGITS (no softmax; train with
`SparseCategoricalCrossentropy(from_logits=True)`), with explicit, stable layer names. Kernels
are `glorot_uniform` seeded `seed * 1000 + i` (i: index of the layer with a kernel, input →
output), biases and BatchNorm parameters start constant: equal `(name, input_shape,
num_classes, seed)` give identical initial weights in any process. The layer feeding the
classifier is `LATENT_LAYER` (`'latent'`), exposed by `latent_model`.
"""

from collections.abc import Callable, Sequence
import itertools
import math

import gin
import tensorflow as tf

from fltff.errors import ConfigError

LATENT_LAYER = 'latent'


class _Init:
  """Hands out seeded kernel initializers, one fresh seed per layer (input → output)."""

  def __init__(self, seed: int):
    self.seed = int(seed)
    self._seeds = itertools.count(self.seed * 1000)  # No zoo model has 1000 kernels.

  def __call__(self) -> tf.keras.initializers.Initializer:
    return tf.keras.initializers.GlorotUniform(seed=next(self._seeds))


def _dense(units: int, init: _Init, name: str,
           activation: str | None = None) -> tf.keras.layers.Dense:
  return tf.keras.layers.Dense(
      units, activation=activation, kernel_initializer=init(),
      bias_initializer='zeros', name=name)


def _conv(filters: int, kernel_size: int, init: _Init, name: str, *,
          strides: int = 1, padding: str = 'valid', activation: str | None = None,
          use_bias: bool = True) -> tf.keras.layers.Conv2D:
  return tf.keras.layers.Conv2D(
      filters, kernel_size, strides=strides, padding=padding, activation=activation,
      use_bias=use_bias, kernel_initializer=init(), bias_initializer='zeros', name=name)


def _bn(name: str) -> tf.keras.layers.BatchNormalization:
  # PyTorch's BatchNorm settings (its momentum 0.1 is 0.9 here), as in the reference CIFAR
  # ResNet-18 and VGG-16; Keras' default 0.99 adapts too slowly for a few local epochs per round.
  return tf.keras.layers.BatchNormalization(momentum=0.9, epsilon=1e-5, name=name)


def _bn_relu(x, bn_name: str, relu_name: str):
  """`x` through BatchNorm `bn_name`, then ReLU `relu_name`."""
  return tf.keras.layers.ReLU(name=relu_name)(_bn(bn_name)(x))


def _conv_pools(x, filters: Sequence[int], kernel_size: int, init: _Init, padding: str):
  """For each of `filters`, a ReLU conv `conv<i>` then a 2x2 max-pool `pool<i>` (i from 1)."""
  for i, width in enumerate(filters, 1):
    x = _conv(width, kernel_size, init, f'conv{i}', padding=padding, activation='relu')(x)
    x = tf.keras.layers.MaxPool2D(2, name=f'pool{i}')(x)
  return x


def _classifier(inputs, x, num_classes: int, init, name: str,
                latent_units: int = 0) -> tf.keras.Model:
  """The model from `inputs` to logits: a linear 'logits' layer on the features `x`; with
  `latent_units`, on `x` flattened through a ReLU dense layer of that size ('latent')."""
  if latent_units:
    x = tf.keras.layers.Flatten(name='flatten')(x)
    x = _dense(latent_units, init, LATENT_LAYER, 'relu')(x)
  return tf.keras.Model(inputs, _dense(num_classes, init, 'logits')(x), name=name)


def _image_input(name: str, input_shape: tuple[int, ...], min_hw: int):
  """Returns (keras Input, HxWxC tensor); accepts [H, W] (adds a channel) or [H, W, C]."""
  if len(input_shape) not in (2, 3):
    raise ConfigError(
        f'Model {name!r} needs an image input_shape (H, W) or (H, W, C); got {input_shape}.')
  if min(input_shape[:2]) < min_hw:
    raise ConfigError(
        f'Model {name!r} needs images of at least {min_hw}x{min_hw}; got {input_shape}.')
  inputs = tf.keras.Input(shape=input_shape, dtype=tf.float32, name='input')
  x = inputs
  if len(input_shape) == 2:
    x = tf.keras.layers.Reshape((*input_shape, 1), name='add_channel')(x)
  return inputs, x


def _logistic(name, input_shape, num_classes, init):
  """Multinomial logistic regression, FedProx's Synthetic(α, β) model (Li et al., 2020); with
  no hidden layer, 'latent' is the Flatten layer (the flattened input)."""
  inputs = tf.keras.Input(shape=input_shape, dtype=tf.float32, name='input')
  x = tf.keras.layers.Flatten(name=LATENT_LAYER)(inputs)
  return _classifier(inputs, x, num_classes, init, name)


def _mlp2(name, input_shape, num_classes, init):
  """784-200-10 ReLU MLP, FedLap's MNIST/FMNIST model (159,010 parameters on 28x28 inputs), not
  McMahan et al.'s (2017) "2NN" (784-200-200-10)."""
  inputs = tf.keras.Input(shape=input_shape, dtype=tf.float32, name='input')
  return _classifier(inputs, inputs, num_classes, init, name, latent_units=200)


def _cnn_cifar_tutorial(name, input_shape, num_classes, init):
  """TensorFlow's CIFAR-10 CNN tutorial model (122,570 parameters on 32x32x3)."""
  inputs, x = _image_input(name, input_shape, min_hw=18)
  x = _conv_pools(x, (32, 64), 3, init, 'valid')
  x = _conv(64, 3, init, 'conv3', activation='relu')(x)
  return _classifier(inputs, x, num_classes, init, name, latent_units=64)


def _cnn_mnist_582k(name, input_shape, num_classes, init):
  """McMahan et al.'s (2017) MNIST CNN with 'valid' padding, 582,026 parameters on 28x28x1:
  conv5x5·32 → pool2 → conv5x5·64 → pool2 → flatten (4·4·64 = 1024) → dense 512 → classifier."""
  inputs, x = _image_input(name, input_shape, min_hw=16)
  x = _conv_pools(x, (32, 64), 5, init, 'valid')
  return _classifier(inputs, x, num_classes, init, name, latent_units=512)


def _cnn2(name, input_shape, num_classes, init):
  """KAPC's MNIST/FMNIST CNN: two 5x5 convs (32, 64 filters), dense 512, dense 128 ('latent').

  'same' padding as in McMahan et al.'s (2017) CNN: 28x28 inputs give 7·7·64 = 3136 features
  after the two 2x2 max-pools; 1,725,194 parameters for 10 classes.
  """
  inputs, x = _image_input(name, input_shape, min_hw=4)
  x = _conv_pools(x, (32, 64), 5, init, 'same')
  x = tf.keras.layers.Flatten(name='flatten')(x)
  x = _dense(512, init, 'dense1', 'relu')(x)
  x = _dense(128, init, LATENT_LAYER, 'relu')(x)
  return _classifier(inputs, x, num_classes, init, name)


def _cnn2_bn(name, input_shape, num_classes, init):
  """`cnn2` with BatchNorm, for FedBN on the KAPC paper's MNIST/FMNIST setting.

  The KAPC paper (§7.1) gives the 2CNN no normalisation, so the BatchNorm placement is OUR
  choice: after every conv and both hidden dense layers, before the ReLU, as in FedBN's
  reference digit model (med-air/FedBN `DigitModel`); conv and dense layers are `cnn2`'s.
  """
  inputs, x = _image_input(name, input_shape, min_hw=4)
  x = _bn_relu(_conv(32, 5, init, 'conv1', padding='same')(x), 'bn1', 'relu1')
  x = tf.keras.layers.MaxPool2D(2, name='pool1')(x)
  x = _bn_relu(_conv(64, 5, init, 'conv2', padding='same')(x), 'bn2', 'relu2')
  x = tf.keras.layers.MaxPool2D(2, name='pool2')(x)
  x = tf.keras.layers.Flatten(name='flatten')(x)
  x = _bn_relu(_dense(512, init, 'dense1')(x), 'bn3', 'relu3')
  x = _bn_relu(_dense(128, init, 'dense2')(x), 'bn4', LATENT_LAYER)
  return _classifier(inputs, x, num_classes, init, name)


def _basic_block(x: tf.Tensor, filters: int, strides: int, init: _Init,
                 prefix: str) -> tf.Tensor:
  """ResNet BasicBlock (He et al., 2016): two 3x3 conv-BN, identity or 1x1-conv-BN shortcut."""
  shortcut = x
  y = _conv(filters, 3, init, f'{prefix}_conv1', strides=strides, padding='same',
            use_bias=False)(x)
  y = _bn_relu(y, f'{prefix}_bn1', f'{prefix}_relu1')
  y = _conv(filters, 3, init, f'{prefix}_conv2', padding='same', use_bias=False)(y)
  y = _bn(f'{prefix}_bn2')(y)
  if strides != 1 or x.shape[-1] != filters:
    shortcut = _conv(filters, 1, init, f'{prefix}_proj_conv', strides=strides,
                     use_bias=False)(x)
    shortcut = _bn(f'{prefix}_proj_bn')(shortcut)
  y = tf.keras.layers.Add(name=f'{prefix}_add')([y, shortcut])
  return tf.keras.layers.ReLU(name=f'{prefix}_relu2')(y)


def _resnet18(name, input_shape, num_classes, init):
  """CIFAR ResNet-18 (He et al., 2016; the common CIFAR variant).

  3x3 stem conv (64) + BN, no max-pool; four stages of two BasicBlocks (64/128/256/512 filters,
  strides 1/2/2/2, 1x1 projection shortcuts); global average pool ('latent', 512-d). Bias-free
  convs (BN follows): 11,173,962 trainable parameters for 10 classes + 9,600 BN statistics.
  """
  inputs, x = _image_input(name, input_shape, min_hw=1)
  x = _conv(64, 3, init, 'stem_conv', padding='same', use_bias=False)(x)
  x = _bn_relu(x, 'stem_bn', 'stem_relu')
  for stage, (filters, strides) in enumerate(((64, 1), (128, 2), (256, 2), (512, 2)), 1):
    x = _basic_block(x, filters, strides, init, f'stage{stage}_block1')
    x = _basic_block(x, filters, 1, init, f'stage{stage}_block2')
  x = tf.keras.layers.GlobalAveragePooling2D(name=LATENT_LAYER)(x)
  return _classifier(inputs, x, num_classes, init, name)


_VGG16_CFG = (64, 64, 'M', 128, 128, 'M', 256, 256, 256, 'M', 512, 512, 512, 'M',
              512, 512, 512, 'M')


def _vgg16(name, input_shape, num_classes, init):
  """VGG-16-BN (Simonyan & Zisserman, 2015), as used by the CCN paper on CIFAR.

  13 3x3 'same' convs (with bias), each followed by BatchNorm (which lets it train from
  scratch) and ReLU; five 2x2 max-pools take 32x32 inputs to 1x1x512; then flatten → dense
  128 ReLU ('latent', CCN's 128-d latent layer) → classifier.
  """
  inputs, x = _image_input(name, input_shape, min_hw=32)
  conv_i, pool_i = 0, 0
  for v in _VGG16_CFG:
    if v == 'M':
      pool_i += 1
      x = tf.keras.layers.MaxPool2D(2, name=f'pool{pool_i}')(x)
    else:
      conv_i += 1
      x = _conv(v, 3, init, f'conv{conv_i}', padding='same')(x)
      x = _bn_relu(x, f'bn{conv_i}', f'relu{conv_i}')
  return _classifier(inputs, x, num_classes, init, name, latent_units=128)


_REGISTRY: dict[str, Callable[[str, tuple[int, ...], int, _Init], tf.keras.Model]] = {
    'logistic': _logistic,
    'mlp2': _mlp2,
    'cnn_cifar_tutorial': _cnn_cifar_tutorial,
    'cnn_mnist_582k': _cnn_mnist_582k,
    'cnn2': _cnn2,
    'cnn2_bn': _cnn2_bn,
    'resnet18': _resnet18,
    'vgg16': _vgg16,
}

# The built-in models; `model_names()` adds the ones registered with `register`.
MODEL_NAMES: tuple[str, ...] = tuple(_REGISTRY)


def register(name: str, model_fn: Callable[[tuple[int, ...], int, int], tf.keras.Model]) -> None:
  """Makes your own Keras model buildable by name wherever a zoo name is accepted.

  `model_fn(input_shape, num_classes, seed)` returns a new model with logits, the same initial
  weights for the same seed (docs/configuration.md, "Your own model"). Re-registering a name
  replaces it; a built-in name is refused.
  """
  if not isinstance(name, str) or not name.strip():
    raise ConfigError(f'A model name is a non-empty string; got {name!r}.')
  if name in MODEL_NAMES:
    raise ConfigError(f'{name!r} is a built-in model of fltff; register yours under another '
                      'name.')
  if not callable(model_fn):
    raise ConfigError(f'register({name!r}, ...) needs a function (input_shape, num_classes, '
                      f'seed) -> tf.keras.Model; got {model_fn!r}.')
  _REGISTRY[name] = lambda _, shape, classes, init: model_fn(shape, classes, init.seed)


def model_names() -> tuple[str, ...]:
  """The built-in models and those registered with `register`."""
  return tuple(_REGISTRY)


@gin.configurable('model')
def build_model(name: str = gin.REQUIRED,
                input_shape: Sequence[int] = (28, 28, 1),
                num_classes: int = 10,
                seed: int = 0) -> tf.keras.Model:
  """Builds zoo model `name`, outputting logits of shape [batch, num_classes >= 2].

  `ConfigError` for an unknown name, or a shape or class count the model cannot take.

  Args:
    name: One of `model_names()` (built-in `MODEL_NAMES` or registered with `register`).
    input_shape: One example's shape: (H, W, C) or (H, W) for the CNNs, any shape for
      'logistic' and 'mlp2' (they flatten it).
  """
  if not isinstance(name, str):
    # E.g. `experiment.model = @fedavg`: gin passes the function itself.
    what = (f'the function {name.__name__}' if callable(name) and hasattr(name, '__name__')
            else repr(name))
    raise ConfigError(f'experiment.model must be a model name (a string), got {what}; known '
                      f'models: {", ".join(_REGISTRY)}.')
  if name not in _REGISTRY:
    raise ConfigError(
        f'Unknown model {name!r}; known models: {", ".join(_REGISTRY)} (your own: '
        'fltff.models.register).')
  try:
    shape = tuple(int(d) for d in input_shape)
  except (TypeError, ValueError):
    shape = ()  # Refused next, as a shape with a non-positive size.
  if not shape or any(d <= 0 for d in shape):
    raise ConfigError(f'input_shape must be a sequence of positive ints; got {input_shape!r}.')
  if int(num_classes) < 2:
    raise ConfigError(f'num_classes must be at least 2; got {num_classes}.')
  model = _REGISTRY[name](name, shape, int(num_classes), _Init(seed))
  if name not in MODEL_NAMES:  # A user's model: checked once here, with a clear message.
    check_logits(model, num_classes, f'The function registered as model {name!r}')
  return model


def check_logits(model, num_classes: int, what: str) -> None:
  """`ConfigError` unless `model` (returned by `what`) is a Keras model that outputs logits
  `[batch, num_classes]`, not probabilities (which the loss would take for logits)."""
  if not isinstance(model, tf.keras.Model):
    raise ConfigError(f'{what} returned {type(model)}, not a tf.keras.Model.')
  if tuple(model.output_shape[1:]) != (int(num_classes),):
    raise ConfigError(f'{what} returned a model that outputs shape {model.output_shape}; '
                      f'fltff needs logits of shape (batch, {int(num_classes)}).')
  last = model.layers[-1]
  if (isinstance(last, tf.keras.layers.Softmax)
      or getattr(last, 'activation', None) is tf.keras.activations.softmax):
    raise ConfigError(f'{what} returned a model ending in a softmax (layer {last.name!r}); '
                      'fltff needs logits (its loss applies the softmax): drop the output '
                      'activation.')


def _latent_layer(model: tf.keras.Model) -> tf.keras.layers.Layer:
  try:
    return model.get_layer(LATENT_LAYER)
  except ValueError:
    raise ConfigError(
        f'Model {model.name!r} has no layer named {LATENT_LAYER!r}; zoo models all do.'
    ) from None


def latent_model(model: tf.keras.Model, with_output: bool = False) -> tf.keras.Model:
  """Maps `model`'s input to its latent (last hidden) layer's output, sharing its weights: the
  representation CCN averages per client and MOON contrasts; `ConfigError` if there is none.
  `with_output`: to `[latent, model's output]`, both from one pass."""
  latent = _latent_layer(model).output
  return tf.keras.Model(model.inputs, [latent, model.output] if with_output else latent,
                        name=f'{model.name}_latent')


def latent_dim(model: tf.keras.Model) -> int:
  """Size of the (flattened) latent representation of `model`."""
  return int(math.prod(_latent_layer(model).output.shape[1:]))
