"""The optional PyTorch reference of the executors bench (`pipelines/torch_reference.py`).

torch is never a dependency of fltff: these tests run where it is importable (the README says
how) and are skipped, with that reason, elsewhere.
"""

import re

import numpy as np
import pytest

torch = pytest.importorskip('torch', reason='the PyTorch reference is optional: torch is not '
                            'importable here')

from fltff.models import build_model  # pylint: disable=g-import-not-at-top,wrong-import-position
from helpers import run_program_here  # pylint: disable=g-import-not-at-top,wrong-import-position
from pipelines import torch_reference  # pylint: disable=g-import-not-at-top,wrong-import-position


@pytest.mark.parametrize('name', ['mlp2', 'cnn2', 'resnet18'])
def test_the_models_have_the_zoos_parameter_counts(name):
  c, h, w = torch_reference.input_shape(name)
  keras = build_model(name, input_shape=(h, w, c), num_classes=10, seed=0)
  trainable = sum(int(np.prod(v.shape)) for v in keras.trainable_variables)
  assert torch_reference.parameter_count(torch_reference.build_model(name)) == trainable


def test_both_client_loops_compute_the_same_fedavg_round():
  # One batch per client (examples == batch): the batch order cannot matter, so the loop over
  # device tensors and the DataLoader + deepcopy loop must give the same global model.
  data = torch_reference.client_data('mlp2', clients=3, examples=8)
  rounds = {s: torch_reference.FedAvgRound('mlp2', data, s, 'cpu', batch=8, epochs=2)
            for s in torch_reference.STYLES}
  before = [p.detach().clone() for p in rounds['torch_loop'].global_model.parameters()]
  for run in rounds.values():
    assert run(0) > 0
  loop, pfllib = (list(r.global_model.parameters()) for r in rounds.values())
  for a, b, start in zip(loop, pfllib, before):
    np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=0, atol=1e-6)
    assert not torch.equal(a, start)  # The round trained.


def test_the_executors_bench_adds_the_pytorch_columns_where_torch_imports():
  result = run_program_here('pipelines.bench', '--executors', '--executor_shapes=mlp2:2x20',
                            '--executor_variants=one_model_floor', '--executor_methods=',
                            '--rounds=2')
  assert result.returncode == 0, result.stderr[-3000:]
  assert re.search(r'tff_builtin\s+one_model_floor\s+torch_loop\s+torch_pfllib\n',
                   result.stdout), result.stdout
  assert re.search(r'mlp2 2x20(\s+\d+\.\d+ s \(\s*\d+\.\d{3}x\)){4}', result.stdout), (
      result.stdout)
