"""The runtime's plug-in contracts: FAE's DataModule implements PinnedRowsSource, and the layers it plugs into
(data/, distributed/, strategies/, runtime/) import nothing of fae/."""

import ast
from pathlib import Path

import pytest

import torchrec_lookahead
from torchrec_lookahead.data import CriteoSyntheticDataModule, LookaheadDataModule
from torchrec_lookahead.fae import HotColdDataModule, PinnedRows
from torchrec_lookahead.runtime.types import PinnedPart, PinnedRowsSource

from ..conftest import tiny_data_args

PACKAGE = Path(torchrec_lookahead.__file__).parent


def _imported_modules(path: Path) -> set:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):  # function-level imports too
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


@pytest.mark.parametrize("layer", ["data", "distributed", "strategies", "runtime"])
def test_the_layers_fae_plugs_into_import_nothing_of_it(layer: str) -> None:
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        fae = sorted(m for m in _imported_modules(path) if m.split(".")[:2] == ["torchrec_lookahead", "fae"])
        assert not fae, f"{path.relative_to(PACKAGE)} imports {fae}"


def test_fae_implements_the_plug_in_contracts() -> None:
    inner = CriteoSyntheticDataModule(**tiny_data_args())
    assert isinstance(HotColdDataModule(inner, hot_budget_bytes=1 << 20), PinnedRowsSource)
    assert not isinstance(inner, PinnedRowsSource)
    assert not isinstance(LookaheadDataModule(inner), PinnedRowsSource)
    pins = PinnedRows({}, {"cat_0": "t_cat_0"}, {"t_cat_0": 4}, {"t_cat_0": 10})
    assert isinstance(pins, PinnedPart)
