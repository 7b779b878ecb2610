"""The KAPC paper's grid of configs, generated from one small spec.

    python -m pipelines.kapc_grid            # says which files differ from the spec
    python -m pipelines.kapc_grid --write    # rewrites gin_configs/kapc/<setting>_<method>.gin

The KAPC paper's Tables 1–2 cross five datasets, 10 or 100 clients and Dirichlet α ∈ {0.1, 0.3}
with ten methods (and KAPC+BLS at four μ); every cell is one config, and the configs differ only
in the lines this module writes. `tests/test_gin_configs.py` checks that the files equal
`grid()`, so the spec stays the one place to change them; the shared settings live in
`gin_configs/kapc/common.gin` and `kapc_dir<α>_common.gin`.
"""

from __future__ import annotations

import os
import sys

# dataset → (base data config, model, rounds). Rounds and models: KAPC §7.1.
DATASETS = {
    'mnist': ('mnist_tfds', 'cnn2', 50),
    'fmnist': ('fmnist_tfds', 'cnn2', 50),
    'cifar10': ('cifar10_tfds', 'resnet18', 100),
    'cifar100': ('cifar100_tfds', 'resnet18', 200),
}
CLIENTS = (10, 100)  # 10: every client each round, on 10 % of the data; 100: 10 % per round.
ALPHAS = (0.1, 0.3)
BLS_MUS = (0.3, 0.5, 0.7, 0.9)
METHODS = ('fedavg', 'fedprox', 'fedamp', 'moon', 'fedbabu', 'fedbn', 'pfedla',
           'local_training', 'kapc', *(f'kapc_bls{mu}' for mu in BLS_MUS))

# How each method is tested (KAPC §7.1–7.2), with why; methods not named use common.gin's.
_EVALUATION = {
    'fedavg': (
        "# KAPC §7.1: the FedAvg baseline is the global model tested on each client's local data, each\n"
        "# client's best accuracy averaged; the other protocols are reported beside it.\n"
        "experiment.evaluation = ['global_local', 'trained_local', 'central']\n"
        "experiment.headline_statistic = 'mean_client_best'\n"),
    'personalised_reading': (
        "# KAPC §7.2 counts this method among the personalised ones: our reading is each client's model\n"
        "# after its local training in the round (trained_local); the global model is reported beside it.\n"
        "experiment.evaluation = ['trained_local', 'global_local', 'central']\n"),
    'fedbabu': (
        "# FedBABU is tested after fine-tuning the global model on each client's data (Oh et al.); the\n"
        "# fine-tuning's epochs (experiment.finetune_epochs, 5 = the setting's E) are ours: KAPC does not say.\n"
        "experiment.evaluation = ['finetuned_local', 'trained_local', 'global_local', 'central']\n"),
    'local_training': (
        "# KAPC §7.1: local training's baseline averages each client's best local test accuracy.\n"
        "experiment.headline_statistic = 'mean_client_best'\n"),
}
_EVALUATION['fedprox'] = _EVALUATION['moon'] = _EVALUATION['personalised_reading']
_FEDBN_MODEL = (
    "# cnn2_bn, not cnn2: FedBN keeps the BatchNorm layers local and cnn2 has none; the\n"
    "# other methods run on cnn2. cnn2_bn's BN placement is ours (fltff/models/zoo.py).\n")
_MOON_CIFAR10 = "moon.mu = 5.0  # MOON paper's μ for CIFAR-10 (1 for CIFAR-100, our default elsewhere)\n"


def setting_name(dataset: str, clients: int, alpha: float) -> str:
  return f'{dataset}_n{clients}_dir{alpha}'


def config(dataset: str, clients: int, alpha: float, method: str) -> str:
  """The text of one cell's config."""
  base, model, rounds = DATASETS[dataset]
  if method == 'fedbn' and model == 'cnn2':
    model = 'cnn2_bn'
  gin_method = 'kapc' if method.startswith('kapc') else method
  text = (f'# KAPC paper: {dataset}, {clients} clients ({1.0 if clients == 10 else 0.1} per round), '
          f'Dirichlet({alpha}), {model}; {method}.\n')
  if model == 'cnn2_bn':
    text += _FEDBN_MODEL
  text += "include 'gin_configs/kapc/common.gin'\n"
  text += f"include 'gin_configs/base/{base}.gin'\n"
  text += f'federated_data.num_clients = {clients}\n'
  if clients == 10:
    text += 'federated_data.data_fraction = 0.1\n'
  text += f'experiment.client_fraction = {1.0 if clients == 10 else 0.1}\n'
  text += f'dirichlet_partition.alpha = {alpha}\n'
  text += f"experiment.model = '{model}'\n"
  text += f'experiment.rounds = {rounds}\n'
  text += f'experiment.method = @{gin_method}\n'
  if method.startswith('kapc_bls'):
    text += f"kapc.bls_mu = {method[len('kapc_bls'):]}\n"
  if method == 'moon' and dataset == 'cifar10':
    text += _MOON_CIFAR10
  text += _EVALUATION.get(method, '')
  if gin_method == 'kapc':
    text += f"include 'gin_configs/kapc/kapc_dir{alpha}_common.gin'\n"
  return text


def idx_config(clients: int, alpha: float, method: str) -> str:
  """A Fashion-MNIST cell read from the local IDX files instead of TFDS."""
  tfds = f'{setting_name("fmnist", clients, alpha)}_{method}.gin'
  return (f'# fmnist_idx_n{clients}_dir{alpha}_{method}.gin: kapc/{tfds} on the Fashion-MNIST IDX '
          f'files (no other change).\n'
          f"include 'gin_configs/kapc/{tfds}'\n"
          "include 'gin_configs/base/fmnist_idx.gin'\n")


def grid() -> dict[str, str]:
  """`{file name in gin_configs/kapc: its text}` for every cell."""
  files = {}
  for clients in CLIENTS:
    for alpha in ALPHAS:
      for method in METHODS:
        for dataset in DATASETS:
          files[f'{setting_name(dataset, clients, alpha)}_{method}.gin'] = config(
              dataset, clients, alpha, method)
        files[f'fmnist_idx_n{clients}_dir{alpha}_{method}.gin'] = idx_config(clients, alpha, method)
  return files


def differences(directory: str) -> list[str]:
  """Files of `grid()` missing from `directory` or with other text there."""
  out = []
  for name, text in grid().items():
    path = os.path.join(directory, name)
    if not os.path.exists(path):
      out.append(f'{name}: missing')
      continue
    with open(path, encoding='utf-8') as f:
      if f.read() != text:
        out.append(f'{name}: differs')
  return out


def main(argv) -> int:
  from fltff import resources  # pylint: disable=g-import-not-at-top

  directory = resources.find_shipped(os.path.join('gin_configs', 'kapc'))
  if '--write' in argv[1:]:
    for name, text in grid().items():
      with open(os.path.join(directory, name), 'w', encoding='utf-8') as f:
        f.write(text)
    print(f'wrote {len(grid())} configs to {directory}')
    return 0
  diff = differences(directory)
  print('\n'.join(diff) if diff else f'all {len(grid())} configs equal the spec')
  return 1 if diff else 0


if __name__ == '__main__':
  sys.exit(main(sys.argv))
