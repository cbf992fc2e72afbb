"""API misuse never crashes the process: each case runs in a process of its own (``run_script``) with bounded time,
which must exit 0 (the script asserts what it saw), never by a signal. Before DTensor parameters, reading a
parameter outside forward, ``model.module.double()`` or wrapping in DDP ended the interpreter with a segmentation
fault."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest
from warm_cli import run_script

PRELUDE = """
import torch, torch.nn as nn, torch.distributed as dist
from odcfsdp import ODCShard
from odcfsdp.launch import spawn
from odcfsdp.models import Llama, LlamaConfig, causal_lm_loss

def llama():
    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2))

def expect(error, match, fn):
    try:
        fn()
    except error as e:
        assert match in str(e), f"{type(e).__name__}: {e}"
        return
    raise AssertionError(f"no {error.__name__} raised")
"""

READ_OUTSIDE_FORWARD = """
def body():
    model = ODCShard(llama(), 4096)
    x = torch.randint(0, 64, (2, 8))
    causal_lm_loss(model(x), x).backward()
    for p in model.parameters():
        text = repr(p) + str(p)
        p.norm().full_tensor() if isinstance(p, torch.distributed.tensor.DTensor) else p.norm()
    w = model.module.lm_head.weight
    total = w.sum()
    total = total.full_tensor() if hasattr(total, "full_tensor") else total
    assert torch.isfinite(total)
    assert w.to(torch.float64).dtype == torch.float64 and w.float().shape == (64, 32)
    text = repr(model)
    return True
"""


def run_case(tmp_path: Path, script: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """Run ``script`` (after ``PRELUDE``) as a file (spawned ranks re-import it); its exit must be clean."""
    path = tmp_path / "case.py"
    path.write_text(textwrap.dedent(PRELUDE) + textwrap.dedent(script))
    proc = run_script(path, cwd=tmp_path, timeout=timeout)
    assert proc.returncode >= 0, f"killed by signal {-proc.returncode}:\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_reading_parameters_outside_forward_one_process(tmp_path):
    run_case(tmp_path, READ_OUTSIDE_FORWARD + "\nbody()\n")


def test_reading_parameters_outside_forward_two_ranks(tmp_path):
    run_case(tmp_path, READ_OUTSIDE_FORWARD + "\nif __name__ == '__main__':\n    assert spawn(body, 2) == [True, True]\n")


def test_moving_or_casting_the_inner_module_is_refused(tmp_path):
    run_case(tmp_path, """
    model = ODCShard(llama(), 4096)
    for move in (lambda: model.module.double(), lambda: model.module.to(torch.float16), lambda: model.module.cpu(),
                 lambda: model.module.layers[0].half(), lambda: model.double()):
        expect(RuntimeError, "move or cast the model before wrapping it", move)
    x = torch.randint(0, 64, (1, 4))
    assert model(x).dtype == torch.float32  # still intact
    """)


WRAP_IN_DDP = """
def body():
    from torch.nn.parallel import DistributedDataParallel
    model = ODCShard(nn.Linear(4, 4))
    expect(TypeError, "cannot be wrapped in DistributedDataParallel", lambda: DistributedDataParallel(model))
    try:
        from accelerate import Accelerator
    except ImportError:
        return "no accelerate"
    accelerator = Accelerator(cpu=True)
    assert accelerator.num_processes == 2
    expect(TypeError, "cannot be wrapped in DistributedDataParallel", lambda: accelerator.prepare(model))
    return "refused"

if __name__ == "__main__":
    print(spawn(body, 2))
"""


def test_wrapping_in_ddp_or_accelerate_is_refused(tmp_path):
    pytest.importorskip("accelerate", reason="the Accelerate case needs accelerate (test extra)")
    proc = run_case(tmp_path, WRAP_IN_DDP)
    assert "['refused', 'refused']" in proc.stdout, proc.stdout


def test_wrapping_a_model_twice_is_refused_at_the_second_call(tmp_path):
    """Issue 34: the second ODCShard over the same model (or a part of it) is refused where it is made, saying the
    model is wrapped already; before, both were accepted and both failed at their first forward. The first wrapper
    trains on, equal to the plain model's gradients."""
    run_case(tmp_path, """
    inner = llama()
    plain = llama()
    model = ODCShard(inner, 4096)
    expect(ValueError, "the model is wrapped already: parameter", lambda: ODCShard(inner, 4096))
    expect(ValueError, "is an ODCShard's shard; wrap a model once", lambda: ODCShard(inner.layers[0], 4096))
    x = torch.randint(0, 64, (2, 8))
    causal_lm_loss(model(x), x).backward()
    causal_lm_loss(plain(x), x).backward()
    got = dict(model.named_parameters())["lm_head.weight"].grad
    torch.testing.assert_close(got, plain.lm_head.weight.grad)
    """)


def test_a_closed_model_fails_cleanly(tmp_path):
    run_case(tmp_path, """
    model = ODCShard(llama(), 4096)
    inner = model.module
    model.close()
    x = torch.randint(0, 64, (1, 4))
    expect(RuntimeError, "was closed", lambda: model(x))
    expect(Exception, "meta", lambda: inner(x))  # the released parameters are meta tensors, not freed memory
    text = repr(inner.lm_head.weight)
    """)


PARENT_READS_CHILD = """
class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x):  # reads proj.weight without calling proj: ODCShard has not gathered it here
        return self.out(x @ self.proj.weight)

def body():
    torch.manual_seed(0)
    model = ODCShard(Head())
    x = torch.randn(3, 4)
    try:
        model(x).sum().backward()
    except RuntimeError as e:
        return str(e)
    return "no error"
"""


def test_a_parameter_used_outside_its_module_is_an_error(tmp_path):
    """In a single process the shard has the full shape, so the forward runs; the gradient that reaches the shard
    is refused at backward. On two ranks the DTensor shard cannot mix with plain tensors: refused at forward."""
    proc = run_case(tmp_path, PARENT_READS_CHILD + "\nprint(body())\n")
    assert "'proj.weight' got a gradient while sharded" in proc.stdout
    proc = run_case(tmp_path, PARENT_READS_CHILD + "\nif __name__ == '__main__':\n    print(spawn(body, 2))\n")
    assert proc.stdout.count("DTensor") >= 2, proc.stdout


@pytest.mark.parametrize("world", [1, 2])
def test_changing_parameters_outside_a_step_is_refused_not_silent(tmp_path, world):
    run_case(tmp_path, f"""
    def body():
        model = ODCShard(llama(), 4096)
        with torch.no_grad():
            model.module.embed_tokens.weight.mul_(2.0)  # every rank's shard has rows of it
        x = torch.randint(0, 64, (1, 4))
        expect(RuntimeError, "changed in place outside an optimizer step", lambda: model(x))
        return True

    if __name__ == "__main__":
        assert (spawn(body, {world}) if {world} > 1 else [body()]) == [True] * {world}
    """)


def test_hsdp_misuse_is_refused(tmp_path):
    """Reading gradients then running forward without a step is refused under HSDP even with one rank per shard
    group and the collective transport (the replicas' sum already happened); a 2-D mesh not laid out
    (replicate, shard) over ranks in order is refused."""
    run_case(tmp_path, """
    from torch.distributed.device_mesh import DeviceMesh
    from odcfsdp.sharding.placement.hsdp import hybrid_mesh

    def body():
        model = ODCShard(llama(), 4096, comm="collective", mesh=hybrid_mesh(2, "cpu"))  # 2 x 1
        x = torch.randint(0, 64, (2, 6))
        model(x).sum().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the replicas' gradients are summed here
        expect(RuntimeError, "or with HSDP replicas (summed at that read)", lambda: model(x).sum().backward())
        model.close()
        expect(ValueError, "a 2-D mesh must be (replicate, shard) over ranks 0..1 in order",
               lambda: ODCShard(llama(), 4096, mesh=DeviceMesh("cpu", [[1, 0]], mesh_dim_names=("replicate", "shard"))))
        return True

    if __name__ == "__main__":
        assert spawn(body, 2) == [True, True]
    """)


def test_lengths_that_do_not_reach_the_attention_are_an_error(tmp_path):
    """A family whose layers do not hand keyword arguments to the attention (stablelm) is not on the list; forced
    onto it, the lengths' absence is an error, never one long document."""
    pytest.importorskip("transformers", reason="the HF model path needs transformers (test extra)")
    run_case(tmp_path, """
    import transformers
    import odcfsdp.models.hf_attention as hf_attention
    from odcfsdp.models.hf import HFCausalLM

    hf_attention.DOCUMENT_ATTENTION_MODEL_TYPES = {"stablelm"}  # forced onto the list
    transformers.AutoConfig.for_model("stablelm", vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256).save_pretrained("stablelm")
    model = HFCausalLM("stablelm")
    tokens, positions = torch.randint(0, 64, (1, 13)), torch.cat([torch.arange(5), torch.arange(8)])[None]
    expect(RuntimeError, "odc_doc_lengths did not reach the attention of StableLmAttention",
           lambda: model(tokens, positions, doc_lengths=[5, 8]))
    """)


def test_memory_policies_given_wrongly_are_refused(tmp_path):
    """FSDP2's policy objects: a conflicting param_dtype, a wrong type, and offload with gathered masters are errors
    that name the fix; FSDP2's plain OffloadPolicy() means no offload."""
    run_case(tmp_path, """
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
expect(ValueError, "param_dtype=torch.float16 and mp_policy.param_dtype=torch.bfloat16 differ",
       lambda: ODCShard(nn.Linear(4, 4), param_dtype=torch.float16,
                        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)))
expect(TypeError, "MixedPrecisionPolicy", lambda: ODCShard(nn.Linear(4, 4), mp_policy={"reduce_dtype": torch.bfloat16}))
expect(ValueError, "choose one",
       lambda: ODCShard(nn.Linear(4, 4), gather_masters=True, offload_policy=CPUOffloadPolicy()))
expect(TypeError, "OffloadPolicy", lambda: ODCShard(nn.Linear(4, 4), offload_policy="cpu"))
model = ODCShard(nn.Linear(4, 4), offload_policy=OffloadPolicy())  # FSDP2's "no offload"
assert all(not g.offloaded for g in model.groups)
model.close()
""")


def test_a_forgotten_end_minibatch_is_refused_on_every_rank(tmp_path):
    """With implicit events off, ``finish_minibatch()`` without ``end_minibatch()`` raises alike on a rank that ran
    micro-batches and on one that ran none: no rank goes on to a meeting its peer never reaches (the run ends
    cleanly within the bound, never by a hang)."""
    run_case(tmp_path, """
    def body():
        model = ODCShard(llama(), 4096, comm="shm")
        model.set_implicit_minibatch(False)
        if dist.get_rank() == 0:
            x = torch.randint(0, 64, (1, 4))
            causal_lm_loss(model(x), x).backward()
        expect(RuntimeError, "before this minibatch's gradients were synced", model.finish_minibatch)
        model.end_minibatch()  # both ranks still meet afterwards: the refusal left them in step
        model.finish_minibatch()
        model.close()
        return True

    if __name__ == "__main__":
        assert spawn(body, 2, timeout=120) == [True, True]
    """)


def test_a_write_through_data_with_split_masters_raises_at_the_next_sync(tmp_path):
    """``split_masters=True`` ([split-masters]): a write through ``.data`` between steps, which the version counters
    miss, leaves a row that is not its master's rounding; the next step's sync raises, naming the fix, instead of
    losing the write silently."""
    run_case(tmp_path, """
    model = ODCShard(llama(), 4096, param_dtype=torch.bfloat16, split_masters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 64, (2, 16))

    def step():
        causal_lm_loss(model(tokens), tokens).backward()
        opt.step()
        opt.zero_grad()

    step()
    next(model.parameters()).data.add_(1.0)  # unseen by the version counters
    expect(RuntimeError, "changing_parameters", step)
    """)
