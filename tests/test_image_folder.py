"""The CINIC-10-layout image folder source on a small folder of real PNG files."""

import numpy as np
import pytest
import tensorflow as tf

from fltff.data import image_folder_source
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
