"""The Flower server: FedAvg rounds over the arrays of a safetensors file, each round timed, then its peak memory."""

import json
import time
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from safetensors.numpy import load_file

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Wait for every node, run the rounds, and write their start and end times and this process's VmHWM."""
    config = context.run_config
    nodes = int(config["num-nodes"])
    tensors = load_file(str(config["arrays-path"]))
    arrays = ArrayRecord(numpy_ndarrays=[tensors[name].reshape(-1) for name in sorted(tensors)])
    strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=nodes, min_available_nodes=nodes)
    while len(list(grid.get_node_ids())) < nodes:
        time.sleep(0.1)
    rounds = []
    for number in range(1, int(config["num-rounds"]) + 1):
        start = time.time()
        replies = grid.send_and_receive(strategy.configure_train(number, arrays, ConfigRecord(), grid), timeout=3600)
        aggregated, _ = strategy.aggregate_train(number, replies)
        if aggregated is None:
            raise RuntimeError(f"round {number}: no replies to aggregate")
        arrays = aggregated
        rounds.append({"round": number, "start": start, "end": time.time()})
    status = Path("/proc/self/status").read_text().splitlines()
    peak = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
    Path(str(config["timings-path"])).write_text(json.dumps({"rounds": rounds, "serverapp_peak_rss": peak}))
