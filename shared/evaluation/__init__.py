"""What a model's predictions are worth, with no torch.

metrics (FedCVD's metrics and their intervals), summaries (what a round reports per site and pooled).
"""
