"""The wheel ships the configs and the entry point; a bundled config runs by name from an installed wheel."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from torchrec_lookahead.bundled import bundled_configs, config_path, resolve_config_args
from torchrec_lookahead.errors import ConfigError

from .cli.test_cli import clean_env
from .conftest import REPO


def test_every_repository_config_is_bundled_and_names_resolve_to_it():
    assert bundled_configs() == sorted(p.stem for p in (REPO / "configs").glob("*.yaml"))
    for name in ("dlrm_tiny", "dlrm_tiny.yaml"):
        assert config_path(name).read_text() == (REPO / "configs" / "dlrm_tiny.yaml").read_text()
    argv = ["verify", "--config", "dlrm_tiny", "--config=dlrm_tiny_lookahead", "--steps", "2"]
    assert resolve_config_args(argv) == [
        "verify",
        "--config",
        str(config_path("dlrm_tiny")),
        f"--config={config_path('dlrm_tiny_lookahead')}",
        "--steps",
        "2",
    ]
    # paths and inline YAML pass through unchanged
    assert resolve_config_args(
        ["--config", "configs/dlrm_tiny.yaml", "--config", "{seed_everything: 1}"]
    ) == [
        "--config",
        "configs/dlrm_tiny.yaml",
        "--config",
        "{seed_everything: 1}",
    ]


def test_an_unknown_config_name_is_a_config_error_listing_the_bundled_ones(capsys):
    with pytest.raises(ConfigError, match="dlrm_tiny_lookahead"):
        config_path("dlrm_huge")
    from torchrec_lookahead.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["fit", "--config", "dlrm_huge"])
    assert stop.value.code == 1
    err = capsys.readouterr().err
    assert (
        err.startswith("ConfigError: No config file or bundled config named 'dlrm_huge'")
        and "dlrm_tiny" in err
    )


def _pip(*args: str, cwd: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args]
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]


@pytest.mark.slow
def test_the_wheel_ships_configs_and_entry_point_and_fits_a_bundled_config_by_name(tmp_path):
    # Build from a copy (setuptools writes build/ and *.egg-info beside the sources) without network access.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        (src / name).write_bytes((REPO / name).read_bytes())
    import shutil

    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO / "torchrec_lookahead", src / "torchrec_lookahead", symlinks=True, ignore=ignore)
    shutil.copytree(REPO / "configs", src / "configs", ignore=ignore)
    _pip(
        "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(tmp_path / "dist"), ".", cwd=src
    )
    (wheel,) = (tmp_path / "dist").glob("torchrec_lookahead-*.whl")

    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        shipped = {n.split("/")[-1] for n in names if n.startswith("torchrec_lookahead/configs/")}
        assert shipped == {p.name for p in (REPO / "configs").glob("*.yaml")}
        assert "torchrec_lookahead/py.typed" in names
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        assert "torchrec-lookahead = torchrec_lookahead.cli:main" in z.read(entry_points).decode()
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = z.read(metadata).decode()
        for extra in ("cpu", "cuda", "dev"):
            assert f"Provides-Extra: {extra}" in meta
        assert 'fbgemm-gpu-cpu==1.8.0; extra == "cpu"' in meta and "lightning" in meta

    # Install the wheel alone (its dependencies are this environment's) and run its script from elsewhere.
    site = tmp_path / "site"
    _pip("install", "--no-deps", "--no-index", "--target", str(site), str(wheel), cwd=tmp_path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {**clean_env(), "PYTHONPATH": str(site)}
    where = subprocess.run(
        [sys.executable, "-c", "import torchrec_lookahead; print(torchrec_lookahead.__file__)"],
        cwd=run_dir, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert where.stdout.strip().startswith(str(site)), where.stdout + where.stderr
    args = ["fit", "--config", "dlrm_tiny", "--trainer.max_steps=2", "--trainer.limit_val_batches=1"]
    done = subprocess.run(
        [str(site / "bin" / "torchrec-lookahead"), *args, f"--trainer.default_root_dir={run_dir / 'logs'}"],
        cwd=run_dir, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Final metrics:" in done.stdout and list((run_dir / "logs").rglob("events.out.tfevents.*"))
