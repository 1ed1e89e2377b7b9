"""The model's sizes and presets, and its head splits: what a study's terms name, with no torch.

shared/model/network.py builds the network from a ModelConfig; this module only describes it, so that a
study's terms (shared/terms/study_terms.py) validate a model without loading PyTorch.

PRESETS are the `cardiofl.models` entry points of every installed distribution (shared/plugins.py):
each a ModelConfig whose `architecture` names, as "module:attribute", the shared/model/architecture.py
Architecture that builds it and splits its state into theta^g and phi_k. cardiofl's own (PAPER,
SMALL, TINY, RESNET1D34 below: DualAttentionResNet1D) are registered by its pyproject.toml, a
plug-in's by its own, one path for both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from shared.errors import ModelConfigError
from shared.plugins import Registry

__all__ = [
    "DUAL_ATTENTION",
    "NO_HEADS",
    "PAPER",
    "PRESETS",
    "RESNET1D34",
    "SMALL",
    "TINY",
    "ModelConfig",
    "OptionValue",
    "head_ratios",
    "head_splits",
    "parse_heads",
    "preset",
]

NO_HEADS = "-"  # the head split of a model without attention (the `resnet1d34` preset)
DUAL_ATTENTION = "shared.model.network:DUAL_ATTENTION_RESNET1D"  # the built-in architecture
OptionValue = bool | int | float | str


@dataclass(frozen=True)
class ModelConfig:
    """Every size of the model; the `paper` preset reproduces FedDualAtt exactly."""

    n_leads: int = 12  # input channels: the standard 12 leads
    signal_len: int = 5000  # samples per record (10 s at 500 Hz, FedCVD)
    n_classes: int = 20  # FedCVD's 20 labels
    stem_channels: int = 64  # stem conv output width (FedCVD: 64)
    stem_kernel: int = 15  # stem conv kernel, stride 2, padding kernel//2 (FedCVD: 15)
    widths: tuple[int, ...] = (64, 128, 256, 512)  # channels of layer1..layer4
    depths: tuple[int, ...] = (3, 4, 6, 3)  # BasicBlocks per layer (ResNet-34)
    block_kernel: int = 7  # BasicBlock conv kernel (FedCVD's misnamed `conv3x` is k7)
    n_heads: int = 8  # H = H_g + H_l attention heads per dual-attention block
    n_global_heads: int = 6  # H_g: heads of the FedAvg-aggregated branch; H_l = H - H_g stay local
    head_dim: int = 64  # E = d_h, fixed per head whatever the split
    n_blocks: int = 2  # stacked dual-attention blocks; 0 is plain ResNet1D-34 (then n_heads must be 0)
    ffn_mult: int = 4  # FFN hidden width = ffn_mult * D
    dropout: float = 0.1  # on attention outputs, FFN hidden and FFN output (MC dropout uses it)
    attn_dropout: float = 0.0  # on attention probabilities
    head_dropout: float = 0.0  # on the pooled features before the classifier
    full_width_heads: bool = False  # per-site splits: both branches hold all H heads, each computes with its own
    learned_heads: bool = False  # learned assignment: both branches hold and compute all H heads, mixed by gates
    architecture: str = DUAL_ATTENTION  # "module:attribute" of the Architecture that builds and splits it
    options: tuple[tuple[str, OptionValue], ...] = ()  # a plug-in architecture's own sizes, by name

    def __post_init__(self) -> None:
        module, colon, attribute = self.architecture.partition(":")
        if not (module and colon and attribute):
            raise ModelConfigError(f"architecture must be 'module:attribute', got {self.architecture!r}")
        names = [name for name, _ in self.options]
        if len(set(names)) != len(names):
            raise ModelConfigError(f"options must name each option once, got {names}")
        if len(self.widths) != len(self.depths):
            raise ModelConfigError("widths and depths must have one entry per backbone layer")
        if self.n_blocks < 0:
            raise ModelConfigError(f"n_blocks must be >= 0, got {self.n_blocks}")
        if self.has_attention and self.n_heads < 1:
            raise ModelConfigError("a model with dual-attention blocks needs at least one head")
        if not self.has_attention and self.n_heads != 0:
            raise ModelConfigError("a model without dual-attention blocks has no heads: set n_heads=0")
        if self.full_width_heads and not self.has_attention:
            raise ModelConfigError("full_width_heads (per-site head splits) needs dual-attention blocks")
        if self.learned_heads and (not self.has_attention or self.full_width_heads):
            raise ModelConfigError(
                "learned_heads needs dual-attention blocks and excludes per-site splits (full_width_heads)"
            )
        if not 0 <= self.n_global_heads <= self.n_heads:
            raise ModelConfigError(f"n_global_heads must be in 0..{self.n_heads}, got {self.n_global_heads}")
        for name in ("dropout", "attn_dropout", "head_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ModelConfigError(f"{name} must be in [0, 1)")

    def option(self, name: str, default: OptionValue) -> OptionValue:
        """The architecture option `name`, or `default` when the config does not set it."""
        return dict(self.options).get(name, default)

    @property
    def has_attention(self) -> bool:
        """Whether the model has dual-attention blocks (and so a head split)."""
        return self.n_blocks > 0

    @property
    def n_local_heads(self) -> int:
        """H_l: heads of the local branch, never shared."""
        return self.n_heads - self.n_global_heads

    @property
    def d_model(self) -> int:
        """D: token width, the last backbone layer's channels."""
        return self.widths[-1]

    @property
    def downsampling(self) -> int:
        """Total stride of the backbone: stem conv, maxpool and every layer after the first."""
        total: int = 2 ** (2 + len(self.widths) - 1)
        return total

    @property
    def n_tokens(self) -> int:
        """L' = ceil(L / 32) tokens (157 for 5000 samples; the paper's 156 rounds down)."""
        return math.ceil(self.signal_len / self.downsampling)

    @property
    def heads(self) -> str:
        """The split as 'H_g:H_l', or NO_HEADS for a model without attention."""
        return f"{self.n_global_heads}:{self.n_local_heads}" if self.has_attention else NO_HEADS

    def with_heads(self, heads: str | tuple[int, int]) -> ModelConfig:
        """Return the config with another H_g:H_l split (the total H may change too).

        A model without attention takes only NO_HEADS, and stays as it is.
        """
        if not self.has_attention:
            if heads != NO_HEADS:
                raise ModelConfigError(
                    f"this model has no attention heads: its head split is {NO_HEADS!r}, got {heads!r}"
                )
            return self
        if heads == NO_HEADS:
            raise ModelConfigError("this model has dual-attention blocks: give a head split such as '6:2'")
        n_global, n_local = parse_heads(heads) if isinstance(heads, str) else heads
        return replace(self, n_heads=n_global + n_local, n_global_heads=n_global)


# FedDualAtt as published: ResNet1D-34 + 2 blocks of 8 heads x 64, about 24.0 M parameters.
PAPER = ModelConfig()
# CPU demos: the same shape of network, narrower and shallower (about 0.6 M parameters).
SMALL = ModelConfig(stem_channels=16, widths=(16, 32, 64, 128), depths=(1, 1, 1, 1), head_dim=16, dropout=0.1)
# Unit tests and protocol checks: smallest network that keeps every named part.
TINY = ModelConfig(
    stem_channels=8,
    stem_kernel=7,
    widths=(8, 8, 16, 32),
    depths=(1, 1, 1, 1),
    block_kernel=3,
    head_dim=4,
    ffn_mult=2,
    dropout=0.1,
)
# FedCVD's ResNet1D-34 with its classifier and nothing else (16,611,220 parameters): the model of
# FedCVD's baselines, Table I's FedAvg ... FedALA rows.
RESNET1D34 = ModelConfig(n_heads=0, n_global_heads=0, n_blocks=0, dropout=0.0)

PRESETS: Registry[ModelConfig] = Registry("cardiofl.models", ModelConfig, "model")


def preset(name: str, heads: str | None = None) -> ModelConfig:
    """Return the named preset, optionally at another H_g:H_l split of its H heads (NO_HEADS for `resnet1d34`)."""
    try:
        config = PRESETS[name]
    except KeyError:
        raise ModelConfigError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}") from None
    if heads is None:
        return config
    if config.has_attention and heads != NO_HEADS:
        total = sum(parse_heads(heads))
        if total != config.n_heads:
            raise ModelConfigError(
                f"heads {heads!r} splits {total} heads; preset {name!r} has {config.n_heads} "
                f"(H_g + H_l = {config.n_heads})"
            )
    return config.with_heads(heads)


def parse_heads(text: str) -> tuple[int, int]:
    """Parse 'H_g:H_l' such as '6:2' into (6, 2)."""
    parts = text.split(":")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ModelConfigError(f"head split must look like '6:2' (global:local), got {text!r}")
    n_global, n_local = (int(p) for p in parts)
    if n_global + n_local == 0:
        raise ModelConfigError("head split needs at least one head")
    return n_global, n_local


def head_ratios(n_heads: int = 8) -> list[str]:
    """All H_g:H_l splits of n_heads, from all-global to all-local ('8:0' ... '0:8')."""
    return [f"{g}:{n_heads - g}" for g in range(n_heads, -1, -1)]


def head_splits(config: ModelConfig) -> list[str]:
    """Every head split `config` may take: its H's ratios, or only NO_HEADS without attention."""
    return head_ratios(config.n_heads) if config.has_attention else [NO_HEADS]
