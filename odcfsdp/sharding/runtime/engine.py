"""``ShardEngine``: one model's sharding machinery, behind both ``ODCShard`` and ``fully_shard``.

Design note [engine]
--------------------
It composes the tiers of ``odcfsdp.sharding`` (after FSDP2's ``_fully_shard``):

* ``ShardMesh`` ([mesh]): the ranks and the collectives they meet with;
* ``Transport`` ([transport]): where rows live and how they move;
* ``CommStreams`` ([streams]): the side streams gathers and pushes run on;
* ``FlatGroup`` ([layout], [storage-resize], [grad-buffers], [masters]): one group's
  rows, buffers, state and use counts;
* ``ShardedParam`` ([params]): one parameter's sharded and unsharded forms;
* ``StepLifecycle`` ([lifecycle]): a micro-batch's steps 1-7, one method per phase, with its
  ``PrefetchSchedule`` ([prefetch]); ``HookDriver`` ([hooks]): which hook runs which phase;
* ``Minibatch`` ([lifecycle] 8-10, [step-protocol], [grad-protocol], [optimizer-events]): the
  minibatch's steps 8-10 and state: its pushes, its meetings, its gradients, every change of rows;
* ``ShardState`` ([shard-state]): the one way into the sharded values (checkpoints,
  Hugging Face files, state dicts).

One engine serves one root module: ``ODCShard`` builds one over the model it wraps, and
``fully_shard`` one over the outermost module it was called on, whose every call below is a
unit of it ([fully-shard] in ``fully_shard.py``). Either way a minibatch has one sync and one
finish meeting, however many units there are.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
import torch.nn as nn

from .arguments import intact_problem, offload_target, registrations
from ..groups.group import FlatGroup
from .hooks import HookDriver
from .lifecycle import StepLifecycle
from ..groups.row_format import LateRows, row_format
from ..placement.layout import GroupLayout, plan_groups
from .engine_settings import EngineSettings
from .materialize import materialize_buffers
from ..placement.mesh import ShardMesh
from ..groups.precision import Precision, register_casts
from .prefetch import PrefetchSchedule
from .minibatch import Minibatch
from .shard_state import ShardState
from ..groups.split_master import SplitMasters
from ..transport.streams import CommStreams
from .transparent import refuse_detaching
from ..transport import Transport, make_transport


class ShardEngine:
    """Shard ``named`` (parameters of ``root``) over ``mesh``'s ranks in flat groups, and hook ``root``.

    The arguments are ``ODCShard``'s, checked and resolved (see its docstring), the engine's own options as one
    ``EngineSettings`` (``settings``, documented there); beyond them:

    Args:
        is_unit: whether a module is hooked as a whole ([hooks]).
        owner_of: a parameter name's unit (None outside units, [layout]'s ``plan_groups``): groups never span
            units, a unit's parameters form one group per dtype and flag, ``group_bytes`` applies outside units;
            None: groups follow only ``group_bytes``.
        late_rows: a row format of their own for some parameters, published late ([row-format]; float8's
            ``Float8Gather``): their groups are their own, their rows its dtype, their format and publishing its.
    """

    def __init__(self, root: nn.Module, named: list[tuple[str, nn.Parameter]], *, device: torch.device,
                 mesh: ShardMesh, param_dtype: torch.dtype, precision: Precision, settings: EngineSettings, comm: str,
                 reshard_after_forward: bool, offload_policy, is_unit: Callable[[nn.Module], bool],
                 owner_of: Callable[[str], object] | None = None, late_rows: LateRows | None = None):
        self.root = root
        self.mesh = mesh
        self.param_dtype = param_dtype
        self.precision = precision
        self.settings = settings
        gather_masters = self.gather_masters = settings.gather_masters  # [gather-masters]: the row peers read
        on_meta = named[0][1].is_meta
        at_least_fp32 = torch.promote_types(param_dtype, torch.float32)
        self.layouts: list[GroupLayout] = plan_groups(named, mesh.world_size, settings.group_bytes, param_dtype,
                                                      owner_of, late_rows.row_dtypes if late_rows else None)
        master_dtypes = [torch.promote_types(lay.dtype, at_least_fp32) for lay in self.layouts]
        host, pin = offload_target(offload_policy, mesh, gather_masters)
        self.late = late_rows.bind(self.layouts, param_dtype, device) if late_rows else None
        # one row format per group, chosen once ([row-format]): what the row holds, where the master lives
        formats = [row_format(lay, dtype, param_dtype, gather_masters=gather_masters, host=host, pin=pin,
                              late=self.late) for lay, dtype in zip(self.layouts, master_dtypes)]
        self.transport: Transport = make_transport(comm, mesh)
        self.transport.setup(self.layouts, [f.row_dtype for f in formats],
                             [precision.accumulator_dtype(d) for d in master_dtypes], gather_dtype=param_dtype)
        self.comm = CommStreams(self.transport, device, gather_ahead=bool(settings.prefetch),
                                push_aside=settings.overlap_push)
        by_name, regs = dict(named), registrations(root)
        # Every name a parameter is reachable by (tied parameters have several).
        canonical = {id(p): name for name, p in named}
        self.aliases = {name: canonical[id(p)] for name, p in root.named_parameters(remove_duplicate=False)
                        if id(p) in canonical and canonical[id(p)] != name}
        self.param_entries = sum(len(r) for r in regs.values())
        device_mesh = mesh.device_mesh
        starts = [sum(len(lay.slots) for lay in self.layouts[:k]) for k in range(len(self.layouts))]
        self.groups: list[FlatGroup] = [
            FlatGroup(lay, [by_name[s.name] for s in lay.slots], [regs[id(by_name[s.name])] for s in lay.slots],
                      self.comm, fmt, device_mesh, start)
            for lay, fmt, start in zip(self.layouts, formats, starts)
        ]
        for g in self.groups:
            g.reshard_after_forward = reshard_after_forward
        # the parameters' .grad events go to the minibatch from here ([params]); FSDP2's default divide factor: the
        # mean over the data-parallel ranks, every replica's included
        self.minibatch = Minibatch(self.groups, self.comm, mesh, float(mesh.world_size * mesh.replicas),
                                   late=self.late)
        self._split_hooks = []
        if settings.split_masters:  # [split-masters]
            if host is not None or param_dtype != torch.bfloat16:
                raise ValueError("split_masters=True splits fp32 masters on the device into bf16 rows and low bits: "
                                 f"it needs param_dtype=torch.bfloat16 (got {param_dtype}) and no offload_policy")
            self.minibatch.split = SplitMasters(self.groups)
            # any module's state_dict() (a submodule's, a fully_shard unit's) holds views of the masters: whole first
            self._split_hooks = [m.register_state_dict_pre_hook(lambda *_: self.minibatch.join_masters())
                                 for m in root.modules()]
        self.lifecycle = StepLifecycle(self.groups, self.comm, PrefetchSchedule(settings.prefetch), self.minibatch,
                                       checks=self.check_intact)
        if on_meta:
            materialize_buffers(root, device)
        if self.late is not None:  # the first late rows need every rank's carry ([row-format]: one all-gather)
            self.late.start(self.groups, mesh.device, mesh.all_gather_rows)
        mesh.barrier()  # every row written before anyone may read it
        self.shard_state = ShardState(self.groups, self.minibatch, self.aliases)
        group_of = {t: g for g in self.groups for sp in g.params for t in (sp.sharded, sp.unsharded)}
        self.driver = HookDriver(root, group_of, self.lifecycle, is_unit, device)
        self._cast_hooks = register_casts(root, precision)
        refuse_detaching(root)  # [transparent-wrapper]
        self.closed = False

    def register_casts(self, modules) -> None:
        """Also cast the forward inputs and outputs of ``modules`` as the precision says (``fully_shard``'s units,
        as FSDP2 casts at every module it was called on); removed on ``close``."""
        for m in modules:
            self._cast_hooks += register_casts(m, self.precision)

    def check_intact(self) -> None:
        """Run before every forward: the model must still hold the parameters that were planned."""
        self.check_open()
        problem = intact_problem(self.root, self.shard_state.params, self.param_entries, self.param_dtype)
        if problem:
            raise RuntimeError(problem)

    def check_open(self) -> None:
        """Raise if the engine was closed."""
        if self.closed:
            raise RuntimeError("this model's sharding was closed; its rows (and masters) are released")

    def expose_on(self, front) -> None:
        """Set this engine's parts on ``front`` (``ODCShard``, ``sharded``'s view of a ``fully_shard`` model) under the
        names the checkpoint, optimizer and application code read, with this rank and the shard group's size."""
        for part in ("mesh", "param_dtype", "layouts", "transport", "gather_masters", "comm", "minibatch", "aliases",
                     "groups", "lifecycle", "shard_state"):
            setattr(front, part, getattr(self, part))
        front.rank, front.world_size = self.mesh.rank, self.mesh.world_size

    def reshard_all(self) -> None:
        """Free every group's unsharded buffer (modules hold their shards again)."""
        self.lifecycle.reshard_all()

    def reset_iter_state(self) -> None:
        """FSDP2's ``reset_iter_state``: after an exception mid-pass, idle again ([lifecycle]'s ``reset``)."""
        self.check_open()
        self.lifecycle.reset()

    def to_empty(self, device: torch.device | str) -> None:
        """``to_empty(device=...)`` after a meta-device build ([meta-init]): the shards already live on the engine's
        device, so nothing moves; meta buffers become real ones; the values the model's own initialisation writes
        into the shards next are published at the next forward, around one meeting."""
        self.check_open()
        want = torch.device(device)
        have = self.mesh.device
        if want.type != have.type or (want.index is not None and want.index != have.index):
            raise ValueError(f"to_empty(device={str(want)!r}): this model's shards live on {have}, where "
                             "fully_shard placed them (the mesh's device): pass that device")
        materialize_buffers(self.root, have)
        self.minibatch.join_masters()  # the model's initialisation writes into the shards next ([split-masters])
        self.minibatch.publish_at_next_forward = True

    @contextlib.contextmanager
    def unsharded(self) -> Iterator[None]:
        """Context in which every parameter holds its full value (collective: all ranks enter)."""
        self.check_open()
        for g in self.groups:
            g.to_unsharded()
            g.wait_ready()
        try:
            yield
        finally:
            self.reshard_all()

    def close(self) -> None:
        """Release the transport, hooks and rows; the model cannot be used afterwards (collective)."""
        if self.closed:
            return
        self.reshard_all()
        self.comm.pushes_done()  # the push stream's work, the zeroing included ([streams] 5), before frees
        self.closed = True
        self.driver.remove()
        for handle in self._cast_hooks + self._split_hooks:
            handle.remove()
        self.minibatch.join_masters()  # the shards hold their values after close too
        self.minibatch.close()
        for g in self.groups:
            g.release()
        for mod in self.root.modules():
            mod.__dict__.pop("_apply", None)
        self.transport.close()
        self.mesh.close()


__all__ = ["ShardEngine"]
