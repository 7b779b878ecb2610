"""Encrypted, authenticated access to a TFF worker with gRPC's TLS (no cryptography of ours).

TFF's `worker_binary` executes any TensorFlow graph it is sent (which can read and write files
on its host), speaks plaintext gRPC on all interfaces and has no TLS or bind-address option.
A fltff worker therefore runs it in an unprivileged network namespace of its own (`unshare
--user --net`: only a private loopback) behind a TLS terminator:

    driver ──mTLS (gRPC's TLS: client certificate required)──▶ forwarder on <host>:<port>
      ──▶ Unix socket (file mode 0600) ──▶ forwarder inside the namespace ──▶ worker_binary

`serve_forwarder` is that terminator: a gRPC server (BoringSSL) relaying every RPC byte for
byte; clients without a certificate signed by the worker's client CA fail the TLS handshake.
"""

from __future__ import annotations

from typing import Optional

import grpc

from fltff.errors import ConfigError


def _read(path: str, what: str) -> bytes:
  try:
    with open(path, 'rb') as f:
      return f.read()
  except OSError as e:
    raise ConfigError(f'Cannot read the {what} {path}: {e.strerror}.') from None


def server_credentials(cert_file: str, key_file: str,
                       client_ca_file: str) -> grpc.ServerCredentials:
  """mTLS server credentials, requiring client certificates signed by `client_ca_file`."""
  return grpc.ssl_server_credentials(
      [(_read(key_file, 'TLS key'), _read(cert_file, 'TLS certificate'))],
      root_certificates=_read(client_ca_file, 'client CA certificate'),
      require_client_auth=True)


def channel_credentials(ca_file: str, cert_file: str,
                        key_file: str) -> grpc.ChannelCredentials:
  """mTLS client credentials: trust `ca_file` for the worker; present our certificate."""
  return grpc.ssl_channel_credentials(
      root_certificates=_read(ca_file, 'CA certificate'),
      private_key=_read(key_file, 'TLS key'),
      certificate_chain=_read(cert_file, 'TLS certificate'))


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
_MESSAGE_OPTIONS = [('grpc.max_send_message_length', -1),
                    ('grpc.max_receive_message_length', -1)]


def serve_forwarder(listen: str, upstream: str,
                    credentials: Optional[grpc.ServerCredentials] = None,
                    max_workers: int = 16) -> tuple[grpc.Server, int]:
  """Starts a server on `listen` (TLS with `credentials`) relaying every RPC to `upstream`
  (plaintext: a Unix socket or loopback address); returns it and its port (0 for a Unix
  socket), or raises `ConfigError` if it cannot listen."""
  from concurrent import futures  # pylint: disable=g-import-not-at-top

  channel = grpc.insecure_channel(upstream, options=_MESSAGE_OPTIONS)
  # gRPC binds with SO_REUSEPORT by default: a second worker on a port in use would share it
  # silently instead of failing.
  server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                       handlers=[_Relay(channel)],
                       options=_MESSAGE_OPTIONS + [('grpc.so_reuseport', 0)])
  try:
    if credentials is None:
      port = server.add_insecure_port(listen)
    else:
      port = server.add_secure_port(listen, credentials)
  except RuntimeError:  # gRPC's "Failed to bind to address".
    port = 0
  if not listen.startswith('unix:') and port == 0:
    pair = '' if credentials is None else ', or --tls_cert and --tls_key are not one pair'
    raise ConfigError(f'Cannot listen on {listen} (port in use or not allowed{pair}).')
  server.start()
  return server, port
