"""What a resumed run may change of the run that wrote its checkpoint, and how a changed hyper-parameter is applied.

Design note [resume-setup]
--------------------------
A checkpoint's manifest holds the config of the run that wrote it. Resuming compares it, key by
key, with the new run's, before any rank starts:

1. *refused*: a change that makes it another run (``REFUSED``: the model, the data and its order,
   the optimizer's class and its parameter groups, the seed). The error names every such key with
   both values, in one line: resume with the saved values, or start a run of its own;
2. *applied on purpose*: a hyper-parameter (``APPLIED``: the learning rate and its schedule, weight
   decay, betas, eps, the optimizer's numeric keyword arguments (a switch such as ``amsgrad``
   changes what its state holds: refused), clipping, the length of the run). One
   ``note:`` line says so. The optimizer's state dict would otherwise bring the old values back
   (torch's ``load_state_dict`` restores every group's hyper-parameters, and the scheduler its base
   learning rates), so after the load ``apply_hyperparameters`` writes the new run's values, those
   of the optimizer and scheduler just built from its config, into the loaded ones;
3. anything else (sharding, balancing, checkpoints, logging, the world size: resharding is
   supported) changes how the run computes, not what: accepted without a word.
"""

from __future__ import annotations

from typing import Any

from ..torch_private import set_last_lr

#: keys whose change makes another run: refused at resume (prefixes: a dict-valued key's entries too)
REFUSED = ("model.name", "model.size", "model.overrides", "model.path", "model.hf_config", "model.lora.r",
           "model.lora.alpha", "model.lora.dropout", "model.lora.target_modules", "data.source", "data.path",
           "data.format", "data.fields", "data.tokenizer_path", "data.vocab_size", "data.lengths",
           "data.prompt_fraction", "data.pool_tokens", "data.batch_size", "optim.name", "optim.no_decay", "run.seed")

#: hyper-parameters a resumed run applies on purpose, with a note
APPLIED = ("optim.lr", "optim.weight_decay", "optim.betas", "optim.eps", "optim.kwargs", "optim.max_norm",
           "optim.warmup_steps", "optim.schedule", "optim.min_lr_ratio", "run.steps", "run.epochs")


#: dict-valued keys compared whole (their entries are free: a key one run has and the other lacks is a change)
WHOLE = ("model.overrides", "optim.kwargs")


def flat(node: Any, prefix: str = "") -> dict[str, Any]:
    """A config tree (nested dicts) as ``{dotted key: leaf value}``; ``WHOLE`` keys stay dicts, lists and tuples
    compare as lists."""
    if isinstance(node, dict) and prefix not in WHOLE:
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: list(node) if isinstance(node, (list, tuple)) else node}


def _under(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def setup_changes(saved: dict, now: dict) -> tuple[list[tuple[str, Any, Any]], list[tuple[str, Any, Any]]]:
    """(refused, applied): the keys whose value differs between the ``saved`` config (a checkpoint's) and ``now``
    (both nested dicts), each as (key, saved value, new value). A key the saved config lacks (an older checkpoint)
    is not compared."""
    old, new = flat(saved), flat(now)
    unread = set()
    if new.get("run.epochs") is not None:  # run.steps is set from the epochs (the saved one was)
        unread.add("run.steps")
    if not old.get("model.lora.r") and not new.get("model.lora.r"):  # no adapters: their settings are unread
        unread |= {k for k in new if k.startswith("model.lora.")}
    changed = [(k, old[k], new[k]) for k in old if k in new and k not in unread and old[k] != new[k]]
    refused = [c for c in changed if _under(c[0], REFUSED)]
    applied = [c for c in changed if _under(c[0], APPLIED)]
    kwargs = [c for c in applied if c[0] == "optim.kwargs"]
    if kwargs and _structural(*kwargs[0][1:]):  # amsgrad, foreach...: the loaded state has another shape
        refused.append(kwargs[0])
        applied.remove(kwargs[0])
    return refused, applied


def _structural(old: dict, new: dict) -> bool:
    """Whether an optimizer keyword that changed is a switch (a bool or a name: ``amsgrad``, ``foreach``), which
    changes what the optimizer's state holds, not a number the loaded state can go on with."""
    keys = {k for k in {*old, *new} if old.get(k) != new.get(k)}
    return any(not isinstance(v, (int, float)) or isinstance(v, bool)
               for k in keys for v in (old.get(k), new.get(k)) if v is not None)


def _show(value: Any) -> str:
    return "null" if value is None else repr(value) if isinstance(value, str) else str(value)


def refusal(path: str, refused: list[tuple[str, Any, Any]]) -> str:
    """The one line that refuses a resume changing ``refused`` keys ([resume-setup] 1)."""
    was = ", ".join(f"{k}={_show(a)}" for k, a, _ in refused)
    now = ", ".join(f"{k}={_show(b)}" for k, _, b in refused)
    return (f"checkpoint.resume: {path} was written by a run with {was}, and this run has {now}: that is another "
            "run, not this one continued: resume with the checkpoint's values, or start it in another run.out_dir")


def note(applied: list[tuple[str, Any, Any]]) -> str:
    """The one ``note:`` line for hyper-parameters a resume applies ([resume-setup] 2)."""
    what = ", ".join(f"{k}={_show(b)} (was {_show(a)})" for k, a, b in applied)
    return f"note: resuming with {what}: applied from the checkpoint's step on"


def fresh_hyperparameters(opt) -> list[dict]:
    """Every param group's hyper-parameters as the new run's config set them (call before loading a checkpoint)."""
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def apply_hyperparameters(opt, sched, fresh: list[dict]) -> None:
    """After a checkpoint's load ([resume-setup] 2): the loaded groups take the new run's hyper-parameters
    (``fresh``), the scheduler its base learning rates, and each group's learning rate is the new schedule's at
    the loaded step (the optimizer's state, its moments and step counts, stays the checkpoint's)."""
    for group, values in zip(opt.param_groups, fresh, strict=True):
        for k, v in values.items():
            if k not in ("lr", "initial_lr"):
                group[k] = v
        group["initial_lr"] = values.get("initial_lr", values["lr"])
    if sched is None:
        return
    sched.base_lrs = [g["initial_lr"] for g in opt.param_groups]
    for group, base, factor in zip(opt.param_groups, sched.base_lrs, sched.lr_lambdas, strict=True):
        group["lr"] = base * factor(sched.last_epoch)
    set_last_lr(sched, [g["lr"] for g in opt.param_groups])  # what get_last_lr() reports (the metrics' lr)


__all__ = ["APPLIED", "REFUSED", "WHOLE", "apply_hyperparameters", "flat", "fresh_hyperparameters", "note", "refusal",
           "setup_changes"]
