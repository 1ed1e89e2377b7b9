import json

from typer.testing import CliRunner

from cardiofl.cli import app

runner = CliRunner()


def test_synth_then_inspect_counts_loaded_and_skipped(tmp_path) -> None:
    out = tmp_path / "sites"
    synth = ["data", "synth", "--sites", "2", "--records", "8", "--seed", "3", "--corrupt-fraction", "0.25"]
    result = runner.invoke(app, [*synth, "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert result.output.split() == [str(out / "site_00"), str(out / "site_01")]
    assert len(list((out / "site_01").glob("*.hea"))) == 8

    result = runner.invoke(app, ["data", "inspect", str(out / "site_00")])
    assert result.exit_code == 0, result.output
    assert "found 8, loaded 6" in result.output and "unreadable 2" in result.output

    result = runner.invoke(app, ["data", "inspect", str(out / "site_01"), "--json", "--cache-dir", str(tmp_path / "c")])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)["sources"][0]
    assert report["kind"] == "challenge" and report["loaded"] == 6 and report["resampled"] == 6
    assert any((tmp_path / "c").iterdir())


def test_inspect_guesses_ptbxl_and_manifest_and_reports_bad_input(tmp_path) -> None:
    (tmp_path / "ptb" / "records500").mkdir(parents=True)
    result = runner.invoke(app, ["data", "inspect", str(tmp_path / "ptb"), "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout)["sources"][0]["kind"] == "ptbxl"
    manifest = tmp_path / "list.csv"
    manifest.write_text("nothing,here\n")
    result = runner.invoke(app, ["data", "inspect", str(manifest)])
    assert result.exit_code == 2 and "no record column 'record'" in result.output
    result = runner.invoke(app, ["data", "inspect", str(tmp_path), "--kind", "sph"])
    assert result.exit_code != 0
