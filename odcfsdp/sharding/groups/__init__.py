"""The flat groups and their parameters: a group's rows, buffers and state, a parameter's sharded and unsharded
forms, the dtypes they take (mixed precision, float8), and how an optimizer's step reaches them.

Above ``placement`` and ``transport``; below ``runtime``."""
