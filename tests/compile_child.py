"""The compile tests' compiler process: one per test process, kept for the whole run, so each compile request pays
for the compiler, not for starting Python, torch and Triton again (3-5 s a request on the 2-core CI machine, about
fifty requests a run).

Compiling needs Triton without the interpreter, which a test process under ``TRITON_INTERPRET=1`` cannot give (the
choice is made when ``@triton.jit`` runs, at import): the child runs with :func:`compiler_env`. Run as a script it
serves requests, one JSON line each on stdin: ``{"argv": [...]}`` runs ``python -m fmoe2.codegen`` with those
arguments, ``{"script": "..."}`` runs a script as ``python -c`` would (in fresh globals). Each answer is one JSON line
on stdout: ``{"rc", "stdout", "stderr"}``, as a child process of its own would have given them.
"""
import atexit
import contextlib
import io
import json
import os
import select
import subprocess
import sys
import tempfile
import traceback
from typing import List, Optional


def compiler_env() -> dict:
    """No interpreter, and no visible GPU: the configs compiled are the shipped defaults on every machine (tuned files
    are picked by measured time)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


class CompilerProcess:
    """The child serving compile requests; started on the first request, started again after it dies (its stderr
    written directly, by the compiler or a crash, in the answer of the request it died in)."""

    def __init__(self):
        self.proc: Optional[subprocess.Popen] = None
        self.stderr_file = None

    def _start(self):
        if self.stderr_file is not None:
            self.stderr_file.close()
        self.stderr_file = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.stderr_file, text=True, env=compiler_env(),
                                     cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def request(self, request: dict, timeout: float) -> subprocess.CompletedProcess:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
            line = self.proc.stdout.readline() if ready else ""
        except BrokenPipeError:  # (died before it read the request)
            ready, line = True, ""
        if not line:  # died, or past the timeout: its own stderr says why
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            self.stderr_file.seek(0)
            why = "timed out" if not ready else f"exit status {self.proc.returncode}"
            said = self.stderr_file.read()[-4000:]
            return subprocess.CompletedProcess(request, 1, "", f"compile child {why}:\n{said}")
        answer = json.loads(line)
        return subprocess.CompletedProcess(request, answer["rc"], answer["stdout"], answer["stderr"])

    def close(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()  # (it ends at the end of its input)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


_CHILD = CompilerProcess()
atexit.register(_CHILD.close)


def run_codegen(argv: List[str], timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m fmoe2.codegen *argv`` in the compile child."""
    return _CHILD.request({"argv": list(argv)}, timeout)


def run_script(script: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -c script`` in the compile child."""
    return _CHILD.request({"script": script}, timeout)


def _serve():
    # The answers get their own descriptor; what the compiler's tools write to descriptor 1 goes to stderr instead
    # of into an answer.
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = os.fdopen(1, "w", closefd=False)
    for line in sys.stdin:
        request = json.loads(line)
        out, err = io.StringIO(), io.StringIO()
        rc = 0
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                if "argv" in request:
                    from fmoe2.codegen import main

                    rc = main(request["argv"])
                else:
                    exec(compile(request["script"], "<string>", "exec"), {"__name__": "__main__"})
            except SystemExit as error:  # (argparse's errors: status 2)
                rc = error.code if isinstance(error.code, int) else 0 if error.code is None else 1
            except Exception:
                traceback.print_exc()
                rc = 1
        answers.write(json.dumps({"rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue()}) + "\n")
        answers.flush()


if __name__ == "__main__":
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # (the repository, as for python -m)
    _serve()
