"""Lookup kernels of the device cache: FBGEMM's fused TBE, and a PyTorch fallback for what FBGEMM lacks.

Both compute lookups over a group of tables laid out like FBGEMM's TBE (indices of all features
concatenated feature-major, ``offsets`` of length ``F * B + 1``), pooled per bag (``SUM``/``MEAN``, the
EmbeddingBagCollection's) or one row per id (``NONE``, the EmbeddingCollection's: every table of the group has
the same dimension, output (number of ids, D)) and apply the sparse optimizer fused in
backward, touching only the rows looked up in the batch. Both expose per-table views of the weights and of
the optimizer state, which the cache reads and writes to move rows between slots and the store.

The PyTorch kernel implements FBGEMM's update formulas (``codegen/genscript/optimizers.py``) for EXACT_SGD,
EXACT_ROWWISE_ADAGRAD, ADAM and PARTIAL_ROWWISE_ADAM: fbgemm-gpu-cpu 1.8 refuses Adam on CPU, so on CPU the
cache uses this kernel for Adam. It sums a row's gradients in FBGEMM's order (bags in batch order, one scale
per id as FBGEMM's ``csr2csc`` computes it), but its optimizer arithmetic is PyTorch's element-wise ops, not
FBGEMM's vectorised JIT kernels, so for SGD and Adagrad it agrees with FBGEMM only to rounding.

Both kernels can hand their backward to a hook (:meth:`_CacheKernel.set_backward_hook`): with several ranks the
LRPP cache builds, from the step's global batch, the batch whose backward updates exactly the rows this rank
holds with exactly the gradients TorchRec's sharded kernel would accumulate, and runs it through
:meth:`_CacheKernel.apply_batch` (see ``distributed/exact_sync.py``).
"""

from __future__ import annotations

import abc
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from torch import nn

from torchrec_lookahead.modules.config import CacheOptimizerConfig
from torchrec_lookahead.modules.types import BackwardHook

__all__: List[str] = []

# FBGEMM TBE buffers behind split_embedding_weights() / split_optimizer_states().
_TBE_BUFFERS = tuple(
    f"{p}_{loc}" for p in ("weights", "momentum1", "momentum2") for loc in ("dev", "host", "uvm")
)


class _CacheKernel(abc.ABC):
    """Pooled lookup with a fused sparse optimizer over a group of tables."""

    def __init__(
        self,
        rows: Sequence[int],
        dims: Sequence[int],
        feature_table_map: Sequence[int],
        pooling: PoolingMode,
        config: CacheOptimizerConfig,
        device: torch.device,
        shares: Optional[Sequence[int]] = None,
    ) -> None:
        self.rows = [int(r) for r in rows]
        #: per table, the table whose rows (and optimizer state) it uses: itself, or the first table of its slot
        #: space (equal rows and dimension); tables sharing rows never hold the same slot at once
        self.shares = list(range(len(self.rows))) if shares is None else [int(s) for s in shares]
        self.dims = [int(d) for d in dims]
        self.feature_table_map = [int(t) for t in feature_table_map]
        self.pooling = pooling
        self.config = config
        self.device = device
        self.state_names: Tuple[str, ...] = tuple(config.state_names())
        self.backward_hook: Optional[BackwardHook] = None  # see set_backward_hook
        self._placeholder = torch.zeros(1, device=device, requires_grad=True)

    def set_backward_hook(self, hook: Optional[BackwardHook]) -> None:
        """Hand this kernel's backward to ``hook``: called with (gradient of the output, indices, offsets,
        weights) instead of the kernel's own update, it must apply the optimizer itself (through
        :meth:`apply_batch`). ``None`` gives the backward back to the kernel."""
        self.backward_hook = hook

    @abc.abstractmethod
    def pooled(
        self, indices: torch.Tensor, offsets: torch.Tensor, weights: Optional[torch.Tensor]
    ) -> torch.Tensor:
        """Forward only: (B, sum of feature dims) pooled embeddings, no autograd graph, no update."""

    @abc.abstractmethod
    def apply_batch(
        self,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        weights: Optional[torch.Tensor],
        grad: torch.Tensor,
        step: Optional[int] = None,
        lr: Optional[float] = None,
    ) -> None:
        """Apply the optimizer as the backward of a lookup of (``indices``, ``offsets``, ``weights``) with output
        gradient ``grad`` would: the rows of the batch get their gradients summed in the kernel's order and are
        updated once. ``step`` and ``lr``: the optimizer iteration and learning rate to apply it with (a
        deferred update lands as in its own step); ``None``: the next iteration at the current rate.

        With ``weights``, an id's gradient is its bag's gradient times its weight, and MEAN pooling does not
        divide by the bag's length again (FBGEMM's rule): a caller that regroups bags passes the scale of
        each id explicitly."""

    def _hooked(
        self, indices: torch.Tensor, offsets: torch.Tensor, weights: Optional[torch.Tensor]
    ) -> torch.Tensor:
        return _HookedLookup.apply(self._placeholder, self, indices, offsets, weights)

    @abc.abstractmethod
    def lookup(
        self, indices: torch.Tensor, offsets: torch.Tensor, weights: Optional[torch.Tensor]
    ) -> torch.Tensor:
        """(B, sum of feature dims) pooled embeddings; the optimizer runs in backward."""

    @abc.abstractmethod
    def weights(self, table: int) -> torch.Tensor:
        """(rows, D) view of a table's weights."""

    @abc.abstractmethod
    def states(self, table: int) -> Dict[str, torch.Tensor]:
        """Per state name an (rows, w) view of a table's optimizer state."""

    @abc.abstractmethod
    def get_learning_rate(self) -> float:
        """The sparse optimizer's current learning rate."""

    @abc.abstractmethod
    def set_learning_rate(self, lr: float) -> None:
        """Set the learning rate of the next updates (as TorchRec's fused optimizer sets its TBE's)."""

    @abc.abstractmethod
    def get_step(self) -> int:
        """Optimizer iteration counter (Adam's bias correction)."""

    @abc.abstractmethod
    def set_step(self, step: int) -> None:
        """Restore the optimizer iteration counter."""

    def train(self, mode: bool) -> None:  # noqa: B027 - optional hook
        """Propagate the module's training flag."""


class _FbgemmKernel(_CacheKernel):
    """FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen``: the kernel TorchRec's FUSED compute kernel uses."""

    def __init__(self, *args: Any, table_names: Sequence[str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        on_cpu = self.device.type == "cpu"
        location = EmbeddingLocation.HOST if on_cpu else EmbeddingLocation.DEVICE
        compute = ComputeDevice.CPU if on_cpu else ComputeDevice.CUDA
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[(r, d, location, compute) for r, d in zip(self.rows, self.dims)],
            feature_table_map=self.feature_table_map,
            pooling_mode=self.pooling,
            device=self.device,
            table_names=list(table_names),
            **self.config.fused_params(),
        )
        self._cached_views: Optional[
            Tuple[Tuple[int, ...], List[torch.Tensor], List[Dict[str, torch.Tensor]]]
        ] = None
        if self.shares != list(range(len(self.rows))):
            self._share_storage()
        for table in range(len(self.rows)):
            for state in self.states(table).values():
                state.zero_()

    @torch.no_grad()
    def _share_storage(self) -> None:
        """Point the tables that share another's rows at its storage (weights and every optimizer state): each
        table keeps its own index range, feature and hash size, so FBGEMM computes exactly what it computes
        for separate tables (its CPU kernels sum a table's gradients differently when features share one),
        and only the memory is shared."""
        tbe = self.tbe
        for prefix in ("weights", "momentum1", "momentum2"):
            physical = getattr(
                tbe, f"{prefix}_physical_offsets", None
            )  # per table; {prefix}_offsets: per feature
            if physical is None or len(physical) != len(self.rows):
                continue
            for loc in ("dev", "host", "uvm"):
                name = f"{prefix}_{loc}"
                old = tbe._parameters.get(name, tbe._buffers.get(name))
                if old is None or not old.numel():
                    continue
                flat = old.detach().reshape(-1)
                starts = [int(o) for o in physical] + [flat.numel()]
                sizes = [starts[t + 1] - starts[t] for t in range(len(self.rows))]
                moved, total = [0] * len(self.rows), 0
                for t, owner in enumerate(self.shares):
                    if owner == t:
                        moved[t], total = total, total + sizes[t]
                moved = [moved[owner] for owner in self.shares]
                storage = flat.new_zeros(total)
                for t, owner in enumerate(self.shares):
                    if owner == t:
                        storage[moved[t] : moved[t] + sizes[t]] = flat[starts[t] : starts[t] + sizes[t]]
                if name in tbe._parameters:
                    tbe._parameters[name] = nn.Parameter(storage, requires_grad=old.requires_grad)
                else:
                    tbe._buffers[name] = storage
                setattr(tbe, f"{prefix}_physical_offsets", moved)
                per_feature = tbe._buffers[f"{prefix}_offsets"]
                per_feature.copy_(
                    torch.tensor([moved[t] for t in self.feature_table_map], dtype=per_feature.dtype)
                )
        self._cached_views = None

    def lookup(
        self, indices: torch.Tensor, offsets: torch.Tensor, weights: Optional[torch.Tensor]
    ) -> torch.Tensor:
        if self.backward_hook is None:
            return self.tbe(indices, offsets, per_sample_weights=weights)
        return self._hooked(indices, offsets, weights)

    @torch.no_grad()
    def pooled(
        self, indices: torch.Tensor, offsets: torch.Tensor, weights: Optional[torch.Tensor]
    ) -> torch.Tensor:
        step = self.get_step()
        out = self.tbe(indices, offsets, per_sample_weights=weights)
        self.set_step(step)  # FBGEMM counts every training forward as an iteration
        return out

    def apply_batch(
        self,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        weights: Optional[torch.Tensor],
        grad: torch.Tensor,
        step: Optional[int] = None,
        lr: Optional[float] = None,
    ) -> None:
        # FBGEMM's own forward and fused backward over the given batch: its csr2csc order, its gradient
        # accumulation and its optimizer kernel, so the update is the one TorchRec's kernel computes.
        current_step, current_lr = self.get_step(), self.get_learning_rate()
        if step is not None:
            self.set_step(step - 1)  # the forward below counts the iteration
        if lr is not None:
            self.set_learning_rate(lr)
        try:
            with torch.enable_grad():
                out = self.tbe(indices, offsets, per_sample_weights=weights)
                out.backward(grad)
        finally:
            if step is not None:
                self.set_step(current_step)
            if lr is not None:
                self.set_learning_rate(current_lr)

    def _storage_key(self) -> Tuple[int, ...]:
        """Addresses of the TBE's weight and optimizer-state buffers (the per-table views depend on them)."""
        # The module's buffer and parameter dicts directly: nn.Module.__getattr__ costs a few microseconds a
        # name, and this runs for every table move.
        tbe = self.tbe
        found = (tbe._buffers.get(n, tbe._parameters.get(n, tbe.__dict__.get(n))) for n in _TBE_BUFFERS)
        return tuple(v.data_ptr() for v in found if isinstance(v, torch.Tensor))

    def _views(self) -> Tuple[List[torch.Tensor], List[Dict[str, torch.Tensor]]]:
        # FBGEMM rebuilds the per-table views on every split_*() call (tens of microseconds per table); they
        # are cached until a buffer is replaced.
        key = self._storage_key()
        if self._cached_views is None or self._cached_views[0] != key:
            weights = list(self.tbe.split_embedding_weights())
            states: List[Dict[str, torch.Tensor]] = [{} for _ in weights]
            if self.state_names:
                for table, views in enumerate(self.tbe.split_optimizer_states()):
                    rows = self.rows[table]
                    states[table] = {n: views[i].view(rows, -1) for i, n in enumerate(self.state_names)}
            self._cached_views = (key, weights, states)
        return self._cached_views[1], self._cached_views[2]

    def weights(self, table: int) -> torch.Tensor:
        return self._views()[0][table]

    def states(self, table: int) -> Dict[str, torch.Tensor]:
        return dict(self._views()[1][table])

    def get_learning_rate(self) -> float:
        return float(self.tbe.get_learning_rate())

    def set_learning_rate(self, lr: float) -> None:
        self.tbe.set_learning_rate(lr)

    def get_step(self) -> int:
        return int(self.tbe.iter.item())

    def set_step(self, step: int) -> None:
        self.tbe.iter.fill_(step)
        # FBGEMM caches the counter on the host and refreshes it from `iter` only while the copy is 0.
        iter_cpu = getattr(self.tbe, "iter_cpu", None)
        if isinstance(iter_cpu, torch.Tensor):
            iter_cpu.fill_(step)

    def train(self, mode: bool) -> None:
        self.tbe.train(mode)


class _HookedLookup(torch.autograd.Function):
    """Pooled lookup whose backward applies the kernel's sparse optimizer in place (no gradient returned), or
    hands the output gradient to the kernel's ``backward_hook``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        placeholder: torch.Tensor,
        kernel: _CacheKernel,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        weights: Optional[torch.Tensor],
    ) -> torch.Tensor:
        ctx.kernel = kernel
        ctx.save_for_backward(indices, offsets, weights)
        return kernel.pooled(indices, offsets, weights)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[None, None, None, None, None]:  # type: ignore[override]
        indices, offsets, weights = ctx.saved_tensors
        kernel: _CacheKernel = ctx.kernel
        if kernel.backward_hook is not None:
            kernel.backward_hook(grad.contiguous(), indices, offsets, weights)
        else:
            kernel.apply_batch(indices, offsets, weights, grad.contiguous())
        return None, None, None, None, None


class _TorchKernel(_CacheKernel):
    """Pure-PyTorch kernel with FBGEMM's update formulas, for optimizers FBGEMM lacks on the device."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._weights = [torch.zeros(r, d, device=self.device) for r, d in zip(self.rows, self.dims)]
        self._states: List[Dict[str, torch.Tensor]] = []
        for r, d in zip(self.rows, self.dims):
            widths = self.config.state_widths(d)
            self._states.append({k: torch.zeros(r, w, device=self.device) for k, w in widths.items()})
        for t, owner in enumerate(self.shares):  # tables sharing a slot space use one storage
            self._weights[t], self._states[t] = self._weights[owner], self._states[owner]
        self._step = 0
        # FBGEMM keeps the learning rate as a float32 tensor: the same value here
        self._lr = float(torch.tensor(self.config.learning_rate, dtype=torch.float32))
        self._mode = "mean" if self.pooling == PoolingMode.MEAN else "sum"

    def lookup(
        self, indices: torch.Tensor, offsets: torch.Tensor, weights: Optional[torch.Tensor]
    ) -> torch.Tensor:
        return self._hooked(indices, offsets, weights)

    def weights(self, table: int) -> torch.Tensor:
        return self._weights[table]

    def states(self, table: int) -> Dict[str, torch.Tensor]:
        return dict(self._states[table])

    def get_learning_rate(self) -> float:
        return self._lr

    def set_learning_rate(self, lr: float) -> None:
        self._lr = float(torch.tensor(lr, dtype=torch.float32))

    def get_step(self) -> int:
        return self._step

    def set_step(self, step: int) -> None:
        self._step = int(step)

    def _segments(self, offsets: torch.Tensor) -> Tuple[int, List[int]]:
        num_features = len(self.feature_table_map)
        batch = (offsets.numel() - 1) // num_features
        bounds = offsets[::batch].tolist() if batch > 0 else [0] * (num_features + 1)
        return batch, bounds

    @torch.no_grad()
    def pooled(
        self, indices: torch.Tensor, offsets: torch.Tensor, weights: Optional[torch.Tensor]
    ) -> torch.Tensor:
        """Forward: one ``embedding_bag`` per feature, concatenated along the embedding dimension."""
        batch, bounds = self._segments(offsets)
        if self.pooling == PoolingMode.NONE:  # one row per id, features one after the other
            rows = [
                self._weights[t][indices[bounds[f] : bounds[f + 1]]]
                for f, t in enumerate(self.feature_table_map)
            ]
            return torch.cat(rows) if rows else torch.zeros(0, self.dims[0], device=self.device)
        outs = []
        for f, t in enumerate(self.feature_table_map):
            off = offsets[f * batch : (f + 1) * batch + 1]
            lo, hi = bounds[f], bounds[f + 1]
            psw = weights[lo:hi] if weights is not None else None
            pooled = F.embedding_bag(
                indices[lo:hi],
                self._weights[t],
                off - lo,
                mode="sum",
                per_sample_weights=psw,
                include_last_offset=True,
            )
            outs.append(mean_of_sums(pooled, off.diff()) if self._mode == "mean" else pooled)
        return torch.cat(outs, dim=1)

    @torch.no_grad()
    def apply_batch(
        self,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        weights: Optional[torch.Tensor],
        grad: torch.Tensor,
        step: Optional[int] = None,
        lr: Optional[float] = None,
    ) -> None:
        """Per-row gradient sums in FBGEMM's order, then the optimizer on the touched rows of every table."""
        if step is None:
            self._step += 1
        batch, bounds = self._segments(offsets)
        grad = grad.contiguous()
        rows: List[List[torch.Tensor]] = [[] for _ in self.rows]
        grads: List[List[torch.Tensor]] = [[] for _ in self.rows]
        col = 0
        for f, t in enumerate(self.feature_table_map):
            dim = self.dims[t]
            lo, hi = bounds[f], bounds[f + 1]
            rows[t].append(indices[lo:hi])
            if self.pooling == PoolingMode.NONE:  # unpooled: each id has its own output row
                grads[t].append(grad[lo:hi])
                continue
            lengths = torch.diff(offsets[f * batch : (f + 1) * batch + 1])
            bag = torch.repeat_interleave(torch.arange(batch, device=grad.device), lengths)
            g = grad[:, col : col + dim].index_select(0, bag)
            # One scale per id, as FBGEMM's csr2csc computes it: the id's weight, else 1/L under MEAN pooling
            # (in double, rounded to float), else none.
            if weights is not None:
                g = g * weights[lo:hi].unsqueeze(1)
            elif self._mode == "mean":
                scale = (1.0 / lengths.index_select(0, bag).clamp(min=1).to(torch.float64)).to(g.dtype)
                g = g * scale.unsqueeze(1)
            grads[t].append(g)
            col += dim
        for t in range(len(self.rows)):
            if not rows[t]:
                continue
            ids = torch.cat(rows[t])
            if not ids.numel():
                continue
            uniq, inverse = torch.unique(ids, return_inverse=True)
            # index_add_ adds a row's contributions one after the other in input order (FBGEMM's stable
            # csr2csc order: feature, bag, position), starting from zero.
            gsum = torch.zeros(uniq.numel(), self.dims[t], device=grad.device, dtype=grad.dtype)
            gsum.index_add_(0, inverse, torch.cat(grads[t]))
            self._apply(t, uniq, gsum, step, lr)

    def _apply(
        self,
        t: int,
        ids: torch.Tensor,
        g: torch.Tensor,
        step: Optional[int] = None,
        lr: Optional[float] = None,
    ) -> None:
        cfg = self.config
        lr = self._lr if lr is None else lr
        wd, eps = cfg.weight_decay, cfg.eps  # wd: Adam only (checked by the config)
        w = self._weights[t].index_select(0, ids)
        optim = cfg.optim
        if optim == EmbOptimType.EXACT_SGD:
            w = fma(g, torch.tensor(-lr, dtype=g.dtype), w)  # FBGEMM's CPU loop compiles to one FMA
        elif optim == EmbOptimType.EXACT_ROWWISE_ADAGRAD:
            m1 = self._states[t]["momentum1"]
            acc = m1.index_select(0, ids) + rowwise_mean_square(g)
            m1.index_copy_(0, ids, acc)
            # float32 throughout, a true division (a Python number over a tensor is a reciprocal and a product)
            step_size = torch.div(
                torch.tensor(lr, dtype=acc.dtype), acc.sqrt() + torch.tensor(eps, dtype=acc.dtype)
            )
            w.sub_(step_size * g)
        else:
            step = self._step if step is None else step
            b1, b2 = cfg.beta1, cfg.beta2
            m1s, m2s = self._states[t]["momentum1"], self._states[t]["momentum2"]
            m1 = m1s.index_select(0, ids).mul_(b1).add_(g, alpha=1.0 - b1)
            m1s.index_copy_(0, ids, m1)
            if optim == EmbOptimType.ADAM:
                m2 = m2s.index_select(0, ids).mul_(b2).addcmul_(g, g, value=1.0 - b2)
            else:
                m2 = m2s.index_select(0, ids).mul_(b2).add_((g * g).mean(dim=1, keepdim=True), alpha=1.0 - b2)
            m2s.index_copy_(0, ids, m2)
            m_hat = m1 / (1.0 - b1**step)
            v_hat = m2 / (1.0 - b2**step)
            w.sub_(lr * (m_hat / (v_hat.sqrt() + eps) + wd * w))
        self._weights[t].index_copy_(0, ids, w)


def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a * b + c`` for float32 tensors, rounded once (a fused multiply-add, which PyTorch does not expose).

    The product of two floats is exact in double precision; the sum is rounded to double, and rounding that to
    float is wrong only when it lands exactly on a midpoint between two floats while the exact sum is not
    there: the error of the double sum (TwoSum) then says which way the exact value lies.

    Example:
        >>> a = torch.tensor([1.0 + 2.0**-12]); c = torch.tensor([-1.0])
        >>> (fma(a, a, c) - (a * a + c)).item()  # the unfused product loses 2**-24
        5.960464477539063e-08
    """
    a64, b64, c64 = a.double(), b.double(), c.double()
    p = a64 * b64  # exact
    s = p + c64
    bb = s - p
    err = (p - (s - bb)) + (c64 - bb)  # exact error of s (TwoSum)
    r = s.float()
    rd = r.double()
    n = torch.nextafter(r, torch.where(s > rd, float("inf"), float("-inf")).to(r.dtype))
    nd = n.double()
    midpoint = (s != rd) & ((rd + nd) * 0.5 == s)
    toward_n = ((nd > rd) & (err > 0)) | ((nd < rd) & (err < 0))
    return torch.where(midpoint & toward_n, n, r)


def mean_of_sums(sums: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """MEAN pooling as FBGEMM's forward computes it, from the bags' (weighted) sums: each sum times the float32
    reciprocal of its bag's length (an empty bag's sum, 0, unchanged). Torch's ``embedding_bag`` mean divides, which
    differs from it in the last bit."""
    scale = 1.0 / lengths.to(sums.device, torch.float32).clamp(min=1)
    return sums * scale.to(sums.dtype).unsqueeze(1)


def rowwise_mean_square(g: torch.Tensor) -> torch.Tensor:
    """(rows, 1) mean of each row's squares as FBGEMM's JIT row-wise Adagrad computes it on x86: squares
    summed chunk by chunk into 8 float lanes, the lanes reduced as two ``vhaddps`` and a final add
    (``((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))``), then divided by the dimension."""
    rows, dim = g.shape
    chunks = (dim + 7) // 8
    sq = g * g
    if chunks * 8 != dim:
        sq = torch.cat([sq, sq.new_zeros(rows, chunks * 8 - dim)], dim=1)
    lanes = sq.view(rows, chunks, 8)
    acc = lanes[:, 0]
    for c in range(1, chunks):
        acc = acc + lanes[:, c]
    pairs = acc[:, 0::2] + acc[:, 1::2]
    quads = pairs[:, 0::2] + pairs[:, 1::2]
    return ((quads[:, 1] + quads[:, 0]) / dim).unsqueeze(1)


def make_kernel(
    rows: Sequence[int],
    dims: Sequence[int],
    feature_table_map: Sequence[int],
    pooling: PoolingMode,
    config: CacheOptimizerConfig,
    device: torch.device,
    table_names: Sequence[str],
    shares: Optional[Sequence[int]] = None,
) -> _CacheKernel:
    """Build the kernel ``config.kernel`` selects for ``device`` (see ``CacheOptimizerConfig.uses_fbgemm``);
    ``shares``: per table, the table whose rows it uses (see :attr:`_CacheKernel.shares`)."""
    if config.uses_fbgemm(device.type):
        return _FbgemmKernel(
            rows, dims, feature_table_map, pooling, config, device, shares, table_names=table_names
        )
    return _TorchKernel(rows, dims, feature_table_map, pooling, config, device, shares)
