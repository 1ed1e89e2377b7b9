"""An example cardiofl plug-in: the model CompactCNN1D (its input adapter kept at each site), FedProx of adaptive mu."""
