"""benchmarks/gpu_suite.sh: bash -n, and every section's command (a dry run) accepted by the scripts, tests and
configs it names; moved out of tests/test_benchmarks.py (which runs each script's CPU path)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

from benchmarks import best_fit, checkpoint_bench, comm_bench, e2e_bench, e2e_summary, optim_bench, park_bench

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


def _suite_sections() -> list[str]:
    """The section names gpu_suite.sh's header documents."""
    header = (BENCH / "gpu_suite.sh").read_text().split("\nset -u")[0]
    listed = re.search(r"# Sections: (.*?)\. Results go", header, re.S).group(1)
    listed = re.sub(r"\([^)]*\)", "", listed.replace("\n#", " "))
    return [s.strip() for s in listed.split(",") if s.strip()]


def _check_suite_command(section: str, cmd: str) -> None:
    """The command a section runs is one that today's scripts, tests and configs accept (each of a ``;`` chain)."""
    if ";" in cmd:
        for part in cmd.split(";"):
            _check_suite_command(section, part)
        return
    words = shlex.split(cmd)
    scripts = [i for i, w in enumerate(words) if w.startswith("benchmarks.")]  # python -m benchmarks.<name>
    if scripts:
        assert words[scripts[0] - 1] == "-m", (section, cmd)
        from benchmarks import fp8_bench, hf_finetune_check

        i = scripts[0]
        module = {"comm_bench": comm_bench, "optim_bench": optim_bench, "park_bench": park_bench,
                  "checkpoint_bench": checkpoint_bench,
                  "e2e_bench": e2e_bench, "best_fit": best_fit, "e2e_summary": e2e_summary,
                  "hf_finetune_check": hf_finetune_check, "fp8_bench": fp8_bench}[words[i].removeprefix("benchmarks.")]
        module.parse(words[i + 1:])  # argparse exits (SystemExit) on an argument the script no longer takes
    elif "pytest" in words:
        files = [w for w in words if w.startswith("tests/")]
        assert files and all((ROOT / f).exists() for f in files), (section, files)
    else:
        from hydra import compose, initialize_config_dir
        from omegaconf import OmegaConf

        from odcfsdp.app.config import register, validate
        from odcfsdp.app.train import CONFIGS_DIR

        overrides = words[words.index("odcfsdp.train") + 1:]
        register()
        with initialize_config_dir(config_dir=str(CONFIGS_DIR), version_base="1.3"):
            validate(OmegaConf.to_object(compose("train", overrides=overrides)))


def test_gpu_suite(tmp_path):
    """bash -n; every documented section gives a command (and a time limit) that the scripts it names accept."""
    script = BENCH / "gpu_suite.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    sections = _suite_sections()
    assert {"tests", "comm", "optim", "checkpoint", "train1b", "e2e_balanced", "hf_8b_balanced", "hf_8b_longtail",
            "hf_1b_vs_llama_1b", "hf_finetune_longtail"} <= set(sections)
    env = {**os.environ, "DRY_RUN": "1"}
    run = subprocess.run(["bash", str(script), str(tmp_path / "suite"), "abc1234", "0,1:" + ",".join(sections),
                          "2,3,4,5:comm,e2e_longtail"], capture_output=True, text=True, env=env, timeout=60)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert len(lines) == len(sections) + 2 and not (tmp_path / "suite").exists()  # a dry run writes nothing
    for line in lines:
        head, cmd = line.split("\t")
        lane, section, limit = head.split()
        assert int(limit) > 0 and cmd.strip(), line
        assert f"{tmp_path / 'suite'}/lane{lane}/{section}_n{2 if lane == '0' else 4}" in cmd, line
        _check_suite_command(section, cmd)
    assert "--nproc-per-node=4" in lines[-1]
    bad = subprocess.run(["bash", str(script), str(tmp_path / "suite"), "abc1234", "0:comm,no_such_section"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode != 0 and "unknown section no_such_section" in bad.stderr
