"""Model FLOPs utilisation: the dense bf16 peak of a device and the fraction of it a run used."""

from __future__ import annotations

import torch

PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0}  # dense bf16 per device


def peak_tflops(device: torch.device, override: float | None = None) -> float | None:
    """Dense bf16 TFLOP/s of ``device`` (``override`` if given; None where unknown, e.g. CPUs)."""
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def mfu(flops: float, seconds: float, peak: float | None, devices: int) -> float | None:
    """``flops`` done in ``seconds`` on ``devices`` devices of ``peak`` TFLOP/s each, as a fraction (None: no peak)."""
    return flops / seconds / (peak * 1e12 * devices) if peak and seconds > 0 else None
