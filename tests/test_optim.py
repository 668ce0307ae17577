"""Why StepOnceCombinedOptimizer exists: TorchRec's CombinedOptimizer hands a step's closure (Lightning's
forward + backward) to every inner optimizer, so the closure runs once per optimizer."""

import torch
from torchrec.optim import CombinedOptimizer
from torchrec.optim.keyed import KeyedOptimizerWrapper

from torchrec_lookahead.optim import StepOnceCombinedOptimizer


def _two_optimizers() -> tuple:
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    opts = [
        (name, KeyedOptimizerWrapper({name: p}, lambda ps: torch.optim.SGD(ps, lr=0.5)))
        for name, p in (("embeddings", a), ("dense", b))
    ]
    calls = []

    def closure() -> torch.Tensor:
        calls.append(1)
        for p in (a, b):
            p.grad = None
        loss = (a.sum() + b.sum()) ** 2
        loss.backward()
        return loss

    return opts, (a, b), calls, closure


def test_torchrec_combined_optimizer_runs_the_closure_once_per_inner_optimizer():
    opts, _, calls, closure = _two_optimizers()
    CombinedOptimizer(opts).step(closure)
    assert len(calls) == 2  # the reason for StepOnceCombinedOptimizer; if TorchRec changes this, remove it


def test_step_once_runs_the_closure_once_and_steps_every_optimizer_like_one_closure_then_steps():
    opts, (a, b), calls, closure = _two_optimizers()
    loss = StepOnceCombinedOptimizer(opts).step(closure)
    assert len(calls) == 1 and float(loss) == 25.0
    # d/dp (sum a + sum b)^2 = 2 * 5 = 10 per element; SGD lr 0.5: 1 - 5 = -4
    assert torch.equal(a.detach(), torch.full((2,), -4.0)) and torch.equal(b.detach(), torch.full((3,), -4.0))
