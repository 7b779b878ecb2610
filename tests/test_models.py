"""Tests for fltff.models: zoo (shapes, parameter counts, determinism) and layer grouping."""

import functools
import importlib.util
import sys

import gin
import numpy as np
import pytest
import tensorflow as tf

from fltff.errors import ConfigError
from fltff import models
from fltff.learning.model_spec import architecture_fingerprint
from fltff.learning.model_spec import ModelSpec
from fltff.models import layers as layers_lib
from fltff.models import zoo

# Default input shape used for each model in these tests.
SHAPES = {
    'logistic': (60,),
    'mlp2': (28, 28, 1),
    'cnn_cifar_tutorial': (32, 32, 3),
    'cnn_mnist_582k': (28, 28, 1),
    'cnn2': (28, 28, 1),
    'cnn2_bn': (28, 28, 1),
    'resnet18': (32, 32, 3),
    'vgg16': (32, 32, 3),
}
LATENT_DIMS = {
    'logistic': 60,
    'mlp2': 200,
    'cnn_cifar_tutorial': 64,
    'cnn_mnist_582k': 512,
    'cnn2': 128,
    'cnn2_bn': 128,
    'resnet18': 512,
    'vgg16': 128,
}
# Expected (number of layer groups, number of them of kind 'norm').
GROUP_COUNTS = {
    'logistic': (1, 0),
    'mlp2': (2, 0),
    'cnn_cifar_tutorial': (5, 0),
    'cnn_mnist_582k': (4, 0),
    'cnn2': (5, 0),
    # cnn2's five layers, a BN after each conv and each hidden dense layer.
    'cnn2_bn': (9, 4),
    # stem conv + 16 block convs + 3 projection convs, each with a BN, + classifier.
    'resnet18': (41, 20),
    # 13 conv + 13 BN + latent + classifier.
    'vgg16': (28, 13),
}


@pytest.fixture(scope='module')
def built():
  """Each zoo model built once per module (seed 0, 10 classes)."""
  return {name: models.build_model(name, SHAPES[name], 10, seed=0)
          for name in models.MODEL_NAMES}


def test_model_names_cover_the_zoo():
  assert set(models.MODEL_NAMES) == set(SHAPES)


# --- Parameter counts, derived independently from the architectures. ---


def _conv(k, cin, cout, bias=True):
  return k * k * cin * cout + (cout if bias else 0)


def _dense(n_in, n_out):
  return n_in * n_out + n_out


def _resnet18_trainable(num_classes):
  total = _conv(3, 3, 64, bias=False) + 2 * 64  # stem conv + BN (gamma, beta)
  cin = 64
  for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
    for block in range(2):
      total += _conv(3, cin, cout, bias=False) + 2 * cout
      total += _conv(3, cout, cout, bias=False) + 2 * cout
      if block == 0 and (stride != 1 or cin != cout):
        total += _conv(1, cin, cout, bias=False) + 2 * cout
      cin = cout
  return total + _dense(512, num_classes)


def _resnet18_bn_channels():
  channels = 64
  for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
    channels += 2 * 2 * cout + (cout if stride != 1 else 0)
  return channels


def _vgg16_trainable(num_classes):
  total, cin = 0, 3
  for cout in (64, 64, 128, 128, 256, 256, 256, 512, 512, 512, 512, 512, 512):
    total += _conv(3, cin, cout) + 2 * cout
    cin = cout
  return total + _dense(512, 128) + _dense(128, num_classes)


@pytest.mark.parametrize('name, expected', [
    ('logistic', _dense(60, 10)),
    ('mlp2', 784 * 200 + 200 + 200 * 10 + 10),
    ('cnn_cifar_tutorial', 122_570),
    ('cnn_mnist_582k', 582_026),
    ('cnn2', _conv(5, 1, 32) + _conv(5, 32, 64) + _dense(7 * 7 * 64, 512)
     + _dense(512, 128) + _dense(128, 10)),
])
def test_param_count_small_models(built, name, expected):
  assert built[name].count_params() == expected
  assert not built[name].non_trainable_weights


def test_param_count_known_values():
  assert 784 * 200 + 200 + 200 * 10 + 10 == 159_010
  assert (_conv(3, 3, 32) + _conv(3, 32, 64) + _conv(3, 64, 64) + _dense(1024, 64)
          + _dense(64, 10)) == 122_570
  assert _conv(5, 1, 32) + _conv(5, 32, 64) + _dense(1024, 512) + _dense(512, 10) == 582_026


def _num_params(variables):
  return sum(int(v.shape.num_elements()) for v in variables)


def test_param_count_resnet18(built):
  model = built['resnet18']
  trainable = _resnet18_trainable(10)
  assert 11_100_000 < trainable < 11_200_000  # the well-known ~11.17M
  assert _num_params(model.trainable_weights) == trainable
  # BN moving mean and variance are non-trainable.
  assert _num_params(model.non_trainable_weights) == 2 * _resnet18_bn_channels()
  assert model.count_params() == trainable + 2 * _resnet18_bn_channels()


def test_param_count_cnn2_bn(built):
  model = built['cnn2_bn']
  cnn2 = (_conv(5, 1, 32) + _conv(5, 32, 64) + _dense(7 * 7 * 64, 512) + _dense(512, 128)
          + _dense(128, 10))
  bn_channels = 32 + 64 + 512 + 128
  assert cnn2 == 1_725_194
  assert _num_params(model.trainable_weights) == cnn2 + 2 * bn_channels == 1_726_666
  assert _num_params(model.non_trainable_weights) == 2 * bn_channels == 1_472
  assert model.count_params() == 1_728_138


def test_cnn2_bn_is_cnn2_with_batchnorm(built):
  # Same conv/dense layers, sizes and seeded initial kernels as cnn2; a BN before each ReLU.
  plain, bn = built['cnn2'], built['cnn2_bn']
  for name, layer in (('conv1', 'conv1'), ('conv2', 'conv2'), ('dense1', 'dense1'),
                      ('latent', 'dense2'), ('logits', 'logits')):
    np.testing.assert_array_equal(plain.get_layer(name).kernel.numpy(),
                                  bn.get_layer(layer).kernel.numpy())
  for conv_or_dense, norm, relu in (('conv1', 'bn1', 'relu1'), ('conv2', 'bn2', 'relu2'),
                                    ('dense1', 'bn3', 'relu3'), ('dense2', 'bn4', 'latent')):
    assert bn.get_layer(conv_or_dense).activation is tf.keras.activations.linear
    assert bn.get_layer(norm).input is bn.get_layer(conv_or_dense).output
    assert bn.get_layer(relu).input is bn.get_layer(norm).output
    assert isinstance(bn.get_layer(relu), tf.keras.layers.ReLU)
  # Output shapes on 28x28x1: 'same' convs, two 2x2 pools, 7·7·64 = 3136 flattened.
  assert bn.get_layer('bn1').output.shape[1:] == (28, 28, 32)
  assert bn.get_layer('bn2').output.shape[1:] == (14, 14, 64)
  assert bn.get_layer('flatten').output.shape[1:] == (3136,)
  assert bn.get_layer('bn3').output.shape[1:] == (512,)
  assert bn.get_layer('latent').output.shape[1:] == (128,)


def test_cnn2_bn_trains_its_batchnorm_statistics():
  model = models.build_model('cnn2_bn', (8, 8, 1), 3, seed=0)
  x = tf.random.stateless_normal((4, 8, 8, 1), seed=(5, 6), mean=2.0)
  before = [w.numpy() for w in model.non_trainable_weights]
  model(x, training=False)
  for a, w in zip(before, model.non_trainable_weights, strict=True):
    np.testing.assert_array_equal(a, w.numpy())  # Inference leaves the statistics alone.
  model(x, training=True)
  assert all(not np.array_equal(a, w.numpy())
             for a, w in zip(before, model.non_trainable_weights, strict=True))


def test_param_count_vgg16(built):
  model = built['vgg16']
  assert _num_params(model.trainable_weights) == _vgg16_trainable(10)
  assert _num_params(model.non_trainable_weights) == 2 * (2 * 64 + 2 * 128 + 3 * 256 + 6 * 512)


# --- Forward pass, latent layer, determinism. ---


@pytest.mark.parametrize('name', list(SHAPES))
def test_logits_shape(built, name):
  model = built[name]
  x = tf.random.stateless_uniform((3, *SHAPES[name]), seed=(1, 2))
  logits = model(x, training=False)
  assert logits.shape == (3, 10)
  assert logits.dtype == tf.float32
  assert np.all(np.isfinite(logits.numpy()))
  # Logits, not probabilities: no softmax at the output.
  assert not np.allclose(np.sum(logits.numpy(), axis=1), 1.0)


@pytest.mark.parametrize('name', list(SHAPES))
def test_latent_model(built, name):
  model = built[name]
  latent = models.latent_model(model)
  x = tf.random.stateless_uniform((2, *SHAPES[name]), seed=(3, 4))
  assert latent(x, training=False).shape == (2, LATENT_DIMS[name])
  assert models.latent_dim(model) == LATENT_DIMS[name]
  assert model.get_layer(models.LATENT_LAYER) is latent.layers[-1]
  # The classifier is the last layer and consumes the latent output.
  assert model.layers[-1].input_shape == (None, LATENT_DIMS[name])


def test_latent_model_requires_latent_layer():
  inputs = tf.keras.Input((4,))
  model = tf.keras.Model(inputs, tf.keras.layers.Dense(2)(inputs))
  with pytest.raises(ConfigError, match='latent'):
    models.latent_model(model)


@pytest.mark.parametrize('name', list(SHAPES))
def test_determinism(built, name):
  same = models.build_model(name, SHAPES[name], 10, seed=0)
  for a, b in zip(built[name].get_weights(), same.get_weights(), strict=True):
    np.testing.assert_array_equal(a, b)
  other = models.build_model(name, SHAPES[name], 10, seed=1)
  kernels = [(a, b) for a, b in zip(built[name].get_weights(), other.get_weights())
             if a.ndim >= 2]
  assert kernels and all(not np.array_equal(a, b) for a, b in kernels)


def test_graph_mode_matches_eager(built):
  # TFF builds models inside graph-mode computations: initial weights must not depend on it.
  eager_weights = [w.numpy() for w in built['cnn2'].weights]
  with tf.Graph().as_default():
    model = models.build_model('cnn2', SHAPES['cnn2'], 10, seed=0)
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      graph_weights = sess.run(model.weights)
  for a, b in zip(eager_weights, graph_weights, strict=True):
    np.testing.assert_array_equal(a, b)


def test_layers_have_distinct_seeds(built):
  # Same-shaped kernels drawn with one seed would be equal: check the seed advances per layer.
  resnet = built['resnet18']
  kernels = [resnet.get_layer(f'stage1_block{b}_conv{c}').kernel.numpy()
             for b in (1, 2) for c in (1, 2)]
  assert all(k.shape == (3, 3, 64, 64) for k in kernels)
  for i in range(len(kernels)):
    for j in range(i):
      assert not np.array_equal(kernels[i], kernels[j])


def test_num_classes_and_flat_inputs():
  model = models.build_model('mlp2', (60,), num_classes=3)
  assert model(tf.zeros((2, 60))).shape == (2, 3)
  model = models.build_model('cnn2', (28, 28), num_classes=62)  # channel-less images
  assert model(tf.zeros((2, 28, 28))).shape == (2, 62)


def test_gin_configurable():
  try:
    gin.parse_config("""
        model.name = 'cnn_mnist_582k'
        model.num_classes = 47
    """)
    model = zoo.build_model()
  finally:
    gin.clear_config()
  assert model.output_shape == (None, 47)


# --- Errors. ---


def test_unknown_name_lists_known_names():
  with pytest.raises(ConfigError) as info:
    models.build_model('resnet50')
  assert isinstance(info.value, ValueError)
  for name in models.MODEL_NAMES:
    assert name in str(info.value)


@pytest.mark.parametrize('name, shape', [
    ('cnn2', (60,)),
    ('vgg16', (28, 28, 1)),
    ('cnn_mnist_582k', (8, 8, 1)),
    ('mlp2', (0, 28)),
    ('mlp2', ('a', 28)),
    ('resnet18', (32, 32, 3, 1)),
])
def test_bad_shape(name, shape):
  with pytest.raises(ConfigError):
    models.build_model(name, shape)


def test_bad_num_classes():
  with pytest.raises(ConfigError):
    models.build_model('mlp2', num_classes=1)


# --- Your own model. ---


def _user_mlp(input_shape, num_classes, seed, outputs=None):
  init = lambda i: tf.keras.initializers.GlorotUniform(seed=seed * 10 + i)
  inputs = tf.keras.Input(input_shape)
  x = tf.keras.layers.Flatten()(inputs)
  x = tf.keras.layers.Dense(12, activation='relu', kernel_initializer=init(0), name='latent')(x)
  return tf.keras.Model(inputs, tf.keras.layers.Dense(outputs or num_classes,
                                                      kernel_initializer=init(1))(x))


@pytest.fixture
def registered():
  names = []

  def register(name, fn):
    models.register(name, fn)
    names.append(name)

  yield register
  for name in names:
    zoo._REGISTRY.pop(name, None)  # pylint: disable=protected-access


def test_a_registered_model_is_built_by_name_with_its_seed(registered):
  registered('user_mlp', _user_mlp)
  assert 'user_mlp' in models.model_names() and 'user_mlp' not in models.MODEL_NAMES
  a = models.build_model('user_mlp', (6,), num_classes=3, seed=4)
  b = models.build_model('user_mlp', (6,), num_classes=3, seed=4)
  c = models.build_model('user_mlp', (6,), num_classes=3, seed=5)
  for x, y in zip(a.get_weights(), b.get_weights()):
    np.testing.assert_array_equal(x, y)
  assert not np.array_equal(a.get_weights()[0], c.get_weights()[0])
  assert a.output_shape == (None, 3)
  assert [g.kind for g in models.layer_groups(a)] == ['dense', 'dense']
  assert models.latent_model(a).output_shape == (None, 12)
  from fltff.simulation.experiment import build_model_spec  # pylint: disable=g-import-not-at-top
  from helpers import mnist_sample_split  # pylint: disable=g-import-not-at-top
  spec = build_model_spec(mnist_sample_split(2, seed=0), 'user_mlp', seed=0)
  assert spec.trainable_layers()[0] == [[0, 1], [2, 3]]


def test_a_registered_model_with_wrong_outputs_or_name_is_one_clear_error(registered):
  registered('user_bad', lambda s, n, seed: _user_mlp(s, n, seed, outputs=n + 1))
  with pytest.raises(ConfigError, match='outputs shape .*logits of shape \\(batch, 3\\)'):
    models.build_model('user_bad', (6,), num_classes=3)
  registered('user_none', lambda s, n, seed: None)
  with pytest.raises(ConfigError, match='not a tf.keras.Model'):
    models.build_model('user_none', (6,), num_classes=3)
  registered('user_probs', lambda s, n, seed: tf.keras.Sequential(
      [_user_mlp(s, n, seed), tf.keras.layers.Softmax()]))
  with pytest.raises(ConfigError, match="ending in a softmax .*drop the output activation"):
    models.build_model('user_probs', (6,), num_classes=3)
  with pytest.raises(ConfigError, match='built-in model'):
    models.register('mlp2', _user_mlp)
  with pytest.raises(ConfigError, match='needs a function'):
    models.register('user_x', 3)
  with pytest.raises(ConfigError, match='fltff.models.register'):
    models.build_model('not_registered')


# --- Architecture fingerprint (what a resume verifies). ---

# The smallest inputs each zoo model takes: quick builds.
SMALL_SHAPES = {'logistic': (6,), 'mlp2': (6,), 'cnn_cifar_tutorial': (18, 18, 3),
                'cnn_mnist_582k': (16, 16, 1), 'cnn2': (4, 4), 'cnn2_bn': (4, 4, 1),
                'resnet18': (2, 2, 3), 'vgg16': (32, 32, 3)}


@pytest.mark.parametrize('name', list(SHAPES))
def test_the_architecture_fingerprint_of_a_zoo_model_is_that_of_every_build(name):
  keras_fn = functools.partial(models.build_model, name, SMALL_SHAPES[name], 3, seed=0)
  # ModelSpec builds its model in a graph of its own; these two are eager.
  fingerprints = {architecture_fingerprint(keras_fn()), architecture_fingerprint(
      keras_fn()), ModelSpec(keras_fn, SMALL_SHAPES[name], 3).architecture()}
  assert len(fingerprints) == 1 and len(fingerprints.pop()) == 64
  other_seed = functools.partial(models.build_model, name, SMALL_SHAPES[name], 3, seed=1)
  assert architecture_fingerprint(other_seed()) != architecture_fingerprint(keras_fn())


def _unnamed_mlp(activation='relu', rate=0.5, seed=0, sequential=False, dropout_first=False):
  layers = [tf.keras.layers.Dense(8, activation, kernel_initializer=tf.keras.initializers
                                  .GlorotUniform(seed)), tf.keras.layers.Dropout(rate),
            tf.keras.layers.Dense(3)]
  if dropout_first:  # The same weight shapes.
    layers[:2] = layers[1::-1]
  if sequential:
    return tf.keras.Sequential([tf.keras.Input((6,))] + layers)
  x = inputs = tf.keras.Input((6,))
  for layer in layers:
    x = layer(x)
  return tf.keras.Model(inputs, x)


@pytest.mark.parametrize('sequential', [False, True])
def test_the_architecture_fingerprint_ignores_names_not_activations_rates_or_seeds(sequential):
  fingerprint = architecture_fingerprint
  a, b = _unnamed_mlp(sequential=sequential), _unnamed_mlp(sequential=sequential)
  assert a.name != b.name and a.layers[0].name != b.layers[0].name  # Keras numbers them.
  assert fingerprint(a) == fingerprint(b)
  others = {fingerprint(_unnamed_mlp(sequential=sequential, **change)) for change in (
      dict(activation='tanh'), dict(rate=0.2), dict(seed=1), dict(dropout_first=True))}
  assert len(others) == 4 and fingerprint(a) not in others
  assert fingerprint(_unnamed_mlp(sequential=not sequential)) != fingerprint(a)


class _Doubling(tf.keras.layers.Layer):
  """A user's layer without `get_config` (its argument is not serialisable)."""

  def __init__(self, fn):
    super().__init__()
    self.fn = fn

  def call(self, x):
    return self.fn(x)


def test_a_model_keras_cannot_serialise_is_fingerprinted_by_its_layer_classes():
  def build(layer):
    inputs = tf.keras.Input((6,))
    return tf.keras.Model(inputs, tf.keras.layers.Dense(3)(layer(inputs)))
  with pytest.raises(NotImplementedError):
    build(_Doubling(lambda x: 2 * x)).to_json()
  fingerprints = [architecture_fingerprint(build(layer)) for layer in (
      _Doubling(lambda x: 2 * x), _Doubling(lambda x: 3 * x), tf.keras.layers.Dense(6))]
  assert fingerprints[0] == fingerprints[1] != fingerprints[2]


# A user's subclassed model as its file holds it; `{call}` is what `call` returns.
_USER_MODEL = """
import tensorflow as tf


class Scale(tf.keras.layers.Layer):

  def call(self, x):
    return {scale} * x


class UserModel(tf.keras.Model):

  def __init__(self, units=3):
    super().__init__()
    self.scale = Scale()
    self.dense = tf.keras.layers.Dense(units)

  def call(self, x):
    return {call}
"""


def _user_model_fingerprint(folder, monkeypatch, call='self.dense(x)', scale=2, typed_in=False):
  """The fingerprint of a built `UserModel` whose module `user_model` lies in `folder` (is
  `exec`'d, without a file, if `typed_in`)."""
  source = _USER_MODEL.format(call=call, scale=scale)
  if typed_in:
    module = {'__name__': 'user_model'}
    exec(source, module)  # pylint: disable=exec-used
    model = module['UserModel']()
  else:
    folder.mkdir()
    (folder / 'user_model.py').write_text(source)
    spec = importlib.util.spec_from_file_location('user_model', folder / 'user_model.py')
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, 'user_model', module)  # Where `inspect` finds its file.
    spec.loader.exec_module(module)
    model = module.UserModel()
  model(tf.zeros([1, 6]))
  return architecture_fingerprint(model)


@pytest.mark.parametrize('typed_in', [False, True])
def test_a_subclassed_model_is_fingerprinted_by_its_code_wherever_its_file_lies(
    tmp_path, monkeypatch, typed_in):
  fingerprint = functools.partial(_user_model_fingerprint, monkeypatch=monkeypatch,
                                  typed_in=typed_in)
  first = fingerprint(tmp_path / 'a')
  assert fingerprint(tmp_path / 'moved') == first and len(first) == 64
  others = {fingerprint(tmp_path / 'call', call='self.dense(2 * x)'),  # Only `call` differs.
            fingerprint(tmp_path / 'layer', call='self.dense(self.scale(x))'),
            fingerprint(tmp_path / 'layer_call', call='self.dense(self.scale(x))', scale=3)}
  assert len(others) == 3 and first not in others


# --- Layer grouping. ---


def _assert_partition(model, groups):
  t = [i for g in groups for i in g.trainable_indices]
  n = [i for g in groups for i in g.non_trainable_indices]
  assert t == list(range(len(model.trainable_weights)))
  assert n == list(range(len(model.non_trainable_weights)))


@pytest.mark.parametrize('name', list(SHAPES))
def test_layer_groups_partition(built, name):
  model = built[name]
  groups = models.layer_groups(model)
  _assert_partition(model, groups)
  num, num_norm = GROUP_COUNTS[name]
  assert len(groups) == num
  assert sum(g.kind == 'norm' for g in groups) == num_norm
  assert len({g.name for g in groups}) == len(groups)
  assert groups[-1].name == 'logits' and groups[-1].kind == 'dense'
  for g in groups:
    assert g.kind in ('dense', 'conv', 'norm')
    ws = [model.trainable_weights[i] for i in g.trainable_indices]
    if g.kind in ('dense', 'conv'):
      assert ws[0].shape.rank == (2 if g.kind == 'dense' else 4)  # kernel first
      assert all(w.shape.rank == 1 for w in ws[1:])  # then bias
      assert not g.non_trainable_indices
    else:
      assert [w.shape.rank for w in ws] == [1, 1]  # gamma, beta
      assert len(g.non_trainable_indices) == 2  # moving mean, variance


def test_layer_groups_small_models(built):
  groups = models.layer_groups(built['mlp2'])
  assert [(g.name, g.kind, g.trainable_indices) for g in groups] == [
      ('latent', 'dense', (0, 1)), ('logits', 'dense', (2, 3))]
  kinds = [g.kind for g in models.layer_groups(built['cnn_mnist_582k'])]
  assert kinds == ['conv', 'conv', 'dense', 'dense']
  resnet = models.layer_groups(built['resnet18'])
  assert [g.name for g in resnet[:2]] == ['stem_conv', 'stem_bn']


def test_layer_groups_cnn2_bn(built):
  # Each BN layer is a group of its own (kind 'norm', which FedBN keeps local) holding its
  # gamma and beta and its moving mean and variance.
  model = built['cnn2_bn']
  groups = models.layer_groups(model)
  assert [(g.name, g.kind) for g in groups] == [
      ('conv1', 'conv'), ('bn1', 'norm'), ('conv2', 'conv'), ('bn2', 'norm'),
      ('dense1', 'dense'), ('bn3', 'norm'), ('dense2', 'dense'), ('bn4', 'norm'),
      ('logits', 'dense')]
  trainable_sizes = [[int(model.trainable_weights[i].shape.num_elements())
                      for i in g.trainable_indices] for g in groups]
  assert trainable_sizes == [
      [5 * 5 * 1 * 32, 32], [32, 32], [5 * 5 * 32 * 64, 64], [64, 64], [3136 * 512, 512],
      [512, 512], [512 * 128, 128], [128, 128], [128 * 10, 10]]
  for g in groups:
    names = [model.trainable_weights[i].name for i in g.trainable_indices]
    stats = [model.non_trainable_weights[i].name for i in g.non_trainable_indices]
    if g.kind == 'norm':
      assert names == [f'{g.name}/gamma:0', f'{g.name}/beta:0']
      assert stats == [f'{g.name}/moving_mean:0', f'{g.name}/moving_variance:0']
    else:
      assert names == [f'{g.name}/kernel:0', f'{g.name}/bias:0'] and not stats


def test_layer_groups_nested_models():
  block = tf.keras.Sequential([
      tf.keras.layers.Conv2D(4, 3, name='inner_conv'),
      tf.keras.layers.BatchNormalization(name='inner_bn'),
      tf.keras.layers.ReLU(),
  ], name='block')

  class Head(tf.keras.layers.Layer):

    def __init__(self):
      super().__init__(name='head')
      self.hidden = tf.keras.layers.Dense(5, name='head_hidden')
      self.out = tf.keras.layers.Dense(2, use_bias=False, name='head_out')

    def call(self, x):
      return self.out(self.hidden(x))

  inputs = tf.keras.Input((8, 8, 1))
  x = tf.keras.layers.Conv2D(3, 3, name='outer_conv')(inputs)
  x = block(x)
  x = tf.keras.layers.GlobalAveragePooling2D()(x)
  model = tf.keras.Model(inputs, Head()(x))
  groups = models.layer_groups(model)
  assert [(g.name, g.kind) for g in groups] == [
      ('outer_conv', 'conv'), ('inner_conv', 'conv'), ('inner_bn', 'norm'),
      ('head_hidden', 'dense'), ('head_out', 'dense')]
  _assert_partition(model, groups)
  assert groups[-1].trainable_indices == (len(model.trainable_weights) - 1,)


def test_layer_groups_frozen_layer():
  inputs = tf.keras.Input((4,))
  hidden = tf.keras.layers.Dense(3, name='body')
  head = tf.keras.layers.Dense(2, name='head')
  model = tf.keras.Model(inputs, head(hidden(inputs)))
  head.trainable = False  # e.g. FedBABU's fixed head
  groups = models.layer_groups(model)
  assert [(g.name, g.trainable_indices, g.non_trainable_indices) for g in groups] == [
      ('body', (0, 1), ()), ('head', (), (0, 1))]


def test_layer_groups_requires_built_model():
  model = tf.keras.Sequential([tf.keras.layers.Dense(2)])
  with pytest.raises(ConfigError):
    models.layer_groups(model)


def test_group_weights(built):
  model = built['resnet18']
  groups = models.layer_groups(model)
  per_layer = models.group_weights(model.trainable_weights, groups)
  assert len(per_layer) == len(groups)
  assert [w.name for ws in per_layer for w in ws] == [w.name for w in model.trainable_weights]
  stats = models.group_weights(model.non_trainable_weights, groups, trainable=False)
  assert [len(s) for s in stats] == [2 if g.kind == 'norm' else 0 for g in groups]
  with pytest.raises(ConfigError):
    models.group_weights(model.trainable_weights[:-1], groups)


# --- Per-neuron rows. ---


@pytest.mark.parametrize('shape, rows_shape', [
    ((), (1, 1)),
    ((7,), (1, 7)),
    ((5, 3), (5, 3)),
    ((3, 3, 2, 4), (18, 4)),
    ((5, 5, 1, 32), (25, 32)),
    ((2, 3, 4, 5, 6), (120, 6)),
])
def test_to_rows_shapes(shape, rows_shape):
  x = tf.reshape(tf.range(int(np.prod(shape)), dtype=tf.float32), shape)
  rows = layers_lib.to_rows(x)
  assert tuple(rows.shape) == rows_shape
  # Row-major: row r of a conv kernel is kernel[i, j, c, :] with r = (i*kw + j)*cin + c.
  if len(shape) == 4:
    kh, kw, cin, _ = shape
    i, j, c = kh - 1, kw - 2, cin - 1
    np.testing.assert_array_equal(rows[(i * kw + j) * cin + c], x[i, j, c])


def _np_rows(x):
  x = np.asarray(x)
  if x.ndim == 0:
    return x.reshape(1, 1)
  if x.ndim == 1:
    return x.reshape(1, -1)
  return x.reshape(-1, x.shape[-1])


@pytest.mark.parametrize('shape', [(), (6,), (5, 4), (3, 3, 2, 4)])
def test_row_functions_match_numpy(shape):
  rng = np.random.default_rng(len(shape))
  a = rng.normal(size=shape).astype(np.float32)
  b = rng.normal(size=shape).astype(np.float32)
  ra, rb = _np_rows(a), _np_rows(b)
  cos = np.sum(ra * rb, 1) / (np.linalg.norm(ra, axis=1) * np.linalg.norm(rb, axis=1))
  dist = np.sum((ra - rb)**2, 1)
  np.testing.assert_allclose(models.row_cosine(a, b).numpy(), cos, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(models.row_squared_distance(a, b).numpy(), dist, rtol=1e-5)
  np.testing.assert_allclose(models.row_cosine(a, a).numpy(), 1.0, rtol=1e-5)
  np.testing.assert_allclose(models.row_cosine(a, np.float32(-2) * a).numpy(), -1.0, rtol=1e-5)


def test_row_cosine_zero_rows_finite_with_finite_gradients():
  a = tf.Variable([[0.0, 0.0, 0.0], [1.0, 2.0, 3.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
  b = tf.Variable([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
  with tf.GradientTape() as tape:
    cos = models.row_cosine(a, b)
    dist = models.row_squared_distance(a, b)
    loss = tf.reduce_sum((1.0 - cos) * dist)  # FedLap's per-neuron penalty form
  np.testing.assert_allclose(cos.numpy(), [1.0, 1.0, 1.0, 1.0])
  grads = tape.gradient([tf.reduce_sum(cos), loss], [a, b])
  for g in grads:
    assert np.all(np.isfinite(g.numpy()))
  # Zero rows contribute no gradient through the cosine.
  with tf.GradientTape() as tape:
    cos = models.row_cosine(a, b)
  ga, gb = tape.gradient(cos, [a, b])
  np.testing.assert_array_equal(ga.numpy()[[0, 1, 3]], 0.0)
  np.testing.assert_array_equal(gb.numpy()[[0, 1, 3]], 0.0)
  assert np.all(np.isfinite(ga.numpy())) and np.all(np.isfinite(gb.numpy()))


def test_row_cosine_on_model_weights(built):
  model = built['cnn_mnist_582k']
  other = models.build_model('cnn_mnist_582k', seed=1)
  groups = models.layer_groups(model)
  ours = models.group_weights(model.trainable_weights, groups)
  theirs = models.group_weights(other.trainable_weights, groups)
  for ws, vs in zip(ours, theirs, strict=True):
    kernel_cos = models.row_cosine(ws[0], vs[0])
    # Dense kernel [in, out] has one row per input neuron.
    assert kernel_cos.shape == (layers_lib.to_rows(ws[0]).shape[0],)
    assert np.all(np.abs(kernel_cos.numpy()) <= 1.0)
    # Biases start at zero: zero rows, cosine defined as 1.
    np.testing.assert_array_equal(models.row_cosine(ws[1], vs[1]).numpy(), [1.0])


@pytest.mark.parametrize('outputs, activation, message', [
    (3, 'softmax', "ModelSpec.keras_fn returned a model ending in a softmax"),
    (4, None, r'outputs shape \(None, 4\); fltff needs logits of shape \(batch, 3\)')])
def test_a_model_spec_of_probabilities_or_other_classes_is_refused_when_built(
    outputs, activation, message):
  # Before: both trained silently, on softmax outputs taken for logits or over 4 classes.
  from fltff import learning  # pylint: disable=g-import-not-at-top

  def keras_fn():
    inputs = tf.keras.Input((6,))
    return tf.keras.Model(inputs, tf.keras.layers.Dense(outputs, activation=activation)(inputs))

  spec = learning.ModelSpec(keras_fn=keras_fn, input_shape=(6,), num_classes=3)
  with pytest.raises(ConfigError, match=message):
    learning.build_fedavg(spec)
