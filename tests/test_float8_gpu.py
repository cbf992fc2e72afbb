"""Issue 35's numerics on one GPU: odcfsdp's float8 (torchao's Float8Linear under ODCShard) against torchao + FSDP2
float8 over 200 steps, and its gap to bf16 (benchmarks/fp8_bench.py's training, a 2-layer model that fits one GPU).

Marked ``gpu``; runs only on a GPU of compute capability 8.9+ with torchao installed. Measured values are appended
as JSON lines to ``$ODC_RESULTS`` when it is set, as test_gpu.py's are.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                       reason="float8 needs a GPU of compute capability 8.9+"),
]

#: dims multiples of 16 (every layer's linears are converted), small enough for 200 compiled steps in ~2 minutes
SHAPE = ["--layers", "2", "--dim", "1024", "--ffn", "2816", "--heads", "8", "--kv-heads", "4", "--vocab", "4096",
         "--batch", "4", "--seq", "1024", "--lr", "1e-4"]


def test_float8_tracks_torchao_fsdp2_float8_within_1pct_over_200_steps(tmp_path):
    """Every step's loss within 1% of torchao + FSDP2 float8 at the same step (the issue's bar), bf16 parameters for
    both; and float8's final loss within 3% of bf16's (torchao reports float8 loss curves that track bf16's)."""
    pytest.importorskip("torchao")
    from benchmarks import fp8_bench

    data = fp8_bench.main([*SHAPE, "--steps", "200", "--warmup", "5", "--out", str(tmp_path),
                           "--methods", "odc_bf16", "odc_float8_tensorwise", "fsdp2_float8"])
    rows = {r["method"]: r for r in data["rows"]}
    f8, bf16 = rows["odc_float8_tensorwise"], rows["odc_bf16"]
    gap_to_bf16 = abs(f8["final_loss"] - bf16["final_loss"]) / bf16["final_loss"]
    if os.environ.get("ODC_RESULTS"):
        with open(os.environ["ODC_RESULTS"], "a") as f:
            f.write(json.dumps({"test": "float8_vs_fsdp2_float8", "loss_rel_gap": f8["loss_rel_gap"],
                                "loss_rel_gap_max": f8["loss_rel_gap_max"], "argmax": f8["loss_rel_gap_argmax"],
                                "loss_rel_gap_window_max": f8["loss_rel_gap_window_max"], "gap_to_bf16": gap_to_bf16,
                                "losses": {m: r["losses"] for m, r in rows.items()},
                                "tokens_per_s": {m: r["tokens_per_s"] for m, r in rows.items()}}) + "\n")
    assert f8["losses"][-1] < 0.7 * f8["losses"][0]  # it learns, so the comparison means something
    # every step within 1%, at an LR at which two runs that round differently stay on one trajectory: at 1e-3 one
    # noisy step sets them apart for a while, float8 or not (at ae89562: 11.6% at one step for float8 vs FSDP2 float8,
    # 11.1% for bf16 vs it; 0.11% over the last 20 steps). Measured at 5b19202 (results/fp8/numerics_5b19202): at
    # 1e-4, 0.64% at most (bf16 parameters), 0.27% (fp32); at 3e-4, 1.16% (bf16).
    assert f8["loss_rel_gap_max"] < 0.01, (f8["loss_rel_gap_max"], f8["loss_rel_gap_argmax"])
    assert gap_to_bf16 < 0.03, gap_to_bf16


def test_float8_gather_tracks_torchao_fsdp2_float8_within_1pct_over_200_steps(tmp_path):
    """[float8-gather] (``float8_gather=True``): the owners cast their fp32 masters with the whole weights' scales, as
    FSDP2's float8 all-gather casts its fp32 shards, so every step's loss is held to the same 1% of torchao + FSDP2
    float8 (a test of its own: a failure of the float8 gather leaves the test above standing). Not yet run on a
    GPU (gpu_suite section tests_float8)."""
    pytest.importorskip("torchao")
    from benchmarks import fp8_bench

    data = fp8_bench.main([*SHAPE, "--steps", "200", "--warmup", "5", "--out", str(tmp_path),
                           "--methods", "odc_float8_gather", "fsdp2_float8"])
    gathered = {r["method"]: r for r in data["rows"]}["odc_float8_gather"]
    if os.environ.get("ODC_RESULTS"):
        with open(os.environ["ODC_RESULTS"], "a") as f:
            f.write(json.dumps({"test": "float8_gather_vs_fsdp2_float8", "loss_rel_gap": gathered["loss_rel_gap"],
                                "loss_rel_gap_max": gathered["loss_rel_gap_max"],
                                "argmax": gathered["loss_rel_gap_argmax"],
                                "losses": {r["method"]: r["losses"] for r in data["rows"]},
                                "tokens_per_s": {r["method"]: r["tokens_per_s"] for r in data["rows"]}}) + "\n")
    assert gathered["losses"][-1] < 0.7 * gathered["losses"][0]  # it learns
    assert gathered["loss_rel_gap_max"] < 0.01, (gathered["loss_rel_gap_max"], gathered["loss_rel_gap_argmax"])
