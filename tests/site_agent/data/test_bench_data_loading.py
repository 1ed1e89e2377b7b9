import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[3] / "bench" / "data_loading.py"


def test_benchmark_runs_at_tiny_size_and_writes_its_json(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH.parent))  # its sibling module benchlib
    spec = importlib.util.spec_from_file_location("data_loading_bench", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "results.json"
    results = bench.main(["--records", "8", "--repeats", "1", "--workdir", str(tmp_path / "w"), "--out", str(out)])
    assert json.loads(out.read_text()) == results
    assert results["records_loaded"] == results["records_found"] == 8
    assert results["reparse_s"] > 0 and results["cache_epoch_s"] > 0 and results["ratio_reparse_over_cache"] > 1
    assert "ratio re-parse / cache epoch" in capsys.readouterr().out
