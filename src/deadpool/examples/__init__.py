"""The example GPT, shipped inside the package so that `deadpool demo` and `deadpool bench` run from any install.

`gpt` is a link to the repository's examples/gpt, the one copy of the example: a clone reads and runs it
there, and a wheel carries it as this package (setuptools follows the link when it builds).
"""

from pathlib import Path

GPT_DIR = (Path(__file__).parent / "gpt").resolve()  # the example's directory: its scripts run by path
