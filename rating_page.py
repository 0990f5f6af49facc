"""The rating page of ratings.py: a browser page for people, and a JSON API for rating tools of your own.

    python ratings.py serve --dir runs/qgen_human/ratings    # then open http://127.0.0.1:8000

The page shows one prompt's pending completions together, newest batch first (ratings.Store's
order), each with a choice per criterion. Its form posts to /rate: `token` (the hidden field of the
page, which refuses forms from other sites), `ids` (the comma-separated item ids shown) and
`<id>.<criterion>=N` for each; a script can rate through it with curl. A rating tool of your own
(the question-generation project had a web UI with a queue API) talks JSON:

    GET  /api/pending    {"pending": [{"id", "batch", "prompt", "completion", "criteria", "scale"}, ...]}
                         newest batch first, a prompt's completions together (the page's order)
    POST /api/rate       {"ratings": [{"id": ..., "scores": {criterion: N}}, ...]}, Content-Type
                         application/json (which another site's page cannot send without asking):
                         all saved, {"saved": n}, or none, 400 {"error": why}; as the form, a rating
                         of an item rated meanwhile is skipped, not counted twice
    GET  /stats, /export the counts (JSON) and the rated items (JSON Lines), as ratings.py's commands
"""
from __future__ import annotations

import hmac
import html
import json
import secrets
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import jsonl
from ratings import Store, say, store_for

PAGE = """<!doctype html><html><head><meta charset="utf-8"><title>minigrpo ratings</title>{refresh}
<style>body{{font-family:sans-serif;max-width:52em;margin:2em auto;padding:0 1em}}
pre{{white-space:pre-wrap;background:#f4f4f4;padding:1em;border-radius:4px}}
fieldset{{border:0;padding:.3em 0}} legend{{font-weight:bold}} .err{{color:#b00}}</style></head><body>
<p>{counts} &middot; <a href="/stats">stats</a> &middot; <a href="/export">export</a></p>{body}</body></html>"""


def render_page(store: Store, token: str, error: str | None = None) -> str:
    pending = store.pending()
    counts = f"{len(pending)} to rate, {len(store.items) - len(pending)} rated"
    if not pending:
        body = "<p>Nothing to rate yet: this page reloads every 2 seconds.</p>"
        return PAGE.format(refresh='<meta http-equiv="refresh" content="2">', counts=counts, body=body)
    group = store.next_group()
    lo, hi = group[0]["scale"]

    def choices(it: dict) -> str:
        return "".join(f'<fieldset><legend>{html.escape(c)}</legend>' + " ".join(
            f'<label><input type="radio" name="{html.escape(it["id"])}.{html.escape(c)}" value="{v}" required> {v}</label>'
            for v in range(lo, hi + 1)) + "</fieldset>" for c in it["criteria"])
    answers = "".join(f"<h3>Answer {n}</h3><pre>{html.escape(it['completion'])}</pre>{choices(it)}"
                      for n, it in enumerate(group, 1))
    body = ((f'<p class="err">{html.escape(error)}</p>' if error else "")
            + f"<h3>Prompt</h3><pre>{html.escape(group[0]['prompt'])}</pre>"
            + f"<p>{len(group)} answer(s) to this prompt. {lo} = worst, {hi} = best; training learns from "
            + "how they compare, so rate them against each other.</p>"
            + f'<form method="post" action="/rate"><input type="hidden" name="token" value="{token}">'
            + f'<input type="hidden" name="ids" value="{html.escape(",".join(it["id"] for it in group))}">{answers}'
            + '<p><button type="submit">Save and next</button></p></form>')
    return PAGE.format(refresh="", counts=counts, body=body)


def page_token(dir: str | Path) -> str:
    """The form token, kept in the folder (page_token, written atomically): a page still open in a
    browser when the server restarts (after a kill, say) saves its ratings, not a 403."""
    path = Path(dir) / "page_token"
    try:
        token = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):  # none yet, or unreadable: a new one
        token = ""
    if len(token) < 16 or not (token.isascii() and token.replace("-", "").replace("_", "").isalnum()):
        token = secrets.token_urlsafe(16)
        jsonl.write_atomic(path, token + "\n")
    return token


def make_server(dir: str | Path, host: str = "127.0.0.1", port: int = 8000) -> ThreadingHTTPServer:
    """The rating page on (host, port); port 0 picks a free one (server.server_port).

    It has no login. Two guards against other web pages the rater has open: on a loopback address
    it answers only requests addressed to localhost (no DNS rebinding onto /export), and a form is
    saved only with the token of the page that showed it (no rating posted from another site)."""
    store = store_for(dir)
    token = ""  # page_token(dir), once the address is bound: a bad --port or --host leaves no folder behind
    loopback = host in ("127.0.0.1", "localhost", "::1")

    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, body: str, ctype: str = "text/html; charset=utf-8", **headers) -> None:
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            for k, v in headers.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        def _refused(self) -> bool:
            name = (self.headers.get("Host") or "").rsplit(":", 1)[0].strip("[]")
            if loopback and name not in ("127.0.0.1", "localhost", "::1"):
                self._send(403, "this page answers only at localhost", "text/plain")
                return True
            return False

        def do_GET(self) -> None:
            if self._refused():
                return
            path = self.path.split("?")[0]
            with store.lock:
                store.refresh()
                if path == "/":
                    return self._send(200, render_page(store, token))
                if path == "/stats":
                    return self._send(200, json.dumps(store.stats(), indent=1), "application/json")
                if path == "/export":
                    lines = "".join(json.dumps(r) + "\n" for r in store.rated_items())
                    return self._send(200, lines, "application/jsonl; charset=utf-8")
                if path == "/api/pending":
                    return self._send(200, json.dumps({"pending": store.pending()}), "application/json")
            self._send(404, "not found", "text/plain")

        def do_POST(self) -> None:
            if self._refused():
                return
            if self.path not in ("/rate", "/api/rate"):
                return self._send(404, "not found", "text/plain")
            try:
                length = int(self.headers.get("Content-Length") or "")
                if not 0 <= length <= 1 << 20:  # a form is a few kilobytes
                    raise ValueError
                body = self.rfile.read(length).decode()
            except ValueError:  # no or bad Content-Length, or a body that is not UTF-8
                return self._send(400, "a body with a Content-Length under 1 MB, in UTF-8", "text/plain")
            if self.path == "/api/rate":
                return self._api_rate(body)
            form = {k: v[0] for k, v in urllib.parse.parse_qs(body).items()}
            with store.lock:
                store.refresh()
                if not hmac.compare_digest(form.get("token", ""), token):
                    return self._send(403, render_page(store, token, "this form came from an older page or "
                                                       "another site: nothing saved; rate the answers below"))
                saved = store.rate(form)
                if isinstance(saved, str):
                    return self._send(400, render_page(store, token, saved))
            self._send(303, "", Location="/")

        def _api_rate(self, body: str) -> None:
            """POST /api/rate: JSON only (a cross-site page cannot send it unasked), checked as the form is."""
            def reply(code: int, obj: dict) -> None:
                self._send(code, json.dumps(obj), "application/json")
            if (self.headers.get("Content-Type") or "").split(";")[0].strip().lower() != "application/json":
                return reply(415, {"error": "send the ratings as Content-Type: application/json"})
            try:
                given = json.loads(body)["ratings"]
                form = {"ids": ",".join(r["id"] for r in given)}
                for r in given:
                    form |= {f"{r['id']}.{c}": json.dumps(v) for c, v in r["scores"].items()}
            except (ValueError, KeyError, TypeError, AttributeError):
                return reply(400, {"error": 'expected {"ratings": [{"id": ..., "scores": {criterion: N}}, ...]}'})
            if len({r["id"] for r in given}) < len(given):
                return reply(400, {"error": "an item is rated twice in this request; send one rating per item"})
            with store.lock:
                store.refresh()
                for r in given:  # a criterion the item is not rated on is a typo, not something to drop
                    if (item := store.items.get(r["id"])) and (extra := sorted(set(r["scores"]) - set(item["criteria"]))):
                        return reply(400, {"error": f"item {r['id']!r} is rated on {item['criteria']}, not {extra[0]!r}"})
                saved = store.rate(form)
            return reply(400, {"error": saved}) if isinstance(saved, str) else reply(200, {"saved": saved})

        def log_message(self, fmt, *args) -> None:  # one line per rating, not one per page view
            if self.command == "POST":
                say(f"{self.address_string()} {fmt % args}")

    server = ThreadingHTTPServer((host, port), Handler)
    token = page_token(dir)
    return server
