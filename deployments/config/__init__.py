"""The serving configuration: what `serve_config.yaml`'s `args:` hold and what each deployment is bound with.

One naming rule (docs/architecture.md, "Configuration"):

- `...Args`: a block the user writes under `args:` (`AppArgs` is the whole mapping, `HttpArgs` its `http:`, ...),
  validated where it is declared (`sections`, `app`). Field names are the YAML's.
- `...Settings`: what `serve_graph.builder` binds one deployment with (`settings`): the validated `...Args` objects
  held whole, plus what the builder resolved once (the embodiment's statistics, the checkpoint's layout).
- `...Config` stays the model's own (`dreamzero.config`: `DreamZeroConfig`, `PipelineConfig`), never the server's.

Validators read no file and import no transport: the files the args name are checked at `serve run` by
`serve_graph.config.check_files`, and read by the replica that uses them (the ZeroMQ door reads its CURVE keys).

Import each name from its module (`deployments.config.sections`, `.settings`, `.app`), not from this package: the
import-direction test sees an import circle only through the module that closes it.
"""
