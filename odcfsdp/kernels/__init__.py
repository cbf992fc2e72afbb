"""Triton kernels (lowest layer: imports nothing else from odcfsdp).

``rows``: one-sided gather and scatter-accumulate over load/store-reachable rows;
``nvshmem_get``: the gather through NVSHMEM get calls; ``chunks``: how both split a
group into programs.
"""
