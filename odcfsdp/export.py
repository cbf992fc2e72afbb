"""``python -m odcfsdp.export CHECKPOINT OUT`` (also ``odcfsdp-export``): a checkpoint as a Hugging Face directory;
the command lives in ``odcfsdp.app.export``."""

from odcfsdp.app.export import _console, main

__all__ = ["main"]

if __name__ == "__main__":
    _console()
