"""The capacity model of vectorised groups on workers (pipelines/capacity.py) against its
equation, on rounds made from known coefficients."""

import math

import numpy as np
import pytest

from pipelines import capacity

# A driver at 10 ns a byte and 30 ms a worker call; a group of n clients trains in
# 0.2 + 0.05 n s; 1 MB of model, 0.3 MB of examples a client.
TRUE = capacity.Fit(t_0=0.2, t_client=0.05, b_model=1e6, b_client=1.3e6, t_byte=1e-8,
                    t_call=0.03)


def measured(clients: int, model: str = 'cnn2', examples: int = 300) -> capacity.Shape:
  """A shape whose rounds and bytes follow `TRUE` exactly."""
  one = [(TRUE.b_model + clients * (TRUE.b_client - TRUE.b_model), clients * TRUE.b_model)]
  halves = [math.ceil(clients / 2), clients // 2]
  two = [(TRUE.b_model + n * (TRUE.b_client - TRUE.b_model), n * TRUE.b_model) for n in halves]
  return capacity.Shape(model, clients, examples, in_process=TRUE.t_0 + TRUE.t_client * clients,
                        one_worker=TRUE.round_seconds(1, clients),
                        two_workers=TRUE.round_seconds(2, clients), bytes_one=one, bytes_two=two)


def test_round_seconds_is_the_equation():
  # T(W, N) = t_call W + t_byte (W b_model + N b_client) + t_0 + t_client ceil(N/W)
  assert TRUE.round_seconds(3, 10) == pytest.approx(0.09 + 1e-8 * (3e6 + 13e6) + 0.2 + 0.05 * 4)
  assert TRUE.round_seconds(64, 10) == pytest.approx(0.3 + 1e-8 * (10e6 + 13e6) + 0.2 + 0.05)
  assert TRUE.driver_share(1, 10) == pytest.approx(0.17 / (0.17 + 0.7))


def test_fit_recovers_the_coefficients():
  shapes = [measured(n) for n in (10, 20, 40)]
  got = capacity.fit(shapes, capacity.driver_costs(shapes))
  np.testing.assert_allclose(
      [got.t_0, got.t_client, got.b_model, got.b_client, got.t_byte, got.t_call],
      [0.2, 0.05, 1e6, 1.3e6, 1e-8, 0.03], rtol=1e-9)
  # One byte count cannot split calls from bytes: all of it per byte, as before the calls.
  assert capacity.driver_costs(shapes[:1])[0] == 0.0


def test_a_negative_fixed_cost_is_refitted_through_zero():
  # Rounds growing faster than linearly in N: the free line crosses 0 below N = 10.
  shapes = [capacity.Shape('cnn2', n, 300, in_process=s) for n, s in ((10, 0.4), (20, 1.2),
                                                                      (40, 2.8))]
  free = np.polyfit([10, 20, 40], [0.4, 1.2, 2.8], 1)
  assert free[1] < 0
  got = capacity.fit(shapes, (0.0, 0.0))
  clients, seconds = np.array([10.0, 20.0, 40.0]), np.array([0.4, 1.2, 2.8])
  assert got.t_0 == 0.0
  assert got.t_client == pytest.approx(clients @ seconds / (clients @ clients), rel=1e-12)


def test_validation_predicts_each_shape_from_the_others():
  shapes = [measured(10), measured(20), measured(40)]
  rows = capacity.validation(shapes)
  assert [(s.clients, w) for s, w, _, _ in rows] == [(n, w) for n in (10, 20, 40) for w in (1, 2)]
  for _, _, predicted, actual in rows:
    assert predicted == pytest.approx(actual, rel=1e-9)
  # A slower second worker shows as a misprediction, not as a refit.
  slow = capacity.Shape(**{**shapes[1].__dict__, 'two_workers': 2 * shapes[1].two_workers})
  (_, _, predicted, actual), = [r for r in capacity.validation([shapes[0], slow, shapes[2]])
                                if r[1] == 2 and r[0].clients == 20]
  assert actual == pytest.approx(2 * predicted)


def test_driver_bound_from_is_the_first_worker_count_where_bytes_dominate():
  w = TRUE.driver_bound_from(1000)
  brute = [k for k in range(1, 1001)
           if 0.03 * k + 1e-8 * TRUE.round_bytes(k, 1000) >= 0.2 + 0.05 * math.ceil(1000 / k)]
  assert w == brute[0]
  assert capacity.Fit(1.0, 1.0, 1.0, 1.0, 0.0).driver_bound_from(100) is None


def test_a_model_timed_in_process_only_takes_the_drivers_rate():
  alone = capacity.Shape('resnet18', 2, 50, in_process=3.0)
  got = capacity.scaled(TRUE, alone, b_model=44.7e6, b_example=3084.0)
  assert (got.t_0, got.t_client, got.t_byte, got.t_call) == (0.0, 1.5, 1e-8, 0.03)
  # Group means: per worker the model down and the mean up; per client its examples only.
  assert (got.b_model, got.b_client) == (pytest.approx(2 * 44.7e6), pytest.approx(50 * 3084.0))
  assert capacity.example_bytes(TRUE, 300) == pytest.approx(1.3e6 / 300)
  (w, seconds, gb, share), = capacity.projection(got, 1000, (16,))
  assert (w, gb) == (16, pytest.approx((16 * 2 * 44.7e6 + 1000 * got.b_client) / 1e9))
  assert seconds == pytest.approx(got.round_seconds(16, 1000))
  # Each client's model back instead: one model moves from each worker's bytes to each client's.
  each = got.with_client_models(44.7e6)
  assert each.round_bytes(16, 1000) == pytest.approx(16 * 44.7e6 + 1000 * (44.7e6 + 50 * 3084.0))
  assert each.driver_bound_from(1000) <= got.driver_bound_from(1000)
