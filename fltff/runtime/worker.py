r"""Runs one TFF worker (the C++ `worker_binary` shipped in the TFF wheel) on this host.

  python -m fltff.runtime.worker --port=8000 [--max_concurrent_computation_calls=-1]

Prints the address to give the driver (`runtime.workers=['<host>:8000']`) and stops the worker
on SIGTERM/SIGINT, exiting 0. The worker speaks plaintext gRPC and listens on *all* interfaces
(TFF's binary has no bind-address or TLS option): run it on a trusted network, restrict the
port with a firewall, or reach it through an SSH tunnel (see README, "Running on several
machines").
"""

import os
import signal
import socket
import sys
import threading

from absl import app
from absl import flags

_PORT = flags.DEFINE_integer('port', 8000, 'Port the worker listens on (all interfaces).')
_MAX_CALLS = flags.DEFINE_integer('max_concurrent_computation_calls', -1,
                                  'Passed to worker_binary; <= 0 means no limit.')
_LOG = flags.DEFINE_string('log_file', None, 'Worker log (default: a temp file, printed).')


def main(argv) -> int:
  del argv
  from fltff.runtime.local import WorkerProcess  # pylint: disable=g-import-not-at-top
  from fltff.runtime.local import release_default_context  # pylint: disable=g-import-not-at-top

  stop = threading.Event()

  def handler(signum, frame):  # pylint: disable=unused-argument
    stop.set()

  signal.signal(signal.SIGTERM, handler)
  signal.signal(signal.SIGINT, handler)
  worker = WorkerProcess(port=_PORT.value, host=socket.gethostname(),
                         max_concurrent_computation_calls=_MAX_CALLS.value,
                         log_path=_LOG.value)
  print(f'fltff worker pid {worker.pid} listening on {worker.address} (port {worker.port} on '
        f'all interfaces, plaintext gRPC); log: {worker.log_path}', flush=True)
  try:
    while not stop.wait(0.5):
      if not worker.alive():
        print(f'error: worker_binary exited with status {worker.process.returncode}; see '
              f'{worker.log_path}', file=sys.stderr, flush=True)
        return 1
  finally:
    worker.stop()
    release_default_context()
  print('fltff worker stopped', flush=True)
  return 0


if __name__ == '__main__':
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
  app.run(lambda argv: sys.exit(main(argv)))
