"""Starting ranks: ``spawn`` N local processes with torch.distributed initialised (tests, CPU runs), or join
``torchrun``'s (``init_torchrun``). ``processes`` holds [bounded-spawn] and [private-store]; ``start_method``, how
its workers start; ``link``, [launcher-link] (a rank ends the moment its launcher does)."""

from .processes import default_spawn_timeout, free_port, init_torchrun, spawn

__all__ = ["default_spawn_timeout", "free_port", "init_torchrun", "spawn"]
