"""`vllm serve`'s start-up, as the end-to-end tests wait for it
(``launch.wait_until_healthy``): a server whose engine met ``PORT_TAKEN``
is started again once; any other death, or a second one, fails the wait
with the server's log. A stand-in server plays `vllm serve`: it dies as told
on its first starts, then answers /health."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from vllm_afd_dev.harness.generate import free_port
from vllm_afd_dev.harness.launch import PORT_TAKEN, wait_until_healthy

# argv: port, a file counting the starts, how many starts die, their last words
STAND_IN = """
import http.server, sys
from pathlib import Path
port, starts, deaths, words = int(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
n = int(starts.read_text() or 0) + 1 if starts.exists() else 1
starts.write_text(str(n))
if n <= deaths:
    print(words, flush=True)
    sys.exit(1)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def start(tmp_path: Path, deaths: int, words: str) -> tuple[subprocess.Popen, int, Path]:
    port, log = free_port(), tmp_path / "serve.log"
    args = [sys.executable, "-c", STAND_IN, str(port), str(tmp_path / "starts"), str(deaths), words]
    with log.open("w") as sink:
        return subprocess.Popen(args, stdout=sink, stderr=subprocess.STDOUT), port, log


def test_a_server_whose_port_was_taken_is_started_again(tmp_path):
    first, port, log = start(tmp_path, deaths=1, words=f"DistNetworkError: {PORT_TAKEN}")
    server = wait_until_healthy(first, port, log, timeout_s=60)
    try:
        assert server is not first and server.poll() is None
        assert (tmp_path / "starts").read_text() == "2"
        assert "== started again" in log.read_text()
    finally:
        server.kill()


@pytest.mark.parametrize(
    "deaths, words", [(1, "ValueError: a wrong engine argument"), (2, PORT_TAKEN)],
    ids=["another cause", "taken twice"],
)  # fmt: skip
def test_any_other_death_fails_the_wait_with_the_log(tmp_path, deaths, words):
    server, port, log = start(tmp_path, deaths, words)
    with pytest.raises(AssertionError, match=words):
        wait_until_healthy(server, port, log, timeout_s=60)
    assert (tmp_path / "starts").read_text() == str(deaths)
