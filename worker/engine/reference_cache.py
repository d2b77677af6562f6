"""References computed once: the metrics of a kernel trajectory kept where the next run finds them.

What a run needs from the references is, per case and step, three numbers: max |p - r64|, the
floored relative error against r64, and max |p - r_same| (worker.engine.trajectory). They depend
on the kernel's parameters p and on the reference trajectory; the reference depends only on the
case, the reference code and the environment. So for a kernel trajectory seen before, identified
by its per-step od2 digests (which cover p and the states bit for bit), the metrics are the ones
computed then, exactly. Keeping the reference trajectories themselves would not pay: for the
standard battery they are 2.43e9 float64 element-steps (19.4 GB, plus 7 GB same-precision), more
to read back than an H200 takes to recompute them; what is kept instead is each trajectory's
metric series, 68 bytes a case-step (about 6 MB for the standard battery).

The key is (environment, case, digest series):
* environment: the kernel host's EnvironmentFingerprint.class_key (device class, torch and CUDA
  versions, CPU vector ISA), its reference digests (torch.optim's code as the host loaded it:
  worker/references/digest.py) and `engine_version()`, a digest of the source of the references,
  the gradient streams, the metric definitions and the digest scheme; any change of one is a new
  key, so stale entries are never read (they age out, see `MAX_ROWS`);
* case: the whole CaseSpec (optimizer, hyperparameters, gradient stream, seed, size, dtype, ...);
* digest series: `series_key(digests)`.

How a run uses it (`run_many`): the parent (never the kernel host: it runs submitted code) looks
up the series it holds for each case and sends their keys with the host's run_many request. The
host runs those cases kernels-only first (worker.engine.kernels_only.run_cases_known); a case whose
series is known is answered with digests only and the parent fills in the stored metrics after
checking the digests; every other case runs the full fast engine, references included, and a
trusted run stores what it computed. A run with a warm cache gives the same results, bit for bit,
as one without (tests/worker/engine/test_reference_cache.py). Who may write, and why: docs/security/SANDBOX.md, "The sandbox".

Storage: one SQLite file (WAL; several workers of one host may share it) in a folder the sandbox
never shows (under the build cache root, a secret path of worker/sandbox/mounts.py). numpy and the
standard library only: safe in a Celery parent.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import closing, contextmanager
from functools import lru_cache
from pathlib import Path

import numpy as np

from service.core.results import CaseResult, CaseSpec, EnvironmentFingerprint, Trajectory

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
FILE_NAME = "references.sqlite"
MAX_SERIES_PER_CASE = 4  # a case's baseline, its commit and a couple more; the least recently used go
MAX_ROWS = 50_000  # about 46 standard batteries' worth of series (~270 MB); oldest used go first
# A series reused again within this many seconds of its last mark keeps that mark: eviction stays
# least-recently-used to within ten minutes, and a warm commit soon after the last run writes
# nothing (marking every series of a battery is a write per series on the warm run's path).
USED_REFRESH_S = 600.0
_LOOKUP_CHUNK = 500  # case keys per query (SQLite's variable limit)
# What a metric depends on besides the kernel's parameters (relative to the worker package).
ENGINE_SOURCES = ("references/*.py", "engine/gradients.py", "engine/trajectory.py", "engine/fast.py",
                  "engine/quant_series.py", "adapters/*.py",  # a quantized case's codec and states: its adapter
                  "engine/kernels_only.py", "engine/digest.py", "engine/step_inputs.py")


def series_key(digests: list[str]) -> str:
    """The key of one digest series (a trajectory's per-step od2 digests)."""
    return hashlib.blake2b("\n".join(digests).encode(), digest_size=16).hexdigest()


@lru_cache(maxsize=1)
def engine_version() -> str:
    worker_root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256(f"optdrift reference cache schema {SCHEMA_VERSION}\n".encode())
    for pattern in ENGINE_SOURCES:
        for path in sorted(worker_root.glob(pattern)):
            digest.update(f"{path.relative_to(worker_root).as_posix()}\n".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def environment_key(environment: EnvironmentFingerprint) -> str:
    # The host's reference digests too: torch.optim's code as the host loaded it can change under
    # one torch version (an edited file, a function replaced at run time), and the metrics stored
    # were measured against the references of their time.
    references = json.dumps(environment.references or {}, sort_keys=True)
    return hashlib.sha256(f"{environment.class_key}\n{engine_version()}\n{references}".encode()).hexdigest()


def case_key(case: CaseSpec) -> str:
    return hashlib.sha256(json.dumps(case.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()


def _encode(trajectory: Trajectory) -> tuple[str, bytes, bytes, int]:
    # metrics: ref64 abs and rel, then the same-precision series (has_same), then a quantized
    # case's two figures against its quantization-aware reference when recorded (told apart by
    # the row count: they depend on the kernel's states, which the digests cover, like the rest).
    series = [trajectory.ref64_max_abs, trajectory.ref64_max_rel]
    if trajectory.same_precision_max_abs is not None:
        series.append(trajectory.same_precision_max_abs)
    if trajectory.quant_ref_steps is not None:
        series += [trajectory.quant_ref_steps, trajectory.quant_ref_max_abs]
    metrics = np.asarray(series, dtype="<f8").tobytes()
    return ("\n".join(trajectory.digests), metrics, np.asarray(trajectory.nonfinite_count, dtype="<i8").tobytes(),
            int(trajectory.same_precision_max_abs is not None))


def _decode(digests: str, metrics: bytes, nonfinite: bytes, has_same: int) -> Trajectory:
    steps = digests.split("\n")
    series = np.frombuffer(metrics, dtype="<f8").reshape(-1, len(steps))
    quantized = len(series) == 2 + has_same + 2
    return Trajectory(ref64_max_abs=series[0].tolist(), ref64_max_rel=series[1].tolist(),
                      same_precision_max_abs=series[2].tolist() if has_same else None,
                      nonfinite_count=np.frombuffer(nonfinite, dtype="<i8").tolist(), digests=steps,
                      quant_ref_steps=series[-2].tolist() if quantized else None,
                      quant_ref_max_abs=series[-1].tolist() if quantized else None)


def _complete(result: CaseResult) -> bool:
    """A result with every metric series, one value per step: what may be stored."""
    t = result.trajectory
    if result.status != "ok" or t is None or not t.digests:
        return False
    lengths = {len(t.digests), len(t.ref64_max_abs), len(t.ref64_max_rel), len(t.nonfinite_count)}
    if t.same_precision_max_abs is not None:
        lengths.add(len(t.same_precision_max_abs))
    if t.quant_ref_steps is not None:
        lengths |= {len(t.quant_ref_steps), len(t.quant_ref_max_abs or [])}
    return lengths == {result.case.steps}


class StoredSeries:
    """One stored series as read: its encoded columns, decoded once when first asked for."""

    __slots__ = ("_columns", "_trajectory", "used", "steps")

    def __init__(self, digests: str, metrics: bytes, nonfinite: bytes, has_same: int, used: float) -> None:
        self._columns = (digests, metrics, nonfinite, has_same)
        self._trajectory: Trajectory | None = None
        self.used = used
        self.steps = digests.count("\n") + 1

    def trajectory(self) -> Trajectory:
        if self._trajectory is None:
            self._trajectory = _decode(*self._columns)
        return self._trajectory


class ReferenceCache:
    """The store in `folder`. `writable`: whether this run may add to it (trusted runs only)."""

    def __init__(self, folder: Path, *, writable: bool) -> None:
        self.path = Path(folder) / FILE_NAME
        self.writable = writable
        # Each case's key, made once for a lookup and the store that follows it (~10 ms a standard
        # battery each time, bench/parent_share.py). The cases are frozen models, held here so
        # that their id stays theirs.
        self._case_keys: dict[int, tuple[CaseSpec, str]] = {}

    def _key(self, case: CaseSpec) -> str:
        held = self._case_keys.get(id(case))
        if held is None or held[0] is not case:
            if len(self._case_keys) > 100_000:
                self._case_keys.clear()
            held = self._case_keys[id(case)] = (case, case_key(case))
        return held[1]

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        """One transaction (committed when the block ends without error), then closed."""
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with closing(sqlite3.connect(self.path, timeout=30)) as connection, connection:
            self._prepare(connection)
            yield connection

    @staticmethod
    def _prepare(connection: sqlite3.Connection) -> None:
        connection.execute("PRAGMA journal_mode=WAL")
        connection.execute("CREATE TABLE IF NOT EXISTS series (env TEXT NOT NULL, case_key TEXT NOT NULL, "
                           "series TEXT NOT NULL, digests TEXT NOT NULL, metrics BLOB NOT NULL, "
                           "nonfinite BLOB NOT NULL, has_same INTEGER NOT NULL, used REAL NOT NULL, "
                           "PRIMARY KEY (env, case_key, series))")
        connection.execute("CREATE INDEX IF NOT EXISTS series_used ON series (used)")

    def lookup(self, environment: EnvironmentFingerprint, cases: list[CaseSpec]) -> dict[int, dict[str, Trajectory]]:
        """{case index: {series key: its trajectory (metrics and digests)}} for the cases held."""
        return {index: {series: row.trajectory() for series, row in held.items()}
                for index, held in self.lookup_rows(environment, cases).items()}

    def lookup_rows(self, environment: EnvironmentFingerprint, cases: list[CaseSpec]) -> dict[int, dict[str, "StoredSeries"]]:
        """`lookup` with each series still encoded (decoded on first use: StoredSeries.trajectory),
        and when it was last marked used."""
        env = environment_key(environment)
        indices_of: dict[str, list[int]] = {}
        for index, case in enumerate(cases):
            indices_of.setdefault(self._key(case), []).append(index)
        found: dict[int, dict[str, StoredSeries]] = {}
        keys = list(indices_of)
        with self._connect() as connection:
            for start in range(0, len(keys), _LOOKUP_CHUNK):
                chunk = keys[start:start + _LOOKUP_CHUNK]
                rows = connection.execute(
                    f"SELECT case_key, series, digests, metrics, nonfinite, has_same, used FROM series "
                    f"WHERE env = ? AND case_key IN ({','.join('?' * len(chunk))})", [env, *chunk])
                for key, series, digests, metrics, nonfinite, has_same, used in rows:
                    row = StoredSeries(digests, metrics, nonfinite, has_same, used)
                    for index in indices_of[key]:
                        if row.steps == cases[index].steps:
                            found.setdefault(index, {})[series] = row
        return found

    def store(self, environment: EnvironmentFingerprint, results: Iterable[CaseResult],
              reused: Iterable[tuple[CaseSpec, str]] = ()) -> int:
        """Add the complete results' series (a no-op unless writable); mark `reused` (case,
        series key) pairs as used now; keep at most MAX_SERIES_PER_CASE per case and MAX_ROWS in
        all, the least recently used going first. Returns how many series were added."""
        if not self.writable:
            return 0
        env, now = environment_key(environment), time.time()
        rows = [(env, self._key(r.case), series_key(r.trajectory.digests), *_encode(r.trajectory), now)
                for r in results if _complete(r)]
        with self._connect() as connection:
            connection.executemany("INSERT OR REPLACE INTO series VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)
            connection.executemany("UPDATE series SET used = ? WHERE env = ? AND case_key = ? AND series = ?",
                                   [(now, env, self._key(case), series) for case, series in reused])
            for key in {row[1] for row in rows}:
                connection.execute("DELETE FROM series WHERE env = ? AND case_key = ? AND series NOT IN "
                                   "(SELECT series FROM series WHERE env = ? AND case_key = ? "
                                   "ORDER BY used DESC LIMIT ?)", (env, key, env, key, MAX_SERIES_PER_CASE))
            connection.execute("DELETE FROM series WHERE rowid IN (SELECT rowid FROM series "
                               "ORDER BY used DESC LIMIT -1 OFFSET ?)", (MAX_ROWS,))
        return len(rows)

    def size(self) -> tuple[int, int]:
        """(series held, bytes of the database file and its write-ahead log)."""
        with self._connect() as connection:
            count = connection.execute("SELECT COUNT(*) FROM series").fetchone()[0]
        files = [self.path, self.path.with_name(FILE_NAME + "-wal")]
        return count, sum(f.stat().st_size for f in files if f.exists())


def for_policy(folder: Path | None, *, trusted: bool) -> ReferenceCache | None:
    return ReferenceCache(folder, writable=trusted) if folder is not None else None


def run_many(host, cases: list[CaseSpec], cache: ReferenceCache | None, *,  # noqa: ANN001
             on_result: Callable[[int, CaseResult], None] | None = None,
             on_pause: Callable[[], None] | None = None, profile: bool = False) -> list[CaseResult]:
    """`host.run_many(cases)` (a worker.engine.host.KernelHost) with the metrics of known digest
    series taken from `cache` instead of recomputed; the same results, bit for bit. A cache that
    cannot be read or written is logged and the run goes on without it. `profile`: as
    KernelHost.run_many's."""
    options = {"profile": True} if profile else {}  # asked only when wanted: any host with run_many serves
    if cache is None:
        return host.run_many(cases, on_result=on_result, on_pause=on_pause, **options)
    held: dict[int, dict[str, StoredSeries]] = {}
    reused: dict[int, tuple[CaseSpec, str]] = {}  # case index -> (case, series key) taken from the cache

    def known(environment: EnvironmentFingerprint) -> dict[int, list[str]]:
        try:
            held.update(cache.lookup_rows(environment, cases))
        except sqlite3.Error as error:
            log.warning("reference cache %s unreadable (%s); computing every reference", cache.path, error)
        return {index: sorted(series) for index, series in held.items()}

    def decode_held() -> None:
        # While the host runs (its request is on its way): the series it was told of, decoded now
        # rather than after its answers, which come together at the end of each wave.
        for series in held.values():
            for row in series.values():
                row.trajectory()

    def filled(index: int, result: CaseResult) -> CaseResult:
        trajectory = result.trajectory
        if result.status != "ok" or trajectory is None or trajectory.ref64_max_abs or not trajectory.digests:
            return result
        key = series_key(trajectory.digests)
        row = held.get(index, {}).get(key)
        stored = row.trajectory() if row is not None else None
        if stored is None or stored.digests != trajectory.digests:
            return CaseResult(case=result.case, status="broken", duration_s=result.duration_s,
                              message="the kernel host answered digests without metrics for a digest series "
                                      "it was not told of (a protocol violation)")
        reused[index] = (result.case, key)
        return result.model_copy(update={"trajectory": stored})

    def known_result(index: int, key: str, duration_s: float) -> CaseResult:
        # A host answering a known series by its key (KernelHost.answers_known_by_key): the stored
        # trajectory, when the key is one it was told of for this case; else, as for digests
        # without metrics, a broken case.
        row = held.get(index, {}).get(key)
        if row is None:
            return CaseResult(case=cases[index], status="broken", duration_s=duration_s,
                              message="the kernel host answered a known digest series it was not told of "
                                      "(a protocol violation)")
        reused[index] = (cases[index], key)
        return CaseResult(case=cases[index], status="ok", duration_s=duration_s, trajectory=row.trajectory())

    completed: dict[int, tuple[CaseResult, CaseResult]] = {}  # index -> (the host's answer, filled)

    def filled_once(index: int, result: CaseResult) -> CaseResult:
        if index not in completed or completed[index][0] is not result:
            completed[index] = (result, filled(index, result))
        return completed[index][1]

    def on_raw(index: int, result: CaseResult) -> None:
        if on_result:
            on_result(index, filled_once(index, result))

    if getattr(host, "answers_known_by_key", False):
        options["known_result"] = known_result
    results = [filled_once(index, result)
               for index, result in enumerate(host.run_many(cases, on_result=on_raw, known=known,
                                                            on_request_sent=decode_held, on_pause=on_pause,
                                                            **options))]
    if host.environment is not None:  # what the cache filled in is not new: not hashed again
        fresh = [r for index, r in enumerate(results) if index not in reused and r.status == "ok"
                 and r.trajectory is not None and series_key(r.trajectory.digests) not in held.get(index, {})]
        stale_after = time.time() - USED_REFRESH_S
        to_mark = [(case, key) for index, (case, key) in reused.items() if held[index][key].used < stale_after]
        try:
            if fresh or to_mark:  # else nothing to write: not even a connection
                cache.store(host.environment, fresh, to_mark)
        except sqlite3.Error as error:
            log.warning("reference cache %s not updated (%s)", cache.path, error)
    return results
