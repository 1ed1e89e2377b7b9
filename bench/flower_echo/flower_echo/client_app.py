"""The Flower client: returns the arrays it received with its number of examples (no training)."""

from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Send the received arrays back, weighted by this node's n_k."""
    num_examples = 100 + int(context.node_config.get("partition-id", 0))
    content = RecordDict({"arrays": msg.content["arrays"], "metrics": MetricRecord({"num-examples": num_examples})})
    return Message(content, reply_to=msg)
