"""A group's row format: what its row holds, where its master lives, and how one becomes the other.

Design note [row-format]
------------------------
Every group has a master row (what optimizers update, fp32 or wider, [masters] in ``group.py``) and a
communicated row (what peers gather). How the two relate is the group's *row format*, one strategy object chosen
once per group by ``row_format``, so the group and its parameters carry no per-feature branches:

| format | row | unsharded parameters | publish (master -> row) |
|---|---|---|---|
| ``ParamDtypeRows`` (default) | ``param_dtype`` | ``param_dtype`` | a cast at the finish ([masters]) |
| ``MasterRows`` (``gather_masters``) | the master | ``param_dtype`` (gathers cast) | nothing ([gather-masters]) |
| ``Float8RowFormat`` (``float8_rows.py``) | e4m3 + scales | float8 tensor views | after the meeting ([float8-gather]) |

Where the master lives is the format's too: next to the row (or the row itself), or in host memory under
``CPUOffloadPolicy`` ([offload]), for any of the three. Gradients are ``param_dtype`` in every format (a float8
group's come from torchao's matmul in ``param_dtype``). Adding a format is a subclass here (its row dtype, its
unsharded form, its publish) and a line in ``row_format``; a format for some parameters only, published late, is a
``LateRows`` of its own file (float8's: ``Float8Gather`` in ``float8_rows.py``): it names its parameters and their
rows' dtype, which ``plan_groups`` gives groups of their own (``GroupLayout.row_dtype``), and supplies their format.
The transport moves whatever dtype the row has (one-byte floating rows as bytes).

A format whose rows need every rank's say before they can be written (float8's scales need every rank's amax)
publishes late, through one ``LatePublish`` object of the model: the rows' ``carry`` rides the finish's meeting
(one all-gather that happens anyway), and ``publish_after`` writes the rows from every rank's carries once the
meeting is over, before any peer's next gather ([streams] 6 in ``streams.py``). The minibatch and the engine know
only this interface, not the format behind it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch

from ..placement.layout import GroupLayout


@dataclass(frozen=True)
class RowFormat:
    """How a group's master and row relate ([row-format]); subclasses name the row.

    Args:
        master_dtype: the master row's dtype (fp32 or wider).
        param_dtype: the dtype layers compute with and gradients arrive in.
        host: where the master lives when offloaded ([offload]); None: on the row's device.
        pin: pin the offloaded master (and the host gradient buffer).
    """

    master_dtype: torch.dtype
    param_dtype: torch.dtype
    host: torch.device | None = None
    pin: bool = False

    @property
    def row_dtype(self) -> torch.dtype:
        """The dtype of the row peers gather."""
        raise NotImplementedError

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the gathered (unsharded) buffer."""
        return self.param_dtype

    @property
    def grad_dtype(self) -> torch.dtype:
        """The dtype of the gradient buffer backward accumulates into."""
        return self.param_dtype

    @property
    def offloaded(self) -> bool:
        """Whether the master lives in host memory ([offload])."""
        return self.host is not None

    def make_master(self, row: torch.Tensor) -> torch.Tensor:
        """This rank's master row for ``row``: in host memory when offloaded, the row itself when they coincide."""
        if self.offloaded:
            return torch.zeros(row.numel(), dtype=self.master_dtype, device=self.host, pin_memory=self.pin)
        return row if row.dtype == self.master_dtype else torch.zeros_like(row, dtype=self.master_dtype)

    def publish(self, master: torch.Tensor, row: torch.Tensor) -> None:
        """Make the row peers gather from the updated master (nothing when the row is the master)."""
        if row is master:
            return
        # An offloaded master goes over as it is and is cast on the device (a copy_ across devices and dtypes casts
        # on the host first: a CPU pass over the masters, then a pageable copy). From pinned memory the copy is
        # queued: every meeting ends in a host read of a tensor on this stream (the meeting's all-gather .cpu()),
        # so it is done before the host can change the master again. Not offloaded, ``to`` returns the master.
        with torch.no_grad():
            row.copy_(master.to(row.device, non_blocking=self.offloaded and self.pin))

    def wraps(self, layout: GroupLayout) -> list[Callable[[torch.Tensor], torch.Tensor]] | None:
        """Per parameter, what makes its unsharded form from its view of the gathered buffer (None: the view)."""
        return None


@dataclass(frozen=True)
class ParamDtypeRows(RowFormat):
    """The default: a ``param_dtype`` row published from a separate master (the master itself if they agree)."""

    @property
    def row_dtype(self) -> torch.dtype:
        return self.param_dtype


@dataclass(frozen=True)
class MasterRows(RowFormat):
    """``gather_masters``: the master is the row; gathers cast to ``param_dtype`` as they unpack."""

    @property
    def row_dtype(self) -> torch.dtype:
        return self.master_dtype


class LatePublish(Protocol):
    """Rows written after the finish's meeting from what every rank carried to it ([row-format])."""

    @property
    def carry_len(self) -> int:
        """The length of the float64 row every rank carries to every meeting."""

    def carry(self, device: torch.device) -> torch.Tensor:
        """This rank's carry: a float64 row of ``carry_len`` on ``device``, from the final masters."""

    def publish_after(self, table: torch.Tensor) -> None:
        """Write this rank's rows from every rank's carries (``(ranks, carry_len)``, the same on every rank)."""

    def start(self, groups: Sequence, device: torch.device,
              gather_carries: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """The groups are built: write the first rows (this rank's carry on ``device``; ``gather_carries``: it ->
        every rank's)."""

    def row_format(self, **placement) -> RowFormat:
        """The row format of its groups (``placement``: ``RowFormat``'s master dtype, param dtype, host, pin)."""


class LateRows(Protocol):
    """A row format of its own for some parameters, published late ([row-format]), before the groups are planned:
    which parameters it takes, then, once planned, the model's ``LatePublish`` over their groups."""

    @property
    def row_dtypes(self) -> dict[str, torch.dtype]:
        """The parameters whose rows it holds, by name, with their rows' dtype (``plan_groups``' ``own_rows``)."""

    def bind(self, layouts: Sequence[GroupLayout], param_dtype: torch.dtype, device: torch.device) -> "LatePublish":
        """The planned layouts (those with ``row_dtype`` set are its own) -> the model's ``LatePublish``."""


def row_format(layout: GroupLayout, master_dtype: torch.dtype, param_dtype: torch.dtype, *, gather_masters: bool,
               host: torch.device | None, pin: bool, late: LatePublish | None = None) -> RowFormat:
    """The one row format of a group ([row-format]): the late format's for a layout of its own rows (``row_dtype``
    set), the master for ``gather_masters``, else ``param_dtype`` rows; with the master in host memory where
    ``host`` is set."""
    placement = {"master_dtype": master_dtype, "param_dtype": param_dtype, "host": host, "pin": pin}
    if layout.row_dtype is not None:
        if late is None:
            raise ValueError(f"group {layout.index} has rows of their own ({layout.row_dtype}) but no late format")
        return late.row_format(**placement)
    return MasterRows(**placement) if gather_masters else ParamDtypeRows(**placement)


__all__ = ["LatePublish", "LateRows", "MasterRows", "ParamDtypeRows", "RowFormat", "row_format"]
