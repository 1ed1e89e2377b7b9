"""CompactCNN1D's presets: what a study's terms name through the `cardiofl.models` entry points (no torch here).

Cardiofl reads these configs when it validates a study's terms, which must not load PyTorch, so the
network itself lives in compact_cnn_model.py, which `architecture` names.
"""

from __future__ import annotations

from shared.model_config import ModelConfig

__all__ = ["COMPACT_CNN", "COMPACT_CNN_TINY"]

ARCHITECTURE = "cardiofl_plugin_example.compact_cnn_model:COMPACT_CNN_1D"

# Four stages of stride-2 convolutions, 32 to 128 channels: about 0.3 M parameters, trains on a CPU.
COMPACT_CNN = ModelConfig(
    stem_channels=32,
    stem_kernel=15,
    widths=(32, 64, 128, 128),
    depths=(1, 1, 1, 1),
    block_kernel=7,
    n_heads=0,
    n_global_heads=0,
    n_blocks=0,
    dropout=0.1,
    architecture=ARCHITECTURE,
    options=(("local_adapter", True),),
)
# Tests: two narrow stages.
COMPACT_CNN_TINY = ModelConfig(
    stem_channels=8,
    stem_kernel=7,
    widths=(8, 16),
    depths=(1, 1),
    block_kernel=3,
    n_heads=0,
    n_global_heads=0,
    n_blocks=0,
    dropout=0.1,
    architecture=ARCHITECTURE,
    options=(("local_adapter", True),),
)
