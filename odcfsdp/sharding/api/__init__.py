"""The front doors: ``ODCShard``, ``fully_shard`` (FSDP2's entry point, its ``FSDPModule`` surface and the patch that
routes torch's to it), their settings, and ``sharded(model)``, one view of a model whichever door built it.

The top layer of ``sharding``; ``odcfsdp.sharding`` re-exports what users need."""
