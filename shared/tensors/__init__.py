"""Name-keyed tensors as safetensors bytes: the lowest floor of shared/ that imports torch.

codec (dump, load, schema checks), windows over a payload, flat sum buffers, and an update's body.
"""
