"""A program for `test_runtime.test_worker_dies_with_its_program`: starts fltff's local TFF
runtime, runs one computation on it and prints its processes' PIDs; then ends without closing
the runtime (`exit`: its exit hooks must stop the worker) or waits to be killed (`hang`)."""

import time


def main(argv) -> int:
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

  from fltff.runtime import LocalWorkerRuntime  # pylint: disable=g-import-not-at-top

  runtime = LocalWorkerRuntime()

  @tff.federated_computation(tff.FederatedType(np.float32, tff.CLIENTS))
  def total(x):
    return tff.federated_sum(x)

  assert total([1.0, 2.0]) == 3.0
  print(*runtime.worker_pids, flush=True)
  if argv[1] == 'hang':
    time.sleep(600)
  return 0
