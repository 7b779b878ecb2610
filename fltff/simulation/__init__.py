"""Round driver: sampling, evaluation, metrics, checkpoints, per-client state store."""

from fltff.simulation.channel import ChannelModel
from fltff.simulation.checkpoint import Checkpointer
from fltff.simulation.driver import RoundConfig
from fltff.simulation.driver import RoundDriver
from fltff.simulation.driver import build_model_spec
from fltff.simulation.driver import run_experiment
from fltff.simulation.evaluation import Evaluator
from fltff.simulation.state_store import ClientStateStore
