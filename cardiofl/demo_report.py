"""What `cardiofl demo` says of its study: a line per round, the round tables and their note, how to look again.

Round t's line and the tables' row t speak of the same two models: each site's own model after round t's
training (`local_eval`, the site columns; the line gives their mean) and the global model θ^g_t that
round t released (`eval`, pooled). The sites read θ^g_t when they receive it, in round t + 1 or the final
evaluation, so round t's line is printed once that round has completed and every site's reading is in.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from rich.table import Table

from shared.wire.api import RoundPublic
from shared.wire.metrics import MetricSummary, PooledMetrics

__all__ = [
    "DemoReport",
    "restart_command",
    "round_line",
    "round_tables",
    "stopped_lines",
    "table_note",
]

FIGURES = (("micro-F1", "micro_f1"), ("mAP", "map"), ("macro-AUROC", "macro_auroc"))
_GLOBAL_WORDS = {  # PooledMetrics.global_label: what the pooled `eval` model is, in the note's words
    "Global": "θ^g_{t} with the initial local part φ_0",
    "Global (site BatchNorm)": "θ^g_{t} with φ_0 and each site's own BatchNorm",
}


def _fmt(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def _figures(summary: MetricSummary | None) -> str:
    summary = summary or MetricSummary()
    return " ".join(f"{label} {_fmt(getattr(summary, name))}" for label, name in FIGURES)


def _sites(r: RoundPublic) -> str:
    return f"{len(r.updates)} site{'' if len(r.updates) == 1 else 's'}"


def own_final_model(algorithm: str, t: int) -> str:
    """What each site's own model is in the final evaluation after round `t` (site_agent `personal_model`)."""
    return f"θ^g_{t} with its own φ_k" if algorithm == "fedavg" else f"own {algorithm} model from θ^g_{t}"


def round_line(r: RoundPublic, algorithm: str = "fedavg") -> str:
    """One settled round as the demo prints it, each figure named by the model it is of."""
    pooled = r.pooled or PooledMetrics()
    if r.kind == "evaluate":
        t = r.number - 1
        return (
            f"final evaluation: {_sites(r)}, nothing trained; each site's "
            f"{own_final_model(algorithm, t)} (mean): {_figures(pooled.local_eval)}"
        )
    spent = pooled.privacy
    privacy = (
        f", epsilon {spent.epsilon:.3g} at delta {spent.delta:g} ({spent.relation})"
        if spent and spent.epsilon is not None
        else ""
    )
    return (
        f"round {r.number}: {_sites(r)}, train loss {_fmt(pooled.train_loss)}{privacy}; "
        f"own models after round {r.number} (mean): {_figures(pooled.local_eval)}; "
        f"global model θ^g_{r.number} (pooled): {_figures(pooled.eval)}"
    )


class DemoReport:
    """The round lines of one study, each printed once, in order, when both its models have been read."""

    def __init__(self, algorithm: str = "fedavg") -> None:
        """Nothing printed yet."""
        self.algorithm = algorithm
        self.reported: set[int] = set()

    def new_lines(self, rounds: Sequence[RoundPublic], finished: bool) -> list[str]:
        """The lines of the completed rounds not printed yet whose θ^g_t was read (all of them once `finished`)."""
        completed = {r.number: r for r in rounds if r.status == "completed"}
        lines = []
        for number, r in sorted(completed.items()):
            if number in self.reported:
                continue
            # θ^g_t is read in round t + 1: pooled over the sites that reported so far until that round completes
            if not (r.kind == "evaluate" or number + 1 in completed or finished):
                break  # later rounds wait for this one
            self.reported.add(number)
            lines.append(round_line(r, self.algorithm))
        return lines


def round_tables(rounds: Sequence[RoundPublic]) -> list[Table]:
    """Micro-F1 and mAP per round, as `cardiofl study show` prints them, titled with the models they are of."""
    from cardiofl.client.figures import round_table  # numpy and scipy: the demo's, not `cardiofl --help`'s

    return [
        round_table(
            rounds,
            metric,
            title=f"{label}: each site's own model after the round, and the round's global model θ^g_t (pooled)",
        )
        for label, metric in FIGURES[:2]
    ]


def table_note(rounds: Sequence[RoundPublic], algorithm: str = "fedavg") -> list[str]:
    """A few lines under the tables: what the final evaluation reads, and why a micro-F1 can be 0.000."""
    lines = []
    final = next((r for r in rounds if r.kind == "evaluate" and r.status == "completed"), None)
    if final is not None:
        t = final.number - 1
        last = next((r.pooled for r in rounds if r.number == t and r.pooled is not None), None)
        words = _GLOBAL_WORDS.get(last.global_label or "", "θ^g_{t}") if last else "θ^g_{t}"
        lines.append(
            f"final eval: nothing trains; on the same test split as every round, it scores each site's "
            f"{own_final_model(algorithm, t)} (site columns) and {words.format(t=t)} (round {t}'s global). "
            f"A round's site column is the site's model right after its own training, before it is averaged "
            f"with the other sites', so the final eval can read below round {t}."
        )
    zeros = [r.number for r in rounds if r.pooled is not None and r.pooled.eval and r.pooled.eval.micro_f1 == 0]
    if zeros or any(u.local_eval and u.local_eval.micro_f1 == 0 for r in rounds for u in r.updates):
        where = f" (the global model in round{'s' if len(zeros) > 1 else ''} {_span(zeros)})" if zeros else ""
        lines.append(
            f"micro-F1 counts a label as predicted at a score of 0.5 or more: a 0.000{where} means that no "
            "record's true label scored that high; mAP ranks the scores and needs no threshold."
        )
    return lines


def _span(numbers: list[int]) -> str:
    """`1–4` for consecutive numbers, else `1, 3, 4`."""
    if numbers == list(range(numbers[0], numbers[-1] + 1)) and len(numbers) > 1:
        return f"{numbers[0]}–{numbers[-1]}"
    return ", ".join(map(str, numbers))


def restart_command(database_url: str, port: int) -> str:
    """The command that starts a coordinator on the demo's database and port again."""
    beside = Path(sys.executable).with_name("cardiofl")
    cardiofl = [str(beside)] if beside.is_file() else [sys.executable, "-m", "cardiofl"]
    args = [*cardiofl, "coordinator", "serve", "--port", str(port)]
    return f"CARDIOFL_DATABASE_URL={shlex.quote(database_url)} {shlex.join(args)}"


def stopped_lines(database_url: str | None, port: int, card: Path | None) -> list[str]:
    """What the demo prints once its coordinator stopped: that it did, and how to see the study again.

    `database_url` is the demo's own SQLite database (None where the demo was given another database).
    """
    lines = ["the coordinator has stopped, and the dashboard with it (--keep-running keeps them up until Ctrl-C)."]
    if database_url is not None:
        lines += [
            "to open the dashboard link above again, start a coordinator on the demo's database "
            "(the next demo in this workdir replaces it):",
            f"  {restart_command(database_url, port)}",
        ]
    else:
        lines.append(
            f"to open the dashboard link above again, start a coordinator on port {port} with "
            "CARDIOFL_DATABASE_URL set to the demo's --database-url: cardiofl coordinator serve --port " + str(port)
        )
    if card is not None:
        lines.append(f"the study's model card: {card}")
    return lines
