"""A non-editable install (a wheel) runs `deadpool demo` (shortened) without the repository, and `deadpool bench`'s
commands start there: the example GPT and the baselines' imports resolve inside the installed package."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]

# What the installed package must answer, run by the fresh environment's python: where each thing comes from.
WHERE = """
import importlib.util, json
import deadpool
from deadpool.bench.baselines import torchrun_dcp
from deadpool.launcher.options import EXAMPLE
print(json.dumps({
    "deadpool": deadpool.__file__,
    "example": str(EXAMPLE),
    "example_files": sorted(p.name for p in EXAMPLE.parent.glob("*.py")),
    "baseline_model": torchrun_dcp.GPT.__module__,
    "baseline_data": torchrun_dcp.BatchSampler.__module__,
    "modules": {name: importlib.util.find_spec(name).origin
                for name in ("deadpool.examples.gpt.model", "deadpool.examples.gpt.data")},
}))
"""


def _build_wheel(tmp_path: Path) -> Path:
    """The wheel `pip install .` would install, built offline from a copy of the sources (the build writes
    build/ and *.egg-info beside them, and a stale build/ would leak old files into the wheel)."""
    setuptools = pytest.importorskip("setuptools", reason="building the wheel offline uses this environment's "
                                                          "setuptools (--no-build-isolation), and it has none")
    if int(setuptools.__version__.split(".")[0]) < 68:
        pytest.skip(f"pyproject.toml needs setuptools>=68 to build, this environment has {setuptools.__version__}")
    source = tmp_path / "source"
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for name in ("src", "examples"):  # src/deadpool/examples/gpt links to examples/gpt: keep the link
        shutil.copytree(REPO / name, source / name, symlinks=True, ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                          "--wheel-dir", str(tmp_path / "wheel"), str(source)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    [wheel] = (tmp_path / "wheel").glob("deadpool-*.whl")
    return wheel


def _fresh_venv(tmp_path: Path, env: dict[str, str]) -> Path:
    """A venv that sees torch and numpy from this environment (a .pth naming their directories: no download)
    and nothing of the repository: a directory named in a .pth is added as it is, so the editable install's
    own .pth in it is never read."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    code = "import sysconfig; print(sysconfig.get_path('purelib'))"
    purelib = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, check=True,
                             timeout=60, env=env).stdout.strip()
    deps = dict.fromkeys(str(Path(m.__file__).resolve().parents[1]) for m in (torch, numpy))
    (Path(purelib) / "dependencies.pth").write_text("\n".join(deps) + "\n")
    return venv


def test_a_wheel_install_runs_without_the_repository(tmp_path):
    wheel = _build_wheel(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}  # no src/ on the path
    env["PYTHONNOUSERSITE"] = "1"
    venv = _fresh_venv(tmp_path, env)
    python, deadpool = str(venv / "bin" / "python"), str(venv / "bin" / "deadpool")
    out = subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
                          str(wheel)], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stdout + out.stderr

    def run(*argv: str) -> str:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    where = json.loads(run(python, "-c", WHERE))
    package = Path(where["deadpool"]).resolve().parent
    assert package.is_relative_to(venv.resolve()), package  # the installed copy, not the repository's src/
    for path in (where["example"], *where["modules"].values()):
        assert Path(path).resolve().is_relative_to(package / "examples" / "gpt"), path
    assert Path(where["example"]).name == "train.py" and Path(where["example"]).is_file()
    assert {"data.py", "model.py", "train.py", "train_ddp.py", "train_ddp_deadpool.py"} <= set(where["example_files"])
    assert (where["baseline_model"], where["baseline_data"]) == ("deadpool.examples.gpt.model",
                                                                 "deadpool.examples.gpt.data")
    assert "usage: deadpool bench recovery" in run(deadpool, "bench", "recovery", "--help")
    assert "usage: deadpool bench overhead" in run(deadpool, "bench", "overhead", "--help")
    # The README's demo, run from the installed package, shortened: rank 1 SIGKILLed in step 2's backward pass,
    # its spare takes over, and the run ends bit for bit as the same job without the failure.
    printed = run(deadpool, "demo", "--workers", "2", "--spares", "1", "--steps", "4", "--fail-at", "2",
                  "--fail-rank", "1", "--out", str(tmp_path / "demo"))
    summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
    assert (summary["exit_code"], summary["final_step"], summary["swaps"]) == (0, 4, 1)
    assert [r["failed_rank"] for r in summary["recoveries"]] == [1] and summary["faults_not_fired"] == []
    assert summary["bitwise_equal"] and summary["loss_sequence_equal"]
    assert summary["final_state_sha256"] == summary["reference_state_sha256"]
    reference = json.loads((tmp_path / "demo" / "reference" / "summary.json").read_text())
    assert (reference["swaps"], reference["final_state_sha256"]) == (0, summary["final_state_sha256"])
    assert "bitwise_equal: true" in printed and "recovery in generation 1: " in printed
