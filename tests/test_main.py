"""The README's main job runs and verifies itself."""
import os
import subprocess
import sys


def test_main_job_verifies_a_forward():
    proc = subprocess.run([sys.executable, "-m", "fmoe2"], capture_output=True, text=True, timeout=900,
                          env=dict(os.environ))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("OK")
    assert proc.stdout.count("OK") >= 3
