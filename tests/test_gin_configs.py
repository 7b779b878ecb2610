"""Every shipped gin file parses against the registered configurables (catches typos)."""

import glob
import os

import gin
import pytest

import fltff

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = sorted(os.path.relpath(p, REPO)
               for p in glob.glob(os.path.join(REPO, 'gin_configs', '**', '*.gin'),
                                  recursive=True))


@pytest.mark.parametrize('path', FILES)
def test_gin_file_parses(path, monkeypatch):
  monkeypatch.chdir(REPO)
  fltff.register_configurables()
  gin.clear_config()
  try:
    gin.parse_config_files_and_bindings([path], [], skip_unknown=False)
    if not path.startswith('gin_configs/base/') and not path.endswith('common.gin'):
      assert gin.query_parameter('experiment.method') is not None
      assert gin.query_parameter('experiment.model')
      assert gin.query_parameter('federated_data.source') is not None
  finally:
    gin.clear_config()


def test_there_are_experiments():
  assert len(FILES) > 40
