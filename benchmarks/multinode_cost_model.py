"""Cost model of one training step on several nodes: HSDP vs full sharding, odcfsdp vs FSDP2 (issue 17).

A model, not a measurement: it combines figures measured on one node (committed JSON, read
here) with published inter-node bandwidth, to argue which layout to run across nodes before
there are nodes to measure on. Per rank and minibatch of ``M`` micro-batches of ``T`` tokens:

1. compute per micro-batch ``c = 6 P T / (peak * MFU)`` (MFU measured on one node);
2. parameter and gradient traffic per micro-batch, split into bytes that stay in the node
   (NVLink, at the measured bus rate of that engine) and bytes that cross nodes (InfiniBand);
   each link's time is bytes / rate, and the micro-batch takes ``max(c, comm)`` (traffic
   overlapped with compute as far as compute lasts, for every method alike: optimistic);
3. per minibatch, what cannot overlap: the replicas' gradient all-reduce (HSDP) and the
   optimizer step (measured time per parameter on one rank, scaled to the rank's share).

Who moves what across nodes (the point of the model):

* NCCL collectives (FSDP2) move one copy of a remote shard per *node*: a ring enters the node
  once and forwards over NVLink, so an all-gather of ``S`` bytes brings ``S (n-1)/n`` into each
  node, over all its NICs.
* odcfsdp's one-sided gets and pushes move one copy per *rank*: every rank fetches every remote
  shard itself, so the node's NICs carry ``g`` (GPUs per node) times more; pushes likewise.
* HSDP keeps sharding inside the node: no inter-node traffic per micro-batch; the replicas sum
  their fp32 gradient shards once per minibatch (odcfsdp) or once per micro-batch (FSDP2's
  default HSDP; ``set_requires_all_reduce(False)`` defers it).

Run: ``python -m benchmarks.multinode_cost_model --out results/cost_model/<name>`` (writes
``cost_model.json`` and ``cost_model.md``). It needs no GPU: it reads committed JSON and builds
the model on the meta device, so the same command is its CPU run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks import harness

ROOT = Path(__file__).resolve().parents[1]
COMM = ROOT / "results/comm/n2_d5edad3/comm_bench.json"  # gather/scatter bus GB/s, 2x H200
OPTIM = ROOT / "results/optim/h200_2b1e66b/optim_bench.json"  # optimizer step ms at 8B, 2 ranks' shards


def llama8b_params(vocab: int = 128256) -> int:
    """Parameters of the 8B Llama (built on the meta device: no memory)."""
    from odcfsdp.models import Llama
    from odcfsdp.models.llama import llama_config

    with torch.device("meta"):
        model = Llama(llama_config("8b", vocab))
    return sum(p.numel() for p in model.parameters())


def measured(group_bytes: int = 32 << 20) -> dict:
    """Rates measured on one node: bus GB/s of gathers and scatters at ``group_bytes``; optimizer ps per parameter."""
    comm = next(r for r in harness.rows(COMM) if r["group_bytes"] == group_bytes)
    best = lambda table, key: max(v[key] for k, v in table.items() if k.startswith("odc_b"))  # noqa: E731
    nccl_gather = next(v for k, v in comm["gather"].items() if k.startswith("nccl"))
    nccl_scatter = next(v for k, v in comm["scatter"].items() if k.startswith("nccl"))
    optim = next(r for r in harness.rows(OPTIM) if r["size"] == "8b")
    per_param = {k: optim["variants"][k]["ms_median"] * 1e-3 / optim["params_on_rank"] for k in ("odc_torch", "fsdp2")}
    return {
        "odc_gather_gbps": best(comm["gather"], "pipelined_bus_gbps"),
        "odc_scatter_gbps": best(comm["scatter"], "pipelined_bus_gbps"),
        "nccl_gather_gbps": nccl_gather["pipelined_bus_gbps"],
        "nccl_scatter_gbps": nccl_scatter["pipelined_bus_gbps"],
        "optim_s_per_param": per_param,
        "sources": [str(COMM.relative_to(ROOT)), str(OPTIM.relative_to(ROOT))],
    }


def step_time(method: str, a: argparse.Namespace, rates: dict, params: int) -> dict:
    """Seconds per minibatch on one rank, and what each part costs (see the module docstring)."""
    g, n = a.gpus_per_node, a.nodes
    world = g * n
    hsdp = method.endswith("hsdp")
    shard = g if hsdp else world
    odc = method.startswith("odc")
    gb = 1e9  # rates are GB/s
    nvl = (rates["odc_gather_gbps"] * gb, rates["odc_scatter_gbps"] * gb) if odc else (a.nccl_nvlink_gbps * gb,) * 2
    ib = a.ib_gbps * a.ib_efficiency * gb  # per GPU (one NIC each)
    bf16, fp32 = 2 * params, 4 * params  # bytes of the full parameters / gradients
    gathers = 1 if a.no_reshard else 2  # forward, and again in backward after resharding
    compute = 6 * params * a.tokens / (a.peak_tflops * 1e12 * a.mfu)
    # Per micro-batch traffic of one rank: bytes in the node and across nodes.
    remote = 0.0 if hsdp else (world - g) / world  # share of the shards on other nodes
    local = (shard - 1) / shard - remote
    moved = gathers * bf16 + fp32  # bytes of one micro-batch's gathers and gradient reduction
    if odc:  # every rank fetches / pushes its own copy: local shards over NVLink, remote ones over its NIC
        intra = gathers * bf16 * local / nvl[0] + fp32 * local / nvl[1]
        inter = moved * remote / ib
    else:  # a ring brings S * remote into each node once, over its g NICs, and crosses every GPU's NVLink
        intra = moved * (shard - 1) / shard / nvl[0]
        inter = moved * remote / (g * ib)
    replica_sync = 0.0
    if hsdp and n > 1:  # all-reduce of the rank's fp32 gradient shard over n replicas (ring over the NICs)
        replica_sync = 2 * (n - 1) / n * fp32 / shard / ib
    fsdp2_syncs_each_micro_batch = hsdp and not odc and not a.fsdp2_defer_all_reduce  # FSDP2 HSDP's default
    if fsdp2_syncs_each_micro_batch:
        inter += replica_sync
    micro = max(compute, intra, inter)
    optim = rates["optim_s_per_param"]["odc_torch" if odc else "fsdp2"] * params / shard
    exposed = optim + (0.0 if fsdp2_syncs_each_micro_batch else replica_sync)
    total = a.micro_batches * micro + exposed
    bytes_per_param = 18 if odc else 16  # fp32 master + Adam (12) + fp32 accumulator or grad (4) + bf16 row (2)
    return {
        "method": method, "shard_group": shard, "replicas": world // shard,
        "compute_s": compute, "intra_s": intra, "inter_s": inter, "replica_sync_s": replica_sync,
        "micro_batch_s": micro, "exposed_s": exposed, "step_s": total,
        "tokens_per_s_per_gpu": a.micro_batches * a.tokens / total,
        "state_gib_per_gpu": bytes_per_param * params / shard / 2**30,
        "bound": max((("compute", compute), ("nvlink", intra), ("infiniband", inter)),
                     key=lambda kv: kv[1])[0],
    }


def main(argv=None) -> None:
    """Print the cost table for the given assumptions (and write it, with the JSON, under ``--out``)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--ib-gbps", type=float, default=50.0, help="InfiniBand per GPU, GB/s (400 Gb/s NDR: 50)")
    p.add_argument("--ib-efficiency", type=float, default=0.9, help="share of line rate reached (nccl-tests ~0.9)")
    p.add_argument("--nccl-nvlink-gbps", type=float, default=None,
                   help="NCCL bus GB/s inside a node (default: the measured 2-GPU all-gather figure)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense peak (H100/H200 SXM)")
    p.add_argument("--mfu", type=float, default=0.326, help="measured 8B MFU on 2x H200 (issue 18, 44e14f3)")
    p.add_argument("--tokens", type=int, nargs="+", default=[16384, 2048], help="tokens per micro-batch")
    p.add_argument("--micro-batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--no-reshard", action="store_true", help="gather once per micro-batch (reshard_after_forward=False)")
    p.add_argument("--fsdp2-defer-all-reduce", action="store_true",
                   help="FSDP2 HSDP all-reduces once per minibatch (set_requires_all_reduce(False) until the last)")
    harness.add_common(p, out="")  # --out (empty: print the table only), --commit
    a = p.parse_args(argv)
    rates = measured()
    if a.nccl_nvlink_gbps is None:
        a.nccl_nvlink_gbps = rates["nccl_gather_gbps"]
    params = llama8b_params()
    rows = []
    for t in a.tokens:
        for m in a.micro_batches:
            for method in ("fsdp2_full", "fsdp2_hsdp", "odc_full", "odc_hsdp"):
                args = argparse.Namespace(**{**vars(a), "micro_batches": m, "tokens": t})
                rows.append({"tokens": t, "micro_batches": m, **step_time(method, args, rates, params)})
    commit = a.commit
    meta = harness.meta(commit, harness.command(__name__, argv), "model (no device)", params=params,
                        assumptions={k: v for k, v in vars(a).items() if k not in ("out", "commit")}, measured=rates)
    lines = [f"# Step cost model: Llama 8B ({params / 1e9:.2f}B), {a.nodes} x {a.gpus_per_node} GPUs, "
             f"{a.ib_gbps * 8:.0f} Gb/s InfiniBand per GPU", "",
             f"{meta['date']}, commit {commit}; a model from measured one-node rates ({', '.join(rates['sources'])}) "
             f"and published link rates, not a measurement. Generated by `{meta['command']}`.", "",
             f"NCCL inside a node: {a.nccl_nvlink_gbps:g} GB/s bus; odcfsdp's gathers / pushes: "
             f"{rates['odc_gather_gbps']:.0f} / {rates['odc_scatter_gbps']:.0f} GB/s (measured); IB {a.ib_gbps:g} GB/s "
             f"per GPU at {a.ib_efficiency:g} of line rate; MFU {a.mfu:g} of {a.peak_tflops:g} TFLOP/s. Times per rank.", "",
             "| tokens / micro-batch | micro-batches | method | shard x replicas | compute s | NVLink s | IB s "
             "| exposed s | step s | tokens/s/GPU | bound | state GiB/GPU |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tokens']} | {r['micro_batches']} | {r['method']} | {r['shard_group']} x {r['replicas']} | "
                     f"{r['compute_s']:.3f} | {r['intra_s']:.3f} | {r['inter_s']:.3f} | {r['exposed_s']:.3f} | "
                     f"{r['step_s']:.3f} | {r['tokens_per_s_per_gpu']:.0f} | {r['bound']} | {r['state_gib_per_gpu']:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        harness.write_result(a.out, "cost_model", meta, rows, text)


if __name__ == "__main__":
    main()
