"""Local regularisers (pure TF functions plus the `LocalRegularizer` objects that use them)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import tensorflow as tf

from fltff.learning.client_work import LocalRegularizer
from fltff.learning.client_work import RegularizerTraits


def proximal_penalty(local: Sequence[tf.Tensor], global_: Sequence[tf.Tensor],
                     mu: float) -> tf.Tensor:
  """FedProx's proximal term `μ/2 ||w − w^t||²` (Li et al., MLSys 2020, eq. (2)).

  Its gradient `μ (w − w^t)` pulls towards the global model; TFF 0.87's `proximal_client_work`
  adds `μ (w^t − w)`, the opposite sign."""
  return 0.5 * mu * tf.add_n(
      [tf.reduce_sum(tf.square(w - g)) for w, g in zip(local, global_)])


class ProximalRegularizer(LocalRegularizer):
  """`LocalRegularizer` `μ/2 Σ_t m_t ||w_t − a_t||²` with no per-epoch context; errors name μ
  `setting`, the parameter a user sets (`fedprox.mu`).

  FedProx: the anchor `a` is the round's global model, every `m_t = 1`. KAPC (client
  objective `λ Σ_l ||w^l − s_i^l||²`): μ = 2λ, the anchor is the client's personalised server
  model s_i, and `m_t = 0` drops the tensors of layers BLS did not send (`tensor_mask`).
  """

  def __init__(self, mu: float, anchor: Optional[Sequence[tf.Tensor]] = None,
               tensor_mask: Optional[Sequence[tf.Tensor]] = None, setting: str = 'mu'):
    from fltff.config_checks import check_number  # pylint: disable=g-import-not-at-top
    check_number(setting, mu, low=0)
    self.mu = float(mu)
    self.anchor = None if anchor is None else tuple(anchor)
    # Per-tensor coefficients μ m_t, formed once (not at every local step).
    self._coefficients = None if tensor_mask is None else tuple(self.mu * m for m in tensor_mask)

  def penalty(self, local, global_, context):
    del context
    anchor = self.offset_anchor(global_)
    if self._coefficients is None:
      return proximal_penalty(local, anchor, self.mu)
    return 0.5 * tf.add_n([c * tf.reduce_sum(tf.square(w - a)) for w, a, c in
                           zip(local, anchor, self._coefficients)])

  def gradient(self, local, global_, context):
    """∂/∂w of the penalty: `μ m_t (w_t − a_t)`."""
    del context
    anchor = self.offset_anchor(global_)
    coefficients = self._coefficients or (self.mu,) * len(anchor)
    return [c * (w - a) for w, a, c in zip(local, anchor, coefficients)]

  @property
  def traits(self) -> RegularizerTraits:
    """Closed-form, affine gradient with one scale μ m_t per tensor (dense kernels may train
    factored), anchored at the global model or at `anchor` (`offset_anchor`)."""
    return RegularizerTraits(analytic=True, affine=True, global_anchor=self.anchor is None,
                             own_anchor=True, per_tensor_scales=True)

  def offset_anchor(self, global_):
    """The anchor `a` of `affine_gradient`'s offsets `−c_t a_t`, so vectorised clients with own
    anchors (KAPC's s_i) add `c ⊙ (w − a)` without forming them (`stacked_optimizer.Anchor`)."""
    return global_ if self.anchor is None else self.anchor

  def affine_gradient(self, global_, context):
    """The gradient as `c_t w_t + (−c_t a_t)`, c_t = μ m_t (see `LocalRegularizer`)."""
    del context
    anchor = self.offset_anchor(global_)
    coefficients = self._coefficients or (self.mu,) * len(anchor)
    return list(coefficients), [-c * a for c, a in zip(coefficients, anchor)]
