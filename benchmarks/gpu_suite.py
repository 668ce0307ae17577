"""Every GPU check and figure of the project in one bounded run: one JSON and one log.

Made for a lent GPU machine on which one command runs once (``scripts/gpu_check.sh`` installs the wheels first).
Each part runs in its own subprocess under its own timeout; a part that fails or times out is recorded (return
code, the tail of its output, what it had printed) and the next one runs. The JSON is rewritten after every
part, so a run cut short keeps what it had. Parts, in order of importance:

* ``env``: versions of Python, torch, fbgemm-gpu, torchrec and Lightning, the GPU, and one FBGEMM CUDA op;
* ``cuda_tests``: the tests marked ``cuda`` (``tests/modules/test_cuda.py``, ``tests/test_cuda_training.py``):
  per test its outcome and the differences it recorded;
* ``sync_checks``: ``tests/test_cuda_sync.py``: the default job's steady steps under torch's sync debug mode (every
  synchronising call recorded with its thread and the code that made it; one made by the cache on the training
  thread fails) and under the CUDA stream sanitizer;
* ``verify_default``: ``verify`` of ``configs/dlrm_lookahead.yaml`` on the GPU;
* ``verify_fae_adam``: ``verify`` of ``configs/dlrm_fae.yaml`` (pinned hot rows) with Adam on the GPU, 50 steps;
* ``two_ranks``: two ranks on the one GPU (gloo, CUDA tensors): the plain-TorchRec-loop comparison of
  ``tests/pipeline_runs.py``, and whether Lightning's ``verify`` can place two ranks on one GPU;
* ``bench_default``: ``benchmarks/gpu.py`` on the default job, TorchRec's UVM-caching anchor (``uvm_lru``,
  ``uvm_lfu``) included;
* ``bench_kaggle``: ``benchmarks/gpu.py --scale 1.0 --fraction 0.01 0.05`` (Kaggle-sized tables; the cached and
  UVM runs at 1 % and 5 % caches, the other runs at 1 %; not ``host``, whose Kaggle-sized figure is on record and
  costs 40 s), last, with the time left (a run cut short keeps the per-run rows it printed and the JSON of the
  runs it finished).

The whole run is bounded by ``--budget`` (450 s: under 8 minutes); each part by its own timeout (env 60 s,
cuda_tests 150 s, sync_checks 150 s, verify_default 90 s, verify_fae_adam 100 s, two_ranks 60 + 45 s, bench_default
130 s), the Kaggle-sized benchmark by the time left. A benchmark part's record carries its JSON (``figures``) and a
``summary``: the median step times, every ratio (``cached_over_uvm_lru``, ``rows_moved_cached_over_uvm_lru``, ...),
the measured host <-> device bandwidth (``link``) and per run the rows moved, hit rate and floor.
``--cpu-smoke`` runs the same parts on the CPU with tiny sizes (a check of the script: 2 to 5 minutes on a
2-core machine).

    python benchmarks/gpu_suite.py --out DIR [--cpu-smoke] [--budget SECONDS]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\d+\s*\|\s*\w+\s*\|\s*[\d,.]+\s*\|")  # a run's row as benchmarks/gpu.py prints it

ENV_PROBE = r"""
import json, platform, sys
out = {"python": sys.version.split()[0], "platform": platform.platform()}
import torch
out.update(torch=torch.__version__, torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    out.update(gpu=p.name, capability=list(torch.cuda.get_device_capability(0)),
               gpu_memory_gib=round(p.total_memory / 2**30, 1), multiprocessors=p.multi_processor_count)
import fbgemm_gpu
out["fbgemm_gpu"] = getattr(fbgemm_gpu, "__version__", "?")
out["fbgemm_variant"] = getattr(fbgemm_gpu, "__variant__", "?")
import torchrec, lightning, torchmetrics
from importlib.metadata import version
for name in ("torchrec", "lightning", "torchmetrics", "tensordict", "jsonargparse", "numpy"):
    try:
        out[name] = version(name)
    except Exception as e:
        out[name] = f"? {e}"
import torchrec_lookahead
out["torchrec_lookahead_file"] = torchrec_lookahead.__file__
dev = "cuda" if torch.cuda.is_available() else "cpu"
# one FBGEMM op on the device: fails with "no kernel image" if the wheel lacks this GPU's architecture
x = torch.tensor([1, 2, 3], dtype=torch.int64, device=dev)
out["fbgemm_cumsum"] = torch.ops.fbgemm.asynchronous_complete_cumsum(x).tolist()
print("ENV_JSON " + json.dumps(out))
"""


def _descendants(pid: int) -> List[int]:
    """Every process below ``pid`` (read from /proc; torchrun's workers may sit in sessions of their own)."""
    parent: Dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                parent[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    found, frontier = [], [pid]
    while frontier:
        children = [c for c, p in parent.items() if p in frontier]
        found += children
        frontier = children
    return found


def _stop_tree(proc: subprocess.Popen[Any]) -> None:
    """SIGTERM to the process, its group and every descendant; SIGKILL to what is left after 10 s."""
    pids = {proc.pid, *_descendants(proc.pid)}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is None:
            pids |= set(_descendants(proc.pid))
        for target in pids:
            try:
                os.kill(target, sig)
            except OSError:
                pass
        try:
            os.killpg(proc.pid, sig)
        except OSError:
            pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            proc.poll()  # reaps the child; orphaned grandchildren are reaped by init
            if not any(Path(f"/proc/{p}").exists() for p in pids):
                return
            time.sleep(0.5)


def _tail(text: str, n: int = 4000) -> str:
    return text[-n:]


def _json_lines(text: str) -> List[Dict[str, Any]]:
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


class Suite:
    def __init__(self, out_dir: Path, smoke: bool, budget: float) -> None:
        self.out_dir = out_dir
        self.smoke = smoke
        self.start = time.monotonic()
        self.deadline = self.start + budget
        self.result: Dict[str, Any] = {
            "mode": "cpu-smoke" if smoke else "gpu",
            "budget_s": budget,
            "commit": self._git("rev-parse", "HEAD"),
            "dirty": bool(self._git("status", "--porcelain")),
            "parts": {},
        }
        self.log = open(out_dir / "gpu_suite.log", "a", buffering=1)
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), self.env.get("PYTHONPATH", "")] if p)
        self.env.setdefault("PYTHONWARNINGS", "ignore")
        if smoke:
            self.env["TRL_TEST_DEVICE"] = "cpu"
            self.env["CUDA_VISIBLE_DEVICES"] = ""
        else:  # fbgemm-gpu links the driver's libnvidia-ml.so.1; where a container mounts the driver
            extra = [d for d in ("/usr/local/nvidia/lib64", "/usr/local/nvidia/lib") if os.path.isdir(d)]
            self.env["LD_LIBRARY_PATH"] = os.pathsep.join(
                [*filter(None, [self.env.get("LD_LIBRARY_PATH")]), *extra]
            )

    @staticmethod
    def _git(*args: str) -> Optional[str]:
        try:
            return subprocess.run(
                ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10
            ).stdout.strip()
        except Exception:
            return None

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        self.result["elapsed_s"] = round(time.monotonic() - self.start, 1)
        path = self.out_dir / "gpu_suite.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.result, indent=1, default=str))
        tmp.replace(path)

    def run(
        self, name: str, cmd: List[str], timeout: float, env: Optional[Dict[str, str]] = None
    ) -> Dict[str, Any]:
        """Run one command of a part under ``timeout`` (cut to the time left); record and log it.

        The output goes to ``<out>/<name>.out`` (not a pipe: a grandchild left holding a pipe open could block
        the read); on a timeout the whole process tree is stopped (SIGTERM, then SIGKILL)."""
        timeout = max(1.0, min(timeout, self.left()))
        self.log.write(f"\n===== {name}: {' '.join(cmd)} (timeout {timeout:.0f} s)\n")
        t0 = time.monotonic()
        rec: Dict[str, Any] = {"cmd": cmd, "timeout_s": round(timeout)}
        out_path = self.out_dir / f"{name}.out"
        with open(out_path, "w") as sink:
            proc = subprocess.Popen(
                cmd,
                cwd=REPO,
                env={**self.env, **(env or {})},
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                rec["rc"], rec["timed_out"] = proc.wait(timeout=timeout), False
            except subprocess.TimeoutExpired:
                _stop_tree(proc)
                rec["rc"], rec["timed_out"] = None, True
        output = out_path.read_text(errors="replace")
        rec["wall_s"] = round(time.monotonic() - t0, 1)
        self.log.write(output)
        self.log.write(
            f"\n----- {name}: rc {rec['rc']}, {rec['wall_s']} s{' (timed out)' if rec['timed_out'] else ''}\n"
        )
        rec["ok"] = rec["rc"] == 0
        rec["output_tail"] = _tail(output)
        rec["_output"] = output
        return rec

    def part(self, name: str, fn: Any) -> None:
        print(f"[{time.monotonic() - self.start:6.1f} s] {name} ...", flush=True)
        try:
            rec = fn()
        except Exception as e:  # the orchestrator itself must not stop
            rec = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        for r in [rec, *rec.get("runs", {}).values()] if isinstance(rec, dict) else []:
            if isinstance(r, dict):
                r.pop("_output", None)
        self.result["parts"][name] = rec
        self.save()
        print(
            f"[{time.monotonic() - self.start:6.1f} s] {name}: {'ok' if rec.get('ok') else 'FAILED'}",
            flush=True,
        )

    # ------------------------------------------------------------------------------------------------- parts
    def env_part(self) -> Dict[str, Any]:
        rec = self.run("env", [sys.executable, "-c", ENV_PROBE], 60)
        for line in rec["_output"].splitlines():
            if line.startswith("ENV_JSON "):
                rec["info"] = json.loads(line[len("ENV_JSON ") :])
        if shutil.which("nvidia-smi"):
            smi = self.run(
                "nvidia-smi",
                ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                15,
            )
            rec["nvidia_smi"] = smi["_output"].strip()
        rec["ok"] = rec["ok"] and "info" in rec
        return rec

    def cuda_tests(self) -> Dict[str, Any]:
        xml = self.out_dir / "cuda_tests.xml"
        xml.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "pytest", "-v", "-m", "cuda", "-p", "no:cacheprovider", "-rfEs",
               "tests/modules/test_cuda.py", "tests/test_cuda_training.py", "tests/benchmarks/test_gpu.py",
               f"--junitxml={xml}"]  # fmt: skip
        if importlib.util.find_spec("pytest_timeout") is not None:
            cmd.append("--timeout=100")  # one hung test fails alone
        if self.smoke:
            cmd += ["-k", "(sgd or pipeline or verify_tiny) and not export"]
        rec = self.run("cuda_tests", cmd, 120 if self.smoke else 150)
        rec["tests"] = _junit(xml) or _verbose_outcomes(rec["_output"])
        rec["summary"] = {
            k: sum(1 for t in rec["tests"].values() if t["outcome"] == k)
            for k in ("passed", "failed", "error", "skipped")
        }
        rec["ok"] = rec["ok"] and rec["summary"]["passed"] > 0
        return rec

    def sync_checks(self) -> Dict[str, Any]:
        xml = self.out_dir / "sync_checks.xml"
        xml.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "pytest", "-v", "-m", "cuda", "-p", "no:cacheprovider", "-rfEs",
               "tests/test_cuda_sync.py", f"--junitxml={xml}"]  # fmt: skip
        rec = self.run("sync_checks", cmd, 90 if self.smoke else 150)
        rec["tests"] = _junit(xml) or _verbose_outcomes(rec["_output"])
        # the synchronising calls found, by thread and code (the test's recorded properties)
        rec["syncs"] = {name.rsplit("::", 1)[-1]: t.get("properties", {}) for name, t in rec["tests"].items()}
        rec["ok"] = rec["ok"] and any(t["outcome"] == "passed" for t in rec["tests"].values())
        return rec

    def _verify(self, name: str, config: str, steps: int, extra: List[str], timeout: float) -> Dict[str, Any]:
        accel = "cpu" if self.smoke else "gpu"
        cmd = [sys.executable, "-m", "torchrec_lookahead", "verify", "--config", config, "--steps", str(steps),
               f"--trainer.accelerator={accel}", *extra]  # fmt: skip
        rec = self.run(name, cmd, timeout)
        found = [j for j in _json_lines(rec["_output"]) if "max_abs_weight_diff" in j]
        if found:
            rec["verify"] = found[-1]
            rec["max_abs_weight_diff"] = found[-1]["max_abs_weight_diff"]
            rec["max_abs_loss_diff"] = found[-1]["max_abs_loss_diff"]
            rec["passed"] = found[-1].get("passed")
        rec["ok"] = rec["ok"] and bool(found)
        return rec

    def verify_default(self) -> Dict[str, Any]:
        # only the batches the steps train (the cached run's capacity pre-scan reads the whole epoch)
        steps, batches = (5, 10) if self.smoke else (100, 110)
        extra = [f"--data.init_args.datamodule.init_args.num_train_batches={batches}"]
        config = "configs/dlrm_tiny_lookahead.yaml" if self.smoke else "configs/dlrm_lookahead.yaml"
        return self._verify("verify_default", config, steps, extra, 60 if self.smoke else 90)

    def verify_fae_adam(self) -> Dict[str, Any]:
        # FBGEMM has no CPU Adam kernel (the resident job's fused tables): the smoke run checks the option path
        # with row-wise Adagrad. 50 steps: calibration and regrouping cost 3 CPU-minutes per 100 on the 2-core CPU
        steps, batches = (5, 10) if self.smoke else (50, 60)
        extra = [
            f"--model.init_args.embedding_optimizer.name={'rowwise_adagrad' if self.smoke else 'adam'}",
            f"--data.init_args.datamodule.init_args.datamodule.init_args.num_train_batches={batches}",
        ]
        config = "configs/dlrm_tiny_fae_lookahead.yaml" if self.smoke else "configs/dlrm_fae.yaml"
        return self._verify("verify_fae_adam", config, steps, extra, 60 if self.smoke else 100)

    def two_ranks(self) -> Dict[str, Any]:
        runs: Dict[str, Any] = {}
        out = self.out_dir / "two_ranks"
        out.mkdir(exist_ok=True)
        torchrun = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            "--master_port=29517",
        ]
        pipe = self.run(
            "two_ranks_pipeline",
            [*torchrun, "-m", "tests.pipeline_runs", str(out)],
            60,
            env={"TRL_TEST_DEVICE": "cpu" if self.smoke else "cuda"},
        )
        ranks = []
        for r in range(2):
            f = out / f"rank{r}.json"
            if f.exists():
                d = json.loads(f.read_text())
                ranks.append({k: d.get(k) for k in ("max_dw", "losses_equal", "steps", "device")})
        pipe["ranks"] = ranks
        pipe["ok"] = (
            pipe["ok"] and len(ranks) == 2 and all(r["max_dw"] == 0.0 and r["losses_equal"] for r in ranks)
        )
        runs["pipeline_gloo"] = pipe
        if not self.smoke:
            # Lightning's CUDA accelerator places one rank per GPU (devices=2 needs two GPUs, device ids must be
            # unique); recorded, not expected to pass on one GPU
            light = self.run(
                "two_ranks_lightning_verify",
                [*torchrun[:-1], "--master_port=29518", "-m", "torchrec_lookahead", "verify", "--config",
                 "configs/dlrm_tiny_lookahead.yaml", "--steps", "10", "--trainer.accelerator=gpu",
                 "--trainer.devices=2", "--trainer.strategy.init_args.process_group_backend=gloo"],
                45,
            )  # fmt: skip
            found = [j for j in _json_lines(light["_output"]) if "max_abs_weight_diff" in j]
            light["verify"] = found[-1] if found else None
            err = re.findall(r"^[\w.]*(?:Error|Exception)\w*: .*$", light["_output"], re.M)
            light["error"] = err[-1] if err else None
            runs["lightning_verify"] = light
        return {"ok": pipe["ok"], "runs": runs}

    def _bench(self, name: str, args: List[str], timeout: float) -> Dict[str, Any]:
        path = self.out_dir / f"{name}.json"
        cmd = [sys.executable, "benchmarks/gpu.py", "--json", str(path), *args]
        rec = self.run(name, cmd, timeout)
        if path.exists():
            rec["figures"] = json.loads(path.read_text())
            rec["summary"] = _bench_summary(rec["figures"])
        # the per-run rows the script printed (all a run cut short has)
        rows = [" ".join(line.split()) for line in rec["_output"].splitlines() if ROW.match(line)]
        rec["rows"] = list(dict.fromkeys(rows))
        rec["ok"] = rec["ok"] and "figures" in rec
        return rec

    def bench_default(self) -> Dict[str, Any]:
        if self.smoke:
            args = ["--device", "cpu", "--quick", "--steps", "2", "--warmup", "1", "--rounds", "1"]
            return self._bench("bench_default", args, 90)
        return self._bench("bench_default", ["--rounds", "1", "--steps", "60"], 130)

    def bench_kaggle(self) -> Dict[str, Any]:
        if self.smoke:
            args = ["--device", "cpu", "--scale", "0.01", "--fraction", "0.01", "0.05", "--dry-run"]
            return self._bench("bench_kaggle", args, 60)
        if self.left() < 45:
            return {"ok": False, "skipped": f"only {self.left():.0f} s left of the budget"}
        runs = ["resident", "resident_bg", "cached", "fae", "uvm_lru", "uvm_lfu", "cached_hbm"]
        args = ["--scale", "1.0", "--fraction", "0.01", "0.05", "--rounds", "1", "--steps", "30",
                "--runs", *runs]  # fmt: skip
        return self._bench("bench_kaggle", args, 1e9)


def _bench_summary(figures: Dict[str, Any]) -> Dict[str, Any]:
    """The headline of a ``benchmarks/gpu.py`` JSON: median step times, ratios, the host <-> device bandwidth
    and per run its rows moved, hit rate, floor and (UVM runs) FBGEMM's cache rows."""
    keys = ("rows_h2d_per_step", "rows_d2h_per_step", "hit_rate", "floor_ms", "step_over_floor",
            "fbgemm_cache_slots", "fbgemm_cache_slots_planned", "skipped")  # fmt: skip
    return {
        "complete": figures.get("complete"),
        "step_ms": {k[: -len("_step_ms")]: v for k, v in figures.items() if k.endswith("_step_ms")},
        "ratios": {k: v for k, v in figures.items() if "_over_" in k},
        "link": figures.get("link"),
        "runs": {n: {k: r[k] for k in keys if k in r} for n, r in (figures.get("runs") or {}).items()},
    }


def _junit(path: Path) -> Dict[str, Dict[str, Any]]:
    """Per test (``file::name``): outcome, seconds, recorded properties, message of a failure."""
    tests: Dict[str, Dict[str, Any]] = {}
    if not path.exists():
        return tests
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        rec: Dict[str, Any] = {"outcome": "passed", "time_s": round(float(case.get("time", 0) or 0), 2)}
        for kind in ("failure", "error", "skipped"):
            el = case.find(kind)
            if el is not None:
                rec["outcome"] = "failed" if kind == "failure" else kind
                rec["message"] = _tail((el.get("message") or "") + "\n" + (el.text or ""), 1500)
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        if props:
            rec["properties"] = props
        tests[name] = rec
    return tests


def _verbose_outcomes(output: str) -> Dict[str, Dict[str, Any]]:
    """Per test, from ``pytest -v`` lines (a run cut short writes no junit XML)."""
    found = re.findall(r"^(tests/\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED)", output, re.M)
    return {name: {"outcome": {"ERROR": "error"}.get(o, o.lower())} for name, o in found}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--out", required=True, help="folder for gpu_suite.json, gpu_suite.log and each part's files"
    )
    p.add_argument("--cpu-smoke", action="store_true", help="every part on the CPU in tiny sizes")
    p.add_argument("--budget", type=float, default=None, help="seconds for the whole run (450; smoke 600)")
    p.add_argument("--only", nargs="*", default=None, help="run only these parts")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suite = Suite(out, args.cpu_smoke, args.budget or (600.0 if args.cpu_smoke else 450.0))
    parts = [
        ("env", suite.env_part),
        ("cuda_tests", suite.cuda_tests),
        ("sync_checks", suite.sync_checks),
        ("verify_default", suite.verify_default),
        ("verify_fae_adam", suite.verify_fae_adam),
        ("two_ranks", suite.two_ranks),
        ("bench_default", suite.bench_default),
        ("bench_kaggle", suite.bench_kaggle),
    ]
    for name, fn in parts:
        if args.only is not None and name not in args.only:
            continue
        if suite.left() < 5:
            suite.result["parts"][name] = {"ok": False, "skipped": "out of time"}
            suite.save()
            continue
        suite.part(name, fn)
    suite.result["ok"] = all(p.get("ok") for p in suite.result["parts"].values())
    suite.save()
    print(json.dumps({k: v.get("ok") for k, v in suite.result["parts"].items()}))
    print(f"wrote {out / 'gpu_suite.json'} and {out / 'gpu_suite.log'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
