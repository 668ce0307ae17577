"""Compressed in-group traffic on any backend that carries bf16 and int8 tensors (gloo included).

* **bf16 gradients of replicated layers**: a DDP communication hook with the body of PyTorch's
  ``bf16_compress_hook`` (which is refused on gloo by a check on its name, and which Lightning registers only
  on CUDA): the bucket is cast to bf16, divided by the group size, all-reduced and cast back.
* **int8 forward activations of column splits**: the rows a column split gathers from the group travel as
  int8 with one fp32 scale per row (``absmax / 127``); the gradient that goes back to each rank's own rows is
  reduce-scattered in bf16 (``compression="bf16"`` keeps the forward gather in fp32 and compresses only that
  gradient).

Partial sums (a row split's reduce-scatter) are not compressed: int8 values with different scales cannot be
summed on the wire.
"""

from functools import partial
from typing import Any, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel

__all__ = ["bf16_allreduce_hook", "quantize_rows", "dequantize_rows", "CompressedColwiseParallel"]


def bf16_allreduce_hook(
    process_group: dist.ProcessGroup, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket's mean over ``process_group``, sent as bf16 (DDP checks the
    annotations: this module does not postpone their evaluation)."""
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(group.size())
    fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(f: torch.futures.Future[Any]) -> torch.Tensor:
        buffer.copy_(f.value()[0])
        return buffer

    return fut.then(decompress)


def quantize_rows(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """int8 values and one fp32 scale per row (``absmax / 127``; all-zero rows get scale 1).

    Example:
        >>> q, s = quantize_rows(torch.tensor([[1.0, -0.5], [0.0, 0.0]]))
        >>> q.tolist(), [round(v, 4) for v in s.flatten().tolist()]
        ([[127, -64], [0, 0]], [0.0079, 1.0])
        >>> [round(v, 4) for v in dequantize_rows(q, s).tolist()[0]]
        [1.0, -0.5039]
    """
    scale = x.detach().abs().amax(dim=-1, keepdim=True).float() / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(x.detach().float() / scale).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_rows` (up to rounding)."""
    return q.float() * scale


class _GatherRows(torch.autograd.Function):
    """Forward: every rank's rows, gathered (int8 + scales, or fp32), as a replicated DTensor. Backward: the
    gradient's partial sums reduce-scattered in bf16 back to each rank's own rows."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: DeviceMesh, int8: bool) -> DTensor:  # type: ignore[override]
        group = mesh.get_group()
        g = mesh.size()
        ctx.group, ctx.g, ctx.dtype = group, g, x.dtype
        if int8:
            q, scale = quantize_rows(x)
            qs = q.new_empty((g * q.shape[0], *q.shape[1:]))
            ss = scale.new_empty((g * scale.shape[0], 1))
            dist.all_gather_into_tensor(qs, q.contiguous(), group=group)
            dist.all_gather_into_tensor(ss, scale.contiguous(), group=group)
            rows = dequantize_rows(qs, ss).to(x.dtype)
        else:
            rows = x.new_empty((g * x.shape[0], *x.shape[1:]))
            dist.all_gather_into_tensor(rows, x.contiguous(), group=group)
        return DTensor.from_local(rows, mesh, (Replicate(),), run_check=False)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:  # type: ignore[override]
        if isinstance(grad, DTensor):
            placement = grad.placements[0]
            local = grad.to_local()
            if not isinstance(placement, Partial):  # already summed: keep the own rows
                rank = dist.get_rank(ctx.group)
                return local.chunk(ctx.g)[rank].contiguous(), None, None
            grad = local
        send = grad.to(torch.bfloat16).contiguous()
        out = send.new_empty((send.shape[0] // ctx.g, *send.shape[1:]))
        dist.reduce_scatter_tensor(out, send, group=ctx.group)
        return out.to(ctx.dtype), None, None


class CompressedColwiseParallel(ColwiseParallel):
    """torch's ``ColwiseParallel`` over the group's rows, with the rows gathered by :class:`_GatherRows`
    (int8 forward with ``int8=True``, bf16 gradient back) instead of DTensor's fp32 all-gather."""

    def __init__(self, output_layouts: Placement, int8: bool) -> None:
        super().__init__(input_layouts=Replicate(), output_layouts=output_layouts)
        self.int8 = int8

    @staticmethod
    def _gather_input(int8: bool, mod: nn.Module, inputs: Any, device_mesh: DeviceMesh) -> DTensor:
        x = inputs[0]
        if isinstance(x, DTensor):
            x = x.to_local()
        return _GatherRows.apply(x, device_mesh, int8)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise NotImplementedError("CompressedColwiseParallel splits nn.Linear layers only")
        return distribute_module(
            module,
            device_mesh,
            self._partition_linear_fn,
            partial(self._gather_input, self.int8),  # type: ignore[arg-type]
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),  # type: ignore[arg-type]
        )
