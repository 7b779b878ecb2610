r"""Runs one TFF worker (the C++ `worker_binary` shipped in the TFF wheel) on this host.

  python -m fltff.runtime.worker --port=8000 \
      --tls_cert=worker.pem --tls_key=worker.key --tls_client_ca=clients-ca.pem
  python -m fltff.runtime.worker --port=8000 --insecure_plaintext   # trusted networks only

Secure by default: `worker_binary` (which executes any TensorFlow graph it is sent, and has no
TLS or bind-address option) runs in a private, unprivileged network namespace nothing outside
can reach, behind a TLS terminator on `--port` requiring a client certificate signed by
`--tls_client_ca` (mutual TLS; `fltff.runtime.tls`). The driver connects with
`runtime.tls_ca_file`, `runtime.tls_cert_file`, `runtime.tls_key_file`. `--insecure_plaintext`
runs `worker_binary` directly on all interfaces, plaintext: anyone who reaches the port can
run code on this host. Prints the address for the driver (`runtime.workers=['<host>:8000']`);
stops the worker on SIGTERM/SIGINT, exiting 0.
"""

import os
import signal
import socket
import sys

from absl import flags

from fltff.cli import StopSignal
from fltff.errors import ConfigError
from fltff.errors import FltffError
from fltff.errors import RuntimeUnavailableError
from fltff.runtime.channels import release_default_context
from fltff.runtime.processes import IsolatedWorker
from fltff.runtime.processes import WorkerProcess
from fltff.runtime.tls import check_can_listen
from fltff.runtime.tls import serve_forwarder
from fltff.runtime.tls import server_credentials

FLAGS = flags.FLAGS


def define_flags() -> None:
  """Defines the worker's flags (once per process) for whatever runs `main` as the program; not
  on import, as `fltff.runtime.isolated` has flags of the same names."""
  if 'tls_client_ca' in FLAGS:
    return
  flags.DEFINE_integer('port', 8000, 'Port the worker listens on (all interfaces), 1 to '
                       '65535; 0: any free port (printed).')
  flags.register_validator('port', lambda port: 0 <= port <= 65535,
                           message='a port is a number from 1 to 65535 (0: any free port)')
  flags.DEFINE_integer('max_concurrent_computation_calls', -1,
                       'Passed to worker_binary; <= 0 means no limit.')
  flags.DEFINE_string('log_file', None, 'Worker log (default: a temp file, printed).')
  flags.DEFINE_string('tls_cert', None, "This worker's TLS certificate (PEM).")
  flags.DEFINE_string('tls_key', None, "This worker's TLS private key (PEM).")
  flags.DEFINE_string(
      'tls_client_ca', None, 'CA certificate (PEM) that signed the drivers\' client '
      'certificates; a client without one is refused.')
  flags.DEFINE_bool(
      'insecure_plaintext', False,
      'Run worker_binary directly, plaintext gRPC on ALL interfaces, no authentication: anyone '
      'who can reach the port can run any TensorFlow graph on this host, i.e. read and write its '
      'files as this user. Only on a trusted, isolated network.')


def serve_until_stopped(stop: StopSignal, worker, what: str) -> int:
  """0 once `stop` is set; 1, said on stderr, if `worker` (a `WorkerProcess` or an
  `IsolatedWorker`) exits first."""
  while not stop.wait(0.5):
    if not worker.alive():
      print(f'error: {what} exited with status {worker.process.returncode}; see '
            f'{worker.log_path}', file=sys.stderr, flush=True)
      return 1
  return 0


def _plaintext(stop: StopSignal) -> int:
  check_can_listen(f'[::]:{FLAGS.port}')  # Named before worker_binary starts and fails.
  worker = WorkerProcess(port=FLAGS.port, host=socket.gethostname(),
                         max_concurrent_computation_calls=FLAGS.max_concurrent_computation_calls,
                         log_path=FLAGS.log_file)
  print(f'fltff worker pid {worker.pid} listening on {worker.address} (port {worker.port} on '
        f'all interfaces, PLAINTEXT gRPC, no authentication: --insecure_plaintext); log: '
        f'{worker.log_path}', flush=True)
  try:
    return serve_until_stopped(stop, worker, 'worker_binary')
  finally:
    worker.stop()


def _secure(stop: StopSignal) -> int:
  if not (FLAGS.tls_cert and FLAGS.tls_key and FLAGS.tls_client_ca):
    raise ConfigError('a fltff worker is reached over mutual TLS: pass --tls_cert, --tls_key and '
                      '--tls_client_ca (README, "Running on several machines"), or '
                      '--insecure_plaintext on a trusted network (see --help).')
  credentials = server_credentials(FLAGS.tls_cert, FLAGS.tls_key, FLAGS.tls_client_ca)
  check_can_listen(f'[::]:{FLAGS.port}')  # Before the isolated worker starts (seconds).
  try:
    inner = IsolatedWorker(max_concurrent_computation_calls=FLAGS.max_concurrent_computation_calls,
                           log_path=FLAGS.log_file)
  except RuntimeUnavailableError as e:
    raise ConfigError(f'{e} Or run with --insecure_plaintext behind your own firewall.') from e
  server = None
  try:
    server, port = serve_forwarder(f'[::]:{FLAGS.port}', inner.address, credentials)
    print(f'fltff worker pid {os.getpid()} listening on {socket.gethostname()}:{port} (mutual '
          'TLS; worker_binary isolated in a private network namespace); log: '
          f'{inner.log_path}', flush=True)
    return serve_until_stopped(stop, inner, 'the isolated worker')
  finally:
    if server is not None:
      server.stop(grace=1)
    inner.stop()


def main(argv) -> int:
  del argv
  stop = StopSignal()
  for signum in (signal.SIGTERM, signal.SIGINT):
    signal.signal(signum, lambda *_: stop.set())
  try:
    status = _plaintext(stop) if FLAGS.insecure_plaintext else _secure(stop)
  except FltffError as e:
    print(f'error: {e}', file=sys.stderr, flush=True)
    return 2
  finally:
    release_default_context()
  print('fltff worker stopped', flush=True)
  return status


if __name__ == '__main__':
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
  define_flags()
  from fltff.cli import run_program  # pylint: disable=g-import-not-at-top
  run_program(main)
