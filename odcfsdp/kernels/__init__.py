"""Triton kernels (lowest layer: imports nothing else from odcfsdp).

``rows``: one-sided gather and scatter-accumulate over load/store-reachable rows;
``float8_cast``: the owner's cast of its master row into its float8 row, a scale per segment;
``nvshmem_get``: the gather through NVSHMEM get calls; ``chunks``: how both split a
group into programs; ``split_bits``: ``split_masters``' split of a master into its row's low bits and their join.
"""
