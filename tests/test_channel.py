"""Wireless channel and system-time model, checked against direct NumPy computations."""

import gin
import numpy as np
import pytest

from fltff.errors import ConfigError
from fltff.simulation import channel
from fltff.simulation.channel import ChannelModel

N0_W_PER_HZ = 10.0 ** ((-174.0 - 30.0) / 10.0)


def watts(dbm):
  return 10.0 ** ((dbm - 30.0) / 10.0)


def fixed_model(bandwidth_mhz=20.0, power_dbm=26.0, distance_m=200.0, num_clients=3, **kwargs):
  """A model whose clients all have the same, given parameters (zero-width ranges)."""
  return ChannelModel(num_clients, bandwidth_mhz=(bandwidth_mhz, bandwidth_mhz),
                      power_dbm=(power_dbm, power_dbm), distance_m=(distance_m, distance_m),
                      **kwargs)


def hand_rate(bandwidth_hz, power_w, distance_m, interference_w, pl_db=-40.0, exponent=4.0):
  gain = 10.0 ** (pl_db / 10.0) * distance_m ** -exponent
  return bandwidth_hz * np.log2(1.0 + power_w * gain / (N0_W_PER_HZ * bandwidth_hz
                                                        + interference_w))


# --- parameters -----------------------------------------------------------------------------
def test_dbm_to_watts():
  np.testing.assert_allclose(channel.dbm_to_watts([30.0, 0.0, 23.0, -174.0]),
                             [1.0, 1e-3, 10 ** -0.7, 10 ** -20.4], rtol=1e-12)


def test_params_are_seeded_draws_in_the_ranges():
  model = ChannelModel(50, seed=7)
  rng = np.random.default_rng(7)
  np.testing.assert_array_equal(model.params.bandwidth_hz, 1e6 * rng.uniform(10, 30, 50))
  np.testing.assert_array_equal(model.params.power_dbm, rng.uniform(23, 30, 50))
  np.testing.assert_array_equal(model.params.distance_m, rng.uniform(100, 500, 50))
  assert np.all((model.params.bandwidth_hz >= 10e6) & (model.params.bandwidth_hz <= 30e6))
  assert np.all((model.params.power_dbm >= 23) & (model.params.power_dbm <= 30))
  assert np.all((model.params.distance_m >= 100) & (model.params.distance_m <= 500))


def test_params_are_deterministic_by_seed():
  a, b, c = ChannelModel(20, seed=3), ChannelModel(20, seed=3), ChannelModel(20, seed=4)
  for field in ('bandwidth_hz', 'power_dbm', 'distance_m'):
    np.testing.assert_array_equal(getattr(a.params, field), getattr(b.params, field))
    assert not np.array_equal(getattr(a.params, field), getattr(c.params, field))
  np.testing.assert_array_equal(a.uplink_rate(np.arange(20)), b.uplink_rate(np.arange(20)))


def test_params_are_read_only():
  model = ChannelModel(4)
  with pytest.raises(ValueError):
    model.params.distance_m[0] = 1.0


def test_gin_binding_reaches_the_model():
  gin.clear_config()
  try:
    gin.parse_config('channel_model.interference_dbm = None\n'
                     'channel_model.distance_m = (250.0, 250.0)')
    model = ChannelModel(2)
  finally:
    gin.clear_config()
  np.testing.assert_array_equal(model.params.distance_m, [250.0, 250.0])
  bandwidth = model.params.bandwidth_hz
  np.testing.assert_allclose(model.uplink_rate([0, 1]),
                             hand_rate(bandwidth, watts(model.params.power_dbm), 250.0, 0.0),
                             rtol=1e-12)


# --- rates ----------------------------------------------------------------------------------
@pytest.mark.parametrize('bandwidth_mhz,power_dbm,distance_m,interference_dbm', [
    (20.0, 26.0, 200.0, -100.0),
    (10.0, 23.0, 500.0, -100.0),
    (30.0, 30.0, 100.0, -90.0),
    (15.0, 25.0, 300.0, None),
])
def test_uplink_rate_matches_hand_formula(bandwidth_mhz, power_dbm, distance_m,
                                          interference_dbm):
  model = fixed_model(bandwidth_mhz, power_dbm, distance_m, interference_dbm=interference_dbm)
  interference_w = 0.0 if interference_dbm is None else watts(interference_dbm)
  expected = hand_rate(bandwidth_mhz * 1e6, watts(power_dbm), distance_m, interference_w)
  np.testing.assert_allclose(model.uplink_rate([0, 2]), [expected, expected], rtol=1e-12)
  np.testing.assert_allclose(model.gain([1]), [1e-4 * distance_m ** -4.0], rtol=1e-12)


def test_uplink_rate_by_hand_numbers():
  # b = 20 MHz, p = 30 dBm = 1 W, d = 100 m: g = 1e-4 * 1e-8 = 1e-12 W/W.
  # Noise N0 b = 10^-20.4 * 2e7 W; I = -100 dBm = 1e-13 W.
  model = fixed_model(20.0, 30.0, 100.0)
  sinr = 1e-12 / (10 ** -20.4 * 2e7 + 1e-13)
  assert model.uplink_rate(1)[0] == pytest.approx(2e7 * np.log2(1 + sinr), rel=1e-12)


def test_path_loss_parameters_enter_the_gain():
  model = fixed_model(20.0, 26.0, 150.0, path_loss_db_at_1m=-30.0, path_loss_exponent=3.0)
  np.testing.assert_allclose(model.gain([0]), [1e-3 * 150.0 ** -3.0], rtol=1e-12)
  expected = hand_rate(2e7, watts(26.0), 150.0, watts(-100.0), pl_db=-30.0, exponent=3.0)
  np.testing.assert_allclose(model.uplink_rate([0]), [expected], rtol=1e-12)


@pytest.mark.parametrize('num_receivers', [1, 2, 5])
def test_downlink_shares_the_server_bandwidth(num_receivers):
  model = fixed_model(distance_m=300.0, num_clients=5)
  clients = np.arange(num_receivers)
  share = 50e6 / num_receivers
  expected = hand_rate(share, watts(30.0), 300.0, watts(-100.0))
  np.testing.assert_allclose(model.downlink_rate(clients), np.full(num_receivers, expected),
                             rtol=1e-12)


def test_downlink_for_two_receivers_uses_half_the_bandwidth():
  model = fixed_model(distance_m=120.0)
  one = model.downlink_rate([0])[0]
  two = model.downlink_rate([0, 1])
  assert one == pytest.approx(hand_rate(50e6, 1.0, 120.0, 1e-13), rel=1e-12)
  np.testing.assert_allclose(two, [hand_rate(25e6, 1.0, 120.0, 1e-13)] * 2, rtol=1e-12)
  assert two[0] < one  # halving the band loses rate, less than half thanks to a better SINR
  assert two[0] > one / 2


def test_downlink_num_receivers_override_and_unshared_band():
  model = fixed_model(distance_m=250.0, num_clients=4)
  np.testing.assert_allclose(model.downlink_rate([3], num_receivers=4),
                             model.downlink_rate([0, 1, 2, 3])[3:], rtol=1e-12)
  unshared = fixed_model(distance_m=250.0, num_clients=4, share_downlink=False)
  full = hand_rate(50e6, 1.0, 250.0, 1e-13)
  np.testing.assert_allclose(unshared.downlink_rate([0, 1, 2, 3]), [full] * 4, rtol=1e-12)
  np.testing.assert_allclose(unshared.downlink_rate([0], num_receivers=3), [full], rtol=1e-12)


def test_server_parameters_enter_the_downlink():
  model = fixed_model(distance_m=200.0, server_bandwidth_mhz=40.0, server_power_dbm=33.0,
                      interference_dbm=None)
  expected = hand_rate(20e6, watts(33.0), 200.0, 0.0)
  np.testing.assert_allclose(model.downlink_rate([0, 1]), [expected] * 2, rtol=1e-12)


def test_rates_follow_the_client_indices():
  model = ChannelModel(10, seed=1)
  up = model.uplink_rate(np.arange(10))
  np.testing.assert_array_equal(model.uplink_rate([7, 2, 7]), up[[7, 2, 7]])
  np.testing.assert_array_equal(model.uplink_rate(np.int64(4)), up[[4]])
  closer = np.argsort(model.params.distance_m)
  down = model.downlink_rate(closer)
  assert np.all(np.diff(down) <= 0)  # same band and power: rate falls with distance
  assert model.uplink_rate([]).shape == (0,)


# --- times ----------------------------------------------------------------------------------
@pytest.mark.parametrize('num_bytes', [0, 1, 1e6, 3.5e7])
def test_times_are_bits_over_rate(num_bytes):
  model = ChannelModel(6, seed=2)
  clients = np.array([0, 3, 5])
  np.testing.assert_allclose(model.upload_seconds(clients, num_bytes),
                             8.0 * num_bytes / model.uplink_rate(clients), rtol=1e-12)
  np.testing.assert_allclose(model.download_seconds(clients, num_bytes),
                             8.0 * num_bytes / model.downlink_rate(clients), rtol=1e-12)


def test_times_scale_linearly_with_bytes():
  model = ChannelModel(8, seed=5)
  clients = np.arange(8)
  one = model.upload_seconds(clients, 1e6)
  np.testing.assert_allclose(model.upload_seconds(clients, 3e6), 3 * one, rtol=1e-12)
  down = model.download_seconds(clients, 2e6)
  np.testing.assert_allclose(model.download_seconds(clients, 5e6), 2.5 * down, rtol=1e-12)


def test_per_client_bytes():
  model = ChannelModel(4, seed=0)
  sizes = np.array([1e5, 2e5, 0.0, 4e5])
  clients = np.arange(4)
  np.testing.assert_allclose(model.upload_seconds(clients, sizes),
                             8 * sizes / model.uplink_rate(clients), rtol=1e-12)
  np.testing.assert_allclose(model.download_seconds(clients, sizes, num_receivers=10),
                             8 * sizes / model.downlink_rate(clients, num_receivers=10),
                             rtol=1e-12)


def test_default_parameters_give_plausible_magnitudes():
  # With the paper's parameters (-40 dB at 1 m, exponent 4) the SINR at 500 m is about -28 to
  # -19 dB, so a 1 MB upload takes up to about 4 minutes at the cell edge; within 200 m it
  # takes under 10 s.
  model = ChannelModel(200, seed=0)
  clients = np.arange(200)
  upload = model.upload_seconds(clients, 1e6)
  assert np.all((upload > 1e-3) & (upload < 300.0))
  near = model.params.distance_m <= 200.0
  assert near.any() and np.all(upload[near] < 10.0)
  up = model.uplink_rate(clients)
  assert np.all((up > 2e4) & (up < 1e8))  # 20 kbit/s to 100 Mbit/s
  down = model.downlink_rate(clients, num_receivers=1)
  assert np.all((down > 2e5) & (down < 2e8))  # 0.2 to 200 Mbit/s with the whole band
  download = model.download_seconds(clients, 1e6, num_receivers=1)
  assert np.all((download > 1e-3) & (download < 30.0))


# --- round time -----------------------------------------------------------------------------
def test_round_time_breakdown_max_formula():
  download = [1.0, 2.0, 0.5]
  compute = [3.0, 1.0, 4.0]
  upload = [0.5, 2.5, 1.0]
  out = channel.round_time_breakdown(download, compute, upload, server_s=0.25)
  assert out == {
      'download_seconds': pytest.approx(3.5 / 3),
      'compute_seconds': pytest.approx(8.0 / 3),
      'upload_seconds': pytest.approx(4.0 / 3),
      'server_seconds': 0.25,
      'round_seconds': pytest.approx(5.5 + 0.25),
      'slowest_client_position': 1,
  }
  totals = np.add(np.add(download, compute), upload)
  assert out['round_seconds'] == pytest.approx(totals.max() + 0.25)


def test_round_time_breakdown_single_client_and_ties():
  out = channel.round_time_breakdown([2.0], [3.0], [1.0], 0.0)
  assert out['round_seconds'] == 6.0 and out['slowest_client_position'] == 0
  out = channel.round_time_breakdown([1.0, 2.0], [2.0, 1.0], [0.0, 0.0], 1.0)
  assert out['round_seconds'] == 4.0 and out['slowest_client_position'] == 0


def test_round_time_breakdown_with_channel_times():
  model = ChannelModel(10, seed=9)
  clients = np.array([1, 4, 6, 8])
  down = model.download_seconds(clients, 2e6)
  up = model.upload_seconds(clients, 2e6)
  compute = np.array([1.0, 2.0, 3.0, 4.0])
  out = channel.round_time_breakdown(down, compute, up, 0.1)
  assert out['round_seconds'] == pytest.approx(np.max(down + compute + up) + 0.1)
  assert out['slowest_client_position'] == int(np.argmax(down + compute + up))
  assert out['upload_seconds'] == pytest.approx(np.mean(up))


@pytest.mark.parametrize('download,compute,upload,server', [
    ([1.0, 2.0], [1.0], [1.0, 1.0], 0.0),
    ([1.0], [1.0], [1.0, 2.0], 0.0),
    ([], [], [], 0.0),
    ([1.0], [-1.0], [1.0], 0.0),
    ([1.0], [1.0], [np.inf], 0.0),
    ([1.0], [1.0], [1.0], -0.5),
    ([[1.0]], [[1.0]], [[1.0]], 0.0),
])
def test_round_time_breakdown_rejects_bad_input(download, compute, upload, server):
  with pytest.raises(ConfigError):
    channel.round_time_breakdown(download, compute, upload, server)


# --- deadlines ------------------------------------------------------------------------------
def test_deadline_epochs_constructed_cases():
  # Room: 10 - 1 - 1 = 8 -> 4 epochs of 2 s exactly; 10 - 3 - 2 = 5 -> 2; 10 - 6 - 5 < 0 -> 0;
  # 10 - 9 - 0.5 = 0.5 -> 0; 10 - 0 - 0 = 10 -> 5 clipped to E = 4.
  download = [1.0, 3.0, 6.0, 9.0, 0.0]
  upload = [1.0, 2.0, 5.0, 0.5, 0.0]
  epochs = channel.deadline_epochs(download, upload, 2.0, epochs=4, deadline_s=10.0)
  np.testing.assert_array_equal(epochs, [4, 2, 0, 0, 4])
  assert epochs.dtype == np.int64
  np.testing.assert_array_equal(
      channel.deadline_epochs(download, upload, 2.0, epochs=10, deadline_s=10.0),
      [4, 2, 0, 0, 5])


def test_deadline_epochs_exact_fit_survives_rounding():
  # (0.7 - 0.1 - 0.3) / 0.1 is 2.9999999999999996 in floating point; on paper it is 3.
  assert (0.7 - 0.1 - 0.3) / 0.1 < 3
  np.testing.assert_array_equal(channel.deadline_epochs([0.1], [0.3], 0.1, 5, 0.7), [3])


def test_deadline_epochs_per_client_seconds_and_no_deadline():
  out = channel.deadline_epochs([0.0, 0.0, 1.0], [0.0, 1.0, 1.0], [1.0, 2.0, 0.5], 6, 9.0)
  np.testing.assert_array_equal(out, [6, 4, 6])  # 9 -> 9 clip 6; 8/2 = 4; 7/0.5 = 14 clip 6
  np.testing.assert_array_equal(
      channel.deadline_epochs([100.0, 0.0], [100.0, 0.0], 1.0, 3, None), [3, 3])


def test_deadline_epochs_from_the_channel():
  model = ChannelModel(30, seed=4)
  clients = np.arange(30)
  down = model.download_seconds(clients, 1e6)
  up = model.upload_seconds(clients, 1e6)
  deadline = float(np.median(down + up)) + 5.0
  out = channel.deadline_epochs(down, up, 1.0, 5, deadline)
  expected = np.clip(np.floor(deadline - down - up), 0, 5)
  np.testing.assert_array_equal(out, expected)
  assert (out == 0).any() and (out == 5).any()


@pytest.mark.parametrize('kwargs', [
    dict(download_s=[1.0, 2.0], upload_s=[1.0]),
    dict(seconds_per_epoch=0.0),
    dict(seconds_per_epoch=[1.0, 2.0, 3.0]),
    dict(epochs=0),
    dict(epochs=2.5),
    dict(deadline_s=0.0),
    dict(deadline_s=-3.0),
    dict(upload_s=[-1.0, 1.0]),
])
def test_deadline_epochs_rejects_bad_input(kwargs):
  args = dict(download_s=[1.0, 2.0], upload_s=[1.0, 1.0], seconds_per_epoch=1.0, epochs=3,
              deadline_s=10.0)
  args.update(kwargs)
  with pytest.raises(ConfigError):
    channel.deadline_epochs(**args)


# --- validation -----------------------------------------------------------------------------
@pytest.mark.parametrize('kwargs', [
    dict(num_clients=0),
    dict(num_clients=-2),
    dict(num_clients=2.5),
    dict(bandwidth_mhz=(30.0, 10.0)),
    dict(bandwidth_mhz=(0.0, 10.0)),
    dict(bandwidth_mhz=(-5.0, 10.0)),
    dict(bandwidth_mhz=(10.0,)),
    dict(power_dbm=(30.0, 23.0)),
    dict(power_dbm=(23.0, np.nan)),
    dict(distance_m=(500.0, 100.0)),
    dict(distance_m=(0.0, 100.0)),
    dict(server_bandwidth_mhz=0.0),
    dict(server_bandwidth_mhz=-50.0),
    dict(path_loss_exponent=0.0),
    dict(noise_dbm_per_hz=np.inf),
    dict(interference_dbm='loud'),
])
def test_model_rejects_bad_parameters(kwargs):
  args = dict(num_clients=4)
  args.update(kwargs)
  with pytest.raises(ConfigError):
    ChannelModel(**args)


def test_model_rejects_bad_calls():
  model = ChannelModel(4)
  with pytest.raises(ConfigError):
    model.upload_seconds([0, 1], -1.0)
  with pytest.raises(ConfigError):
    model.download_seconds([0, 1], [1.0, -1.0])
  with pytest.raises(ConfigError):
    model.upload_seconds([0, 1], [1.0, 2.0, 3.0])
  with pytest.raises(ConfigError):
    model.uplink_rate([0, 4])
  with pytest.raises(ConfigError):
    model.uplink_rate([-1])
  with pytest.raises(ConfigError):
    model.uplink_rate([0.5])
  with pytest.raises(ConfigError):
    model.downlink_rate([0], num_receivers=0)


def test_config_error_message_is_one_sentence():
  with pytest.raises(ConfigError, match=r'^channel_model\.bandwidth_mhz must have low <= high'):
    ChannelModel(3, bandwidth_mhz=(30.0, 10.0))
