"""The typed configs: one help mechanism (each field's docstring), and ``ShardConfig`` equal to ODCShard's arguments."""

from __future__ import annotations

import dataclasses
import inspect
import io
import tokenize
import typing

from odcfsdp import ODCShard
from odcfsdp.app.cli import key_table
from odcfsdp.checks import field_docs
from odcfsdp.app.config import TrainConfig
from odcfsdp.app.shard_config import CONFIG_ONLY, CONVERSIONS, RUNTIME, ShardConfig, args_help


def _config_classes(node=None) -> list[type]:
    """Every dataclass of the config tree, the root first."""
    node = TrainConfig() if node is None else node
    out = [type(node)]
    for f in dataclasses.fields(node):
        if dataclasses.is_dataclass(getattr(node, f.name)):
            out += _config_classes(getattr(node, f.name))
    return out


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def test_every_field_of_every_config_class_has_a_docstring_and_no_trailing_comment():
    """[config-docs]: the string literal below a field is its one help; no field line ends in a comment."""
    for cls in _config_classes():
        docs = field_docs(cls)
        assert [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)] == [], cls.__name__
        source = inspect.getsource(cls)
        comments = [t.string for t in tokenize.generate_tokens(io.StringIO(source).readline)
                    if t.type == tokenize.COMMENT]
        assert comments == [], (cls.__name__, comments)


def test_help_rows_are_the_docstrings():
    rows = {key: text for key, _, text in key_table()}
    assert rows["run.steps"] == field_docs(type(TrainConfig().run))["steps"]
    assert rows["shard.mp_policy.reduce_dtype"].startswith("gradient accumulators' dtype")
    assert rows["shard.replicas"].startswith("HSDP: copies of the model")


def test_field_docs_reads_a_docstring_below_each_field():
    @dataclasses.dataclass
    class Example:
        a: int = 1
        """the first
        key, on two lines"""
        b: str = "x"
        c: float = 0.5
        """the third"""

    assert field_docs(Example) == {"a": "the first key, on two lines", "c": "the third"}


def test_shard_config_is_exactly_odcshards_configurable_arguments():
    """[shard-config]: the fields of ShardConfig are ODCShard's arguments but the runtime ones (same names, order and
    defaults, converted where CONVERSIONS says), then the config-only keys; each argument is documented in ODCShard's
    Args: section, and a plain one has the argument's own type."""
    params = {n: p for n, p in inspect.signature(ODCShard.__init__).parameters.items() if n != "self"}
    assert set(RUNTIME) <= set(params) and set(CONVERSIONS) <= set(params)
    configurable = {n: p for n, p in params.items() if n not in RUNTIME}
    fields = {f.name: f for f in dataclasses.fields(ShardConfig)}
    assert list(fields) == [*configurable, *CONFIG_ONLY]
    assert not set(CONFIG_ONLY) & set(params)
    hints, argument_hints = typing.get_type_hints(ShardConfig), typing.get_type_hints(ODCShard.__init__)
    for name, p in configurable.items():
        assert p.default is not p.empty, f"ODCShard's argument {name} needs a default to be a config key"
        conversion = CONVERSIONS.get(name)
        expected = conversion.to_config(p.default) if conversion else p.default
        assert _default(fields[name]) == expected, name
        if conversion is None:
            assert hints[name] == argument_hints[name], name
    documented = args_help(ODCShard.__doc__ or "")
    assert [n for n in configurable if not documented.get(n)] == []
    docs = field_docs(ShardConfig)
    assert [n for n in configurable if not docs.get(n, "").startswith(documented[n][:40])] == []


def test_shard_arguments_hand_every_argument_key_to_odcshard():
    import torch.nn as nn

    from odcfsdp.app.shard_config import shard_arguments

    built = type("Built", (), {"model": nn.Linear(2, 2)})()
    args = shard_arguments(ShardConfig(), built)
    assert list(args) == [n for n in (f.name for f in dataclasses.fields(ShardConfig)) if n not in CONFIG_ONLY]
    inspect.signature(ODCShard.__init__).bind(None, nn.Linear(2, 2), **args)
    assert args["group_bytes"] == 32 << 20 and args["units"] == () and args["param_dtype"] is None


# -- data sources ([data-sources]) -------------------------------------------------------------------------------------
def test_data_source_choices_and_checks_come_from_the_registry():
    import pytest

    from odcfsdp.app.config import config_from, validate
    from odcfsdp.app.sources import SOURCES, source_choices

    assert source_choices() == ("auto", "synthetic", "jsonl") == ("auto", *SOURCES)
    with pytest.raises(ValueError, match=r"data.source='parquet' is not allowed.*\('auto', 'synthetic', 'jsonl'\)"):
        validate(config_from({"data": {"source": "parquet"}}))
    assert config_from({"data": {"path": "x.jsonl"}}).data.source == "jsonl"
    assert config_from({}).data.source == "synthetic"


def test_a_new_source_is_one_registration(tmp_path):
    """A registered source is a choice of data.source, built by build_source, checked by validate and preflight, and
    its own keys are refused for the other sources' runs (and theirs for its runs)."""
    import pytest

    from odcfsdp.app import sources
    from odcfsdp.app.builders import build_source, vocab_size
    from odcfsdp.app.config import config_from, unused_key, validate
    from odcfsdp.app.preflight import preflight

    def must_be_small(cfg):
        if cfg.data.vocab_size > 1000:
            raise ValueError("data.source=constant takes data.vocab_size <= 1000")

    constant = sources.DataSource(
        "constant", build=lambda cfg: ("samples", 7), vocab_size=lambda cfg: 7, config_vocab=lambda cfg: 7,
        validate=must_be_small, preflight=lambda cfg: ["note: constant data"], reads=("prompt_fraction",),
        unread="constant data has no files")
    sources.register(constant)
    try:
        with pytest.raises(ValueError, match="already registered"):
            sources.register(constant)
        cfg = config_from({"data": {"source": "constant"}, "run": {"out_dir": str(tmp_path / "run"),
                                                                    "world_size": 1}})
        validate(cfg)
        assert build_source(cfg) == ("samples", 7) and vocab_size(cfg) == 7
        assert preflight(cfg) == ["note: constant data"]
        assert unused_key(cfg, "data.format") == ("constant data has no files", True)
        assert unused_key(cfg, "data.vocab_size") == ("constant data has no files", True)
        assert unused_key(cfg, "data.prompt_fraction") is None
        assert unused_key(config_from({"data": {"path": "x.jsonl"}}), "data.prompt_fraction")[1]
        with pytest.raises(ValueError, match="data.source=constant takes data.vocab_size <= 1000"):
            validate(config_from({"data": {"source": "constant", "vocab_size": 5000}}))
        with pytest.raises(ValueError, match="run.epochs needs a JSONL data.path"):
            validate(config_from({"data": {"source": "constant"}, "run": {"epochs": 1.0}}))
    finally:
        sources.SOURCES.pop("constant")


def test_the_engines_options_are_documented_once():
    """Issue 43 item 3: each of the engine's own options has one documentation, its ``EngineSettings`` field's
    docstring; ``ODCShard``'s ``Args:`` entries and the ``shard.*`` keys' help are that text, and ShardConfig's source
    repeats none of it."""
    import ast

    from odcfsdp import EngineSettings

    docs = field_docs(EngineSettings)
    names = [f.name for f in dataclasses.fields(EngineSettings)]
    assert sorted(docs) == sorted(names) and all(docs.values())
    entries = args_help(ODCShard.__doc__ or "")
    assert {n: entries[n] for n in names} == docs
    shard_docs = field_docs(ShardConfig)
    shared = [n for n in names if n in {f.name for f in dataclasses.fields(ShardConfig)}]
    assert shared and all(shard_docs[n] == docs[n] for n in shared)
    body = ast.parse(inspect.cleandoc("\n" + inspect.getsource(ShardConfig))).body[0].body
    documented_here = {node.target.id for node, below in zip(body, body[1:]) if isinstance(node, ast.AnnAssign)
                       and isinstance(below, ast.Expr) and isinstance(below.value, ast.Constant)}
    assert not documented_here & set(names)
