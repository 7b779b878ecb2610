"""The CINIC-10-layout image folder source on a small folder of real PNG files."""

import numpy as np
import pytest
import tensorflow as tf

from fltff.data import image_folder_source
from fltff.errors import ConfigError
from fltff.errors import DataError

CLASSES = ('airplane', 'cat', 'truck')


def _write_folder(root, counts, size=(8, 8)):
  rng = np.random.default_rng(0)
  written = {}
  for split, per_class in counts.items():
    for label, name in enumerate(CLASSES):
      d = root / split / name
      d.mkdir(parents=True)
      for i in range(per_class):
        img = rng.integers(0, 256, size=(*size, 3), dtype=np.uint8)
        (d / f'{i:03d}.png').write_bytes(tf.io.encode_png(img).numpy())
        written[(split, label, i)] = img
  return written


def test_loads_images_and_labels(tmp_path):
  written = _write_folder(tmp_path, {'train': 4, 'test': 2})
  ds = image_folder_source(str(tmp_path), name='mini', classes=CLASSES)
  assert ds.x_train.shape == (12, 8, 8, 3) and ds.x_train.dtype == np.uint8
  assert ds.x_test.shape == (6, 8, 8, 3) and ds.num_classes == 3
  np.testing.assert_array_equal(ds.y_train, np.repeat([0, 1, 2], 4))
  # PNG is lossless: pixels come back exactly, in class then file-name order.
  np.testing.assert_array_equal(ds.x_train[5], written[('train', 1, 1)])
  np.testing.assert_array_equal(ds.x_test[4], written[('test', 2, 0)])


def test_missing_folder_split_or_class_is_a_data_error(tmp_path):
  with pytest.raises(DataError, match='not found'):
    image_folder_source(str(tmp_path / 'nope'), classes=CLASSES)
  _write_folder(tmp_path, {'train': 1})
  with pytest.raises(DataError, match='test'):
    image_folder_source(str(tmp_path), classes=CLASSES)
  with pytest.raises(DataError, match='dog'):
    image_folder_source(str(tmp_path), classes=('airplane', 'dog'))


def test_mixed_image_sizes_are_rejected(tmp_path):
  _write_folder(tmp_path, {'train': 1, 'test': 1})
  odd = np.zeros((5, 5, 3), np.uint8)
  (tmp_path / 'train' / 'cat' / 'zzz.png').write_bytes(tf.io.encode_png(odd).numpy())
  with pytest.raises(DataError, match='same size'):
    image_folder_source(str(tmp_path), classes=CLASSES)


def test_an_empty_class_folder_or_an_unreadable_image_is_a_data_error(tmp_path):
  """Before, an empty class folder left the class without examples, silently, and an unreadable
  image stopped the run with TensorFlow's traceback."""
  _write_folder(tmp_path, {'train': 2, 'test': 1})
  # A folder copied from macOS: a hidden `._<name>` metadata file beside each image, not read.
  (tmp_path / 'train' / 'cat' / '._000.png').write_bytes(b'\0\5\26\7 Mac OS X')
  assert image_folder_source(str(tmp_path), classes=CLASSES).x_train.shape == (6, 8, 8, 3)
  (tmp_path / 'test' / 'cat' / '000.png').rename(tmp_path / 'test' / 'cat' / '000.gif.part')
  with pytest.raises(DataError, match=f"^{tmp_path / 'test' / 'cat'} holds no images"):
    image_folder_source(str(tmp_path), classes=CLASSES)
  (tmp_path / 'test' / 'cat' / '000.gif.part').rename(tmp_path / 'test' / 'cat' / '000.png')
  broken = tmp_path / 'train' / 'truck' / '001.png'
  broken.write_bytes(broken.read_bytes()[:60])  # A download cut short.
  with pytest.raises(DataError, match=f'^{broken} cannot be decoded as an image '
                                      r'\(Invalid PNG data, size 60\)'):
    image_folder_source(str(tmp_path), classes=CLASSES)


def test_the_training_folder_as_test_split_or_a_class_twice_is_refused(tmp_path):
  _write_folder(tmp_path, {'train': 2, 'test': 1})
  with pytest.raises(DataError, match='is also a training example'):
    image_folder_source(str(tmp_path), classes=CLASSES, test_split='train')
  with pytest.raises(ConfigError, match="must name each class folder once, got "
                                        r"\('airplane', 'cat', 'cat'\)"):
    image_folder_source(str(tmp_path), classes=('airplane', 'cat', 'cat'))
