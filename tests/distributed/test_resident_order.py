"""Several ranks: a model reading its pooled embeddings by position sees them in the order resident training
gives them (TorchRec's sharded collection returns them in shard order, which depends on its plan)."""

import json
import subprocess
import sys

import pytest

from ..conftest import REPO, free_port


@pytest.mark.distributed
def test_a_model_reading_pooled_values_by_position_trains_exactly_on_two_ranks(tmp_path):
    """TorchRec returned ['d', 'a', 'b'] resident and the cache ['a', 'b', 'd']: the model's top layer read other
    columns, and the cached run trained another model without a word (every weight differed from step 0)."""
    from ..cli.test_cli import clean_env

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "-m", "tests.distributed.resident_order_runs", str(tmp_path)]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=clean_env())
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["resident_keys"] != ["a", "b", "d"], result  # the case: TorchRec's shard order
    assert result["cached_keys"] == result["resident_keys"], result
    assert result["differ"] == [], result
