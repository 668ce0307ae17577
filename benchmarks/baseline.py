"""Resident TorchRec training throughput on CPU for the default config (one process).

Every table is fully in memory (TorchRec's fused kernel through ``strategy="torchrec"``); the figure is
samples per second of whole training steps (data, forward, backward, fused embedding update, dense
optimizer), median over several runs.

    python benchmarks/baseline.py [--quick] [--json out.json]
"""

from __future__ import annotations

import os
import sys
from typing import Any, Dict, List

import lightning.pytorch as pl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import StepTimer, machine, median, parser, table, write_json  # noqa: E402
from torchrec_lookahead.launch import build_cli  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one_run(config: str, steps: int, warmup: int) -> Dict[str, float]:
    cli = build_cli(
        [
            "--config",
            config,
            "--trainer.logger=false",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_checkpointing=false",
            "--trainer.limit_val_batches=0",
            "--trainer.enable_model_summary=false",
        ]
    )
    timer = StepTimer(warmup=warmup)
    trainer = pl.Trainer(
        **{
            **{k: v for k, v in cli.config_init["trainer"].items() if k not in ("callbacks", "logger")},
            "max_steps": steps + warmup + 1,
            "callbacks": [timer],
            "logger": False,
        }
    )
    trainer.fit(cli.model, datamodule=cli.datamodule)
    batch = cli.datamodule.hparams["batch_size"]
    step = median(timer.times)
    return {"step_ms": step * 1e3, "samples_per_s": batch / step}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--config", default=os.path.join(REPO, "configs", "dlrm_synthetic.yaml"))
    p.add_argument("--runs", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    args = p.parse_args()
    runs = args.runs or (3 if args.quick else 5)
    steps = args.steps or (20 if args.quick else 60)
    results: List[Dict[str, Any]] = []
    for r in range(runs):
        res = one_run(args.config, steps, warmup=3)
        results.append({"run": r, **res})
    print(table(results))
    figures = {
        "samples_per_s": median([r["samples_per_s"] for r in results]),
        "step_ms": median([r["step_ms"] for r in results]),
        "runs": runs,
        "steps_per_run": steps,
        "config": os.path.relpath(args.config, REPO),
    }
    print(
        f"\nresident samples/s (median of {runs} runs): {figures['samples_per_s']:,.0f}  on {machine()['cpu']}"
    )
    write_json(args.json, figures)


if __name__ == "__main__":
    main()
