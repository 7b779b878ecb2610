"""Composing fltff's factories with TFF's aggregation wrappers.

fltff's factories gather all participants' values in one aggregate (single-pass), so they take
no inner TFF factory (secure sum or DP noise would have to run per client inside them). TFF
wrappers acting on each client's value first (`clipping_factory`, `zeroing_factory`) go *around*
them; `with_weight_fields_of` keeps the inner factory's `weight_fields` visible on the wrapper,
so the learning builders still send them. TFF's unweighted factories (e.g.
`DifferentiallyPrivateFactory`) go to the builders directly (`build_algorithm` makes them
weighted, ignoring ν, as TFF's `build_weighted_fed_avg` does).
"""

from __future__ import annotations

import tensorflow_federated as tff


class _WithWeightFields(tff.aggregators.WeightedAggregationFactory):
  """`outer` (a TFF wrapper around `inner`) with `inner`'s `weight_fields`."""

  def __init__(self, outer: tff.aggregators.WeightedAggregationFactory, weight_fields):
    self._outer = outer
    self.weight_fields = tuple(weight_fields)

  def create(self, value_type, weight_type) -> tff.templates.AggregationProcess:
    return self._outer.create(value_type, weight_type)


def with_weight_fields_of(outer: tff.aggregators.WeightedAggregationFactory,
                          inner) -> tff.aggregators.WeightedAggregationFactory:
  """`outer` (a TFF wrapper around the fltff factory `inner`) exposing `inner`'s `weight_fields`.

  E.g. `with_weight_fields_of(tff.aggregators.clipping_factory(1.0, ccn), ccn)`."""
  return _WithWeightFields(outer, getattr(inner, 'weight_fields', ()))
