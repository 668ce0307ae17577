"""Optimizer configuration of the embedding cache, shared with the resident TorchRec baseline."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Dict, Union

from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_training import WeightDecayMode  # (older FBGEMM too)

from torchrec_lookahead.errors import ConfigError

__all__ = [
    "CacheLayout",
    "CacheOptimizerConfig",
    "KernelChoice",
    "OPTIMIZER_NAMES",
    "SUPPORTED_OPTIMIZERS",
    "FBGEMM_CPU_OPTIMIZERS",
]

OPTIMIZER_NAMES: Dict[str, EmbOptimType] = {
    "sgd": EmbOptimType.EXACT_SGD,
    "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    "adagrad": EmbOptimType.EXACT_ADAGRAD,
    "adam": EmbOptimType.ADAM,
}
"""The package's embedding optimizer names (those of ``embedding_optimizer.name`` in a config, TorchRec's
optimizer classes) and the FBGEMM kernel each one runs. :class:`CacheOptimizerConfig` also accepts FBGEMM's own
``EmbOptimType`` values (``exact_row_wise_adagrad``, ``partial_row_wise_adam``, ...) as aliases: sharder configs
written with them keep working."""

SUPPORTED_OPTIMIZERS = (
    EmbOptimType.EXACT_SGD,
    EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    EmbOptimType.EXACT_ADAGRAD,
    EmbOptimType.ADAM,
    EmbOptimType.PARTIAL_ROWWISE_ADAM,
)
"""Optimizers whose per-row state the cache moves with the row."""

FBGEMM_CPU_OPTIMIZERS = (
    EmbOptimType.EXACT_SGD,
    EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    EmbOptimType.EXACT_ADAGRAD,
)
"""Optimizers FBGEMM's fused CPU kernels implement (fbgemm-gpu-cpu 1.8 refuses Adam on CPU)."""

_TORCH_KERNEL_OPTIMIZERS = (
    EmbOptimType.EXACT_SGD,
    EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    EmbOptimType.ADAM,
    EmbOptimType.PARTIAL_ROWWISE_ADAM,
)


class CacheLayout(str, enum.Enum):
    """How the device cache's rows are shared between the cached tables.

    ``POOLED`` (default): the cached tables of one kernel and one embedding dimension share one cache of the sum
    of their capacities, planned jointly (FBGEMM keeps one cache per TBE the same way), so the rows go to
    whichever table the stream reads next. ``PER_TABLE``: every cached table keeps its own ``capacity`` rows.
    """

    POOLED = "pooled"
    PER_TABLE = "per_table"


class KernelChoice(str, enum.Enum):
    """Which kernel computes lookups and fused updates of the cache.

    ``AUTO`` uses FBGEMM's fused TBE where FBGEMM implements the optimizer on the device (all of them on CUDA;
    SGD and Adagrad on CPU) and the PyTorch kernel otherwise (Adam on CPU).
    """

    AUTO = "auto"
    FBGEMM = "fbgemm"
    TORCH = "torch"


def _to_optim(value: Union[EmbOptimType, str]) -> EmbOptimType:
    if isinstance(value, EmbOptimType):
        return value
    text = str(value).strip()
    if text.lower() in OPTIMIZER_NAMES:
        return OPTIMIZER_NAMES[text.lower()]
    for member in EmbOptimType:
        if text.lower() in (member.value, member.name.lower()):
            return member
    raise ConfigError(f"optimizer must be one of {[m.value for m in SUPPORTED_OPTIMIZERS]} but got {value!r}")


@dataclass(frozen=True)
class CacheOptimizerConfig:
    """Sparse optimizer of the cached (and resident) embedding tables, applied fused in backward.

    The same values build the resident baseline: pass :meth:`fused_params` to TorchRec's
    ``EmbeddingBagCollectionSharder(fused_params=...)``.

    Attributes:
        optimizer: a name of :data:`OPTIMIZER_NAMES` (``"sgd"``, ``"rowwise_adagrad"``, ``"adagrad"``,
            ``"adam"``, as the model's ``embedding_optimizer`` names them), or an ``EmbOptimType`` or its value
            (FBGEMM's names, accepted as aliases: ``"exact_sgd"``, ``"exact_row_wise_adagrad"``,
            ``"exact_adagrad"``, ``"adam"``, and ``"partial_row_wise_adam"``, which has no short name).
        learning_rate: step size.
        eps: Adagrad / Adam epsilon.
        beta1: Adam first-moment decay.
        beta2: Adam second-moment decay.
        weight_decay: weight decay. Adam: ``w -= lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * w)`` as in
            FBGEMM. SGD / Adagrad: only with FBGEMM on CUDA (FBGEMM's CPU kernels ignore it, so it is refused).
        weight_decay_mode: FBGEMM's ``WeightDecayMode`` for row-wise Adagrad on CUDA: NONE, L2 or DECOUPLE.
        kernel: :class:`KernelChoice` (``"auto"``, ``"fbgemm"``, ``"torch"``).

    Example:
        >>> cfg = CacheOptimizerConfig("rowwise_adagrad", learning_rate=0.1)
        >>> cfg == CacheOptimizerConfig("exact_row_wise_adagrad", learning_rate=0.1)  # FBGEMM's name, an alias
        True
        >>> cfg.state_widths(8), cfg.fused_params()["learning_rate"]
        ({'momentum1': 1}, 0.1)
        >>> CacheOptimizerConfig("adam").state_widths(8)
        {'momentum1': 8, 'momentum2': 8}
    """

    optimizer: Union[EmbOptimType, str] = EmbOptimType.EXACT_ROWWISE_ADAGRAD
    learning_rate: float = 0.01
    eps: float = 1.0e-8
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 0.0
    weight_decay_mode: Union[WeightDecayMode, int, str] = WeightDecayMode.NONE
    kernel: Union[KernelChoice, str] = KernelChoice.AUTO

    def __post_init__(self) -> None:
        optim = _to_optim(self.optimizer)
        if optim not in SUPPORTED_OPTIMIZERS:
            raise ConfigError(
                f"optimizer must be one of {[m.value for m in SUPPORTED_OPTIMIZERS]} but got {optim.value!r}"
            )
        object.__setattr__(self, "optimizer", optim)
        mode = self.weight_decay_mode
        try:
            mode = WeightDecayMode[mode.upper()] if isinstance(mode, str) else WeightDecayMode(int(mode))
        except (KeyError, ValueError) as e:
            raise ConfigError(f"weight_decay_mode must be NONE, L2 or DECOUPLE but got {mode!r}") from e
        if mode not in (WeightDecayMode.NONE, WeightDecayMode.L2, WeightDecayMode.DECOUPLE):
            raise ConfigError(
                f"weight_decay_mode must be NONE, L2 or DECOUPLE but got {mode.name}: counter-based modes keep "
                "per-row iteration state the cache does not move"
            )
        object.__setattr__(self, "weight_decay_mode", mode)
        try:
            object.__setattr__(self, "kernel", KernelChoice(self.kernel))
        except ValueError as e:
            raise ConfigError(
                f"kernel must be one of {[k.value for k in KernelChoice]} but got {self.kernel!r}"
            ) from e
        if not self.learning_rate > 0:
            raise ConfigError(f"learning_rate must be > 0 but got {self.learning_rate}")
        if not self.eps > 0:
            raise ConfigError(f"eps must be > 0 but got {self.eps}")
        if not (0.0 <= self.beta1 < 1.0 and 0.0 <= self.beta2 < 1.0):
            raise ConfigError(f"beta1 and beta2 must be in [0, 1) but got {self.beta1}, {self.beta2}")
        if self.weight_decay < 0:
            raise ConfigError(f"weight_decay must be >= 0 but got {self.weight_decay}")

    @property
    def optim(self) -> EmbOptimType:
        """The optimizer as an ``EmbOptimType``."""
        return _to_optim(self.optimizer)

    def state_names(self) -> tuple:
        """Names of the per-row optimizer states, in FBGEMM's ``split_optimizer_states()`` order."""
        if self.optim == EmbOptimType.EXACT_SGD:
            return ()
        if self.optim in (EmbOptimType.EXACT_ROWWISE_ADAGRAD, EmbOptimType.EXACT_ADAGRAD):
            return ("momentum1",)
        return ("momentum1", "momentum2")

    def state_widths(self, embedding_dim: int) -> Dict[str, int]:
        """Optimizer state name -> float32 columns per row, for a table of width ``embedding_dim``.

        Args:
            embedding_dim: width of the table's rows.

        Returns:
            ``{}`` (SGD), ``{"momentum1": 1}`` (row-wise Adagrad), ``{"momentum1": D}`` (Adagrad),
            ``{"momentum1": D, "momentum2": D}`` (Adam), ``{"momentum1": D, "momentum2": 1}`` (partial
            row-wise Adam).
        """
        optim = self.optim
        if optim == EmbOptimType.EXACT_SGD:
            return {}
        if optim == EmbOptimType.EXACT_ROWWISE_ADAGRAD:
            return {"momentum1": 1}
        if optim == EmbOptimType.EXACT_ADAGRAD:
            return {"momentum1": embedding_dim}
        if optim == EmbOptimType.ADAM:
            return {"momentum1": embedding_dim, "momentum2": embedding_dim}
        return {"momentum1": embedding_dim, "momentum2": 1}

    def fused_params(self) -> Dict[str, Any]:
        """Keyword arguments for FBGEMM's TBE and TorchRec's sharder ``fused_params``.

        Returns:
            ``{"optimizer", "learning_rate", "eps", "beta1", "beta2", "weight_decay", "weight_decay_mode"}``.
        """
        return {
            "optimizer": self.optim,
            "learning_rate": self.learning_rate,
            "eps": self.eps,
            "beta1": self.beta1,
            "beta2": self.beta2,
            "weight_decay": self.weight_decay,
            "weight_decay_mode": self.weight_decay_mode,
        }

    def uses_fbgemm(self, device_type: str) -> bool:
        """Whether the cache on a device of this type runs FBGEMM's fused TBE (else the PyTorch kernel).

        Args:
            device_type: ``"cpu"`` or ``"cuda"``.

        Returns:
            True for FBGEMM.

        Raises:
            ConfigError: the requested kernel cannot run this optimizer on this device.
        """
        kernel = KernelChoice(self.kernel)
        fbgemm_ok = device_type != "cpu" or self.optim in FBGEMM_CPU_OPTIMIZERS
        if kernel == KernelChoice.FBGEMM and not fbgemm_ok:
            raise ConfigError(
                f"FBGEMM has no {device_type.upper()} kernel for optimizer {self.optim.value!r}; "
                "use kernel='auto' or 'torch'"
            )
        if kernel == KernelChoice.TORCH and self.optim not in _TORCH_KERNEL_OPTIMIZERS:
            raise ConfigError(
                f"the PyTorch kernel supports {[o.value for o in _TORCH_KERNEL_OPTIMIZERS]} but got "
                f"{self.optim.value!r}; use kernel='auto' or 'fbgemm'"
            )
        use_fbgemm = fbgemm_ok if kernel == KernelChoice.AUTO else kernel == KernelChoice.FBGEMM
        no_decay = (EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ROWWISE_ADAGRAD, EmbOptimType.EXACT_ADAGRAD)
        if self.weight_decay > 0 and self.optim in no_decay and (device_type == "cpu" or not use_fbgemm):
            raise ConfigError(
                f"weight_decay={self.weight_decay} with optimizer {self.optim.value!r} on {device_type.upper()}: "
                "FBGEMM's CPU kernels silently ignore it (so does TorchRec's resident training on CPU) and the "
                "PyTorch kernel does not implement it; set weight_decay=0 or use Adam"
            )
        return use_fbgemm
