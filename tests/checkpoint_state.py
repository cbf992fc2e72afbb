"""The small model, training loop and state comparison the checkpoint and HSDP tests share."""

from __future__ import annotations

import torch
import torch.distributed as dist

from odcfsdp import ODCShard, param_groups
from odcfsdp.models import Llama, LlamaConfig

CFG = LlamaConfig(vocab_size=61, dim=40, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=108)


def build(cfg: LlamaConfig = CFG, group_bytes: int = 4096, seed: int = 0, mesh=None) -> tuple[ODCShard, torch.optim.AdamW]:
    torch.manual_seed(seed)
    # The default gradient divide factor (the mean over ranks, FSDP2's): these runs are compared with each other only.
    model = ODCShard(Llama(cfg), group_bytes, comm="shm" if dist.is_initialized() else "collective", mesh=mesh)
    return model, torch.optim.AdamW(param_groups(model), lr=1e-2, weight_decay=0.1)


def save_outcome(path, model: ODCShard, opt: torch.optim.Optimizer, error: type[Exception] | None = None) -> str:
    """``save_checkpoint`` of step 1 on this rank: "saved", or the message of the refusal (``error``, by default
    ``CheckpointError``) that every rank must make alike."""
    from odcfsdp.checkpoint import CheckpointError, save_checkpoint

    try:
        save_checkpoint(path, model, opt, step=1)
    except (error or CheckpointError) as e:
        return str(e)
    return "saved"


def train_steps(model: ODCShard, opt: torch.optim.Optimizer, steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed + model.rank)
    for _ in range(steps):
        x = torch.randint(0, CFG.vocab_size, (2, 9), generator=g)
        model(x).float().pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()


def optimizer_state(opt: torch.optim.Optimizer | None) -> dict | None:
    """Full optimizer state by parameter name (collective: DTensor states are gathered)."""
    if opt is None:
        return None
    out = {}
    for group in opt.param_groups:
        for p in group["params"]:
            out[p._odc.name] = {k: v.full_tensor() if hasattr(v, "full_tensor") else v.clone() if torch.is_tensor(v)
                                else v for k, v in opt.state.get(p, {}).items()}
    return out


def full_state(model: ODCShard, opt: torch.optim.Optimizer | None) -> dict:
    return {"params": model.full_state_dict(), "opt": optimizer_state(opt)}


def assert_same_state(a: dict, b: dict) -> None:
    assert a["params"].keys() == b["params"].keys()
    for k in a["params"]:
        assert torch.equal(a["params"][k], b["params"][k]), k
    if a["opt"] is not None:
        assert a["opt"].keys() == b["opt"].keys()
        for name, state in a["opt"].items():
            assert state.keys() == b["opt"][name].keys() and {"step", "exp_avg", "exp_avg_sq"} <= state.keys(), name
            for key, v in state.items():
                assert torch.equal(v, b["opt"][name][key]), (name, key)
