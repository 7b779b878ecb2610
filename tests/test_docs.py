"""The documentation works as written: the MkDocs site builds in strict mode (a broken link or
API reference fails), the quickstart page's commands run, the README's library program
(the same as the running page's) runs, and the pages tell no history."""

import ast
import csv
import os
import re
import shlex
import subprocess
import sys

from fltff import cli
from helpers import REPO
from launcher import run_program


def _blocks(path: str, language: str) -> list[str]:
  with open(os.path.join(REPO, path)) as f:
    return re.findall(rf'^```{language}\n(.*?)^```', f.read(), flags=re.S | re.M)


def _commands(block: str) -> list[str]:
  """A shell block's commands: continuation lines joined, comments dropped."""
  joined = re.sub(r'\\\n\s*', ' ', block)
  return [line.split('  #')[0].strip() for line in joined.splitlines()
          if line.strip() and not line.lstrip().startswith('#')]


def _defined(path: str) -> set[str]:
  """The public functions and classes a module of fltff defines at its top level."""
  with open(path) as f:
    tree = ast.parse(f.read())
  return {node.name for node in tree.body
          if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith('_')}


def _exported(package: str) -> list[str]:
  """`__all__` of `fltff.<package>`, read from its source (no TensorFlow imported)."""
  with open(os.path.join(REPO, 'fltff', package, '__init__.py')) as f:
    tree = ast.parse(f.read())
  [names] = [node.value for node in tree.body if isinstance(node, ast.Assign)
             and [t.id for t in node.targets if isinstance(t, ast.Name)] == ['__all__']]
  return ast.literal_eval(names)


def _api_names() -> set[str]:
  """What the API page must document with its signature: the protocol, every method's builder
  (the registry), every `build_*`, aggregation factory and factory class a package of fltff
  exports, and every one the other pages or the README name, where it is defined."""
  from fltff import methods  # pylint: disable=g-import-not-at-top

  is_builder = re.compile(r'^(build_\w+|\w+_factory|\w+Factory)$').match
  wanted = {'fltff.learning.protocol.FederatedAlgorithm'}
  wanted |= {m.builder.replace(':', '.') for m in methods.METHODS.values()}
  exported = {}
  for package in ('aggregators', 'data', 'learning', 'models', 'personalization', 'runtime',
                  'simulation'):
    for name in filter(is_builder, _exported(package)):
      exported[name] = f'fltff.{package}.{name}'
  wanted |= set(exported.values())
  pages = [os.path.join(d, n) for d, _, names in os.walk(os.path.join(REPO, 'docs'))
           for n in names if n.endswith('.md')] + [os.path.join(REPO, 'README.md')]
  named = set()
  for page in pages:
    with open(page) as f:
      named |= set(re.findall(r'\b(build_\w+|\w+_factory)\b', f.read()))
  for folder, _, files in os.walk(os.path.join(REPO, 'fltff')):
    for file in files:
      if file.endswith('.py') and not file.startswith('_'):
        module = os.path.relpath(os.path.join(folder, file[:-3]), REPO).replace(os.sep, '.')
        wanted |= {exported.get(name, f'{module}.{name}')
                   for name in _defined(os.path.join(folder, file)) & named}
  return wanted


def test_the_documentation_builds_strictly_without_a_warning(tmp_path):
  # Not --quiet: it silences griffe's docstring warnings, and the build then passes with them.
  result = subprocess.run([sys.executable, '-m', 'mkdocs', 'build', '--strict',
                           '--site-dir', str(tmp_path / 'site')], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
  output = result.stdout + result.stderr
  assert result.returncode == 0, output[-3000:]
  assert [l for l in output.splitlines() if not l.startswith('INFO')] == [], output[-3000:]
  api = (tmp_path / 'site' / 'api' / 'index.html').read_text()
  # Each with its signature, generated from the code by mkdocstrings.
  missing = sorted(name for name in _api_names() if f'id="{name}"' not in api)
  assert missing == []
  assert 'layerwise_adaptive_factory(layers=None, num_clients=None' in api


def test_the_pages_say_what_fltff_does_not_what_it_did():
  # For users: no "(a traceback before)" beside a fault, no session's story, no commit of a past
  # measurement (a run's data fingerprint in an example, `fedavg (data=3fa2c1d0)`, is not one).
  history = re.compile(r'\btracebacks? before\b|\bthis session\b|\bearlier we\b|\bwas fixed\b'
                       r'|\bcommit `?[0-9a-f]{7,40}\b|`[0-9a-f]{7,40}`', re.I)
  pages = [os.path.join(d, n) for d, _, names in os.walk(os.path.join(REPO, 'docs'))
           for n in names if n.endswith('.md')] + [os.path.join(REPO, 'README.md')]
  found = []
  for page in pages:
    with open(page) as f:
      found += [f'{os.path.relpath(page, REPO)}: {m[0]}' for m in history.finditer(f.read())]
  assert found == []


def test_the_readme_library_program_runs_as_written(tmp_path):
  [readme] = [b for b in _blocks('README.md', 'python') if 'algorithm.next' in b]
  [page] = [b for b in _blocks('docs/running.md', 'python') if 'algorithm.next' in b]
  assert readme == page  # One program, shown twice.
  (tmp_path / 'program.py').write_text(readme)
  result = subprocess.run([sys.executable, 'program.py'], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3'))
  assert result.returncode == 0, result.stderr[-3000:]
  assert re.search(r'round 2: train loss \d+\.\d{3}', result.stdout), result.stdout
  assert 'FedLayerWise weights psi: (3, 2)' in result.stdout, result.stdout
  assert 'Traceback' not in result.stderr and 'Exception ignored' not in result.stderr


def test_the_quickstart_page_commands_run_as_shown(tmp_path):
  first, then = (_commands(b) for b in _blocks('docs/index.md', 'bash'))
  assert first == ['make quickstart']
  # The README shows the same commands.
  readme = [_commands(b) for b in _blocks('README.md', 'bash')]
  assert then in readme and ['make quickstart', 'make test'] in readme
  # `make quickstart` (its output folder moved out of the checkout: the Makefile's OUTPUT_DIR).
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3',
             OUTPUT_DIR=str(tmp_path / 'runs' / 'quickstart'))
  result = subprocess.run(['make', 'quickstart'], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=900)
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
  # The other commands from another folder: `fltff <command> ...` runs the program
  # `pipelines.<command>` with those flags (`fltff.cli`), here forked from the fork server
  # (`launcher.py`; the installed command itself runs in `make quickstart` and test_install.py).
  for command in then:
    argv = shlex.split(command)
    assert argv[0] == '.venv/bin/fltff' and argv[1] in cli.COMMANDS
    result = run_program(f'pipelines.{argv[1]}', *argv[2:], cwd=str(tmp_path))
    assert result.returncode == 0, (command, result.stderr[-3000:])
  with open(tmp_path / 'runs' / 'five' / 'metrics.csv') as f:
    assert [int(r['round']) for r in csv.DictReader(f)] == list(range(1, 9))
  assert (tmp_path / 'runs' / 'report' / 'report.md').exists()
