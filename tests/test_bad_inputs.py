"""Bad values of the number- and path-valued settings of the sharder, the DataModules and the strategies, through
the Python API: each is refused at construction with a ConfigError (a DataError for data files) naming the
setting, never a TypeError or ValueError from deep inside."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest

from torchrec_lookahead.data import (
    CriteoSyntheticDataModule,
    CriteoTSVDataModule,
    LookaheadDataModule,
    MovieLensDataModule,
    MovieLensHistoryDataModule,
)
from torchrec_lookahead.distributed import LookaheadEmbeddingBagCollectionSharder as Sharder
from torchrec_lookahead.errors import ConfigError, DataError
from torchrec_lookahead.strategies import HierarchicalStrategy, TorchRecStrategy


def _inner() -> CriteoSyntheticDataModule:
    return CriteoSyntheticDataModule(batch_size=4, num_train_batches=2)


def _disk(**options: Any) -> Sharder:
    return Sharder(store="disk", host_budget_bytes=1 << 20, disk_options=options)


NUMBERS = {
    "batch_size": lambda: CriteoSyntheticDataModule(batch_size="x"),
    "num_train_batches": lambda: CriteoSyntheticDataModule(num_train_batches="x"),
    "num_val_batches": lambda: CriteoSyntheticDataModule(num_val_batches="x"),
    "scale": lambda: CriteoSyntheticDataModule(scale="x"),
    "min_rows": lambda: CriteoSyntheticDataModule(min_rows="x"),
    "zipf_exponent": lambda: CriteoSyntheticDataModule(zipf_exponent="x"),
    "seed": lambda: CriteoSyntheticDataModule(seed="x"),
    "horizon": lambda: LookaheadDataModule(_inner(), horizon="x"),
    "prefetch_depth": lambda: LookaheadDataModule(_inner(), prefetch_depth="x"),
    "queue_depth": lambda: LookaheadDataModule(_inner(), queue_depth="x"),
    "ways": lambda: LookaheadDataModule(_inner(), ways="x"),
    "capacity_check_batches": lambda: LookaheadDataModule(_inner(), capacity_check_batches="x"),
    "capacity_check_seconds": lambda: LookaheadDataModule(_inner(), capacity_check_seconds="x"),
    "init_seed": lambda: TorchRecStrategy(init_seed="x"),
    "group_size": lambda: HierarchicalStrategy(group_size="x"),
    "sync_every": lambda: HierarchicalStrategy(sync_every="x"),
    "elastic_alpha": lambda: HierarchicalStrategy(elastic_alpha="x"),
    "host_budget_bytes": lambda: Sharder(store="disk", host_budget_bytes="lots"),
    "host_budget_bytes['t']": lambda: Sharder(store="disk", host_budget_bytes={"t": "lots"}),
    "device_budget_bytes": lambda: Sharder(device_budget_bytes="x"),
    "capacity of table 't'": lambda: Sharder(capacity={"t": "x"}),
    "cdlrm_average_every": lambda: Sharder(cdlrm_average_every="x"),
    "planner_options horizon": lambda: Sharder(device_budget_bytes=10, planner_options={"horizon": "x"}),
    "planner_options policy": lambda: Sharder(device_budget_bytes=10, planner_options={"policy": "fifo"}),
    "disk_options io_threads": lambda: _disk(io_threads="x"),
    "disk_prefetch_depth": lambda: _disk(host_policy="lookahead", disk_prefetch_depth="x"),
}


@pytest.mark.parametrize("setting", sorted(NUMBERS))
def test_a_string_where_a_number_belongs_is_a_config_error_naming_the_setting(setting):
    with pytest.raises(ConfigError) as e:
        NUMBERS[setting]()
    assert str(e.value).startswith(setting) or f"Expected {setting}" in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "options, expected",
    [
        ({"direct_io": "maybe"}, "disk_options direct_io must be one of true, false, null but got 'maybe'"),
        ({"direct_io": 0}, "disk_options direct_io must be one of true, false, null but got 0"),
        ({"preallocate": 3}, "disk_options preallocate must be one of true, false but got 3"),
        (
            {"disk_prefetch_depth": 2},
            "disk_options disk_prefetch_depth reads rows ahead under host_policy: lookahead",
        ),
    ],
)
def test_disk_options_that_would_be_read_otherwise_or_do_nothing_are_refused(options, expected):
    with pytest.raises(ConfigError) as e:
        _disk(**options)
    assert str(e.value).startswith(expected), str(e.value)
    _disk(direct_io=None, preallocate=False, host_policy="lookahead", disk_prefetch_depth=2)  # all valid


@pytest.fixture
def tsv(tmp_path: Path) -> str:
    path = tmp_path / "train.tsv"
    path.write_text("0\t" + "\t" * 38 + "\n")
    return str(path)


FILE_NUMBERS: dict[str, Callable[[str], Any]] = {
    "batch_size": lambda f: CriteoTSVDataModule(f, batch_size="x"),
    "Table size for feature 'cat_0'": lambda f: CriteoTSVDataModule(f, num_embeddings="x"),
    "history_length": lambda f: MovieLensHistoryDataModule(f, history_length="x"),
}


@pytest.mark.parametrize("setting", sorted(FILE_NUMBERS))
def test_a_string_for_a_file_data_module_number_is_a_config_error(tsv, setting):
    with pytest.raises(ConfigError, match=f"^{setting}"):
        FILE_NUMBERS[setting](tsv)


def test_a_directory_where_a_data_file_belongs_is_a_data_error(tmp_path, tsv):
    with pytest.raises(DataError, match=f"Data file '{tmp_path}' is a directory; name the data files in it"):
        CriteoTSVDataModule(str(tmp_path))
    with pytest.raises(DataError, match="is a directory"):
        MovieLensDataModule(tsv, movies_file=str(tmp_path))


def test_a_store_dir_that_is_a_file_is_refused_by_the_sharder(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="store_dir '.*file' is a file, not a directory"):
        Sharder(store="disk", host_budget_bytes=1 << 20, store_dir=str(blocker))
    with pytest.raises(ConfigError, match="store_dir must be a directory's path but got 3"):
        Sharder(store="mmap", store_dir=3)  # type: ignore[arg-type]
    Sharder(
        store="disk", host_budget_bytes=1 << 20, store_dir=str(tmp_path / "new")
    )  # made when the stores are
    assert not (tmp_path / "new").exists()


def test_a_hot_set_path_that_cannot_be_written_is_refused_before_calibrating(tmp_path):
    from torchrec_lookahead.fae import HotColdDataModule

    with pytest.raises(ConfigError, match=f"hot_set '{tmp_path}' is a directory; name the file to write"):
        HotColdDataModule(_inner(), hot_budget_bytes=1 << 16, hot_set=str(tmp_path))
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="hot_set '.*hot.pt' cannot be written: '.*file' is a file"):
        HotColdDataModule(_inner(), hot_budget_bytes=1 << 16, hot_set=str(blocker / "hot.pt"))
