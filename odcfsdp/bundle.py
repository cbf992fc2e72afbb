"""``python -m odcfsdp.bundle`` (also ``odcfsdp-bundle``): an offline wheel bundle, on a machine without torch; the
command lives in ``odcfsdp.app.bundle``."""

from odcfsdp.app.bundle import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
