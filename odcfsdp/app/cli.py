"""What ``python -m odcfsdp.train`` says about its keys: ``--help``, and the checks of command-line overrides.

Design note [cli-keys]
----------------------
The typed config (``odcfsdp/app/config.py``) is the one list of keys and of what each does: a
field's help is the docstring right below it ([config-docs] in ``config.py``; ``field_docs``
reads it, the one reader of help). ``--help`` prints every key with its default and the first
sentence of that help, and the experiment presets with their first comment line.

Overrides are checked before Hydra composes the config, so that each mistake is one line
and exit code 2, as for invalid values:

* a key that is no field is refused with the closest key (Hydra would otherwise suggest
  ``+key=value``, which it then adds and the typed config silently drops);
* ``optim.<k>=v`` for a ``k`` that is no ``optim`` field is the optimizer's keyword argument
  ``k`` (``optim.kwargs.<k>``; ``odcfsdp.app.config.validate`` checks it against the class);
* keys under a dict-valued field (``model.overrides``, ``optim.kwargs``) are free, and added
  with Hydra's ``++`` so that they need no ``+``;
* after composition, an override the run would not read (``unused_key``) is refused when it
  belongs to another kind of run (another model, optimizer or data source), and reported in a
  ``note:`` line when it sets a mode that is off (LoRA's keys with ``model.lora.r=0``: a sweep
  over the mode holds them); giving both ``run.steps`` and ``run.epochs`` is refused;
* nothing on the command line or in a preset runs code: Hydra keys other than where runs write
  and how Hydra logs (``HYDRA_KEYS``) are refused, since callbacks, launchers, sweepers and
  ``_target_`` import code and ``hydra.job.env_set`` sets the ranks' environment (a
  ``PYTHONPATH``); so are ``--experimental-rerun`` (it unpickles a file and runs it) and another
  primary config (``--config-path``, ``--config-name``). The presets of a ``--config-dir`` are
  read first and held to the same rule; odcfsdp's own presets (``configs/experiment``) are tested
  against it.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path
from typing import Any

from ..checks import did_you_mean, field_docs
from .config import TrainConfig, unused_key


def _value(v: Any) -> str:
    """A default as one would type it on the command line."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{_value(x)}" for k, x in v.items()) + "}"
    return str(v)


def key_table(node: Any = None, prefix: str = "") -> list[tuple[str, str, str]]:
    """(key, default, help) of every leaf key of the config tree under ``node`` (default: ``TrainConfig()``)."""
    node = TrainConfig() if node is None else node
    docs = field_docs(type(node))
    rows = []
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            rows += key_table(value, f"{prefix}{f.name}.")
        else:
            rows.append((f"{prefix}{f.name}", _value(value), docs.get(f.name, "")))
    return rows


def presets(configs_dir: Path) -> list[tuple[str, str]]:
    """(name, first comment line) of each experiment preset under ``configs_dir/experiment``."""
    out = []
    for path in sorted((configs_dir / "experiment").glob("*.yaml")):
        lines = [ln.lstrip("# ").strip() for ln in path.read_text().splitlines()
                 if ln.startswith("#") and "@package" not in ln]
        out.append((path.stem, lines[0] if lines else ""))
    return out


def _sentence(text: str) -> str:
    """The first sentence of ``text``, on one line."""
    text = " ".join(text.replace("``", "").split())
    end = re.search(r"(?<!e\.g)(?<!i\.e)\.(\s|$)", text)
    return text[:end.start() + 1] if end else text


def help_text(configs_dir: Path) -> str:
    """``python -m odcfsdp.train --help``: usage, the experiment presets, every key with its default and help."""
    out = ["usage: python -m odcfsdp.train [+experiment=NAME] [KEY=VALUE ...] [--multirun KEY=A,B ...]",
           "       torchrun --nproc-per-node=N -m odcfsdp.train [KEY=VALUE ...]",
           "",
           "Trains as the keys below say (Hydra overrides); with none, a tiny Llama on synthetic data on 2 CPU ranks.",
           "Any other optim.<k>=v is the optimizer's keyword argument k (optim.name=SGD optim.momentum=0.9).",
           "Ctrl-C or SIGTERM: the ranks finish the step and save a checkpoint (resume: checkpoint.resume=auto);",
           "a second Ctrl-C ends at once.", ""]
    found = presets(configs_dir) if configs_dir.is_dir() else []
    out.append(f"experiment presets (+experiment=NAME, from {configs_dir}):" if found else
               "experiment presets: none (they are in a source checkout's configs/experiment/)")
    width = max((len(n) for n, _ in found), default=0)
    out += [f"  {name:<{width}}  {text}" for name, text in found]
    out.append("")
    out.append("keys (KEY=DEFAULT  what it does):")
    rows = key_table()
    width = min(48, max(len(k) + len(d) + 1 for k, d, _ in rows))
    group = None
    for key, default, text in rows:
        if key.split(".")[0] != group:
            group = key.split(".")[0]
            cls = type(getattr(TrainConfig(), group))
            out.append(f" {group}: {_sentence(cls.__doc__ or '')}")
        out.append(f"  {f'{key}={default}':<{width}}  {_sentence(text)}")
    return "\n".join(out)


def _node_at(key: str) -> tuple[str, Any]:
    """How far ``key`` is a config key: ("ok" | "free" | "unknown", the last node or the unknown part's parent)."""
    node: Any = TrainConfig()
    parts = key.split(".")
    for k, part in enumerate(parts):
        if not dataclasses.is_dataclass(node) or part not in {f.name for f in dataclasses.fields(node)}:
            return ("free" if isinstance(node, dict) else "unknown"), (".".join(parts[:k]), node)
        node = getattr(node, part)
    return "ok", (key, node)


def _closest(key: str) -> str:
    return did_you_mean(key, [k for k, _, _ in key_table()])


def _parsed(arg: str):
    """Hydra's parse of one override; ``ValueError`` in one line where its grammar refuses it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    try:
        return OverridesParser.create().parse_overrides([arg])[0]
    except OverrideParseException:
        key, _, value = arg.partition("=")
        raise ValueError(f"{arg}: the value cannot be read; quote it ({key}='{value}'), as paths with spaces or "
                         "non-ASCII characters must be") from None


def _check_type(arg: str, key: str, typed):
    """``ValueError`` naming ``key`` and the type it takes when ``arg``'s value is not of it (Hydra would say so in
    4-6 lines, after the config was composed); returns the structured config it checks against, built once."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    override = _parsed(arg)
    if override.is_sweep_override():
        return typed
    typed = OmegaConf.structured(TrainConfig) if typed is None else typed
    try:
        OmegaConf.update(typed, key, override.value(), merge=True)
    except OmegaConfBaseException:
        raise ValueError(f"{arg}: {key} takes {_type_name(key)}, not {override.value()!r}") from None
    return typed


def _type_name(key: str) -> str:
    """The type a config key takes, in words (``a float``, ``an int``, ``a list of floats``, ...)."""
    node: Any = TrainConfig
    for part in key.split(".")[:-1]:
        node = typing.get_type_hints(node)[part]
    hint = typing.get_type_hints(node)[key.split(".")[-1]]
    plain = isinstance(hint, type) and typing.get_origin(hint) is None
    kind = hint.__name__ if plain else str(hint).replace("typing.", "")
    words = {"float": "a float", "int": "an int", "bool": "true or false", "str": "a string",
             "list[float]": "a list of floats", "float | None": "a float or null", "int | None": "an int or null",
             "str | None": "a string or null", "bool | None": "true, false or null"}
    return words.get(kind, kind)


#: the Hydra keys a command line may set: where runs write and how Hydra logs. Any other would import code
#: (callbacks, launchers, sweepers, a ``_target_``), set the ranks' environment (``hydra.job.env_set``: a
#: ``PYTHONPATH``) or read configs from elsewhere (``hydra.searchpath``) ([cli-keys]).
HYDRA_KEYS = ("hydra.run.dir", "hydra.sweep.dir", "hydra.sweep.subdir", "hydra.output_subdir", "hydra.job.chdir",
              "hydra.job.name", "hydra.verbose", "hydra.mode", "hydra/job_logging", "hydra/hydra_logging")

#: Hydra's own logging configs, the only ones a run takes (a logging config names handler classes it imports)
HYDRA_LOGGING = ("default", "disabled", "none", "stdout")

#: Hydra's flags that run code or pick another primary config, with why each is refused
REFUSED_FLAGS = {
    "--experimental-rerun": "it unpickles a file and runs it",
    "--config-path": "the config is odcfsdp's typed one (presets: +experiment=NAME, or --config-dir DIR)",
    "-cp": "the config is odcfsdp's typed one (presets: +experiment=NAME, or --config-dir DIR)",
    "--config-name": "the config is odcfsdp's typed one (presets: +experiment=NAME, or --config-dir DIR)",
    "-cn": "the config is odcfsdp's typed one (presets: +experiment=NAME, or --config-dir DIR)",
}


def _refused_hydra(arg: str) -> str | None:
    """Why the command-line argument ``arg`` is refused (it would run code, [cli-keys]); None if it is not."""
    if arg.startswith("-"):
        flag = arg.split("=")[0]
        return f"{flag}: refused, {REFUSED_FLAGS[flag]}" if flag in REFUSED_FLAGS else None
    name = arg.split("=")[0]
    key = name.lstrip("+~")
    hydra = key.startswith(("hydra.", "hydra/"))
    if "_target_" in key:
        return f"{name}: the command line takes no {'hydra ' if hydra else ''}keys that import or run code"
    value = arg.split("=", 1)[1] if "=" in arg else ""
    if key in ("hydra/job_logging", "hydra/hydra_logging") and value not in HYDRA_LOGGING:
        return (f"{name}={value}: refused, a logging config of your own names classes to import; Hydra's own are "
                f"{', '.join(HYDRA_LOGGING)}")
    if hydra and not key.startswith(HYDRA_KEYS):
        return (f"{name}: refused, it would import code, set the ranks' environment or read configs from "
                f"elsewhere (the hydra keys a run takes: {', '.join(HYDRA_KEYS)})")
    return None


def check_config_dir(path: str | Path) -> None:
    """``ValueError`` unless every preset under ``--config-dir path`` leaves Hydra as the command line may
    ([cli-keys]): no ``_target_``, no ``hydra`` key but ``HYDRA_KEYS``, no ``hydra/...`` defaults entry but those."""
    import yaml

    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"--config-dir {str(path)!r} is not a directory")
    for file in sorted(root.rglob("*.y*ml")):
        if file.relative_to(root).parts[0] == "hydra":
            raise ValueError(f"{file}: a preset of Hydra's own groups configures Hydra (a logging config imports the "
                             "classes it names): presets set odcfsdp's keys")
        try:
            preset = yaml.safe_load(file.read_text())
        except (OSError, yaml.YAMLError) as e:
            raise ValueError(f"{file}: not a readable YAML preset: {str(e).splitlines()[0]}") from None
        for key in _flat_keys(preset):
            refused = _refused_hydra(key.replace("defaults.", "", 1) if key.startswith("defaults.") else key)
            if refused:
                raise ValueError(f"{file}: {refused}")


def _flat_keys(node, prefix: str = "") -> list[str]:
    """Every leaf key path under ``node`` (``a.b.c``); a defaults-list entry ``{group: option}`` or
    ``"override group: option"`` is ``defaults.group``."""
    if prefix == "defaults" and isinstance(node, (list, dict)):
        entries = node if isinstance(node, list) else [node]
        groups = [g for e in entries for g in (e if isinstance(e, dict) else [str(e).split(":")[0]])]
        return [f"defaults.{_group(g)}" for g in groups]
    if isinstance(node, dict):
        return [k for key, v in node.items() for k in _flat_keys(v, f"{prefix}.{key}" if prefix else str(key))] \
            or [prefix]
    if isinstance(node, list):
        return [k for item in node for k in _flat_keys(item, prefix)] or [prefix]
    return [prefix]


def _group(entry) -> str:
    """A defaults-list entry's group: ``override /hydra/launcher`` is ``hydra/launcher``."""
    return str(entry).removeprefix("override ").strip().lstrip("/")


def config_dirs(args: list[str]) -> list[str]:
    """The directories given with Hydra's ``--config-dir DIR`` / ``--config-dir=DIR`` / ``-cd DIR``."""
    found = []
    for i, arg in enumerate(args):
        if arg.startswith("--config-dir="):
            found.append(arg.split("=", 1)[1])
        elif arg in ("--config-dir", "-cd"):
            found.append(args[i + 1] if i + 1 < len(args) else "")
    return found


def check_overrides(args: list[str], groups: tuple[str, ...] = ("experiment",)) -> list[str]:
    """The command line with its overrides checked and rewritten as [cli-keys] says; ``ValueError`` for an unknown key,
    and for what would run code (``_refused_hydra``), the presets of a ``--config-dir`` included.

    ``groups`` are config groups (``+experiment=NAME``), not keys of the tree.
    """
    for path in config_dirs(args):
        check_config_dir(path)
    out, typed = [], None
    for arg in args:
        m = re.fullmatch(r"(\+\+|\+|~)?([\w.\[\]-]+)(=.*)?", arg, re.S)
        refused = _refused_hydra(arg)
        if refused:
            raise ValueError(refused)
        if arg.startswith("-") or not m or (m[3] is None and m[1] != "~"):
            if "=" in arg and not arg.startswith("-"):
                _parsed(arg)  # not even an override: Hydra's grammar would say so in several lines
            out.append(arg)  # a flag (--multirun), or not an override
            continue
        prefix, key, value = m[1] or "", m[2], m[3] or ""
        if key.split(".")[0] in ("hydra", *groups):
            out.append(arg)
            continue
        state, (where, node) = _node_at(key)
        if state == "ok" and value and not dataclasses.is_dataclass(node) and not isinstance(node, dict):
            typed = _check_type(arg, key, typed)
        if state == "unknown" and where == "optim":  # an optimizer keyword argument
            key, state = "optim.kwargs." + key.removeprefix("optim."), "free"
        if state == "unknown":
            raise ValueError(f"{key} is not a key: {_closest(key)}(python -m odcfsdp.train --help lists them all)")
        if (state == "free" or isinstance(node, dict)) and prefix != "~":
            prefix = "++"  # a dict-valued field or a key in one: added, or replaced if a preset set it
        out.append(f"{prefix}{key}{value}")
    return out


def given_keys(overrides: list[str]) -> list[str]:
    """The config keys that Hydra overrides (``key=value``, ``+key=...``, ``~key``) set, in order."""
    keys = []
    for o in overrides:
        key = re.sub(r"^(\+\+|\+|~)", "", o.split("=")[0])
        if key and not key.startswith("hydra.") and key != "experiment" and key not in keys:
            keys.append(key)
    return keys


def check_given(cfg: TrainConfig, keys: list[str]) -> list[str]:
    """``ValueError`` for a given key of another kind of run (``unused_key``), or for both ``run.steps`` and
    ``run.epochs``; returns the notes (one line each) for given keys of a mode that is off."""
    if "run.steps" in keys and "run.epochs" in keys:
        raise ValueError("run.steps and run.epochs are both given: give one (run.epochs sets the steps from the "
                         "number of samples and data.batch_size)")
    notes = []
    for key in keys:
        unused = unused_key(cfg, key)
        if unused and unused[1]:
            raise ValueError(f"{key} is not used by this run: {unused[0]} (drop it)")
        if unused:
            notes.append(f"note: {key} is not used by this run: {unused[0]}")
    return notes
