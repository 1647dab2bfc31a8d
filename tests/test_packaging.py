"""Every shipped config file is matched by the package-data globs (else a wheel silently drops it)."""
import fnmatch
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_config_files_are_package_data():
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        text = f.read()
    globs = re.findall(r'"([^"]+)"', re.search(r'"fmoe2\.gemm" = \[([^\]]*)\]', text).group(1))
    gemm = os.path.join(ROOT, "fmoe2", "gemm")
    shipped = [os.path.relpath(os.path.join(d, f), gemm) for d, _, fs in os.walk(os.path.join(gemm, "configs"))
               for f in fs if f.endswith(".json")]
    assert len(shipped) >= 7  # defaults + tuned files for two GPUs
    def matches(path, glob):  # setuptools globs: "*" stays within one folder
        parts, pattern = path.split(os.sep), glob.split("/")
        return len(parts) == len(pattern) and all(fnmatch.fnmatch(a, b) for a, b in zip(parts, pattern))

    missing = [p for p in shipped if not any(matches(p, g) for g in globs)]
    assert not missing, f"not in package data: {missing}"
