"""Stragglers (system heterogeneity: random or by a round deadline on the channel) and FedLap
personalisation, unit and end to end."""

import json
import os
from typing import Optional

import numpy as np
import pytest
import tensorflow_federated as tff

from fltff import learning
from fltff.errors import ConfigError
from fltff.learning import optimizers
from fltff.personalization import mix_layers
from fltff.personalization import mixing_coefficients
from fltff.personalization import layer_dissimilarities
from fltff.simulation import ChannelModel
from fltff.simulation import RoundConfig
from fltff.simulation import RoundDriver
from fltff.simulation import build_model_spec
from fltff.simulation import sampling
from helpers import mnist_sample_split
from helpers import read_csv
from helpers import run_and_resume
from helpers import run_pipeline_here

BASE = ['--gin_file=gin_configs/fedlap/offline_mnist1003_fedlap.gin',
        '--gin_bindings=experiment.rounds = 3', '--gin_bindings=experiment.local_epochs = 3',
        '--gin_bindings=experiment.checkpoint_every = 1']


# --- straggler plan -------------------------------------------------------------------------
def test_straggler_plan_partial_is_seeded_and_in_range():
  clients = np.arange(20)
  epochs, dropped = sampling.straggler_plan(clients, 10, 0.5, 'partial', seed=3, round_num=7)
  again, _ = sampling.straggler_plan(clients, 10, 0.5, 'partial', seed=3, round_num=7)
  assert epochs == again and not dropped
  reduced = [k for k, e in epochs.items() if e < 10]
  assert 1 <= len(reduced) <= 10 and all(1 <= e <= 10 for e in epochs.values())
  other, _ = sampling.straggler_plan(clients, 10, 0.5, 'partial', seed=3, round_num=8)
  assert other != epochs
  assert sampling.straggler_plan(clients, 10, 0.0, 'partial', 3, 7) == (
      {k: 10 for k in range(20)}, set())


def test_straggler_plan_drop_keeps_one_participant():
  epochs, dropped = sampling.straggler_plan(np.arange(10), 5, 0.9, 'drop', 0, 1)
  assert len(dropped) == 9 and set(epochs.values()) == {5}
  _, dropped = sampling.straggler_plan(np.arange(2), 5, 1.0, 'drop', 0, 1)
  assert len(dropped) == 1


@pytest.mark.parametrize('fraction,mode', [(-0.1, 'partial'), (1.5, 'drop'), (0.5, 'slow')])
def test_bad_straggler_settings_are_refused(fraction, mode):
  with pytest.raises(ConfigError, match='experiment.straggler_'):
    RoundConfig(local_epochs=2, straggler_fraction=fraction, straggler_mode=mode)


# --- deadline stragglers: the round driver on a channel ----------------------------------
# Six clients of 55-378 examples at 50-150 m: transfers of FedAvg's mlp2 take 0.1-0.6 s, and
# an epoch takes 0.06-0.38 s at DEADLINE_SECONDS_PER_EXAMPLE.
DEADLINE_CLIENTS = 6
DEADLINE_EPOCHS = 3
DEADLINE_SECONDS_PER_EXAMPLE = 1e-3


@pytest.fixture(scope='module')
def deadline_data():
  return mnist_sample_split(DEADLINE_CLIENTS, seed=5, local_test_examples=10)


def deadline_driver(data, output_dir, deadline: Optional[float], clients_per_round: int,
                    seed: int = 0, rounds: int = 2, **settings) -> RoundDriver:
  """Vectorised FedAvg with E = DEADLINE_EPOCHS under `experiment.round_deadline = deadline`
  (and the other `experiment` `settings`)."""
  spec = build_model_spec(data, 'mlp2', seed=0)
  algorithm = learning.build_fedavg(spec, client_optimizer=optimizers.sgdm(learning_rate=0.05))
  config = RoundConfig(rounds=rounds, clients_per_round=clients_per_round,
                       local_epochs=DEADLINE_EPOCHS, batch_size=16, seed=seed,
                       round_deadline=deadline,
                       compute_seconds_per_example=DEADLINE_SECONDS_PER_EXAMPLE, **settings)
  channel = ChannelModel(DEADLINE_CLIENTS, seed=0, distance_m=(50.0, 150.0))
  return RoundDriver(algorithm.with_vectorized_clients(), data, config, str(output_dir),
                     progress=lambda _: None, channel=channel)


def deadline_plan(driver, round_num: int) -> tuple[np.ndarray, np.ndarray]:
  """`(sampled clients, epochs)` in NumPy: floor((deadline - download - upload) / (n_k × s))
  clipped to [0, E], the download of every sampled client sharing the server's band."""
  config = driver.config
  sampled = sampling.sample_clients(DEADLINE_CLIENTS, config.clients_per_round, config.seed,
                                    round_num)
  sizes = np.asarray([len(driver.data.train_indices[k]) for k in sampled], np.float64)
  room = (config.round_deadline
          - driver.channel.download_seconds(sampled, driver.algorithm.bytes_down_per_client)
          - driver.channel.upload_seconds(sampled, driver.algorithm.bytes_up_per_client))
  epochs = np.floor(room / (sizes * DEADLINE_SECONDS_PER_EXAMPLE))
  return sampled, np.clip(epochs, 0, DEADLINE_EPOCHS).astype(np.int64)


def test_a_round_deadline_sets_each_clients_epochs_and_drops_the_late(deadline_data, tmp_path,
                                                                      in_process):
  """Each sampled client trains the whole epochs that fit the deadline after its transfers and
  one with none is dropped: the clients aggregated, the examples trained (Σ e_k n_k), the bytes
  (a dropped client's download included), the `stragglers`/`dropped` columns and the simulated
  times of each round (the plan's: downloads sharing the band among every sampled client,
  e_k n_k × the compute model, no participant past the deadline), and the summary, against
  NumPy."""
  del in_process
  driver = deadline_driver(deadline_data, tmp_path, deadline=0.7, clients_per_round=4)
  summary = driver.run()
  bytes_down = driver.algorithm.bytes_down_per_client
  bytes_up = driver.algorithm.bytes_up_per_client
  rows = read_csv(tmp_path / 'metrics.csv')
  with open(tmp_path / 'measurements.jsonl') as f:
    records = [json.loads(line) for line in f]
  assert [int(r['round']) for r in rows] == [r['round'] for r in records] == [1, 2]
  all_epochs, examples, sim_time = [], [], 0.0
  for row, record in zip(rows, records):
    sampled, epochs = deadline_plan(driver, int(row['round']))
    sizes = np.asarray([len(deadline_data.train_indices[k]) for k in sampled])
    participants = sampled[epochs > 0].tolist()
    # The round's clients, as the algorithm returned them (evaluated with the new global model).
    assert record['eval/global_local/clients'] == participants
    assert int(row['clients']) == len(participants)
    assert int(row['dropped']) == np.sum(epochs == 0)
    assert int(row['stragglers']) == np.sum((epochs > 0) & (epochs < DEADLINE_EPOCHS))
    assert int(row['examples']) == np.sum(epochs * sizes)
    assert int(row['bytes_down']) == len(sampled) * bytes_down
    assert int(row['bytes_up']) == len(participants) * bytes_up
    trained = epochs > 0
    # The server's 50 MHz at 30 dBm (1 W) shared by every sampled client, -174 dBm/Hz noise,
    # -100 dBm interference (docs/methods/personalised.md, "System model").
    band = 50e6 / len(sampled)
    download = 8 * bytes_down / (band * np.log2(
        1 + driver.channel.gain(sampled) / (10 ** -20.4 * band + 1e-13)))
    compute = epochs * sizes * DEADLINE_SECONDS_PER_EXAMPLE
    upload = driver.channel.upload_seconds(sampled, bytes_up)
    client_seconds = (download + compute + upload)[trained]
    assert np.all(client_seconds <= driver.config.round_deadline * (1 + 1e-9))
    expected = {'sim_download_seconds': np.mean(download),
                'sim_compute_seconds': np.mean(compute[trained]),
                'sim_upload_seconds': np.mean(upload[trained]), 'sim_server_seconds': 0.0,
                'sim_round_seconds': np.max(client_seconds),
                'sim_time_cumulative': sim_time + np.max(client_seconds)}
    for column, value in expected.items():
      assert float(row[column]) == pytest.approx(value, rel=1e-12, abs=1e-15), column
    sim_time = float(row['sim_time_cumulative'])
    all_epochs.extend(epochs)
    examples.append(int(np.sum(epochs * sizes)))
  # The deadline bites: some clients train all E epochs, some fewer, some none.
  assert {0, DEADLINE_EPOCHS} < set(all_epochs) <= set(range(DEADLINE_EPOCHS + 1))
  assert summary['rounds_completed'] == 2
  assert summary['examples_processed'] == sum(examples)
  assert summary['bytes_up_per_round'] == [int(r['bytes_up']) for r in rows]
  assert summary['sim_time_total'] == sim_time


def test_dropped_stragglers_downloaded_and_measured_compute_without_a_deadline(
    deadline_data, tmp_path, in_process):
  """`straggler_mode = 'drop'` without a deadline: the dropped clients downloaded (their bytes in
  `bytes_down`, their share of the band and their download in `sim_download_seconds`), the
  participants' compute is the measured training time split by examples × epochs."""
  del in_process
  driver = deadline_driver(deadline_data, tmp_path, None, clients_per_round=4,
                           straggler_fraction=0.5, straggler_mode='drop')
  driver.run()
  bytes_down = driver.algorithm.bytes_down_per_client
  bytes_up = driver.algorithm.bytes_up_per_client
  for row in read_csv(tmp_path / 'metrics.csv'):
    round_num = int(row['round'])
    sampled = sampling.sample_clients(DEADLINE_CLIENTS, 4, 0, round_num)
    _, dropped = sampling.straggler_plan(sampled, DEADLINE_EPOCHS, 0.5, 'drop', 0, round_num)
    kept = np.asarray([k not in dropped for k in sampled])
    assert int(row['dropped']) == len(dropped) == 2
    assert int(row['bytes_down']) == len(sampled) * bytes_down
    assert int(row['bytes_up']) == np.sum(kept) * bytes_up
    download = driver.channel.download_seconds(sampled, bytes_down)  # B_s / 4 each.
    work = np.asarray([len(deadline_data.train_indices[k]) for k in sampled])[kept]
    compute = float(row['round_seconds']) * work / work.sum()
    upload = driver.channel.upload_seconds(sampled[kept], bytes_up)
    for column, value in (('sim_download_seconds', np.mean(download)),
                          ('sim_compute_seconds', np.mean(compute)),
                          ('sim_upload_seconds', np.mean(upload)),
                          ('sim_round_seconds', np.max(download[kept] + compute + upload))):
      assert float(row[column]) == pytest.approx(value, rel=1e-12), column


@pytest.mark.parametrize('deadline,clients_per_round,seed,empty_round', [
    (0.1, 4, 0, 1),  # No client fits one epoch in 0.1 s.
    (0.3, 3, 1, 2),  # Round 1 keeps one client of three, round 2 none.
])
def test_a_deadline_that_drops_a_whole_round_stops_the_run(deadline_data, tmp_path, in_process,
                                                          deadline, clients_per_round, seed,
                                                          empty_round):
  """A round with no participant has nothing to aggregate (TFF's FedAvg logged it as a round of
  loss 0 that left the model as it was; vectorised clients failed on an empty batch shape): one
  ConfigError names the round and the deadline its quickest client needs, before any round runs
  (the plan of every round is known up front)."""
  del in_process
  driver = deadline_driver(deadline_data, tmp_path, deadline, clients_per_round, seed, rounds=3)
  sampled, epochs = deadline_plan(driver, empty_round)
  assert not epochs.any()
  quickest = np.min(
      driver.channel.download_seconds(sampled, driver.algorithm.bytes_down_per_client)
      + driver.channel.upload_seconds(sampled, driver.algorithm.bytes_up_per_client)
      + DEADLINE_SECONDS_PER_EXAMPLE * np.asarray(
          [len(deadline_data.train_indices[k]) for k in sampled]))
  with pytest.raises(ConfigError, match=(
      rf'round_deadline = {deadline:g} s drops every participant of round {empty_round} '
      rf'\(the quickest of its {clients_per_round} needs {quickest:.4g} s .*\). '
      'No completed round is in a checkpoint; raise the deadline')):
    driver.run()
  assert driver.checkpointer.latest_round() is None
  assert not os.path.exists(tmp_path / 'metrics.csv') or not read_csv(tmp_path / 'metrics.csv')
  if empty_round > 1:  # Round 1 has a participant: the check looked ahead, not at round 1.
    assert deadline_plan(driver, 1)[1].any()


def test_the_empty_round_error_names_the_quickest_of_the_clients_the_straggler_plan_kept(
    deadline_data, tmp_path):
  """With `straggler_mode = 'drop'` too, the quickest client named is one the deadline dropped,
  not one the straggler plan had dropped already."""
  driver = deadline_driver(deadline_data, tmp_path, 0.1, 4, straggler_fraction=0.5,
                           straggler_mode='drop')
  sampled, _ = deadline_plan(driver, 1)
  _, straggling = sampling.straggler_plan(sampled, DEADLINE_EPOCHS, 0.5, 'drop', 0, 1)
  kept = np.asarray([int(k) not in straggling for k in sampled])
  assert 0 < kept.sum() < len(sampled)
  need = (driver.channel.download_seconds(sampled, driver.algorithm.bytes_down_per_client)
          + driver.channel.upload_seconds(sampled, driver.algorithm.bytes_up_per_client)
          + DEADLINE_SECONDS_PER_EXAMPLE * np.asarray(
              [len(deadline_data.train_indices[k]) for k in sampled]))
  assert need[kept].min() != need.min()  # The case the message must get right.
  with pytest.raises(ConfigError, match=rf'the quickest of its {kept.sum()} needs '
                                        rf'{need[kept].min():.4g} s '):
    driver.run()


@pytest.mark.parametrize('fraction, mode, epochs, m, message', [
    (0.1, 'partial', 3, 4, 'experiment.straggler_fraction = 0.1 of 4 participant(s) a round '
     'gives no straggler (0.4 rounds to 0); use at least 0.25, or more participants.'),
    (0.9, 'drop', 3, 1, 'experiment.straggler_fraction = 0.9 of 1 participant(s) a round gives '
     "no straggler ('drop' keeps one); use more participants."),
    (0.5, 'partial', 1, 4, "experiment.straggler_mode = 'partial': a straggler trains a random "
     'number of epochs in [1, experiment.local_epochs], with local_epochs = 1 as many as the '
     "others; use more epochs or straggler_mode = 'drop'."),
])
def test_stragglers_that_would_not_straggle_are_refused(deadline_data, tmp_path, fraction,
                                                         mode, epochs, m, message):
  """A run that asked for stragglers never has one: refused, not run as if none were asked."""
  plans = [sampling.straggler_plan(sampling.sample_clients(DEADLINE_CLIENTS, m, 0, r), epochs,
                                   fraction, mode, 0, r) for r in (1, 2)]
  assert all(set(e.values()) == {epochs} and not dropped for e, dropped in plans)
  spec = build_model_spec(deadline_data, 'mlp2', seed=0)
  algorithm = learning.build_fedavg(spec, client_optimizer=optimizers.sgdm(learning_rate=0.05))
  with pytest.raises(ConfigError) as error:
    RoundDriver(algorithm, deadline_data, RoundConfig(
        rounds=2, clients_per_round=m, local_epochs=epochs, straggler_fraction=fraction,
        straggler_mode=mode), str(tmp_path), progress=lambda _: None)
  assert str(error.value) == message
  assert os.listdir(tmp_path) == []


# --- personalisation mixing ----------------------------------------------------------------
def test_mixing_fixed_and_by_dissimilarity():
  rng = np.random.default_rng(0)
  glob = [rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=3).astype(np.float32),
          rng.normal(size=(3, 2)).astype(np.float32), rng.normal(size=2).astype(np.float32)]
  local = [glob[0] + 1.0, glob[1], -glob[2], glob[3] * 2]
  layers = [[0, 1], [2, 3]]
  d = layer_dissimilarities(local, glob, layers)
  rows = lambda w: w.reshape(1, -1) if w.ndim == 1 else w
  for l, group in enumerate(layers):
    lam = np.concatenate([1 - (rows(local[i]) * rows(glob[i])).sum(1) /
                          (np.linalg.norm(rows(local[i]), axis=1) *
                           np.linalg.norm(rows(glob[i]), axis=1)) for i in group])
    assert d[l] == pytest.approx(lam.mean() / 2, abs=1e-5)
  assert d[1] > d[0]  # The negated layer is the dissimilar one.
  np.testing.assert_allclose(mixing_coefficients(d, 0.4, 'fixed'), [0.4, 0.4])
  betas = mixing_coefficients(d, 0.4, 'dissimilarity')
  np.testing.assert_allclose(betas, np.clip(0.4 * d / d.mean(), 0, 1))
  assert betas[1] > betas[0]
  mixed = mix_layers(local, glob, layers, betas)
  for l, group in enumerate(layers):
    for i in group:
      np.testing.assert_allclose(mixed[i], betas[l] * local[i] + (1 - betas[l]) * glob[i],
                                 rtol=1e-6)


# --- end to end ---------------------------------------------------------------------------
@pytest.fixture(scope='module')
def straggler_run(tmp_path_factory):
  out = str(tmp_path_factory.mktemp('stragglers'))
  result = run_pipeline_here(*BASE, '--gin_bindings=experiment.straggler_fraction = 0.5',
                        f'--output_dir={out}')
  assert result.returncode == 0, result.stderr[-3000:]
  return out


def test_partial_stragglers_process_their_epochs(straggler_run):
  """Examples per round = Σ_k epochs_k · n_k for the seeded participants and straggler plan."""
  partition = json.load(open(os.path.join(straggler_run, 'partition.json')))
  sizes = partition['train_sizes']
  config = open(os.path.join(straggler_run, 'config.gin')).read()
  assert 'experiment.straggler_fraction = 0.5' in config
  rows = read_csv(os.path.join(straggler_run, 'metrics.csv'))
  saw_stragglers = False
  for row in rows:
    r = int(row['round'])
    clients = sampling.sample_clients(len(sizes), int(row['clients']), 0, r)
    epochs, _ = sampling.straggler_plan(clients, 3, 0.5, 'partial', 0, r)
    assert int(row['examples']) == sum(epochs[int(k)] * sizes[int(k)] for k in clients)
    assert int(row['stragglers']) == sum(1 for e in epochs.values() if e < 3)
    saw_stragglers |= int(row['stragglers']) > 0
  assert saw_stragglers


def test_dropped_stragglers_leave_the_round(tmp_path):
  result = run_pipeline_here(*BASE, '--gin_bindings=experiment.straggler_fraction = 0.5',
                        "--gin_bindings=experiment.straggler_mode = 'drop'",
                        '--gin_bindings=experiment.rounds = 2', f'--output_dir={tmp_path}')
  assert result.returncode == 0, result.stderr[-3000:]
  for row in read_csv(os.path.join(tmp_path, 'metrics.csv')):
    assert int(row['dropped']) > 0
    assert int(row['clients']) + int(row['dropped']) == 5


def test_personalization_reports_and_resumes_exactly(tmp_path):
  args = ['--gin_file=gin_configs/fedlap/offline_mnist1003_fedlap_personalized.gin',
          '--gin_bindings=experiment.local_epochs = 2',
          '--gin_bindings=experiment.checkpoint_every = 1']
  # Local models live in the checkpoint: resumed after round 2, the same metrics.
  rows, resumed, stdout = run_and_resume(
      [*args, '--gin_bindings=experiment.rounds = 3'], tmp_path, stop_round=2)
  # The default executor vectorises the method's clients and the local models' training.
  assert 'runs on the in-process executor, vectorised clients.' in stdout
  for row in rows:
    assert 0.0 <= float(row['personalized_accuracy']) <= 1.0
    assert 0.0 <= float(row['global_model_local_accuracy']) <= 1.0
    assert 0.0 <= float(row['client_work/regularizer/lambda_mean/latent']) <= 2.0
  assert len(resumed) == len(rows) == 3
  for a, b in zip(resumed, rows):
    for key in ('test_accuracy', 'personalized_accuracy', 'global_model_local_accuracy',
                'train_loss'):
      assert float(a[key]) == pytest.approx(float(b[key]), rel=1e-5, abs=1e-6), key
