r"""Lists what an experiment can name: methods (with the paper each follows), models, data
sources and the gin configs fltff ships.

  fltff list [methods|models|sources|configs]

With no section it prints every section, the shipped configs as one line per folder;
`fltff list configs` prints every config with its first comment line.
"""

import os
import sys
from typing import Optional

SECTIONS = ('methods', 'models', 'sources', 'configs')


def _summary(doc: Optional[str]) -> str:
  """The first sentence of a docstring's first paragraph ('' without a docstring): up to a '. '
  before a capital letter or a '; ', outside brackets and code."""
  paragraph = ' '.join((doc or '').strip().split('\n\n')[0].split())
  depth, code = 0, False
  for i, char in enumerate(paragraph):
    code ^= char == '`'
    depth += (char in '([') - (char in ')]')
    after = paragraph[i + 1:i + 3]
    if not code and depth == 0 and (
        (char == '.' and after[:1] == ' ' and after[1:].isupper()) or char == ';'):
      return paragraph[:i]
  return paragraph.rstrip('.')


def _rows(pairs, indent: str = '  ') -> list[str]:
  """`name  text` lines, the texts aligned."""
  width = max(len(name) for name, _ in pairs)
  return [f'{indent}{name:<{width}}  {text}'.rstrip() for name, text in pairs]


def methods_section() -> list[str]:
  """Every method of the registry with its citation, then the compositions that add a paper."""
  from fltff import methods  # pylint: disable=g-import-not-at-top

  lines = ['methods (experiment.method = @<name>):']
  lines += _rows([(m.gin_name, m.citation or 'no paper: every client trains on its own data')
                  for m in methods.METHODS.values()])
  lines += ['compositions:']
  lines += _rows([
      ('<method>.model_aggregator = @contribution_normalization()',
       f'CCN: {methods.CCN_CITATION}'),
      ('kapc.bls_mu = <mu>', "KAPC with BLS: the KAPC paper's"),
      ('experiment.personalization = @fedlap_personalization',
       methods.VARIANTS['fedavg+fedlap_personalization'].citation),
  ])
  return lines


def models_section() -> list[str]:
  """The model zoo (and models registered by modules imported so far)."""
  from fltff.models import zoo  # pylint: disable=g-import-not-at-top

  lines = ["models (experiment.model = '<name>'; your own: fltff.models.register):"]
  return lines + _rows([(name, _summary(zoo._REGISTRY[name].__doc__))  # pylint: disable=protected-access
                        for name in zoo.model_names()])


def sources_section() -> list[str]:
  """The data sources and the data fltff ships."""
  from fltff import data  # pylint: disable=g-import-not-at-top
  from fltff import resources  # pylint: disable=g-import-not-at-top

  lines = ['data sources (federated_data.source = @<name>):']
  lines += _rows([(name, _summary(getattr(data, name).__doc__))
                  for name in data.__all__ if name.endswith('_source')])
  samples = os.path.join('fltff', 'data', 'samples')
  folder = resources.find_shipped(samples)
  shipped = sorted(n for n in os.listdir(folder) if n.endswith('.npz')) if folder else []
  lines += ['shipped data (npz_source.path):']
  return lines + [f'  {samples}/{name}' for name in shipped]


def _configs() -> dict[str, list[str]]:
  """The shipped gin configs, `gin_configs/...` paths by folder."""
  from fltff import resources  # pylint: disable=g-import-not-at-top

  root = resources.find_shipped('gin_configs')
  by_folder = {}
  for folder, dirs, files in os.walk(root):
    dirs.sort()
    for name in sorted(files):
      if name.endswith('.gin'):
        path = os.path.relpath(os.path.join(folder, name), os.path.dirname(root))
        by_folder.setdefault(os.path.dirname(path), []).append(path)
  return by_folder


def _first_comment(path: str) -> str:
  from fltff import resources  # pylint: disable=g-import-not-at-top

  with open(resources.find_shipped(path)) as f:
    for line in f:
      if line.startswith('#') and line.strip('#').strip():
        return line.strip('#').strip()
  return ''


def configs_section(every: bool) -> list[str]:
  """The shipped gin configs: with `every` each with its first comment line, else per folder."""
  by_folder = _configs()
  lines = ['gin configs (fltff run --gin_file=<path>):']
  if every:
    return lines + _rows([(path, _first_comment(path))
                          for paths in by_folder.values() for path in paths])
  rows = []
  for folder, paths in by_folder.items():
    if folder == 'gin_configs':
      rows += [(path, _first_comment(path)) for path in paths]
    else:
      rows.append((f'{folder}/', f'{len(paths)} configs (fltff list configs names them)'))
  return lines + _rows(rows)


def main(argv) -> int:
  sections = list(argv[1:]) or list(SECTIONS)
  unknown = [s for s in sections if s not in SECTIONS]
  if unknown:
    print(f'error: no section {unknown[0]!r}; fltff list [{"|".join(SECTIONS)}].',
          file=sys.stderr)
    return 2
  build = {'methods': methods_section, 'models': models_section, 'sources': sources_section,
           'configs': lambda: configs_section(every=len(sections) == 1)}
  print('\n\n'.join('\n'.join(build[s]()) for s in sections))
  return 0


if __name__ == '__main__':
  from fltff.cli import run_program  # pylint: disable=g-import-not-at-top
  run_program(main)
