r"""A FedAvg round written in PyTorch, as a reference for `pipelines.bench --executors`.

  python -m pipelines.torch_reference [--shapes=mlp2:10x600,cnn2:10x600] [--device=cpu]

Optional: it needs `torch`, which fltff never depends on; `pipelines.bench --executors` adds
its columns only where `torch` imports. It runs alone too (it imports numpy, torch and absl
only), so it can time a machine where fltff itself cannot run.

The round is the one the bench times for fltff: every client starts from the global model,
trains `--epochs` epochs of SGD (learning rate 0.01, momentum 0.9) over its examples in
batches of `--batch_size`, reshuffled each round, and the server takes the example-weighted
mean. Two ways of writing the client loop, both common in PyTorch FL code:

* `torch_loop`: clients in turn on one model, each client's examples held as tensors on the
  device and sliced into batches (the fastest plain loop);
* `torch_pfllib`: the PFLlib / FL-bench shape: a `DataLoader` per client and a `deepcopy` of
  the global model per client.

The models are the zoo's architectures (`fltff.models.zoo`): mlp2 (784-200-10), cnn2 (KAPC's
CNN, 'same' 5x5 convolutions) and resnet18 (the CIFAR ResNet-18, 32x32x3 inputs, BatchNorm in
training mode). Data are random, seeded. Times are the median over rounds 2 to `--rounds` (the
first warms up), with the device synchronised around each round.
"""

import copy
import statistics
import sys
import time

import numpy as np
from absl import flags

STYLES = ('torch_loop', 'torch_pfllib')
MODELS = ('mlp2', 'cnn2', 'resnet18')  # The zoo models written here as PyTorch modules.
LEARNING_RATE = 0.01
MOMENTUM = 0.9

def input_shape(model: str) -> tuple[int, int, int]:
  """(C, H, W) of the bench's inputs for `model`."""
  return (3, 32, 32) if model == 'resnet18' else (1, 28, 28)


def build_model(name: str, num_classes: int = 10):
  """The zoo model `name` as a `torch.nn.Module` (same layers and parameter counts)."""
  from torch import nn  # pylint: disable=g-import-not-at-top

  if name == 'mlp2':
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 200), nn.ReLU(), nn.Linear(200, num_classes))
  if name == 'cnn2':
    return nn.Sequential(
        nn.Conv2d(1, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(7 * 7 * 64, 512), nn.ReLU(), nn.Linear(512, 128), nn.ReLU(),
        nn.Linear(128, num_classes))
  if name == 'resnet18':
    return _resnet18(num_classes)
  raise ValueError(f'unknown model {name!r}: choose from {", ".join(MODELS)}')


def _resnet18(num_classes):
  from torch import nn  # pylint: disable=g-import-not-at-top

  class Block(nn.Module):

    def __init__(self, cin, cout, stride):
      super().__init__()
      self.body = nn.Sequential(
          nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
          nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
      self.shortcut = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                     nn.BatchNorm2d(cout))
                       if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x):
      return nn.functional.relu(self.body(x) + self.shortcut(x))

  layers = [nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU()]
  cin = 64
  for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
    layers += [Block(cin, cout, stride), Block(cout, cout, 1)]
    cin = cout
  layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, num_classes)]
  return nn.Sequential(*layers)


def parameter_count(model) -> int:
  return sum(p.numel() for p in model.parameters())


def client_data(model: str, clients: int, examples: int, seed: int = 0):
  """Per client `(x, y)`: float32 images in [0, 1] of `input_shape(model)`, int64 labels."""
  rng = np.random.default_rng(seed)
  return [(rng.integers(0, 256, size=(examples, *input_shape(model))).astype(np.float32) / 255,
           rng.integers(0, 10, size=examples).astype(np.int64)) for _ in range(clients)]


def _sync(device):
  import torch  # pylint: disable=g-import-not-at-top

  if device.type == 'cuda':
    torch.cuda.synchronize(device)


class FedAvgRound:
  """One FedAvg round of `style` on `data`, the global model kept between rounds."""

  def __init__(self, model: str, data, style: str, device: str, batch: int, epochs: int):
    import torch  # pylint: disable=g-import-not-at-top

    if style not in STYLES:
      raise ValueError(f'unknown style {style!r}: choose from {STYLES}')
    self.device = torch.device(device)
    torch.manual_seed(0)
    self.global_model = build_model(model).to(self.device)
    self.style, self.batch, self.epochs = style, batch, epochs
    self.sizes = [len(y) for _, y in data]
    if style == 'torch_loop':
      self.data = [(torch.from_numpy(x).to(self.device), torch.from_numpy(y).to(self.device))
                   for x, y in data]
      self.work = build_model(model).to(self.device)
    else:
      self.data = [torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
                   for x, y in data]

  @staticmethod
  def _train(model, optimizer, batches):
    import torch  # pylint: disable=g-import-not-at-top

    model.train()
    for x, y in batches:
      optimizer.zero_grad(set_to_none=True)
      torch.nn.functional.cross_entropy(model(x), y).backward()
      optimizer.step()

  def __call__(self, round_num: int) -> float:
    """Runs round `round_num`; its wall time in seconds."""
    import torch  # pylint: disable=g-import-not-at-top

    _sync(self.device)
    start = time.perf_counter()
    total = float(sum(self.sizes))
    global_state = self.global_model.state_dict()
    mean = {k: torch.zeros_like(v, dtype=torch.float32) for k, v in global_state.items()}
    for k, (data, n) in enumerate(zip(self.data, self.sizes)):
      generator = torch.Generator().manual_seed(round_num * 1000 + k)
      if self.style == 'torch_loop':
        model = self.work
        model.load_state_dict(global_state)
      else:
        model = copy.deepcopy(self.global_model)
      # A fresh optimizer per client and round: momentum starts at zero, as in fltff.
      optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE, momentum=MOMENTUM)
      for _ in range(self.epochs):
        if self.style == 'torch_loop':
          x, y = data
          order = torch.randperm(n, generator=generator).to(self.device)
          batches = ((x[order[i:i + self.batch]], y[order[i:i + self.batch]])
                     for i in range(0, n, self.batch))
        else:
          loader = torch.utils.data.DataLoader(data, batch_size=self.batch, shuffle=True,
                                               generator=generator)
          batches = ((x.to(self.device), y.to(self.device)) for x, y in loader)
        self._train(model, optimizer, batches)
      with torch.no_grad():
        for name, value in model.state_dict().items():
          mean[name] += (n / total) * value.float()
    with torch.no_grad():
      self.global_model.load_state_dict(
          {k: v.to(global_state[k].dtype) for k, v in mean.items()})
    _sync(self.device)
    return time.perf_counter() - start


def median_round_seconds(model: str, clients: int, examples: int, rounds: int, device: str,
                         batch: int, epochs: int) -> dict:
  """{style: median round seconds over rounds 2..`rounds`}, the styles alternating per round."""
  data = client_data(model, clients, examples)
  runners = {s: FedAvgRound(model, data, s, device, batch, epochs) for s in STYLES}
  times = {s: [] for s in STYLES}
  for r in range(rounds):
    for s in (STYLES if r % 2 == 0 else STYLES[::-1]):
      times[s].append(runners[s](r))
  return {s: statistics.median(v[1:]) for s, v in times.items()}


def _define_flags() -> dict:
  # Defined only when this module is the program: `pipelines.bench` imports it beside flags
  # of the same names.
  return dict(
      shapes=flags.DEFINE_list('shapes', ['mlp2:10x600', 'cnn2:10x600'],
                               'model:CLIENTSxEXAMPLES entries (models: mlp2, cnn2, resnet18).'),
      device=flags.DEFINE_string('device', 'cpu', "torch device: 'cpu' or 'cuda'."),
      rounds=flags.DEFINE_integer('rounds', 6, 'Rounds per style (the first is excluded).'),
      batch=flags.DEFINE_integer('batch_size', 10, 'Local batch size.'),
      epochs=flags.DEFINE_integer('epochs', 1, 'Local epochs.'),
      threads=flags.DEFINE_integer('threads', 0, "torch CPU threads (0: torch's default)."))


def main(argv, options: dict) -> int:
  del argv
  shapes, device, rounds, batch, epochs, threads = (
      options[k].value for k in ('shapes', 'device', 'rounds', 'batch', 'epochs', 'threads'))
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError:
    print('error: torch is not importable here; this reference needs it.', file=sys.stderr)
    return 2
  if threads:
    torch.set_num_threads(threads)
  if rounds < 2:
    print('error: --rounds must be at least 2 (the first round is excluded).', file=sys.stderr)
    return 2
  if device.startswith('cuda') and not torch.cuda.is_available():
    print(f'error: --device={device}, but torch {torch.__version__} sees no CUDA device.',
          file=sys.stderr)
    return 2
  name = torch.cuda.get_device_name(device) if device.startswith('cuda') else (
      f'CPU, {torch.get_num_threads()} threads')
  print(f'torch {torch.__version__} on {name}; FedAvg round, batch {batch}, '
        f'{epochs} epoch(s), SGD {LEARNING_RATE} momentum {MOMENTUM}; median of rounds '
        f'2-{rounds}:')
  print(f'  {"shape":18s}{"parameters":>12s}' + ''.join(f'{s:>16s}' for s in STYLES))
  for text in shapes:
    try:
      model, dims = text.split(':')
      clients, examples = (int(v) for v in dims.lower().split('x'))
      build_model(model)
    except ValueError as e:
      print(f'error: --shapes entry {text!r}: {e}', file=sys.stderr)
      return 2
    med = median_round_seconds(model, clients, examples, rounds, device, batch, epochs)
    print(f'  {text:18s}{parameter_count(build_model(model)):>12,d}'
          + ''.join(f'{med[s]:>14.3f} s' for s in STYLES), flush=True)
  return 0


if __name__ == '__main__':
  _flags = _define_flags()
  from fltff.cli import run_program  # pylint: disable=g-import-not-at-top
  run_program(lambda argv: main(argv, _flags))
