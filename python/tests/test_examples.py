"""The examples of examples/python run as tests: each exits 0 only when the cache agrees with its oracle."""
import os
import subprocess
import sys

import pytest

from conftest import EXAMPLES


@pytest.mark.parametrize("name", ["attention_decode.py", "tiny_runtime.py"])
def test_example(name):
    r = subprocess.run([sys.executable, os.path.join(EXAMPLES, name)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "cache == recompute" in r.stdout
