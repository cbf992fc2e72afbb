"""``EngineSettings``: the engine's own options beyond FSDP2's arguments, each documented once, here.

``ODCShard`` takes them as keyword arguments of its own (the same names and defaults) and builds one;
``fully_shard`` keeps FSDP2's signature and takes one, ``fully_shard(module, ..., settings=EngineSettings(...))``;
``ShardEngine`` reads them from it. Every call of one model must pass equal settings (one engine has one of each),
as they must share the mesh.

The string below each field is that option's one documentation ([config-docs] in ``odcfsdp/app/config.py``):
``ODCShard``'s docstring lists them from here (``settings_args_doc``), and the ``shard.*`` config keys of the same
names take their help from here (``ShardConfig._field_docs_from``).
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, fields

from ...checks import field_docs
from .arguments import check_numbers
from ..groups.float8 import FLOAT8_GATHER_DEFAULT


@dataclass(frozen=True)
class EngineSettings:
    """The engine's own options, each as ``ODCShard``'s argument of the same name (see the module's docstring)."""

    group_bytes: int = 32 << 20
    """byte budget of one group outside ``units``, counted in unsharded ``param_dtype`` bytes. A larger parameter forms
    its own group. A unit's parameters are one group (per dtype and ``requires_grad`` flag) whatever the budget."""
    prefetch: int = 1
    """how many hook sites ahead to gather (forward order, reversed in backward; sites whose groups are already in
    hand do not count); 0 disables. On CUDA on a side stream while the current site computes; elsewhere simply ahead
    of use. Each prefetched group holds its unsharded buffer early."""
    gather_masters: bool = False
    """peers gather the fp32 master rows and cast them to ``param_dtype`` while unpacking, so no ``param_dtype`` copy
    of the rows is kept (2 bytes per parameter / N less with bf16) for twice the gather bytes ([gather-masters] in
    ``group.py``)."""
    split_masters: bool = False
    """hold each bf16 group's fp32 master as its bf16 row plus 16 low bits from a minibatch's first forward to its
    sync, where the peak is: 2 bytes per parameter / N less, the gathers unchanged; a read of a shard in between
    joins them first ([split-masters] in ``split_master.py``). Needs bf16 ``param_dtype``; not with
    ``gather_masters`` or an offload policy."""
    float8_gather: bool = FLOAT8_GATHER_DEFAULT
    """gather the weights of tensorwise ``Float8Linear`` layers (``float8="tensorwise"``'s, or ones converted before
    wrapping) in float8: their owners cast them once per step, with scales from amaxes the step's meeting carries;
    half of bf16's bytes ([float8-gather] in ``float8.py``). False gathers them in ``param_dtype``; rowwise layers
    always are."""
    timeout: float = 300.0
    """seconds a rank waits at a meeting for the others before raising an error that names the ranks that did not
    come; a rank silent (stopped) this long ends the others' processes with one line naming it (see [watchdog] in
    ``watchdog.py``)."""
    overlap_push: bool = True
    """on CUDA, push gradients on a side stream while backward goes on."""

    def __post_init__(self) -> None:
        if isinstance(self.group_bytes, bool) or not isinstance(self.group_bytes, int) or self.group_bytes <= 0:
            raise ValueError(f"group_bytes must be a positive int (bytes per group), got {self.group_bytes!r}")
        check_numbers(self.prefetch, self.timeout)
        for name in ("gather_masters", "split_masters", "float8_gather", "overlap_push"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.gather_masters and self.split_masters:
            raise ValueError("gather_masters=True and split_masters=True both drop the bf16 copy of the masters: "
                             "choose one (split_masters keeps bf16 gathers)")


def settings_args_doc(indent: int = 4, width: int = 116) -> str:
    """``EngineSettings``' fields as entries of a Google-style ``Args:`` section (``name: its docstring``), each
    wrapped to ``width`` columns at ``indent`` spaces (continuation lines 4 deeper, words never split: the entries
    read back, joined by spaces, as the docstrings); none where the source cannot be read."""
    docs = field_docs(EngineSettings)  # empty where the source cannot be read (a .pyc-only install): no entries
    pad = " " * indent
    return "\n".join(textwrap.fill(f"{f.name}: {docs[f.name]}", width, initial_indent=pad,
                                   subsequent_indent=pad + "    ", break_on_hyphens=False, break_long_words=False)
                     for f in fields(EngineSettings) if f.name in docs)


__all__ = ["EngineSettings", "settings_args_doc"]
