"""The cache's optimizer from what TorchRec is given: the ``apply_optimizer_in_backward`` declarations on the
tables and the sharder's ``fused_params``, translated to a :class:`CacheOptimizerConfig`; and whether the
resident tables can train in the cache's kernel with exactly TorchRec's arithmetic."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Dict, List, Optional

from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingType
from torchrec.distributed.utils import optimizer_type_to_emb_opt_type
from torchrec.modules.embedding_configs import DataType
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from torchrec_lookahead.distributed._tables import in_backward_optimizer, table_parameters
from torchrec_lookahead.errors import ConfigError
from torchrec_lookahead.modules import CacheOptimizerConfig

__all__ = ["cache_optimizer_from_kwargs", "cache_optimizer_from_module", "why_not_fusable"]


def cache_optimizer_from_kwargs(optimizer: Any, kw: Dict[str, Any]) -> CacheOptimizerConfig:
    """A cache optimizer from FBGEMM-named arguments (``lr`` as TorchRec's in-backward kwargs name it, or
    ``learning_rate`` as fused params do)."""
    return CacheOptimizerConfig(
        optimizer,
        learning_rate=float(kw["lr"] if "lr" in kw else kw.get("learning_rate", 0.01)),
        eps=float(kw.get("eps", 1e-8)),
        beta1=float(kw.get("beta1", 0.9)),
        beta2=float(kw.get("beta2", 0.999)),
        weight_decay=float(kw.get("weight_decay", 0.0)),
    )


def _emb_opt_type(cls: Any) -> Optional[EmbOptimType]:
    """FBGEMM's optimizer type for a ``torch.optim`` class as TorchRec maps it, ``None`` where it has none."""
    try:
        return optimizer_type_to_emb_opt_type(cls)
    except ValueError:
        return None


def cache_optimizer_from_module(module: nn.Module, tables: List[str]) -> Optional[CacheOptimizerConfig]:
    """The cache optimizer declared on the tables with ``apply_optimizer_in_backward`` (``None`` if none).

    Raises:
        ConfigError: cached tables declare different optimizers, or one the cache cannot move with the row.
    """
    found: Dict[str, CacheOptimizerConfig] = {}
    for name, p in table_parameters(module).named_parameters():
        table = name.split(".")[0]
        declared = in_backward_optimizer(p)
        if table not in tables or declared is None:
            continue
        cls, kw = declared
        opt = _emb_opt_type(cls)
        if opt is None:
            raise ConfigError(
                f"Table '{table}' declares optimizer {cls.__name__}, which the cache does not support"
            )
        found[table] = cache_optimizer_from_kwargs(opt, kw)
    distinct = set(found.values())
    if len(distinct) > 1:
        first, ref = next(iter(found.items()))
        other, cfg = next((t, c) for t, c in found.items() if c != ref)
        raise ConfigError(
            f"Cached tables declare different optimizers: table '{other}' has "
            f"{optimizer_differences(cfg, ref)} (table '{first}'); declare one optimizer for every cached table, "
            "or leave the others resident"
        )
    return next(iter(distinct)) if distinct else None


def optimizer_differences(ours: CacheOptimizerConfig, theirs: CacheOptimizerConfig) -> str:
    """The settings (the kernel aside) in which two optimizer configs differ, as ``name ours, not theirs``.

    Example:
        >>> optimizer_differences(CacheOptimizerConfig("sgd", 0.1), CacheOptimizerConfig("sgd", 0.05))
        'learning_rate 0.1, not 0.05'
    """
    a, b = dataclasses.asdict(ours), dataclasses.asdict(theirs)
    return "; ".join(
        f"{n} {_value(v)}, not {_value(b[n])}" for n, v in a.items() if n != "kernel" and v != b[n]
    )


def _value(v: Any) -> str:
    return str(v.value) if isinstance(v, enum.Enum) else repr(v)


_FUSABLE_SHARDINGS = (ShardingType.TABLE_WISE.value, ShardingType.ROW_WISE.value)
# Optimizer arguments that cache_optimizer_from_kwargs maps one to one; anything else in fused_params (gradient
# clipping, stochastic rounding, output dtype, ...) changes what TorchRec's kernel computes.
_FUSABLE_OPTIMIZER_KEYS = {"optimizer", "learning_rate", "lr", "eps", "beta1", "beta2", "weight_decay"}
# Per-table plan settings TorchRec's fused kernel honours and the cache's kernel does not.
_PLAN_EXTRAS = (
    "cache_params",
    "enforce_hbm",
    "stochastic_rounding",
    "bounds_check_mode",
    "output_dtype",
    "key_value_params",
)


def _table_optimizer(module: EmbeddingBagCollection, name: str, fused_params: Dict[str, Any]) -> Any:
    """The optimizer TorchRec's fused kernel would train table ``name`` with: its ``apply_optimizer_in_backward``
    declaration over the sharder's ``fused_params`` (as TorchRec merges them), else ``fused_params`` alone.
    Returns a :class:`CacheOptimizerConfig`, or the reason there is none the cache can reproduce."""
    declared = in_backward_optimizer(table_parameters(module)[name].weight)
    if declared is None:
        if "optimizer" not in fused_params:
            return f"table '{name}' declares no optimizer and the sharder has none in fused_params"
        return cache_optimizer_from_kwargs(fused_params["optimizer"], fused_params)
    cls, kw = declared
    unknown = sorted(set(kw) - _FUSABLE_OPTIMIZER_KEYS)
    if unknown:
        return f"table '{name}' declares optimizer arguments {unknown} the cache's kernel does not take"
    opt = _emb_opt_type(cls)
    if opt is None:
        return f"table '{name}' declares optimizer {cls.__name__}, which the cache does not support"
    return cache_optimizer_from_kwargs(opt, {**fused_params, **kw})


def why_not_fusable(
    module: EmbeddingBagCollection,
    resident_cfgs: List[Any],
    params: Dict[str, ParameterSharding],
    env: ShardingEnv,
    optimizer: CacheOptimizerConfig,
    fused_params: Optional[Dict[str, Any]],
) -> Optional[str]:
    """``None`` when the resident tables can train in the cache's kernel with exactly TorchRec's arithmetic,
    else the reason they cannot."""
    if env.world_size > 1:
        return f"{env.world_size} ranks (the resident tables are sharded across them by TorchRec)"
    fp = dict(fused_params or {})
    unknown = sorted(set(fp) - _FUSABLE_OPTIMIZER_KEYS)
    if unknown:
        return f"the sharder's fused_params {unknown} have no counterpart in the cache's kernel"
    for c in resident_cfgs:
        ps = params.get(c.name)
        if ps is None:
            return f"table '{c.name}' has no sharding plan"
        if (
            ps.compute_kernel != EmbeddingComputeKernel.FUSED.value
            or ps.sharding_type not in _FUSABLE_SHARDINGS
        ):
            return (
                f"table '{c.name}' is planned {ps.sharding_type} with the {ps.compute_kernel} kernel (fusing needs "
                f"{'/'.join(_FUSABLE_SHARDINGS)} with the fused kernel)"
            )
        if c.data_type != DataType.FP32:
            return f"table '{c.name}' is {c.data_type.name} (the cache's kernel holds FP32 tables)"
        extra = [f for f in _PLAN_EXTRAS if getattr(ps, f, None) is not None]
        if extra:
            return f"table '{c.name}' is planned with {extra}, which the cache's kernel does not take"
        declared = _table_optimizer(module, c.name, fp)
        if isinstance(declared, str):
            return declared
        if dataclasses.replace(declared, kernel=optimizer.kernel) != optimizer:
            return f"table '{c.name}' trains with {declared}, not the cached tables' {optimizer}"
    return None
