"""Shared pieces of the parity tests: a model, data, a plain-PyTorch reference run and a sharded run.

Both runs are the standard PyTorch loop (micro-batches' backward, ``clip_grad_norm_``,
a ``torch.optim`` optimizer over ``param_groups``, optionally a ``LambdaLR`` schedule,
``zero_grad``). The reference is a single process on a plain model that sees the
union of every rank's micro-batches; the sharded run is what each rank executes
under ``odcfsdp.launch.spawn``, on an ``ODCShard`` of the same model.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from odcfsdp import ODCShard, param_groups
from odcfsdp.models import Llama, LlamaConfig, causal_lm_loss

# Sizes chosen so no parameter count divides evenly by both 2 and 3.
CONFIG = LlamaConfig(vocab_size=97, dim=40, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=108, tie_embeddings=True)
FROZEN = "llama.layers.0.post_attention_layernorm.weight"
NO_DECAY = ["*norm*", "logit_scale"]


class ParityModel(nn.Module):
    """Llama with a tied embedding, plus a 1-element logit scale and a frozen norm."""

    def __init__(self, dtype: torch.dtype = torch.float32, compile_backend: str | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.llama = Llama(dataclasses.replace(CONFIG, compile=compile_backend is not None,
                                               compile_backend=compile_backend or "inductor"))
        self.logit_scale = nn.Parameter(torch.full((1,), 1.1))
        with torch.no_grad():
            frozen = self.get_parameter(FROZEN)
            frozen.uniform_(0.5, 1.5)
            frozen.requires_grad_(False)
        self.to(dtype)

    def forward(self, tokens):
        return self.llama(tokens) * self.logit_scale


@dataclass
class Run:
    """Hyper-parameters and data of one parity run."""

    world_size: int
    micro_batches: list[int]  # per rank
    steps: int = 3
    batch: int = 2
    seq: int = 12
    lr: float = 1e-2
    weight_decay: float = 0.1
    # eps bounds Adam's amplification of gradient rounding (update ~ lr * g / (|g| + eps)) on
    # entries whose true gradient is ~0; with 1e-8 a 1e-10 rounding difference moves them ~1e-6.
    eps: float = 1e-6
    max_norm: float = 0.3
    seed: int = 1
    optimizer: str = "adamw"  # adamw | adam | sgd (momentum) | adagrad | rmsprop
    schedule: bool = False  # LambdaLR: linear warm-up over the run
    zero_grad_first: bool = False  # opt.zero_grad() at the start of each step instead of after opt.step()
    fused: bool | None = None  # torch's fused AdamW (GPU)
    data: list = field(default_factory=list)

    def __post_init__(self):
        g = torch.Generator().manual_seed(self.seed)
        # data[step][rank] = list of (inputs, targets) micro-batches
        self.data = [
            [
                [
                    tuple(torch.randint(0, CONFIG.vocab_size, (2, self.batch, self.seq), generator=g))
                    for _ in range(self.micro_batches[r])
                ]
                for r in range(self.world_size)
            ]
            for _ in range(self.steps)
        ]

    def tokens(self, step: int) -> int:
        """Global number of target tokens in a minibatch (the loss normaliser)."""
        return sum(t.numel() for rank in self.data[step] for _, t in rank)

    def optimizer_for(self, model: nn.Module):
        """(optimizer, scheduler or None) over ``model``'s parameter groups (norms and the logit scale undecayed)."""
        groups = param_groups(model, no_decay=NO_DECAY)
        name = self.optimizer
        if name in ("adamw", "adam"):
            cls = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
            opt = cls(groups, lr=self.lr, weight_decay=self.weight_decay, eps=self.eps, fused=self.fused)
        elif name == "sgd":
            opt = torch.optim.SGD(groups, lr=self.lr, momentum=0.9, weight_decay=self.weight_decay)
        elif name == "adagrad":
            opt = torch.optim.Adagrad(groups, lr=self.lr, weight_decay=self.weight_decay, eps=self.eps)
        elif name == "rmsprop":
            opt = torch.optim.RMSprop(groups, lr=self.lr * 0.1, weight_decay=self.weight_decay, eps=self.eps,
                                      momentum=0.5)
        else:
            raise ValueError(f"unknown optimizer {name!r}")
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: (k + 1) / self.steps) if self.schedule else None
        return opt, sched


def train_loop(run: Run, model: nn.Module, batches, compute=lambda x: x, on_micro=None) -> dict:
    """The standard loop over ``batches(step)`` -> [(x, y), ...] micro-batches; per-step losses and clip norms,
    and the host seconds each ``clip_grad_norm_``, each ``zero_grad`` and each whole step took.

    ``compute`` moves inputs where the model runs; ``on_micro`` runs after each
    backward (the mixed-precision reference collects its gradients there).
    """
    opt, sched = run.optimizer_for(model)
    losses, norms, clip_s, zero_grad_s, step_s = [], [], [], [], []

    def zero_grad():
        t0 = time.perf_counter()
        opt.zero_grad()
        zero_grad_s.append(time.perf_counter() - t0)

    for step in range(run.steps):
        t_step = time.perf_counter()
        if run.zero_grad_first:
            zero_grad()
        step_losses = []
        for x, y in batches(step):
            loss = causal_lm_loss(model(compute(x)), compute(y), run.tokens(step))
            loss.backward()
            step_losses.append(loss.item())
            if on_micro is not None:
                on_micro()
        losses.append(step_losses)
        t0 = time.perf_counter()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_norm)))
        clip_s.append(time.perf_counter() - t0)
        opt.step()
        if sched is not None:
            sched.step()
        if not run.zero_grad_first:
            zero_grad()
        step_s.append(time.perf_counter() - t_step)
    return {"losses": losses, "norms": norms, "optimizer": opt, "clip_s": clip_s, "zero_grad_s": zero_grad_s,
            "step_s": step_s}


def reference_run(run: Run, dtype: torch.dtype, compile_backend: str | None = None) -> dict:
    """Single-process PyTorch on the union of all ranks' data."""
    model = ParityModel(dtype, compile_backend)
    out = train_loop(run, model, lambda step: [mb for rank in run.data[step] for mb in rank])
    return {"losses": out["losses"], "norms": out["norms"],
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def sharded_run(
    run: Run,
    dtype: torch.dtype,
    group_bytes: int,
    reshard: bool,
    comm: str = "collective",
    device: str = "cpu",
    prefetch: int = 1,
    param_dtype: torch.dtype | None = None,
    units: tuple = (),
    compile_backend: str | None = None,
    replicas: int = 1,
    mp_policy=None,
    gather_masters: bool = False,
    offload_policy=None,
    overlap_push: bool = True,
    pushes_in_flight: int | None | str = "default",
    split_masters: bool = False,
) -> dict:
    """What every rank runs: the standard loop on an ``ODCShard`` of the model, on this rank's micro-batches.

    On ``device="cuda"`` each rank uses its current GPU; ``param_dtype`` defaults to
    bf16 there (ODCShard's default) and to ``dtype`` on CPU. ``units`` goes to
    ``ODCShard``; ``compile_backend`` compiles the decoder layers' dense parts; ``replicas`` > 1
    shards over a 2-D ``(replicate, shard)`` mesh (HSDP).
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    model = ODCShard(
        ParityModel(dtype, compile_backend).to(dev), group_bytes, comm=comm, reshard_after_forward=reshard,
        prefetch=prefetch, param_dtype=param_dtype, units=units, mesh=_hsdp_mesh(dev, replicas), mp_policy=mp_policy,
        gather_masters=gather_masters, offload_policy=offload_policy, overlap_push=overlap_push,
        split_masters=split_masters,
    )
    if pushes_in_flight != "default":  # [streams] 2's bound (CUDA's push stream only); None: unbounded
        model.comm.pushes_in_flight = pushes_in_flight
    model.set_gradient_divide_factor(1.0)  # sum: the reference sums over ranks (losses / the global token count)
    host_masters = {str(g.master.device.type) + ("/pinned" if g.master.is_pinned() else "") for g in model.groups}
    heap_rows = {str(t.dtype).removeprefix("torch.") for t in model.transport.rows}
    out = train_loop(run, model, lambda step: run.data[step][rank], compute=lambda t: t.to(dev))
    state = {k: v.cpu() for k, v in model.full_state_dict().items()}
    model.close()
    from torch._dynamo.utils import counters

    return {"losses": out["losses"], "norms": out["norms"], "clip_s": out["clip_s"], "zero_grad_s": out["zero_grad_s"],
            "step_s": out["step_s"], "params": state, "groups": len(model.groups),
            "row_dtypes": heap_rows, "master_devices": host_masters,
            "graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values())}


def _hsdp_mesh(device: torch.device, replicas: int):
    if replicas == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (replicas, dist.get_world_size() // replicas),
                            mesh_dim_names=("replicate", "shard"))


@torch.no_grad()
def cast_into(compute: nn.Module, master: nn.Module) -> None:
    """Copy master values into the compute copy (a cast: to nearest, ties to even, as ODCShard publishes)."""
    for p, q in zip(compute.parameters(), master.parameters()):
        p.copy_(q)


def mixed_precision_reference(run: Run, device: str, compute_dtype: torch.dtype = torch.bfloat16,
                              reduce_dtype: torch.dtype = torch.float32, master_device: str | None = None) -> dict:
    """Plain PyTorch with FSDP2-style mixed precision, on one device, on the union of the data.

    A copy of the model with ``compute_dtype`` parameters runs forward/backward per
    micro-batch; its gradients are rounded to ``reduce_dtype`` and summed in it (fp32: the
    default), then handed to the fp32 master parameters, which the run's optimizer (after
    ``clip_grad_norm_``) updates and which are cast back into the compute copy after every step.
    ``master_device`` (default ``device``) is where the masters, the optimizer and its step live
    (``"cpu"``: CPU offload; torch's CPU and CUDA optimizer kernels round differently).
    """
    import copy

    master = ParityModel(torch.float32).to(master_device or device)
    compute = copy.deepcopy(master).to(device)
    for p in compute.parameters():  # parameters only: buffers (RoPE frequencies) stay fp32, as in ODCShard
        p.data = p.data.to(compute_dtype)
    cast_into(compute, master)
    names = [n for n, p in master.named_parameters() if p.requires_grad]
    opt, sched = run.optimizer_for(master)
    losses, norms = [], []
    for step in range(run.steps):
        norm_by = run.tokens(step)
        accum = {n: torch.zeros_like(master.get_parameter(n), dtype=reduce_dtype) for n in names}
        step_losses = []
        for rank in range(run.world_size):
            for x, y in run.data[step][rank]:
                loss = causal_lm_loss(compute(x.to(device)), y.to(device), norm_by)
                loss.backward()
                step_losses.append(loss.item())
                for n in names:
                    accum[n].add_(compute.get_parameter(n).grad.to(accum[n].device, reduce_dtype))
                compute.zero_grad(set_to_none=True)
        losses.append(step_losses)
        for n in names:
            master.get_parameter(n).grad = accum[n].float()
        norms.append(torch.nn.utils.clip_grad_norm_(master.parameters(), run.max_norm).item())
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()
        cast_into(compute, master)
    return {"losses": losses, "norms": norms, "params": {n: p.detach().cpu() for n, p in master.named_parameters()}}


def assert_same_training(first: list[dict], second: list[dict]) -> None:
    """Two sets of ranks' ``sharded_run`` results trained the same thing to the bit: losses, norms, final values."""
    for a, b in zip(first, second, strict=True):
        assert a["losses"] == b["losses"] and a["norms"] == b["norms"]
        for k in a["params"]:
            assert torch.equal(a["params"][k], b["params"][k]), k
