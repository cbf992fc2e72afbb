"""TRL's ``SFTTrainer`` on odcfsdp (issue 42, item 6): the one documented call, ``odcfsdp.patch_fsdp2()`` before the
trainer is built, makes accelerate's FSDP2 plugin (``fsdp_version=2``) shard with odcfsdp's ``fully_shard``; 5 steps
of ``SFTTrainer`` on a tiny Hugging Face Llama then log the same per-step losses (rtol 1e-5) and gradient norms as
with torch's ``fully_shard``, each run in processes of its own (``torchrun --nproc-per-node=2`` on the script below).

* ``test_sft_trainer_on_two_gpus_matches_torchs_fsdp2`` (marked ``gpu``; gpu_suite section ``trl``): on 2 GPUs,
  accelerate's real FSDP2 path, twice: TRL's defaults (its gradient checkpointing on, the model built on the host and
  moved to the GPU by ``fully_shard``), and ``cpu_ram_efficient_loading`` (a meta-device model filled from rank 0's
  weights) with checkpointing off. Ready, not yet run on GPUs.
* ``test_sft_trainer_on_two_cpu_ranks_matches_torchs_fsdp2``: the same script on 2 CPU ranks (gloo). accelerate takes
  its FSDP2 path only on GPUs (a CPU run gets DDP), so ``--cpu-standin`` makes ``AcceleratorState`` FSDP when given a
  plugin on CPU ranks, as it does on GPU ranks (``accelerate/state.py``); the trainer, ``Accelerator.prepare``'s FSDP2
  preparation, the optimizer's switch to the sharded parameters, ``no_sync``, clipping and logging are TRL's,
  transformers' and accelerate's own code.

Nothing is downloaded (the GPU host has no network): the tokenizer is ``hf_fixtures``' BPE trained here, the model is
built from a config, and the dataset is ``datasets.Dataset.from_list`` of text rows. Needs ``trl`` and ``datasets``
(``pip install "odcfsdp[trl]"``); skipped without them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
STEPS = 5

#: One rank of the run (torchrun starts 2): writes its per-step losses, its gradient norms and what it built to
#: ``--out/rank<r>.json``.
SCRIPT = r'''
import argparse
import json
import os
import sys

p = argparse.ArgumentParser()
p.add_argument("--impl", choices=["torch", "odc"], required=True)
p.add_argument("--tokenizer", required=True)
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--gradient-checkpointing", action="store_true")  # TRL's default (SFTConfig: True)
p.add_argument("--ram-efficient-loading", action="store_true")  # meta-device model, rank 0's weights broadcast
p.add_argument("--untied", action="store_true")  # an output head of its own (the test's default: tied to the embedding)
p.add_argument("--cpu-standin", action="store_true")  # CPU ranks: AcceleratorState made FSDP, as on GPU ranks
a = p.parse_args()
with open(os.path.join(a.out, f"pid{os.environ['RANK']}"), "w") as f:  # the test stops a rank left by a timeout
    f.write(str(os.getpid()))

if a.impl == "odc":
    import odcfsdp

    odcfsdp.patch_fsdp2()  # the one documented call: before the trainer is built

import accelerate
import datasets
import torch
import torch.distributed as dist
import transformers
import trl
from torch.distributed.fsdp import FSDPModule

if a.cpu_standin:
    # On GPU ranks AcceleratorState.__init__ turns MULTI_GPU into FSDP when given a plugin, and writes that back into
    # PartialState's shared state (later AcceleratorState() calls copy it from there); on CPU ranks it keeps MULTI_CPU
    # (and accelerate would build DDP). Do on CPU ranks what it does on GPU ranks, nothing else.
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    _init = AcceleratorState.__init__

    def _fsdp_on_cpu(self, *args, fsdp_plugin=None, **kwargs):
        _init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    AcceleratorState.__init__ = _fsdp_on_cpu

tok = transformers.AutoTokenizer.from_pretrained(a.tokenizer)
torch.manual_seed(0)
# eager attention: fp32 SDPA on GPUs takes the memory-efficient kernel, whose backward is not deterministic, and the
# two runs are compared to 1e-5
config = transformers.LlamaConfig(vocab_size=288, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                  pad_token_id=tok.pad_token_id, tie_word_embeddings=not a.untied,
                                  attn_implementation="eager")
model = transformers.LlamaForCausalLM(config)
g = torch.Generator().manual_seed(1)
rows = []
for i in range(64):
    x, y = (int(v) for v in torch.randint(0, 50, (2,), generator=g))
    rows.append({"text": f"what is {x} plus {y}? {x} plus {y} is {x + y}." + " and times two?" * (i % 3)})
dataset = datasets.Dataset.from_list(rows)
args = trl.SFTConfig(
    output_dir=os.path.join(a.out, "trainer"), fsdp="full_shard",
    fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                 "reshard_after_forward": True, "cpu_ram_efficient_loading": a.ram_efficient_loading},
    max_steps=a.steps, per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=1e-3, seed=0,
    data_seed=0, logging_steps=1, report_to=[], bf16=False, fp16=False, eval_strategy="no", save_strategy="no",
    max_length=64, disable_tqdm=True, dataloader_num_workers=0,
    gradient_checkpointing=a.gradient_checkpointing, use_cpu=a.cpu_standin)
trainer = trl.SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tok)
trainer.train()

model = trainer.model
rank = dist.get_rank()
history = trainer.state.log_history
result = {
    "rank": rank,
    "fsdp_version": trainer.accelerator.state.fsdp_plugin.fsdp_version,
    "is_fsdp2": bool(trainer.accelerator.is_fsdp2),
    "losses": [e["loss"] for e in history if "loss" in e],
    "grad_norms": [float(e["grad_norm"]) for e in history if "grad_norm" in e],
    "classes": sorted({type(m).__name__ for m in model.modules() if type(m).__name__.startswith(("FSDP", "ODC"))}),
    "fsdp_modules": sum(isinstance(m, FSDPModule) for m in model.modules()),
    "device": str(next(model.parameters()).device),
    "optim": str(trainer.args.optim),
    "versions": {m.__name__: m.__version__ for m in (torch, transformers, accelerate, trl, datasets)},
}
if a.impl == "odc":
    result["odc_modules"] = sum(isinstance(m, odcfsdp.ODCModule) for m in model.modules())
    result["sharded"] = type(odcfsdp.sharded(model)).__name__
with open(os.path.join(a.out, f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
dist.barrier()
sys.stdout.flush()
sys.stderr.flush()
# no interpreter teardown: there a CPU rank of torch's FSDP2 run aborted now and then ("terminate called without an
# active exception", SIGABRT: 1 of 12 runs), after its results were written
os._exit(0)
'''


def _needs_trl():
    pytest.importorskip("trl", reason="needs trl (pip install 'odcfsdp[trl]')")
    pytest.importorskip("datasets", reason="needs datasets (pip install 'odcfsdp[trl]')")
    pytest.importorskip("accelerate", reason="needs accelerate (pip install 'odcfsdp[trl]')")


def _tokenizer(tmp_path: Path) -> Path:
    from hf_fixtures import save_tokenizer

    out = tmp_path / "tokenizer"
    save_tokenizer(out)
    return out


def _stop(proc: subprocess.Popen, out: Path) -> None:
    """Stop a run past its time: SIGTERM to the agent (it stops its ranks), SIGKILL to its session after 30 s, then
    to every rank still running (torchrun starts each rank in a session of its own)."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    for pid_file in out.glob("pid*"):
        pid = int(pid_file.read_text())
        try:
            if "sft_rank.py" in Path(f"/proc/{pid}/cmdline").read_text():
                os.kill(pid, signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError):
            pass


def _torchrun(tmp_path: Path, impl: str, *flags: str, timeout: float, env: dict | None = None
              ) -> tuple[list[dict], str]:
    """Run the script on 2 ranks (``torchrun --standalone``, its output to a file), with ``env`` added to the
    environment; return the ranks' results and the run's output. Fails with the output's tail when the run fails,
    leaves a rank's result unwritten or runs past ``timeout`` (then its agent and ranks are stopped, ``_stop``)."""
    script = tmp_path / "sft_rank.py"
    if not script.exists():
        script.write_text(SCRIPT)
    out = tmp_path / impl
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script),
           "--impl", impl, "--tokenizer", str(tmp_path / "tokenizer"), "--out", str(out), "--steps", str(STEPS),
           *flags]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {}),
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    log = out / "torchrun.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
                                start_new_session=True)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(proc, out)
        pytest.fail(f"{impl}: torchrun did not finish in {timeout:.0f} s ({' '.join(cmd)}); its output:\n"
                    f"{log.read_text(errors='replace')[-15000:]}")
    output = log.read_text(errors="replace")
    files = [out / f"rank{r}.json" for r in range(2)]
    if proc.returncode != 0 or not all(f.exists() for f in files):
        pytest.fail(f"{impl}: torchrun exited with {proc.returncode} ({' '.join(cmd)}), results written: "
                    f"{[f.name for f in files if f.exists()]}; its output:\n{output[-15000:]}")
    return [json.loads(f.read_text()) for f in files], output


def _record(name: str, ours: list[dict], theirs: list[dict]) -> None:
    """The measured relative gaps, appended to $ODC_RESULTS (JSON lines) when it is set, as test_gpu.py's."""
    path = os.environ.get("ODC_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({
                "test": name,
                "loss_rel_by_step": [abs(a - b) / abs(b) for a, b in zip(ours[0]["losses"], theirs[0]["losses"])],
                "norm_rel_by_step": [abs(a - b) / abs(b)
                                     for a, b in zip(ours[0]["grad_norms"], theirs[0]["grad_norms"])],
                "losses": {"odc": ours[0]["losses"], "torch": theirs[0]["losses"]},
                "grad_norms": {"odc": ours[0]["grad_norms"], "torch": theirs[0]["grad_norms"]},
                "versions": ours[0]["versions"]}) + "\n")


def _compare(ours: list[dict], theirs: list[dict], device: str) -> None:
    """Both runs took accelerate's FSDP2 path; ours sharded with odcfsdp's modules only, theirs with torch's; the 5
    per-step losses (and gradient norms) logged by the trainer are equal to rtol 1e-5 on every rank; the model
    trains."""
    for run, prefix, other in ((ours, "ODC", "FSDP"), (theirs, "FSDP", "ODC")):
        for r in run:
            assert r["fsdp_version"] == 2 and r["is_fsdp2"], r
            assert len(r["losses"]) == STEPS and len(r["grad_norms"]) == STEPS, r
            assert r["device"].startswith(device), r
            assert f"{prefix}LlamaDecoderLayer" in r["classes"] and f"{prefix}LlamaForCausalLM" in r["classes"], r
            assert not any(c.startswith(other) for c in r["classes"]), r
        # the logged loss is the mean over the ranks: every rank logs the same
        assert run[0]["losses"] == pytest.approx(run[1]["losses"], rel=1e-6), run
    for o, t in zip(ours, theirs, strict=True):
        # the same units as accelerate made with torch's (the 2 blocks, the embedding and the tail, the root),
        # every one of them odcfsdp's
        assert o["odc_modules"] == o["fsdp_modules"] == t["fsdp_modules"], (o, t)
        assert o["sharded"] == "FullyShardedView", o
        for step, (a, b) in enumerate(zip(o["losses"], t["losses"], strict=True)):
            assert a == pytest.approx(b, rel=1e-5), (step, o["losses"], t["losses"])
        for step, (a, b) in enumerate(zip(o["grad_norms"], t["grad_norms"], strict=True)):
            assert a == pytest.approx(b, rel=1e-5), (step, o["grad_norms"], t["grad_norms"])
    assert ours[0]["losses"][-1] < ours[0]["losses"][0], ours[0]["losses"]  # it trains


GPU_CASES = {
    "trl_defaults": ["--gradient-checkpointing"],
    "ram_efficient_loading": ["--ram-efficient-loading"],
}


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.timeout(420)
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_sft_trainer_on_two_gpus_matches_torchs_fsdp2(tmp_path, case):
    """On 2 GPUs (NCCL; odcfsdp over nvshmem): SFTTrainer with accelerate's FSDP2 plugin, 5 steps in fp32 with
    gradient accumulation (2 micro-batches: accelerate's no_sync), clipping and the trainer's default optimizer,
    after ``odcfsdp.patch_fsdp2()`` and with torch's ``fully_shard``: per-step losses and gradient norms equal to
    rtol 1e-5. Ready, not yet run on GPUs (gpu_suite section ``trl``)."""
    _needs_trl()
    _tokenizer(tmp_path)
    ours, out_ours = _torchrun(tmp_path, "odc", *GPU_CASES[case], timeout=180)
    theirs, out_theirs = _torchrun(tmp_path, "torch", *GPU_CASES[case], timeout=180)
    print(f"odc: {ours[0]['losses']}\ntorch: {theirs[0]['losses']}\nversions: {ours[0]['versions']}\n"
          f"--- odc run's output (tail) ---\n{out_ours[-3000:]}\n--- torch run's output (tail) ---\n{out_theirs[-3000:]}")
    _record(f"trl_sft_{case}", ours, theirs)
    _compare(ours, theirs, "cuda")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("head", ["tied", "untied"])
def test_sft_trainer_on_two_cpu_ranks_matches_torchs_fsdp2(tmp_path, head):
    """The GPU test's script on 2 CPU ranks (gloo), accelerate's FSDP2 state stood in (``--cpu-standin``), TRL's
    defaults (gradient checkpointing on): after ``odcfsdp.patch_fsdp2()`` the trainer shards with odcfsdp's modules
    and logs torch's ``fully_shard``'s losses and gradient norms, to rtol 1e-5, for 5 steps, with the output head
    tied and untied (TRL's fused head reads an untied ``lm_head.weight`` outside its module: its gradient was lost
    until ``prepare_grad`` kept gradients that arrive before their group's buffer, [grad-buffers])."""
    _needs_trl()
    _tokenizer(tmp_path)
    cpu = {"CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}  # CPU ranks on a GPU host too (gpu_suite's trl)
    flags = ["--cpu-standin", "--gradient-checkpointing", *(["--untied"] if head == "untied" else [])]
    ours, _ = _torchrun(tmp_path, "odc", *flags, timeout=150, env=cpu)
    theirs, _ = _torchrun(tmp_path, "torch", *flags, timeout=150, env=cpu)
    _compare(ours, theirs, "cpu")
