"""``python -m odcfsdp.plot RUN_DIR`` (also ``odcfsdp-plot``): a run's curves; the command lives in
``odcfsdp.app.plot``."""

from odcfsdp.app.plot import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
