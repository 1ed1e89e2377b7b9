"""The cardiofl site agent: trains at a hospital and shares only the study's shared tensors."""
