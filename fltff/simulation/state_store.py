"""The per-client state store: nested NumPy states by client index, which the round driver
feeds to a process and saves with checkpoints; `experiment.client_state_store` chooses
`ClientStateStore` ('memory') or `SqliteClientStateStore` ('sqlite'), as docs/outputs.md
("Where client states live") describes.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import io
import os
import sqlite3
from typing import Any, Callable, Optional

import numpy as np
import tensorflow as tf

from fltff.data.federated import arrays_digest
from fltff.errors import CheckpointError
from fltff.errors import ConfigError

STORE_KINDS = ('memory', 'sqlite')
# The marker a checkpoint of the SQLite store carries instead of client arrays.
_SQLITE_MARKER = 'client_store/sqlite'


class ClientStateStore:
  """Client index → nested NumPy state, with lazy initialisation and (de)serialisation."""

  def __init__(self, init_fn: Callable[[int], Any]):
    self._init_fn = init_fn
    self._states: dict[int, Any] = {}
    # Client index → its state's digest (`fingerprint`) until replaced (never changed in place).
    self._digests: dict[int, str] = {}

  def __len__(self) -> int:
    return len(self._states)

  def __contains__(self, client_index: int) -> bool:
    return client_index in self._states

  def get(self, client_index: int) -> Any:
    """The client's state, created with `init_fn` on first use."""
    if client_index not in self._states:
      self.set(client_index, self._init_fn(client_index))
    return self._states[client_index]

  def set(self, client_index: int, state: Any) -> None:
    self._states[client_index] = tf.nest.map_structure(np.asarray, state)
    self._digests.pop(client_index, None)

  def set_many(self, states: dict, round_num: int) -> None:
    """Stores the participants' new states after round `round_num`."""
    del round_num
    for k, state in states.items():
      self.set(int(k), state)

  def checkpoint(self, round_num: int) -> dict[str, np.ndarray]:
    """The arrays the checkpoint of round `round_num` holds: every client's state, flat
    (`client/<index>/<leaf>`), an array that a state holds twice (KAPC's server copy of an
    uploaded layer is the client's own) once: `alias/<index>/<leaf>` is the leaf holding it."""
    del round_num
    arrays = {}
    for index, state in self._states.items():
      first: dict[int, int] = {}  # id(array) → its first leaf.
      for j, leaf in enumerate(tf.nest.flatten(state)):
        source = first.setdefault(id(leaf), j)
        arrays[f'alias/{index}/{j}' if source < j else f'client/{index}/{j}'] = (
            np.int64(source) if source < j else leaf)
    return arrays

  def prune(self, kept_rounds) -> None:
    """Nothing to prune: each checkpoint file holds its own copy."""
    del kept_rounds

  def restore(self, round_num: int, arrays: dict, template_fn: Callable[[int], Any]) -> None:
    """The states of the checkpoint of `round_num` (its `arrays`); `template_fn(i)` gives each
    state's structure."""
    del round_num
    if _SQLITE_MARKER in arrays:
      raise ConfigError("This run's client states are in client_states.sqlite: resume it with "
                        "experiment.client_state_store = 'sqlite'.")
    # Older checkpoints hold the client states under 'method/'.
    prefix = 'client' if any(key.startswith('client/') for key in arrays) else 'method'
    leaves: dict[int, dict[int, np.ndarray]] = {}
    # Aliases last, each then the array of its leaf (the same array, as the state held it).
    for key, value in sorted(arrays.items(), key=lambda item: item[0].startswith('alias/')):
      parts = key.split('/')
      if len(parts) == 3 and parts[0] in (prefix, 'alias'):
        by_position = leaves.setdefault(int(parts[1]), {})
        by_position[int(parts[2])] = by_position[int(value)] if parts[0] == 'alias' else value
    self._states = {index: tf.nest.pack_sequence_as(template_fn(index),
                                                    [by_pos[j] for j in range(len(by_pos))])
                    for index, by_pos in leaves.items()}
    self._digests = {}

  def reset(self) -> None:
    self._states, self._digests = {}, {}

  def fingerprint(self, round_num: int) -> dict:
    """`fingerprint_of` the clients with a state and the shapes of each one's arrays, with a
    digest of their contents (a state moved to another client changes it)."""
    del round_num
    ordered = sorted(self._states)
    self._digests.update({k: arrays_digest(f'{k}:', tf.nest.flatten(self._states[k]))
                          for k in ordered if k not in self._digests})
    return fingerprint_of(
        ((k, [np.shape(leaf) for leaf in tf.nest.flatten(self._states[k])]) for k in ordered),
        contents=((k, self._digests[k]) for k in ordered))

  def close(self) -> None:
    pass


def state_digest(client_index: int, blob: bytes) -> str:
  """sha256 of one client's packed state, bound to the client's index."""
  return hashlib.sha256(f'{int(client_index)}:'.encode() + blob).hexdigest()


class SqliteClientStateStore:
  """Client states in SQLite, RAM bounded by a small cache (docs/outputs.md).

  Table `states(client, round, leaves)`: a row per client and round it changed in, the newest
  its state. `cache_size`: decoded states kept in RAM (a few rounds' participants suffice).
  """

  def __init__(self, directory: str, init_fn: Callable[[int], Any], cache_size: int = 64):
    os.makedirs(directory, exist_ok=True)
    self.path = os.path.join(directory, 'client_states.sqlite')
    self._init_fn = init_fn
    self._structure = None  # One initial state, for its structure only (`get`).
    self._cache: collections.OrderedDict[int, Any] = collections.OrderedDict()
    self._cache_size = int(cache_size)
    self._changed: set[int] = set()
    self._existed = os.path.exists(self.path)
    try:
      # Not only the driver's thread: a second signal's stop may save the last completed round
      # from the signal thread (the driver's lock keeps the two from overlapping).
      self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
    except sqlite3.Error as e:
      raise CheckpointError(f'cannot open the client-state store {self.path} ({e}).') from None
    # WAL: a round's transaction is durable once committed, and a kill mid-transaction leaves
    # the previous state (SQLite rolls the torn transaction back on the next open).
    self._sql('execute', 'PRAGMA journal_mode=WAL')
    self._sql('execute', 'PRAGMA synchronous=FULL')
    self._sql('execute', 'CREATE TABLE IF NOT EXISTS states (client INTEGER NOT NULL, round INTEGER '
                     'NOT NULL, leaves BLOB NOT NULL, digest TEXT, PRIMARY KEY (client, round))')
    columns = [row[1] for row in self._sql('execute', 'PRAGMA table_info(states)')]
    if 'digest' not in columns:  # A store written before states carried their digest.
      self._sql('execute', 'ALTER TABLE states ADD COLUMN digest TEXT')

  def _sql(self, method: str, *args):
    """`self._db.<method>(*args)`; a damaged or foreign database file is one CheckpointError."""
    try:
      return getattr(self._db, method)(*args)
    except sqlite3.DatabaseError as e:
      raise CheckpointError(
          f'the client-state store {self.path} is damaged or not fltff\'s ({e}); restore it '
          'from a copy, or start the run again in a new --output_dir.') from None

  def _verify(self, client_index: int, blob: bytes, digest: Optional[str]) -> None:
    """Raises `CheckpointError` unless `blob` is the state stored for the client (`digest`;
    None in a store written before states carried one)."""
    if digest is not None and state_digest(client_index, blob) != digest:
      raise CheckpointError(
          f'the client-state store {self.path} holds a state for client {client_index} that is '
          'not the one stored for it (its checksum differs: changed, or moved from another '
          'client); the checkpointed rounds are kept: restore the file from a copy, or start the '
          'run again in a new --output_dir.')

  def _remember(self, client_index: int, state) -> None:
    self._cache[client_index] = state
    self._cache.move_to_end(client_index)
    while len(self._cache) > self._cache_size:
      self._cache.popitem(last=False)

  def __len__(self) -> int:
    return self._sql('execute', 'SELECT COUNT(DISTINCT client) FROM states').fetchone()[0]

  def __contains__(self, client_index: int) -> bool:
    return self._sql('execute', 'SELECT 1 FROM states WHERE client = ? LIMIT 1',
                            (int(client_index),)).fetchone() is not None

  def get(self, client_index: int) -> Any:
    """The client's newest state; a client never stored starts from `init_fn`."""
    k = int(client_index)
    if k in self._cache:
      self._cache.move_to_end(k)
      return self._cache[k]
    row = self._sql('execute', 'SELECT leaves, digest FROM states WHERE client = ? ORDER BY '
                           'round DESC LIMIT 1', (k,)).fetchone()
    if row is None:
      state = tf.nest.map_structure(np.asarray, self._init_fn(k))
      if self._structure is None:
        self._structure = state
    else:
      # A stored state needs only the structure (the same for every client), not a fresh
      # initial state (a model-sized copy for the personalised methods).
      if self._structure is None:
        self._structure = self._init_fn(k)
      self._verify(k, *row)
      try:
        with np.load(io.BytesIO(row[0])) as arrays:
          state = tf.nest.pack_sequence_as(self._structure,
                                           [arrays[f'arr_{j}'] for j in range(len(arrays.files))])
      except Exception as e:  # pylint: disable=broad-except
        raise CheckpointError(
            f'the client-state store {self.path} holds a damaged state for client {k} '
            f'({type(e).__name__}); restore the file from a copy, or start the run again in a '
            'new --output_dir.') from None
    self._remember(k, state)
    return state

  def set_many(self, states: dict, round_num: int) -> None:
    """Writes the participants' new states of round `round_num` in one transaction."""
    rows = []
    for k, state in states.items():
      state = tf.nest.map_structure(np.asarray, state)
      buffer = io.BytesIO()
      np.savez(buffer, *tf.nest.flatten(state))
      blob = buffer.getvalue()
      rows.append((int(k), int(round_num), blob, state_digest(k, blob)))
      self._remember(int(k), state)
      self._changed.add(int(k))
    self._sql('execute', 'BEGIN')
    try:
      self._sql('executemany', 'INSERT OR REPLACE INTO states VALUES (?, ?, ?, ?)', rows)
      self._sql('execute', 'COMMIT')
    except BaseException:
      self._sql('execute', 'ROLLBACK')
      raise

  def checkpoint(self, round_num: int) -> dict[str, np.ndarray]:
    """Only a marker: the states up to `round_num` are here (each round committed its own)."""
    return {_SQLITE_MARKER: np.asarray(round_num, np.int64)}

  def prune(self, kept_rounds) -> None:
    """Deletes the changed clients' versions older than the oldest kept checkpoint needs."""
    oldest = min(kept_rounds)
    changed = sorted(self._changed)
    self._sql('execute', 'BEGIN')
    self._sql('executemany', 
        'DELETE FROM states WHERE client = ? AND round < (SELECT MAX(round) FROM states '
        'WHERE client = ? AND round <= ?)', [(k, k, oldest) for k in changed])
    self._sql('execute', 'COMMIT')
    self._changed.clear()

  def restore(self, round_num: int, arrays: dict, template_fn: Callable[[int], Any]) -> None:
    """Back to the states as of round `round_num`, deleting newer versions (e.g. a torn run)."""
    del template_fn
    if _SQLITE_MARKER not in arrays:
      raise ConfigError("This run's checkpoints hold its client states in the checkpoint "
                        "files: resume it with experiment.client_state_store = 'memory'.")
    if not self._existed:
      # Opening made an empty store: removed, so the refused resume leaves the folder as it was.
      self._db.close()
      for suffix in ('', '-wal', '-shm'):
        with contextlib.suppress(FileNotFoundError):
          os.remove(self.path + suffix)
      raise CheckpointError(
          f'{self.path} is missing: the client states of this run are gone, so it cannot be '
          'resumed. Restore the file from a copy, or start the run again in a new --output_dir.')
    cursor = self._sql('execute', 'SELECT client, leaves, digest FROM states WHERE round <= ?',
                       (int(round_num),))
    for client, blob, digest in cursor:  # One row at a time: RAM stays bounded.
      self._verify(client, blob, digest)
    self._sql('execute', 'DELETE FROM states WHERE round > ?', (int(round_num),))
    self._cache.clear()
    self._changed = {row[0] for row in self._sql('execute', 'SELECT DISTINCT client FROM states')}

  def fingerprint(self, round_num: int) -> dict:
    """`fingerprint_of` each client with a state as of `round_num` and its newest round, with
    the stored digests of those states (each verified against its blob when read, `get`)."""
    rows = self._sql('execute',
        'SELECT s.client, s.round, s.digest FROM states s JOIN (SELECT client, MAX(round) AS r '
        'FROM states WHERE round <= ? GROUP BY client) m ON s.client = m.client AND s.round = m.r '
        'ORDER BY s.client', (int(round_num),)).fetchall()
    return fingerprint_of(((k, r) for k, r, _ in rows),
                          contents=((k, d) for k, _, d in rows))

  def reset(self) -> None:
    """A new run in this folder: no states."""
    self._sql('execute', 'DELETE FROM states')
    self._cache.clear()
    self._changed.clear()

  def close(self) -> None:
    self._db.close()


def fingerprint_of(entries, contents) -> dict:
  """`{'clients': count, 'digest': sha256, 'contents': sha256}` of `(client, detail)` entries
  and `(client, state digest)` `contents` in client order: a resumed run checks the store
  against its checkpoint's (`RoundDriver.restore`; checkpoints written before 'contents'
  existed are checked on the other two)."""
  digest = hashlib.sha256()
  count = 0
  for client, detail in entries:
    digest.update(f'{int(client)}:{detail};'.encode())
    count += 1
  return {'clients': count, 'digest': digest.hexdigest(), 'contents': hashlib.sha256(
      ''.join(f'{int(k)}:{d};' for k, d in contents).encode()).hexdigest()}
