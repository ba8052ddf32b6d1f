"""The coordinator never imports torch or the runtime, and the commands do not import each other in a circle."""

import subprocess
import sys

import pytest


def imported_by(module: str) -> set[str]:
    """The modules a fresh interpreter has loaded after importing `module`."""
    code = f"import sys, {module}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return set(out.stdout.split())


@pytest.mark.parametrize("module", ["deadpool.coordinator.server", "deadpool.launcher.agent", "deadpool.protocol.store",
                                    "deadpool.protocol.secret", "deadpool.launcher.cli", "deadpool.launcher.launch",
                                    "deadpool.launcher.node"])
def test_the_coordinator_imports_neither_torch_nor_the_runtime(module):
    loaded = imported_by(module)
    assert "torch" not in loaded
    assert not {m for m in loaded if m.startswith("deadpool.runtime")}


@pytest.mark.parametrize("module", ["deadpool.demo", "deadpool.bench.recovery", "deadpool.bench.overhead"])
def test_commands_do_not_import_the_cli(module):
    assert "deadpool.launcher.cli" not in imported_by(module)
