r"""The inside of an isolated `worker_binary`, run by `fltff.runtime.processes.IsolatedWorker`.

In the private network namespace it brings up the loopback, starts `worker_binary` there
(reachable from this namespace only) and relays a Unix socket to it: the only way in, which
only its owner may open (mode 0600).
"""

import fcntl
import os
import signal
import socket
import struct
import sys
import time

from absl import app
from absl import flags

from fltff.runtime import heap

FLAGS = flags.FLAGS


def define_flags() -> None:
  """Defines this program's flags (once per process) for whatever runs `main` as the program;
  not on import, as `fltff.runtime.worker` has flags of the same names."""
  if 'socket' in FLAGS:
    return
  flags.DEFINE_string('socket', None, 'Unix socket to relay to worker_binary.')
  flags.DEFINE_integer('max_concurrent_computation_calls', -1,
                       'Passed to worker_binary; <= 0 means no limit.')
  flags.DEFINE_string('log_file', None, "worker_binary's log.")
  flags.DEFINE_string('worker_binary', None,
                      'Path of worker_binary (default: the one in the TFF wheel).')
  flags.DEFINE_integer('mmap_threshold_kib', heap.DEFAULT_MMAP_THRESHOLD_KIB,
                       "worker_binary's glibc mmap threshold (`fltff.runtime.heap`).")


_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1


def loopback_up() -> None:
  """`ip link set lo up`, with the kernel's interface ioctls (no iproute2 needed)."""
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    request = struct.pack('16sH14s', b'lo', 0, b'\0' * 14)
    current = struct.unpack('16sH14s', fcntl.ioctl(s, _SIOCGIFFLAGS, request))[1]
    fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack('16sH14s', b'lo', current | _IFF_UP, b'\0' * 14))


def main(argv) -> int:
  del argv
  from fltff.cli import StopSignal  # pylint: disable=g-import-not-at-top
  from fltff.runtime.processes import WorkerProcess  # pylint: disable=g-import-not-at-top
  from fltff.runtime.tls import serve_forwarder  # pylint: disable=g-import-not-at-top
  from fltff.runtime.worker import serve_until_stopped  # pylint: disable=g-import-not-at-top

  stop = StopSignal()
  signal.signal(signal.SIGTERM, lambda *_: stop.set())
  signal.signal(signal.SIGINT, lambda *_: stop.set())
  loopback_up()
  worker = WorkerProcess(max_concurrent_computation_calls=FLAGS.max_concurrent_computation_calls,
                         log_path=FLAGS.log_file, mmap_threshold_kib=FLAGS.mmap_threshold_kib,
                         binary=FLAGS.worker_binary)
  # The relay answers at once; the first RPC must not reach a worker_binary still starting.
  deadline = time.monotonic() + 60.0
  while True:
    try:
      socket.create_connection(('127.0.0.1', worker.port), timeout=1.0).close()
      break
    except OSError:
      if not worker.alive() or time.monotonic() > deadline:
        print(f'error: worker_binary did not start; see {worker.log_path}', file=sys.stderr,
              flush=True)
        worker.stop()
        return 1
      time.sleep(0.05)
  old_umask = os.umask(0o177)  # The socket file is created 0600.
  try:
    server, _ = serve_forwarder(f'unix:{FLAGS.socket}', worker.address)
  finally:
    os.umask(old_umask)
  print(f'ready {worker.pid}', flush=True)
  try:
    return serve_until_stopped(stop, worker, 'worker_binary')
  finally:
    server.stop(grace=1)
    worker.stop()


if __name__ == '__main__':
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
  define_flags()
  app.run(lambda argv: sys.exit(main(argv)))
