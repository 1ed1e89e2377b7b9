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
