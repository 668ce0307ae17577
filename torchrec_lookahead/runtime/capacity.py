"""Checking a training stream against the cache before training starts (contract 2: bounded, fail early).

The oracle raises :class:`~torchrec_lookahead.errors.CapacityError` when a window (a batch and the next
``prefetch_depth``) needs more rows than a table's cache holds, but it plans only ``horizon`` batches ahead of
training, so a window late in an epoch would surface mid-training. :func:`check_stream` scans a stream first:
the same per-window working sets, ids checked against the table sizes (the resident tables' too, a min and a max
per feature, which the step would otherwise refuse only when it reads them), and nothing planned or moved. The
pre-scan before training (:func:`~torchrec_lookahead.runtime.scan.prescan`) runs it over the epoch's first
batches, up to a bound in batches or seconds, so that a large epoch is not read before the first step; the
oracle still checks every window it plans, those beyond the bound included, before it is trained.

Tables in disk stores have a second bound: the host tier between the disk and the device cache must hold the
rows of one window of its own (:class:`~torchrec_lookahead.store.types.HostWindow`: one step's rows, or with the
lookahead host policy a step's and the next ``disk_prefetch_depth`` steps'). :func:`check_stream` checks it
after the device caches, and the planner thread checks it for every batch it reads, those beyond the pre-scan's
bound included.
"""

from __future__ import annotations

import enum
import numbers
from typing import Any, Callable, Dict, Iterable, Iterator, Mapping, Optional, Sequence, Tuple

import numpy as np

from torchrec_lookahead._checks import check_int
from torchrec_lookahead.errors import CapacityError, ConfigError, InvalidIdError
from torchrec_lookahead.oracle.batch_ids import UnknownFeatures, split_batch, table_ids
from torchrec_lookahead.oracle.oracle import window_working_sets
from torchrec_lookahead.oracle.ttl import Shortfall
from torchrec_lookahead.oracle.types import describe_window
from torchrec_lookahead.runtime._host_windows import HostShortfall, HostWindowCheck
from torchrec_lookahead.store.types import HostWindow

__all__ = ["CapacityCheck", "check_stream", "scan_stream", "check_scan_bounds", "DEFAULT_SCAN_SECONDS"]


class CapacityCheck(enum.StrEnum):
    """When ``LookaheadDataModule`` checks that every window of an epoch fits the cache (its
    ``capacity_check``); a ``str``, so the YAML strings ``epoch`` and ``lookahead`` are its values.

    Example:
        >>> CapacityCheck("epoch") is CapacityCheck.EPOCH, CapacityCheck.LOOKAHEAD == "lookahead"
        (True, True)
    """

    #: before training, scan the epoch's sparse features (:func:`check_stream`), up to a bound in batches or
    #: seconds; the windows beyond it as the oracle plans them
    EPOCH = "epoch"
    LOOKAHEAD = "lookahead"  #: only as the oracle plans, ``horizon`` batches ahead of training


#: the default time bound of the ``"epoch"`` pre-scan (``LookaheadDataModule(capacity_check_seconds=...)``)
DEFAULT_SCAN_SECONDS = 20.0


def check_scan_bounds(batches: object, seconds: object) -> Tuple[Optional[int], Optional[float]]:
    """The pre-scan's bounds ``(capacity_check_batches, capacity_check_seconds)`` as ``(int, float)``, each
    possibly ``None`` (no such bound).

    Raises:
        ConfigError: ``batches`` is not an integer >= 1, or ``seconds`` not a number > 0 (``bool`` and NaN
            refused).

    Example:
        >>> check_scan_bounds(1000, 30), check_scan_bounds(None, None)
        ((1000, 30.0), (None, None))
    """
    fix = "pass None for no such bound, or capacity_check='lookahead' for no pre-scan"
    n = None if batches is None else check_int("capacity_check_batches", batches, 1, fix)
    if seconds is None:
        return n, None
    if not isinstance(seconds, numbers.Real) or isinstance(seconds, bool) or not float(seconds) > 0:
        raise ConfigError(f"capacity_check_seconds must be a number > 0 but got {seconds!r}; {fix}")
    return n, float(seconds)


def _check_resident(ids: Mapping[str, Any], resident: Mapping[str, Tuple[str, int]], step: int) -> None:
    """Refuse batch ``step`` if a resident feature's ids (feature -> ids) leave its table's rows."""
    for feature, values in ids.items():
        if not values.numel():
            continue
        table, rows = resident[feature]
        low, high = int(values.min()), int(values.max())
        if low < 0 or high >= rows:
            bad = low if low < 0 else high
            raise InvalidIdError(
                f"feature {feature!r} of resident table {table!r}: batch {step} holds id {bad} outside [0, "
                f"{rows}); remap or hash ids into the table before training",
                table=table,
                batch=step,
                id=bad,
                num_rows=rows,
            )


def check_stream(
    batches: Iterable[Any],
    capacity: Mapping[str, int],
    feature_to_table: Mapping[str, str],
    num_embeddings: Mapping[str, int],
    prefetch_depth: int,
    host_windows: Optional[Mapping[str, HostWindow]] = None,
    slot_spaces: Optional[Mapping[str, Sequence[str]]] = None,
    resident_features: Optional[Mapping[str, Tuple[str, int]]] = None,
) -> Dict[str, int]:
    """:func:`scan_stream`'s largest window working set per table (its arguments, raises and checks).

    Example:
        >>> import torch
        >>> stream = [{"f": torch.tensor([1, 2])}, {"f": torch.tensor([3])}, {"f": torch.tensor([3, 4])}]
        >>> check_stream(stream, {"t": 3}, {"f": "t"}, {"t": 10}, prefetch_depth=1)
        {'t': 3}
    """
    return scan_stream(
        batches,
        capacity,
        feature_to_table,
        num_embeddings,
        prefetch_depth,
        host_windows,
        slot_spaces,
        resident_features,
    )[0]


def _shared_label(members: Sequence[str]) -> str:
    return f"the cache shared by tables {list(members)}"


def scan_stream(
    batches: Iterable[Any],
    capacity: Mapping[str, int],
    feature_to_table: Mapping[str, str],
    num_embeddings: Mapping[str, int],
    prefetch_depth: int,
    host_windows: Optional[Mapping[str, HostWindow]] = None,
    slot_spaces: Optional[Mapping[str, Sequence[str]]] = None,
    resident_features: Optional[Mapping[str, Tuple[str, int]]] = None,
    shortfalls: Optional[Callable[[], Mapping[str, Shortfall]]] = None,
    pinned: Optional[Mapping[str, int]] = None,
) -> Tuple[Dict[str, int], Dict[str, int]]:
    """Scan a stream of sparse features (KJTs or mappings) and fail at the first window a cache cannot hold.

    Args:
        batches: the stream (read once).
        capacity: cache rows per cached table.
        feature_to_table: feature -> table for the cached tables' features (other features are ignored).
        num_embeddings: rows per cached table (ids must be in ``[0, rows)``).
        prefetch_depth: P: a window is a batch and the next P batches.
        host_windows: per cached table in a disk store, what its host tier must hold at once (a batch and the
            next ``depth`` batches' rows on each shard, :class:`~torchrec_lookahead.store.types.HostWindow`);
            checked after the device caches.
        slot_spaces: slot space -> the cached tables that share one cache of the sum of their capacities
            (:attr:`CacheTarget.slot_spaces`): a window must fit in the space, whatever each member's share.
        resident_features: feature -> (table, rows) of resident tables (:attr:`CacheTarget.resident_features`):
            each batch's ids of these features are checked against their table's rows too (a min and a max per
            feature), so that a bad id fails here rather than at the step that reads it.
        shortfalls: called once the stream has been read: per table alone or shared slot space (by its name in
            ``slot_spaces``), what a ``ttl`` oracle measuring the same batches held beyond its capacity
            (:meth:`LookaheadOracle.shortfalls <torchrec_lookahead.oracle.LookaheadOracle.shortfalls>`), refused
            with the windows that do not fit.
        pinned: rows of each table's cache held by pinned (FAE's hot) rows, which the stream's ids do not read
            (their batches come without them): its windows must fit in the rest, and a refusal speaks of the
            whole cache (the capacities given, the pinned rows besides the windows' need).

    Returns:
        The largest window working set per table (for a table alone, the smallest capacity that would do), and
        per shared slot space (of ``slot_spaces``, two tables or more) the largest window working set of its
        tables together, which is what the space's capacity (the sum of its members') must hold.

    Raises:
        CapacityError: a window needs more rows than a table's capacity, or a ``shortfalls`` cache held more,
            once the whole stream is read: names the first such window, the rows it needs and the rows
            available, and the largest need of each short cache over the stream, what its capacity must hold
            (``needed``: the named cache's; ``batch``: its first window that does not fit); else a window needs
            more rows on a shard than its host tier holds (``tier="host"``, the same facts).
        InvalidIdError: an id of a cached table, or of a resident feature, is negative or not below the table's
            size (names the table, the batch and the id; for a resident table the feature too).

    Example:
        >>> import torch
        >>> five = torch.tensor([5])
        >>> stream = [{"f": torch.tensor([1, 2]), "g": five}, {"f": torch.tensor([3]), "g": five}]
        >>> caps, features = {"t": 2, "u": 2}, {"f": "t", "g": "u"}
        >>> scan_stream(stream, caps, features, {"t": 10, "u": 10}, 1, slot_spaces={"s": ("t", "u")})
        ({'t': 3, 'u': 1}, {'s': 4})
    """
    names = sorted(capacity)
    best = {n: 0 for n in names}
    first: Dict[str, Tuple[int, int, int]] = {}
    # a cache: a table alone, or the tables of a shared slot space (their id ranges are disjoint, so the space's
    # window needs the sum of theirs)
    spaces = {
        name: tuple(m)
        for name, m in (slot_spaces or {}).items()
        if len(m) > 1 and all(t in capacity for t in m)
    }
    shared = list(spaces.values())
    in_space = {t for members in shared for t in members}
    caches = [(n,) for n in names if n not in in_space] + shared
    cache_best = {members: 0 for members in caches}
    held_rows = {t: int(n) for t, n in (pinned or {}).items()}
    host = HostWindowCheck({t: w for t, w in (host_windows or {}).items() if t in capacity})
    host_first: Dict[str, HostShortfall] = {}

    resident = dict(resident_features or {})
    by_feature = {f: f for f in resident}

    def cached_ids() -> Iterator[Dict[str, np.ndarray]]:
        for step, batch in enumerate(batches):
            if resident:
                _check_resident(table_ids(batch, by_feature, unknown=UnknownFeatures.IGNORE), resident, step)
            parts = split_batch(batch, names, feature_to_table, False, UnknownFeatures.IGNORE)
            yield {n: parts[n][0] for n in names}

    for step, sets in window_working_sets(cached_ids(), prefetch_depth):
        for n, (uniq, need) in sets.items():
            if uniq.size and (int(uniq[0]) < 0 or int(uniq[-1]) >= int(num_embeddings[n])):
                bad = int(uniq[0]) if int(uniq[0]) < 0 else int(uniq[-1])
                raise InvalidIdError(
                    f"table {n!r}: batch {step} holds id {bad} outside [0, {int(num_embeddings[n])}); remap or "
                    "hash ids into the table before training",
                    table=n,
                    batch=step,
                    id=bad,
                    num_rows=int(num_embeddings[n]),
                )
            best[n] = max(best[n], need)
        for members in caches:
            need = sum(sets[t][1] for t in members)
            cache_best[members] = max(cache_best[members], need)
            if (
                need > sum(int(capacity[t]) - held_rows.get(t, 0) for t in members)
                and members[0] not in first
            ):
                first[members[0]] = (max(step - prefetch_depth, 0), step, need)
        if host:
            for found in host.push({n: sets[n][0] for n in host.tables}):
                host_first.setdefault(found.table, found)
    short = shortfalls() if shortfalls is not None else {}
    key = {m: (m[0] if len(m) == 1 else next(k for k, v in spaces.items() if v == m)) for m in caches}
    held = {m: short[key[m]] for m in caches if key[m] in short}
    if first or held:
        _refuse(first, held, caches, cache_best, key, capacity, prefetch_depth, held_rows)
    if host_first:
        largest = host.largest
        first_short, *others = (host_first[t] for t in sorted(host_first))
        raise first_short.error({t: largest[t] for t in sorted(host_first)}, others)
    return best, {k: cache_best[m] for k, m in spaces.items()}


def _refuse(
    first: Mapping[str, Tuple[int, int, int]],
    held: Mapping[Tuple[str, ...], Shortfall],
    caches: Sequence[Tuple[str, ...]],
    cache_best: Mapping[Tuple[str, ...], int],
    key: Mapping[Tuple[str, ...], str],
    capacity: Mapping[str, int],
    prefetch_depth: int,
    pinned: Mapping[str, int],
) -> None:
    """Raise the scan's CapacityError: the first short cache's first window that does not fit (or where its
    ``ttl`` cache first held more), and the largest need of every short cache over the scanned stream."""
    short_caches = sorted(m for m in caches if m[0] in first or m in held)
    fixed = {m: sum(pinned.get(t, 0) for t in m) for m in short_caches}
    largest = {m: max(cache_best[m], held[m].peak if m in held else 0) + fixed[m] for m in short_caches}
    members = short_caches[0]
    n = members[0]
    available = sum(int(capacity[t]) for t in members)
    besides = (
        f" besides {'its' if len(members) == 1 else 'their'} {fixed[members]} pinned hot rows"
        if fixed[members]
        else ""
    )
    if n in first:
        lo, hi, need = first[n]
        what = f"{describe_window(lo, hi, prefetch_depth)} need{'s' if lo == hi else ''} {need} cache rows{besides}"
    else:
        s = held[members]
        hi = s.first_batch
        what = f"policy 'ttl' needs {s.first_need} cache rows{besides} at batch {hi} (horizon {s.horizon})"
    what = (
        f"table {n!r}: {what} but capacity[{n!r}] is {available}"
        if len(members) == 1
        else f"{_shared_label(members)} (the sum of their capacities, {available} rows): {what} but it holds "
        f"{available}"
    )
    # a shared space's need is its tables' together (one table's share of it is no bound of its own)
    alone = {m[0]: largest[m] for m in short_caches if len(m) == 1}
    need_text = " and ".join(
        ([f"{alone} rows"] if alone else [])
        + [f"{largest[m]} rows for tables {list(m)} together" for m in short_caches if len(m) > 1]
    )
    ttl = [held[m] for m in short_caches if m in held]
    lead = "the scanned batches need at most" if ttl else "the scanned batches' largest windows need"
    if any(fixed.values()):
        need_text += " (pinned hot rows included)"
    if ttl:
        need_text += (
            f" (policy 'ttl' keeps each row used again within its horizon of {ttl[0].horizon} batches)"
        )
    raise CapacityError(
        f"{what}; {lead} {need_text}: raise those capacities, lower prefetch_depth{' or the horizon' if ttl else ''}"
        ", or use smaller batches (found before training by LookaheadDataModule(capacity_check='epoch'))",
        table=key[members],
        batch=hi,
        needed=largest[members],
        available=available,
    )
