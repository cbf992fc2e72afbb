"""The float8 parameter gather's row format ([float8-gather] in ``float8.py``, [row-format] in ``row_format.py``):
which weights are gathered in float8 (``Float8Gather``, the engine's ``LateRows``), their scales (from the amaxes the
finish's meeting carries), the owner's cast into its row (``Float8Rows``, the model's ``LatePublish``), and the
unsharded form torchao's ``Float8Linear`` takes as already cast (``Float8RowFormat``). Nothing else in the sharding
knows float8: the planner, the transport and the engine see rows of a dtype of their own."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn as nn

from ...kernels.float8_cast import cast_segments_to_float8
from ..placement.layout import GroupLayout
from .row_format import RowFormat

#: the dtype of float8-gathered rows: e4m3, as torchao casts weights
FLOAT8_DTYPE = torch.float8_e4m3fn
#: torchao's ``float8_utils.EPS``: the least amax a scale is computed from (a zero weight gets a finite scale)
EPS = 1e-12
FLOAT8_MAX = torch.finfo(FLOAT8_DTYPE).max


def _tensorwise(config) -> bool:
    """Whether a ``Float8LinearConfig`` casts the weight as the float8 gather does: one dynamic e4m3 scale per
    tensor, for the forward and the backward matmul alike, not rounded to a power of two."""
    casts = (config.cast_config_weight, config.cast_config_weight_for_grad_input)
    return not config.round_scales_to_power_of_2 and all(
        c.scaling_type.value == "dynamic" and c.scaling_granularity.value == "tensorwise"
        and c.target_dtype == FLOAT8_DTYPE for c in casts)


def float8_gathered(root: nn.Module, named: Sequence[tuple[str, nn.Parameter]]) -> dict[str, nn.Module]:
    """The weights gathered in float8 (``ODCShard(float8_gather=True)``), by parameter name, with their layer: those
    of the model's torchao ``Float8Linear`` layers whose weights are cast tensorwise (``ODCShard(float8="tensorwise")``
    converted them, or the caller did, with ``convert_float8_linears``). Rowwise gathers ``param_dtype``
    ([float8-gather] says why), and a weight registered anywhere else too (tied) stays in ``param_dtype``: its other
    users want plain values."""
    if "torchao.float8.float8_linear" not in sys.modules:  # no model holds a Float8Linear before torchao made it:
        return {}  # a model without float8 (the default on) never imports torchao, slow and loud to import
    from torchao.float8.float8_linear import Float8Linear

    uses: dict[int, int] = {}
    for _, p in root.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    canonical = {id(p): n for n, p in named}
    return {f"{name}.weight": m for name, m in root.named_modules()
            if isinstance(m, Float8Linear) and _tensorwise(m.config) and uses.get(id(m.weight)) == 1
            and canonical.get(id(m.weight)) == f"{name}.weight"}


def scales_from_amaxes(table: torch.Tensor) -> torch.Tensor:
    """Every weight's scale from a ``(ranks, weights)`` table of the ranks' amaxes, as torchao's
    ``precompute_float8_dynamic_scale_for_fsdp`` computes it: the max over ranks (exact: each entry is an fp32 amax
    carried in float64), clamped to ``EPS`` in fp32, ``finfo(e4m3).max / amax`` in float64, then fp32."""
    amax = torch.clamp(table.amax(0).to(torch.float32), min=EPS)
    return (FLOAT8_MAX / amax.to(torch.float64)).to(torch.float32)


def to_float8(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``values`` scaled and cast to e4m3, saturating, as torchao's ``hp_tensor_and_scale_to_float8`` casts (in fp32,
    then clamped to the float8 range: a value past it becomes the largest float8, not inf/NaN)."""
    return (values.to(torch.float32) * scale).clamp(-FLOAT8_MAX, FLOAT8_MAX).to(FLOAT8_DTYPE)


@dataclass(frozen=True)
class Float8RowFormat(RowFormat):
    """``float8_gather``: e4m3 rows cast from the master with every rank's scales after the finish's meeting
    (``Float8Rows.cast``, not ``publish``); unsharded weights are ``Float8TrainingTensor`` views of the buffer."""

    rows: "Float8Rows | None" = None
    """the model's Float8Rows: its scales and the owner's cast"""

    @property
    def row_dtype(self) -> torch.dtype:
        return FLOAT8_DTYPE

    @property
    def compute_dtype(self) -> torch.dtype:
        return FLOAT8_DTYPE

    def publish(self, master: torch.Tensor, row: torch.Tensor) -> None:
        return  # cast once the scales are known ([float8-gather])

    def wraps(self, layout: GroupLayout) -> list[Callable[[torch.Tensor], torch.Tensor]] | None:
        return self.rows.wrap(layout)


@dataclass(frozen=True)
class Float8Gather:
    """The weights gathered in float8, with their ``Float8Linear`` layers, before the groups are planned: the
    engine's ``LateRows`` ([row-format]). ``of`` finds them in a model (``float8_gathered``)."""

    linears: dict[str, nn.Module]

    @classmethod
    def of(cls, root: nn.Module, named: Sequence[tuple[str, nn.Parameter]]) -> "Float8Gather | None":
        """The model's float8-gathered weights (``float8_gathered``), None where it has none."""
        linears = float8_gathered(root, named)
        return cls(linears) if linears else None

    @property
    def row_dtypes(self) -> dict[str, torch.dtype]:
        """``LateRows``: each weight's rows are e4m3."""
        return dict.fromkeys(self.linears, FLOAT8_DTYPE)

    def bind(self, layouts: Sequence[GroupLayout], param_dtype: torch.dtype, device: torch.device) -> "Float8Rows":
        """``LateRows``: the planned layouts -> the model's ``Float8Rows``."""
        return Float8Rows(layouts, self.linears, param_dtype, device)


class Float8Rows:
    """The float8-gathered weights of one model: their scales and the owner's cast ([float8-gather]); the model's
    ``LatePublish`` ([row-format]): the masters' amaxes are the carry, the cast is the publish after the meeting.

    Args:
        layouts: the model's group layouts (those with ``row_dtype`` set hold these weights).
        linears: the weights' ``Float8Linear`` modules by parameter name (``float8_gathered``).
        param_dtype: the dtype torchao's matmuls return the weights' gradients in.
        device: where the rows (and so the scales) live.
    """

    def __init__(self, layouts: Sequence[GroupLayout], linears: dict[str, nn.Module], param_dtype: torch.dtype,
                 device: torch.device):
        self.linears = linears
        self.param_dtype = param_dtype
        self.slots = [(lay.index, i) for lay in layouts if lay.row_dtype is not None for i in range(len(lay.slots))]
        self._number = {key: k for k, key in enumerate(self.slots)}
        # one tensor, updated in place: each unsharded weight's Float8TrainingTensor holds a 0-dim view of it
        self.scales = torch.ones(len(self.slots), dtype=torch.float32, device=device)
        self.groups: list = []

    @property
    def carry_len(self) -> int:
        """One amax per float8 weight rides every meeting."""
        return len(self.slots)

    def carry(self, device: torch.device) -> torch.Tensor:
        """``LatePublish``: this rank's amaxes."""
        return self.amaxes(device)

    def publish_after(self, table: torch.Tensor) -> None:
        """``LatePublish``: the scales from every rank's amaxes, then this rank's rows cast."""
        self.cast(table)

    def row_format(self, **placement) -> Float8RowFormat:
        """``LatePublish``: the format of the float8 groups (``placement``: master dtype, param dtype, host, pin)."""
        return Float8RowFormat(**placement, rows=self)

    def start(self, groups, device: torch.device, gather_carries: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """``LatePublish``: the groups are built; the first rows need every rank's amaxes (one all-gather)."""
        self.attach(groups)
        self.cast(gather_carries(self.amaxes(device)))

    def attach(self, groups) -> None:
        """The model's groups are built: those of float8 layouts are the ones cast."""
        self.groups = {g.index: g for g in groups if g.layout.row_dtype is not None}
        device = self.scales.device
        # per group: its weights' scale numbers and segment ends in the row (the cast's table: each element of the
        # row takes its segment's scale; padding too: zero in the master, zero in the row)
        self._numbers = {gi: torch.tensor([self._number[(gi, i)] for i in range(len(g.layout.slots))], device=device)
                         for gi, g in self.groups.items()}
        self._ends = {gi: torch.tensor([s.offset + s.seg for s in g.layout.slots], device=device)
                      for gi, g in self.groups.items()}

    def wrap(self, layout: GroupLayout) -> list[Callable[[torch.Tensor], torch.Tensor]] | None:
        """For each parameter of a float8 group, what makes its unsharded form from its view of the group's float8
        buffer: a ``Float8TrainingTensor`` with its scale, which ``Float8Linear.forward`` takes as already cast
        (torchao's ``tensor_already_casted_to_fp8``), so the layer casts nothing. None for other groups."""
        if layout.row_dtype is None:
            return None
        from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

        def make(slot) -> Callable[[torch.Tensor], torch.Tensor]:
            scale = self.scales[self._number[(layout.index, slot)]]
            config = self.linears[layout.slots[slot].name].linear_mm_config
            return lambda view: Float8TrainingTensor(view, scale, self.param_dtype, config, GemmInputRole.WEIGHT)

        return [make(i) for i in range(len(layout.slots))]

    def _masters(self) -> list[torch.Tensor]:
        return [(g := self.groups[gi]).layout.local_view(g.master, i, g.rank) for gi, i in self.slots]

    def amaxes(self, device: torch.device) -> torch.Tensor:
        """This rank's amax of each weight's master slice (float64 on ``device``: the meeting's row); 0 for a weight
        this rank holds no rows of. One ``_foreach_norm(inf)`` over the slices: no copy."""
        masters = self._masters()
        held = [k for k, m in enumerate(masters) if m.numel()]  # an empty slice has no inf-norm
        out = torch.zeros(len(masters), dtype=torch.float64, device=device)
        if held:
            norms = torch._foreach_norm([masters[k] for k in held], ord=float("inf"))
            out[torch.tensor(held, device=device)] = torch.stack(norms).to(device, torch.float64)
        return out

    def cast(self, table: torch.Tensor) -> None:
        """Every rank's amaxes (``(ranks, weights)``, the same table on every rank) -> the scales, then this rank's
        master slices cast into its rows with them. Peers must not gather until every owner has cast
        (``CommStreams.late_rows_written`` orders that).

        On CUDA one kernel a group (``kernels/float8_cast.py``: 4 bytes read and 1 written per element, no
        temporaries); elsewhere (CPU runs, tests) torch's operators segment by segment, the same arithmetic."""
        with torch.no_grad():
            self.scales.copy_(scales_from_amaxes(table.to(self.scales.device)))
            for gi, g in self.groups.items():
                # a host master (offload) comes over once, from pinned memory without a host sync where it is pinned
                master = g.master.to(g.row.device, non_blocking=True)
                if g.row.device.type == "cuda":
                    cast_segments_to_float8(master, g.row, self._ends[gi], self._numbers[gi], self.scales)
                    continue
                for i in range(len(g.layout.slots)):
                    scale = self.scales[self._number[(gi, i)]]
                    g.layout.segment(g.row, i).copy_(to_float8(g.layout.segment(master, i), scale))


__all__ = ["EPS", "FLOAT8_DTYPE", "Float8Gather", "Float8RowFormat", "Float8Rows", "float8_gathered",
           "scales_from_amaxes", "to_float8"]
