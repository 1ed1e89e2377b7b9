"""The big-model benchmark cuts each of a round's four transfers once and resends little more than the cut-off part."""

import json
import re
from pathlib import Path

from tests.bench.test_benchmarks import run_bench

# The coordinator reads up to 4 MiB of an upload ahead of its handler (coordinator/serving/process.py), and
# what it had read but not yet stored when a connection is cut is lost and sent again: at 4 MB a cut upload
# is resent almost whole (about 1.25x). From 32 MB on the target of 1.1 holds with room to spare.
MEGABYTES = 32


def test_each_transfer_is_cut_once_and_the_bytes_sent_stay_within_a_tenth_of_the_payload(tmp_path: Path) -> None:
    out = tmp_path / "big_model.json"
    stdout = run_bench(
        "big_model", "--megabytes", str(MEGABYTES), "--cut", "0.5", "--resume-delay-s", "0.2",
        "--workdir", str(tmp_path / "w"), "--out", str(out),
    )  # fmt: skip
    ratio = re.search(r"^bytes sent / payload: (\d+\.\d{3}) \(target <= 1\.1\)$", stdout, re.MULTILINE)
    assert ratio is not None, stdout
    assert 1.0 < float(ratio[1]) <= 1.1
    assert re.search(r"^peak RSS: coordinator \d+ MB, agent \d+ MB$", stdout, re.MULTILINE), stdout
    results = json.loads(out.read_text())
    assert results["sites"] == 2 and results["cut"] == 0.5
    assert abs(results["theta_bytes"] - MEGABYTES * 1e6) < 0.01 * MEGABYTES * 1e6
    transfers = results["transfers"]  # per agent: its upload, its download of theta^g, whole bodies
    assert len(transfers) == 4 and all(
        results["theta_bytes"] <= length < results["theta_bytes"] + 64_000 for length in transfers
    )
    assert results["payload_bytes"] == sum(transfers)
    assert results["sent_over_payload"] == results["bytes_sent"] / results["payload_bytes"]
    assert results["bytes_sent"] == results["read_up_bytes"] + results["read_down_bytes"]
    assert results["payload_bytes"] < results["bytes_delivered"] <= results["bytes_sent"]
    assert results["coordinator_peak_rss"] >= results["coordinator_peak_rss_before_start"] > 0
    assert len(results["agent_peak_rss"]) == 2 and min(results["agent_peak_rss"]) > results["theta_bytes"]
    assert results["wall_s"] > 0 and results["unframed_streams"] == 0
