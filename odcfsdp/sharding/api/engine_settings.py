"""``EngineSettings``: what the one-sided engine takes beyond FSDP2's arguments, for ``fully_shard``.

``ODCShard`` takes these as keyword arguments of its own (the same names and defaults); ``fully_shard``
keeps FSDP2's signature and takes them as one object, ``fully_shard(module, ..., settings=EngineSettings(...))``.
Every call of one model must pass equal settings (one engine has one of each), as they must share the mesh.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..runtime.arguments import check_numbers
from ..groups.float8 import FLOAT8_GATHER_DEFAULT


@dataclass(frozen=True)
class EngineSettings:
    """The engine's own settings ([engine] in ``engine.py``), each as ``ODCShard``'s argument of the same name.

    Attributes:
        group_bytes: byte budget of one group outside units (a unit's parameters are one group), counted in
            unsharded ``param_dtype`` bytes ([layout]).
        prefetch: hook sites gathered ahead on a side stream ([prefetch]).
        gather_masters: peers gather the fp32 masters and cast while unpacking: no ``param_dtype`` copy of the
            rows, 2 bytes per parameter / N less, twice the gather bytes ([gather-masters]).
        float8_gather: gather the weights of tensorwise torchao ``Float8Linear`` layers in float8
            ([float8-gather]).
        timeout: seconds a rank waits for the others at a meeting ([watchdog]).
        overlap_push: push gradients on a side stream while backward goes on (CUDA).
    """

    group_bytes: int = 32 << 20
    prefetch: int = 1
    gather_masters: bool = False
    float8_gather: bool = FLOAT8_GATHER_DEFAULT
    timeout: float = 300.0
    overlap_push: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.group_bytes, bool) or not isinstance(self.group_bytes, int) or self.group_bytes <= 0:
            raise ValueError(f"group_bytes must be a positive int (bytes per group), got {self.group_bytes!r}")
        check_numbers(self.prefetch, self.timeout)
        for name in ("gather_masters", "float8_gather", "overlap_push"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")


__all__ = ["EngineSettings"]
