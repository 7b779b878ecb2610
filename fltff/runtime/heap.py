"""Where a round's memory comes from: TensorFlow's pooling allocator, and glibc's heap.

TensorFlow's default CPU allocator takes every tensor from malloc. A round allocates and frees
the same model-sized tensors again and again, and glibc serves each large one with a fresh
`mmap` that the kernel fills page by page (hundreds of thousands of page faults a second in a
vectorised round, close to half of its CPU time in the kernel). TensorFlow's BFC allocator
(`TF_CPU_ALLOCATOR_USE_BFC=true`) keeps the memory it took and reuses it: `pooled_tensors()`
asks for it in this process (effective when no TensorFlow op has run yet; fltff's programs ask
at their start) and `worker_environment` for the local `worker_binary`. A value the user set
in the environment wins.

Outside the tensors:

A federated round allocates and frees the same model-sized buffers again and again (client
states, serialized datasets, gathered updates). glibc's malloc serves a block of 128 KiB or more
with `mmap` (given back to the kernel at `free`) — until the first such block is freed: then it
raises that threshold, up to 32 MiB, and later model-sized blocks come from the heap, where
they fragment it. Resident memory then creeps up by a few KiB each round in the driver and by
far more in TFF's `worker_binary`; with a fixed threshold the growth per round falls several
times (`fltff bench --memory`, docs/performance.md). The arithmetic is untouched; only where
memory comes from changes.

* `fix_mmap_threshold(kib)`: `mallopt(M_MMAP_THRESHOLD)` in this process (which also turns off
  the dynamic raise);
* `worker_environment(kib)`: the same setting for a child process (`MALLOC_MMAP_THRESHOLD_`,
  read by glibc at the child's start), used for the local `worker_binary`;
* `trim()`: `malloc_trim(0)`, which hands the free pages inside the heap back to the kernel;
  the round driver calls it after each round.

These three are no-ops where libc is not glibc. No setting here changes a number.
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


def pooled_tensors(environ=None) -> None:
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
