"""The plug-in on its own: the model and its partition, mu's rule, their registration (cardiofl installed beside it)."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from cardiofl_plugin_example.adaptive_prox import FALLING, LOSS, MU, AdaptiveProxParams
from cardiofl_plugin_example.adaptive_prox_client import next_mu
from cardiofl_plugin_example.compact_cnn import COMPACT_CNN_TINY
from cardiofl_plugin_example.csv_source import CsvFolderSource

from site_agent.data.records import STANDARD_LEADS

PARAMS = AdaptiveProxParams(mu=0.5, step=0.1, patience=2)
DISTRIBUTION = "cardiofl-plugin-example"


def test_the_model_registers_and_keeps_its_input_adapter_at_the_site() -> None:
    """Cardiofl's model registry finds the presets; the partition rule keeps exactly the adapter local."""
    from shared.model.partition import model_partition, model_schema
    from shared.terms.model_config import PRESETS

    assert PRESETS["compact_cnn_tiny"] == COMPACT_CNN_TINY and "compact_cnn" in PRESETS
    identity = PRESETS.plugin("compact_cnn_tiny")
    assert identity is not None and identity.distribution == DISTRIBUTION
    partition = model_partition(COMPACT_CNN_TINY)
    assert set(partition.local) == {"adapter.weight", "adapter.bias"}
    assert set(partition.shared) == set(model_schema(COMPACT_CNN_TINY)) - set(partition.local)
    assert "head.weight" in partition.shared
    everything_shared = replace(COMPACT_CNN_TINY, options=(("local_adapter", False),))
    assert model_partition(everything_shared).local == ()


def test_the_model_starts_at_the_identity_adapter_and_is_seeded() -> None:
    """Same seed, bit-identical state; the adapter passes the signal through; logits per class."""
    from shared.model.network import build_model

    one, two = build_model(COMPACT_CNN_TINY, seed=3), build_model(COMPACT_CNN_TINY, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(one.state_dict().values(), two.state_dict().values(), strict=True))
    signals = torch.randn(2, 12, 500)
    assert torch.equal(one.adapter(signals), signals)
    assert one.eval()(signals).shape == (2, 20)


def write_csv_site(folder: Path, rows: list[tuple[str, str]]) -> Path:
    """An index and one 10 s, 500 Hz file in uV per (record, codes) row, its columns in reverse lead order.

    Lead i of record n is 1000 uV sin(2 pi (1 + n + i/10) t); the record `short_of_v6` has no V6 column.
    """
    folder.mkdir(parents=True)
    lines = ["record,codes,age,sex"] + [f"{name},{codes},60,female" for name, codes in rows]
    (folder / "index.csv").write_text("\n".join(lines) + "\n")
    t = np.arange(5000) / 500.0
    for number, (name, _) in enumerate(rows):
        leads = [lead for lead in STANDARD_LEADS if not (name == "short_of_v6" and lead == "V6")]
        values = np.stack([1000.0 * np.sin(2 * np.pi * (1 + number + i / 10) * t) for i in range(len(leads))], axis=1)
        body = "\n".join(",".join(f"{v:.4f}" for v in row[::-1]) for row in values)
        (folder / f"{name}.csv").write_text(",".join(reversed(leads)) + "\n" + body + "\n")
    return folder


def test_the_csv_source_registers_and_reads_through_cardiofls_pipeline(tmp_path: Path) -> None:
    """Kept records in mV in the standard lead order; a missing lead and an unknown code skipped and counted."""
    from site_agent.data import open_site_data, parse_source
    from site_agent.data.config import SOURCES

    assert SOURCES["csv_folder"] is CsvFolderSource and SOURCES.plugin("csv_folder") is not None
    rows = [(f"ecg{i}", "164889003") for i in range(4)] + [("short_of_v6", "164889003"), ("odd", "999")]
    folder = write_csv_site(tmp_path / "site", rows)
    source = parse_source({"kind": "csv_folder", "path": str(folder), "test_fraction": 0.0})
    assert isinstance(source, CsvFolderSource) and source.units == "uV"
    data = open_site_data(source, tmp_path / "cache")
    report = data.report.sources[0]
    assert report.loaded == 4 and report.skipped == {"unreadable": 1, "no_label": 1}
    signal, fs = source.read_signal(next(r for r in source.records() if r.record_id == "ecg0"))
    expected = np.sin(2 * np.pi * (1 + 0 / 10) * np.arange(5000) / 500.0)  # lead I of ecg0, now in mV
    assert fs == 500.0 and signal.shape == (12, 5000) and np.allclose(signal[0], expected, atol=1e-6)


def test_mu_rises_when_the_loss_rose_and_falls_after_patience_falls() -> None:
    """Li et al.'s heuristic, one round at a time."""
    assert next_mu(0.5, math.nan, 1.0, 0, PARAMS) == (0.5, 0)  # the first round has nothing to compare
    assert next_mu(0.5, 1.0, 1.2, 1, PARAMS) == pytest.approx((0.6, 0))
    assert next_mu(0.5, 1.0, 0.9, 0, PARAMS) == (0.5, 1)
    assert next_mu(0.5, 1.0, 0.9, 1, PARAMS) == pytest.approx((0.4, 0))
    assert next_mu(0.05, 1.0, 0.9, 1, PARAMS) == (0.0, 0)  # never below 0


def test_the_rule_registers_through_its_entry_point() -> None:
    """Cardiofl's registry finds the rule and its client, and names the distribution that provides them."""
    from shared.algorithms.registry import ALGORITHMS
    from site_agent.algorithms import CLIENT_ALGORITHMS

    assert (
        "fedprox_adaptive" in ALGORITHMS and type(CLIENT_ALGORITHMS["fedprox_adaptive"]).__name__ == "AdaptiveFedProx"
    )
    identity = ALGORITHMS.plugin("fedprox_adaptive")
    assert identity is not None and identity.distribution == DISTRIBUTION and identity.version == "0.1.0"


def test_a_study_keeps_each_sites_mu_as_its_own() -> None:
    """mu, the last loss and the falling count are site state: kept, never uploaded."""
    from shared.study.rules import algorithm_exchange
    from shared.terms import AlgorithmSpec, ModelSpec

    exchange = algorithm_exchange(ModelSpec(preset="tiny"), AlgorithmSpec(name="fedprox_adaptive"))
    assert {MU, LOSS, FALLING} <= exchange.local_names()
    assert not {MU, LOSS, FALLING} & set(exchange.upload_schema())  # nothing of it leaves the site
