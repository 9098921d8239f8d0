"""gpu_shapes_e2e.py (the GPU check's MLA and hybrid-group end to end) run
here on the host backend, so that the script the GPU machine runs is known
to work before a GPU is lent: the same layouts, placements, two processes
and byte comparison, over CPU memory."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
from conftest import kvtierd_path

HERE = pathlib.Path(__file__).resolve().parent


def test_the_gpu_checks_shapes_end_to_end_passes_on_the_host_backend() -> None:
    pytest.importorskip("torch")
    out = subprocess.run(
        [sys.executable, str(HERE / "gpu_shapes_e2e.py"), str(kvtierd_path()), "--host"],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "shapes e2e: PASS" in out.stdout
    assert "every byte matches" in out.stdout
