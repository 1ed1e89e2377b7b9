"""DualAttentionResNet1D: FedCVD's ResNet1D-34 plus dual-attention blocks (FedDualAtt, MWSCAS 2026).

Read top to bottom: the backbone parts, the attention parts, then the whole model; its sizes and
presets (ModelConfig, PRESETS) are in shared/terms/model_config.py, which needs no torch.
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
import re
from collections.abc import Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shared.errors import ModelConfigError
from shared.model.architecture import Architecture, architecture_of
from shared.terms.model_config import NO_HEADS, PRESETS, ModelConfig, head_ratios, head_splits, parse_heads, preset

__all__ = [
    "DUAL_ATTENTION_RESNET1D",
    "HEAD_GATE_PATTERN",
    "LOCAL_BRANCH_PATTERN",
    "DualAttentionResNet1D",
    "ModelConfig",
    "NO_HEADS",
    "PRESETS",
    "build_model",
    "head_ratios",
    "head_splits",
    "load_released",
    "parse_heads",
    "preset",
    "sinusoidal_encoding",
]

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
        activated: Tensor = self.relu(out + identity)
        return activated


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
            raise ModelConfigError(f"active heads must be a contiguous range within 0..{n_heads}, got {self.active}")
        self.attn_dropout = config.attn_dropout
        if n_heads > 0:  # zero heads: no projections at all, so nothing to share or keep
            self.in_proj = nn.Linear(config.d_model, 3 * n_heads * config.head_dim)  # W_in: q, k, v
            self.out_proj = nn.Linear(n_heads * config.head_dim, config.d_model)  # W_out
        self.dropout = nn.Dropout(config.dropout)
        self.norm = nn.LayerNorm(config.d_model)

    def forward(self, x: Tensor, head_scale: Tensor | None = None) -> Tensor:
        """The branch's output; `head_scale` (H,) scales each head's attended values before W_out."""
        if len(self.active) == 0:
            normed: Tensor = self.norm(x)
            return normed
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
        out: Tensor = self.norm(x + self.dropout(self.out_proj(attended)))  # (B, T, D)
        return out

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
        out: Tensor = self.norm(x + self.dropout(F.linear(attended, w_out, self.out_proj.bias)))  # (B, T, D)
        return out


class FeedForward(nn.Module):
    """Position-wise D -> ffn_mult*D -> D with GELU."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden = config.ffn_mult * config.d_model
        self.fc_in = nn.Linear(config.d_model, hidden)
        self.fc_out = nn.Linear(hidden, config.d_model)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.dropout(self.fc_out(self.dropout(F.gelu(self.fc_in(x)))))
        return out


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
        out: Tensor = self.norm(x + self.ffn(x))
        return out


# ---------------------------------------------------------------------------------------------
# The whole model


class DualAttentionResNet1D(nn.Module):
    """ResNet1D-34 -> tokens + positions -> dual-attention blocks -> mean pool -> logits.

    Without blocks: ResNet1D-34 -> mean pool -> logits, FedCVD's `resnet1d34` before its sigmoid.
    """

    positions: Tensor  # a non-persistent buffer (register_buffer), (T, D); empty without attention

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
        features: Tensor = self.backbone(x).transpose(1, 2)  # (B, T, D)
        T = features.shape[1]
        positions = self.positions if T == self.positions.shape[0] else None
        if positions is None:
            positions = sinusoidal_encoding(T, features.shape[2], device=features.device)
        return features + positions.to(features.dtype)

    def features(self, x: Tensor) -> Tensor:
        """Pooled representation before the classifier, (B, D)."""
        if not self.config.has_attention:
            pooled: Tensor = self.backbone(x).mean(dim=2)  # (B, D): FedCVD's AdaptiveAvgPool1d(1) + flatten
            return pooled
        return self.attended(self.tokens(x))

    def attended(self, tokens: Tensor) -> Tensor:
        """The dual-attention blocks over position-encoded tokens (B, T, D), mean-pooled: (B, D)."""
        h = tokens
        for block in self.blocks:
            h = block(h)  # (B, T, D)
        return h.mean(dim=1)  # (B, D): mean pool over tokens

    def forward(self, x: Tensor) -> Tensor:
        """Logits (B, n_classes) of raw-millivolt ECGs (B, C, L)."""
        logits: Tensor = self.head(self.head_dropout(self.features(x)))  # (B, n_classes)
        return logits


def load_released(model: nn.Module, state: Mapping[str, Tensor]) -> nn.Module:
    """`model` holding `state` exactly (strict), a negative BatchNorm running variance read as 0; returns `model`.

    DP noise on a released model can push a running variance below 0, which would make BatchNorm's
    output NaN; 0 plus BatchNorm's eps is a valid one, and post-processing a released model costs
    no privacy. Every place that loads a global model loads it so.
    """
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.running_var is not None:
                module.running_var.clamp_(min=0.0)
    return model


# FedDualAtt section III-A: phi_k is W_in^l and W_out^l (weights and biases) of every block.
LOCAL_BRANCH_PATTERN = re.compile(r"^blocks\.\d+\.local_branch\.(in_proj|out_proj)\.(weight|bias)$")
# Learned head assignment (issue #19): each block's head gates are phi_k too, never uploaded.
HEAD_GATE_PATTERN = re.compile(r"^blocks\.\d+\.head_gate$")


def _dual_attention_local(_config: ModelConfig, names: tuple[str, ...]) -> Iterable[str]:
    """FedDualAtt's phi_k: the local branches' projections (and learned heads' gates); the rest is theta^g."""
    return (n for n in names if LOCAL_BRANCH_PATTERN.match(n) or HEAD_GATE_PATTERN.match(n))


# The built-in presets' architecture (shared/terms/model_config.py DUAL_ATTENTION names it).
DUAL_ATTENTION_RESNET1D = Architecture(DualAttentionResNet1D, _dual_attention_local)


def build_model(config: ModelConfig, seed: int = 0) -> nn.Module:
    """Build `config`'s network (by its architecture) with PyTorch's default init from `seed`; same seed, same state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return architecture_of(config).build(config)
