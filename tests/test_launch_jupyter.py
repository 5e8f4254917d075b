"""`make notebooks` (issue 54): JupyterLab starts (as root too), serves the repository root, so an
exercise notebook is reachable through Jupyter's contents API, and stops. About 5 s."""

import json
import os
import secrets
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXERCISE = "exercises/01_naive_vs_cached.ipynb"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get(url: str, token: str) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"token {token}"})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def test_make_notebooks_serves_the_exercises(tmp_path):
    port, token = _free_port(), secrets.token_hex(16)
    args = (
        f"--no-browser --ip=127.0.0.1 --port={port} --ServerApp.port_retries=0 "
        f"--IdentityProvider.token={token}"
    )
    log = tmp_path / "jupyter.log"
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime")}
    # -o: the recipe itself, never a reinstall because requirements.txt is newer than .venv
    with open(log, "wb") as out:
        server = subprocess.Popen(
            ["make", "--no-print-directory", "-o", ".venv/.installed", "notebooks",
             f"JUPYTER_ARGS={args}"],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert server.poll() is None, f"make notebooks exited:\n{log.read_text()[-3000:]}"
            try:
                if _get(f"{base}/api/status", token)[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"no server after 60 s:\n{log.read_text()}"
            time.sleep(0.2)
        status, body = _get(f"{base}/api/contents/{EXERCISE}", token)
        assert status == 200, f"GET {EXERCISE}: HTTP {status}: {body[:300]!r}"
        model = json.loads(body)
        assert model["type"] == "notebook" and model["path"] == EXERCISE
        on_disk = json.loads((ROOT / EXERCISE).read_text())
        assert len(model["content"]["cells"]) == len(on_disk["cells"])
        # the repository root is served: the chapters and the solutions beside the exercises
        listing = json.loads(_get(f"{base}/api/contents/", token)[1])
        names = {item["name"] for item in listing["content"]}
        assert {"notebooks", "exercises", "solutions"} <= names, names
        # chapter 1 opens in JupyterLab's document view
        chapter = "lab/tree/notebooks/01_naive_vs_cached.ipynb"
        assert _get(f"{base}/{chapter}", token)[0] == 200
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
