"""Shared test fixtures: one owned TFF runtime per test session, checked for leaks."""

import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position


@pytest.fixture(scope='session', autouse=True)
def tff_runtime():
  """Every TFF computation in the suite runs on a worker_binary this session owns."""
  from fltff.runtime import TffRuntime  # pylint: disable=g-import-not-at-top
  from fltff.runtime.local import wait_for_exit  # pylint: disable=g-import-not-at-top

  runtime = TffRuntime()
  pids = runtime.worker_pids
  yield runtime
  runtime.close()
  for pid in pids:
    assert wait_for_exit(pid), f'worker_binary {pid} outlived the test session'


@pytest.fixture(autouse=True)
def session_context(tff_runtime):
  """Re-installs the session runtime's context before each test: tests that start and close
  their own `TffRuntime` (test_runtime, test_remote) leave TFF without a default context."""
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

  tff.framework.set_default_context(tff_runtime.context)
  yield
