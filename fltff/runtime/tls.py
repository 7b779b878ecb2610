"""Encrypted, authenticated access to a TFF worker with gRPC's TLS (no cryptography of ours;
docs/multiple-machines.md, "Security"):

    driver ──mTLS (gRPC's TLS: client certificate required)──▶ forwarder on <host>:<port>
      ──▶ Unix socket (file mode 0600) ──▶ forwarder inside the namespace ──▶ worker_binary

`serve_forwarder` is that terminator, relaying every RPC byte for byte.
"""

from __future__ import annotations

import errno
import socket
import ssl
from typing import Optional

import grpc

from fltff.errors import ConfigError


def read_tls_files(cert: tuple[str, str], key: tuple[str, str],
                   ca: tuple[str, str]) -> list[bytes]:
  """The contents of `cert`, `key` and `ca` (each a `(setting, path)`); `ConfigError` naming the
  setting unless `cert` holds a PEM certificate, `key` its unencrypted PEM private key and `ca`
  a PEM CA certificate: checked with Python's `ssl` before gRPC sees them (gRPC logs its own
  lines and says only that it cannot listen or connect)."""
  contents = []
  for (name, path), what in ((cert, 'certificate'), (key, 'private key'),
                             (ca, 'CA certificate')):
    try:
      with open(path, 'rb') as f:
        contents.append(f.read())
    except OSError as e:
      raise ConfigError(f'Cannot read the {what} ({name}) {path}: {e.strerror}.') from None
  context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
  for (name, path), what in ((cert, 'a PEM certificate'), (ca, 'a PEM CA certificate')):
    try:
      context.load_verify_locations(cafile=path)
    except ssl.SSLError:
      raise ConfigError(f'{name} {path} is not {what}.') from None
  try:
    # A password callback: an encrypted key fails here instead of prompting on the terminal.
    context.load_cert_chain(cert[1], key[1], password=lambda: b'')
  except ssl.SSLError as e:
    if e.reason == 'KEY_VALUES_MISMATCH':
      raise ConfigError(f'{key[0]} {key[1]} is not the private key of {cert[0]} {cert[1]}: '
                        'pass the key the certificate was issued for.') from None
    raise ConfigError(f'{key[0]} {key[1]} is not an unencrypted PEM private key.') from None
  return contents


def server_credentials(cert_file: str, key_file: str,
                       client_ca_file: str) -> grpc.ServerCredentials:
  """mTLS server credentials, requiring client certificates signed by `client_ca_file`; the
  files are the worker's `--tls_cert`, `--tls_key`, `--tls_client_ca` (`read_tls_files`)."""
  cert, key, ca = read_tls_files(('--tls_cert', cert_file), ('--tls_key', key_file),
                                 ('--tls_client_ca', client_ca_file))
  return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                     require_client_auth=True)


def channel_credentials(ca_file: str, cert_file: str,
                        key_file: str) -> grpc.ChannelCredentials:
  """mTLS client credentials: trust `ca_file` for the worker; present our certificate (the
  driver's `runtime.tls_*` files, `read_tls_files`)."""
  cert, key, ca = read_tls_files(('runtime.tls_cert_file', cert_file),
                                 ('runtime.tls_key_file', key_file),
                                 ('runtime.tls_ca_file', ca_file))
  return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                      certificate_chain=cert)


def check_can_listen(listen: str) -> None:
  """Raises `ConfigError` unless this process can listen on `listen` (`host:port`, `[::]:port`)
  now: bound and closed at once, as gRPC binds (SO_REUSEADDR, not SO_REUSEPORT), so a port in
  use is named as such before gRPC (or `worker_binary`) logs its own failure."""
  host, _, port = listen.rpartition(':')
  host = host.strip('[]')
  if not port.isdigit() or int(port) == 0:
    return  # Any free port.
  try:
    infos = [(family, address) for family, _, _, _, address in socket.getaddrinfo(
        host or None, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)]
  except socket.gaierror as e:
    raise ConfigError(f'Cannot listen on {listen}: {e.strerror}.') from None
  if host in ('', '::'):  # gRPC falls back to IPv4 on a host without IPv6.
    infos.append((socket.AF_INET, ('0.0.0.0', int(port))))
  error = None
  for family, address in infos:
    try:
      with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(address)
        return
    except OSError as e:
      if e.errno in (errno.EADDRINUSE, errno.EACCES):
        error = e
        break
      error = error or e  # E.g. no IPv6 on this host: the next address may do.
  if error.errno == errno.EADDRINUSE:
    reason = f'port {port} is in use (another program listens there); choose another --port'
  elif error.errno == errno.EACCES:
    reason = f'port {port} needs privileges this user lacks; choose a port above 1023'
  else:
    reason = error.strerror or str(error)
  raise ConfigError(f'Cannot listen on {listen}: {reason}.')


class _Relay(grpc.GenericRpcHandler):
  """Relays every method, unary ones too, to `channel` as a bidirectional raw-bytes stream."""

  def __init__(self, channel: grpc.Channel):
    self._channel = channel

  def service(self, handler_call_details):
    method = handler_call_details.method
    upstream = self._channel.stream_stream(method)  # Bytes in, bytes out.

    def relay(request_iterator, context):
      metadata = [(k, v) for k, v in context.invocation_metadata()
                  if not k.startswith(':') and k not in ('user-agent', 'te', 'content-type')]
      call = upstream(_until_cancelled(request_iterator), metadata=metadata or None)
      # A caller that goes away (a driver killed mid-round) cancels the upstream call too.
      context.add_callback(call.cancel)
      try:
        yield from call
      except grpc.RpcError as e:
        if context.is_active():
          context.abort(e.code(), e.details() or '')

    return grpc.stream_stream_rpc_method_handler(relay)


def _until_cancelled(request_iterator):
  """The caller's messages, ending quietly when the caller cancels or goes away (the
  `RpcError` would be logged upstream as "Exception iterating requests!", with a traceback)."""
  try:
    yield from request_iterator
  except grpc.RpcError:
    return


# TFF sends whole computations and values in single messages.
MESSAGE_OPTIONS = [('grpc.max_send_message_length', -1),
                    ('grpc.max_receive_message_length', -1)]


def serve_forwarder(listen: str, upstream: str,
                    credentials: Optional[grpc.ServerCredentials] = None,
                    max_workers: int = 16) -> tuple[grpc.Server, int]:
  """Starts a server on `listen` (TLS with `credentials`) relaying every RPC to `upstream`
  (plaintext: a Unix socket or loopback address); returns it and its port (0 for a Unix
  socket), or raises `ConfigError` if it cannot listen."""
  from concurrent import futures  # pylint: disable=g-import-not-at-top

  channel = grpc.insecure_channel(upstream, options=MESSAGE_OPTIONS)
  # gRPC binds with SO_REUSEPORT by default: a second worker on a port in use would share it
  # silently instead of failing.
  server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                       handlers=[_Relay(channel)],
                       options=MESSAGE_OPTIONS + [('grpc.so_reuseport', 0)])
  if not listen.startswith('unix:'):
    check_can_listen(listen)
  try:
    if credentials is None:
      port = server.add_insecure_port(listen)
    else:
      port = server.add_secure_port(listen, credentials)
  except RuntimeError:  # gRPC's "Failed to bind to address".
    port = 0
  if not listen.startswith('unix:') and port == 0:
    # Checked just above: another program took the port since, or gRPC refused the address.
    raise ConfigError(f'Cannot listen on {listen} (gRPC could not bind it; is the port still '
                      'free?).')
  server.start()
  return server, port
