"""Wireless channel and system-time model of a synchronous FL round (pure NumPy).

Follows the KAPC paper's simulation setting (IEEE TMC 2024, Table 4), turning the bytes a
client downloads and uploads into seconds for rounds reported as in its Table 5 (download,
computation, upload, server and round time). Assumptions, formulas and the magnitudes of the
defaults: "System model" in docs/methods/personalised.md.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union

import gin
import numpy as np

from fltff.config_checks import check_number
from fltff.errors import ConfigError

ArrayLike = Union[float, int, Sequence[float], np.ndarray]

# Relative slack when counting the whole epochs that fit into a deadline, so that a fit that is
# exact on paper (e.g. (0.7 - 0.1 - 0.3) / 0.1 = 3) is not lost to floating-point rounding.
_EPOCH_FIT_SLACK = 1e-9


def dbm_to_watts(dbm: ArrayLike) -> np.ndarray:
  """Converts a power in dBm to watts: 10^((dBm - 30) / 10)."""
  return np.power(10.0, (np.asarray(dbm, dtype=np.float64) - 30.0) / 10.0)


@dataclasses.dataclass(frozen=True)
class ChannelParams:
  """Per-client parameters, one entry per client: uplink bandwidth b_i in Hz, transmit power
  p_i in dBm, distance d_i to the server in metres."""
  bandwidth_hz: np.ndarray
  power_dbm: np.ndarray
  distance_m: np.ndarray


def _check_range(name: str, value: Sequence[float], positive: bool) -> tuple[float, float]:
  """Returns `value` as a (low, high) pair of floats, or raises ConfigError."""
  try:
    low, high = (float(v) for v in value)
  except (TypeError, ValueError):
    raise ConfigError(f'channel_model.{name} must be (low, high) numbers, got {value!r}.') from None
  for bound in (low, high):
    check_number(f'channel_model.{name}', bound, low=0 if positive else None, open_low=True)
  if low > high:
    raise ConfigError(f'channel_model.{name} must have low <= high, got {value!r}.')
  return low, high


def _per_client(name: str, values: ArrayLike, count: Optional[int] = None,
                positive: bool = False) -> np.ndarray:
  """A scalar or one value per client (`count` None: a 1-D array, one per client) as `[count]`
  floats, finite and >= 0 (> 0 if `positive`), or ConfigError."""
  array = np.asarray(values, dtype=np.float64)
  if count is None and array.ndim != 1:
    raise ConfigError(f'{name} must be a 1-D array with one entry per client, '
                      f'got shape {array.shape}.')
  count = len(array) if count is None else count
  if array.ndim > 1 or (array.ndim == 1 and array.shape[0] != count):
    raise ConfigError(f'{name} must be a scalar or one value per client ({count}), '
                      f'got shape {array.shape}.')
  if np.any(~np.isfinite(array)) or np.any(array <= 0 if positive else array < 0):
    raise ConfigError(f'{name} must be finite and {"positive" if positive else "non-negative"}'
                      f', got {values!r}.')
  return np.broadcast_to(array, (count,))


@gin.configurable('channel_model')
class ChannelModel:
  """Rates and transfer times of `num_clients` (N) clients with `params` drawn from `seed`."""

  def __init__(self,
               num_clients: int,
               seed: int = 0,
               bandwidth_mhz: Sequence[float] = (10.0, 30.0),
               power_dbm: Sequence[float] = (23.0, 30.0),
               distance_m: Sequence[float] = (100.0, 500.0),
               server_bandwidth_mhz: float = 50.0,
               server_power_dbm: float = 30.0,
               path_loss_db_at_1m: float = -40.0,
               path_loss_exponent: float = 4.0,
               noise_dbm_per_hz: float = -174.0,
               interference_dbm: Optional[float] = -100.0,
               share_downlink: bool = True):
    """Draws each client's bandwidth, power and distance uniformly from its (low, high) range;
    the server's B_s and P_s, path loss PL at 1 m and exponent, noise N0, interference I (None:
    none) and `share_downlink` (B_s split among a round's receivers) as in docs/methods/
    personalised.md, "System model". `ConfigError` for a parameter out of range."""
    check_number('channel_model.num_clients', num_clients, integer=True, low=1)
    bandwidth = _check_range('bandwidth_mhz', bandwidth_mhz, positive=True)
    power = _check_range('power_dbm', power_dbm, positive=False)
    distance = _check_range('distance_m', distance_m, positive=True)
    for name, value, low in (('server_bandwidth_mhz', server_bandwidth_mhz, 0),
                             ('server_power_dbm', server_power_dbm, None),
                             ('path_loss_db_at_1m', path_loss_db_at_1m, None),
                             ('path_loss_exponent', path_loss_exponent, 0),
                             ('noise_dbm_per_hz', noise_dbm_per_hz, None),
                             ('interference_dbm', interference_dbm, None)):
      check_number(f'channel_model.{name}', value, allow_none=name == 'interference_dbm',
                   low=low, open_low=True)
    self._server_bandwidth_hz = 1e6 * float(server_bandwidth_mhz)
    self._server_power_w = float(dbm_to_watts(server_power_dbm))
    self._noise_w_per_hz = float(dbm_to_watts(noise_dbm_per_hz))
    self._interference_w = (0.0 if interference_dbm is None else
                            float(dbm_to_watts(interference_dbm)))
    self._share_downlink = bool(share_downlink)
    self.num_clients = int(num_clients)

    rng = np.random.default_rng(seed)
    self.params = ChannelParams(
        bandwidth_hz=1e6 * rng.uniform(*bandwidth, size=self.num_clients),
        power_dbm=rng.uniform(*power, size=self.num_clients),
        distance_m=rng.uniform(*distance, size=self.num_clients))
    for field in dataclasses.fields(self.params):
      getattr(self.params, field.name).setflags(write=False)
    self._gain = (10.0 ** (float(path_loss_db_at_1m) / 10.0)
                  * self.params.distance_m ** (-float(path_loss_exponent)))

  def _indices(self, clients: ArrayLike) -> np.ndarray:
    """`clients` as a 1-D integer index array, checked against the number of clients."""
    indices = np.asarray(clients)
    if indices.ndim == 0:
      indices = indices.reshape(1)
    if indices.ndim != 1 or (indices.size and not np.issubdtype(indices.dtype, np.integer)):
      raise ConfigError(f'Client indices must be a 1-D sequence of integers, got {clients!r}.')
    if indices.size and (indices.min() < 0 or indices.max() >= self.num_clients):
      raise ConfigError(f'Client indices must be in [0, {self.num_clients}), got '
                        f'{indices.min()}..{indices.max()}.')
    return indices.astype(np.int64)

  def gain(self, clients: ArrayLike) -> np.ndarray:
    """Linear channel gains g_i = 10^(PL/10) * d_i^(-exponent) of the given clients."""
    return self._gain[self._indices(clients)]

  def uplink_rate(self, clients: ArrayLike) -> np.ndarray:
    """Uplink rates b_i log2(1 + p_i g_i / (N0 b_i + I)) of the given clients, in bit/s."""
    indices = self._indices(clients)
    bandwidth = self.params.bandwidth_hz[indices]
    power = dbm_to_watts(self.params.power_dbm[indices])
    sinr = power * self._gain[indices] / (self._noise_w_per_hz * bandwidth
                                          + self._interference_w)
    return bandwidth * np.log2(1.0 + sinr)

  def downlink_rate(self, clients: ArrayLike,
                    num_receivers: Optional[int] = None) -> np.ndarray:
    """Downlink rates (B_s/K) log2(1 + P_s g_i / (N0 B_s/K + I)) of the given clients, in bit/s;
    K = `num_receivers` (default `len(clients)`; 1 with `share_downlink=False`)."""
    indices = self._indices(clients)
    check_number('num_receivers', num_receivers, integer=True, low=1, allow_none=True)
    if num_receivers is None:
      num_receivers = max(len(indices), 1)
    shares = num_receivers if self._share_downlink else 1
    bandwidth = self._server_bandwidth_hz / shares
    sinr = self._server_power_w * self._gain[indices] / (self._noise_w_per_hz * bandwidth
                                                        + self._interference_w)
    return bandwidth * np.log2(1.0 + sinr)

  def upload_seconds(self, clients: ArrayLike, bytes_up: ArrayLike) -> np.ndarray:
    """Seconds 8 * bytes_up_i / r_up_i to upload `bytes_up` (scalar or per client)."""
    rate = self.uplink_rate(clients)
    return 8.0 * _per_client('bytes_up', bytes_up, len(rate)) / rate

  def download_seconds(self, clients: ArrayLike, bytes_down: ArrayLike,
                       num_receivers: Optional[int] = None) -> np.ndarray:
    """Seconds 8 * bytes_down_i / r_down_i to download `bytes_down` (scalar or per client);
    `num_receivers` as in `downlink_rate`."""
    rate = self.downlink_rate(clients, num_receivers)
    return 8.0 * _per_client('bytes_down', bytes_down, len(rate)) / rate


def round_time_breakdown(download_s: ArrayLike, compute_s: ArrayLike, upload_s: ArrayLike,
                         server_s: float) -> dict:
  """Time figures of a synchronous round from per-participant seconds (KAPC paper, Table 5):
  the participants' mean 'download_seconds', 'compute_seconds' and 'upload_seconds',
  'server_seconds', 'round_seconds' = max_i(download_i + compute_i + upload_i) + server_s and
  'slowest_client_position' (the first on ties). `ConfigError` for inputs empty, of different
  lengths, negative or not finite."""
  download = _per_client('download_s', download_s)
  compute = _per_client('compute_s', compute_s)
  upload = _per_client('upload_s', upload_s)
  if not len(download) == len(compute) == len(upload):
    raise ConfigError(f'download_s, compute_s and upload_s must have one entry per client '
                      f'each, got lengths {len(download)}, {len(compute)} and {len(upload)}.')
  if not len(download):
    raise ConfigError('round_time_breakdown needs at least one client.')
  check_number('server_s', server_s, low=0)
  server = float(server_s)
  total = download + compute + upload
  slowest = int(np.argmax(total))
  return {
      'download_seconds': float(np.mean(download)),
      'compute_seconds': float(np.mean(compute)),
      'upload_seconds': float(np.mean(upload)),
      'server_seconds': server,
      'round_seconds': float(total[slowest]) + server,
      'slowest_client_position': slowest,
  }


def deadline_epochs(download_s: ArrayLike, upload_s: ArrayLike, seconds_per_epoch: ArrayLike,
                    epochs: int, deadline_s: Optional[float]) -> np.ndarray:
  """Whole local epochs (int64) each client completes within `deadline_s` (None: `epochs`):
  floor((deadline - download - upload) / seconds_per_epoch) clipped to [0, epochs], 0 dropping
  the client. `ConfigError` for lengths that differ or a value out of range."""
  download = _per_client('download_s', download_s)
  upload = _per_client('upload_s', upload_s)
  if len(download) != len(upload):
    raise ConfigError(f'download_s and upload_s must have one entry per client each, got '
                      f'lengths {len(download)} and {len(upload)}.')
  per_epoch = _per_client('seconds_per_epoch', seconds_per_epoch, len(download), positive=True)
  check_number('epochs', epochs, integer=True, low=1)
  check_number('deadline_s', deadline_s, allow_none=True, low=0, open_low=True)
  if deadline_s is None:
    return np.full(len(download), int(epochs), dtype=np.int64)
  fit = np.floor((float(deadline_s) - download - upload) / per_epoch * (1.0 + _EPOCH_FIT_SLACK))
  # A negative room times (1 + slack) only gets more negative, so the clip handles it.
  return np.clip(fit, 0, epochs).astype(np.int64)
