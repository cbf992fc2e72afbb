"""The hook driver: which modules are hook sites, and which step of the lifecycle each of their hooks runs.

Design note [hooks]
-------------------
Hooks sit on *hook sites*: each ``units`` module (for all parameters of its subtree)
and every other submodule outside the units that directly owns parameters. A site
gets these hooks:

1. forward pre-hook: [lifecycle] 2, gather the groups holding its parameters; in grad
   mode, also hook the site's inputs: once the gradients of all of them are done,
   the site's backward is through (4). A hook only observes, so gradients are summed
   exactly as without the wrapper;
2. forward post-hook: [lifecycle] 4, count the site off in each of its groups and
   reshard a group after its last site; then register a pre-backward hook on the
   site's outputs;
3. pre-backward hook (fires when the gradient of any output is ready, i.e. right
   before the site's own backward): [lifecycle] 5, re-gather ([fresh-grads] in
   ``fresh_grads.py``, [grad-buffers] in ``group.py``);
4. post-backward: [lifecycle] 6, push each group whose last site is through, and
   reshard it.

The end-of-backward callback is [lifecycle] 7 (push whatever is still pending: groups
of sites whose inputs need no gradient, such as the embedding; parameters that got no
gradient in this pass contribute zeros; reshard everything). Forward hooks that run
*during* backward (activation recomputation) never reshard, because the recomputed
activations are about to be used, and prefetch in backward order ([prefetch]).

Units (like FSDP2's ``fully_shard`` per block) cost one hook call per block instead of
one per parameter-owning module, and keep the hooks outside the block's own code, so
the block's forward can be compiled (``torch.compile``) in one piece.

The root (the wrapped model itself) gets a forward pre-hook that runs first ([lifecycle] 1:
the minibatch's ``before_forward``, resetting use counts; on a GPU it moves tensors given on
another device to the model's, as FSDP2's root does) and a post-hook that runs last, even
when forward raises; they sit on the wrapped model, not in
``ODCShard.forward``, so that methods of the model that call its forward
themselves (Hugging Face ``generate``) take the same path.

Every hook is opaque to ``torch.compile``: each registered hook is itself
``torch.compiler.disable``'d, so a compiled block (``block.compile()``, or
``torch.compile(block)`` before or after ``fully_shard``) runs it eagerly with no graph
break, as FSDP2's hooks (one graph, no break, no recompile: tests/test_fully_shard_contract.py);
gathers, frees and pushes stay out of traced code. A hook that were a lambda calling a
disabled method would be inlined and break the graph at the call (two breaks a block). A
whole model compiled as one still breaks once, where FSDP2's does not.

Limitation: a parameter is available only while its site runs (or while its group
stays resident); code that reads ``child.weight`` from a parent's forward without
calling ``child`` sees the sharded parameter ([params]) and fails. Call the module
instead, make the parent a unit, or use ``reshard_after_forward=False``.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from ..groups.group import FlatGroup
from .lifecycle import Site, StepLifecycle
from ...torch_private import apply_to_tensors, tree_leaves


def hook_sites(root: nn.Module, is_unit: Callable[[nn.Module], bool]
               ) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """(module, parameters it gathers), parents before children: each unit with its subtree but for the subtrees
    of units nested in it (their own sites, as FSDP2's nested ``fully_shard`` calls), other modules with their own."""
    sites: list[tuple[nn.Module, list[nn.Parameter]]] = []
    seen: set[int] = set()

    def visit(mod: nn.Module, unit_params: list[nn.Parameter] | None) -> None:
        if id(mod) in seen:  # a module used twice is hooked once, where it first appears
            return
        seen.add(id(mod))
        if is_unit(mod):
            unit_params = []
            sites.append((mod, unit_params))
        elif unit_params is None:
            sites.append((mod, list(mod.parameters(recurse=False))))
        if unit_params is not None:
            unit_params.extend(mod.parameters(recurse=False))
        for child in mod.children():
            visit(child, unit_params)

    visit(root, None)
    return sites


def unit_of(root: nn.Module, is_unit: Callable[[nn.Module], bool]) -> Callable[[str], nn.Module | None]:
    """A parameter name's unit: the innermost unit module on its path, the site that gathers it (``hook_sites``);
    None outside every unit (its module is its own site). Groups never span two units and a unit's parameters
    form one group per dtype and ``requires_grad`` flag ([layout]'s ``owner_of``), as FSDP2's one param group per
    ``fully_shard`` module: a site gathers its own groups, one launch each."""
    prefixes = {prefix: m for prefix, m in root.named_modules() if prefix and is_unit(m)}

    def owner(name: str) -> nn.Module | None:
        parts = name.split(".")
        for k in range(len(parts) - 1, 0, -1):
            m = prefixes.get(".".join(parts[:k]))
            if m is not None:
                return m
        return None

    return owner


def _opaque(hook: Callable) -> Callable:
    """``hook`` as torch.compile sees it: not traced, run eagerly ([hooks]: opaque to ``torch.compile``)."""
    return torch.compiler.disable(hook)


class HookDriver:
    """Registers the hooks of a model; each hook calls one step of the lifecycle (see [hooks], [lifecycle]).

    Args:
        root: the wrapped model.
        group_of: maps each (unsharded) parameter to its group.
        lifecycle: the steps the hooks run (``begin_forward`` ... ``finalize_backward``).
        is_unit: whether a module is hooked as a whole (a ``units`` class, or a ``fully_shard`` module).
    """

    def __init__(self, root: nn.Module, group_of: dict[nn.Parameter, FlatGroup], lifecycle: StepLifecycle,
                 is_unit: Callable[[nn.Module], bool], device: torch.device | None = None):
        self.lifecycle = lifecycle
        self.device = device if device is not None and device.type != "cpu" else None
        # The hooks hold this object; tensor hooks live in C++, where Python's garbage collector
        # cannot see the cycle, so remove() drops them for the wrapper to be freed.
        # Every registered hook is itself torch.compiler.disable'd (not a lambda calling a disabled method): a
        # compiled module's call (``module.compile()``) then runs it eagerly with no graph break, where a lambda
        # around it was inlined and broke the graph at the call (2 breaks a block).
        self.handles: list = [root.register_forward_pre_hook(
            _opaque(lambda _m, args, kwargs: self._root_pre_forward(args, kwargs)), prepend=True, with_kwargs=True)]
        self.site_of: dict[nn.Module, Site] = {}  # each hooked module's site (``fully_shard``'s methods use them)
        for mod, params in hook_sites(root, is_unit):
            site = tuple(dict.fromkeys(group_of[p] for p in params if p in group_of))  # not ignored_params
            if not site:
                continue
            self.site_of[mod] = site
            for g in site:
                g.sites += 1
            self.handles.append(mod.register_forward_pre_hook(
                _opaque(lambda _m, args, kwargs, s=site: self._pre_forward(s, args, kwargs)), with_kwargs=True))
            self.handles.append(mod.register_forward_hook(
                _opaque(lambda _m, _a, out, s=site: self._post_forward(s, out))))
        self.handles.append(root.register_forward_hook(_opaque(lambda _m, _a, _o: self._root_post_forward()),
                                                       always_call=True))
        self.sites = (len(self.handles) - 2) // 2

    def remove(self) -> None:
        """Remove every hook (the wrapper is closing)."""
        for handle in self.handles:
            handle.remove()
        self.handles = []

    # -- the root's forward: [lifecycle] 1 and 4 (each method runs inside its disabled hook, _opaque) -------
    def _root_pre_forward(self, args, kwargs):
        self.lifecycle.begin_forward()
        if self.device is None:
            return None
        # as FSDP2's root: tensors given on another device (the host) move to the model's (a blocking copy, as
        # FSDP2's: the caller may reuse a pinned host buffer at once)
        return apply_to_tensors(lambda t: t if t.device == self.device else t.to(self.device), (args, kwargs))

    def _root_post_forward(self) -> None:
        self.lifecycle.end_forward()

    # -- site hooks: [lifecycle] 2, 4, 5, 6 ----------------------------------------------------------------
    def _pre_forward(self, site: Site, args, kwargs) -> None:
        self.lifecycle.gather(site)
        if not torch.is_grad_enabled():
            return
        # Its inputs get the post-backward hook, in recomputation too: reentrant checkpointing runs backward
        # through the recomputed graph (and the original forward ran without grad); otherwise it never fires.
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not inputs:  # e.g. token ids: the end-of-backward callback finishes this site's groups
            return
        # A plain hook per input, counted down: torch's multi-grad hook ("all") keeps the inputs'
        # autograd nodes in its closure, a reference cycle through C++ that leaks the graph. An input
        # that gets no gradient leaves the site to the end-of-backward callback (later, never early).
        left = [len(inputs)]

        def input_grad_done(_grad) -> None:
            left[0] -= 1
            if left[0] == 0:
                self.lifecycle.post_backward(site)

        for t in inputs:
            t.register_hook(input_grad_done)

    def _post_forward(self, site: Site, output) -> None:
        self.lifecycle.reshard(site)
        if torch.is_grad_enabled():
            tensors = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, lambda _grad: self.lifecycle.pre_backward(site), mode="any")
