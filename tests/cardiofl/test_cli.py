from pathlib import Path

from typer.testing import CliRunner

from cardiofl.cli import app

runner = CliRunner()


def test_help_lists_model_commands() -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    assert "model" in result.output


def test_model_summary_prints_all_nine_ratios_of_the_paper_preset() -> None:
    result = runner.invoke(app, ["model", "summary", "--preset", "paper", "--heads", "6:2"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for ratio in ("8:0", "7:1", "6:2 *", "5:3", "4:4", "3:5", "2:6", "1:7", "0:8"):
        assert ratio in result.output
    assert "526,080" in result.output  # phi_k at 6:2
    assert "23,442,580" in result.output  # theta^g parameters at 6:2
    assert "tokens=157" in result.output


def test_model_summary_rejects_bad_heads() -> None:
    result = runner.invoke(app, ["model", "summary", "--heads", "9:9x"])
    assert result.exit_code != 0


def test_study_create_checks_the_terms_before_it_sends_them(tmp_path: Path) -> None:
    toml = tmp_path / "study.toml"
    toml.write_text(
        'name = "bad"\nsites = ["lyon", "oslo", "rome"]\nmin_sites = 2\n'
        '[privacy.secure_aggregation]\nthreshold = 5\n[algorithm]\nname = "fedprox"\n[algorithm.params]\nmu = -1\n'
    )
    # nothing listens on port 9: an attempt to send would fail with "unreachable", not with the terms' errors
    result = runner.invoke(app, ["study", "create", str(toml), "--url", "http://127.0.0.1:9", "--token", "x" * 43])
    assert result.exit_code == 1
    assert "algorithm.params.mu:" in result.output and "unreachable" not in result.output


def test_version_prints_the_release_and_the_protocol() -> None:
    from importlib.metadata import version

    from shared.wire.protocol import PROTOCOL_VERSION

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"cardiofl {version('cardiofl')} (protocol {PROTOCOL_VERSION})"


def test_study_show_names_the_relation_only_where_the_coordinator_says_it() -> None:
    from cardiofl.client.cli import _privacy_line
    from shared.wire.metrics import PrivacySpent

    shown = {"mode": "central", "noise_multiplier": 1.0, "clip_norm": 0.1, "epsilon": 10.7255, "delta": 1e-5}
    current = {**shown, "rounds": 1, "relation": "replace-one", "sensitivity": 0.2}
    assert _privacy_line(PrivacySpent(**current)).endswith(
        "after 1 released model(s), replace-one neighbours (sensitivity 0.2)"
    )
    older = {**shown, "rounds": 1}  # a coordinator before 0.6.0 accounted another relation: claim none
    assert _privacy_line(PrivacySpent(**older)).endswith("after 1 released model(s)")
