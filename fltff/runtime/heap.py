"""Where a round's memory comes from (docs/performance.md, "Where a round's memory comes from").

A round allocates and frees the same model-sized buffers at every step. Tensors: TensorFlow's
default CPU allocator takes each from malloc, whose large blocks are fresh mmaps the kernel
fills page by page; `pooled_tensors` selects TensorFlow's reusing BFC allocator (before this
process's first op, or for a child). Other buffers: glibc raises its mmap threshold after the
first large `free`, and model-sized blocks then fragment the heap; `fix_mmap_threshold` /
`worker_environment` keep it fixed (not in a driver that trains vectorised clients: its rounds
are faster with the adaptive threshold, at the same memory), and `trim` (after each round)
returns the free pages. None of this changes a number; the glibc settings are no-ops where libc
is not glibc.
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
