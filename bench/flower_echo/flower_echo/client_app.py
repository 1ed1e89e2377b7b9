"""The Flower client: returns the arrays it received with its number of examples (no training)."""

from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import ClientAppCallable
from flwr.common import Code, FitRes, Status
from flwr.compat.common import recorddict_compat as compat


def secure_when_asked(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Flower's SecAgg+ client mod on every train message of a run with `secure = true`."""
    if context.run_config.get("secure", False):
        return secaggplus_mod(msg, context, call_next)
    return call_next(msg, context)


app = ClientApp(mods=[secure_when_asked])


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Send the received arrays back, weighted by this node's n_k."""
    num_examples = 100 + int(context.node_config.get("partition-id", 0))
    if context.run_config.get("secure", False):  # SecAggPlusWorkflow sends FitIns and secaggplus_mod reads a FitRes
        fitins = compat.recorddict_to_fitins(msg.content, keep_input=True)
        fitres = FitRes(Status(Code.OK, "echo"), fitins.parameters, num_examples, {})
        return Message(compat.fitres_to_recorddict(fitres, keep_input=True), reply_to=msg)
    content = RecordDict({"arrays": msg.content["arrays"], "metrics": MetricRecord({"num-examples": num_examples})})
    return Message(content, reply_to=msg)
