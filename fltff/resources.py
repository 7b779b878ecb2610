"""Where fltff's shipped files are, in a checkout and in an installed package alike.

The gin configs (`gin_configs/` in the repository, installed as `fltff/gin_configs/`) and the
sample data are named by paths from the repository root (`gin_configs/base/...`,
`fltff/data/samples/...`), which resolve against the checkout or the installed package folder.
"""

import contextlib
import logging
import os
import re
import stat
import subprocess
import sys
from typing import Optional

import gin

from fltff import __version__
from fltff.errors import ConfigError

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_CHECKOUT = os.path.dirname(PACKAGE_DIR)  # A checkout's root (site-packages once installed).


def shipped_roots() -> list[str]:
  """Folders against which a shipped path (`gin_configs/...`, `fltff/...`) resolves: the
  checkout this fltff is imported from, then the installed package's own folder."""
  roots = [_CHECKOUT] if os.path.isdir(os.path.join(_CHECKOUT, 'gin_configs')) else []
  return roots + [PACKAGE_DIR] + ([] if roots else [_CHECKOUT])


def find_shipped(path: str) -> Optional[str]:
  """`path` as given if it exists, else the shipped file of that relative path, else None."""
  shipped = [] if os.path.isabs(path) else [os.path.join(root, path) for root in shipped_roots()]
  return next((candidate for candidate in [path] + shipped if os.path.exists(candidate)), None)


def find_gin_files(paths, bindings=()) -> list[str]:
  """The gin files as `find_shipped` finds them, after checking that they and their includes
  (looked up as gin will), and the files that `bindings` include, exist, are gin files and
  include no cycle; `ConfigError` naming the first that fails."""
  found = [find_shipped(path) for path in paths]
  for path, where in zip(paths, found):
    if where is None:
      raise ConfigError(f'Gin file {path} does not exist (neither here nor among the configs '
                        f'fltff ships, {os.path.join(shipped_roots()[0], "gin_configs")}).')
  seen = set()
  for where in found:
    _check_includes(where, seen, ())
  for binding in bindings:
    for line in binding.splitlines():
      match = _INCLUDE.match(line.strip())
      included = find_shipped(match.group(2)) if match else None
      if included is not None:  # Else gin says it is not found, naming the binding.
        _check_includes(included, seen, ('--gin_bindings',))
  return found


_INCLUDE = re.compile(r"""^include\s+(['"])(.+?)\1""")
# A gin file is a few KiB of text; more is not a configuration (e.g. --gin_file=/dev/zero).
MAX_GIN_FILE_BYTES = 1 << 20


def _check_includes(path: str, seen: set, chain: tuple) -> None:
  """Checks `path` and, recursively, the files it includes; `chain`: the files including it,
  outermost first (an include of one of them is a cycle, which gin would follow forever)."""
  real = os.path.realpath(path)
  cycle = [p for p in chain if os.path.realpath(p) == real]
  if cycle:
    files = list(chain[chain.index(cycle[0]):]) + [path]
    raise ConfigError(f'Invalid gin configuration: an include cycle: {" includes ".join(files)}'
                      '; remove one of these includes.')
  if real in seen:
    return
  seen.add(real)
  try:  # A readable regular text file (a device or FIFO is refused before it is opened).
    if not stat.S_ISREG(os.stat(path).st_mode):
      raise ConfigError(f'the gin file {path} is not a regular file (a folder, device or '
                        'pipe); pass a gin configuration file.')
    with open(path, 'rb') as f:
      data = f.read(MAX_GIN_FILE_BYTES + 1)
    if len(data) > MAX_GIN_FILE_BYTES:
      raise ConfigError(f'the gin file {path} is over {MAX_GIN_FILE_BYTES >> 20} MiB, more '
                        'than a gin configuration is; pass a gin configuration file.')
    lines = data.decode().splitlines()
  except (OSError, UnicodeDecodeError) as e:
    reason = os.strerror(e.errno) if getattr(e, 'errno', None) else 'not a text file'
    raise ConfigError(f'cannot read the gin file {path}: {reason}.') from None
  for number, line in enumerate(lines, 1):
    match = _INCLUDE.match(line.strip())
    if not match:
      continue
    target = match.group(2)
    # As `enable_gin_lookup` makes gin look: beside the including file, then `find_shipped`.
    beside = os.path.join(os.path.dirname(path), target)
    included = (beside if not os.path.isabs(target) and os.path.isfile(beside)
                else find_shipped(target))
    if included is None:
      raise ConfigError(include_not_found(target, f'{path}, line {number}'))
    _check_includes(included, seen, chain + (path,))


def include_not_found(target: str, where: str) -> str:
  """The error of an `include` that is not found (`where`: the file and line, or
  --gin_bindings), found first by `find_gin_files` or else by gin."""
  return (f'Invalid gin configuration: an included file is not found: {target} (in {where}); '
          'includes are looked up beside the including file, in the working directory, then '
          'among the configs fltff ships')


# Folders of the gin files being parsed, innermost last (gin opens includes mid-file).
_PARSING = []


@contextlib.contextmanager
def _tracked(path: str):
  """Opens a gin file for gin's parser and records its folder while gin reads it, for its
  includes, and puts it last on `sys.path`, for its imports (where Python finds none first)."""
  with open(path) as f:
    _PARSING.append(os.path.dirname(os.path.abspath(path)))
    sys.path.append(_PARSING[-1])
    try:
      yield f
    finally:
      del sys.path[len(sys.path) - 1 - sys.path[::-1].index(_PARSING.pop())]


def _beside_including_file(path: str) -> Optional[str]:
  if not _PARSING or os.path.isabs(path):
    return None
  candidate = os.path.join(_PARSING[-1], path)
  return candidate if os.path.isfile(candidate) else None


def _open_beside_including_file(path: str):
  return _tracked(_beside_including_file(path))


def enable_gin_lookup() -> None:
  """Makes gin look up an `include` beside the including file first, then in the working
  directory, then among fltff's shipped files (`gin_configs/...`), and an `import` where Python
  looks (the working directory first), then beside the importing file. Idempotent."""
  for root in shipped_roots():
    if root not in gin.config._LOCATION_PREFIXES:  # pylint: disable=protected-access
      gin.add_config_file_search_path(root)
  readers = gin.config._FILE_READERS  # pylint: disable=protected-access
  if any(reader is _open_beside_including_file for reader, _ in readers):
    return
  # gin's reader `open` becomes one recording the opened file's folder, for includes beside it;
  # gin's package-file reader, which logs an error wherever an include is not, is quietened.
  readers[:] = [(_tracked if reader is open else reader,
                 _quietly(check) if getattr(check, '__module__', '') == 'gin.resource_reader'
                 else check) for reader, check in readers]
  readers.insert(0, (_open_beside_including_file, _beside_including_file))


def _quietly(check):
  def quiet_check(path: str) -> bool:
    logging.disable(logging.ERROR)
    try:
      return check(path)
    except TypeError:
      # With a checkout on sys.path, gin reads `gin_configs/` as a namespace package without
      # a file path, and its check raises instead of answering "not there".
      return False
    finally:
      logging.disable(logging.NOTSET)

  return quiet_check


def source_version() -> dict:
  """fltff's version and, in a git checkout, its commit (`-dirty` with uncommitted changes), as
  a run's `summary.json` records them."""
  info = {'fltff_version': __version__}
  if os.path.exists(os.path.join(_CHECKOUT, '.git')):
    try:
      info['fltff_commit'] = subprocess.run(
          ['git', '-C', _CHECKOUT, 'describe', '--always', '--dirty', '--abbrev=12'],
          capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
      pass
  return info
