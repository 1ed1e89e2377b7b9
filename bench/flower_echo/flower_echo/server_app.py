"""The Flower server: rounds over the arrays of a safetensors file, each round timed, then its peak memory.

Plain rounds (`secure = false`) are FedAvg through the Message API. Secure rounds (`secure = true`)
are Flower's SecAgg+ (`SecAggPlusWorkflow` as the fit workflow of `DefaultWorkflow`, legacy FedAvg)
with `num-shares` shares per client (itself and its neighbours) and `reconstruction-threshold`.
"""

import json
import time
from pathlib import Path

import numpy as np
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
    ndarrays = [tensors[name].reshape(-1) for name in sorted(tensors)]
    while len(list(grid.get_node_ids())) < nodes:
        time.sleep(0.1)
    if config.get("secure", False):
        rounds, error = secure_rounds(grid, context, ndarrays, nodes)
    else:
        rounds, error = plain_rounds(grid, context, ndarrays, nodes), 0.0
    status = Path("/proc/self/status").read_text().splitlines()
    peak = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
    results = {"rounds": rounds, "serverapp_peak_rss": peak, "max_abs_error": error}
    Path(str(config["timings-path"])).write_text(json.dumps(results))


def plain_rounds(grid: Grid, context: Context, ndarrays: list[np.ndarray], nodes: int) -> list[dict]:
    """FedAvg rounds (Message API), each timed from sending the instructions to the aggregate."""
    arrays = ArrayRecord(numpy_ndarrays=ndarrays)
    strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=nodes, min_available_nodes=nodes)
    rounds = []
    for number in range(1, int(context.run_config["num-rounds"]) + 1):
        start = time.time()
        replies = grid.send_and_receive(strategy.configure_train(number, arrays, ConfigRecord(), grid), timeout=3600)
        aggregated, _ = strategy.aggregate_train(number, replies)
        if aggregated is None:
            raise RuntimeError(f"round {number}: no replies to aggregate")
        arrays = aggregated
        rounds.append({"round": number, "start": start, "end": time.time()})
    return rounds


def secure_rounds(grid: Grid, context: Context, ndarrays: list[np.ndarray], nodes: int) -> tuple[list[dict], float]:
    """SecAgg+ rounds, each timed from its setup stage to the aggregate; the last aggregate's largest error."""
    from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.compat.common import recorddict_compat as compat
    from flwr.server import LegacyContext, ServerConfig
    from flwr.server.strategy import FedAvg as LegacyFedAvg
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
    from flwr.server.workflow.constant import MAIN_PARAMS_RECORD

    config = context.run_config
    strategy = LegacyFedAvg(
        fraction_fit=1.0,
        fraction_evaluate=0.0,
        min_fit_clients=nodes,
        min_evaluate_clients=0,
        min_available_clients=nodes,
        initial_parameters=ndarrays_to_parameters(ndarrays),
    )
    secagg = SecAggPlusWorkflow(
        num_shares=int(config["num-shares"]), reconstruction_threshold=int(config["reconstruction-threshold"])
    )
    rounds: list[dict] = []

    def timed_fit(grid: Grid, legacy: Context) -> None:
        before = legacy.state.array_records[MAIN_PARAMS_RECORD]
        start = time.time()
        secagg(grid, legacy)
        if legacy.state.array_records[MAIN_PARAMS_RECORD] is before:
            raise RuntimeError(f"round {len(rounds) + 1}: SecAgg+ halted without an aggregate")
        rounds.append({"round": len(rounds) + 1, "start": start, "end": time.time()})

    legacy = LegacyContext(context, config=ServerConfig(num_rounds=int(config["num-rounds"])), strategy=strategy)
    DefaultWorkflow(fit_workflow=timed_fit)(grid, legacy)
    final = parameters_to_ndarrays(
        compat.arrayrecord_to_parameters(legacy.state.array_records[MAIN_PARAMS_RECORD], True)
    )
    error = max(float(np.abs(got - sent).max()) for got, sent in zip(final, ndarrays, strict=True))
    return rounds, error
