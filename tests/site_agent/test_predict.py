"""`cardiofl site predict|evaluate|export` on a finished study: the site's personal model at work."""

from __future__ import annotations

import csv
import json
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from sklearn.metrics import average_precision_score, f1_score
from typer.testing import CliRunner

from shared.labels import CLASS_NAMES
from shared.model.export import read_metadata
from shared.terms import StudyTerms
from site_agent.cli import model as cli_model
from site_agent.cli.app import site_app
from site_agent.data import ChallengeSource, ManifestSource, open_site_data
from site_agent.data.records import STANDARD_LEADS
from site_agent.data.synthetic import write_record
from site_agent.device import resolve_runtime
from site_agent.errors import WrongSite
from site_agent.predict import evaluate_predictions, for_prediction, predict_source
from site_agent.study_model import APPROVED, StudyModelError, load_site_model, read_study_config
from tests.coordinator.factories import ADMIN
from tests.site_agent.finished_study import (
    MODEL,
    ROUNDS,
    FinishedStudy,
    finished_study,
    run_export_without_cardiofl,
    seeded_signals,
)

runner = CliRunner()
ECG_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "ecg"


@pytest.fixture(scope="module")
def done(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FinishedStudy]:
    with finished_study(tmp_path_factory.mktemp("study")) as study:
        yield study


@pytest.fixture()
def coordinator_http(done: FinishedStudy, monkeypatch: pytest.MonkeyPatch) -> None:
    """The commands reach the in-process coordinator with the site's token from its config."""
    monkeypatch.setattr(cli_model, "site_http", lambda settings: done.http())


@pytest.fixture(scope="module")
def records(done: FinishedStudy, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site's records, plus one with no known class and one whose signal file is cut short."""
    folder = tmp_path_factory.mktemp("records") / "new"
    shutil.copytree(done.records, folder)
    rng = np.random.default_rng(0)
    digital = rng.integers(-300, 300, size=(12, 5000), dtype=np.int16)
    write_record(folder, "unlabelled", digital, 500, STANDARD_LEADS, ["Dx: 999999999"])
    write_record(folder, "broken", digital, 500, STANDARD_LEADS, ["Dx: 164854000"])
    mat = folder / "broken.mat"
    mat.write_bytes(mat.read_bytes()[:1000])
    return folder


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def training_view(done: FinishedStudy, folder: Path, cache: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Record id -> (signal, labels) as the site's training pipeline loads them."""
    data = open_site_data(ChallengeSource(path=folder, name="x"), cache)
    out = {}
    for split in (data.train, data.test):
        for index, record_id in enumerate(split.record_ids):
            out[record_id.removeprefix("x/")] = (np.asarray(split.signals[index]), np.asarray(split.labels[index]))
    return out


def test_predict_writes_the_personal_models_probabilities_and_skips_what_it_cannot_read(
    done: FinishedStudy, records: Path, coordinator_http: None, tmp_path: Path
) -> None:
    out = tmp_path / "predictions.csv"
    args = ["predict", "--config", str(done.config_file), "--study", str(done.study_id)]
    result = runner.invoke(site_app, [*args, "--records", str(records), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "found 42, used 41, skipped 1 (unreadable 1)" in result.output

    rows = read_csv(out)
    columns = ["record", *(f"prob_{c}" for c in CLASS_NAMES), *(f"pred_{c}" for c in CLASS_NAMES), "predicted"]
    assert list(rows[0]) == columns
    ids = [row["record"] for row in rows]
    assert len(ids) == 41 and "unlabelled" in ids and "broken" not in ids  # no label needed to predict
    probabilities = np.array([[float(row[f"prob_{c}"]) for c in CLASS_NAMES] for row in rows])
    assert probabilities.shape == (41, 20)
    assert ((probabilities >= 0) & (probabilities <= 1)).all()
    predicted = np.array([[int(row[f"pred_{c}"]) for c in CLASS_NAMES] for row in rows])
    assert (predicted == (probabilities >= 0.5)).all()
    for row, flags in zip(rows, predicted, strict=True):
        assert row["predicted"] == ";".join(c for c, flag in zip(CLASS_NAMES, flags, strict=True) if flag)

    # the same records through the training pipeline and theta^g_T with phi_k, run directly
    view = training_view(done, records, tmp_path / "cache")
    model = done.personal_model()
    labelled = [record_id for record_id in ids if record_id in view]
    assert len(labelled) == 40
    with torch.no_grad():
        expected = torch.sigmoid(model(torch.from_numpy(np.stack([view[i][0] for i in labelled])))).numpy()
    index = {record_id: row for row, record_id in enumerate(ids)}
    np.testing.assert_allclose(probabilities[[index[i] for i in labelled]], expected, atol=1e-6, rtol=0)
    assert np.abs(expected - 0.5).max() > 1e-3  # not a constant model: the comparison can fail


def test_predict_uses_the_final_round_and_the_sites_latest_phi(done: FinishedStudy) -> None:
    runtime = resolve_runtime("cpu")
    with done.client() as client:
        site_model = load_site_model(
            client, done.store, done.site, str(done.study_id), runtime, data=lambda: pytest.fail("no data needed")
        )
    assert site_model.round == ROUNDS
    assert site_model.local_round == ROUNDS  # phi_k after round T (the final evaluation kept it as round T+1)
    assert done.store.local_rounds(site_model.study.key)[-1] == ROUNDS + 1
    assert site_model.spec.model == MODEL and site_model.spec.algorithm.name == "fedavg"
    assert site_model.spec.origin == APPROVED  # the terms this site's operator approved, kept in its store
    x = seeded_signals()
    with torch.no_grad():
        assert torch.equal(site_model.model(x), done.personal_model()(x))
        earlier = done.model(ROUNDS - 1, done.store.load_local(site_model.study.key)[1])
        assert not torch.allclose(site_model.model(x), earlier(x))  # rounds differ: the choice of T matters


def test_an_earlier_round_takes_the_phi_the_site_had_then(done: FinishedStudy) -> None:
    with done.client() as client:
        site_model = load_site_model(
            client, done.store, done.site, str(done.study_id), resolve_runtime("cpu"), round_=1, data=pytest.fail
        )
    assert (site_model.round, site_model.local_round) == (1, 1)
    kept = done.store.load_local(site_model.study.key, 1)
    assert kept is not None
    x = seeded_signals()
    with torch.no_grad():
        assert torch.equal(site_model.model(x), done.model(1, kept[1])(x))


def test_the_study_config_when_given_is_used_and_checked_against_the_tensors(
    done: FinishedStudy, tmp_path: Path
) -> None:
    def toml(heads: str) -> StudyTerms:
        path = tmp_path / f"study-{heads.replace(':', '-')}.toml"
        path.write_text(
            f'name = "trial"\nsites = ["lyon", "oslo"]\nrounds = {ROUNDS}\nseed = 11\n'
            f'[model]\npreset = "tiny"\nheads = "{heads}"\n[algorithm]\nname = "fedprox"\n'
        )
        return read_study_config(path)

    runtime = resolve_runtime("cpu")
    with done.client() as client:
        site_model = load_site_model(
            client, done.store, done.site, str(done.study_id), runtime, config=toml("6:2"), data=pytest.fail
        )
        assert not site_model.spec.inferred and site_model.spec.algorithm.name == "fedprox"
        with pytest.raises(StudyModelError, match="do not match the study's tensors"):
            load_site_model(
                client, done.store, done.site, str(done.study_id), runtime, config=toml("8:0"), data=pytest.fail
            )
    x = seeded_signals()
    with torch.no_grad():
        assert torch.equal(site_model.model(x), done.personal_model()(x))


def test_a_manifest_without_labels_lists_its_records_for_prediction(done: FinishedStudy, tmp_path: Path) -> None:
    manifest = tmp_path / "list.csv"
    names = sorted(p.stem for p in done.records.glob("*.hea"))[:5]
    manifest.write_text("record\n" + "".join(f"{done.records / name}\n" for name in names))
    source = for_prediction(ManifestSource(path=manifest))
    predictions = predict_source(done.personal_model(), source, resolve_runtime("cpu"), progress=False)
    assert len(predictions.record_ids) == 5 and predictions.report.n_skipped == 0
    assert predictions.probabilities.shape == (5, 20)


def test_evaluate_prints_metrics_equal_to_scikit_learns(
    done: FinishedStudy, records: Path, coordinator_http: None, tmp_path: Path
) -> None:
    args = ["evaluate", "--config", str(done.config_file), "--study", str(done.study_id), "--records", str(records)]
    result = runner.invoke(site_app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    reported = json.loads(result.stdout)
    assert reported["n_records"] == 40  # no_label and unreadable records skipped, as in training
    assert reported["skipped"] == {"no_label": 1, "unreadable": 1}

    view = training_view(done, records, tmp_path / "cache")
    ids = sorted(view)
    truth = np.stack([view[i][1] for i in ids]).astype(int)
    with torch.no_grad():
        scores = torch.sigmoid(done.personal_model()(torch.from_numpy(np.stack([view[i][0] for i in ids])))).numpy()
    assert reported["micro_f1"] == pytest.approx(f1_score(truth, scores >= 0.5, average="micro", zero_division=0))
    present = truth.sum(axis=0) > 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # scikit-learn warns about classes without positives (they score 0)
        ap = np.array([average_precision_score(truth[:, c], scores[:, c]) if present[c] else 0.0 for c in range(20)])
    assert reported["map"] == pytest.approx(ap.mean(), abs=1e-6)
    assert reported["map_present"] == pytest.approx(ap[present].mean(), abs=1e-6)
    for c, row in enumerate(reported["classes"]):
        assert row["name"] == CLASS_NAMES[c]
        assert row["positives"] == truth[:, c].sum()
        assert row["ap"] == pytest.approx(ap[c], abs=1e-6)
        assert row["f1"] == pytest.approx(f1_score(truth[:, c], scores[:, c] >= 0.5, zero_division=0))

    table = runner.invoke(site_app, [*args, "--out", str(tmp_path / "e.csv")])
    assert table.exit_code == 0, table.output
    written = {row["record"]: row["true"] for row in read_csv(tmp_path / "e.csv")}
    assert written == {i: ";".join(c for c, on in zip(CLASS_NAMES, view[i][1], strict=True) if on) for i in ids}
    assert f"micro-F1 {reported['micro_f1']:.4f}, mAP {reported['map']:.4f}" in table.output
    assert "AFIB" in table.output


def test_evaluate_metrics_are_scikit_learns_on_the_same_predictions(done: FinishedStudy, records: Path) -> None:
    model = done.personal_model()
    predictions = predict_source(
        model, ChallengeSource(path=records), resolve_runtime("cpu"), labelled=True, batch_size=7, progress=False
    )
    evaluation = evaluate_predictions(predictions)
    truth, scores = predictions.labels, predictions.probabilities
    assert truth is not None
    assert evaluation.micro_f1 == pytest.approx(f1_score(truth, scores >= 0.5, average="micro"), abs=1e-12)
    for c in np.flatnonzero(truth.sum(axis=0)):
        assert evaluation.classes[c].ap == pytest.approx(average_precision_score(truth[:, c], scores[:, c]), abs=1e-12)


def test_export_loads_without_cardiofl_and_gives_the_models_outputs(
    done: FinishedStudy, coordinator_http: None, tmp_path: Path
) -> None:
    out = tmp_path / "lyon.pt2"
    args = ["export", "--config", str(done.config_file), "--study", str(done.study_id), "--out", str(out)]
    result = runner.invoke(site_app, args)
    assert result.exit_code == 0, result.output
    assert "(batch, 20) probabilities" in result.output
    metadata = read_metadata(out)
    assert metadata["model"] == "personal" and metadata["site"] == done.site and metadata["round"] == ROUNDS
    assert metadata["output"]["classes"] == list(CLASS_NAMES) and metadata["threshold"] == 0.5

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    loaded = run_export_without_cardiofl(out, outside)
    with torch.no_grad():
        expected = torch.sigmoid(done.personal_model()(seeded_signals())).numpy()
    np.testing.assert_allclose(loaded, expected, atol=1e-5, rtol=0)


def test_a_study_the_store_does_not_hold_is_refused_with_one_line(
    done: FinishedStudy, records: Path, coordinator_http: None, tmp_path: Path
) -> None:
    args = ["predict", "--config", str(done.config_file), "--records", str(records), "--out", str(tmp_path / "p.csv")]
    result = runner.invoke(site_app, [*args, "--study", "99"])
    assert result.exit_code == 1
    assert "holds nothing of study 99" in result.output
    missing = runner.invoke(site_app, [*args[:3], "--records", str(tmp_path / "nowhere"), *args[5:], "--study", "1"])
    assert missing.exit_code == 2 and "--records" in missing.output
    assert not (tmp_path / "p.csv").exists()


def test_another_sites_token_is_refused_before_anything_is_fetched(done: FinishedStudy) -> None:
    other = done.coordinator.post("/api/v1/sites", json={"name": "bern"}, headers=ADMIN)
    headers = {"Authorization": f"Bearer {other.json()['token']['token']}"}
    with done.client(headers) as client, pytest.raises(WrongSite, match="belongs to site 'bern'"):
        load_site_model(client, done.store, done.site, str(done.study_id), resolve_runtime("cpu"), data=pytest.fail)
    assert client.bytes_received < 1000  # asked who it is, downloaded no model


def test_an_unreachable_coordinator_is_one_line(
    done: FinishedStudy, records: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    unreachable = httpx.Client(transport=httpx.MockTransport(refuse), base_url="http://testserver")
    monkeypatch.setattr(cli_model, "site_http", lambda settings: unreachable)
    args = ["predict", "--config", str(done.config_file), "--study", str(done.study_id), "--records", str(records)]
    result = runner.invoke(site_app, [*args, "--out", str(tmp_path / "p.csv")])
    assert result.exit_code == 1
    assert "ConnectError" in result.output and "Traceback" not in result.output


def test_real_ptbxl_records_every_one_predicted_and_the_labelled_ones_evaluated(
    done: FinishedStudy, coordinator_http: None, tmp_path: Path
) -> None:
    folder = ECG_DIR / "ptbxl_subset"
    if not folder.is_dir():
        pytest.skip(f"real ECG records not found at {folder}")
    common = ["--config", str(done.config_file), "--study", str(done.study_id), "--records", str(folder)]
    predicted = runner.invoke(site_app, ["predict", *common, "--out", str(tmp_path / "p.csv")])
    assert predicted.exit_code == 0, predicted.output
    assert "found 33, used 33, skipped 0" in predicted.output  # no class needed: 12 of them have none of the 20
    assert len(read_csv(tmp_path / "p.csv")) == 33
    evaluated = runner.invoke(site_app, ["evaluate", *common, "--json"])
    assert evaluated.exit_code == 0, evaluated.output
    report = json.loads(evaluated.stdout)
    assert (report["n_records"], report["skipped"]) == (21, {"no_label": 12})  # as the site's training loads them


def test_without_an_approval_at_hand_the_model_is_read_from_the_tensors(done: FinishedStudy) -> None:
    key = f"{done.study_id}-{done.study_uid}"
    record = done.store.load_approval(key)
    assert record is not None
    done.store.remove_approval(key)  # revoked since the study ended: no terms in the store
    try:
        with done.client() as client:
            site_model = load_site_model(
                client, done.store, done.site, str(done.study_id), resolve_runtime("cpu"), data=pytest.fail
            )
    finally:
        done.store.save_approval(key, record)
    assert site_model.spec.inferred and site_model.spec.model == MODEL
    x = seeded_signals()
    with torch.no_grad():
        assert torch.equal(site_model.model(x), done.personal_model()(x))
