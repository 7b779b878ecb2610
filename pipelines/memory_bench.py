"""Memory per round of the driver and of its TFF worker: `fltff bench --memory`.

Each method runs in its own process (so the driver's resident memory is its own): fltff's
FedAvg, FedLayerWise and KAPC through the real pipeline (`run_experiment` on their offline
configs; also SCAFFOLD, a global method with client state), and TFF's built-in
`build_weighted_fed_avg` in a plain loop on the same data (10
clients of the MNIST sample, all taking part, mlp2). Resident memory (VmRSS) of the process
and of its current `worker_binary` is read after every round (a pipeline run's extra last
round, which also evaluates and checkpoints, is not sampled); the slope is the least-squares
fit from 10 % of the rounds on (the first rounds trace and load).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

from fltff import resources

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {
    'fedavg': 'gin_configs/foundation/mnist1003_shards_fedavg.gin',
    'fedlayerwise': 'gin_configs/fedlayerwise/offline_2iid_8noniid_fedlayerwise.gin',
    'kapc': 'gin_configs/kapc/offline_mnist1003_kapc.gin',
    # A global method with per-client state (its c_i in the client state store).
    'scaffold': 'gin_configs/ccn/offline_mnist1003_scaffold.gin',
}
METHODS = ('tff_fedavg',) + tuple(CONFIGS)
_MARK = 'MEMORY_SAMPLES '


def rss_mib(pid: int, field: str = 'VmRSS') -> float:
  """Resident memory of process `pid` in MiB (0 if it is gone). `field='RssAnon'`: its
  anonymous part only (heap, stacks, Python objects), without the pages of mapped files such as
  TensorFlow's shared library, which the kernel can drop and reload at will."""
  try:
    with open(f'/proc/{pid}/status') as f:
      for line in f:
        if line.startswith(field + ':'):
          return int(line.split()[1]) / 1024.0
  except OSError:
    pass
  return 0.0


def slope(samples: list[float]) -> float:
  """MiB per round: least-squares slope from 10 % of the rounds on."""
  start = max(1, len(samples) // 10)
  y = np.asarray(samples[start:], np.float64)
  if len(y) < 2:
    return float('nan')
  return float(np.polyfit(np.arange(len(y)), y, 1)[0])


def _probe_fltff(method: str, rounds: int, recycle_every: int, rt, sample) -> None:
  from fltff.simulation.experiment import configure  # pylint: disable=g-import-not-at-top
  from fltff.simulation import run_experiment  # pylint: disable=g-import-not-at-top

  # A run's last round also evaluates, checkpoints and skips the heap trim, once: it runs one
  # round more than it samples, so every sample is of a steady round.
  configure([resources.find_shipped(CONFIGS[method])],
            [f'experiment.rounds = {rounds + 1}', 'experiment.checkpoint_every = 1000000',
             f'experiment.eval_every = {rounds + 1}'])
  rt.recycle_every = recycle_every
  sampled = itertools.count()
  with tempfile.TemporaryDirectory() as out:
    run_experiment(output_dir=out, runtime=rt,
                   progress=lambda _: next(sampled) < rounds and sample())


def _probe_tff_fedavg(rounds: int, recycle_every: int, rt, sample) -> None:
  """TFF's own FedAvg on the fedavg config's data: 10 clients, all every round, mlp2."""
  import functools  # pylint: disable=g-import-not-at-top
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top
  from fltff.data import build_federated_data  # pylint: disable=g-import-not-at-top
  from fltff.data import npz_source  # pylint: disable=g-import-not-at-top
  from fltff.data import shard_partition  # pylint: disable=g-import-not-at-top
  from fltff.data.pipeline import ClientDatasets  # pylint: disable=g-import-not-at-top
  from fltff.simulation import build_model_spec  # pylint: disable=g-import-not-at-top

  data = build_federated_data(
      source=functools.partial(npz_source,
                               path=os.path.join(resources.PACKAGE_DIR, 'data', 'samples',
                                                 'mnist_first1003.npz')),
      partitioner=functools.partial(shard_partition, shards_per_client=2), num_clients=10,
      seed=0)
  spec = build_model_spec(data, 'mlp2', seed=0)
  process = tff.learning.algorithms.build_weighted_fed_avg(
      spec.tff_model, client_optimizer_fn=tff.learning.optimizers.build_sgdm(0.01, 0.9),
      server_optimizer_fn=tff.learning.optimizers.build_sgdm(1.0))
  datasets = ClientDatasets(data.client_arrays, batch_size=10)
  state = process.initialize()
  for r in range(1, rounds + 1):
    state = process.next(state, [datasets.batches(k, r * 1000 + k).dataset
                                 for k in range(10)]).state
    sample()
    if r < rounds:
      rt.after_round(r)


def probe(method: str, rounds: int, recycle_every: int, mmap_threshold_kib: int) -> dict:
  """Runs `method` for `rounds` rounds here; returns the per-round samples (MiB)."""
  from fltff.runtime import LocalWorkerRuntime  # pylint: disable=g-import-not-at-top

  rt = LocalWorkerRuntime(recycle_every=recycle_every, mmap_threshold_kib=mmap_threshold_kib)
  driver, worker, driver_anon, worker_anon = [], [], [], []

  def sample():
    driver.append(rss_mib(os.getpid()))
    worker.append(sum(rss_mib(p) for p in rt.worker_pids))
    driver_anon.append(rss_mib(os.getpid(), 'RssAnon'))
    worker_anon.append(sum(rss_mib(p, 'RssAnon') for p in rt.worker_pids))

  try:
    if method == 'tff_fedavg':
      _probe_tff_fedavg(rounds, recycle_every, rt, sample)
    else:
      _probe_fltff(method, rounds, recycle_every, rt, sample)
  finally:
    rt.close()
  return {'driver': driver, 'worker': worker, 'driver_anon': driver_anon,
          'worker_anon': worker_anon}


def compare(methods, rounds: int, recycle_every: int, mmap_threshold_kib: int) -> int:
  """Each method in its own `pipelines.bench --memory_probe` process; prints the table."""
  unknown = [m for m in methods if m not in METHODS]
  if unknown:
    print(f'error: unknown method(s) {unknown} for --memory; choose from {list(METHODS)}',
          file=sys.stderr)
    return 2
  results = {}
  for method in methods:
    cmd = [sys.executable, '-m', f'{__package__}.bench', f'--memory_probe={method}',
           f'--memory_rounds={rounds}', f'--recycle_every={recycle_every}',
           f'--mmap_threshold_kib={mmap_threshold_kib}']
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    lines = [l for l in proc.stdout.splitlines() if l.startswith(_MARK)]
    if proc.returncode or not lines:
      print(f'error: the memory probe of {method} failed (exit {proc.returncode}): '
            f'{proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""}',
            file=sys.stderr)
      return 1
    results[method] = json.loads(lines[-1][len(_MARK):])
    r = results[method]
    d, w = r['driver'], r['worker']
    print(f'{method}: driver {d[0]:.0f} -> {d[-1]:.0f} MiB ({slope(d):+.3f} MiB/round, '
          f'anonymous {slope(r["driver_anon"]):+.3f}), worker {w[0]:.0f} -> {w[-1]:.0f} MiB '
          f'({slope(w):+.3f} MiB/round, anonymous {slope(r["worker_anon"]):+.3f})', flush=True)
  print(f'\nResident memory per round over {rounds} rounds (least-squares slope from round '
        f'{max(1, rounds // 10) + 1} on), local TFF runtime'
        f'{f", worker recycled every {recycle_every} rounds" if recycle_every else ""}, '
        + (f'mmap threshold {mmap_threshold_kib} KiB + heap trim' if mmap_threshold_kib
           else "glibc's default malloc") + ':')
  print('| run | driver MiB (first -> last) | driver MiB/round | of it anonymous | '
        'worker MiB (first -> last) | worker MiB/round | of it anonymous |')
  print('|---|---|---|---|---|---|---|')
  for method, r in results.items():
    d, w = r['driver'], r['worker']
    print(f'| {method} | {d[0]:.0f} -> {d[-1]:.0f} | {slope(d):+.3f} | '
          f'{slope(r["driver_anon"]):+.3f} | {w[0]:.0f} -> {w[-1]:.0f} | {slope(w):+.3f} | '
          f'{slope(r["worker_anon"]):+.3f} |')
  return 0


def run_probe(method: str, rounds: int, recycle_every: int, mmap_threshold_kib: int) -> int:
  print(_MARK + json.dumps(probe(method, rounds, recycle_every, mmap_threshold_kib)), flush=True)
  return 0
