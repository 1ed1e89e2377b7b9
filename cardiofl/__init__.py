"""cardiofl's composer: the `cardiofl` command, the demo and the in-process experiment runner."""
