"""Tests for rating_server.py under a real uvicorn (what the test client cannot show): a client that
stops reading, never sends, or never finishes its body is dropped after the timeout and blocks no
one meanwhile; `python -m tools.ratings serve` starts, answers and stops on Ctrl-C, and refuses
what it cannot use, leaving nothing behind."""
import contextlib
import fcntl
import http.client
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from files import jsonl
from graders import ratings
from rating_client import needs_page
from tools import ratings as ratings_cmd

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def page_libs():
    needs_page()
    ratings._STORES.clear()
    yield
    ratings._STORES.clear()


@contextlib.contextmanager
def running(folder, timeout_s: float = 30.0):
    """The page served by uvicorn in a thread on a free port; yields the port."""
    from graders import rating_server
    sock = rating_server.listen("127.0.0.1", 0)
    server = rating_server.uvicorn_server(folder, timeout_s=timeout_s)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)


def status(port: int, path: str = "/stats") -> int:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", path)
    code = c.getresponse().status
    c.close()
    return code


def raw(port: int, request: bytes) -> socket.socket:
    """A connection that sent `request`; its receive buffer small (fixed, not grown by the kernel to
    as much as 32 MB), so a reply of a few MB fills it when it does not read."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
    s.settimeout(10)
    s.connect(("127.0.0.1", port))
    s.sendall(request)
    return s


def read_all(s: socket.socket) -> bytes:
    out = b""
    while chunk := s.recv(1 << 16):
        out += chunk
    return out


def test_a_client_that_stops_reading_is_dropped_after_the_timeout_and_blocks_no_one(tmp_path):
    folder = tmp_path / "r"
    # big enough that /export fills the socket's buffers (about 12 MB)
    jsonl.append(folder / "queue.jsonl", [
        {"id": f"i{i}", "batch": 1, "prompt": "p" * 2000, "completion": "c" * 2000,
         "criteria": ["overall"], "scale": [1, 5], "time": 0} for i in range(3000)])
    jsonl.append(folder / "ratings.jsonl",
                 [{"id": f"i{i}", "scores": {"overall": 3}} for i in range(3000)])
    with running(folder, timeout_s=1.0) as port:
        # and never reads
        stalled = raw(port, f"GET /export HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
        time.sleep(0.5)
        t0 = time.monotonic()
        assert status(port) == 200 and time.monotonic() - t0 < 5
        time.sleep(2.5)  # past the timeout: the reply was cut, the connection closed
        got = read_all(stalled)
        head, _, body = got.partition(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        assert length > 10_000_000 and len(body) < length
        assert status(port) == 200


def test_a_connection_that_sends_nothing_or_half_a_body_is_closed_after_the_timeout(tmp_path):
    with running(tmp_path / "r", timeout_s=0.5) as port:
        silent = raw(port, b"")
        half = raw(port, f"POST /rate HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 10"
                         "\r\n\r\ntoken=".encode())
        t0 = time.monotonic()
        assert read_all(silent) == b"" and time.monotonic() - t0 < 5
        assert read_all(half).startswith(b"HTTP/1.1 408 ")
        # a Content-Length that is not one: refused by the HTTP parser itself
        bad = raw(port, f"POST /rate HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: -1"
                        "\r\n\r\nx".encode())
        assert read_all(bad).startswith(b"HTTP/1.1 400 ")
        assert status(port) == 200


def test_serve_starts_answers_and_stops_on_ctrl_c(tmp_path):
    """Bound to every address it says so (the page has no login), and answers them at an IP."""
    proc = subprocess.Popen([sys.executable, "-m", "tools.ratings", "serve", "--dir",
                             str(tmp_path / "r"), "--port", "0", "--host", "0.0.0.0"], cwd=ROOT,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line = proc.stdout.readline()  # rating page: http://0.0.0.0:PORT/  (folder ...)
        port = int(line.split("0.0.0.0:")[1].split("/")[0])
        assert status(port, "/") == 200 and status(port, "/api/queue/pending") == 200
        token = (tmp_path / "r" / "page_token").read_text().strip()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) == 0
    finally:
        proc.kill()
    err = proc.stderr.read()
    assert "warning: --host 0.0.0.0 lets anyone who can reach this machine rate" in err
    assert token not in err and token not in line  # the token is never logged


def test_serve_refuses_what_it_cannot_use_and_leaves_nothing_behind(tmp_path, capsys):
    (tmp_path / "queue.jsonl").write_text("")
    # a file, not a folder
    assert ratings_cmd.main(["serve", "--dir", str(tmp_path / "queue.jsonl"), "--port", "0"]) == 2
    assert "cannot use" in capsys.readouterr().err
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = str(taken.getsockname()[1])
        for argv, says in ((["--port", "99999"], "is not a port"),
                           (["--host", "no.such.host.invalid"], "check --host"),
                           (["--port", port], "the port is taken: pick another --port")):
            assert ratings_cmd.main(["serve", "--dir", str(tmp_path / "new" / "deeper"),
                                     *argv]) == 2
            # nothing left behind
            assert says in capsys.readouterr().err and not (tmp_path / "new").exists()


def test_a_second_server_on_one_folder_is_refused(tmp_path, capsys):
    """Two servers would each skip only the items rated through themselves: one item rated twice."""
    (tmp_path / "r").mkdir()
    with open(tmp_path / "r" / "serve.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert ratings_cmd.main(["serve", "--dir", str(tmp_path / "r"), "--port", "0"]) == 2
    assert "another `python -m tools.ratings serve` is using" in capsys.readouterr().err
