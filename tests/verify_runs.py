"""Several ``verify`` comparisons (cached against resident training) in one launch, sharing what they can: the
interpreter and its imports, the process group, and the resident run of every comparison whose resident side is
the same job (the same model, inner data, seed, steps and ranks: only the lookahead sharder differs).

Launched by the tests under torchrun (rank 0 writes ``<out>/<name>.json``, the result ``verify`` prints)::

    python -m torch.distributed.run --nproc_per_node=2 -m tests.verify_runs OUT JSON

with JSON a list of ``{"name": ..., "config": [yaml, ...], "steps": N, "overrides": [...], "tolerance": 0}``.
Each comparison's output starts with a line ``SECTION_MARK + name`` that rank 0 writes on stdout and on
stderr (:func:`section` cuts it out). :func:`shared_resident_runs` does the sharing in one process, for tests that call
``verify`` directly.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

SECTION_MARK = "=== verify run: "

Trained = Tuple[Dict[str, Any], List[float], List[str]]


def _resident_job(cli: Any, steps: int, seed: int) -> str:
    """What the resident side of ``verify`` trains, as a key: the model, the data module it reads (the one inside
    a ``LookaheadDataModule``), the seed, the steps and the Trainer settings ``verify`` takes over (accelerator,
    devices, nodes, the strategy without its sharders, the callbacks); the lookahead sharders are left out."""
    cfg = cli.config.clone().as_dict()
    trainer = cfg.get("trainer") or {}
    strategy = trainer.get("strategy")
    if isinstance(strategy, dict):
        strategy = {**strategy, "init_args": dict(strategy.get("init_args") or {})}
        strategy["init_args"].pop("sharders", None)
    data = cfg.get("data") or {}
    if str(data.get("class_path", "")).endswith(".LookaheadDataModule"):
        data = (data.get("init_args") or {}).get("datamodule")
    job = {
        "model": cfg.get("model"),
        "data": data,
        "seed": seed,
        "steps": steps,
        "trainer": {k: trainer.get(k) for k in ("accelerator", "devices", "num_nodes", "callbacks")},
        "strategy": strategy,
    }
    return json.dumps(job, sort_keys=True, default=str)


@contextlib.contextmanager
def shared_resident_runs(memo: Optional[Dict[str, Trained]] = None) -> Iterator[Dict[str, Trained]]:
    """Within the block, ``verify`` trains each resident job once (by :func:`_resident_job`) and compares later
    cached runs with the weights and losses it kept. Resident training is deterministic (the comparisons check
    it bit for bit), so a kept run is the run ``verify`` would train again."""
    import torchrec_lookahead.verify as verify_module

    train = verify_module._train
    kept: Dict[str, Trained] = {} if memo is None else memo

    def train_once(cli: Any, resident: bool, steps: int, seed: int) -> Trained:
        if not resident:
            return train(cli, resident, steps, seed)
        key = _resident_job(cli, steps, seed)
        if key not in kept:
            kept[key] = train(cli, resident, steps, seed)
        weights, losses, notes = kept[key]
        return weights, list(losses), list(notes)

    verify_module._train = train_once  # type: ignore[assignment]
    try:
        yield kept
    finally:
        verify_module._train = train  # type: ignore[assignment]


def section(text: str, name: str) -> str:
    """The part of a launch's stdout or stderr that comparison ``name`` printed."""
    start = text.find(SECTION_MARK + name + "\n")
    assert start >= 0, f"no output of run {name!r}"
    end = text.find(SECTION_MARK, start + len(SECTION_MARK))
    return text[start : end if end >= 0 else len(text)]


def launch(
    out: Path, runs: List[Dict[str, Any]], nproc: int = 2, timeout: int = 1800
) -> Tuple[Dict[str, Dict[str, Any]], Any]:
    """Run ``runs`` in one torchrun launch of ``nproc`` ranks: each run's result by name, and the finished
    process (its ``stdout`` and ``stderr`` hold every run's :func:`section`)."""
    import subprocess

    from .cli.test_cli import clean_env
    from .conftest import REPO, free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
           "-m", "tests.verify_runs", str(out), json.dumps(runs)]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=clean_env())
    assert done.returncode == 0, done.stderr[-4000:] + done.stdout[-2000:]
    return {r["name"]: json.loads(Path(out, f"{r['name']}.json").read_text()) for r in runs}, done


def selected(request: Any, runs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The runs of ``request``'s module whose test (a run is named after the test that checks it) was selected:
    ``pytest -k`` of one test launches its run only."""
    names = {item.name for item in request.session.items if getattr(item, "module", None) is request.module}
    return [r for r in runs if r["name"] in names]


def main(out: str, runs: str) -> None:
    import torch.distributed as dist

    from torchrec_lookahead.launch import shutdown_distributed
    from torchrec_lookahead.verify import verify

    with shared_resident_runs():
        for spec in json.loads(runs):
            if os.environ.get("RANK", "0") == "0":  # rank 0 logs (the process group starts in the first fit)
                for stream in (sys.stdout, sys.stderr):
                    stream.write(f"{SECTION_MARK}{spec['name']}\n")
                    stream.flush()
            result = verify(
                spec["config"], spec["steps"], spec.get("tolerance", 0.0), spec.get("overrides", [])
            )
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                holder = [result]
                dist.broadcast_object_list(holder, src=0)  # rank 0 holds the whole comparison
                result = holder[0]
            if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
                Path(out, f"{spec['name']}.json").write_text(json.dumps(result))
    shutdown_distributed(exit_code=0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
