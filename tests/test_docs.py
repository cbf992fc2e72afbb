"""Documentation derived from code stays in step with it."""

from pathlib import Path

import pytest

from odcfsdp.sharding.transport import COMM_CHOICES, TRANSPORTS, transport_class, transport_table

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_transport_table_is_the_generated_one():
    """The README's table of transports is ``transport_table()`` verbatim (regenerate it when a transport changes)."""
    assert transport_table() in README.read_text()


def test_comm_choices_come_from_the_registry():
    assert COMM_CHOICES == ("auto", *TRANSPORTS)
    assert all(t.caps.devices and t.caps.where and t.caps.how for t in TRANSPORTS.values())


def test_device_checks_come_from_the_registry():
    assert transport_class("auto", "cuda").name == "nvshmem" and transport_class("auto", "cpu").name == "shm"
    with pytest.raises(ValueError, match=r"comm='shm' moves cpu tensors, the model is on cuda; use comm='auto' or "
                                         r"one of \['nvshmem', 'collective'\]"):
        transport_class("shm", "cuda")
    with pytest.raises(ValueError, match="comm='nvshmem' moves cuda tensors, the model is on cpu"):
        transport_class("nvshmem", "cpu")


def test_every_shard_key_has_its_help_from_odcshards_args():
    """``shard.*`` keys are derived from ODCShard's signature; each takes its Args line as help ([derived-shard-config])."""
    import dataclasses

    from odcfsdp.shard_config import ShardConfig

    assert all(f.metadata["help"] for f in dataclasses.fields(ShardConfig))
