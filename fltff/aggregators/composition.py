"""Composing fltff's factories with TFF's aggregation wrappers (docs/methods/index.md).

fltff's factories gather all participants' values in one aggregate (single-pass), so they take
no inner TFF factory (secure sum or DP noise would have to run per client inside them). TFF
wrappers acting on each client's value first (`clipping_factory`, `zeroing_factory`) go *around*
them.
"""

from __future__ import annotations

import tensorflow_federated as tff


class _WithClientStatistics(tff.aggregators.WeightedAggregationFactory):
  """`outer` (a TFF wrapper around `inner`) with `inner`'s `client_statistics`."""

  def __init__(self, outer: tff.aggregators.WeightedAggregationFactory, client_statistics):
    self._outer = outer
    self.client_statistics = tuple(client_statistics)

  def create(self, value_type, weight_type) -> tff.templates.AggregationProcess:
    return self._outer.create(value_type, weight_type)


def with_client_statistics_of(outer: tff.aggregators.WeightedAggregationFactory,
                              inner) -> tff.aggregators.WeightedAggregationFactory:
  """`outer` (a TFF wrapper around the fltff factory `inner`) exposing `inner`'s
  `client_statistics`. E.g. `with_client_statistics_of(tff.aggregators.clipping_factory(1.0,
  ccn), ccn)`."""
  return _WithClientStatistics(outer, getattr(inner, 'client_statistics', ()))
