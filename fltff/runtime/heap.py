"""Where a round's memory comes from (docs/performance.md, "Where a round's memory comes from"):
TensorFlow's reusing BFC allocator (`pooled_tensors`), glibc's mmap threshold kept fixed
(`fix_mmap_threshold`, `worker_environment`) and the heap trimmed after each round (`trim`).
None of this changes a number; the glibc settings are no-ops where libc is not glibc.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Optional

_M_MMAP_THRESHOLD = -3  # glibc's malloc.h.
_FIXED = {'here': False}  # Whether this process's threshold is fixed (for good: mallopt's rule).
_POOLED = ('TF_CPU_ALLOCATOR_USE_BFC', 'true')
# The default: glibc's own initial threshold, made fixed.
DEFAULT_MMAP_THRESHOLD_KIB = 128


@functools.lru_cache(maxsize=None)
def _glibc() -> Optional[ctypes.CDLL]:
  try:
    libc = ctypes.CDLL('libc.so.6')
    libc.mallopt  # pylint: disable=pointless-statement
    libc.malloc_trim  # pylint: disable=pointless-statement
  except (OSError, AttributeError):
    return None
  return libc


def pooled_tensors(environ: Optional[dict] = None) -> None:
  """TensorFlow's BFC allocator for this process (or, in `environ`, a child) unless one is named."""
  (os.environ if environ is None else environ).setdefault(*_POOLED)


def fix_mmap_threshold(kib: int) -> bool:
  """Fixes glibc's mmap threshold here at `kib` KiB (0: no-op); returns whether it did."""
  libc = _glibc()
  if kib > 0 and libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, int(kib) * 1024):
    _FIXED['here'] = True
    return True
  return False


def threshold_fixed() -> bool:
  """Whether `fix_mmap_threshold` fixed this process's threshold."""
  return _FIXED['here']


def worker_environment(kib: int, base: Optional[dict] = None) -> dict:
  """`base` (default: `os.environ`) with the threshold and pooled tensors set, for a child."""
  env = dict(os.environ if base is None else base)
  pooled_tensors(env)
  if kib > 0:
    env['MALLOC_MMAP_THRESHOLD_'] = str(int(kib) * 1024)
  return env


def trim() -> None:
  """Returns the heap's free pages to the kernel (`malloc_trim(0)`)."""
  libc = _glibc()
  if libc is not None:
    libc.malloc_trim(0)
