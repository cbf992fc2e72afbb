"""The smallest complete odcfsdp training loop; run with ``torchrun --nproc-per-node=2 examples/minimal_loop.py``.

The standard PyTorch loop: only the ``ODCShard`` line differs from single-GPU code.
Ranks run different numbers of micro-batches here (rank r runs r + 1) and meet only
where the gradients are read (``clip_grad_norm_``). Without torchrun it runs as a
single process (N = 1, no communication).
"""

import os

import torch
import torch.distributed as dist

import odcfsdp
from odcfsdp.models import Llama, LlamaConfig, causal_lm_loss


def main() -> None:
    if "RANK" in os.environ:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    torch.manual_seed(0)  # every rank builds the same initial model
    with torch.device(device):
        model = Llama(LlamaConfig(vocab_size=256, dim=128, n_layers=4))
    model = odcfsdp.ODCShard(model, group_bytes=32 << 20)
    # sum: the loss below is normalised by the global token count, so the gradient is its sum over ranks
    # (the default, FSDP2's, divides by the number of ranks: for a per-rank mean loss)
    model.set_gradient_divide_factor(1.0)
    opt = torch.optim.AdamW(odcfsdp.param_groups(model), lr=3e-4, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 3))
    gen = torch.Generator(device=device).manual_seed(1 + rank)
    global_tokens = 4 * 64 * sum(r + 1 for r in range(world))  # every rank's target tokens, summed
    for step in range(10):
        for _ in range(rank + 1):  # this rank's micro-batches
            seq = torch.randint(0, 256, (4, 65), device=device, generator=gen)
            causal_lm_loss(model(seq[:, :-1]), seq[:, 1:], global_tokens).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # ranks meet here
        opt.step()
        sched.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {step}: grad norm {float(norm.full_tensor() if world > 1 else norm):.4f}")
    model.close()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
