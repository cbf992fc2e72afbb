"""``odcfsdp.patch_fsdp2()`` under accelerate's FSDP2 plugin: accelerate's own ``fsdp2_prepare_model`` (blocks, the
tied embedding and tail as a list unit, the root; a meta-device build filled by broadcasting rank 0's values into
``load_state_dict(assign=True)``) on torch's ``fully_shard`` and, patched, on odcfsdp's, then 5 steps of a plain loop on
a Hugging Face Llama: per-step losses and norms equal to 1e-5 on 2 CPU ranks.

accelerate runs its FSDP2 path only on GPUs (on CPU ranks it builds DDP), so the ``Accelerator`` is stood in for by
the few attributes ``fsdp2_prepare_model`` reads; the preparation itself is accelerate's code. TRL's trainers reach the
same function through ``Accelerator.prepare``."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist

from odcfsdp.launch import spawn

pytest.importorskip("accelerate", reason="needs accelerate (test extra)")
pytest.importorskip("transformers", reason="needs transformers (test extra)")


def _accelerate_script(impl: str) -> dict:
    import transformers
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    undo = None
    if impl == "odc":
        import odcfsdp

        undo = odcfsdp.patch_fsdp2()
    rank = dist.get_rank()
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
                                            cpu_ram_efficient_loading=True, reshard_after_forward=True)
    accelerator = types.SimpleNamespace(state=types.SimpleNamespace(fsdp_plugin=plugin), torch_device_mesh=None,
                                        mixed_precision="no", is_main_process=rank == 0, device=torch.device("cpu"),
                                        parallelism_config=None, process_index=rank)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = fsdp2_prepare_model(accelerator, transformers.LlamaForCausalLM(config))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    steps = []
    for _ in range(5):
        x = torch.randint(0, 128, (2, 16), generator=g)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        steps.append((loss.item(), float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)))
    classes = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.startswith(("FSDP", "ODC"))})
    tied = model.model.embed_tokens.weight is model.lm_head.weight
    if undo is not None:
        undo()
    return {"steps": steps, "classes": classes, "tied": tied}


def test_accelerates_fsdp2_preparation_runs_on_odcfsdp_as_on_torch():
    ours = spawn(_accelerate_script, 2, "odc")
    theirs = spawn(_accelerate_script, 2, "torch")
    for rank in range(2):
        for (a, na), (b, nb) in zip(ours[rank]["steps"], theirs[rank]["steps"], strict=True):
            assert a == pytest.approx(b, rel=1e-5) and na == pytest.approx(nb, rel=1e-5), (ours, theirs)
        assert ours[rank]["tied"] and theirs[rank]["tied"]
    assert "ODCLlamaForCausalLM" in ours[0]["classes"] and "ODCLlamaDecoderLayer" in ours[0]["classes"]
    assert ours[0]["steps"][-1][0] < ours[0]["steps"][0][0]  # it trains
