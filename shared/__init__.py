"""Code shared by the coordinator and the site agent: model, partition, tensor codec, metrics."""
