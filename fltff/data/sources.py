"""Data sources, each returning a whole dataset as in-memory NumPy arrays (`ArrayDataset`).

Only `tfds_source` and `femnist_source` download, and only with `download=True`; relative paths
are looked up in the current directory, then in fltff's shipped files (docs/configuration.md).
"""

import contextlib
import dataclasses
import gzip
import os
import pathlib
import sqlite3
import zipfile
import zlib
from typing import Optional

import gin
import numpy as np

from fltff import resources
from fltff.config_checks import check_number
from fltff.errors import ConfigError
from fltff.errors import DataError


@dataclasses.dataclass(frozen=True)
class ArrayDataset:
  """A whole dataset in memory.

  Attributes:
    x_train: Images as uint8 `[n, H, W, C]`; feature vectors as float32 `[n, d]`.
    y_train: int32 labels `[n]` in `[0, num_classes)`.
    x_test: The central test set, like `x_train` (`y_test` like `y_train`).
    natural_partition: Optional per-client index arrays into `x_train`, for datasets that come
      with clients (synthetic, FEMNIST).
    natural_test_partition: Optional per-client index arrays into `x_test`, aligned with
      `natural_partition`: each client's own held-out examples.
  """
  name: str
  x_train: np.ndarray
  y_train: np.ndarray
  x_test: np.ndarray
  y_test: np.ndarray
  num_classes: int
  natural_partition: Optional[list[np.ndarray]] = None
  natural_test_partition: Optional[list[np.ndarray]] = None


def check_dataset(dataset: ArrayDataset, origin: str) -> ArrayDataset:
  """`dataset`, unless it is data a run would train on without a word and get wrong, or stop on
  with a traceback: one `DataError` line naming `origin`, the split and the count (each check:
  docs/configuration.md, "Your own data"). uint8 images are scaled to [0, 1] by the input
  pipeline, other images must lie there; feature vectors (`[n, d]`) may take any finite value."""
  for key in ('x_train', 'y_train', 'x_test', 'y_test'):
    if not isinstance(getattr(dataset, key), np.ndarray):
      raise DataError(f'{origin}: {key} is of type {type(getattr(dataset, key)).__name__}, '
                      'not a NumPy array; build the ArrayDataset from np.asarray(...).')
  x_train, x_test = dataset.x_train, dataset.x_test
  if x_train.shape[1:] != x_test.shape[1:]:
    raise DataError(f'{origin}: training examples have shape {x_train.shape[1:]}, test '
                    f'examples {x_test.shape[1:]}; they must match.')
  if x_train.ndim == 4 and x_train.shape[1] in (1, 3, 4) and x_train.shape[3] > 4:
    raise DataError(f'{origin}: examples of shape {x_train.shape[1:]} are channel-first (C, H, '
                    "W), as PyTorch stores images, but fltff's models read (H, W, C): "
                    'np.moveaxis(x, 1, -1).')
  clients, test_parts = len(dataset.natural_partition or ()), dataset.natural_test_partition
  outside = sum(int(np.count_nonzero((t < 0) | (t >= len(x_test))))
                for t in map(np.asarray, test_parts or ()))
  if test_parts is not None and (len(test_parts) != clients or outside):
    raise DataError(f'{origin}: natural_test_partition has {len(test_parts)} index arrays, '
                    f"{outside} indices outside x_test's [0, {len(x_test)}); it needs one "
                    f'array of x_test indices per client of natural_partition ({clients}).')
  if not len(dataset.y_test):
    raise DataError(f'{origin}: the test split has no examples, and every evaluation reads it '
                    '(the central test set, and the local test splits drawn from it).')
  if x_train.dtype == x_test.dtype and x_train.size and all(  # 32 values per example first.
      np.isin(_rows(x_test, c), _rows(x_train, c)).all()
      for c in (np.linspace(0, x_train[0].size - 1, 32).astype(np.int64), slice(None))):
    raise DataError(f'{origin}: every test example (all {len(x_test)}) is also a training '
                    'example, as when one file or folder is read as both splits: every '
                    'evaluation would measure accuracy on training data; give held-out '
                    'examples as the test split.')
  for split in ('train', 'test'):
    x, y = getattr(dataset, f'x_{split}'), getattr(dataset, f'y_{split}')
    if len(x) != len(y):
      raise DataError(f'{origin}: x_{split} has {len(x)} examples but y_{split} has {len(y)}; '
                      'both must have the same length.')
    if np.issubdtype(x.dtype, np.floating):
      bad = int(x.size - np.count_nonzero(np.isfinite(x)))
      if bad:
        raise DataError(f'{origin}: x_{split} holds {bad} NaN or infinite values (of {x.size}); '
                        'fix or drop those examples.')
    if x.dtype != np.uint8 and x.ndim >= 3 and x.size and (x.min() < 0 or x.max() > 1):
      raise DataError(
          f'{origin}: x_{split} holds {x.dtype} images with values in [{x.min():g}, {x.max():g}], '
          'but only uint8 images are scaled (by the input pipeline); others are used as they '
          'are and must lie in [0, 1]: store them as uint8 or divide by 255 (features that '
          'are not images: reshape them to [n, d]).')
    if x.dtype == np.uint8 and x.size and x.max() <= 1:  # E.g. binarised: (x > 127) as uint8.
      raise DataError(f'{origin}: x_{split} holds uint8 images of only 0s and 1s, which the '
                      'input pipeline would divide by 255 like pixels: store them as float32.')
    outside = int(np.count_nonzero((y < 0) | (y >= dataset.num_classes)))
    if outside:
      raise DataError(f'{origin}: y_{split} holds {outside} labels outside [0, '
                      f'{dataset.num_classes}) (the declared classes); fix the labels (class '
                      'indices from 0: 1-based labels, subtract 1) or the class count.')
  return dataset


def _rows(x: np.ndarray, columns=slice(None)) -> np.ndarray:
  """Each example of `x` (its values at flat positions `columns`) as one value for `np.isin`."""
  flat = np.ascontiguousarray(x.reshape(len(x), -1)[:, columns])
  return flat.view(np.dtype((np.void, flat.shape[1] * flat.itemsize))).ravel()


def _contiguous(lengths) -> list[np.ndarray]:
  """Index arrays of consecutive runs of `lengths` (a natural partition of concatenated data)."""
  lengths = list(lengths)
  return np.split(np.arange(sum(lengths), dtype=np.int64), np.cumsum(lengths)[:-1])


def _images(x: np.ndarray) -> np.ndarray:
  return x[..., np.newaxis] if x.ndim == 3 else x


@gin.configurable('tfds_source')
def tfds_source(name: str,
                data_dir: Optional[str] = None,
                download: bool = False) -> ArrayDataset:
  """Loads a TFDS image classification dataset: uint8 images `[n, H, W, C]`, int32 labels.

  Args:
    name: A TFDS dataset with 'train' and 'test' splits and an (image, label) supervised form
      (e.g. 'mnist', 'cifar100', 'emnist/digits'); its label feature gives the class count.
    data_dir: The TFDS data directory; `None`: $TFDS_DATA_DIR or `~/tensorflow_datasets`.

  Raises:
    ConfigError: For a name TFDS does not know or a dataset that is not image classification.
    DataError: If the data is not prepared in `data_dir` and `download` is False.
  """
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  resolved = os.path.abspath(os.path.expanduser(
      data_dir or os.environ.get('TFDS_DATA_DIR') or tfds.core.constants.DATA_DIR))
  try:
    builder = tfds.builder(name, data_dir=data_dir)
  except Exception as e:  # pylint: disable=broad-except
    if 'NotFound' not in type(e).__name__:
      raise
    raise ConfigError(f'TFDS has no dataset {name!r} (tfds_source.name; see '
                      'https://www.tensorflow.org/datasets/catalog), or use npz_source for '
                      'other data.') from None
  keys = builder.info.supervised_keys  # The class count from the label feature, no data read.
  label = builder.info.features[keys[1]] if keys and len(keys) == 2 else None
  if label is None or not hasattr(label, 'num_classes') or len(
      getattr(builder.info.features[keys[0]], 'shape', ())) not in (2, 3):
    raise ConfigError(f'TFDS dataset {name!r} is not image classification (a supervised '
                      '(image, label) pair with a class label); tfds_source reads those only.')
  try:
    # Not `batch_size=-1`: under `tfds.testing.mock_data` (split size 0) that aborts.
    splits = tfds.load(name, split=['train', 'test'], as_supervised=True,
                       data_dir=data_dir, download=download)
  except Exception as e:  # pylint: disable=broad-except
    not_prepared = isinstance(e, (AssertionError, FileNotFoundError)) or (
        'NotFound' in type(e).__name__)
    if not not_prepared:
      raise
    raise DataError(
        f'TFDS dataset {name!r} is not prepared in {resolved} and downloading is off '
        f'({type(e).__name__}); prepare it on a machine with network access with '
        f'`python -c "import tensorflow_datasets as tfds; tfds.load(\'{name}\', '
        f'data_dir=\'{resolved}\')"` and copy that directory here, or set '
        f'`tfds_source.download = True`.') from e

  arrays = []
  for ds in splits:
    batches = list(tfds.as_numpy(ds.batch(8192)))
    if not batches:
      raise DataError(f'TFDS dataset {name!r} in {resolved} has an empty '
                      'split; re-prepare it with tfds.load(..., download=True).')
    xs, ys = zip(*batches)
    arrays.append((_images(np.concatenate(xs)).astype(np.uint8),
                   np.concatenate(ys).astype(np.int32).reshape(-1)))
  (x_train, y_train), (x_test, y_test) = arrays
  return ArrayDataset(name=name, x_train=x_train, y_train=y_train, x_test=x_test,
                      y_test=y_test, num_classes=int(label.num_classes))


def _find(path: str, folder: bool, what: str, hint: str) -> pathlib.Path:
  """The file (`folder`: folder) `path`; a relative path is looked up in the current directory,
  then in fltff's shipped files; else `DataError` '<what> <path> not found (tried ...); <hint>'."""
  p = pathlib.Path(os.path.expanduser(path))
  candidates = [p] if p.is_absolute() else [pathlib.Path.cwd() / p] + [
      pathlib.Path(r) / p for r in resources.shipped_roots()]
  found = next((c for c in candidates if (c.is_dir() if folder else c.is_file())), None)
  if found is None:
    tried = ', '.join(str(c.resolve()) for c in candidates)
    raise DataError(f'{what} {path!r} not found (tried {tried}); {hint}')
  return found


_NPZ_KEYS = ('x_train', 'y_train', 'x_test', 'y_test')

# IDX element types by the magic number's third byte (LeCun's "THE IDX FILE FORMAT"; big-endian).
_IDX_DTYPES = {0x08: np.dtype('u1'), 0x09: np.dtype('i1'), 0x0B: np.dtype('>i2'),
               0x0C: np.dtype('>i4'), 0x0D: np.dtype('>f4'), 0x0E: np.dtype('>f8')}
IDX_FILES = {
    'train': ('train-images-idx3-ubyte', 'train-labels-idx1-ubyte'),
    'test': ('t10k-images-idx3-ubyte', 't10k-labels-idx1-ubyte'),
}
_IDX_HINT = ('Fashion-MNIST: `apt-get install dataset-fashion-mnist` (Debian/Ubuntu, files in '
             '/usr/share/datasets/fashion-mnist/) or the four .gz files from '
             'github.com/zalandoresearch/fashion-mnist; MNIST: the same four files from its '
             'authors. Bind idx_source.path to their folder.')


def read_idx(path: str) -> np.ndarray:
  """Reads one IDX file (gzip-compressed if named `*.gz`) into a NumPy array; `DataError` for a
  file that is not IDX (magic `00 00 <type> <ndim>`), is truncated, or has bytes left over."""
  opener = gzip.open if str(path).endswith('.gz') else open
  try:
    with opener(path, 'rb') as f:
      raw = f.read()
  except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError.
    raise DataError(f'cannot read {path} ({type(e).__name__}: {e}); the file is damaged or '
                    f'truncated, fetch it again. {_IDX_HINT}') from e
  if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES or raw[3] == 0:
    raise DataError(f'{path} is not an IDX file (magic bytes {raw[:4].hex() or "missing"}, '
                    f'expected 0000 <type> <ndim>). {_IDX_HINT}')
  dtype, ndim = _IDX_DTYPES[raw[2]], raw[3]
  header = 4 + 4 * ndim
  if len(raw) < header:
    raise DataError(f'{path} is truncated: its header needs {header} bytes, the file has '
                    f'{len(raw)}. Fetch it again. {_IDX_HINT}')
  shape = tuple(int(d) for d in np.frombuffer(raw, '>u4', count=ndim, offset=4))
  expected = header + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
  if len(raw) != expected:
    what = 'truncated' if len(raw) < expected else 'longer than its header says'
    raise DataError(f'{path} is {what}: shape {shape} needs {expected} bytes, the file has '
                    f'{len(raw)}. Fetch it again. {_IDX_HINT}')
  return np.frombuffer(raw, dtype, offset=header).reshape(shape).astype(dtype.newbyteorder('='))


@gin.configurable('idx_source')
def idx_source(path: str = '/usr/share/datasets/fashion-mnist',
               name: Optional[str] = None,
               num_classes: int = 10) -> ArrayDataset:
  """MNIST-family data from its four IDX files: uint8 images `[n, 28, 28, 1]`, int32 labels.

  Reads the `IDX_FILES` (`train-images-idx3-ubyte[.gz]`, ...), the layout of MNIST (LeCun et
  al.), Fashion-MNIST (Xiao et al., 2017; Debian/Ubuntu's `dataset-fashion-mnist` installs it in
  `/usr/share/datasets/fashion-mnist/`) and KMNIST. `DataError` for a missing or damaged file,
  or files that do not match (image and label counts, image shapes, label range).

  Args:
    name: Defaults to the folder name with '-' as '_' (`fashion_mnist`).
    num_classes: Every label must lie in `[0, num_classes)`.
  """
  root = _find(path, True, 'IDX data folder', _IDX_HINT)
  files = {stem: next((f for f in (root / f'{stem}.gz', root / stem) if f.is_file()), None)
           for pair in IDX_FILES.values() for stem in pair}
  missing = [stem for stem, f in files.items() if f is None]
  if missing:
    raise DataError(f'{root} lacks {", ".join(s + "[.gz]" for s in missing)}. {_IDX_HINT}')

  arrays = {}
  for split, (images_stem, labels_stem) in IDX_FILES.items():
    x = read_idx(str(files[images_stem]))
    y = _labels(read_idx(str(files[labels_stem])), 'the labels', files[labels_stem])
    if x.ndim != 3 or x.dtype != np.uint8:
      raise DataError(f'{files[images_stem]} holds {x.dtype} data of shape {x.shape}; '
                      'images must be uint8 [n, rows, cols].')
    if len(x) != len(y):
      raise DataError(f'{files[images_stem].name} has {len(x)} images but '
                      f'{files[labels_stem].name} has {len(y)} labels; the files do not '
                      f'belong together. {_IDX_HINT}')
    arrays[split] = (_images(x), y)
  (x_train, y_train), (x_test, y_test) = arrays['train'], arrays['test']
  return check_dataset(ArrayDataset(name=name or root.name.replace('-', '_'), x_train=x_train,
                                    y_train=y_train, x_test=x_test, y_test=y_test,
                                    num_classes=int(num_classes)), f'idx_source ({root})')


def _labels(y: np.ndarray, key: str, path: pathlib.Path) -> np.ndarray:
  """Checks that labels are integers and flattens `[n, 1]` labels to `[n]`."""
  if y.ndim == 2 and y.shape[1] == 1:
    y = y[:, 0]
  if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
    raise DataError(f'{key} in {path} must be integer class labels of shape [n] or [n, 1], '
                    f'got dtype {y.dtype} and shape {y.shape}; store class indices, not '
                    'one-hot vectors.')
  return y.astype(np.int32)


@gin.configurable('npz_source')
def npz_source(path: str,
               name: Optional[str] = None,
               num_classes: Optional[int] = None) -> ArrayDataset:
  """Loads a Keras-layout `.npz` file (`x_train, y_train, x_test, y_test`).

  uint8 `[n, H, W]` images get a channel axis; non-uint8 inputs become float32. `DataError` if
  the file or one of its arrays is missing or inconsistent (`check_dataset`), or if labels skip
  a class of an inferred class count.

  Args:
    name: Defaults to the file name without extension.
    num_classes: Defaults to `max(label) + 1` over both splits.
  """
  resolved = _find(path, False, 'npz file', 'check npz_source.path.')
  try:
    with np.load(resolved, allow_pickle=False) as f:
      missing = [k for k in _NPZ_KEYS if k not in f.files]
      if missing:
        raise DataError(f'npz file {resolved} lacks arrays {missing} (it has {f.files}); '
                        f'a Keras-layout file needs {list(_NPZ_KEYS)}.')
      raw = {k: f[k] for k in _NPZ_KEYS}
  # Truncated, not a zip, or an .npy file (TypeError: one array, not a context manager).
  except (OSError, ValueError, EOFError, TypeError, zipfile.BadZipFile) as e:
    raise DataError(f'cannot read {resolved} as an .npz file ({e}); write it with '
                    'np.savez(path, x_train=..., y_train=..., x_test=..., y_test=...).') from e
  x_train, x_test = (_images(x) if x.dtype == np.uint8 else _images(x).astype(np.float32)
                     for x in (raw['x_train'], raw['x_test']))
  y_train = _labels(raw['y_train'], 'y_train', resolved)
  y_test = _labels(raw['y_test'], 'y_test', resolved)
  all_labels = np.concatenate([y_train, y_test])
  inferred = int(all_labels.max()) + 1 if all_labels.size else 0
  absent = np.setdiff1d(np.arange(inferred), all_labels)
  if num_classes is None and absent.size:
    raise DataError(f'{resolved}: no example has label {absent[0]}, but the class count '
                    f'inferred from the largest label is {inferred}: labels are class indices '
                    '0..C-1 (1-based labels: subtract 1); if classes without examples are '
                    f'meant, declare them with npz_source.num_classes = {inferred}.')
  return check_dataset(ArrayDataset(
      name=name or resolved.stem, x_train=x_train, y_train=y_train, x_test=x_test,
      y_test=y_test, num_classes=int(inferred if num_classes is None else num_classes)),
      str(resolved))


CINIC10_CLASSES = ('airplane', 'automobile', 'bird', 'cat', 'deer', 'dog', 'frog', 'horse',
                   'ship', 'truck')
_IMAGE_SUFFIXES = ('.png', '.jpg', '.jpeg')


def _read_image_split(root: pathlib.Path, split: str, classes) -> tuple[np.ndarray, np.ndarray]:
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  split_dir = root / split
  if not split_dir.is_dir():
    raise DataError(f'{split_dir} does not exist; an image folder needs '
                    f'<root>/{split}/<class>/*.png (CINIC-10 layout).')
  images, labels, shape = [], [], None
  for label, name in enumerate(classes):
    class_dir = split_dir / name
    if not class_dir.is_dir():
      raise DataError(f'{class_dir} does not exist; expected one folder per class '
                      f'({", ".join(classes)}) under {split_dir}.')
    count = len(images)
    for path in sorted(class_dir.iterdir()):
      if path.name.startswith('.') or path.suffix.lower() not in _IMAGE_SUFFIXES:
        continue  # Hidden files too: macOS's `._x.png` beside each image of a copied folder.
      try:
        img = tf.io.decode_image(tf.io.read_file(str(path)), channels=3,
                                 expand_animations=False).numpy()
      except tf.errors.InvalidArgumentError as e:  # Truncated, or not an image at all.
        why = e.message.split('}} ')[-1].split(' [Op:')[0]
        raise DataError(f'{path} cannot be decoded as an image ({why}); replace or delete '
                        'it.') from None
      if shape is None:
        shape = img.shape
      elif img.shape != shape:
        raise DataError(f'{path} is {img.shape[1]}x{img.shape[0]}, the other images are '
                        f'{shape[1]}x{shape[0]}; all images must have the same size.')
      images.append(img)
      labels.append(label)
    if len(images) == count:
      raise DataError(f'{class_dir} holds no images (*.png, *.jpg): class {name!r} would have '
                      f'no {split} examples; add them, or leave the class out of '
                      'image_folder_source.classes.')
  return np.stack(images).astype(np.uint8), np.asarray(labels, np.int32)


@gin.configurable('image_folder_source')
def image_folder_source(path: str,
                        name: str = 'cinic10',
                        classes=CINIC10_CLASSES,
                        train_split: str = 'train',
                        test_split: str = 'test') -> ArrayDataset:
  """Images (`.png`, `.jpg`; one size, read as RGB) from `<path>/<split>/<class>/`.

  This is the published layout of CINIC-10 (Darlow et al., 2018): `train/`, `valid/`, `test/`,
  each with the ten CIFAR class folders; download and unpack it, then point `path` at it (to
  train on 'valid' too, merge it into the training folder beforehand).

  Args:
    classes: Class folder names in label order (default: CINIC-10's, CIFAR-10's order).
    test_split: Folder of the central test images.
  """
  root = _find(path, True, 'image folder', 'download CINIC-10 (or any folder with '
               '<split>/<class>/*.png) and set image_folder_source.path.')
  classes = tuple(classes)
  if not classes or len(set(classes)) < len(classes):
    raise ConfigError(f'image_folder_source.classes must name each class folder once, got '
                      f'{classes}.')
  x_train, y_train = _read_image_split(root, train_split, classes)
  x_test, y_test = _read_image_split(root, test_split, classes)
  return check_dataset(ArrayDataset(name=name, x_train=x_train, y_train=y_train, x_test=x_test,
                                    y_test=y_test, num_classes=len(classes)), str(root))


# TFF 0.87's federated EMNIST: one SQLite file, both variants as splits (`femnist_source`).
_EMNIST_URL = 'https://storage.googleapis.com/tff-datasets-public/emnist_all.sqlite.lzma'
_EMNIST_FILE = 'emnist_all.sqlite'


def _writer_arrays(client_data, writer: str) -> tuple[np.ndarray, np.ndarray]:
  """One writer's examples as (uint8 `[n, 28, 28, 1]`, int32 `[n]`); empty if absent."""
  batches = list(client_data.create_tf_dataset_for_client(writer).batch(
      1024).as_numpy_iterator()) if writer in client_data.client_ids else []
  pixels = [np.zeros((0, 28, 28), np.float32)] + [b['pixels'] for b in batches]
  labels = [np.zeros(0, np.int32)] + [b['label'] for b in batches]
  # TFF's float [0, 1] white-background pixels -> uint8 ink-on-black.
  x = np.round((1.0 - np.asarray(np.concatenate(pixels), np.float32)) * 255.0)
  return (np.clip(x, 0, 255).astype(np.uint8).reshape(-1, 28, 28, 1),
          np.concatenate(labels).astype(np.int32).reshape(-1))


@gin.configurable('femnist_source')
def femnist_source(num_clients: int = 10,
                   only_digits: bool = False,
                   cache_dir: Optional[str] = None,
                   download: bool = False,
                   seed: int = 0,
                   min_examples_per_client: int = 1) -> ArrayDataset:
  """FEMNIST (LEAF's federated EMNIST, one client per writer) through TFF 0.87's loader.

  Reads `<cache_dir>/emnist_all.sqlite` (default `~/.tff`; TFF downloads it only with
  `download=True`) and draws `num_clients` of the writers with at least
  `min_examples_per_client` training examples (`default_rng(seed)`): their training examples
  as `natural_partition`, their test examples as the central test set and
  `natural_test_partition` (docs/configuration.md).
  """
  check_number('femnist_source.num_clients', num_clients, integer=True, low=1)
  check_number('femnist_source.min_examples_per_client', min_examples_per_client, integer=True,
               low=1)
  resolved = os.path.abspath(os.path.expanduser(cache_dir or os.path.join('~', '.tff')))
  path = os.path.join(resolved, _EMNIST_FILE)
  existed = os.path.isfile(path)
  if not existed and not download:
    # Checked here: TFF's `load_data` would start downloading right away.
    raise DataError(
        f'FEMNIST file {_EMNIST_FILE} is not in {resolved} and femnist_source.download is '
        f'False; set femnist_source.download = True once on a machine with network access '
        f'(TFF downloads {_EMNIST_URL} and decompresses it there), or copy {_EMNIST_FILE} '
        f'from such a machine\'s TFF cache (~/.tff) into {resolved}.')

  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top
  try:
    train, test = tff.simulation.datasets.emnist.load_data(only_digits=only_digits,
                                                           cache_dir=resolved)
    # Training examples per writer, from the database's `client_metadata` table.
    uri = pathlib.Path(path).as_uri() + '?mode=ro'
    with contextlib.closing(sqlite3.connect(uri, uri=True)) as connection:
      rows = connection.execute(
          'SELECT client_id, num_examples FROM client_metadata WHERE split_name = ?',
          ('digits_only_train' if only_digits else 'all_train',)).fetchall()
    counts = {str(cid): int(n) for cid, n in rows}
  except BaseException as e:
    if not existed and os.path.isfile(path):
      os.remove(path)  # TFF decompresses straight into the cache: drop a partial file.
    if not isinstance(e, Exception):
      raise
    if not existed:
      raise DataError(f'downloading FEMNIST from {_EMNIST_URL} into {resolved} failed '
                      f'({type(e).__name__}: {e}); check the network, or copy '
                      f'{_EMNIST_FILE} from another machine\'s ~/.tff into {resolved}.') from e
    if isinstance(e, sqlite3.Error) or type(e).__name__ == 'DatabaseFormatError':
      raise DataError(f'{path} is not a readable TFF EMNIST database ({type(e).__name__}: '
                      f'{e}); delete it and set femnist_source.download = True, or copy '
                      'an intact emnist_all.sqlite there.') from e
    raise

  eligible = sorted(cid for cid in train.client_ids
                    if counts.get(cid, 0) >= min_examples_per_client)
  if len(eligible) < num_clients:
    raise ConfigError(
        f'femnist_source.num_clients is {num_clients} but only {len(eligible)} writers have '
        f'at least {min_examples_per_client} training examples in {path}; ask for fewer '
        'clients or lower femnist_source.min_examples_per_client.')
  rng = np.random.default_rng(seed)
  chosen = [eligible[i] for i in np.sort(rng.choice(len(eligible), size=num_clients,
                                                    replace=False))]

  num_classes = 10 if only_digits else 62
  splits = []
  for client_data in (train, test):
    xs, ys = zip(*[_writer_arrays(client_data, writer) for writer in chosen])
    splits.append((np.concatenate(xs), np.concatenate(ys), _contiguous(map(len, ys))))
  (x_train, y_train, train_parts), (x_test, y_test, test_parts) = splits
  for writer, part in zip(chosen, train_parts):
    if part.size == 0:
      raise DataError(f'writer {writer!r} has no training examples in {path} although its '
                      'metadata lists some; the database is inconsistent, download it again.')
  return check_dataset(ArrayDataset(
      name='femnist_digits' if only_digits else 'femnist', x_train=x_train, y_train=y_train,
      x_test=x_test, y_test=y_test, num_classes=num_classes, natural_partition=train_parts,
      natural_test_partition=test_parts), path)


@gin.configurable('synthetic_source')
def synthetic_source(alpha: float = 1.0,
                     beta: float = 1.0,
                     num_clients: int = 30,
                     dimension: int = 60,
                     num_classes: int = 10,
                     iid: bool = False,
                     min_samples: int = 50,
                     max_samples: int = 1000,
                     test_fraction: float = 0.2,
                     seed: int = 0) -> ArrayDataset:
  """Synthetic(alpha, beta) of FedProx (Li et al., MLSys 2020, Sec. 5.1) / LEAF.

  Per client k: u_k ~ N(0, alpha), B_k ~ N(0, beta); W_k[j, c] ~ N(u_k, 1),
  b_k[c] ~ N(u_k, 1); v_k[j] ~ N(B_k, 1); x ~ N(v_k, Sigma) with diagonal
  Sigma_jj = j^-1.2; y = argmax(softmax(W_k x + b_k)). As in the FedProx reference
  generator, alpha and beta are standard deviations (`np.random.normal(0, alpha)`).
  `iid=True` is FedProx's Synthetic-IID: one W, b ~ N(0, 1) for all clients and v_k = B_k
  (all zeros for beta = 0, the paper's setting).

  A client's size (train + test) is `min_samples + int(lognormal(4, 2))` (the reference: `+ 50`),
  clipped to `max_samples` against the heavy tail. Each client holds out a random
  `test_fraction` (in [0, 1), at least one example): the central test set and
  `natural_test_partition`. float32 `x` `[n, dimension]`, a deterministic function of all
  arguments; alpha (how much the clients' models differ) and beta (their inputs) are >= 0.
  """
  if alpha < 0 or beta < 0:
    raise ConfigError(f'synthetic_source needs alpha >= 0 and beta >= 0, got alpha={alpha} '
                      f'and beta={beta}; use e.g. alpha = beta = 1 (Synthetic(1, 1)).')
  check_number('synthetic_source.num_clients', num_clients, integer=True, low=1)
  check_number('synthetic_source.dimension', dimension, integer=True, low=1)
  check_number('synthetic_source.num_classes', num_classes, integer=True, low=2)
  check_number('synthetic_source.test_fraction', test_fraction, low=0, high=1, open_high=True)
  smallest = 2 if test_fraction > 0 else 1
  if min_samples < smallest or max_samples < min_samples:
    raise ConfigError(f'synthetic_source needs {smallest} <= min_samples <= max_samples, got '
                      f'min_samples={min_samples} and max_samples={max_samples}.')

  rng = np.random.default_rng(seed)
  sizes = np.minimum(min_samples + rng.lognormal(4, 2, num_clients).astype(np.int64),
                     max_samples)
  mean_w = rng.normal(0, alpha, num_clients)  # u_k; the reference uses it for b_k too.
  big_b = rng.normal(0, beta, num_clients)
  if iid:
    mean_x = np.repeat(big_b[:, None], dimension, axis=1)
    w_global = rng.normal(0, 1, (dimension, num_classes))
    b_global = rng.normal(0, 1, num_classes)
  else:
    mean_x = rng.normal(big_b[:, None], 1, (num_clients, dimension))
  std_x = np.power(np.arange(1, dimension + 1, dtype=np.float64), -1.2) ** 0.5

  clients = []
  for k in range(num_clients):
    if iid:
      w, b = w_global, b_global
    else:
      w = rng.normal(mean_w[k], 1, (dimension, num_classes))
      b = rng.normal(mean_w[k], 1, num_classes)
    n = int(sizes[k])
    x = mean_x[k] + std_x * rng.standard_normal((n, dimension))
    y = np.argmax(x @ w + b, axis=1)  # softmax is monotone: argmax of the logits.
    n_test = max(1, int(round(test_fraction * n))) if test_fraction > 0 else 0
    perm = rng.permutation(n)
    test_idx, train_idx = np.sort(perm[:n_test]), np.sort(perm[n_test:])
    clients.append((x[train_idx], y[train_idx], x[test_idx], y[test_idx]))
  train_x, train_y, test_x, test_y = zip(*clients)

  name = 'synthetic_iid' if iid else f'synthetic_{alpha:g}_{beta:g}'
  return ArrayDataset(
      name=name,
      x_train=np.concatenate(train_x).astype(np.float32),
      y_train=np.concatenate(train_y).astype(np.int32),
      x_test=np.concatenate(test_x).astype(np.float32).reshape(-1, dimension),
      y_test=np.concatenate(test_y).astype(np.int32),
      num_classes=num_classes,
      natural_partition=_contiguous(map(len, train_y)),
      natural_test_partition=_contiguous(map(len, test_y)))
