"""cardiofl's composer: the `cardiofl` command, the researcher's client, the demo and the experiment runner."""
