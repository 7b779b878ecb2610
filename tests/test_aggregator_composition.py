"""TFF's aggregation wrappers around fltff's builders and factories (issue 13): zeroing and
clipping around the weighted mean and around CCN, and TFF's DP factory as a whole aggregator."""

import numpy as np
import tensorflow_federated as tff

from fltff import aggregators
from fltff import learning
from test_ccn import SPEC
from test_ccn import _diff
from test_ccn import _opt
from test_ccn import _run

SIZES = (10, 20, 30)


def _fedavg(**kwargs):
  return _run(learning.build_fedavg(SPEC, client_optimizer=_opt(), **kwargs), sizes=SIZES)


def test_zeroing_and_clipping_around_the_mean_act_only_when_they_should():
  plain, _ = _fedavg()
  loose = tff.aggregators.zeroing_factory(1e6, tff.aggregators.clipping_factory(
      1e6, tff.aggregators.MeanFactory()))
  same, metrics = _fedavg(model_aggregator=loose)
  assert _diff(same, plain) <= 1e-6
  assert 'zeroing' in str(metrics['aggregator'])
  tight, _ = _fedavg(model_aggregator=tff.aggregators.clipping_factory(
      1e-3, tff.aggregators.MeanFactory()))
  assert _diff(tight, plain) > 1e-4
  start = SPEC.initial_weights().trainable
  # Each update's norm is clipped to 1e-3, so two rounds move the model by at most 2e-3.
  moved = np.sqrt(sum(np.sum((np.asarray(a) - b) ** 2) for a, b in zip(tight, start)))
  assert moved <= 2e-3 + 1e-6


def test_clipping_around_ccn_keeps_ccns_client_statistics():
  ccn = aggregators.contribution_normalization_factory(0.05)
  reference, _ = _fedavg(model_aggregator=ccn)
  wrapped = aggregators.with_client_statistics_of(tff.aggregators.clipping_factory(1e6, ccn),
                                                  ccn)
  assert [s.name for s in wrapped.client_statistics] == ['client_index', 'latent_mean']
  clipped, metrics = _fedavg(model_aggregator=wrapped)
  assert _diff(clipped, reference) <= 1e-6
  assert 'contribution' in str(metrics['aggregator'])


def test_dp_factory_without_noise_is_the_unweighted_mean():
  """TFF's DP aggregator (unweighted) as the model aggregator: with no noise and a clip no
  update reaches, it is FedAvg with the unweighted mean (client_weighting='uniform')."""
  dp = tff.aggregators.DifferentiallyPrivateFactory.gaussian_fixed(
      noise_multiplier=0.0, clients_per_round=len(SIZES), clip=1e6)
  private, _ = _fedavg(model_aggregator=dp)
  uniform, _ = _fedavg(client_weighting='uniform')
  weighted, _ = _fedavg()
  assert _diff(private, uniform) <= 1e-5
  assert _diff(private, weighted) > 1e-4
