"""Where a round's memory comes from (docs/performance.md, "Where a round's memory comes from").

A round allocates and frees the same model-sized buffers at every step. Tensors: TensorFlow's
default CPU allocator takes each from malloc, whose large blocks are fresh mmaps the kernel
fills page by page; `pooled_tensors` asks for TensorFlow's BFC allocator instead, which reuses
its memory (in this process before its first op, or in a child's environment). Other buffers:
glibc raises its mmap threshold after the first large `free`, and model-sized blocks then
fragment the heap; `fix_mmap_threshold` / `worker_environment` fix it (the local
`worker_binary` grows several times more slowly per round) and `trim` (`malloc_trim(0)`, after
each round) returns the heap's free pages. None of this changes a number; the glibc settings
are no-ops where libc is not glibc.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Optional

_M_MMAP_THRESHOLD = -3  # glibc's malloc.h.
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
  """TensorFlow's BFC allocator for this process's tensors (or, given `environ`, for a child
  started with it), unless the environment names an allocator already."""
  (os.environ if environ is None else environ).setdefault(*_POOLED)


def fix_mmap_threshold(kib: int) -> bool:
  """Serves blocks of `kib` KiB or more with mmap in this process, without glibc's dynamic raise
  (0: leave glibc's default). Returns whether the setting was applied."""
  libc = _glibc()
  if kib <= 0 or libc is None:
    return False
  return bool(libc.mallopt(_M_MMAP_THRESHOLD, int(kib) * 1024))


def worker_environment(kib: int, base: Optional[dict] = None) -> dict:
  """`base` (default: this process's environment) with the threshold and the pooled tensor
  allocator set for a child process."""
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
