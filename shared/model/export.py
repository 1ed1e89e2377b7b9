"""A trained model as one self-contained `torch.export` file (.pt2) that runs with nothing but torch.

The exported program is the model in eval mode (no dropout), on the CPU in float32, followed by the
sigmoid: it takes a float32 tensor (batch, 12, samples) of raw-millivolt ECGs, preprocessed as for
training (500 Hz, `samples` = the model's signal length, 5000), and returns (batch, 20) class
probabilities in the order of `shared.labels.CLASS_NAMES`. The batch size is free. A JSON entry
`cardiofl.json` in the archive describes input, output, classes, threshold and where the model came from.

Load it where torch is installed (the release that wrote it, or a later one), without cardiofl:

    import torch
    program = torch.export.load("model.pt2")
    probabilities = program.module()(signals)  # signals: torch.float32, (batch, 12, 5000)

TorchScript is not offered: `torch.jit.script` is deprecated and cannot compile the backbone.
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from shared.errors import FormatError
from shared.evaluation.metrics import THRESHOLD
from shared.labels import CLASS_NAMES
from shared.model.network import ModelConfig

__all__ = ["EXPORT_FORMAT", "METADATA_FILE", "Probabilities", "export_model", "export_summary", "read_metadata"]

METADATA_FILE = "cardiofl.json"  # the archive entry holding the description
EXPORT_FORMAT = "cardiofl-model/1"


class Probabilities(nn.Module):
    """The model followed by the sigmoid: (B, 12, L) millivolts -> (B, 20) probabilities."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, signals: Tensor) -> Tensor:
        """(B, 20) probabilities of (B, 12, L) signals."""
        return torch.sigmoid(self.model(signals))


def export_model(
    model: nn.Module, config: ModelConfig, path: Path, *, leads: Sequence[str], description: Mapping[str, Any]
) -> dict[str, Any]:
    """Write `model` (of `config`; moved to the CPU, eval mode) to `path` as a .pt2 archive; returns its metadata.

    `leads` names the input's channels in order; `description` (study, round, site, what the model
    is ...) is added to the metadata as given.
    """
    model = model.to("cpu", torch.float32).eval()
    example = torch.zeros(2, config.n_leads, config.signal_len)
    batch = torch.export.Dim("batch", min=1)
    with torch.no_grad():
        program = torch.export.export(Probabilities(model).eval(), (example,), dynamic_shapes={"signals": {0: batch}})
    metadata = {
        "format": EXPORT_FORMAT,
        "input": {
            "shape": ["batch", config.n_leads, config.signal_len],
            "dtype": "float32",
            "units": "mV",
            "sampling_rate_hz": 500,
            "leads": list(leads),
        },
        "output": {"shape": ["batch", config.n_classes], "kind": "probabilities", "classes": list(CLASS_NAMES)},
        "threshold": THRESHOLD,
        **description,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.export.save(program, str(path), extra_files={METADATA_FILE: json.dumps(metadata, indent=2)})
    return metadata


def read_metadata(path: Path) -> dict[str, Any]:
    """The metadata of an exported file, read without loading its program."""
    with zipfile.ZipFile(path) as archive:
        for name in archive.namelist():
            if name.endswith(f"extra/{METADATA_FILE}") or name == METADATA_FILE:
                return dict(json.loads(archive.read(name)))
    raise FormatError(f"{path} holds no {METADATA_FILE}: not a cardiofl export")


def export_summary(metadata: Mapping[str, Any]) -> str:
    """What an exported file takes and gives, in one line."""
    shape = ", ".join(str(size) for size in metadata["input"]["shape"])
    output = ", ".join(str(size) for size in metadata["output"]["shape"])
    rate = metadata["input"]["sampling_rate_hz"]
    return f"input ({shape}) float32 mV at {rate} Hz, output ({output}) {metadata['output']['kind']}"
