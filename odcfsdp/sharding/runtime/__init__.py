"""What runs while a model trains: the engine behind both front doors, one step's lifecycle (steps 1-7), the minibatch
(steps 8-10), the hook driver, prefetch, and the checks and refusals that keep a wrapped model attached to its shards.

Above ``groups``; only ``api`` is higher."""
