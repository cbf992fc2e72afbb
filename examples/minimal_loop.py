"""The smallest complete odcfsdp training loop; run with ``torchrun --nproc-per-node=2 examples/minimal_loop.py``.

Without torchrun it runs as a single process (N = 1, no communication).
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
    torch.manual_seed(0)  # every rank builds the same initial model
    with torch.device(device):
        model = Llama(LlamaConfig(vocab_size=256, dim=128, n_layers=4))
    model = odcfsdp.ODCShard(model, group_bytes=32 << 20)
    opt = odcfsdp.optim.AdamW(model, lr=3e-4, weight_decay=0.1, no_decay=["*norm*"])
    rank = dist.get_rank() if dist.is_initialized() else 0
    gen = torch.Generator(device=device).manual_seed(1 + rank)
    for step in range(10):
        micro_batches = [torch.randint(0, 256, (4, 65), device=device, generator=gen) for _ in range(2)]
        global_tokens = 4 * 64 * 2 * (dist.get_world_size() if dist.is_initialized() else 1)
        for seq in micro_batches:
            causal_lm_loss(model(seq[:, :-1]), seq[:, 1:], global_tokens).backward()
        norm = opt.step(max_norm=1.0)  # the one place ranks meet
        opt.zero_grad()
        if rank == 0:
            print(f"step {step}: grad norm {norm.item():.4f}")
    model.close()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
