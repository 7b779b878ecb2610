"""The package's shape: installable, no import circles, no shadowed modules, `__all__`,
`build_*` builders, and builders that take their optimizers instead of reading gin."""

import ast
import collections
import importlib
import json
import os
import pkgutil
import subprocess
import sys

import gin
import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

import fltff
from fltff import learning
from fltff import methods
from fltff import personalization
from fltff.errors import ConfigError
from fltff.learning import ModelSpec
from fltff.learning import optimizers
from fltff.simulation import experiment
from helpers import REPO
from helpers import tiny_mlp

PACKAGES = ['fltff.' + name for name in fltff.__all__ if name not in ('errors', 'methods')]


def _modules():
  """{module name: path} for every module of fltff."""
  out = {}
  for root, _, files in os.walk(os.path.join(REPO, 'fltff')):
    for f in files:
      if f.endswith('.py'):
        path = os.path.join(root, f)
        name = os.path.relpath(path[:-3], REPO).replace(os.sep, '.')
        out[name[:-len('.__init__')] if name.endswith('.__init__') else name] = path
  return out


def import_graph() -> dict:
  """Module → fltff modules it imports anywhere in its text (top level, inside functions, or
  by `importlib.import_module('fltff...')` with a literal name)."""
  modules = _modules()
  graph = {}
  for name, path in modules.items():
    with open(path) as f:
      tree = ast.parse(f.read())
    targets = set()
    for node in ast.walk(tree):
      found = []
      if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith('fltff'):
        found = [f'{node.module}.{a.name}' if f'{node.module}.{a.name}' in modules
                 else node.module for a in node.names]
      elif isinstance(node, ast.Import):
        found = [a.name for a in node.names if a.name.startswith('fltff')]
      elif (isinstance(node, ast.Call) and getattr(node.func, 'attr', '') == 'import_module'
            and node.args and isinstance(node.args[0], ast.Constant)
            and str(node.args[0].value).startswith('fltff')):
        found = [node.args[0].value]
      targets.update(t for t in found if t in modules and t != name)
    graph[name] = targets
  return graph


def find_cycle(graph: dict):
  """One import cycle as a list of modules, or None."""
  state = {}

  def visit(node, path):
    state[node] = 'open'
    for nxt in sorted(graph[node]):
      if state.get(nxt) == 'open':
        return path[path.index(nxt):] + [nxt]
      if nxt not in state:
        cycle = visit(nxt, path + [nxt])
        if cycle:
          return cycle
    state[node] = 'done'
    return None

  for start in sorted(graph):
    if start not in state:
      cycle = visit(start, [start])
      if cycle:
        return cycle
  return None


def test_find_cycle_finds_one():
  assert find_cycle({'a': {'b'}, 'b': {'c'}, 'c': {'a'}}) == ['a', 'b', 'c', 'a']
  assert find_cycle({'a': {'b'}, 'b': set(), 'c': {'a'}}) is None


def test_no_import_cycle_in_fltff():
  graph = import_graph()
  assert len(graph) > 40
  # A package importing its own modules is how packages work; a cycle through the package's
  # __init__ and back (module -> package -> module) is not allowed either.
  assert find_cycle(graph) is None, ' -> '.join(find_cycle(graph))


@pytest.mark.parametrize('package', PACKAGES)
def test_every_package_has_a_resolvable_all(package):
  module = importlib.import_module(package)
  assert hasattr(module, '__all__'), f'{package} has no __all__'
  missing = [n for n in module.__all__ if not hasattr(module, n)]
  assert not missing


@pytest.mark.parametrize('package', PACKAGES)
def test_no_module_is_shadowed_by_a_package_attribute(package):
  module = importlib.import_module(package)
  for info in pkgutil.iter_modules(module.__path__):
    sub = importlib.import_module(f'{package}.{info.name}')
    assert getattr(module, info.name, sub) is sub, f'{package}.{info.name} is shadowed'


_IMPORT_ALL = '''
import importlib, json, sys
from absl import flags
defined = {}
for name in sys.argv[1:]:
  before = set(flags.FLAGS)
  importlib.import_module(name)
  if set(flags.FLAGS) - before:
    defined[name] = sorted(set(flags.FLAGS) - before)
print(json.dumps({'defined': defined, 'by_module': {
    module: sorted(f.name for f in fs)
    for module, fs in flags.FLAGS.flags_by_module_dict().items()}}))
'''


def test_importing_every_module_in_one_process_defines_no_flag():
  """Flags belong to entry points: importing any fltff module, the programs
  `fltff.runtime.worker` and `fltff.runtime.isolated` (flags of the same names) among them,
  defines no absl flag; each program defines its own when it runs (`define_flags`). The
  runner's programs (`pipelines/`), which define theirs at import, import beside them and
  each other (tests/launcher.py's fork server preloads several)."""
  library = sorted(_modules().keys() - {'fltff.__main__'})
  runner = ['pipelines'] + sorted(f'pipelines.{f[:-3]}' for f in os.listdir(
      os.path.join(REPO, 'pipelines')) if f.endswith('.py') and f != '__init__.py')
  assert {'fltff.runtime.worker', 'fltff.runtime.isolated'} <= set(library)
  # `python -m fltff`'s module last: importing it must not run the command either.
  names = library + runner + ['fltff.__main__']
  run = subprocess.run([sys.executable, '-c', _IMPORT_ALL, *names], cwd=REPO,
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3'))
  assert run.returncode == 0, run.stderr[-3000:]
  found = json.loads(run.stdout.strip().splitlines()[-1])
  # An fltff module may import a third-party one that defines flags (absl.logging's), never
  # define one itself.
  own = {module: names for module, names in found['by_module'].items()
         if module == 'fltff' or module.startswith('fltff.')}
  assert not own, f'defined at import: {own} (new flags after each import: {found["defined"]})'


def test_method_builders_are_named_build_and_keep_short_gin_names():
  fltff.register_configurables()
  for gin_name in [m.gin_name for m in methods.METHODS.values()] + ['fedlap_personalization']:
    fn = gin.get_configurable(gin_name)
    assert fn.__name__.startswith('build_'), (gin_name, fn.__name__)


def test_library_builders_do_not_read_gin_optimizers():
  """Only the experiment wiring calls the gin-configured optimizers."""
  offenders = []
  for name, path in _modules().items():
    if name in ('fltff.simulation.experiment', 'fltff.learning.optimizers'):
      continue
    with open(path) as f:
      text = f.read()
    if 'optimizers.client_optimizer(' in text or 'optimizers.server_optimizer(' in text:
      offenders.append(name)
  assert not offenders


# --- explicit optimizers through the wiring --------------------------------------------------
DIM, CLASSES = 4, 3
SPEC = ModelSpec(lambda: tiny_mlp(DIM, CLASSES, 9), (DIM,), CLASSES)


def _one_round(algorithm):
  rng = np.random.default_rng(0)
  inputs = []
  for k, n in enumerate((6, 9)):
    x = rng.normal(size=(n, DIM)).astype(np.float32)
    y = rng.integers(0, CLASSES, n).astype(np.int32)
    ds = tf.data.Dataset.from_tensor_slices(collections.OrderedDict(x=x, y=y)).batch(3)
    inputs.append(learning.client_input(ds, k, 1))
  process = algorithm.process
  state = process.initialize()
  state = process.set_model_weights(state, SPEC.initial_weights())
  return [np.asarray(w) for w in
          process.get_model_weights(process.next(state, inputs).state).trainable]


@pytest.fixture
def clean_gin():
  gin.clear_config()
  yield
  gin.clear_config()


def test_wiring_passes_the_gin_optimizers_and_a_bound_server_optimizer_counts(clean_gin):
  fltff.register_configurables()
  gin.parse_config(['client_optimizer.name = "sgd"', 'client_optimizer.learning_rate = 0.1'])
  plain = _one_round(experiment.build_method(learning.build_fedavg, SPEC, 2))
  sgd = optimizers.sgdm(learning_rate=0.1)
  for a, b in zip(plain, _one_round(learning.build_fedavg(SPEC, client_optimizer=sgd))):
    np.testing.assert_allclose(a, b, atol=1e-6)
  gin.parse_config(['server_optimizer.learning_rate = 0.5'])
  half = _one_round(experiment.build_method(learning.build_fedavg, SPEC, 2))
  start = [np.asarray(w) for w in SPEC.initial_weights().trainable]
  for h, p, w in zip(half, plain, start):  # w + 0.5 (w_avg − w)
    np.testing.assert_allclose(h, w + 0.5 * (p - w), atol=1e-6)


def test_bound_server_optimizer_is_refused_by_a_method_without_one(clean_gin):
  fltff.register_configurables()
  gin.parse_config(['server_optimizer.learning_rate = 0.5'])
  with pytest.raises(ConfigError, match='kapc has no server optimizer'):
    experiment.build_method(personalization.build_kapc, SPEC, 2)


def test_server_optimizer_and_learning_rate_together_are_refused():
  with pytest.raises(ConfigError, match='pass server_optimizer or server_learning_rate'):
    learning.build_fedavg(SPEC, server_learning_rate=0.5,
                          server_optimizer=optimizers.sgdm(0.5))


# Installing fltff and running it from another folder: tests/test_install.py.


def test_a_new_method_module_is_registered_without_touching_any_other_file(tmp_path):
  """A new personalised rule is one module (plus its test): `register_configurables` finds
  its gin builder although no `__init__` imports it."""
  rule = '''
import dataclasses
import gin
from fltff.personalization import process
from fltff.learning import optimizers

@dataclasses.dataclass(frozen=True)
class EveryoneEqual(process.RelationRule):
  name = 'everyone_equal'
  lambda_: float = 0.1

@gin.configurable('everyone_equal_test_rule')
def build_everyone_equal(model_spec, num_clients, client_optimizer=None):
  return process.build_personalized_process(model_spec, num_clients, client_optimizer,
                                            EveryoneEqual())
'''
  package = tmp_path / 'fltff' / 'personalization'
  package.mkdir(parents=True)
  (package / 'everyone_equal.py').write_text(rule)
  code = ('import fltff, fltff.personalization as p, gin; '
          f'p.__path__.append({str(package)!r}); fltff.register_configurables(); '
          "print(gin.get_configurable('everyone_equal_test_rule').__name__)")
  run = subprocess.run([sys.executable, '-c', code], cwd=REPO, capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3'))
  assert run.returncode == 0, run.stderr[-2000:]
  assert run.stdout.strip().endswith('build_everyone_equal')
