"""The training application: ``python -m odcfsdp.train`` and its tools, built on the library around it.

The library (what a FSDP user imports: ``odcfsdp.ODCShard``, ``odcfsdp.param_groups``,
``odcfsdp.launch.spawn``, ``odcfsdp.checkpoint``, ``odcfsdp.loop``) never imports this package.
Here: the typed configs (``config``, ``shard_config``, their checks in ``validation``), the data
sources (``sources``), the command line (``cli``, ``train``), the checks before ranks start
(``preflight``), the model specs (``specs``), the pieces of a run
(``builders``) and the run itself (``trainer``), its metrics and plot, HF export and the offline
bundle. Nothing is imported here, so ``python -m odcfsdp.bundle`` runs without torch.
"""
