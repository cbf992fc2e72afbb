"""One table over several end-to-end benchmark runs (their ``e2e_bench.json``), for READMEs.

    python benchmarks/e2e_summary.py results/e2e/*/e2e_bench.json

Per run: odcfsdp nvshmem (lb_mini on the long-tailed workload, where it ran, else lb_micro)
against PyTorch FSDP2 + lb_micro, and the other methods' ratios, read from the files as written by
``e2e_bench.py``; nothing is typed in by hand.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def row(path: Path) -> str:
    data = json.loads(path.read_text())
    meta, runs = data["meta"], {(r["method"], r["balance"]): r for r in data["results"]}
    workload = data["results"][0]["workload"]
    fsdp2 = runs.get(("fsdp2", "lb_micro"))
    odc = runs.get(("odc", "lb_mini")) or runs.get(("odc", "lb_micro"))

    def ratio(method: str, balance: str = "lb_micro") -> str:
        r = runs.get((method, balance))
        return f"{r['tokens_per_s'] / fsdp2['tokens_per_s']:.2f}x" if r and fsdp2 else "-"

    def mem(r: dict | None) -> str:
        return "-" if not r else f"{r['peak_alloc_gib']:.1f}" + (f" + {r['nvshmem_heap_gib']:.1f}" if r["nvshmem_heap_gib"] else "")

    losses = [r["losses"][-1] for r in data["results"]]
    return (f"| {workload} | {meta['world_size']} | {meta['commit']} | "
            f"{odc['tokens_per_s']:.0f} ({odc['balance']}) | {fsdp2['tokens_per_s']:.0f} | {ratio('odc', odc['balance'])} | "
            f"{ratio('odc', 'lb_micro') if odc['balance'] == 'lb_mini' else '-'} | {ratio('odc_collective')} | "
            f"{ratio('ddp')} | {odc['mfu']:.1%} / {fsdp2['mfu']:.1%} | {mem(odc)} / {mem(fsdp2)} | "
            f"{min(losses):.3f}-{max(losses):.3f} | `{path.parent.name}` |")


def scaling(paths: list[Path]) -> list[str]:
    """Weak scaling per method: tokens/s per GPU at the largest world size over the smallest, same workload and commit."""
    by: dict[tuple, dict[int, float]] = {}
    for path in paths:
        data = json.loads(path.read_text())
        n = data["meta"]["world_size"]
        for r in data["results"]:
            key = (r["workload"], data["meta"]["commit"], r["method"], r["balance"])
            by.setdefault(key, {})[n] = r["tokens_per_s"] / n
    lines = ["| workload | commit | method | balance | tokens/s per GPU (GPUs: value) | efficiency |", "|---|---|---|---|---|---|"]
    for (w, c, m, b), per in sorted(by.items()):
        if len(per) > 1:
            lo, hi = min(per), max(per)
            lines.append(f"| {w} | {c} | {m} | {b} | {', '.join(f'{n}: {v:.0f}' for n, v in sorted(per.items()))} | "
                         f"{per[hi] / per[lo]:.0%} |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("files", nargs="+", type=Path)
    args = p.parse_args()
    print("| workload | GPUs | commit | odcfsdp nvshmem tokens/s | FSDP2 tokens/s | odc / FSDP2 | odc lb_micro / FSDP2 | "
          "odc collective / FSDP2 | DDP / FSDP2 | MFU odc / FSDP2 | peak GiB odc (+ heap) / FSDP2 | final losses | run |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for f in args.files:
        print(row(f))
    print()
    print("\n".join(scaling(args.files)))


if __name__ == "__main__":
    main()
