"""CompactCNN1D's presets: what a study's terms name through the `cardiofl.models` entry points (no torch here).

Cardiofl reads these configs when it validates a study's terms, which must not load PyTorch, so the
network itself lives in compact_cnn_model.py, which `architecture` names.
"""

from __future__ import annotations

from shared.terms.model_config import ModelConfig

__all__ = ["COMPACT_CNN", "COMPACT_CNN_TINY", "compact_cnn"]

ARCHITECTURE = "cardiofl_plugin_example.compact_cnn_model:COMPACT_CNN_1D"


def compact_cnn(widths: tuple[int, ...], stem_kernel: int, block_kernel: int) -> ModelConfig:
    """CompactCNN1D of one stage per width: the first stage's kernel, the others', no dual attention."""
    return ModelConfig(
        stem_channels=widths[0],
        stem_kernel=stem_kernel,
        widths=widths,
        depths=(1,) * len(widths),
        block_kernel=block_kernel,
        n_heads=0,
        n_global_heads=0,
        n_blocks=0,
        dropout=0.1,
        architecture=ARCHITECTURE,
        options=(("local_adapter", True),),
    )


# Four stages of stride-2 convolutions, 32 to 128 channels: about 0.3 M parameters, trains on a CPU.
COMPACT_CNN = compact_cnn((32, 64, 128, 128), stem_kernel=15, block_kernel=7)
# Tests: two narrow stages.
COMPACT_CNN_TINY = compact_cnn((8, 16), stem_kernel=7, block_kernel=3)
