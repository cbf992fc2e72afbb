"""How optimizer steps reach the models whose parameters they update.

Design note [optimizer-events]
------------------------------
Optimizers are built by the user after wrapping, so a model learns of their steps
through torch's global optimizer step hooks: one pair for the process, installed with
the first model and never removed, which keeps no list of models. Each sharded
parameter points to its model's step protocol (``sp.events``, [params]), so the
post-step hook hands every model the parameters of its own that the optimizer holds
(``optimizer_stepped``, an event of [step-protocol]); a model that is gone has no
parameter in any live optimizer, and a closed one ignores the event. The pre-step
hook refuses an optimizer built from the parameters as they were before wrapping
(``UNSHARDED``: by id, holding them weakly; not a ``WeakSet``, whose lookups compare
tensors with ``==``, elementwise, on storages that may be freed; filled by [params]). Should something
remove torch's hooks (a test fixture clearing the global tables), the next model puts
the pair back.
"""

from __future__ import annotations

import weakref

from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ...torch_private import optimizer_hooks_present

#: the trained parameters as they were before wrapping (now the unsharded forms): an optimizer over them is refused.
UNSHARDED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_hooks: tuple | None = None  # the process's one pair of handles


def install_optimizer_hooks() -> None:
    """Register the process's pair of optimizer step hooks, once (again if they were removed)."""
    global _hooks
    if _hooks is not None and optimizer_hooks_present(_hooks[0].id, _hooks[1].id):
        return
    if _hooks is not None:
        for handle in _hooks:
            handle.remove()
    _hooks = (register_optimizer_step_pre_hook(_before_optimizer_step),
              register_optimizer_step_post_hook(_after_optimizer_step))


def _before_optimizer_step(optimizer, args, kwargs) -> None:
    if any(UNSHARDED.get(id(p)) is p for g in optimizer.param_groups for p in g["params"]):
        raise RuntimeError(
            "this optimizer holds the model's parameters as they were before ODCShard wrapped it; build the "
            "optimizer after wrapping, from the wrapped model's parameters (as with FSDP2)")


def _after_optimizer_step(optimizer, args, kwargs) -> None:
    by_model: dict[int, tuple] = {}  # id(minibatch) -> (minibatch, its parameters in this optimizer)
    for g in optimizer.param_groups:
        for p in g["params"]:
            sp = getattr(p, "_odc", None)
            if sp is not None:
                by_model.setdefault(id(sp.events), (sp.events, []))[1].append(sp)
    for minibatch, sps in by_model.values():
        minibatch.optimizer_stepped(sps)
