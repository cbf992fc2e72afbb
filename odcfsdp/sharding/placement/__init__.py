"""Who holds what: the ranks a model is sharded over (the mesh, HSDP's layout, their collectives and meetings, the
watchdog that ends a run when one stops) and where every parameter value lives in the flat groups (the layout).

The lowest layer of ``sharding``: it imports nothing of the others."""
