"""Remote workers are secure by default (issue 15): mutual TLS in front of a worker_binary
isolated in a private network namespace. On loopback: an authorised driver trains and gets
the local runtime's metrics; clients without a certificate, with one from another CA, or in
plaintext are refused; worker_binary is in another network namespace; the unsafe mode needs
`--insecure_plaintext` on both sides.

Certificates are made here with the `cryptography` package (X.509 generation only; the TLS
itself is gRPC's).
"""

import datetime
import ipaddress
import os
import socket
import subprocess
import sys
import time

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from helpers import REPO
from helpers import assert_one_line_error
from helpers import read_csv
from helpers import pipeline_env
from helpers import run_pipeline
from helpers import tagged_worker_pids
from launcher import run_program
from test_remote import FEDAVG
from test_remote import Worker


def _key():
  return ec.generate_private_key(ec.SECP256R1())


def _cert(subject, key, issuer=None, issuer_key=None, ca=False, server=False):
  now = datetime.datetime.now(datetime.timezone.utc)
  builder = (x509.CertificateBuilder()
             .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
             .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer or subject)]))
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
  if server:
    builder = builder.add_extension(x509.SubjectAlternativeName(
        [x509.DNSName('localhost'), x509.IPAddress(ipaddress.ip_address('127.0.0.1'))]),
                                    critical=False)
  return builder.sign(issuer_key or key, hashes.SHA256())


def _write(folder, name, cert, key=None):
  with open(os.path.join(folder, f'{name}.pem'), 'wb') as f:
    f.write(cert.public_bytes(serialization.Encoding.PEM))
  if key is not None:
    with open(os.path.join(folder, f'{name}.key'), 'wb') as f:
      f.write(key.private_bytes(serialization.Encoding.PEM,
                                serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption()))


@pytest.fixture(scope='module')
def pki(tmp_path_factory):
  """A CA for the workers, one for the drivers, their certificates, and a rogue CA's client."""
  folder = str(tmp_path_factory.mktemp('tls'))
  made = {}
  for ca in ('workers-ca', 'drivers-ca', 'rogue-ca'):
    key = _key()
    made[ca] = (_cert(ca, key, ca=True), key)
    _write(folder, ca, made[ca][0])
  for name, ca, server in (('worker', 'workers-ca', True), ('driver', 'drivers-ca', False),
                           ('rogue', 'rogue-ca', False)):
    key = _key()
    _write(folder, name, _cert(name, key, ca, made[ca][1], server=server), key)
  with open(os.path.join(folder, 'garbage.pem'), 'w') as f:
    f.write('-----BEGIN CERTIFICATE-----\nnot base64!\n-----END CERTIFICATE-----\n')
  return lambda name: os.path.join(folder, name)


def SecureWorker(pki):  # pylint: disable=invalid-name
  """`python -m fltff.runtime.worker` with mutual TLS (the default mode)."""
  w = Worker(f'--tls_cert={pki("worker.pem")}', f'--tls_key={pki("worker.key")}',
             f'--tls_client_ca={pki("drivers-ca.pem")}')
  assert 'mutual TLS' in w.line, w.line
  return w


@pytest.fixture(scope='module')
def worker(pki):
  w = SecureWorker(pki)
  yield w
  w.stop()
  deadline = time.monotonic() + 10
  while tagged_worker_pids() and time.monotonic() < deadline:
    time.sleep(0.1)
  assert not tagged_worker_pids(), 'a worker_binary outlived the secure worker'


def _tls_bindings(pki, worker):
  return [f"--gin_bindings=runtime.workers = ['{worker.address}']",
          f"--gin_bindings=runtime.tls_ca_file = '{pki('workers-ca.pem')}'",
          f"--gin_bindings=runtime.tls_cert_file = '{pki('driver.pem')}'",
          f"--gin_bindings=runtime.tls_key_file = '{pki('driver.key')}'"]


def test_authorised_driver_trains_and_matches_the_local_runtime(pki, worker, small_run,
                                                               tmp_path):
  remote = run_pipeline(*FEDAVG, *_tls_bindings(pki, worker), f'--output_dir={tmp_path}')
  assert remote.returncode == 0, remote.stderr[-3000:]
  rows, reference = (read_csv(os.path.join(d, 'metrics.csv')) for d in (tmp_path, small_run[0]))
  assert len(rows) == len(reference) == 3
  for a, b in zip(rows, reference):
    for key in ('train_loss', 'test_accuracy', 'test_loss'):
      assert float(a[key]) == pytest.approx(float(b[key]), rel=1e-5, abs=1e-6)


def _probe(channel) -> grpc.StatusCode:
  """The status of one RPC (any method: the TLS handshake comes first)."""
  try:
    channel.unary_unary('/tensorflow_federated.v0.ExecutorGroup/GetExecutor')(b'', timeout=5)
  except grpc.RpcError as e:
    return e.code()
  return grpc.StatusCode.OK


def _read(path):
  with open(path, 'rb') as f:
    return f.read()


@pytest.mark.parametrize('client', ['no certificate', 'rogue certificate', 'plaintext'])
def test_unauthorised_clients_are_refused(client, pki, worker):
  ca = _read(pki('workers-ca.pem'))
  if client == 'plaintext':
    channel = grpc.insecure_channel(worker.address)
  elif client == 'no certificate':
    channel = grpc.secure_channel(worker.address, grpc.ssl_channel_credentials(ca))
  else:
    channel = grpc.secure_channel(worker.address, grpc.ssl_channel_credentials(
        ca, _read(pki('rogue.key')), _read(pki('rogue.pem'))))
  with channel:
    assert _probe(channel) == grpc.StatusCode.UNAVAILABLE
  # The authorised credentials get through the handshake (to the worker's own answer). Tried
  # up to 3 times: on a loaded 2-core machine the relay's hop to worker_binary was once
  # transiently UNAVAILABLE (CI, with other jobs running); a refusal is not transient.
  with grpc.secure_channel(worker.address, grpc.ssl_channel_credentials(
      ca, _read(pki('driver.key')), _read(pki('driver.pem')))) as channel:
    codes = []
    for _ in range(3):
      codes.append(_probe(channel))
      if codes[-1] != grpc.StatusCode.UNAVAILABLE:
        break
      time.sleep(1.0)
    assert codes[-1] != grpc.StatusCode.UNAVAILABLE, codes


def test_worker_binary_lives_in_another_network_namespace(worker):
  """Nothing outside can reach worker_binary: its only network is a private loopback."""
  mine = os.readlink('/proc/self/ns/net')
  found = []
  for pid in tagged_worker_pids():
    found.append(os.readlink(f'/proc/{pid}/ns/net'))
  assert found and all(ns != mine for ns in found), (mine, found)


def test_worker_without_tls_or_insecure_flag_is_one_line():
  result = run_program('fltff.runtime.worker', '--port=1', timeout=120)
  line = assert_one_line_error(result, '--tls_cert', '--insecure_plaintext')
  assert 'mutual TLS' in line


def test_driver_without_tls_settings_is_one_line(tmp_path):
  result = run_pipeline(*FEDAVG, "--gin_bindings=runtime.workers = ['127.0.0.1:9']",
                        f'--output_dir={tmp_path}')
  assert_one_line_error(result, 'runtime.tls_ca_file', 'runtime.insecure_plaintext')


def test_a_second_forwarder_on_a_port_in_use_is_refused():
  # gRPC's default SO_REUSEPORT would let a second worker share the port and say it listens.
  import portpicker  # pylint: disable=g-import-not-at-top

  from fltff.errors import ConfigError  # pylint: disable=g-import-not-at-top
  from fltff.runtime.tls import serve_forwarder  # pylint: disable=g-import-not-at-top

  port = portpicker.pick_unused_port()
  first, _ = serve_forwarder(f'[::]:{port}', '127.0.0.1:9')
  try:
    with pytest.raises(ConfigError,
                       match=f'Cannot listen on \\[::\\]:{port}: port {port} is in use'):
      serve_forwarder(f'[::]:{port}', '127.0.0.1:9')
  finally:
    first.stop(grace=None)


def test_a_key_that_is_not_the_certificates_is_one_clear_refusal(pki):
  from fltff.errors import ConfigError  # pylint: disable=g-import-not-at-top
  from fltff.runtime.tls import server_credentials  # pylint: disable=g-import-not-at-top

  # Checked with Python's ssl before gRPC sees the files (gRPC would log its own lines).
  with pytest.raises(ConfigError, match='--tls_key .*driver.key is not the private key of '
                                        '--tls_cert .*worker.pem'):
    server_credentials(pki('worker.pem'), pki('driver.key'), pki('drivers-ca.pem'))


def test_a_driver_that_goes_away_mid_call_leaves_no_traceback_in_the_relay(caplog):
  # A driver killed during a round cancels its streams; the relay must end its upstream call
  # quietly instead of logging gRPC's "Exception iterating requests!" with a traceback.
  import threading  # pylint: disable=g-import-not-at-top
  from concurrent import futures  # pylint: disable=g-import-not-at-top

  from fltff.runtime.tls import serve_forwarder  # pylint: disable=g-import-not-at-top

  release = threading.Event()

  def slow_echo(request_iterator, context):
    del context
    for request in request_iterator:
      release.wait(10)
      yield request

  upstream = grpc.server(futures.ThreadPoolExecutor(max_workers=4), handlers=[
      grpc.method_handlers_generic_handler('echo.Echo', {
          'Chat': grpc.stream_stream_rpc_method_handler(slow_echo)})])
  upstream_port = upstream.add_insecure_port('127.0.0.1:0')
  upstream.start()
  relay, port = serve_forwarder('127.0.0.1:0', f'127.0.0.1:{upstream_port}')  # Started.
  started = threading.Event()

  def requests():
    yield b'x'
    started.set()
    release.wait(10)  # The driver never sends its next message: it is killed first.

  caplog.set_level('DEBUG')
  try:
    with grpc.insecure_channel(f'127.0.0.1:{port}') as channel:
      call = channel.stream_stream('/echo.Echo/Chat')(requests())
      assert started.wait(10)
      time.sleep(0.3)
      call.cancel()
      time.sleep(1.0)
  finally:
    release.set()
    time.sleep(0.5)
    relay.stop(grace=None)
    upstream.stop(grace=None)
  noise = [r for r in caplog.records if 'iterating requests' in r.getMessage()
           or (r.exc_info and r.levelname in ('ERROR', 'CRITICAL'))]
  assert not noise, [r.getMessage() for r in noise]


def _alone(result, *fragments) -> str:
  """The one `error:` line (`assert_one_line_error`), with nothing before or after it on stderr
  (no `E1129 ...` line of gRPC's C core)."""
  line = assert_one_line_error(result, *fragments)
  assert result.stderr.strip() == line, result.stderr[-3000:]
  return line


@pytest.mark.parametrize('cert,key,client_ca,message', [
    ('worker.pem', 'driver.key', 'drivers-ca.pem', 'is not the private key of --tls_cert'),
    ('garbage.pem', 'worker.key', 'drivers-ca.pem', 'garbage.pem is not a PEM certificate'),
    ('worker.pem', 'garbage.pem', 'drivers-ca.pem', 'garbage.pem is not an unencrypted PEM '
                                                    'private key'),
    ('worker.pem', 'worker.key', 'garbage.pem', 'garbage.pem is not a PEM CA certificate'),
])
def test_a_worker_with_bad_tls_files_says_which_in_one_line_alone(cert, key, client_ca, message,
                                                                  pki):
  result = run_program('fltff.runtime.worker', '--port=0', f'--tls_cert={pki(cert)}',
                       f'--tls_key={pki(key)}', f'--tls_client_ca={pki(client_ca)}',
                       timeout=120)
  line = _alone(result, message)
  assert 'port in use' not in line


@pytest.mark.parametrize('mode', ['mutual TLS', 'plaintext'])
def test_a_worker_on_a_port_in_use_is_one_line_alone(mode, pki):
  with socket.create_server(('', 0)) as taken:  # Listens on every interface, as a worker would.
    port = taken.getsockname()[1]
    tls = (['--insecure_plaintext'] if mode == 'plaintext' else
           [f'--tls_cert={pki("worker.pem")}', f'--tls_key={pki("worker.key")}',
            f'--tls_client_ca={pki("drivers-ca.pem")}'])
    result = run_program('fltff.runtime.worker', f'--port={port}', *tls, timeout=120)
  _alone(result, f'port {port} is in use')


@pytest.mark.parametrize('port', ['99999', '65536', '-1'])
def test_a_worker_port_out_of_range_is_one_line(port):
  # A port over 65535 used to be wrapped (99999 listened on 34463) without a word.
  result = run_program('fltff.runtime.worker', f'--port={port}', '--insecure_plaintext',
                       timeout=60)
  _alone(result, f'--port={port}', 'from 1 to 65535 (0: any free port)')


def _connect(pki, address, tmp_path, *bindings):
  """A run against `address` (connect_timeout 120 s): its result and seconds taken."""
  start = time.monotonic()
  result = run_pipeline(*FEDAVG, f"--gin_bindings=runtime.workers = ['{address}']",
                        '--gin_bindings=runtime.connect_timeout = 120', *bindings,
                        f'--output_dir={tmp_path}')
  return result, time.monotonic() - start


@pytest.mark.parametrize('client,message', [
    ('untrusted CA', "its certificate is not signed by runtime.tls_ca_file's CA"),
    ('rogue certificate', "it refused this driver's certificate"),
    ('plaintext', 'it expects mutual TLS'),
])
def test_a_driver_the_worker_refuses_is_told_why_at_once(client, message, pki, worker,
                                                         tmp_path):
  """Not after `runtime.connect_timeout` as a worker that "did not answer": gRPC's status
  names the failed handshake at the first attempt."""
  files = {'untrusted CA': ('rogue-ca.pem', 'driver.pem', 'driver.key'),
           'rogue certificate': ('workers-ca.pem', 'rogue.pem', 'rogue.key')}.get(client)
  bindings = (['--gin_bindings=runtime.insecure_plaintext = True'] if files is None else
              [f"--gin_bindings=runtime.tls_{name}_file = '{pki(path)}'"
               for name, path in zip(('ca', 'cert', 'key'), files)])
  result, seconds = _connect(pki, worker.address, tmp_path, *bindings)
  _alone(result, f'TFF worker at {worker.address}', message)
  assert seconds < 60, seconds


# A library user's driver, not `fltff run`'s: the runtime's error alone, printed.
_LIBRARY_DRIVER = """
import os, sys
from fltff import runtime
print(os.environ.get('GRPC_VERBOSITY'))  # Importing sets nothing.
try:
  runtime.make_runtime(workers=[{address!r}], tls_ca_file={ca!r}, tls_cert_file={cert!r},
                       tls_key_file={key!r})
except Exception as e:  # pylint: disable=broad-except
  print(str(e).splitlines()[0], file=sys.stderr)  # Without gin's 'In call to configurable'.
"""


@pytest.mark.parametrize('verbosity', [None, 'ERROR'])
def test_a_library_driver_the_worker_refuses_sees_grpcs_log_only_if_it_asks(verbosity, pki,
                                                                            worker):
  script = _LIBRARY_DRIVER.format(address=worker.address, ca=pki('rogue-ca.pem'),
                                  cert=pki('driver.pem'), key=pki('driver.key'))
  env = {k: v for k, v in pipeline_env().items() if k != 'GRPC_VERBOSITY'}
  result = subprocess.run([sys.executable, '-c', script], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env=dict(env, **(
                              {'GRPC_VERBOSITY': verbosity} if verbosity else {})))
  assert result.stdout == f'{verbosity}\n', result.stderr[-3000:]
  error = f"TFF worker at {worker.address} failed the TLS handshake: its certificate is not signed"
  assert result.stderr.splitlines()[-1].startswith(error), result.stderr[-3000:]
  # gRPC's own line on the failed handshake, `E1129 ... Handshake failed ...`, only if asked.
  assert ('Handshake failed' in result.stderr) == bool(verbosity), result.stderr[-3000:]
  if not verbosity:
    assert len(result.stderr.splitlines()) == 1, result.stderr[-3000:]


def test_a_tls_driver_on_a_plaintext_worker_is_told_so_at_once(pki, tmp_path):
  plaintext = Worker()
  try:
    result, seconds = _connect(pki, plaintext.address, tmp_path,
                               *_tls_bindings(pki, plaintext)[1:])
  finally:
    plaintext.stop()
  _alone(result, 'does not speak TLS', '--insecure_plaintext')
  assert seconds < 60, seconds
