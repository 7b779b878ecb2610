"""Simulation: the experiment wiring, the round drivers, sampling, evaluation, checkpoints.

`run_experiment` (gin `experiment`, `experiment.py`) wires data → model → method → driver;
`RoundDriver` (`driver.py`) runs every method through `fltff.learning.protocol`; per-client
state lives in its one `ClientStateStore`.
"""

from fltff.simulation.channel import ChannelModel
from fltff.simulation.checkpoint import Checkpointer
from fltff.simulation.driver import RoundConfig
from fltff.simulation.driver import RoundDriver
from fltff.simulation.evaluation import Evaluator
from fltff.simulation.experiment import build_model_spec
from fltff.simulation.experiment import run_experiment
from fltff.simulation.state_store import ClientStateStore

__all__ = [
    'ChannelModel',
    'Checkpointer',
    'ClientStateStore',
    'Evaluator',
    'RoundConfig',
    'RoundDriver',
    'build_model_spec',
    'run_experiment',
]
