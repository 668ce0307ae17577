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


class _Exited(Exception):
    pass


def test_a_rank_whose_peer_died_says_so_in_one_line_of_its_own_with_its_rank(monkeypatch, capsys):
    """gloo's message of a killed peer is quoted up to its first sentence (not cut mid-word), on a line of its own
    after an open progress bar, prefixed with the rank like every other error of a rank other than 0."""
    import atexit
    import os

    import pytest
    import torch.distributed as dist
    from tqdm import tqdm

    from torchrec_lookahead import launch

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 2)
    monkeypatch.setattr(launch, "_rank", lambda: 1)
    monkeypatch.setattr(atexit, "_run_exitfuncs", lambda: None)
    codes = []

    def _exit(code):
        codes.append(code)
        raise _Exited

    monkeypatch.setattr(os, "_exit", _exit)
    gloo = (
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:34499: "
        "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application. "
        "Check the logs of the remote worker before reporting an error."
    )
    bar = tqdm(total=10, desc="Epoch 0")
    try:
        with pytest.raises(_Exited), launch.fail_fast_on_error():
            raise RuntimeError(gloo)
    finally:
        bar.close()
    assert codes == [1]
    lines = capsys.readouterr().err.split("\n")
    line = next(x for x in lines if "RuntimeError" in x)
    assert line == (
        "[rank 1] RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
        "[127.0.0.1]:34499: Connection reset by peer (another rank ended: its own error, or torchrun's report, says "
        "why)"
    )


def test_ckpt_path_last_under_torchrun_restarts_without_a_fixed_checkpoint_directory_is_refused(tmp_path):
    """A restarted attempt logs to a new version_N: a ModelCheckpoint under the logger's version would never be
    found by --ckpt_path=last, and the attempt would train from the start. Refused before anything is built; with a
    dirpath the same job trains."""
    import subprocess
    import sys

    from ..conftest import REPO
    from .test_cli import clean_env

    env = {**clean_env(), "TORCHELASTIC_MAX_RESTARTS": "1"}
    args = [
        sys.executable, "-m", "torchrec_lookahead", "fit", "--config", "configs/dlrm_tiny_lookahead.yaml",
        "--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.save_last=true", "--ckpt_path=last",
        "--trainer.max_steps=1", f"--trainer.default_root_dir={tmp_path / 'logs'}",
    ]  # fmt: skip
    refused = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert refused.returncode == 1
    assert (
        refused.stderr.strip()
        .splitlines()[-1]
        .startswith(
            "ConfigError: --ckpt_path=last under torchrun --max-restarts: "
            "ModelCheckpoint(save_last=True) has no dirpath"
        )
    ), refused.stderr[-2000:]
    assert not (tmp_path / "logs").exists()  # before anything is built
    fixed = [*args, f"--trainer.callbacks.dirpath={tmp_path / 'ckpts'}"]
    trained = subprocess.run(fixed, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert trained.returncode == 0, trained.stderr[-2000:]
    assert (tmp_path / "ckpts" / "last.ckpt").exists()


def test_a_full_disk_under_the_logs_is_one_config_error_line_naming_the_file(tmp_path, capsys):
    """fsspec writing config.yaml, TensorBoard writing its events: ENOSPC was a traceback; it is one line naming
    the file (or the logger's directory when the error names none) and the bytes free there."""
    import errno
    from types import SimpleNamespace

    import pytest

    from torchrec_lookahead import launch

    trainer = SimpleNamespace(
        logger=SimpleNamespace(log_dir=str(tmp_path / "version_0")), default_root_dir="."
    )
    for error, where in [
        (
            OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "config.yaml")),
            tmp_path / "config.yaml",
        ),
        (OSError(errno.ENOSPC, "No space left on device"), tmp_path / "version_0"),
    ]:
        with pytest.raises(SystemExit):
            with launch.short_lookahead_errors(), launch.full_disk_refused(trainer):  # type: ignore[arg-type]
                raise RuntimeError("while logging") from error
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"ConfigError: no space left on device writing {where} ("), err
        assert "bytes free there" in err and "\n" not in err
    with pytest.raises(ValueError, match="other"):
        with launch.full_disk_refused(trainer):  # type: ignore[arg-type]
            raise ValueError("other")


def _summary(capsys, save_dir: str, metrics: dict) -> str:
    from types import SimpleNamespace

    import torch

    from torchrec_lookahead.launch import LookaheadCLI

    logger = SimpleNamespace(log_dir=f"{save_dir}/lightning_logs/version_0", save_dir=save_dir)
    trainer = SimpleNamespace(
        is_global_zero=True, logger=logger, callback_metrics={k: torch.tensor(v) for k, v in metrics.items()}
    )
    LookaheadCLI._summary(SimpleNamespace(trainer=trainer))  # type: ignore[arg-type]
    return capsys.readouterr().out


def test_the_tensorboard_command_quotes_a_directory_with_spaces(capsys):
    out = _summary(capsys, "/tmp/my runs", {"train/loss": 0.5})
    assert "  open them with: tensorboard --logdir '/tmp/my runs'\n" in out, out


def test_final_metrics_show_the_aggregates_and_count_the_per_table_ones(capsys):
    """~160 per-table cache metrics on the Criteo configs drowned the line."""
    metrics = {
        "train/loss": 0.5,
        "val/auroc": 0.75,
        "cache/hit_rate": 0.25,
        "cache/sync/grad_floats_sent": 8.0,
    }
    metrics.update({f"cache/t_cat_{i}/{m}": 1.0 for i in range(3) for m in ("hit_rate", "occupancy")})
    out = _summary(capsys, "/tmp/r", metrics)
    line = next(x for x in out.splitlines() if x.startswith("Final metrics:"))
    assert line == (
        "Final metrics: cache/hit_rate=0.2500, cache/sync/grad_floats_sent=8.0000, train/loss=0.5000, "
        "val/auroc=0.7500 (and 6 per-table metrics, cache/<table>/..., in TensorBoard)"
    ), line  # the rank's synchronisation totals (cache/sync/...) are aggregates


def test_a_busy_master_port_under_lightnings_launcher_is_one_line_and_starts_no_other_rank(tmp_path):
    """Rank 0 printed a 55-line DistNetworkError (EADDRINUSE) after starting rank 1, which then hung."""
    import socket
    import subprocess
    import sys

    from ..conftest import REPO
    from .test_cli import clean_env

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        args = [
            sys.executable, "-m", "torchrec_lookahead", "fit", "--config", "configs/dlrm_tiny_lookahead.yaml",
            "--trainer.devices=2", f"--trainer.default_root_dir={tmp_path}",
        ]  # fmt: skip
        env = {**clean_env(), "MASTER_PORT": str(port)}
        out = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    finally:
        busy.close()
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert lines[-1].startswith(f"ConfigError: MASTER_PORT {port} is in use on this machine"), out.stderr[
        -3000:
    ]
    assert "Traceback" not in out.stderr and "[rank 1]" not in out.stderr, out.stderr[-3000:]
