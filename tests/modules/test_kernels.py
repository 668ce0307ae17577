"""The cache kernels' arithmetic against FBGEMM's, bit for bit where the PyTorch kernel reproduces it.

The multi-rank cache relies on two properties checked here: a batch that keeps only some rows' ids (with the
bags in the same order) updates those rows exactly as the full batch does (FBGEMM's accumulation of a row
depends only on that row's own bags, in order), and an update can be deferred to a later call with its own
iteration and learning rate.
"""

from __future__ import annotations

from fractions import Fraction
from typing import List, Optional, Tuple

import numpy as np
import pytest
import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode

from torchrec_lookahead.modules import CacheOptimizerConfig
from torchrec_lookahead.modules._kernels import _CacheKernel, fma, make_kernel, rowwise_mean_square

CPU = torch.device("cpu")


def _kernel(optim: str, kernel: str, dims: List[int], pooling: PoolingMode = PoolingMode.SUM) -> _CacheKernel:
    cfg = CacheOptimizerConfig(optim, learning_rate=0.05, eps=1e-8, kernel=kernel)
    k = make_kernel(
        [400] * len(dims),
        dims,
        list(range(len(dims))),
        pooling,
        cfg,
        CPU,
        [f"t{i}" for i in range(len(dims))],
    )
    gen = torch.Generator().manual_seed(1)
    for t, d in enumerate(dims):
        k.weights(t).copy_(torch.randn(400, d, generator=gen))
    return k


def _batch(
    gen: torch.Generator, features: int, bags: int, weighted: bool
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    lengths = torch.randint(0, 6, (features * bags,), generator=gen)
    # skewed ids: many rows appear several times in a batch, some twice in one bag
    ids = (torch.rand(int(lengths.sum()), generator=gen) ** 3 * 400).long()
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    weights = torch.rand(ids.numel(), generator=gen) if weighted else None
    return ids, offsets, weights


@pytest.mark.parametrize("dims", [[16], [4, 20], [8, 64, 12]])
def test_torch_kernel_sgd_equals_fbgemm_bit_for_bit(dims: List[int]) -> None:
    """Unweighted SUM pooling: the same forward, the same per-row sums (bag order) and FBGEMM's fused update."""
    fb, pt = _kernel("exact_sgd", "fbgemm", dims), _kernel("exact_sgd", "torch", dims)
    gen = torch.Generator().manual_seed(7)
    for _ in range(10):
        ids, offsets, _ = _batch(gen, len(dims), 128, False)
        grad = torch.randn(128, sum(dims), generator=gen)
        assert torch.equal(fb.pooled(ids, offsets, None), pt.pooled(ids, offsets, None))
        fb.apply_batch(ids, offsets, None, grad)
        pt.apply_batch(ids, offsets, None, grad)
        for t in range(len(dims)):
            assert torch.equal(fb.weights(t), pt.weights(t)), t


@pytest.mark.parametrize("optim,weighted", [("exact_sgd", True), ("exact_row_wise_adagrad", False),
                                            ("exact_row_wise_adagrad", True)])  # fmt: skip
def test_torch_kernel_agrees_with_fbgemm_to_rounding(optim: str, weighted: bool) -> None:
    """Where FBGEMM's JIT kernels round in ways the PyTorch kernel does not reproduce (row-wise Adagrad's
    update, weighted accumulation), the two agree to a few units in the last place per step."""
    dims = [16, 20]
    fb, pt = _kernel(optim, "fbgemm", dims), _kernel(optim, "torch", dims)
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):
        ids, offsets, weights = _batch(gen, 2, 64, weighted)
        grad = torch.randn(64, 36, generator=gen)
        fb.apply_batch(ids, offsets, weights, grad)
        pt.apply_batch(ids, offsets, weights, grad)
    for t in range(2):
        scale = fb.weights(t).abs().max().item()
        assert (fb.weights(t) - pt.weights(t)).abs().max().item() <= 5e-7 * scale
        for name, state in fb.states(t).items():
            assert torch.allclose(state, pt.states(t)[name], rtol=1e-6, atol=0), name


@pytest.mark.parametrize("kernel,optim", [("fbgemm", "exact_row_wise_adagrad"), ("fbgemm", "exact_sgd"),
                                          ("torch", "adam"), ("torch", "exact_row_wise_adagrad")])  # fmt: skip
@pytest.mark.parametrize("pooling", [PoolingMode.SUM, PoolingMode.MEAN])
def test_a_batch_keeping_some_rows_updates_them_as_the_full_batch(
    kernel: str, optim: str, pooling: PoolingMode
) -> None:
    """What the exchange batch relies on: dropping other rows' ids (their bags kept, in order; MEAN's 1/L
    passed as per-id weights) leaves the kept rows' update unchanged, bit for bit."""
    dims = [16, 8]
    full, part = _kernel(optim, kernel, dims, pooling), _kernel(optim, kernel, dims, pooling)
    gen = torch.Generator().manual_seed(11)
    for _ in range(5):
        ids, offsets, _ = _batch(gen, 2, 256, False)
        grad = torch.randn(256, 24, generator=gen)
        full.apply_batch(ids, offsets, None, grad)
        lengths = torch.diff(offsets)
        bag = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
        keep = ids % 3 == 0
        kept = torch.bincount(bag[keep], minlength=lengths.numel())
        weights = None
        if pooling == PoolingMode.MEAN:
            weights = (1.0 / lengths[bag].clamp(min=1).double()).float()[keep]
        part.apply_batch(
            ids[keep], torch.cat([torch.zeros(1, dtype=torch.int64), kept.cumsum(0)]), weights, grad
        )
        for t in range(2):
            rows = torch.unique(ids[keep][bag[keep] // 256 == t])
            assert torch.equal(full.weights(t)[rows], part.weights(t)[rows]), (t, kernel, optim)
            for name, state in full.states(t).items():
                assert torch.equal(state[rows], part.states(t)[name][rows]), name


@pytest.mark.parametrize("kernel,optim", [("fbgemm", "exact_row_wise_adagrad"), ("torch", "adam")])
def test_a_deferred_update_lands_with_its_own_iteration_and_rate(kernel: str, optim: str) -> None:
    """apply_batch(step=, lr=) applies an update as in that step, and leaves the counter and the rate alone."""
    now, later = _kernel(optim, kernel, [8]), _kernel(optim, kernel, [8])
    gen = torch.Generator().manual_seed(5)
    ids, offsets, _ = _batch(gen, 1, 64, False)
    grad = torch.randn(64, 8, generator=gen)
    now.set_learning_rate(0.2)
    now.apply_batch(ids, offsets, None, grad)
    later.apply_batch(ids[:0], torch.zeros(65, dtype=torch.int64), None, grad)  # the step itself, no rows
    step = later.get_step()
    later.set_learning_rate(0.7)
    later.apply_batch(ids, offsets, None, grad, step=step, lr=0.2)
    assert torch.equal(now.weights(0), later.weights(0))
    assert later.get_step() == step and later.get_learning_rate() == pytest.approx(0.7)


def _round_to_float(x: Fraction) -> float:
    """The float32 nearest to ``x``, ties to even (by comparing with the neighbours of a close candidate)."""
    f = np.float32(float(x))
    cands = [np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf))]
    even = lambda v: int(np.float32(v).view(np.uint32)) & 1  # noqa: E731
    return float(min(cands, key=lambda v: (abs(Fraction(float(v)) - x), even(v))))


def test_fma_rounds_once() -> None:
    gen = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(2000, generator=gen) for _ in range(3))
    out = fma(a, b, c)
    for i in range(2000):
        exact = Fraction(a[i].item()) * Fraction(b[i].item()) + Fraction(c[i].item())
        assert out[i].item() == _round_to_float(exact), i
    # exact = 1 + 2**-24 + 2**-70: its nearest double is the midpoint 1 + 2**-24, which rounds to even (1.0);
    # the exact value lies above it, so the fused result is 1 + 2**-23
    x = torch.tensor([-(2.0**-24) * (1 + 2.0**-23)])
    y = torch.tensor([1 - 2.0**-23])
    z = torch.tensor([1 + 2.0**-23])
    assert (x.double() * y.double() + z.double()).float().item() == 1.0
    assert fma(x, y, z).item() == 1 + 2.0**-23


def test_rowwise_mean_square_is_the_8_lane_reduction() -> None:
    g = torch.arange(1, 21, dtype=torch.float32).view(1, 20) / 7
    sq = g * g
    lanes = torch.cat([sq, torch.zeros(1, 4)], dim=1).view(3, 8)
    acc = (lanes[0] + lanes[1]) + lanes[2]
    expect = (((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))) / 20
    assert torch.equal(rowwise_mean_square(g), expect.view(1, 1))
