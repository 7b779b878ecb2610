"""Centralised evaluation of the global model, in the driver process (no TFF round-trip)."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from fltff.data.pipeline import preprocess_batch


class Evaluator:
  """Loss and accuracy of `ModelWeights` on fixed arrays, with one compiled Keras model."""

  def __init__(self, model_spec, batch_size: int = 1000):
    self.model = model_spec.keras_fn()
    self.loss_fn = model_spec.loss()
    self.batch_size = batch_size

    @tf.function
    def batch_stats(x, y):
      logits = self.model(x, training=False)
      loss = self.loss_fn(y, logits) * tf.cast(tf.shape(y)[0], tf.float32)
      correct = tf.reduce_sum(
          tf.cast(tf.equal(tf.argmax(logits, axis=-1, output_type=tf.int32), y), tf.float32))
      return loss, correct

    self._batch_stats = batch_stats

  def set_weights(self, model_weights) -> None:
    """Loads `ModelWeights` or a dict with 'trainable' and 'non_trainable' lists."""
    if isinstance(model_weights, dict):
      trainable, non_trainable = model_weights['trainable'], model_weights['non_trainable']
    else:
      trainable, non_trainable = model_weights.trainable, model_weights.non_trainable
    for var, value in zip(self.model.trainable_weights, trainable):
      var.assign(value)
    for var, value in zip(self.model.non_trainable_weights, non_trainable):
      var.assign(value)

  def evaluate(self, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
    total_loss, total_correct = 0.0, 0.0
    for start in range(0, len(x), self.batch_size):
      batch = preprocess_batch({'x': tf.constant(x[start:start + self.batch_size]),
                                'y': tf.constant(y[start:start + self.batch_size])})
      loss, correct = self._batch_stats(batch['x'], batch['y'])
      total_loss += float(loss)
      total_correct += float(correct)
    n = max(len(x), 1)
    return {'loss': total_loss / n, 'accuracy': total_correct / n}
