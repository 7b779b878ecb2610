"""The owned TFF runtime: workers never outlive the program that started them."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow_federated as tff

from fltff.runtime import TffRuntime
from fltff.runtime.local import wait_for_exit

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _alive(pid):
  return not wait_for_exit(pid, timeout=0.0)


def test_runtime_runs_computation_and_close_stops_worker(tff_runtime):
  runtime = TffRuntime()
  try:
    [pid] = runtime.worker_pids
    assert _alive(pid)

    @tff.federated_computation(tff.FederatedType(np.float32, tff.CLIENTS))
    def mean(x):
      return tff.federated_mean(x)

    assert mean([1.0, 2.0, 6.0]) == pytest.approx(3.0)
  finally:
    runtime.close()
    tff.framework.set_default_context(tff_runtime.context)  # Back to the session runtime.
  assert wait_for_exit(pid)
  runtime.close()  # Idempotent.


_CHILD = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    import tensorflow_federated as tff
    from fltff.runtime import TffRuntime
    rt = TffRuntime()
    @tff.federated_computation(tff.FederatedType(np.float32, tff.CLIENTS))
    def total(x):
      return tff.federated_sum(x)
    assert total([1.0, 2.0]) == 3.0
    print(rt.worker_pids[0], flush=True)
    if sys.argv[1] == 'hang':
      time.sleep(600)
    # 'exit': leave without calling close(): atexit must stop the worker.
""")


@pytest.mark.parametrize('how', ['exit', 'sigkill'])
def test_worker_dies_with_its_program(how):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3', PYTHONPATH=REPO)
  proc = subprocess.Popen([sys.executable, '-c', _CHILD, 'exit' if how == 'exit' else 'hang'],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
  pid = int(proc.stdout.readline())
  if how == 'sigkill':
    assert _alive(pid)
    proc.kill()
  proc.wait(timeout=120)
  if how == 'exit':
    assert proc.returncode == 0
  assert wait_for_exit(pid, timeout=10), f'worker {pid} outlived its program ({how})'


def test_unreachable_remote_worker_is_a_clear_error():
  from fltff.errors import RuntimeUnavailableError  # pylint: disable=g-import-not-at-top
  import portpicker  # pylint: disable=g-import-not-at-top

  port = portpicker.pick_unused_port()
  with pytest.raises(RuntimeUnavailableError, match=f'127.0.0.1:{port}'):
    TffRuntime(workers=[f'127.0.0.1:{port}'], connect_timeout=1.0)
