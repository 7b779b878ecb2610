"""Shared test fixtures: one owned TFF runtime per test session (checked for leaks), its C++
context, and the federation and model most numerical tests use."""

import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position

from fltff.runtime import heap  # pylint: disable=g-import-not-at-top,wrong-import-position

# The tests' tensors come from the allocator fltff's programs choose (before any op runs here).
heap.pooled_tensors()


@pytest.fixture(scope='session', autouse=True)
def tff_runtime():
  """Every TFF computation in the suite runs on a worker_binary this session owns."""
  from fltff.runtime import LocalWorkerRuntime  # pylint: disable=g-import-not-at-top
  from fltff.runtime.processes import wait_for_exit  # pylint: disable=g-import-not-at-top

  runtime = LocalWorkerRuntime()
  pids = runtime.worker_pids
  yield runtime
  runtime.close()
  for pid in pids:
    assert wait_for_exit(pid), f'worker_binary {pid} outlived the test session'


@pytest.fixture(autouse=True)
def session_context(tff_runtime):
  """Re-installs the session runtime's context before each test: tests that start and close
  their own runtime (test_runtime, test_remote) leave TFF without a default context."""
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

  tff.framework.set_default_context(tff_runtime.context)
  yield


@pytest.fixture
def in_process(session_context):
  """The in-process executor as TFF's context (after the session runtime's): where vectorised
  clients run."""
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

  from fltff.runtime.in_process import InProcessContext  # pylint: disable=g-import-not-at-top

  del session_context
  tff.framework.set_default_context(InProcessContext())


@pytest.fixture(scope='module')
def cpp(tff_runtime):
  """The session's TFF C++ runtime context: the reference the executor-equality tests compare
  against."""
  return tff_runtime.context


@pytest.fixture(scope='module')
def data():
  """The executor-equality federation: the 1003-image MNIST sample over `EQUALITY_CLIENTS`
  clients of unequal sizes, with local test splits (a module may define its own `data`)."""
  from helpers import EQUALITY_CLIENTS  # pylint: disable=g-import-not-at-top
  from helpers import mnist_sample_split  # pylint: disable=g-import-not-at-top

  return mnist_sample_split(EQUALITY_CLIENTS, seed=3, local_test_examples=10)


@pytest.fixture(scope='module')
def spec(data):  # pylint: disable=redefined-outer-name
  """mlp2 sized for the module's `data`."""
  from fltff.simulation import build_model_spec  # pylint: disable=g-import-not-at-top

  return build_model_spec(data, 'mlp2', seed=0)


# What starts a program end to end: `pipelines.run` (in a subprocess or in this process), the
# bench, the report, the installed command, mkdocs, a TFF worker in its own process.
_PROGRAM_CALLS = ('run_pipeline', 'run_and_resume', 'run_program', 'Program(', 'subprocess.',
                  'Popen(', 'pipelines.')


def _starts_a_program(function) -> bool:
  import inspect  # pylint: disable=g-import-not-at-top

  try:
    source = inspect.getsource(function)
  except (OSError, TypeError):
    return False
  return any(call in source for call in _PROGRAM_CALLS)


@pytest.fixture(scope='session')
def small_run(tmp_path_factory):
  """`(output folder, CompletedProcess, leaked worker pids)` of the SMALL run on TFF's C++
  runtime as its own process: read, resumed and compared against by several modules' tests,
  which must not change it."""
  from helpers import SMALL  # pylint: disable=g-import-not-at-top
  from helpers import run_pipeline  # pylint: disable=g-import-not-at-top
  from helpers import tagged_worker_pids  # pylint: disable=g-import-not-at-top

  out = str(tmp_path_factory.mktemp('small') / 'run')
  before = tagged_worker_pids()
  result = run_pipeline(*SMALL, f'--output_dir={out}')
  assert result.returncode == 0, result.stderr[-3000:]
  return out, result, tagged_worker_pids() - before


# Fixtures that finish a run or build a package (10–20 s each): the tests that use one go to
# one test process (`xdist_group`, the Makefile's `--dist loadgroup`), so that it is built once
# per session rather than once in each process that runs one of those tests.
SHARED_FIXTURES = ('small_run', 'installed', 'editable', 'straggler_run',
                   'built')


@pytest.hookimpl(tryfirst=True)  # Before pytest-xdist reads the groups.
def pytest_collection_modifyitems(items):
  """Marks `pipeline` every test that starts a program, itself or through a fixture, so that
  `pytest -m "not pipeline"` runs the unit and numerical tests alone; groups the tests of each
  of `SHARED_FIXTURES`; and runs the long tests first (`_start_order`).

  The end-to-end tests are the long ones (10–80 s each against well under a second for most
  others): started first and handed out one at a time (`--dist loadgroup` sends one test, or
  one group, to a process that has fewer than two waiting), they spread over the test processes and the short tests fill the gaps at the end, instead of
  one process running the last long tests while the other idles.
  """
  for item in items:
    fixtures = getattr(item, '_fixtureinfo', None)
    defs = fixtures.name2fixturedefs.values() if fixtures else ()
    if _starts_a_program(getattr(item, 'function', None)) or any(
        _starts_a_program(d[-1].func) for d in defs if d):
      item.add_marker(pytest.mark.pipeline)
    for name in SHARED_FIXTURES:
      if name in getattr(item, 'fixturenames', ()):
        item.add_marker(pytest.mark.xdist_group(name))
  items.sort(key=_start_order)


def _start_order(item) -> int:
  """Pipeline tests first, then the tests that run TFF's C++ runtime (the executor-equality
  matrix: 10–60 s each), then the rest (mostly well under a second)."""
  if item.get_closest_marker('pipeline') is not None:
    return 0
  return 1 if {'cpp', 'tff_runtime'} & set(getattr(item, 'fixturenames', ())) else 2
