"""``ODCShard``: the module wrapper that shards a model's parameters in flat groups.

Design note [hooks]
-------------------
Hooks sit on *hook sites*: each ``units`` module (for all parameters of its subtree)
and every other submodule outside the units that directly owns parameters. A site
gets these hooks:

1. forward pre-hook: unshard (gather) the groups holding its parameters; in grad
   mode, also hook the site's inputs: once the gradients of all of them are done,
   the site's backward is through (the post-backward, 4). A hook only observes, so
   gradients are summed exactly as without the wrapper;
2. forward post-hook: count the site off in each of its groups; once every site of
   a group has run, reshard the group if ``reshard_after_forward`` (or if grad mode
   is off); then register a pre-backward hook on the site's outputs;
3. pre-backward hook (fires when the gradient of any output is ready, i.e. right
   before the site's own backward): unshard its groups again and give each trained
   group a zeroed gradient buffer, to which the parameters' ``.grad`` point (see
   [grad-buffers]);
4. post-backward: count the site off in each of its groups; once every site of a
   group is through, push its gradient buffer into the owners' accumulators
   (scatter-accumulate) and reshard it.

An end-of-backward callback pushes whatever is still pending (groups of sites whose
inputs need no gradient, such as the embedding; parameters that got no gradient in
this pass contribute zeros) and reshards everything. Forward hooks that run
*during* backward (activation recomputation) never reshard, because the recomputed
activations are about to be used, and prefetch in backward order.

Design note [grad-buffers]
--------------------------
A trained parameter's ``.grad`` is, during backward, a view of its group's
parameter-major gradient buffer, so autograd's own gradient accumulation adds into
the buffer in place: no Python runs per parameter (a post-accumulate-grad hook per
parameter cost ~0.1 ms of host time each, which made backward launch-bound). The
post-backward of a site runs after the gradients of its parameters have been
accumulated: autograd runs gradient accumulation first among the nodes that are
ready together, which FSDP2 relies on too. A gradient that reaches a parameter after
its group was pushed (a parameter used outside its site, after the site's backward)
lands in a fresh ``.grad``; the end-of-backward callback pushes it too, so nothing is
lost, only pushed late.

Units (like FSDP2's ``fully_shard`` per block) cost one hook call per block instead of
one per parameter-owning module, and keep the hooks outside the block's own code, so
the block's forward can be compiled (``torch.compile``) in one piece.

Limitation: a parameter is available only while its site runs (or while its group
stays resident); code that reads ``child.weight`` from a parent's forward without
calling ``child`` sees freed storage. Call the module instead, make the parent a
unit, or use ``reshard_after_forward=False``.
"""

from __future__ import annotations

import contextlib
import enum
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from .group import FlatGroup, GroupState
from .layout import GroupLayout, plan_groups
from .transport import Transport, make_transport


class TrainingPhase(enum.Enum):
    """Where the wrapper is in a forward/backward pass."""

    IDLE = enum.auto()
    """No forward or backward pass in flight."""
    FORWARD = enum.auto()
    """Inside the root module's forward."""
    BACKWARD = enum.auto()
    """Between the first pre-backward hook and the end-of-backward callback."""


def _default_world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None and not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


class ODCShard(nn.Module):
    """Shard ``module``'s parameters over the ranks of a process group, in flat groups.

    Parameters are packed in order into groups of up to ``group_bytes`` (see
    [layout]); rank r keeps row r of every group plus a master copy of it in fp32.
    Groups are gathered right before a module needs them and freed after, and
    gradients are reduced in fp32 into their owners' accumulator rows, where they
    add up over micro-batches until ``odcfsdp.optim.AdamW.step``.

    Args:
        module: the model; every rank must hold the same initial values.
        group_bytes: byte budget of one group, counted in unsharded ``param_dtype``
            bytes. A larger parameter forms its own group.
        comm: transport: ``"auto"`` (``nvshmem`` on CUDA, ``shm`` on CPU), ``"shm"``,
            ``"nvshmem"`` (one-sided: ranks meet only at the optimizer step and may
            run different numbers of micro-batches) or ``"collective"``
            (all-gather / reduce-scatter; equal micro-batch counts required).
        process_group: ranks to shard over; the default group if None, or a single
            process if torch.distributed is not initialised.
        reshard_after_forward: free a group after its last use in forward and gather
            it again in backward (less memory); keep it until backward if False.
        param_dtype: dtype parameters are computed (and communicated) in; bf16 on
            CUDA and the parameters' own dtype elsewhere when None.
        device: where rows and buffers live. Needed for a model built on the meta
            device (``with torch.device("meta"): model = ...``): its rows start at
            zero, meta buffers are materialised and any submodule's
            ``init_buffers()`` is called; then load values with
            ``odcfsdp.checkpoint.load_hf`` or ``load_checkpoint``. Defaults to the
            parameters' device.
        prefetch: how many hook sites ahead to gather (forward order, reversed in
            backward; sites whose groups are already in hand do not count); 0
            disables. On CUDA on a side stream while the current site computes;
            elsewhere simply ahead of use. Each prefetched group holds its unsharded
            buffer early.
        overlap_push: on CUDA, push gradients on a side stream while backward goes on.
        units: module classes whose instances are hooked as a whole (all parameters
            of their subtree gathered before their forward, e.g. the decoder layer
            class); other modules that own parameters are hooked one by one.
    """

    def __init__(
        self,
        module: nn.Module,
        group_bytes: int = 32 << 20,
        *,
        comm: str = "auto",
        process_group: dist.ProcessGroup | None = None,
        reshard_after_forward: bool = True,
        param_dtype: torch.dtype | None = None,
        prefetch: int = 1,
        device: torch.device | str | None = None,
        overlap_push: bool = True,
        units: tuple[type[nn.Module], ...] | list[type[nn.Module]] = (),
    ):
        super().__init__()
        if not isinstance(module, nn.Module) or isinstance(module, ODCShard):
            raise TypeError(f"ODCShard wraps a plain nn.Module once, got {type(module).__name__}")
        named = list(module.named_parameters())
        if not named:
            raise ValueError("the module has no parameters to shard")
        self._check_params(named)
        on_meta = named[0][1].is_meta
        if on_meta and device is None:
            raise ValueError("the model is on the meta device: pass device= (where its shards should live)")
        if device is not None and not on_meta and torch.device(device) != named[0][1].device:
            raise ValueError(f"device={device} differs from the parameters' device {named[0][1].device}; "
                             "move the model first (or build it on the meta device)")
        device = torch.device(device) if device is not None else named[0][1].device
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if param_dtype is None:
            dtypes = {p.dtype for _, p in named}
            if device.type != "cuda" and len(dtypes) > 1:
                raise ValueError(
                    f"parameters have mixed dtypes {sorted(map(str, dtypes))}; pass param_dtype= to "
                    "compute them all in one dtype"
                )
            param_dtype = torch.bfloat16 if device.type == "cuda" else named[0][1].dtype
        if not param_dtype.is_floating_point:
            raise ValueError(f"param_dtype must be a floating dtype, got {param_dtype}")

        units = tuple(units)
        if not all(isinstance(u, type) and issubclass(u, nn.Module) for u in units):
            raise TypeError(f"units must be nn.Module subclasses, got {units!r}")
        if units and not any(isinstance(m, units) for m in module.modules()):
            raise ValueError(f"no module of the model is one of units={[u.__name__ for u in units]}")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0 (groups gathered ahead), got {prefetch!r}")
        self.module = module
        self.prefetch = prefetch
        self._gather_stream = torch.cuda.Stream(device) if device.type == "cuda" and prefetch else None
        self._push_stream = torch.cuda.Stream(device) if device.type == "cuda" and overlap_push else None
        self._sites: list[tuple[FlatGroup, ...]] = []  # hook sites' groups, in the order the first forward ran them
        self._site_pos: dict[tuple[FlatGroup, ...], int] = {}  # a site's place in that order (hooks look it up)
        self._order_done = False
        self.rank, self.world_size = _default_world(process_group)
        self.param_dtype = param_dtype
        self.reshard_after_forward = reshard_after_forward
        accum_dtype = torch.promote_types(param_dtype, torch.float32)
        self.layouts: list[GroupLayout] = plan_groups(named, self.world_size, group_bytes, param_dtype)
        self.transport: Transport = make_transport(comm, self.rank, self.world_size, device, process_group)
        self.transport.setup(self.layouts, param_dtype, accum_dtype)

        by_name = dict(named)
        self.groups: list[FlatGroup] = []
        for lay in self.layouts:
            master_dtype = torch.promote_types(lay.dtype, accum_dtype)
            self.groups.append(FlatGroup(lay, [by_name[s.name] for s in lay.slots], self.transport, master_dtype))
        if on_meta:
            self._swap_meta_params({id(by_name[s.name]): p for g in self.groups for s, p in zip(g.layout.slots, g.params)})
            self._materialize_buffers(device)
        self._slot_of: dict[nn.Parameter, tuple[FlatGroup, int]] = {
            p: (g, i) for g in self.groups for i, p in enumerate(g.params)
        }
        self.transport.barrier()  # every row written before anyone may read it

        # Every name a parameter is reachable by (tied parameters have several).
        self._registered = [
            (name, p, tuple(p.shape), p.requires_grad) for name, p in module.named_parameters(remove_duplicate=False)
        ]
        canonical = {id(p): name for name, p in module.named_parameters()}  # after any meta swap
        self.aliases = {name: canonical[id(p)] for name, p, _, _ in self._registered if canonical[id(p)] != name}
        self._phase = TrainingPhase.IDLE
        self._closed = False
        self._pushes = 0
        self._forward_modules: dict[FlatGroup, int] = {g: 0 for g in self.groups}
        # The hooks hold this object; parameter hooks live in C++, where Python's garbage collector
        # cannot see the cycle, so close() removes them for the wrapper to be freed.
        self._hooks: list = []
        self.units = units
        self._register_hooks(units)

    # -- set-up ------------------------------------------------------------------
    def _swap_meta_params(self, new_by_old_id: dict[int, nn.Parameter]) -> None:
        """Put the device parameters that replaced meta ones into every module that held them."""
        for mod in self.module.modules():
            for name, p in mod._parameters.items():
                if p is not None and id(p) in new_by_old_id:
                    mod._parameters[name] = new_by_old_id[id(p)]

    def persistent_buffers(self) -> dict[str, torch.Tensor]:
        """The wrapped model's persistent buffers by name (replicated on every rank; checkpoints keep them)."""
        out = {}
        for prefix, mod in self.module.named_modules():
            for name, buf in mod._buffers.items():
                if buf is not None and name not in mod._non_persistent_buffers_set:
                    out[f"{prefix}.{name}" if prefix else name] = buf
        return out

    def _materialize_buffers(self, device: torch.device) -> None:
        for mod in self.module.modules():
            for name, buf in mod._buffers.items():
                if buf is not None and buf.is_meta:
                    mod._buffers[name] = torch.zeros_like(buf, device=device)  # then init_buffers / a load
        for mod in self.module.modules():
            init = getattr(mod, "init_buffers", None)
            if callable(init):
                init()

    @staticmethod
    def _check_params(named: list[tuple[str, nn.Parameter]]) -> None:
        devices = {p.device for _, p in named}
        if len(devices) > 1:
            raise ValueError(f"all parameters must be on one device, found {sorted(map(str, devices))}")
        for name, p in named:
            if not p.dtype.is_floating_point:
                raise ValueError(f"parameter {name!r} has dtype {p.dtype}; only floating-point parameters can be sharded")

    def _hook_sites(self, units: tuple[type[nn.Module], ...]) -> Iterator[tuple[nn.Module, list[nn.Parameter]]]:
        """(module, parameters it gathers): each unit with its subtree, other modules with their own."""
        inside: set[int] = set()  # modules below a unit: the unit covers them
        for mod in self.module.modules():  # parents before children
            if id(mod) in inside:
                continue
            if isinstance(mod, units):
                inside.update(id(m) for m in mod.modules())
                yield mod, list(mod.parameters())
            else:
                yield mod, list(mod.parameters(recurse=False))

    def _register_hooks(self, units: tuple[type[nn.Module], ...]) -> None:
        for mod, params in self._hook_sites(units):
            groups = []
            for p in params:
                g = self._slot_of[p][0]
                if g not in groups:
                    groups.append(g)
            if not groups:
                continue
            for g in groups:
                self._forward_modules[g] += 1
            self._hooks.append(mod.register_forward_pre_hook(
                lambda _m, args, kwargs, gs=tuple(groups): self._pre_forward(gs, args, kwargs), with_kwargs=True))
            self._hooks.append(
                mod.register_forward_hook(lambda _m, _a, out, gs=tuple(groups): self._post_forward(gs, out)))

    # -- hooks -------------------------------------------------------------------
    def _use(self, groups: tuple[FlatGroup, ...], backward: bool) -> None:
        """Unshard ``groups`` for use on the current stream, then prefetch what the next sites need."""
        for g in groups:
            g.to_unsharded()
            g.wait_ready()
            if backward:
                g.prepare_grad()
        pos = self._site_pos.get(groups)
        if not self._order_done:
            if pos is None:
                self._site_pos[groups] = len(self._sites)
                self._sites.append(groups)
            return
        if not self.prefetch or pos is None:  # (a site first run after the first forward)
            return
        seen, ahead = set(groups), 0
        for i in range(pos - 1, -1, -1) if backward else range(pos + 1, len(self._sites)):
            new = [g for g in self._sites[i] if g not in seen]
            if not new:  # a site using only groups already counted (e.g. the next norm in the same group)
                continue
            for g in new:
                g.to_unsharded(self._gather_stream)  # on CPU (no stream) a plain gather ahead of use
            seen.update(new)
            ahead += 1
            if ahead == self.prefetch:
                return

    def _pre_forward(self, groups: tuple[FlatGroup, ...], args, kwargs) -> None:
        # During backward this is activation recomputation: what comes next is backward order. Its
        # inputs get the post-backward hook too: reentrant checkpointing runs backward through the
        # recomputed graph (and the original forward ran without grad); otherwise it never fires.
        self._use(groups, backward=self._phase is TrainingPhase.BACKWARD)
        if not torch.is_grad_enabled():
            return
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if not inputs:  # e.g. token ids: the end-of-backward callback finishes this site's groups
            return
        # A plain hook per input, counted down: torch's multi-grad hook ("all") keeps the inputs'
        # autograd nodes in its closure, a reference cycle through C++ that leaks the graph. An input
        # that gets no gradient leaves the site to the end-of-backward callback (later, never early).
        left = [len(inputs)]

        def input_grad_done(_grad) -> None:
            left[0] -= 1
            if left[0] == 0:
                self._post_backward_site(groups)

        for t in inputs:
            t.register_hook(input_grad_done)

    def _post_backward_site(self, groups: tuple[FlatGroup, ...]) -> None:
        for g in groups:
            g.backward_uses_left -= 1
            if g.backward_uses_left <= 0:
                self._pushes += g.push_grad(self._push_stream)
                g.to_sharded()

    def _post_forward(self, groups: tuple[FlatGroup, ...], output) -> None:
        grad_mode = torch.is_grad_enabled()
        if self._phase is not TrainingPhase.BACKWARD:
            reshard = self.reshard_after_forward or not grad_mode
            for g in groups:
                g.forward_uses_left -= 1
                if reshard and g.forward_uses_left <= 0:
                    g.to_sharded()
        if grad_mode:
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, lambda _grad: self._pre_backward(groups), mode="any"
                )

    def _enter_backward(self) -> None:
        if self._phase is not TrainingPhase.BACKWARD:
            self._phase = TrainingPhase.BACKWARD
            torch.autograd.Variable._execution_engine.queue_callback(self._post_backward)

    def _pre_backward(self, groups: tuple[FlatGroup, ...]) -> None:
        self._enter_backward()
        self._use(groups, backward=True)

    def _post_backward(self) -> None:
        for g in self.groups:
            self._pushes += g.push_grad(self._push_stream)
            g.to_sharded()
        late = [(g, i, p) for p, (g, i) in self._slot_of.items() if p.grad is not None]  # see [grad-buffers]
        for g, i, p in late:
            g.add_grad(i, p.grad)
            p.grad = None
        for g in dict.fromkeys(g for g, _, _ in late):
            self._pushes += g.push_grad(self._push_stream)
        self._phase = TrainingPhase.IDLE

    def wait_pushes(self) -> None:
        """Make the current stream wait for every push issued so far (the optimizer reads accumulators)."""
        if self._push_stream is not None:
            torch.cuda.current_stream(self._push_stream.device).wait_stream(self._push_stream)

    # -- minibatch protocol --------------------------------------------------------
    def begin_minibatch(self, micro_batches: int, tokens: int | None = None) -> int | None:
        """Declare this rank's share of the coming minibatch; return the global token count.

        Optional with one-sided transports, which accept any number of micro-batches
        per rank (zero included) and communicate here only to sum ``tokens`` (one small
        all-reduce, right after the step's barrier, where ranks are in step anyway).
        With ``comm="collective"`` it checks that every rank runs the same number of
        micro-batches and raises otherwise, instead of letting mismatched collectives
        hang later.

        Args:
            micro_batches: micro-batches this rank will run before the next step.
            tokens: this rank's loss-bearing tokens; if given, the sum over ranks is
                returned (normalise the loss by it: ranks' shares differ).
        """
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 0:
            raise ValueError(f"micro_batches must be an int >= 0, got {micro_batches!r}")
        if self.world_size == 1 or (self.transport.one_sided and tokens is None):
            return tokens
        local = torch.tensor([micro_batches, tokens or 0], dtype=torch.int64, device=self.transport.device)
        table = self.transport.all_gather_rows(local).cpu()
        counts = table[:, 0].tolist()
        if not self.transport.one_sided and len(set(counts)) > 1:
            raise RuntimeError(
                f"comm='{self.transport.name}' needs the same number of micro-batches on every rank, got {counts} "
                "by rank; balance with lb_micro, or use a one-sided transport (comm='shm' on CPU, 'nvshmem' on CUDA)"
            )
        return int(table[:, 1].sum()) if tokens is not None else None

    # -- forward -------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        """Run the wrapped module, gathering each group right before it is needed."""
        self._check_open()
        self._check_unchanged()
        for g, n in self._forward_modules.items():
            g.forward_uses_left = g.backward_uses_left = n
        self._phase = TrainingPhase.FORWARD
        try:
            return self.module(*args, **kwargs)
        finally:
            self._phase = TrainingPhase.IDLE
            self._order_done = True
            if self.reshard_after_forward or not torch.is_grad_enabled():
                self.reshard_all()

    def _check_unchanged(self) -> None:
        current = list(self.module.named_parameters(remove_duplicate=False))
        if len(current) != len(self._registered):
            raise RuntimeError(
                f"the wrapped model now has {len(current)} parameter entries, ODCShard planned "
                f"{len(self._registered)}: parameters must not be added or removed after wrapping"
            )
        for (name, p), (rname, rp, shape, req) in zip(current, self._registered):
            if name != rname or p is not rp:
                raise RuntimeError(
                    f"parameter {rname!r} was replaced after ODCShard wrapped the model; "
                    "change parameters before wrapping (or load values with load_full_state_dict)"
                )
            if tuple(p.shape) != shape or p.dtype != self.param_dtype:
                raise RuntimeError(f"parameter {name!r} had its data reassigned after wrapping")
            if p.requires_grad != req:
                raise RuntimeError(
                    f"parameter {name!r} changed requires_grad after wrapping; freeze or unfreeze before ODCShard"
                )

    # -- whole-model access -----------------------------------------------------------
    def reshard_all(self) -> None:
        """Free every group's unsharded buffer."""
        for g in self.groups:
            g.to_sharded()

    def after_update(self) -> None:
        """Called by the optimizer once rows changed: later prefetches must see the new rows."""
        if self._gather_stream is not None:
            self._gather_stream.wait_stream(torch.cuda.current_stream(self._gather_stream.device))

    @property
    def pending_pushes(self) -> int:
        """Gradient pushes since the last optimizer step (0 between minibatches)."""
        return self._pushes

    def consume_push_count(self) -> int:
        """Number of gradient pushes since the last call (the optimizer's bookkeeping)."""
        n, self._pushes = self._pushes, 0
        return n

    @contextlib.contextmanager
    def unsharded(self) -> Iterator[None]:
        """Context in which every parameter holds its full value (collective: all ranks enter)."""
        self._check_open()
        for g in self.groups:
            g.to_unsharded()
            g.wait_ready()
        try:
            yield
        finally:
            self.reshard_all()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full parameter values (from the master rows), keyed by parameter name.

        Collective: every rank must call it. Values have the parameters' original
        dtypes; tied parameters appear under each of their names.
        """
        self._check_open()
        out: dict[str, torch.Tensor] = {}
        for g in self.groups:
            full = g.layout.unpack(self.transport.all_gather_rows(g.read_master()))
            for i, s in enumerate(g.layout.slots):
                out[s.name] = g.layout.param_view(full, i).to(g.layout.dtype).clone()
        for alias, name in self.aliases.items():
            out[alias] = out[name]
        return out

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Set every parameter from full values (collective: all ranks call it with the same values)."""
        self._check_open()
        expected = {s.name: s for lay in self.layouts for s in lay.slots}
        missing = sorted(set(expected) - set(state))
        unexpected = sorted(set(state) - set(expected) - set(self.aliases))
        if missing or unexpected:
            raise KeyError(f"state dict does not match the model: missing {missing}, unexpected {unexpected}")
        for name, s in expected.items():
            if tuple(state[name].shape) != s.shape:
                raise ValueError(f"parameter {name!r}: shape {tuple(state[name].shape)} in the state dict, {s.shape} in the model")
        self.reshard_all()
        self.transport.barrier()  # nobody may be reading rows while they change
        for g in self.groups:
            g.load_full_([state[s.name].to(self.transport.device) for s in g.layout.slots])
        self.after_update()
        self.transport.barrier()

    def state_dict(self, *args, **kwargs):  # type: ignore[override]
        """Same as ``full_state_dict`` (a gathered, plain-PyTorch view of the model)."""
        if args or kwargs:
            raise TypeError("ODCShard.state_dict takes no arguments; it returns full_state_dict()")
        return self.full_state_dict()

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):  # type: ignore[override]
        """Same as ``load_full_state_dict`` (``strict`` must stay True, ``assign`` False)."""
        if not strict or assign:
            raise ValueError("ODCShard.load_state_dict supports only strict=True, assign=False")
        self.load_full_state_dict(state_dict)

    def _apply(self, fn, recurse=True):
        # .to()/.cuda()/.half() would replace parameter data with tensors outside the group
        # buffers, silently disconnecting the model from its shards.
        raise RuntimeError(
            "ODCShard does not support .to()/.cuda()/.float() and the like after wrapping; move or cast "
            "the model before wrapping it (param_dtype= sets the compute dtype)"
        )

    def close(self) -> None:
        """Release the transport, hooks and rows; the model cannot be used afterwards (collective)."""
        if not self._closed:
            self.reshard_all()
            self._closed = True
            for handle in self._hooks:
                handle.remove()
            self._hooks = []
            for g in self.groups:
                g.release_master()
                g.grad = None
            self.transport.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this ODCShard was closed; its rows (and masters) are released")

    def extra_repr(self) -> str:
        return (
            f"groups={len(self.groups)}, world_size={self.world_size}, comm={self.transport.name}, "
            f"param_dtype={self.param_dtype}, reshard_after_forward={self.reshard_after_forward}"
            + (f", units={[u.__name__ for u in self.units]}" if self.units else "")
        )
