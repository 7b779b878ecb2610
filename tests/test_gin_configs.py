"""Every shipped gin file parses against the registered configurables (catches typos)."""

import glob
import os

import gin
import pytest

import fltff

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = sorted(os.path.relpath(p, REPO)
               for p in glob.glob(os.path.join(REPO, 'gin_configs', '**', '*.gin'),
                                  recursive=True))


@pytest.mark.parametrize('path', FILES)
def test_gin_file_parses(path, monkeypatch):
  monkeypatch.chdir(REPO)
  fltff.register_configurables()
  gin.clear_config()
  try:
    gin.parse_config_files_and_bindings([path], [], skip_unknown=False)
    if not path.startswith('gin_configs/base/') and not path.endswith('common.gin'):
      assert gin.query_parameter('experiment.method') is not None
      assert gin.query_parameter('experiment.model')
      assert gin.query_parameter('federated_data.source') is not None
  finally:
    gin.clear_config()


def test_there_are_experiments():
  assert len(FILES) > 40


TFDS_FMNIST = [p for p in FILES if os.path.basename(p).startswith('fmnist_')
               and 'fmnist_idx' not in p and p.split(os.sep)[1] in ('fedlap', 'kapc')]


def _bindings(path):
  gin.clear_config()
  try:
    gin.parse_config_files_and_bindings([path], [], skip_unknown=False)
    return {line for line in gin.config_str().splitlines() if line.strip()}
  finally:
    gin.clear_config()


@pytest.mark.parametrize('path', TFDS_FMNIST)
def test_fmnist_paper_config_has_idx_twin(path, monkeypatch):
  """Every Fashion-MNIST paper config runs on the IDX files with nothing else changed."""
  monkeypatch.chdir(REPO)
  fltff.register_configurables()
  twin = path.replace(os.sep + 'fmnist_', os.sep + 'fmnist_idx_')
  assert twin in FILES
  original, twinned = _bindings(path), _bindings(twin)
  assert {l for l in original - twinned if 'source' not in l} == set()
  assert {l for l in twinned - original if 'source' not in l} == set()
  assert any('@idx_source' in l for l in twinned)


def test_kapc_paper_rounds_and_fraction(monkeypatch):
  """KAPC: K = 50 (MNIST/FMNIST), 100 (CIFAR-10), 200 (CIFAR-100); 10 % of the data at N = 10."""
  monkeypatch.chdir(REPO)
  fltff.register_configurables()
  expected = {'mnist': 50, 'fmnist': 50, 'cifar10': 100, 'cifar100': 200}
  checked = 0
  for path in FILES:
    name = os.path.basename(path)
    if not path.startswith(os.path.join('gin_configs', 'kapc')) or '_n1' not in name:
      continue
    dataset = name.split('_')[0]
    if dataset == 'fmnist' and name.startswith('fmnist_idx_'):
      dataset = 'fmnist'
    gin.clear_config()
    try:
      gin.parse_config_files_and_bindings([path], [], skip_unknown=False)
      assert gin.query_parameter('experiment.rounds') == expected[dataset], path
      fraction = (gin.query_parameter('federated_data.data_fraction')
                  if '_n10_' in name else None)
      if '_n10_' in name:
        assert fraction == 0.1, path
      else:
        with pytest.raises(ValueError):
          gin.query_parameter('federated_data.data_fraction')
    finally:
      gin.clear_config()
    checked += 1
  assert checked == 4 * 52 + 52


def test_the_kapc_grid_is_the_generated_one():
  """`gin_configs/kapc` is `pipelines.kapc_grid`'s output, byte for byte, plus its hand-written
  includes: change the spec and run `python -m pipelines.kapc_grid`, never one file by hand."""
  from pipelines import kapc_grid  # pylint: disable=g-import-not-at-top

  directory = os.path.join(REPO, 'gin_configs', 'kapc')
  rendered = kapc_grid.render()
  for name, text in rendered.items():
    with open(os.path.join(directory, name), encoding='utf-8', newline='') as f:
      assert f.read() == text, name
  assert {n for n in os.listdir(directory)
          if n not in rendered and n not in kapc_grid.HAND_WRITTEN} == set()
  assert all(os.path.exists(os.path.join(directory, n)) for n in kapc_grid.HAND_WRITTEN)
  assert kapc_grid.check(directory) == []


def test_the_kapc_grid_check_names_a_changed_file(tmp_path):
  """`--check` names a changed, a missing and a stale grid file (the offline twin on cnn2_bn
  is hand-written, not stale)."""
  from pipelines import kapc_grid  # pylint: disable=g-import-not-at-top

  for name, text in kapc_grid.render().items():
    (tmp_path / name).write_text(text, encoding='utf-8')
  assert kapc_grid.check(str(tmp_path)) == []
  changed = tmp_path / 'cifar10_n100_dir0.3_moon.gin'
  changed.write_text(changed.read_text(encoding='utf-8').replace('5.0', '1.0'), encoding='utf-8')
  (tmp_path / 'fmnist_idx_n10_dir0.1_kapc.gin').unlink()
  (tmp_path / 'mnist_n10_dir0.1_scaffold.gin').write_text('# not in the spec\n')
  (tmp_path / 'offline_mnist1003_fedbn_cnn2_bn.gin').write_text('# hand-written\n')
  assert kapc_grid.check(str(tmp_path)) == ['cifar10_n100_dir0.3_moon.gin (differs)',
                                            'fmnist_idx_n10_dir0.1_kapc.gin (missing)',
                                            'mnist_n10_dir0.1_scaffold.gin (not in the spec)']
