"""odcfsdp's benchmarks: one module per benchmark, run from the repository root as ``python -m benchmarks.<name>``
(docs/benchmarks.md). ``harness`` holds what they share: the common flags, ``meta()``, the result writer and reader
(one schema: ``{"meta": {date, commit, command, device, ...}, "rows": [...]}``) and the ranks' launch."""
