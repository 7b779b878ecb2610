r"""The KAPC paper's grid of settings (§7 of the KAPC paper, Tables 1 and 2) as gin configs.

  python -m pipelines.kapc_grid            # writes the files whose text changed
  python -m pipelines.kapc_grid --check    # writes nothing; exit 1 when a file differs

Tables 1–2 cross four datasets (MNIST, Fashion-MNIST, CIFAR-10, CIFAR-100), 10 clients (all
of them each round, on 10 % of the data) or 100 (10 % each round) and Dirichlet α ∈ {0.1, 0.3}
with nine methods and KAPC+BLS at four μ: one config per cell,
`gin_configs/kapc/<dataset>_n<N>_dir<α>_<method>.gin`. Beside them: a twin of every
Fashion-MNIST cell that reads the local IDX files (`fmnist_idx_...`), and one offline twin per
method on the bundled MNIST sample (`offline_mnist1003_<method>.gin`). The cells differ only in
the few lines of the spec below (DATASETS, CLIENTS, ALPHAS, METHODS); what they share lives in
the hand-written includes (HAND_WRITTEN). To change a cell, change the spec and rerun this
module; `tests/test_gin_configs.py` checks that the files on disk are what `render()` returns.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from typing import Optional

from absl import flags

# Where the configs are, in a checkout and installed (`fltff/pipelines`, `fltff/gin_configs`).
_KAPC_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         'gin_configs', 'kapc')

_CHECK = flags.DEFINE_bool('check', False, 'Write nothing; exit 1 naming the files that '
                           'differ from the spec.')
_DIRECTORY = flags.DEFINE_string('directory', _KAPC_DIR, 'The folder of the KAPC configs.')


@dataclasses.dataclass(frozen=True)
class Dataset:
  """One dataset of the grid: its data config, model and rounds K (KAPC §7.1)."""
  title: str                # Its name in comments.
  base: str                 # gin_configs/base/<base>.gin reads it.
  model: str
  rounds: int
  # Lines of its own for some methods, after `experiment.method` (method → lines).
  method_lines: dict[str, str] = dataclasses.field(default_factory=dict)
  # gin_configs/base/<idx_base>.gin: every cell has a twin on the local IDX files.
  idx_base: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class Clients:
  """A client setting: N, the share of the data drawn before partitioning, participation."""
  num_clients: int
  data_fraction: Optional[float]  # None: all of it.
  client_fraction: float


@dataclasses.dataclass(frozen=True)
class Method:
  """One method column: its gin configurable and its lines, in file order."""
  gin: str                  # experiment.method = @<gin>
  settings: str = ''        # Right after experiment.method.
  evaluation: str = ''      # After the dataset's lines for the method: how it is tested.
  # Models it replaces (model → replacement), with the comment saying why (under the title).
  models: dict[str, str] = dataclasses.field(default_factory=dict)
  model_comment: str = ''
  # Includes kapc_dir<α>_common.gin (R's settings, λ, β; α = 0.1 for the offline twins).
  kapc_common: bool = False
  title: Optional[str] = None  # The offline twin's title; None: the method's file name.


_MOON_MU_CIFAR10 = """\
moon.mu = 5.0  # MOON paper's μ for CIFAR-10 (1 for CIFAR-100, our default elsewhere)
"""

DATASETS = {
    'mnist': Dataset('MNIST', 'mnist_tfds', 'cnn2', 50),
    'fmnist': Dataset('Fashion-MNIST', 'fmnist_tfds', 'cnn2', 50, idx_base='fmnist_idx'),
    'cifar10': Dataset('CIFAR-10', 'cifar10_tfds', 'resnet18', 100,
                       method_lines={'moon': _MOON_MU_CIFAR10}),
    'cifar100': Dataset('CIFAR-100', 'cifar100_tfds', 'resnet18', 200),
}

CLIENTS = {
    10: Clients(num_clients=10, data_fraction=0.1, client_fraction=1.0),
    100: Clients(num_clients=100, data_fraction=None, client_fraction=0.1),
}

ALPHAS = (0.1, 0.3)

BLS_MUS = (0.3, 0.5, 0.7, 0.9)

# How each method is tested (KAPC §7.1–7.2); methods without one use common.gin's protocols.
_GLOBAL_MODEL_CLIENT_BEST = """\
# KAPC §7.1: the FedAvg baseline is the global model tested on each client's local data, each
# client's best accuracy averaged; the other protocols are reported beside it.
experiment.evaluation = ['global_local', 'trained_local', 'central']
experiment.headline_statistic = 'mean_client_best'
"""
_PERSONALISED_READING = """\
# KAPC §7.2 counts this method among the personalised ones: our reading is each client's model
# after its local training in the round (trained_local); the global model is reported beside it.
experiment.evaluation = ['trained_local', 'global_local', 'central']
"""
_FINETUNED = """\
# FedBABU is tested after fine-tuning the global model on each client's data (Oh et al.); the
# fine-tuning's epochs (experiment.finetune_epochs, 5 = the setting's E) are ours: KAPC does not say.
experiment.evaluation = ['finetuned_local', 'trained_local', 'global_local', 'central']
"""
_LOCAL_CLIENT_BEST = """\
# KAPC §7.1: local training's baseline averages each client's best local test accuracy.
experiment.headline_statistic = 'mean_client_best'
"""

_FEDBN_MODEL = """\
# cnn2_bn, not cnn2: FedBN keeps the BatchNorm layers local and cnn2 has none; the
# other methods run on cnn2. cnn2_bn's BN placement is ours (fltff/models/zoo.py).
"""

METHODS = {
    'fedamp': Method('fedamp'),
    'fedavg': Method('fedavg', evaluation=_GLOBAL_MODEL_CLIENT_BEST),
    'fedbabu': Method('fedbabu', evaluation=_FINETUNED),
    'fedbn': Method('fedbn', models={'cnn2': 'cnn2_bn'}, model_comment=_FEDBN_MODEL),
    'fedprox': Method('fedprox', evaluation=_PERSONALISED_READING),
    'kapc': Method('kapc', kapc_common=True),
    **{f'kapc_bls{mu}': Method('kapc', settings=f'kapc.bls_mu = {mu}\n', kapc_common=True,
                               title=f'KAPC+BLS with mu = {mu}') for mu in BLS_MUS},
    'local_training': Method('local_training', evaluation=_LOCAL_CLIENT_BEST),
    'moon': Method('moon', evaluation=_PERSONALISED_READING),
    'pfedla': Method('pfedla'),
}

# The offline twins: every method on offline_common.gin's setting (mlp2, which no method
# replaces; α = 0.1, whose λ and β the KAPC twins include).
OFFLINE_PREFIX = 'offline_mnist1003'
OFFLINE_COMMON = 'gin_configs/kapc/offline_common.gin'

# Files of gin_configs/kapc that are not generated: the shared includes, and the FedBN offline
# twin on cnn2_bn (a one-off beside offline_mnist1003_fedbn.gin, with its own comment).
HAND_WRITTEN = ('common.gin', 'offline_common.gin', 'kapc_common.gin',
                'kapc_dir0.1_common.gin', 'kapc_dir0.3_common.gin',
                'offline_mnist1003_fedbn_cnn2_bn.gin')

# Names of the kind render() produces: a file of this form that it does not produce is stale.
_GRID_NAME = re.compile(r'([a-z0-9_]+_n\d+_dir[\d.]+|' + OFFLINE_PREFIX + r')_[a-z0-9_.]+\.gin')


def _method_lines(method: Method, dataset_lines: str = '') -> str:
  return (f'experiment.method = @{method.gin}\n' + method.settings + dataset_lines +
          method.evaluation)


def cell(dataset: str, clients: int, alpha: float, method: str,
         base: Optional[str] = None) -> str:
  """The text of one cell's config; `base`: the data config it reads (default: the dataset's)."""
  data, setting, spec = DATASETS[dataset], CLIENTS[clients], METHODS[method]
  model = spec.models.get(data.model, data.model)
  text = (f'# KAPC paper: {dataset}, {setting.num_clients} clients ({setting.client_fraction} '
          f'per round), Dirichlet({alpha}), {model}; {method}.\n')
  if model != data.model:
    text += spec.model_comment
  text += ("include 'gin_configs/kapc/common.gin'\n"
           f"include 'gin_configs/base/{base or data.base}.gin'\n"
           f'federated_data.num_clients = {setting.num_clients}\n')
  if setting.data_fraction is not None:
    text += f'federated_data.data_fraction = {setting.data_fraction}\n'
  text += (f'experiment.client_fraction = {setting.client_fraction}\n'
           f'dirichlet_partition.alpha = {alpha}\n'
           f"experiment.model = '{model}'\n"
           f'experiment.rounds = {data.rounds}\n')
  text += _method_lines(spec, data.method_lines.get(method, ''))
  if spec.kapc_common:
    text += f"include 'gin_configs/kapc/kapc_dir{alpha}_common.gin'\n"
  return text


def offline_twin(method: str) -> str:
  """A method on offline_common.gin's small setting."""
  spec = METHODS[method]
  return (f'# Offline KAPC twin: {spec.title or method}.\n'
          f"include '{OFFLINE_COMMON}'\n" + _method_lines(spec) +
          ("include 'gin_configs/kapc/kapc_dir0.1_common.gin'\n" if spec.kapc_common else ''))


def render() -> dict[str, str]:
  """`{file name in gin_configs/kapc: its text}` for every generated config."""
  files = {}
  for dataset, data in DATASETS.items():
    for clients in CLIENTS:
      for alpha in ALPHAS:
        for method in METHODS:
          suffix = f'n{clients}_dir{alpha}_{method}.gin'
          name = f'{dataset}_{suffix}'
          files[name] = cell(dataset, clients, alpha, method)
          if data.idx_base:  # The cell on the local IDX files, nothing else changed (and no
            # binding of the TFDS source it does not read).
            files[f'{dataset}_idx_{suffix}'] = (
                f'# kapc/{name} on the {data.title} IDX files (no other change).\n' +
                cell(dataset, clients, alpha, method, data.idx_base))
  for method in METHODS:
    files[f'{OFFLINE_PREFIX}_{method}.gin'] = offline_twin(method)
  return files


def check(directory: str) -> list[str]:
  """'<file> (<why>)' for each file of `directory` that is not the spec's: rendered files
  that are missing or differ, and grid-named files that the spec does not produce."""
  rendered = render()
  problems = []
  for name, text in sorted(rendered.items()):
    path = os.path.join(directory, name)
    if not os.path.exists(path):
      problems.append(f'{name} (missing)')
      continue
    with open(path, encoding='utf-8', newline='') as f:
      if f.read() != text:
        problems.append(f'{name} (differs)')
  for name in sorted(os.listdir(directory)):
    if _GRID_NAME.fullmatch(name) and name not in rendered and name not in HAND_WRITTEN:
      problems.append(f'{name} (not in the spec)')
  return problems


def write(directory: str) -> int:
  """Writes the rendered files whose text differs from the file's; the number written."""
  written = 0
  for name, text in render().items():
    path = os.path.join(directory, name)
    if os.path.exists(path):
      with open(path, encoding='utf-8', newline='') as f:
        if f.read() == text:
          continue
    with open(path, 'w', encoding='utf-8', newline='') as f:
      f.write(text)
    written += 1
  return written


def main(argv: list[str]) -> int:
  del argv
  directory = _DIRECTORY.value
  if _CHECK.value:
    problems = check(directory)
    if problems:
      print(f'error: {len(problems)} file(s) in {directory} are not what '
            f'`python -m pipelines.kapc_grid` writes: {", ".join(problems)}', file=sys.stderr)
      return 1
    print(f'all {len(render())} generated configs in {directory} equal the spec')
    return 0
  print(f'wrote {write(directory)} of {len(render())} configs to {directory}')
  return 0


if __name__ == '__main__':
  from fltff.cli import run_program  # pylint: disable=g-import-not-at-top
  run_program(main)
