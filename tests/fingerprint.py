"""Records and compares every method's numbers, for refactorings that must not move them.

    python tests/fingerprint.py record DIR            # 3 rounds per method, C++ runtime and vectorised
    python tests/fingerprint.py compare BEFORE AFTER  # one line per method and executor

Each method of the executor-equality suites (`helpers.equality_methods`) runs `helpers.run_rounds`
(4 clients of unequal sizes, 1 or 2 epochs, reshuffled batches) on TFF's C++ runtime and with
vectorised clients; every round's metrics, client states and measurements and the final server
state are saved, leaf by leaf, to `DIR/<method>.<executor>.npz`. `compare` says for each file
whether the two records are bit-identical, and otherwise the largest difference relative to the
largest magnitude of its tensor (`helpers.assert_close_leaf`'s measure).
"""

import os
import sys

import numpy as np

# This checkout's fltff, not an installed one, and its tests' helpers.
sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                os.path.dirname(os.path.abspath(__file__))]
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')


def record(out_dir: str, names=None) -> None:
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

  import helpers  # pylint: disable=g-import-not-at-top
  from fltff.runtime import LocalWorkerRuntime  # pylint: disable=g-import-not-at-top
  from fltff.runtime.in_process import InProcessContext  # pylint: disable=g-import-not-at-top
  from fltff.simulation import build_model_spec  # pylint: disable=g-import-not-at-top

  os.makedirs(out_dir, exist_ok=True)
  data = helpers.mnist_sample_split(helpers.EQUALITY_CLIENTS, seed=3, local_test_examples=10)
  spec = build_model_spec(data, 'mlp2', seed=0)
  methods = helpers.equality_methods()
  runtime = LocalWorkerRuntime()
  try:
    for name in names or sorted(methods):
      for executor in ('cpp', 'vectorised'):
        algorithm = methods[name](spec)
        if executor == 'cpp':
          context = runtime.context
        else:
          algorithm = algorithm.with_vectorized_clients()
          context = InProcessContext()
        trace, state = helpers.run_rounds(algorithm, data, context, helpers.EQUALITY_CLIENTS)
        tff.framework.set_default_context(runtime.context)
        arrays = {f'r{r}_{i:04d}': x for r, round_ in enumerate(trace)
                  for i, x in enumerate(helpers.leaves(round_))}
        arrays.update({f'final_{i:04d}': x for i, x in enumerate(helpers.leaves(state))})
        np.savez(os.path.join(out_dir, f'{name}.{executor}.npz'), **arrays)
        print(name, executor, len(arrays), 'arrays', flush=True)
  finally:
    runtime.close()


def compare(before: str, after: str) -> int:
  worst_overall = 0.0
  for file in sorted(os.listdir(before)):
    if not os.path.exists(os.path.join(after, file)):
      print(f'{file:50s} missing after')
      worst_overall = np.inf
      continue
    a, b = np.load(os.path.join(before, file)), np.load(os.path.join(after, file))
    if sorted(a) != sorted(b):
      print(f'{file:50s} different structure ({len(a)} vs {len(b)} arrays)')
      worst_overall = np.inf
      continue
    identical, worst = True, 0.0
    for key in a:
      x, y = a[key], b[key]
      if x.shape != y.shape:
        worst = np.inf
        continue
      if not np.array_equal(x, y):
        identical = False
        scale = max(float(np.max(np.abs(x.astype(np.float64)))), 1e-6) if x.size else 1.0
        worst = max(worst, float(np.max(np.abs(x.astype(np.float64) - y))) / scale)
    print(f'{file:50s} ' + ('bit-identical' if identical else f'max relative difference {worst:.2e}'))
    worst_overall = max(worst_overall, worst)
  return 0 if worst_overall <= 1e-6 else 1


if __name__ == '__main__':
  if sys.argv[1:2] == ['record']:
    record(sys.argv[2], sys.argv[3:])
  elif sys.argv[1:2] == ['compare']:
    sys.exit(compare(sys.argv[2], sys.argv[3]))
  else:
    print(__doc__)
    sys.exit(2)
