"""How commands end: Ctrl-C while a ``python -m`` command is still importing its modules."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# The command runs as `python -m` runs it, with Ctrl-C arriving while it imports torch: Python raises
# KeyboardInterrupt wherever the main thread is when SIGINT comes.
INTERRUPTED_IMPORT = """
import runpy, sys

command = sys.argv[1]

class CtrlC:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            raise KeyboardInterrupt
        return None

sys.meta_path.insert(0, CtrlC())
sys.argv = [command, "--help"]
runpy.run_module(command, run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("command", ["traincore.stage", "traincore.train", "traincore.export",
                                     "traincore.evaluate", "traincore.registry"])
def test_ctrl_c_while_a_command_imports_torch_is_one_line_and_exit_130(command):
    result = subprocess.run([sys.executable, "-c", INTERRUPTED_IMPORT, command], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout) == (130, ""), result.stderr
    assert result.stderr == f"interrupted: {command} stopped while starting, nothing was written\n"
