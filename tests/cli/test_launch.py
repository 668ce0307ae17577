"""The commands share torchrec_lookahead.launch, and no command module imports the CLI's dispatcher back."""

import ast
import time
from pathlib import Path

import torchrec_lookahead

PACKAGE = Path(torchrec_lookahead.__file__).parent


def _imported_modules(path: Path) -> set:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_no_command_module_imports_the_cli_and_launch_imports_no_command():
    commands = ["verify", "export", "calibrate"]
    for name in commands:
        imported = _imported_modules(PACKAGE / f"{name}.py")
        assert "torchrec_lookahead.cli" not in imported, name
        assert "torchrec_lookahead.launch" in imported, name
    launch_imports = _imported_modules(PACKAGE / "launch.py")
    assert not {f"torchrec_lookahead.{n}" for n in [*commands, "cli"]} & launch_imports


def _no_wait(seconds: float) -> None:
    raise AssertionError(f"a rank waited {seconds} s before reporting its error")


def _report(monkeypatch, capsys, rank: str) -> str:
    import pytest

    from torchrec_lookahead import launch
    from torchrec_lookahead.errors import ConfigError

    monkeypatch.setattr(launch, "_rank", lambda: int(rank))  # a process group of an earlier test may be up
    monkeypatch.delenv(launch.TRACEBACK_ENV, raising=False)
    monkeypatch.setattr(time, "sleep", _no_wait)  # every rank reports at once: none waits for another
    with pytest.raises(SystemExit) as exit_info, launch.short_lookahead_errors():
        raise ValueError(
            f"Does not validate against any of the Union subtypes\n - {ConfigError('bad policy')}"
        )
    assert exit_info.value.code == 1
    return capsys.readouterr().err


def test_every_rank_reports_at_once_and_a_rank_other_than_zero_prefixes_its_rank(monkeypatch, capsys):
    from torchrec_lookahead.errors import ConfigError

    ConfigError("bad policy")  # recorded, as jsonargparse's Union check would have met it
    assert _report(monkeypatch, capsys, "0") == "ConfigError: bad policy\n"
    assert _report(monkeypatch, capsys, "1") == "[rank 1] ConfigError: bad policy\n"
    assert _report(monkeypatch, capsys, "3") == "[rank 3] ConfigError: bad policy\n"
