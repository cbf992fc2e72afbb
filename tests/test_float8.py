"""Issue 35: float8 training through torchao ([float8] in odcfsdp/sharding/groups/float8.py).

Without torchao only the refusals run (CPU, an old GPU, no torchao: one line naming the fix, before any rank starts);
with it, the conversion's choice of layers and a float8 model trained under ODCShard on 2 CPU ranks against the same
float8 model in one plain process. Float8 numerics on a GPU against torchao + FSDP2: ``test_float8_gpu.py``.
"""

from __future__ import annotations

import dataclasses
import types
from unittest import mock

import pytest
import torch
import torch.nn as nn

from odcfsdp.app import preflight
from odcfsdp.app.config import config_from, validate
from odcfsdp.sharding.groups import float8
from odcfsdp.sharding.groups.float8 import convert_float8_linears, float8_problem
from warm_cli import cli

#: every dim a multiple of 16, so every linear but the head is converted
def _cpu_takes_rowwise_scales() -> bool:
    """Whether this torch's CPU ``_scaled_mm`` takes rowwise scales (torch 2.11's takes per-tensor ones only)."""
    a = torch.zeros(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


ROWWISE_ON_CPU = _cpu_takes_rowwise_scales()
CONFIG = dict(vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128)


# -- refusals: need no torchao --------------------------------------------------------------------------------------
def test_float8_problem_names_what_is_missing_and_the_fix(monkeypatch):
    assert "and this run is on cpu" in float8_problem("cpu")
    assert "this GPU's is 8.0" in float8_problem("cuda", (8, 0))  # A100: no float8 matmul
    monkeypatch.setattr(float8, "torchao_installed", lambda: False)
    assert float8_problem("cuda", (9, 0)).endswith("torchao, which is not installed: pip install odcfsdp[fp8]")
    monkeypatch.setattr(float8, "torchao_installed", lambda: True)
    assert float8_problem("cuda", (8, 9)) is None and float8_problem("cuda", (9, 0)) is None


def test_odcshard_refuses_float8_on_cpu_and_unknown_recipes_in_one_line():
    from odcfsdp import ODCShard

    with pytest.raises(RuntimeError, match=r"^float8 training needs a GPU of compute capability 8\.9") as e:
        ODCShard(nn.Linear(16, 16), float8="tensorwise")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"float8='fp8' is not a recipe; choose one of \('tensorwise', 'rowwise'\)"):
        ODCShard(nn.Linear(16, 16), float8="fp8")


def test_config_key_choices_and_none():
    with pytest.raises(ValueError, match=r"shard.float8='fp8' is not allowed"):
        validate(config_from({"shard": {"float8": "fp8"}}))
    from odcfsdp.app.shard_config import CONVERSIONS

    assert CONVERSIONS["float8"].to_argument("none", None) is None
    assert CONVERSIONS["float8"].to_argument("rowwise", None) == "rowwise"


def test_the_cli_refuses_float8_on_cpu_in_one_line_before_ranks_start(tmp_path):
    proc = cli("shard.float8=tensorwise", "run.device=cpu", f"run.out_dir={tmp_path / 'run'}", cwd=tmp_path,
               timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: shard.float8=tensorwise: float8 training needs a GPU of compute capability "
                               "8.9 or more"), proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("capability, have_torchao, message", [
    ((8, 0), True, "shard.float8=rowwise: float8 training needs a GPU of compute capability 8.9 or more (H100, "
                   "H200, L40S, RTX 4090); this GPU's is 8.0"),
    ((9, 0), False, "shard.float8=rowwise: float8 training needs torchao, which is not installed: "
                    "pip install odcfsdp[fp8]"),
    (None, False, "shard.float8=rowwise: float8 training needs torchao, which is not installed"),  # nvidia-smi silent
])
def test_preflight_refuses_an_old_gpu_or_no_torchao(monkeypatch, capability, have_torchao, message):
    """The launcher reads the GPU's capability from nvidia-smi (no CUDA context before the ranks): faked here."""
    monkeypatch.setattr(preflight, "_gpu_capability", lambda: capability)
    monkeypatch.setattr(float8, "torchao_installed", lambda: have_torchao)
    cfg = config_from({"shard": {"float8": "rowwise"}})
    with pytest.raises(ValueError) as e:
        preflight._float8(cfg, cuda=True)
    assert str(e.value).startswith(message)
    monkeypatch.setattr(float8, "torchao_installed", lambda: True)
    preflight._float8(cfg, cuda=True) if capability != (8, 0) else None  # accepted once torchao is there


# -- with torchao -----------------------------------------------------------------------------------------------
class Mixed(nn.Module):
    """Linears of every kind the filter decides on."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(32, 64)          # converted
        self.odd = nn.Linear(64, 24)         # out_features not a multiple of 16: kept
        self.narrow = nn.Linear(24, 32)      # in_features not a multiple of 16: kept
        self.block = nn.Sequential(nn.Linear(32, 32, bias=False))  # converted (a nested name)
        self.output = nn.Linear(32, 16)      # the head (torchtitan's name): kept
        self.lm_head = nn.Linear(32, 16)     # the head (Hugging Face's name): kept


def test_conversion_takes_the_linears_torchtitan_takes_and_keeps_the_parameters():
    pytest.importorskip("torchao")
    from torchao.float8.float8_linear import Float8Linear

    model = Mixed()
    before = {n: p for n, p in model.named_parameters()}
    assert convert_float8_linears(model, "tensorwise") == ["up", "block.0"]
    kinds = {n: type(m) for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert [n for n, k in kinds.items() if k is Float8Linear] == ["up", "block.0"]
    assert all(kinds[n] is nn.Linear for n in ("odd", "narrow", "output", "lm_head"))
    assert all(p is before[n] for n, p in model.named_parameters())  # ODCShard plans these very parameters
    assert model.up.config.cast_config_weight.scaling_granularity.value == "tensorwise"
    rowwise = Mixed()
    convert_float8_linears(rowwise, "rowwise")
    assert rowwise.up.config.cast_config_weight.scaling_granularity.value == "axiswise"


def _float8_llama(recipe: str | None):
    from odcfsdp.models import Llama, LlamaConfig

    torch.manual_seed(0)
    model = Llama(LlamaConfig(**CONFIG))
    if recipe:
        convert_float8_linears(model, recipe)
    return model


def _batches(ranks: int, steps: int = 3):
    g = torch.Generator().manual_seed(1)
    return [[torch.randint(0, CONFIG["vocab_size"], (2, 17), generator=g) for _ in range(ranks)] for _ in range(steps)]


def _train(model, batches, tokens) -> list[float]:
    from odcfsdp.models import causal_lm_loss

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    losses = []
    for step in batches:
        total = 0.0
        for seq in step:
            loss = causal_lm_loss(model(seq[:, :-1]), seq[:, 1:], tokens)
            loss.backward()
            total += loss.item()
        losses.append(total)
        opt.step()
        opt.zero_grad()
    return losses


def _sharded_float8_rank(recipe: str, batches, tokens) -> list[float]:
    """One rank: ``ODCShard(float8=recipe)`` of the Llama, trained on this rank's micro-batch of each step. The GPU
    check is lifted (torchao's float8 matmul runs on CPU, slowly): the conversion under test is ODCShard's own."""
    import torch.distributed as dist

    from odcfsdp import ODCShard

    with mock.patch.object(float8, "float8_problem", return_value=None):
        # rows in the compute dtype, cast by each layer (the float8 gather, the default: tests/test_float8_gather.py)
        model = ODCShard(_float8_llama(None), float8=recipe, comm="shm", float8_gather=False)
    model.set_gradient_divide_factor(1.0)
    assert len(model.float8_linears) == 2 * 7  # q, k, v, o, gate, up, down per layer; not the head
    rank = dist.get_rank()
    local = _train(model, [[step[rank]] for step in batches], tokens)
    model.close()
    return local


@pytest.mark.parametrize("recipe", ["tensorwise", pytest.param("rowwise", marks=pytest.mark.skipif(
    not ROWWISE_ON_CPU, reason="this torch's CPU _scaled_mm takes per-tensor scales only"))])
def test_a_float8_model_trains_alike_sharded_on_two_ranks_and_in_one_process(recipe):
    """The same float8 model, its micro-batches split over 2 ranks, against one plain process on both; and far
    from the same model without float8 (so float8 is what runs)."""
    pytest.importorskip("torchao")
    from odcfsdp.launch import spawn

    batches = _batches(2)
    tokens = 2 * 16 * 2
    reference = _train(_float8_llama(recipe), batches, tokens)
    plain = _train(_float8_llama(None), batches, tokens)
    per_rank = spawn(_sharded_float8_rank, 2, recipe, batches, tokens, timeout=300)
    sharded = [a + b for a, b in zip(*per_rank)]
    gap = max(abs(a - b) / abs(b) for a, b in zip(sharded, reference))
    float8_effect = max(abs(a - b) / abs(b) for a, b in zip(plain, reference))
    # fp32 rows gathered whole: every micro-batch's float8 casts see the reference's weights (0.0 measured); float8
    # itself moves the losses by 5e-4 (tensorwise) and 9e-4 (rowwise) over the 3 steps
    assert gap < 1e-6 and float8_effect > 1e-4, (sharded, reference, plain)


def test_the_float8_settings_reach_odcshard_from_the_config():
    from odcfsdp.app.shard_config import shard_arguments

    built = types.SimpleNamespace(model=nn.Linear(2, 2))
    cfg = config_from({"shard": {"float8": "tensorwise"}})
    assert shard_arguments(cfg.shard, built)["float8"] == "tensorwise"
    assert shard_arguments(config_from({"shard": {"float8": "none"}}).shard, built)["float8"] is None
    assert [f.name for f in dataclasses.fields(type(cfg.shard))][-3:] == ["float8", "float8_gather", "replicas"]
    assert shard_arguments(config_from({"shard": {"float8": "tensorwise", "float8_gather": True}}).shard,
                           built)["float8_gather"] is True


def test_fp8_bench(tmp_path):
    """benchmarks/fp8_bench.py's CPU smoke run (fp32 on CPU): every method trains; odcfsdp's tensorwise float8, with
    bf16 rows gathered or float8 ones, equals torchao + FSDP2 float8 (the same float8 casts of the same fp32 weights)
    to the bit, while the model without float8
    and the rowwise recipe do not; the result is the one schema."""
    pytest.importorskip("torchao")
    from benchmarks import fp8_bench, harness

    methods = [m for m in fp8_bench.METHODS if ROWWISE_ON_CPU or "rowwise" not in m]
    data = fp8_bench.main(["--cpu", "--layers", "2", "--steps", "4", "--warmup", "1", "--out", str(tmp_path),
                           "--methods", *methods])
    rows = {r["method"]: r for r in data["rows"]}
    assert list(rows) == methods
    assert all(r["tokens_per_s"] > 0 and len(r["losses"]) == 4 for r in rows.values())
    assert rows["odc_float8_tensorwise"]["losses"] == rows["fsdp2_float8"]["losses"]
    assert rows["odc_float8_tensorwise"]["loss_rel_gap_max"] == 0.0
    assert rows["odc_float8_gather"]["losses"] == rows["fsdp2_float8"]["losses"]  # the owner's cast: the same bytes
    assert rows["odc_bf16"]["loss_rel_gap_max"] > 1e-5
    assert not ROWWISE_ON_CPU or rows["odc_float8_rowwise"]["loss_rel_gap_max"] > 1e-5
    assert rows["odc_bf16"]["losses"][-1] < rows["odc_bf16"]["losses"][0]  # it learns
    assert harness.load_result(tmp_path / "fp8_bench.json") == data and set(data) == {"meta", "rows"}
    assert "| odc_float8_tensorwise |" in (tmp_path / "fp8_bench.md").read_text()
