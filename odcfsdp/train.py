"""``python -m odcfsdp.train [key=value ...]`` (also ``odcfsdp-train``): the training command line, which lives in
``odcfsdp.app.train``; this module keeps its documented name."""

if __name__ == "__main__":  # a signal while torch and Hydra load ends with one line (see odcfsdp.app.train)
    from odcfsdp.interrupts import exit_during_imports, install

    install(exit_during_imports)

from odcfsdp.app.train import main, run  # noqa: E402

__all__ = ["main", "run"]

if __name__ == "__main__":
    main()
