"""Methods on FedCVD's plain ResNet1D-34 next to methods on the hybrid model: config and report."""

from __future__ import annotations

from pathlib import Path

import pytest

from cardiofl.experiment.config import ExperimentConfig
from cardiofl.experiment.grid import run_experiment
from cardiofl.experiment.report import write_report
from site_agent.device import resolve_runtime


def mixed_experiment(tmp_path: Path, plain_heads: list[str]) -> ExperimentConfig:
    return ExperimentConfig.model_validate(
        {
            "name": "mixed",
            "preset": "tiny",
            "heads": ["8:0"],
            "seeds": [0],
            "rounds": 1,
            "synthetic": {"sites": 2, "records_per_site": 10, "seed": 5},
            "training": {"batch_size": 2, "max_steps": 1},
            "methods": [
                {"label": "FedDualAtt"},
                {"label": "FedAvg", "preset": "resnet1d34", "heads": plain_heads},
            ],
            "device": "cpu",
            "cache_dir": str(tmp_path / "cache"),
        }
    )


def test_a_method_runs_on_its_own_preset_without_a_head_split(tmp_path: Path) -> None:
    config = mixed_experiment(tmp_path, ["-"])
    models = {key.method: config.study(key).model for key in config.runs()}
    assert (models["FedAvg"].preset, models["FedAvg"].heads) == ("resnet1d34", "-")
    assert (models["FedDualAtt"].preset, models["FedDualAtt"].heads) == ("tiny", "8:0")
    with pytest.raises(ValueError, match="no attention heads"):
        mixed_experiment(tmp_path, ["8:0"])


def test_the_report_puts_plain_resnet_rows_and_hybrid_rows_in_two_tables(tmp_path: Path) -> None:
    config = mixed_experiment(tmp_path, ["-"])
    results = tmp_path / "results.jsonl"
    run_experiment(config, results, runtime=resolve_runtime("cpu"))
    table = write_report(results, tmp_path / "report")["table.md"].read_text()
    plain, hybrid = table.split("## The dual-attention hybrid model")
    assert plain.startswith("## FedCVD's ResNet1D-34")
    assert "| FedAvg | - |" in plain and "FedDualAtt" not in plain
    assert "| FedDualAtt | 8:0 |" in hybrid and "| FedAvg |" not in hybrid
