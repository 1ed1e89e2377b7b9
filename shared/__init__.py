"""Code shared by the coordinator and the site agent, in rooms by floor (lowest first).

- errors, logs, labels, plugins, tls, release, tables: the ground floor, what every room may use;
- evaluation/: metrics of predictions and their per-site and pooled summaries (no torch);
- privacy/: secure-aggregation and discrete-noise primitives, plain data in and out (no torch);
- terms/: a study's terms as data, `shared.terms.StudyTerms`, and the model presets they name (no torch);
- wire/: what crosses the network as JSON (no torch);
- tensors/: name-keyed tensors as safetensors bytes, windows over them, an update's body;
- model/: the FedDualAtt network, its global/local partition and its export;
- algorithms/: what each algorithm declares to both sides, its registry and its server step;
- study/: where a study's terms are applied: its checks, exchange, rounds, DP and secure aggregation.

The floors are an import contract (pyproject.toml): a room imports only the rooms below it.
"""
