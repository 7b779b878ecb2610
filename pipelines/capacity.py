"""A capacity model of vectorised client groups on TFF workers, fitted to `fltff bench --runtimes`.

A round of N participants on W workers trains one group of ⌈N/W⌉ clients per worker
(`fltff.learning.groups`). The model:

  T(W, N) = t_call · W + t_byte · B(W, N) + t_0 + t_client · ⌈N/W⌉

- `B(W, N) = W · b_model + N · b_client`: tensor bytes to and from all workers in a round. Per
  worker the global model down and, for a method whose updates go to a plain weighted mean
  (FedAvg's), the group's mean update up; per client its examples down and, for any other
  method, its trained model up (`Fit.with_client_models`). The driver serialises, sends,
  receives and merges them one worker after another, so this term does not shrink with W.
- `t_0 + t_client · n`: one group of n clients trained on one worker; fitted to the same round
  vectorised in process on one core, as a worker has, where no byte leaves the driver (the
  aggregation on the driver is counted here, once per round: at FedAvg's cost it is small next
  to training).
- `t_call`, `t_byte`: the driver's seconds per worker call (TFF's dispatch, values created
  and results merged, whatever their size) and per byte on the wire; the least-squares line of
  (the round on 1 worker − the same round in process) on the 1-worker bytes over the measured
  shapes.

The workers run their groups at once (TFF's mergeable context: one sub-round per worker), so the
round's compute shrinks with W while the driver's share grows with W and N: the driver becomes
the limit from the W where `t_call · W + t_byte · B(W, N)` exceeds `t_0 + t_client · ⌈N/W⌉`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Shape:
  """One measured shape: N clients of `examples` each; the median round seconds in process
  (`in_process`), on 1 and on 2 workers (None: not timed), and the bytes to and from each
  worker on 1 worker (`[(down, up)]`) and on 2 workers."""
  model: str
  clients: int
  examples: int
  in_process: float
  one_worker: Optional[float] = None
  two_workers: Optional[float] = None
  bytes_one: Sequence[tuple[int, int]] = ()
  bytes_two: Sequence[tuple[int, int]] = ()


@dataclasses.dataclass(frozen=True)
class Fit:
  """The model's coefficients for one model and client size (`t_call`, `t_byte`: the driver's,
  shared)."""
  t_0: float
  t_client: float
  b_model: float
  b_client: float
  t_byte: float
  t_call: float = 0.0

  def round_bytes(self, workers: int, clients: int) -> float:
    """B(W, N); at most one group (and global model) per client."""
    return min(workers, clients) * self.b_model + clients * self.b_client

  def driver_seconds(self, workers: int, clients: int) -> float:
    """The driver's calls and bytes of a round: t_call · W + t_byte · B(W, N)."""
    return (self.t_call * min(workers, clients)
            + self.t_byte * self.round_bytes(workers, clients))

  def round_seconds(self, workers: int, clients: int) -> float:
    """T(W, N): the driver's calls and bytes plus the largest group's training."""
    group = math.ceil(clients / max(1, min(workers, clients)))
    return self.driver_seconds(workers, clients) + self.t_0 + self.t_client * group

  def driver_share(self, workers: int, clients: int) -> float:
    """The fraction of T(W, N) the driver's calls and bytes take."""
    return self.driver_seconds(workers, clients) / self.round_seconds(workers, clients)

  def with_client_models(self, model_bytes: float) -> 'Fit':
    """This fit (of group means) for a method that needs each client's trained model back:
    `model_bytes` moves from each worker's bytes to each client's."""
    return dataclasses.replace(self, b_model=self.b_model - model_bytes,
                               b_client=self.b_client + model_bytes)

  def driver_bound_from(self, clients: int, most: int = 1 << 20) -> Optional[int]:
    """The fewest workers at which the driver's calls and bytes take longer than a group's
    training."""
    for w in range(1, min(clients, most) + 1):
      group = math.ceil(clients / w)
      if self.driver_seconds(w, clients) >= self.t_0 + self.t_client * group:
        return w
    return None


def driver_costs(shapes: Sequence[Shape]) -> tuple[float, float]:
  """`(t_call, t_byte)`: the least-squares line of (1 worker − in process) seconds on the
  1-worker bytes, neither negative; through 0 (t_call = 0) from a single byte count."""
  pairs = [(s.one_worker - s.in_process, sum(d + u for d, u in s.bytes_one))
           for s in shapes if s.one_worker is not None and s.bytes_one]
  if not pairs:
    raise ValueError('the capacity model needs at least one shape timed on 1 worker')
  extra, sent = np.array(pairs, dtype=np.float64).T
  if len(set(sent)) > 1:
    t_byte, t_call = np.polyfit(sent, extra, 1)
    if t_call >= 0 and t_byte >= 0:
      return float(t_call), float(t_byte)
    if t_byte < 0:  # Bytes too few to tell from the calls: all of it per call.
      return max(0.0, float(np.mean(extra))), 0.0
  return 0.0, max(0.0, float(extra @ sent / (sent @ sent)))


def per_client_bytes(shape: Shape) -> tuple[float, float]:
  """`(b_model, b_client)` of a shape, from its bytes on 1 and on 2 workers: what the second
  worker adds is per worker; the rest is per client."""
  one = sum(d + u for d, u in shape.bytes_one)
  if not shape.bytes_two:
    raise ValueError(f'{shape.model}:{shape.clients}x{shape.examples} has no 2-worker bytes')
  b_model = sum(d + u for d, u in shape.bytes_two) - one
  return float(b_model), (one - b_model) / shape.clients


def fit(shapes: Sequence[Shape], driver: tuple[float, float]) -> Fit:
  """The model for shapes of one model and client size (their in-process rounds give the
  group's training: the least-squares line in the number of clients, through 0 for one size),
  with the driver's `(t_call, t_byte)` (`driver_costs`)."""
  clients = np.array([s.clients for s in shapes], dtype=np.float64)
  seconds = np.array([s.in_process for s in shapes])
  t_client, t_0 = (np.polyfit(clients, seconds, 1) if len(set(clients)) > 1
                    else (float(np.mean(seconds / clients)), 0.0))
  if t_client < 0:  # Timing noise over sizes too close to tell: a constant round.
    t_client, t_0 = 0.0, float(np.mean(seconds))
  elif t_0 < 0:  # A round cannot cost less than nothing: the least-squares line through 0.
    t_client, t_0 = float(clients @ seconds / (clients @ clients)), 0.0
  measured = [s for s in shapes if s.bytes_two]
  b_model, b_client = (np.mean([per_client_bytes(s) for s in measured], axis=0)
                       if measured else (0.0, 0.0))
  return Fit(float(t_0), float(t_client), float(b_model), float(b_client), driver[1], driver[0])


def validation(shapes: Sequence[Shape]) -> list[tuple[Shape, int, float, float]]:
  """`(shape, workers, predicted, measured)` for each shape's 1- and 2-worker rounds. Each
  1-worker prediction takes the driver's costs from the other shapes (alone: from itself); the
  2-worker predictions from all of them."""
  rows = []
  for s in shapes:
    same = [o for o in shapes if (o.model, o.examples) == (s.model, s.examples)]
    others = [o for o in shapes if o is not s] or [s]
    for workers, measured in ((1, s.one_worker), (2, s.two_workers)):
      if measured is None or not s.bytes_two:
        continue
      driver = driver_costs(others if workers == 1 else shapes)
      rows.append((s, workers, fit(same, driver).round_seconds(workers, s.clients), measured))
  return rows


def example_bytes(base: Fit, examples: int) -> float:
  """Bytes on the wire per example of `base`'s clients (`examples` each; a fit of group
  means, whose client bytes are its examples)."""
  return base.b_client / examples


def scaled(base: Fit, in_process: Shape, b_model: float, b_example: float) -> Fit:
  """The model of group means for another model timed in process only (`in_process`: its
  round of N clients, through 0), with `base`'s driver costs, its own model bytes
  (`b_model`: the global model down and the group's mean up per worker) and bytes per example
  (`b_example`)."""
  return Fit(0.0, in_process.in_process / in_process.clients, 2 * b_model,
             in_process.examples * b_example, base.t_byte, base.t_call)


def projection(fit_: Fit, clients: int = 1000, workers: Sequence[int] = (4, 16, 64)
               ) -> list[tuple[int, float, float, float]]:
  """`(W, round seconds, GB on the wire, driver share)` of a round of `clients` participants."""
  return [(w, fit_.round_seconds(w, clients), fit_.round_bytes(w, clients) / 1e9,
           fit_.driver_share(w, clients)) for w in workers]
