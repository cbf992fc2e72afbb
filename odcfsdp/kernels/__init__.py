"""Triton kernels (lowest layer: imports nothing else from odcfsdp).

The one-sided gather and scatter-accumulate kernels land with the ODC transports;
until then the collective transport moves data with torch ops only.
"""
