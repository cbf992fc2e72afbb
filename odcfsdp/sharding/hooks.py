"""The hook driver: which modules are hook sites, and what their hooks do in forward and backward.

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
   [grad-buffers] in ``group.py``);
4. post-backward: count the site off in each of its groups; once every site of a
   group is through, push its gradient buffer into the owners' accumulators
   (scatter-accumulate) and reshard it.

An end-of-backward callback pushes whatever is still pending (groups of sites whose
inputs need no gradient, such as the embedding; parameters that got no gradient in
this pass contribute zeros) and reshards everything. Forward hooks that run
*during* backward (activation recomputation) never reshard, because the recomputed
activations are about to be used, and prefetch in backward order ([prefetch]).

Units (like FSDP2's ``fully_shard`` per block) cost one hook call per block instead of
one per parameter-owning module, and keep the hooks outside the block's own code, so
the block's forward can be compiled (``torch.compile``) in one piece.

The root (the wrapped model itself) gets a forward pre-hook that runs first (the
step protocol's ``before_forward``, resetting use counts) and a post-hook that runs
last, even when forward raises; they sit on the wrapped model, not in
``ODCShard.forward``, so that methods of the model that call its forward
themselves (Hugging Face ``generate``) take the same path.

Every hook is opaque to ``torch.compile`` (``torch.compiler.disable``): a compiled
module or model breaks its graph at them and runs them eagerly, which keeps
gathers, frees and pushes out of traced code.

Limitation: a parameter is available only while its site runs (or while its group
stays resident); code that reads ``child.weight`` from a parent's forward without
calling ``child`` sees the sharded parameter ([params]) and fails. Call the module
instead, make the parent a unit, or use ``reshard_after_forward=False``.
"""

from __future__ import annotations

import enum
from typing import Iterator

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from .group import FlatGroup
from .prefetch import PrefetchSchedule
from .protocol import StepProtocol


class TrainingPhase(enum.Enum):
    """Where the wrapper is in a forward/backward pass."""

    IDLE = enum.auto()
    """No forward or backward pass in flight."""
    FORWARD = enum.auto()
    """Inside the root module's forward."""
    BACKWARD = enum.auto()
    """Between the first pre-backward hook and the end-of-backward callback."""


Site = tuple[FlatGroup, ...]


def hook_sites(root: nn.Module, units: tuple[type[nn.Module], ...]) -> Iterator[tuple[nn.Module, list[nn.Parameter]]]:
    """(module, parameters it gathers): each unit with its subtree, other modules with their own."""
    inside: set[int] = set()  # modules below a unit: the unit covers them
    for mod in root.modules():  # parents before children
        if id(mod) in inside:
            continue
        if isinstance(mod, units):
            inside.update(id(m) for m in mod.modules())
            yield mod, list(mod.parameters())
        else:
            yield mod, list(mod.parameters(recurse=False))


class HookDriver:
    """Registers the hooks of a model and runs them (see [hooks]).

    Args:
        root: the wrapped model.
        groups: its groups; ``group_of`` maps each (unsharded) parameter to its group.
        protocol: counts and issues pushes; its ``before_forward`` runs first in every root forward.
        prefetch: the site order and how far ahead to gather.
        reshard_after_forward: free a group after its last forward use.
        units: module classes hooked as a whole.
        checks: run at the start of every root forward, before anything else (may raise).
    """

    def __init__(self, root: nn.Module, groups: list[FlatGroup], group_of: dict[nn.Parameter, FlatGroup],
                 protocol: StepProtocol, prefetch: PrefetchSchedule, reshard_after_forward: bool,
                 units: tuple[type[nn.Module], ...], checks=lambda: None):
        self.groups = groups
        self.protocol = protocol
        self.prefetch = prefetch
        self.reshard_after_forward = reshard_after_forward
        self.checks = checks
        self.phase = TrainingPhase.IDLE
        # The hooks hold this object; tensor hooks live in C++, where Python's garbage collector
        # cannot see the cycle, so remove() drops them for the wrapper to be freed.
        self.handles: list = [root.register_forward_pre_hook(lambda _m, _a: self._root_pre_forward(), prepend=True)]
        for mod, params in hook_sites(root, units):
            site = tuple(dict.fromkeys(group_of[p] for p in params))
            if not site:
                continue
            for g in site:
                g.sites += 1
            self.handles.append(mod.register_forward_pre_hook(
                lambda _m, args, kwargs, s=site: self._pre_forward(s, args, kwargs), with_kwargs=True))
            self.handles.append(mod.register_forward_hook(lambda _m, _a, out, s=site: self._post_forward(s, out)))
        self.handles.append(root.register_forward_hook(lambda _m, _a, _o: self._root_post_forward(), always_call=True))
        self.sites = (len(self.handles) - 2) // 2

    def remove(self) -> None:
        """Remove every hook (the wrapper is closing)."""
        for handle in self.handles:
            handle.remove()
        self.handles = []

    @property
    def busy(self) -> bool:
        """A forward or backward pass is in flight."""
        return self.phase is not TrainingPhase.IDLE

    # -- the root's forward ----------------------------------------------------------------------
    @torch.compiler.disable
    def _root_pre_forward(self) -> None:
        """The root forward starts: checks, the step protocol, every site of every group still to run."""
        if self.phase is TrainingPhase.BACKWARD:  # the whole model recomputed in backward: nothing to reset
            return
        self.checks()
        self.protocol.before_forward()
        for g in self.groups:
            g.reset_uses()
        self.phase = TrainingPhase.FORWARD

    @torch.compiler.disable
    def _root_post_forward(self) -> None:
        """The root forward is over (or failed): fix the site order, free what backward will gather again."""
        if self.phase is not TrainingPhase.FORWARD:
            return
        self.phase = TrainingPhase.IDLE
        self.prefetch.finish_recording()
        if self.reshard_after_forward or not torch.is_grad_enabled():
            self.protocol.reshard_all()

    # -- site hooks ----------------------------------------------------------------------------------
    def _use(self, site: Site, backward: bool) -> None:
        """Unshard ``site``'s groups for use on the current stream, then prefetch what the next sites need."""
        for g in site:
            g.to_unsharded()
            g.wait_ready()
            if backward:
                g.prepare_grad()
        self.prefetch.record(site)
        for g in self.prefetch.targets(site, backward):
            g.to_unsharded(ahead=True)  # on CPU (no side stream) a plain gather ahead of use

    @torch.compiler.disable
    def _pre_forward(self, site: Site, args, kwargs) -> None:
        # During backward this is activation recomputation: what comes next is backward order. Its
        # inputs get the post-backward hook too: reentrant checkpointing runs backward through the
        # recomputed graph (and the original forward ran without grad); otherwise it never fires.
        self._use(site, backward=self.phase is TrainingPhase.BACKWARD)
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
                self._post_backward_site(site)

        for t in inputs:
            t.register_hook(input_grad_done)

    @torch.compiler.disable
    def _post_forward(self, site: Site, output) -> None:
        grad_mode = torch.is_grad_enabled()
        if self.phase is not TrainingPhase.BACKWARD:
            reshard = self.reshard_after_forward or not grad_mode
            for g in site:
                if g.forward_use_done() and reshard:
                    g.to_sharded()
        if grad_mode:
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(tensors, lambda _grad: self._pre_backward(site),
                                                              mode="any")

    def _pre_backward(self, site: Site) -> None:
        if self.phase is not TrainingPhase.BACKWARD:
            self.phase = TrainingPhase.BACKWARD
            torch.autograd.Variable._execution_engine.queue_callback(self._post_backward)
        self._use(site, backward=True)

    def _post_backward_site(self, site: Site) -> None:
        for g in site:
            if g.backward_use_done():
                self.protocol.push(g)
                g.to_sharded()

    def _post_backward(self) -> None:
        for g in self.groups:
            self.protocol.push(g)
            g.to_sharded()
        late = [g for g in self.groups if g.collect_late_grads()]  # see [grad-buffers]
        for g in late:
            self.protocol.push(g)
        self.phase = TrainingPhase.IDLE
        self.protocol.after_backward()
