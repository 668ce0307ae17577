"""The calibrator's result: the hot rows of every table, their cost, and the share of traffic they take.

A :class:`HotSet` is saved once per dataset (``torch.save`` of plain values: ``hot_ids`` maps a table name to
its sorted int64 hot ids; the rest is metadata) and loaded by training runs, which check it against the model.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Mapping, Sequence

import torch

from torchrec_lookahead._checks import share_as_created
from torchrec_lookahead.errors import CheckpointError, ConfigError, InvalidIdError, LookaheadError, first_line

__all__ = ["HotTable", "HotSet", "table_name", "format_table", "fingerprint"]

_FORMAT = "torchrec_lookahead.hotset"
_VERSION = 1


def table_name(feature: str) -> str:
    """The table of a feature, as :func:`~torchrec_lookahead.models.dlrm.make_table_configs` names it."""
    return f"t_{feature}"


@dataclass
class HotTable:
    """The hot part of one table.

    Attributes:
        name: table name.
        feature: the sparse feature that reads the table.
        num_embeddings: rows of the table.
        hot_ids: sorted int64 ids of the hot rows.
        cutoff: sampled accesses a row needs to be hot (``ceil(threshold * sampled_accesses)``; 0 for small
            tables).
        estimated_hot_rows: the Rand-Em Box's upper bound at the chosen threshold (all rows for small tables).
        small: the table is under ``small_table_bytes`` and wholly hot.
        row_bytes: bytes of one hot row (weights plus optimizer state).
        sampled_accesses: accesses into the table in the sample.
        hot_accesses: sampled accesses whose row is hot even without that access (a leave-one-out estimate
            of the hot accesses on unseen data; every access for small tables).
    """

    name: str
    feature: str
    num_embeddings: int
    hot_ids: torch.Tensor
    cutoff: int
    estimated_hot_rows: int
    small: bool
    row_bytes: int
    sampled_accesses: int
    hot_accesses: int

    @property
    def hot_rows(self) -> int:
        """Rows marked hot (exact)."""
        return int(self.hot_ids.numel())

    @property
    def hot_bytes(self) -> int:
        """Bytes the hot rows take on every rank."""
        return self.hot_rows * self.row_bytes

    @property
    def access_share(self) -> float:
        """Expected share of the table's accesses that hit hot rows (leave-one-out over the sample)."""
        return self.hot_accesses / self.sampled_accesses if self.sampled_accesses else 0.0

    def mask(self) -> torch.Tensor:
        """A bool per row: hot or not."""
        m = torch.zeros(self.num_embeddings, dtype=torch.bool)
        m[self.hot_ids] = True
        return m

    def _meta(self) -> Dict[str, Any]:
        d = asdict(self)
        d.pop("hot_ids")
        d.pop("name")
        return d


def format_table(
    title: str, header: Sequence[str], rows: Sequence[Sequence[str]], notes: Sequence[str]
) -> str:
    """A ``#``-framed text table in the style of TorchRec's planner report."""
    widths = (
        [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
        if rows
        else [len(h) for h in header]
    )

    def line(cells: Sequence[str]) -> str:
        return " | ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    body = [line(header), "-+-".join("-" * w for w in widths)] + [line(r) for r in rows]
    inner = max([len(title)] + [len(b) for b in body] + [len(n) for n in notes])
    bar = "#" * (inner + 4)
    out = [bar, "# " + title.center(inner) + " #"]
    out += ["# " + b.ljust(inner) + " #" for b in body]
    out += ["# " + " " * inner + " #"] + ["# " + n.ljust(inner) + " #" for n in notes] + [bar]
    return "\n".join(out)


def _mib(b: float) -> str:
    return f"{b / (1 << 20):.2f} MiB"


@dataclass
class HotSet:
    """Hot rows per table chosen by the calibrator for a memory budget.

    Attributes:
        tables: table name -> its hot part, in feature order.
        threshold: the access threshold ``t`` (a share of each table's sampled accesses).
        hot_budget_bytes: the per-rank budget the hot rows were fitted to.
        hot_sample_share: expected share of samples whose every id is hot (leave-one-out over the sample).
        sampled_samples: samples in the calibration sample.
        seconds: wall time of the calibration.
        config: the calibration settings, for the record.

    Example:
        >>> t = HotTable("t_a", "a", 4, torch.tensor([1, 3]), 2, 2, False, 8, 10, 9)
        >>> hs = HotSet({"t_a": t}, 0.2, 64, 0.8, 10, 0.0)
        >>> hs.hot_rows, hs.hot_bytes, round(hs.hot_access_share, 2)
        ({'t_a': 2}, 16, 0.9)
    """

    tables: Dict[str, HotTable]
    threshold: float
    hot_budget_bytes: int
    hot_sample_share: float
    sampled_samples: int
    seconds: float
    config: Dict[str, Any] = field(default_factory=dict)

    @property
    def hot_rows(self) -> Dict[str, int]:
        """Exact hot rows per table."""
        return {n: t.hot_rows for n, t in self.tables.items()}

    @property
    def estimated_hot_rows(self) -> Dict[str, int]:
        """Rand-Em Box upper bounds per table."""
        return {n: t.estimated_hot_rows for n, t in self.tables.items()}

    @property
    def hot_bytes(self) -> int:
        """Bytes of all hot rows (per rank)."""
        return sum(t.hot_bytes for t in self.tables.values())

    @property
    def hot_access_share(self) -> float:
        """Expected share of all accesses that hit hot rows (leave-one-out over the sample)."""
        total = sum(t.sampled_accesses for t in self.tables.values())
        return sum(t.hot_accesses for t in self.tables.values()) / total if total else 0.0

    def masks(self) -> Dict[str, torch.Tensor]:
        """Feature name -> bool per row of its table (hot or not)."""
        return {t.feature: t.mask() for t in self.tables.values()}

    def check_model(self, num_embeddings_per_feature: Mapping[str, int]) -> None:
        """Refuse a hot set calibrated for other tables.

        Raises:
            ConfigError: the features or the table sizes differ.
        """
        mine = {t.feature: t.num_embeddings for t in self.tables.values()}
        theirs = {str(f): int(n) for f, n in num_embeddings_per_feature.items()}
        if set(mine) != set(theirs):
            raise ConfigError(
                f"The hot set is for features {sorted(mine)} but the model has {sorted(theirs)}; recalibrate "
                "(python -m torchrec_lookahead calibrate --config <yaml> --save <path>)"
            )
        for f, n in theirs.items():
            if mine[f] != n:
                raise ConfigError(
                    f"The hot set's table for feature '{f}' has {mine[f]} rows but the model's has {n}; "
                    "recalibrate for this model (python -m torchrec_lookahead calibrate --config <yaml> --save <path>)"
                )

    def check_budget(self, config: Any) -> None:
        """Refuse a hot set calibrated for another budget or row size than ``config``
        (a :class:`~torchrec_lookahead.fae.CalibrationConfig`).

        Raises:
            ConfigError: the budget or the bytes per row differ.
        """
        row_bytes = {t.row_bytes for t in self.tables.values()}
        if self.hot_budget_bytes != config.hot_budget_bytes or row_bytes - {config.row_bytes}:
            raise ConfigError(
                f"The hot set was calibrated for hot_budget_bytes={self.hot_budget_bytes} and {sorted(row_bytes)} "
                f"bytes per row but the configuration asks for {config.hot_budget_bytes} and {config.row_bytes}; "
                "delete the file so that it is recalibrated, or recalibrate "
                "(python -m torchrec_lookahead calibrate --config <yaml>)"
            )

    def summary(self) -> Dict[str, Any]:
        """The figures as plain values (what ``calibrate --json`` writes)."""
        return {
            "threshold": self.threshold,
            "hot_budget_bytes": self.hot_budget_bytes,
            "hot_bytes": self.hot_bytes,
            "hot_rows": self.hot_rows,
            "estimated_hot_rows": self.estimated_hot_rows,
            "hot_access_share": self.hot_access_share,
            "hot_sample_share": self.hot_sample_share,
            "sampled_samples": self.sampled_samples,
            "seconds": self.seconds,
        }

    def report(self) -> str:
        """A text table of the hot set, framed like TorchRec's planner report."""
        header = ["table", "rows", "hot rows", "estimated", "hot bytes", "access share", "cutoff"]
        rows: List[List[str]] = []
        for t in self.tables.values():
            rows.append(
                [
                    t.name,
                    f"{t.num_embeddings:,}",
                    f"{t.hot_rows:,}",
                    f"{t.estimated_hot_rows:,}",
                    _mib(t.hot_bytes),
                    f"{100 * t.access_share:.1f}%",
                    "small: all" if t.small else f"{t.cutoff:,}",
                ]
            )
        total_rows = sum(t.num_embeddings for t in self.tables.values())
        notes = [
            f"threshold t = {self.threshold:.3e} of each table's sampled accesses",
            f"hot rows: {sum(self.hot_rows.values()):,} of {total_rows:,} "
            f"({100 * sum(self.hot_rows.values()) / max(total_rows, 1):.2f}%)",
            f"hot bytes per rank: {_mib(self.hot_bytes)} of a {_mib(self.hot_budget_bytes)} budget",
            f"hot share of sampled accesses: {100 * self.hot_access_share:.1f}%, "
            f"of samples: {100 * self.hot_sample_share:.1f}% ({self.sampled_samples:,} sampled)",
            f"calibration time: {self.seconds:.2f} s",
        ]
        return format_table("--- FAE hot set ---", header, rows, notes)

    def to_dict(self) -> Dict[str, Any]:
        """The hot set as a dict of plain values and int64 tensors (what :meth:`save` writes; a checkpoint can
        hold it, and :meth:`from_dict` reads it back)."""
        return {
            "format": _FORMAT,
            "version": _VERSION,
            "hot_ids": {n: t.hot_ids for n, t in self.tables.items()},
            "tables": {n: t._meta() for n, t in self.tables.items()},
            "threshold": self.threshold,
            "hot_budget_bytes": self.hot_budget_bytes,
            "hot_sample_share": self.hot_sample_share,
            "sampled_samples": self.sampled_samples,
            "seconds": self.seconds,
            "config": json.loads(json.dumps(self.config)),
        }

    def save(self, path: str) -> None:
        """Write the hot set to ``path`` atomically (a file ``torch.load`` reads as a dict of plain values).

        Raises:
            ConfigError: ``path`` cannot be written (its directory cannot be made, no permission, a full disk).
        """
        payload = self.to_dict()
        directory = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=directory, prefix="hotset-", suffix=".tmp")
        except OSError as e:
            raise ConfigError(
                f"cannot write the hot set to {path!r}: {e.strerror or e}; name a writable path"
            ) from None
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(payload, f)
            share_as_created(tmp)
            os.replace(tmp, path)
        except BaseException as e:
            if os.path.exists(tmp):
                os.remove(tmp)
            if isinstance(e, OSError):
                raise ConfigError(
                    f"cannot write the hot set to {path!r}: {e.strerror or e}; name a writable path"
                ) from None
            raise

    @classmethod
    def load(cls, path: str) -> HotSet:
        """Read a hot set written by :meth:`save`.

        Raises:
            CheckpointError: the file is missing or not a hot set.
            InvalidIdError: a hot id is out of its table's range, or the ids are not sorted and distinct.
        """
        if not os.path.isfile(path):
            raise CheckpointError(
                f"Hot set file not found: {path!r}; write it with "
                "python -m torchrec_lookahead calibrate --config <yaml> --save <path>"
            )
        try:
            d = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - damaged bytes fail in many ways
            # torch's message on a pickle of another kind runs to paragraphs (and suggests an unsafe load)
            first = first_line(e, 160, sentence=True) or type(e).__name__
            raise CheckpointError(
                f"{path!r} is not a readable hot set file ({type(e).__name__}: {first}): it is empty, truncated or "
                "not written by HotSet.save; write it again with python -m torchrec_lookahead calibrate --config "
                "<yaml> --save <path>"
            ) from e
        return cls.from_dict(d, where=repr(path))

    @classmethod
    def from_dict(cls, d: Any, where: str = "the hot set") -> HotSet:
        """Read a hot set from :meth:`to_dict`'s values.

        Example:
            >>> t = HotTable("t_a", "a", 4, torch.tensor([1, 3]), 2, 2, False, 8, 10, 9)
            >>> HotSet.from_dict(HotSet({"t_a": t}, 0.2, 64, 0.8, 10, 0.0).to_dict()).hot_rows
            {'t_a': 2}

        Raises:
            CheckpointError: ``d`` is not a hot set.
            InvalidIdError: a hot id is out of its table's range, or the ids are not sorted and distinct.
        """
        path = where
        if not isinstance(d, dict) or d.get("format") != _FORMAT or "hot_ids" not in d or "tables" not in d:
            raise CheckpointError(f"{path} is not a hot set written by HotSet.save() or HotSet.to_dict()")
        try:
            return cls._from_checked_dict(d, path)
        except LookaheadError:  # an id out of range, ... (InvalidIdError is a ValueError too)
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CheckpointError(
                f"{path} is a damaged hot set ({type(e).__name__}: {e}): a field is missing or of another type; "
                "write it again with python -m torchrec_lookahead calibrate --config <yaml> --save <path>"
            ) from None

    @classmethod
    def _from_checked_dict(cls, d: Dict[str, Any], path: str) -> HotSet:
        """:meth:`from_dict` past the format check (a missing or mistyped field raises Python's own errors)."""
        tables: Dict[str, HotTable] = {}
        for name, meta in d["tables"].items():
            ids = d["hot_ids"].get(name)
            if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 1:
                raise CheckpointError(f"{path}: table {name!r} has no int64 vector of hot ids")
            n = int(meta["num_embeddings"])
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
                bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
                raise InvalidIdError(
                    f"{path}: hot id {bad} of table {name!r} is out of range for its {n} rows (valid 0..{n - 1}); "
                    "recalibrate",
                    table=name,
                    id=bad,
                    num_rows=n,
                )
            if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
                raise InvalidIdError(
                    f"{path}: hot ids of table {name!r} are not sorted and distinct; recalibrate",
                    table=name,
                    num_rows=n,
                )
            tables[name] = HotTable(name=name, hot_ids=ids, **meta)
        return cls(
            tables=tables,
            threshold=float(d["threshold"]),
            hot_budget_bytes=int(d["hot_budget_bytes"]),
            hot_sample_share=float(d["hot_sample_share"]),
            sampled_samples=int(d["sampled_samples"]),
            seconds=float(d["seconds"]),
            config=dict(d.get("config", {})),
        )


def fingerprint(hs: HotSet) -> str:
    """A digest of ``hs``'s hot ids per table (SHA-256): equal for the same hot set, whatever file it came from.

    Example:
        >>> t = HotTable("t_a", "a", 4, torch.tensor([1, 3]), 2, 2, False, 8, 10, 9)
        >>> a = HotSet({"t_a": t}, 0.2, 64, 0.8, 10, 0.0)
        >>> fingerprint(a) == fingerprint(HotSet.from_dict(a.to_dict())), len(fingerprint(a))
        (True, 64)
    """
    digest = hashlib.sha256()
    for name in sorted(hs.tables):
        ids = hs.tables[name].hot_ids.to(torch.int64).contiguous().numpy()
        digest.update(name.encode("utf-8") + b"\0" + str(ids.size).encode("ascii") + b"\0" + ids.tobytes())
    return digest.hexdigest()
