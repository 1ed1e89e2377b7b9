"""The cardiofl coordinator: runs federated studies round by round and stores every global model."""
