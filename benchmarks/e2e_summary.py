"""One table over several end-to-end benchmark runs (their ``e2e_bench.json``), for READMEs.

    python -m benchmarks.e2e_summary results/e2e/*/e2e_bench.json
    python -m benchmarks.e2e_summary $(find results/e2e -name e2e_bench.json) --out /tmp/e2e_summary.md  # anywhere

Per run and workload: odcfsdp nvshmem (lb_mini on the long-tailed workload, where it ran, else
lb_micro) against PyTorch FSDP2 + lb_micro, and the other methods' ratios, read from the files as
written by ``e2e_bench.py``; nothing is typed in by hand. A run without one of them (an odc-only
A/B run) shows "-" there. A run of a Hugging Face model (``--model hf:<name>``) has ``hf_fsdp2`` /
``hf_ddp`` in the FSDP2 / DDP columns and its model named in the run column. Post-processing only: it
runs anywhere (CPU), on committed results.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks import harness
from benchmarks.e2e_report import baseline

HEADER = ["| workload | GPUs | commit | odcfsdp nvshmem tokens/s | FSDP2 tokens/s | odc / FSDP2 | "
          "odc lb_micro / FSDP2 | odc collective / FSDP2 | DDP / FSDP2 | MFU odc / FSDP2 | "
          "peak GiB odc (+ heap) / FSDP2 | final losses | run |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]


def rows(path: Path) -> list[str]:
    """The table's rows of one ``e2e_bench.json``: one per workload it ran, in the order it ran them."""
    data = harness.load_result(path)  # "results" before the one schema
    workloads = list(dict.fromkeys(r["workload"] for r in data["rows"]))
    return [_row(path, data["meta"], [r for r in data["rows"] if r["workload"] == w]) for w in workloads]


def _row(path: Path, meta: dict, results: list[dict]) -> str:
    """One workload's row (``results``: that workload's runs)."""
    runs = {(baseline(r["method"]), r["balance"]): r for r in results}
    fsdp2 = runs.get(("fsdp2", "lb_micro"))
    odc = runs.get(("odc", "lb_mini")) or runs.get(("odc", "lb_micro"))

    def ratio(method: str, balance: str = "lb_micro") -> str:
        r = runs.get((method, balance))
        return f"{r['tokens_per_s'] / fsdp2['tokens_per_s']:.2f}x" if r and fsdp2 else "-"

    def mem(r: dict | None) -> str:
        if not r or r["peak_alloc_gib"] is None:  # a CPU run has no peak
            return "-"
        heap = r.get("nvshmem_heap_gib")
        return f"{r['peak_alloc_gib']:.1f}" + (f" + {heap:.1f}" if heap else "")

    def mfu(r: dict | None) -> str:
        return "-" if not r or r.get("mfu") is None else f"{r['mfu']:.1%}"

    losses = [r["losses"][-1] for r in results]
    model = f" ({meta['model']})" if meta.get("model", "").startswith("HF") else ""
    odc_tps = f"{odc['tokens_per_s']:.0f} ({odc['balance']})" if odc else "-"
    fsdp2_tps = f"{fsdp2['tokens_per_s']:.0f}" if fsdp2 else "-"
    odc_vs = ratio("odc", odc["balance"]) if odc else "-"
    micro_vs = ratio("odc", "lb_micro") if odc and odc["balance"] == "lb_mini" else "-"
    return (f"| {results[0]['workload']} | {meta['world_size']} | {meta['commit']} | {odc_tps} | {fsdp2_tps} | "
            f"{odc_vs} | {micro_vs} | {ratio('odc_collective')} | {ratio('ddp')} | {mfu(odc)} / {mfu(fsdp2)} | "
            f"{mem(odc)} / {mem(fsdp2)} | {min(losses):.3f}-{max(losses):.3f} | `{path.parent.name}`{model} |")


def scaling(paths: list[Path]) -> list[str]:
    """Weak scaling per method: tokens/s per GPU at the largest world size over the smallest, same workload and
    commit."""
    by: dict[tuple, dict[int, float]] = {}
    for path in paths:
        data = harness.load_result(path)
        n = data["meta"]["world_size"]
        for r in data["rows"]:
            key = (r["workload"], data["meta"]["commit"], r["method"], r["balance"])
            by.setdefault(key, {})[n] = r["tokens_per_s"] / n
    lines = ["| workload | commit | method | balance | tokens/s per GPU (GPUs: value) | efficiency |",
             "|---|---|---|---|---|---|"]
    for (w, c, m, b), per in sorted(by.items()):
        if len(per) > 1:
            lo, hi = min(per), max(per)
            lines.append(f"| {w} | {c} | {m} | {b} | {', '.join(f'{n}: {v:.0f}' for n, v in sorted(per.items()))} | "
                         f"{per[hi] / per[lo]:.0%} |")
    return lines


def summary(paths: list[Path]) -> str:
    """The runs' table, then the weak-scaling table, as markdown."""
    lines = list(HEADER)
    for f in paths:
        lines += rows(f)
    return "\n".join([*lines, "", *scaling(paths)]) + "\n"


def parse(argv=None) -> argparse.Namespace:
    """The command line: ``e2e_bench.json`` files, ``--out``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--out", type=Path, default=None, help="also write the markdown to this file")
    return p.parse_args(argv)


def main(argv=None) -> None:
    """Print the summary of the given ``e2e_bench.json`` files (and write it to ``--out``)."""
    args = parse(argv)
    text = summary(args.files)
    print(text, end="")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
