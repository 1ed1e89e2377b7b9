"""FedProx with a proximal weight each site adapts to its own loss: a cardiofl plug-in algorithm."""
