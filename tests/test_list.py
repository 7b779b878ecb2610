"""`fltff list`: the methods with their papers, the models, the data sources and the shipped gin
configs, read from the registry, the zoo, `fltff.data` and the configs themselves."""

import importlib
import os

import pytest

from fltff import methods
from fltff.models import zoo
from helpers import REPO

listing = importlib.import_module('pipelines.list')


def _shipped_configs() -> list[str]:
  return sorted(os.path.relpath(os.path.join(d, n), REPO)
                for d, _, names in os.walk(os.path.join(REPO, 'gin_configs'))
                for n in names if n.endswith('.gin'))


def test_methods_are_listed_with_their_citations():
  lines = listing.methods_section()
  assert lines[:3] == [
      'methods (experiment.method = @<name>):',
      '  fedavg          H. B. McMahan, E. Moore, D. Ramage, S. Hampson, B. Agüera y Arcas. '
      'Communication-Efficient Learning of Deep Networks from Decentralized Data. AISTATS 2017.',
      '  fedprox         T. Li, A. K. Sahu, M. Zaheer, M. Sanjabi, A. Talwalkar, V. Smith. '
      'Federated Optimization in Heterogeneous Networks. MLSys 2020.']
  assert [l.split()[0] for l in lines[1:len(methods.METHODS) + 1]] == [
      m.gin_name for m in methods.METHODS.values()]
  assert '  local_training  no paper: every client trains on its own data' in lines
  assert lines[len(methods.METHODS) + 1] == 'compositions:'
  assert (f'  <method>.model_aggregator = @contribution_normalization()  CCN: '
          f'{methods.CCN_CITATION}') in lines


@pytest.mark.parametrize('section,expected', [
    ('models', ['  cnn2_bn             `cnn2` with BatchNorm, for FedBN on the KAPC paper\'s '
                'MNIST/FMNIST setting',
                '  resnet18            CIFAR ResNet-18 (He et al., 2016; the common CIFAR '
                'variant)']),
    ('sources', ['  image_folder_source  Images (`.png`, `.jpg`; one size, read as RGB) from '
                 '`<path>/<split>/<class>/`',
                 '  synthetic_source     Synthetic(alpha, beta) of FedProx (Li et al., MLSys '
                 '2020, Sec. 5.1) / LEAF',
                 'shipped data (npz_source.path):',
                 '  fltff/data/samples/mnist_first1003.npz']),
])
def test_models_and_sources_are_listed_with_their_first_sentence(section, expected):
  lines = getattr(listing, f'{section}_section')()
  assert [l for l in lines if l in expected] == expected
  if section == 'models':
    assert [l.split()[0] for l in lines[1:]] == list(zoo.model_names())


def test_every_shipped_config_is_listed_once():
  every = listing.configs_section(every=True)
  assert sorted(l.split()[0] for l in every[1:]) == _shipped_configs()
  assert ('  gin_configs/quickstart.gin' in every[1] and every[1].endswith(
      '  The default experiment: FedAvg training logistic regression on Synthetic(1, 1), '
      'offline.'))
  # Without `configs` alone: the top-level configs, then one line per folder.
  folders = listing.configs_section(every=False)
  kapc = len([p for p in _shipped_configs() if p.startswith('gin_configs/kapc/')])
  assert f'  gin_configs/kapc/           {kapc} configs (fltff list configs names them)' in folders


@pytest.mark.parametrize('argv,code,out,err', [
    (['list', 'bogus'], 2, '', "error: no section 'bogus'; fltff list "
                               '[methods|models|sources|configs].\n'),
    (['list', 'models'], 0, "models (experiment.model = '<name>'; your own: "
                            'fltff.models.register):\n', ''),
])
def test_main_prints_the_sections_asked_for(argv, code, out, err, capsys):
  assert listing.main(argv) == code
  printed = capsys.readouterr()
  assert printed.out.startswith(out) and printed.err == err
