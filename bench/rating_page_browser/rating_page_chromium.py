"""The rating page in a real browser: headless Chromium (through chromedriver's WebDriver API)
against `python -m tools.ratings serve`, as a rater and as the seed's trainer client use it.

    apt-get install chromium chromium-driver      # once
    python bench/rating_page_browser/rating_page_chromium.py \
        | tee bench/rating_page_browser/rating_page_chromium.log

It rates a group through the page's own form at a phone's width (so the CSP's form-action and the
303 redirect are the browser's to allow), has a second tab send the same group (the ?taken= note
and its 15 s reload), submits a question as the seed's client does and rates it on the page, and
prints the browser console (a CSP refusal would show there). Screenshots go to the temp folder.
"""
import base64
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from files import jsonl  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(url: str, method: str = "GET", body=None):
    req = urllib.request.Request(url, method=method, headers={"Content-Type": "application/json"},
                                 data=None if body is None else json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def wd(url: str, method: str = "GET", body=None):
    """A WebDriver command: its reply's value."""
    return call(url, method, body)["value"]


def main() -> None:
    tmp = Path(tempfile.mkdtemp())
    folder, page_port, drv_port = tmp / "ratings", free_port(), free_port()
    jsonl.append(folder / "queue.jsonl", [
        {"id": f"t{i}", "batch": 1, "prompt": "Write a screening question for a Go backend role.",
         "completion": c, "criteria": ["relevance", "clarity"], "scale": [1, 5], "time": 0}
        for i, c in enumerate(["What does a goroutine cost? <b>bold?</b>", "\nA new line", "  "])])
    procs = [subprocess.Popen(["chromedriver", f"--port={drv_port}"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL),
             subprocess.Popen([sys.executable, "-m", "tools.ratings", "serve", "--dir",
                               str(folder), "--port", str(page_port)], cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)]
    page, drv = f"http://127.0.0.1:{page_port}", f"http://127.0.0.1:{drv_port}"
    time.sleep(2)
    try:
        # a phone's width
        opts = {"args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=412,915"
                         ]}
        s = drv + "/session/" + wd(drv + "/session", "POST", {"capabilities": {"alwaysMatch": {
            "browserName": "chrome", "goog:loggingPrefs": {"browser": "ALL"},
            "goog:chromeOptions": opts}}})["sessionId"]

        def go(url):
            wd(s + "/url", "POST", {"url": url})
            time.sleep(0.5)

        def found(css):
            return wd(s + "/elements", "POST", {"using": "css selector", "value": css})

        def rate_all(value):
            for el in found(f'input[type=radio][value="{value}"]') + found("button[type=submit]"):
                wd(s + f"/element/{next(iter(el.values()))}/click", "POST", {})
            time.sleep(0.5)

        def shot(name):
            (tmp / f"{name}.png").write_bytes(base64.b64decode(wd(s + "/screenshot")))

        go(page + "/")
        source = wd(s + "/source")
        print("page:", wd(s + "/title"), "| radios:", len(found("input[type=radio]")),
              "| model output escaped:", "&lt;b&gt;bold?&lt;/b&gt;" in source,
              "| empty answer said:", "(empty answer)" in source)
        shot("1_page")
        first = wd(s + "/window")
        wd(s + "/window/new", "POST", {"type": "tab"})
        second = next(h for h in wd(s + "/window/handles") if h != first)
        wd(s + "/window", "POST", {"handle": second})
        go(page + "/")
        wd(s + "/window", "POST", {"handle": first})
        rate_all(4)
        print("first tab saved, now at:", wd(s + "/url"), "|", wd(s + "/title"))
        wd(s + "/window", "POST", {"handle": second})
        rate_all(2)
        source = wd(s + "/source")
        print("second tab, same group, now at:", wd(s + "/url"), "| note:",
              "had been rated by someone else" in source, "| reloads to / in 15 s:",
              'content="15; url=/"' in source)
        shot("2_taken")
        rid = str(uuid.uuid4())
        print("seed client submits:", call(page + "/api/queue/submit", "POST", {
            "request_id": rid, "question": "Explain Go's escape analysis.",
            "role_context": "Senior Go engineer", "role_id": "r1"}))
        go(page + "/")
        print("the page shows it:", "escape analysis" in wd(s + "/source"))
        shot("3_submitted")
        rate_all(5)
        print("seed client polls:", call(page + f"/api/queue/result/{rid}"))
        print("browser console:", [m["message"] for m in wd(s + "/se/log", "POST",
                                                                 {"type": "browser"})] or "empty")
        wd(s, "DELETE")
    finally:
        for p in procs:
            p.terminate()
    print("server log:", procs[1].stderr.read().strip().replace("\n", "\n  "))
    print("ratings.jsonl:", len((folder / "ratings.jsonl").read_text().splitlines()), "lines;",
          "screenshots in", tmp)


if __name__ == "__main__":
    main()
