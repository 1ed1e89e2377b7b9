"""DualAttentionResNet1D: FedCVD's ResNet1D-34 plus dual-attention blocks (FedDualAtt, MWSCAS 2026).

Read top to bottom: the config, the backbone parts, the attention parts, then the whole model.
Dimensions are named once: B batch, C leads/channels, L samples, T tokens (L' = ceil(L/32)),
D model width (d), H heads, E head size (d_h).

The backbone is FedCVD `model/resnet.py:resnet1d34` without its classifier; its parameter names
(`conv1`, `bn1`, `layer1.0.conv1`, ..., `downsample.0`) are kept under `backbone.` so FedCVD
checkpoints map one to one. FedCVD's `fc` + sigmoid becomes `head`, returning logits
(use BCE-with-logits; mathematically FedCVD's BCELoss on sigmoid outputs).

With no dual-attention blocks (`n_blocks=0`, the `resnet1d34` preset) the model is FedCVD's
ResNet1D-34 itself: backbone, mean pool over time (FedCVD's AdaptiveAvgPool1d(1)), classifier; no
positional encoding and no head split (its split is written NO_HEADS, "-").

Per-site head splits (`full_width_heads`, shared/algorithms/head_splits.py): both branches of a
block hold all H heads, so every site has the same theta^g and phi_k schemas whatever its split;
a site of split H_g:H_l computes its global branch with heads 0..H_g-1 and its local branch with
heads H_g..H-1, each branch exactly as a branch of only those heads (per-head attention is
independent, and the other heads' projections are sliced away before W_out).

Learned head assignment (`learned_heads`, shared/algorithms/learned_heads.py): both branches hold
and compute all H heads, and block b's gate g_h = sigmoid(head_gate[h]) (phi_k) weighs head h's
attended values before each branch's W_out: by 1 - g_h in the global branch, g_h in the local one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "DualAttentionResNet1D",
    "ModelConfig",
    "NO_HEADS",
    "PRESETS",
    "build_model",
    "head_ratios",
    "head_splits",
    "parse_heads",
    "preset",
    "sinusoidal_encoding",
]

NO_HEADS = "-"  # the head split of a model without attention (the `resnet1d34` preset)


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

    def __post_init__(self) -> None:
        if len(self.widths) != len(self.depths):
            raise ValueError("widths and depths must have one entry per backbone layer")
        if self.n_blocks < 0:
            raise ValueError(f"n_blocks must be >= 0, got {self.n_blocks}")
        if self.has_attention and self.n_heads < 1:
            raise ValueError("a model with dual-attention blocks needs at least one head")
        if not self.has_attention and self.n_heads != 0:
            raise ValueError("a model without dual-attention blocks has no heads: set n_heads=0")
        if self.full_width_heads and not self.has_attention:
            raise ValueError("full_width_heads (per-site head splits) needs dual-attention blocks")
        if self.learned_heads and (not self.has_attention or self.full_width_heads):
            raise ValueError(
                "learned_heads needs dual-attention blocks and excludes per-site splits (full_width_heads)"
            )
        if not 0 <= self.n_global_heads <= self.n_heads:
            raise ValueError(f"n_global_heads must be in 0..{self.n_heads}, got {self.n_global_heads}")
        for name in ("dropout", "attn_dropout", "head_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1)")

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
        return 2 ** (2 + len(self.widths) - 1)

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
                raise ValueError(f"this model has no attention heads: its head split is {NO_HEADS!r}, got {heads!r}")
            return self
        if heads == NO_HEADS:
            raise ValueError("this model has dual-attention blocks: give a head split such as '6:2'")
        n_global, n_local = parse_heads(heads) if isinstance(heads, str) else heads
        return replace(self, n_heads=n_global + n_local, n_global_heads=n_global)


PRESETS: dict[str, ModelConfig] = {
    # FedDualAtt as published: ResNet1D-34 + 2 blocks of 8 heads x 64, about 24.0 M parameters.
    "paper": ModelConfig(),
    # CPU demos: the same shape of network, narrower and shallower (about 0.6 M parameters).
    "small": ModelConfig(stem_channels=16, widths=(16, 32, 64, 128), depths=(1, 1, 1, 1), head_dim=16, dropout=0.1),
    # Unit tests and protocol checks: smallest network that keeps every named part.
    "tiny": ModelConfig(
        stem_channels=8,
        stem_kernel=7,
        widths=(8, 8, 16, 32),
        depths=(1, 1, 1, 1),
        block_kernel=3,
        head_dim=4,
        ffn_mult=2,
        dropout=0.1,
    ),
    # FedCVD's ResNet1D-34 with its classifier and nothing else (16,611,220 parameters): the model of
    # FedCVD's baselines, Table I's FedAvg ... FedALA rows. Last, so a FedDualAtt state matches its
    # own preset first (site_agent/study_model.py).
    "resnet1d34": ModelConfig(n_heads=0, n_global_heads=0, n_blocks=0, dropout=0.0),
}


def preset(name: str, heads: str | None = None) -> ModelConfig:
    """Return the named preset, optionally with another H_g:H_l split (NO_HEADS for `resnet1d34`)."""
    try:
        config = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}") from None
    return config.with_heads(heads) if heads is not None else config


def parse_heads(text: str) -> tuple[int, int]:
    """Parse 'H_g:H_l' such as '6:2' into (6, 2)."""
    parts = text.split(":")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"head split must look like '6:2' (global:local), got {text!r}")
    n_global, n_local = (int(p) for p in parts)
    if n_global + n_local == 0:
        raise ValueError("head split needs at least one head")
    return n_global, n_local


def head_ratios(n_heads: int = 8) -> list[str]:
    """All H_g:H_l splits of n_heads, from all-global to all-local ('8:0' ... '0:8')."""
    return [f"{g}:{n_heads - g}" for g in range(n_heads, -1, -1)]


def head_splits(config: ModelConfig) -> list[str]:
    """Every head split `config` may take: its H's ratios, or only NO_HEADS without attention."""
    return head_ratios(config.n_heads) if config.has_attention else [NO_HEADS]


# ---------------------------------------------------------------------------------------------
# Backbone: FedCVD ResNet1D-34 without its classifier


class BasicBlock(nn.Module):
    """conv-BN-ReLU-conv-BN plus a shortcut (1x1 strided conv + BN when the shape changes), then ReLU."""

    def __init__(self, c_in: int, c_out: int, stride: int, kernel: int) -> None:
        super().__init__()
        pad = kernel // 2
        self.conv1 = nn.Conv1d(c_in, c_out, kernel, stride=stride, padding=pad, bias=False)
        self.bn1 = nn.BatchNorm1d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv1d(c_out, c_out, kernel, stride=1, padding=pad, bias=False)
        self.bn2 = nn.BatchNorm1d(c_out)
        self.downsample: nn.Module | None = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(nn.Conv1d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm1d(c_out))

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet1DBackbone(nn.Module):
    """FedCVD ResNet1D-34 feature extractor: (B, C, L) -> (B, D, L/32)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        stem = config.stem_channels
        self.conv1 = nn.Conv1d(
            config.n_leads, stem, config.stem_kernel, stride=2, padding=config.stem_kernel // 2, bias=False
        )
        self.bn1 = nn.BatchNorm1d(stem)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool1d(kernel_size=3, stride=2, padding=1)
        c_in = stem
        for index, (width, depth) in enumerate(zip(config.widths, config.depths, strict=True)):
            stride = 1 if index == 0 else 2
            blocks = [BasicBlock(c_in, width, stride, config.block_kernel)]
            blocks += [BasicBlock(width, width, 1, config.block_kernel) for _ in range(depth - 1)]
            self.add_module(f"layer{index + 1}", nn.Sequential(*blocks))
            c_in = width
        self.n_layers = len(config.widths)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))  # (B, stem, L/4)
        for index in range(self.n_layers):
            x = getattr(self, f"layer{index + 1}")(x)  # layer4: (B, D, L/32)
        return x


# ---------------------------------------------------------------------------------------------
# Dual attention


def sinusoidal_encoding(n_tokens: int, width: int, device: torch.device | None = None) -> Tensor:
    """Vaswani et al.'s fixed sin/cos position table, (T, D)."""
    position = torch.arange(n_tokens, dtype=torch.float32, device=device).unsqueeze(1)
    frequency = torch.exp(torch.arange(0, width, 2, dtype=torch.float32, device=device) * (-math.log(10000.0) / width))
    table = torch.zeros(n_tokens, width, device=device)
    table[:, 0::2] = torch.sin(position * frequency)
    table[:, 1::2] = torch.cos(position * frequency[: width // 2])
    return table


class AttentionBranch(nn.Module):
    """LN(X + MHA(X W_in, H) W_out) with H heads of size E; a branch of zero heads is LN(X).

    `active` (default: all) are the heads it computes with; the others' slices of W_in and W_out
    are held (a full-width branch of a per-site split) but take no part, so the branch equals one
    of only the active heads.
    """

    def __init__(self, config: ModelConfig, n_heads: int, active: range | None = None) -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, config.head_dim
        self.active = range(n_heads) if active is None else active
        if self.active.step != 1 or not 0 <= self.active.start <= self.active.stop <= n_heads:
            raise ValueError(f"active heads must be a contiguous range within 0..{n_heads}, got {self.active}")
        self.attn_dropout = config.attn_dropout
        if n_heads > 0:  # zero heads: no projections at all, so nothing to share or keep
            self.in_proj = nn.Linear(config.d_model, 3 * n_heads * config.head_dim)  # W_in: q, k, v
            self.out_proj = nn.Linear(n_heads * config.head_dim, config.d_model)  # W_out
        self.dropout = nn.Dropout(config.dropout)
        self.norm = nn.LayerNorm(config.d_model)

    def forward(self, x: Tensor, head_scale: Tensor | None = None) -> Tensor:
        """The branch's output; `head_scale` (H,) scales each head's attended values before W_out."""
        if len(self.active) == 0:
            return self.norm(x)
        if len(self.active) < self.n_heads:
            return self._masked(x)
        B, T, _ = x.shape
        H, E = self.n_heads, self.head_dim
        q, k, v = self.in_proj(x).view(B, T, 3, H, E).permute(2, 0, 3, 1, 4)  # 3 x (B, H, T, E)
        p = self.attn_dropout if self.training else 0.0
        attended = F.scaled_dot_product_attention(q, k, v, dropout_p=p)  # (B, H, T, E)
        if head_scale is not None:  # learned heads: head h enters W_out weighted by its gate
            attended = attended * head_scale.to(attended.dtype).view(1, H, 1, 1)
        attended = attended.transpose(1, 2).reshape(B, T, H * E)  # (B, T, H*E)
        return self.norm(x + self.dropout(self.out_proj(attended)))  # (B, T, D)

    def _masked(self, x: Tensor) -> Tensor:
        """The branch of only the active heads A: W_in's rows and W_out's columns of the others sliced away."""
        B, T, D = x.shape
        H, E, heads = self.n_heads, self.head_dim, self.active
        A = len(heads)
        w_in = self.in_proj.weight.view(3, H, E, D)[:, heads.start : heads.stop].reshape(3 * A * E, D)
        b_in = self.in_proj.bias.view(3, H, E)[:, heads.start : heads.stop].reshape(3 * A * E)
        q, k, v = F.linear(x, w_in, b_in).view(B, T, 3, A, E).permute(2, 0, 3, 1, 4)  # 3 x (B, A, T, E)
        p = self.attn_dropout if self.training else 0.0
        attended = F.scaled_dot_product_attention(q, k, v, dropout_p=p).transpose(1, 2).reshape(B, T, A * E)
        w_out = self.out_proj.weight[:, heads.start * E : heads.stop * E]  # (D, A*E)
        return self.norm(x + self.dropout(F.linear(attended, w_out, self.out_proj.bias)))  # (B, T, D)


class FeedForward(nn.Module):
    """Position-wise D -> ffn_mult*D -> D with GELU."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden = config.ffn_mult * config.d_model
        self.fc_in = nn.Linear(config.d_model, hidden)
        self.fc_out = nn.Linear(hidden, config.d_model)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.fc_out(self.dropout(F.gelu(self.fc_in(x)))))


class DualAttentionBlock(nn.Module):
    """Global and local branches side by side, combined by W_c, then LN(X' + FFN(X')) (paper eq. 1-4)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.learned_heads:  # every head in both branches, mixed per head by g = sigmoid(head_gate)
            self.global_branch = AttentionBranch(config, config.n_heads)  # theta^g
            self.local_branch = AttentionBranch(config, config.n_heads)  # W_in, W_out are phi_k
        elif config.full_width_heads:  # a per-site split: heads 0..H_g-1 global, H_g..H-1 local
            H, H_g = config.n_heads, config.n_global_heads
            self.global_branch = AttentionBranch(config, H, range(0, H_g))  # theta^g
            self.local_branch = AttentionBranch(config, H, range(H_g, H))  # W_in, W_out are phi_k
        else:
            self.global_branch = AttentionBranch(config, config.n_global_heads)  # theta^g
            self.local_branch = AttentionBranch(config, config.n_local_heads)  # W_in, W_out are phi_k
        self.combine = nn.Linear(2 * config.d_model, config.d_model)  # W_c
        self.ffn = FeedForward(config)
        self.norm = nn.LayerNorm(config.d_model)
        # learned heads: the gate logits, phi_k; 0 is g = 1/2, no head assigned yet
        self.head_gate = nn.Parameter(torch.zeros(config.n_heads)) if config.learned_heads else None

    def forward(self, x: Tensor) -> Tensor:
        if self.head_gate is not None:  # g_h: how much head h is local; 1 - g_h: how much it is global
            gate = torch.sigmoid(self.head_gate)
            g, l_ = self.global_branch(x, 1 - gate), self.local_branch(x, gate)
        else:
            g = self.global_branch(x)  # (B, T, D)
            l_ = self.local_branch(x)  # (B, T, D)
        x = self.combine(torch.cat([g, l_], dim=-1))  # (B, T, D)
        return self.norm(x + self.ffn(x))


# ---------------------------------------------------------------------------------------------
# The whole model


class DualAttentionResNet1D(nn.Module):
    """ResNet1D-34 -> tokens + positions -> dual-attention blocks -> mean pool -> logits.

    Without blocks: ResNet1D-34 -> mean pool -> logits, FedCVD's `resnet1d34` before its sigmoid.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.backbone = ResNet1DBackbone(config)
        positions = sinusoidal_encoding(config.n_tokens, config.d_model) if config.has_attention else torch.empty(0)
        self.register_buffer("positions", positions, persistent=False)
        self.blocks = nn.ModuleList(DualAttentionBlock(config) for _ in range(config.n_blocks))
        self.head_dropout = nn.Dropout(config.head_dropout)
        self.head = nn.Linear(config.d_model, config.n_classes)  # last: FedALA's layer_idx counts from here

    def tokens(self, x: Tensor) -> Tensor:
        """Backbone features as a position-encoded token sequence, (B, T, D)."""
        features = self.backbone(x).transpose(1, 2)  # (B, T, D)
        T = features.shape[1]
        positions = self.positions if T == self.positions.shape[0] else None
        if positions is None:
            positions = sinusoidal_encoding(T, features.shape[2], device=features.device)
        return features + positions.to(features.dtype)

    def features(self, x: Tensor) -> Tensor:
        """Pooled representation before the classifier, (B, D)."""
        if not self.config.has_attention:
            return self.backbone(x).mean(dim=2)  # (B, D): FedCVD's AdaptiveAvgPool1d(1) + flatten
        h = self.tokens(x)
        for block in self.blocks:
            h = block(h)  # (B, T, D)
        return h.mean(dim=1)  # (B, D): mean pool over tokens

    def forward(self, x: Tensor) -> Tensor:
        """Logits (B, n_classes) of raw-millivolt ECGs (B, C, L)."""
        return self.head(self.head_dropout(self.features(x)))  # (B, n_classes) logits


def build_model(config: ModelConfig, seed: int = 0) -> DualAttentionResNet1D:
    """Build the model with PyTorch's default init from `seed`; same seed, bit-identical state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return DualAttentionResNet1D(config)
