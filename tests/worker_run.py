"""Run a test worker module (`python -m tests.<module>`) in a subprocess with forced CPU devices and
read the JSON line it prints last: the multi-device parity tests' one way to start their workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def run_json_worker(module: str, *args: str, devices: int, timeout: int = 900) -> Any:
    """`module`'s last stdout line, parsed; a non-zero exit fails the test with the worker's stderr."""
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", f"tests.{module}", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
