"""The protocol package never imports torch: the coordinator, the agents and `deadpool status` use it."""

import pkgutil
import subprocess
import sys

import deadpool.protocol


def test_no_protocol_module_imports_torch():
    modules = [f"deadpool.protocol.{m.name}" for m in pkgutil.iter_modules(deadpool.protocol.__path__)]
    assert {"deadpool.protocol.plane", "deadpool.protocol.records", "deadpool.protocol.keys"} <= set(modules)
    code = f"import sys; import {', '.join(modules)}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"
