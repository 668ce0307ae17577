"""AvazuParser and AvazuDataModule: Avazu CTR ``train.csv`` (header by column names, label ``click``)."""

import pytest

from torchrec_lookahead import ConfigError, DataError
from torchrec_lookahead.data import AvazuDataModule
from torchrec_lookahead.data.readers import AVAZU_FEATURES

from ..conftest import shared_data

COLUMNS = (
    "id,click,hour,C1,banner_pos,site_id,site_domain,site_category,app_id,app_domain,app_category,device_id,"
    "device_ip,device_model,device_type,device_conn_type,C14,C15,C16,C17,C18,C19,C20,C21"
).split(",")
HEADER = ",".join(COLUMNS)
#: the first row of Avazu's train.csv
GOOD = (
    "1000009418151094273,0,14102100,1005,0,1fbe01fe,f3845767,28905ebd,ecad2386,7801e8d9,07d7df22,a99f214a,"
    "ddd2926e,44956a24,1,2,15706,320,50,1722,0,35,-1,79"
)


def _write(tmp_path, lines, name="train.csv"):
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n")
    return str(p)


def _batches(dm):
    dm.setup("fit")
    return list(dm.train_dataloader())


def _with(row: str, column: str, value: str) -> str:
    f = row.split(",")
    f[COLUMNS.index(column)] = value
    return ",".join(f)


def test_good_rows_give_hashed_ids_hour_of_day_day_of_week_and_click(tmp_path):
    clicked = _with(_with(GOOD, "click", "1"), "hour", "14102517")  # Saturday 2014-10-25, 17:00
    path = _write(tmp_path, [HEADER, GOOD, clicked])
    dm = AvazuDataModule(path, num_embeddings=[1000] * 22, batch_size=4)
    assert list(dm.num_embeddings_per_feature) == AVAZU_FEATURES and dm.num_dense_features == 1
    (b,) = _batches(dm)
    assert b.labels.tolist() == [0.0, 1.0]
    kjt = b.sparse_features
    assert kjt.keys() == AVAZU_FEATURES
    assert kjt["site_id"].values().tolist() == [int("1fbe01fe", 16) % 1000] * 2  # hexadecimal, as Criteo's
    assert kjt["C14"].values().tolist() == [706, 706]  # integers: 15706 % 1000
    assert kjt["C20"].values().tolist() == [999, 999]  # -1 % 1000
    assert kjt["hour_of_day"].values().tolist() == [0, 17]
    assert b.dense_features.flatten().tolist() == pytest.approx([1 / 7, 5 / 7])  # Tuesday, Saturday


def test_header_columns_are_found_by_name(tmp_path):
    order = list(reversed(COLUMNS)) + ["extra"]
    values = dict(zip(COLUMNS, GOOD.split(",")))
    values["extra"] = "x"
    shuffled = _write(tmp_path, [",".join(order), ",".join(values[c] for c in order)], "shuffled.csv")
    plain = _write(tmp_path, [HEADER, GOOD], "plain.csv")
    (a,) = _batches(AvazuDataModule(shuffled, batch_size=2))
    (b,) = _batches(AvazuDataModule(plain, batch_size=2))
    assert a.sparse_features.values().tolist() == b.sparse_features.values().tolist()
    assert a.labels.tolist() == b.labels.tolist() and a.dense_features.tolist() == b.dense_features.tolist()


def test_num_embeddings_by_name_and_bad_sizes(tmp_path):
    path = _write(tmp_path, [HEADER, GOOD])
    sizes = {name: 7 for name in AVAZU_FEATURES}
    assert AvazuDataModule(path, num_embeddings=sizes).num_embeddings_per_feature == sizes
    with pytest.raises(ConfigError, match="Expected 22 table sizes"):
        AvazuDataModule(path, num_embeddings=[10, 10])
    with pytest.raises(ConfigError, match=r"num_embeddings has no size for feature\(s\) \['hour_of_day'\]"):
        AvazuDataModule(path, num_embeddings={n: 7 for n in AVAZU_FEATURES[:-1]})


@pytest.mark.parametrize(
    "column, value, match",
    [
        ("click", "2", "click must be 0 or 1 but got '2'"),
        ("click", "", "click must be 0 or 1 but got ''"),
        ("hour", "141021", r"hour must be YYMMDDHH \(as 14102100\) but got '141021'"),
        ("hour", "14102124", "hour must be YYMMDDHH"),
        ("hour", "14023100", "hour must be YYMMDDHH"),  # 31 February
        ("site_id", "zz", "categorical feature site_id is not hexadecimal: 'zz'"),
        ("C14", "1fbe", "categorical feature C14 is not an integer: '1fbe'"),
    ],
)
def test_bad_value_names_file_and_line(tmp_path, column, value, match):
    path = _write(tmp_path, [HEADER, GOOD, GOOD, _with(GOOD, column, value)])
    with pytest.raises(DataError, match=match) as err:
        _batches(AvazuDataModule(path, batch_size=8))
    assert f"{path}:4: " in str(err.value)


def test_wrong_field_count_is_found_when_the_rows_are_counted(tmp_path):
    path = _write(tmp_path, [HEADER] + [GOOD] * 3 + [GOOD + ",1"])
    with pytest.raises(DataError) as err:
        AvazuDataModule(path, batch_size=2).setup("fit")  # before any batch is read
    assert (
        str(err.value) == f"{path}:5: expected 24 comma-separated fields (as in the header line) but got 25"
    )


@pytest.mark.parametrize(
    "header, match",
    [
        (
            None,
            r"train.csv:1: the first line '1000009418151094273,.* is not Avazu's header line; an Avazu ",
        ),
        (
            HEADER.replace(",hour,", ",time,"),
            "train.csv:1: the first line lacks the column.s. hour; an Avazu ",
        ),
        (HEADER.replace(",", "\t"), "holds tabs: Avazu files are comma-separated"),
    ],
)
def test_file_without_its_header_line_is_a_data_error(tmp_path, header, match):
    path = _write(tmp_path, ([header] if header else []) + [GOOD, GOOD])
    with pytest.raises(DataError, match=match) as err:
        AvazuDataModule(path).setup("fit")
    assert str(err.value).endswith(f"starts with the header line {HEADER} (columns in any order): add it")


def test_avazu_real_sample():
    path = shared_data("avazu_head", "avazu_train_head_8999.csv")
    dm = AvazuDataModule(str(path), batch_size=1024)
    batches = _batches(dm)
    assert sum(len(b.labels) for b in batches) == 8999
    assert sum(int(b.labels.sum()) for b in batches) == 1563  # the README's 1,563 clicks
    assert {v for b in batches for v in b.sparse_features["hour_of_day"].values().tolist()} == {0}
