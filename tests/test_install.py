"""fltff installed as a user installs it (a wheel, no checkout on the path; or editable, as
`make setup` does) runs from any folder: the `fltff` command, the shipped gin configs and sample
data, the user's own modules and includes beside the user's own gin file; scripts that import
it exit quietly."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

from helpers import REPO
from helpers import assert_one_line_error


def _shipped(folder, suffix):
  return {os.path.relpath(os.path.join(d, n), os.path.join(REPO, folder))
          for d, _, names in os.walk(os.path.join(REPO, folder)) for n in names
          if n.endswith(suffix) and '__pycache__' not in d}


def _copy_of_the_source(source):
  """A copy of what the distribution is built from, so that a build leaves the checkout alone."""
  for folder in ('fltff', 'pipelines', 'gin_configs'):
    shutil.copytree(os.path.join(REPO, folder), source / folder,
                    ignore=shutil.ignore_patterns('__pycache__'))
  for name in ('pyproject.toml', 'README.md'):
    shutil.copy(os.path.join(REPO, name), source / name)
  return source


@pytest.fixture(scope='module')
def installed(tmp_path_factory):
  """`(site, env)`: fltff's wheel built from this checkout and installed into `site`, and an
  environment in which Python finds it there (and not this checkout)."""
  root = tmp_path_factory.mktemp('install')
  source = _copy_of_the_source(root / 'source')
  build = subprocess.run(
      [sys.executable, '-m', 'pip', 'wheel', '-q', '--no-deps', '--no-build-isolation',
       '--disable-pip-version-check', '-w', str(root / 'dist'), str(source)],
      capture_output=True, text=True, timeout=300)
  assert build.returncode == 0, build.stderr[-3000:]
  [wheel] = list((root / 'dist').glob('fltff-*.whl'))
  names = set(zipfile.ZipFile(wheel).namelist())
  # Every module and every shipped config is in the wheel (pyproject.toml lists the packages).
  assert {f'fltff/{p}' for p in _shipped('fltff', '.py')} <= names
  assert {f'fltff/pipelines/{p}' for p in _shipped('pipelines', '.py')} <= names
  assert {f'fltff/gin_configs/{p}' for p in _shipped('gin_configs', '.gin')} <= names
  assert 'fltff/data/samples/mnist_first1003.npz' in names
  site = root / 'site'
  install = subprocess.run(
      [sys.executable, '-m', 'pip', 'install', '-q', '--no-deps', '--disable-pip-version-check',
       f'--target={site}', str(wheel)], capture_output=True, text=True, timeout=300)
  assert install.returncode == 0, install.stderr[-3000:]
  env = dict(os.environ, PYTHONPATH=str(site), TF_CPP_MIN_LOG_LEVEL='3')
  return site, env


@pytest.fixture(scope='module')
def editable(tmp_path_factory):
  """`(script, env)`: the `fltff` script of an editable install (`make setup`'s `pip install
  -e .`) of a copy of this checkout, into a virtual environment of its own that reads this
  one's packages (TensorFlow, TFF, gin), and an environment to run it in."""
  root = tmp_path_factory.mktemp('editable')
  source = _copy_of_the_source(root / 'source')
  venv = root / 'venv'
  subprocess.run([sys.executable, '-m', 'venv', '--without-pip', str(venv)], check=True,
                 timeout=120)
  [packages] = venv.glob('lib/python*/site-packages')
  # A plain path line: this environment's packages, but not its own editable fltff (whose
  # .pth file Python does not process from there).
  (packages / 'zz_packages_of_the_tests.pth').write_text(sysconfig.get_paths()['purelib'] + '\n')
  # pip from those packages; --ignore-installed: it never touches another environment's fltff.
  install = subprocess.run(
      [str(venv / 'bin' / 'python'), '-m', 'pip', 'install', '-q', '--no-deps',
       '--no-build-isolation', '--ignore-installed', '--disable-pip-version-check', '-e',
       str(source)], capture_output=True, text=True, timeout=300)
  assert install.returncode == 0, install.stderr[-3000:]
  env = {k: v for k, v in os.environ.items() if k not in ('PYTHONPATH', 'VIRTUAL_ENV')}
  return venv / 'bin' / 'fltff', dict(env, TF_CPP_MIN_LOG_LEVEL='3')


_USER_MODELS = """
import tensorflow as tf
from fltff import models

def small_mlp(input_shape, num_classes, seed):
  init = lambda i: tf.keras.initializers.GlorotUniform(seed=seed * 10 + i)
  inputs = tf.keras.Input(input_shape)
  x = tf.keras.layers.Flatten()(inputs)
  x = tf.keras.layers.Dense(16, activation='relu', kernel_initializer=init(0), name='latent')(x)
  return tf.keras.Model(inputs, tf.keras.layers.Dense(num_classes, kernel_initializer=init(1))(x))

models.register('small_mlp', small_mlp)
"""


def _command(how, request):
  """`(argv, env, python, root)`: the command `how` names (`python -m fltff`, or the `fltff`
  script of the wheel or of the editable install), its environment, its Python and the folder
  its fltff is imported from."""
  if how == 'editable':
    script, env = request.getfixturevalue('editable')
    return [str(script)], env, str(script.parent / 'python'), str(script.parents[2] / 'source')
  site, env = request.getfixturevalue('installed')
  argv = [str(site / 'bin' / 'fltff')] if how == 'wheel' else [sys.executable, '-m', 'fltff']
  return argv, env, sys.executable, str(site)


# The installed `fltff` script starts Python with its own folder first on sys.path, not the
# working directory as `python -m` does: the user's module is found all the same.
@pytest.mark.parametrize('how', ['python -m', 'wheel', 'editable'])
def test_the_installed_command_runs_a_users_project_with_its_own_model(how, request, tmp_path):
  command, env, python, fltff_root = _command(how, request)
  project = tmp_path / 'project'
  project.mkdir()
  # The user's project: a module that registers a model, a gin file that imports it and
  # includes a shipped config and a file of its own beside it.
  (project / 'my_models.py').write_text(_USER_MODELS)
  (project / 'exp.gin').write_text(
      "import my_models\ninclude 'gin_configs/quickstart.gin'\ninclude 'short.gin'\n"
      "experiment.model = 'small_mlp'\n")
  (project / 'short.gin').write_text('experiment.rounds = 2\n')
  result = subprocess.run([*command, 'run', '--gin_file=exp.gin', '--output_dir=out'],
                          cwd=project, env=env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'Traceback' not in result.stderr, result.stderr[-3000:]
  summary = json.loads((project / 'out' / 'summary.json').read_text())
  assert summary['rounds_completed'] == 2 and summary['dataset'].startswith('synthetic')
  assert summary['model'] == 'small_mlp' and 'vectorised clients' in summary['executor']
  assert summary['fltff_version'] and 'fltff_commit' not in summary  # No checkout here.
  where = subprocess.run([python, '-c', 'import fltff; print(fltff.__file__)'],
                         cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
  assert where.stdout.strip().startswith(fltff_root), where.stdout
  assert where.stderr == ''  # Imported and exited without TFF's ServiceManager traceback.


def test_the_installed_command_finds_shipped_configs_and_names_what_is_missing(installed,
                                                                             tmp_path):
  _, env = installed
  run = lambda *args: subprocess.run([sys.executable, '-m', 'fltff', *args], cwd=tmp_path,
                                     env=env, capture_output=True, text=True, timeout=600)
  # A shipped config by its repository path, from a folder that has no such file; it reads the
  # shipped MNIST sample.
  result = run('run', '--gin_file=gin_configs/foundation/mnist1003_shards_fedavg.gin',
               '--gin_bindings=experiment.rounds = 1', '--output_dir=out')
  assert result.returncode == 0, result.stderr[-3000:]
  (tmp_path / 'bad.gin').write_text("include 'gin_configs/quickstart.gin'\ninclude 'mine.gin'\n")
  assert_one_line_error(run('run', '--gin_file=bad.gin', '--output_dir=out2'),
                        'an included file is not found', 'mine.gin')
  assert not (tmp_path / 'out2').exists()
  assert_one_line_error(run('run', '--gin_file=nope.gin'), 'nope.gin does not exist')


def test_the_command_lists_its_commands_and_their_flags():
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3')
  run = lambda *args: subprocess.run([sys.executable, '-m', 'fltff', *args], cwd=REPO, env=env,
                                     capture_output=True, text=True, timeout=300)
  usage = run()
  assert usage.returncode == 2 and 'commands:' in usage.stdout
  for command in ('run', 'report', 'sweep', 'reproduce', 'bench', 'list'):
    assert f'  {command} ' in usage.stdout
  assert_one_line_error(run('nonsense'), "unknown command 'nonsense'")
  # A bad flag is one line too (absl's parser prints a FATAL line and a hint).
  assert_one_line_error(run('run', '--nope=1'), "error: Unknown command line flag 'nope'")
  assert_one_line_error(run('bench', '--rounds=abc'), "error: flag --rounds=abc")
  helped = run('run', '--help')
  assert helped.returncode == 0 and '--gin_file' in helped.stdout and '--resume' in helped.stdout
  assert 'Traceback' not in helped.stderr and 'Exception ignored' not in helped.stderr


@pytest.mark.parametrize('gin_file,error', [
    ('nope.gin', 'error: Gin file nope.gin does not exist'),
    # A shipped config found from another folder, including one that is, and a missing file.
    ('bad.gin', 'error: Invalid gin configuration: an included file is not found: mine.gin '
                '(in bad.gin, line 3)'),
    ('.', 'error: the gin file . is not a regular file (a folder, device or pipe); pass a gin '
          'configuration file.')])
def test_a_missing_gin_file_is_refused_before_tensorflow_is_imported(tmp_path, gin_file, error):
  # The command checks its --gin_file paths and their includes first: the error comes at once,
  # not after the seconds TensorFlow and TFF take to import. The checkout is on sys.path, so
  # gin's lookup of `gin_configs/...` as a package meets a namespace package on the way.
  (tmp_path / 'bad.gin').write_text("include 'gin_configs/quickstart.gin'\n\n"
                                    "include 'mine.gin'\n")
  program = ("import sys\nfrom fltff import cli\ntry:\n"
             f"  cli.main(['fltff', 'run', '--gin_file', '{gin_file}', '--output_dir=out'])\n"
             "except SystemExit as e:\n  print(e.code, 'tensorflow' in sys.modules)\n")
  result = subprocess.run([sys.executable, '-c', program], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=REPO))
  assert result.stdout.split() == ['2', 'False'], (result.stdout, result.stderr[-2000:])
  assert result.stderr.startswith(error), result.stderr
  assert len(result.stderr.strip().splitlines()) == 1, result.stderr
  assert not (tmp_path / 'out').exists()


def test_the_installed_command_lists_what_an_experiment_can_name(installed, tmp_path):
  site, env = installed
  run = lambda *args: subprocess.run([str(site / 'bin' / 'fltff'), *args], cwd=tmp_path,
                                     env=env, capture_output=True, text=True, timeout=300)
  usage = run()
  assert ('  list       the methods (with their papers), models, data sources and shipped gin '
          'configs') in usage.stdout.splitlines()
  listed = run('list')
  assert (listed.returncode, listed.stderr) == (0, '')
  lines = listed.stdout.splitlines()
  assert lines[0] == 'methods (experiment.method = @<name>):'
  for expected in ("models (experiment.model = '<name>'; your own: fltff.models.register):",
                   'data sources (federated_data.source = @<name>):',
                   '  fltff/data/samples/mnist_first1003.npz',
                   'gin configs (fltff run --gin_file=<path>):'):
    assert expected in lines
  # The installed package's own configs.
  assert '  gin_configs/kapc/' in listed.stdout and str(site) not in listed.stdout
  helped = run('run', '--help')
  assert helped.returncode == 0 and '`fltff list` shows what a configuration can name' in (
      helped.stdout)
