"""Host memory of loading a pretrained Hugging Face checkpoint the way ``model.path`` does.

    python -m benchmarks.hf_load_memory --out results/hf_load --layers 8 --dim 1024 --world 2
    python -m benchmarks.hf_load_memory --out /tmp/hf_load --layers 2 --dim 128 --vocab 512   # smoke run

Saves a randomly initialised Llama-architecture checkpoint (fp32 safetensors, sharded with an
index) to a temporary directory; then ``--world`` CPU ranks (gloo + shm) build the model on the
meta device, wrap it in ``ODCShard(device="cpu")`` and read their slices with ``load_hf``. Each
rank reports, from ``/proc/self/status`` (the high-water mark reset with ``/proc/self/clear_refs``
after the imports):

* ``state``: resident memory the loaded model holds afterwards: the rank's sharded training
  state (fp32 master, row and gradient accumulator: up to 12 bytes per parameter / world on
  CPU, where rows are fp32; pages never written, such as zero accumulators, are not resident),
  which any sharded trainer holds;
* ``load peak``: how far above that the resident memory went during wrapping and loading: what
  reading the checkpoint costs beyond the state. A loader that materialised the model would
  show the full fp32 model here. It counts the pages of the open safetensors file that the
  rank read (mapped page cache, dropped when the file is closed); ``anon`` is the same for
  anonymous memory alone (RssAnon, sampled every millisecond), i.e. without those pages.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from benchmarks import harness


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


class _AnonPeak:
    """Samples RssAnon (anonymous resident memory: not file pages) every millisecond; ``peak`` in KiB."""

    def __init__(self):
        import threading

        self.peak = _rss_kib("RssAnon")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _rss_kib("RssAnon"))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, _rss_kib("RssAnon"))


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS


def _save(path: str, layers: int, dim: int, vocab: int) -> int:
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=int(dim * 8 / 3) // 64 * 64,
                                   num_hidden_layers=layers, num_attention_heads=dim // 64, num_key_value_heads=dim // 128,
                                   tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(path, max_shard_size="200MB")
    return sum(p.numel() for p in model.parameters())


def _odcfsdp_rank(path: str) -> dict:
    import transformers

    from odcfsdp import ODCShard
    from odcfsdp.checkpoint import load_hf

    _reset_peak()
    before, anon_before = _rss_kib("VmRSS"), _rss_kib("RssAnon")
    sampler = _AnonPeak()
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(path),
                                                             dtype=torch.float32)
    model = ODCShard(meta, device=torch.device("cpu"))
    load_hf(model, path)
    anon_peak = sampler.stop()
    after, anon_after = _rss_kib("VmRSS"), _rss_kib("RssAnon")
    out = {"state_mib": (after - before) / 1024, "load_peak_mib": (_rss_kib("VmHWM") - after) / 1024,
           "anon_state_mib": (anon_after - anon_before) / 1024, "anon_load_peak_mib": (anon_peak - anon_after) / 1024}
    model.close()
    return out


def main(argv=None) -> None:
    """Save the checkpoint, load it on ``--world`` CPU ranks, write ``hf_load_memory.json`` and ``.md``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--world", type=int, default=2)
    harness.add_common(p, out="results/hf_load")  # --out, --commit
    args = p.parse_args(argv)
    import transformers  # noqa: F401  (imported before any measurement, like in the workers)

    from odcfsdp.launch import spawn

    with tempfile.TemporaryDirectory() as tmp:
        params = spawn(_save, 1, tmp, args.layers, args.dim, args.vocab, timeout=1800)[0]
        ranks = spawn(_odcfsdp_rank, args.world, tmp, timeout=1800)
    model_mib = params * 4 / 2**20
    meta = harness.meta(args.commit, harness.command(__name__, argv), harness.device_name("cpu", args.world),
                        params=params, fp32_model_mib=model_mib, world=args.world, layers=args.layers, dim=args.dim,
                        vocab=args.vocab)
    rows = [{"rank": r, **x} for r, x in enumerate(ranks)]
    lines = ["# Host memory of loading a pretrained checkpoint", "",
             f"- device: {meta['device']}; date {meta['date']}; commit {meta['commit']}",
             f"- command: `{meta['command']}`",
             f"- model: Llama architecture, {params / 1e6:.0f}M parameters, {model_mib:.0f} MiB in fp32 "
             "(safetensors, sharded with an index)",
             "- state: resident memory the loaded model holds (the rank's sharded training state); "
             "load peak: how far above that resident memory went while wrapping and loading", "",
             "| rank | state MiB | load peak MiB (/ fp32 model) | anon state MiB | anon load peak MiB (/ fp32 model) |",
             "|---|---|---|---|---|"]
    for r, x in enumerate(ranks):
        lines.append(f"| {r} of {args.world} | {x['state_mib']:.0f} | {x['load_peak_mib']:.0f} "
                     f"({x['load_peak_mib'] / model_mib:.3f}) | {x['anon_state_mib']:.0f} | "
                     f"{x['anon_load_peak_mib']:.0f} ({x['anon_load_peak_mib'] / model_mib:.3f}) |")
    harness.write_result(args.out, "hf_load_memory", meta, rows, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
