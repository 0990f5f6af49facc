"""The rating page of ratings.py: a browser page for people, a JSON API for your own rating tools.

    python -m tools.ratings serve --dir runs/qgen_human/ratings  # then open http://127.0.0.1:8000

The page shows one prompt's pending completions together, newest batch first (ratings.Store's
order), each with a choice per criterion. Its form posts to /rate: `token` (the hidden field of the
page, which refuses forms from other sites), `ids` (the comma-separated item ids shown) and
`<id>.<criterion>=N` for each; a script can rate through it with curl. A rating tool of your own
(the question-generation project had a web UI with a queue API) talks JSON:

    GET  /api/pending    {"pending": [{"id", "batch", "prompt", "completion", "criteria", "scale"},
                         ...]}, newest batch first, a prompt's completions together (page order)
    POST /api/rate       {"ratings": [{"id": ..., "scores": {criterion: N}}, ...]}, Content-Type
                         application/json (which another site's page cannot send without asking):
                         all saved, {"saved": n}, or none, 400 {"error": why} (507 when the ratings
                         folder cannot be written); as the form, a rating of an item rated meanwhile
                         is skipped, not counted twice
    GET  /stats, /export the counts (JSON) and the rated items (JSON Lines; /export?format=parquet:
                         Parquet), as ratings.py's commands

Requests are answered only when addressed to an IP address, localhost, the --host name or a name
given with --allow-host (no DNS rebinding of another site's name onto the page); a client that stops
reading holds its own thread for at most 30 s, never the others' (replies are sent outside the
store's lock).
"""
from __future__ import annotations

import hmac
import html
import ipaddress
import json
import os
import secrets
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from graders.ratings import Store, parquet_bytes, say, store_for
from plumbing import jsonl

PAGE = """<!doctype html><html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width,initial-scale=1">\
<title>{title}minigrpo ratings</title>{refresh}
<style>body{{font-family:sans-serif;max-width:52em;margin:2em auto;padding:0 1em}}
pre{{white-space:pre-wrap;overflow-wrap:anywhere;background:#f4f4f4;padding:1em;border-radius:4px}}
label{{display:inline-block;padding:.4em .5em}}\
 input[type=radio]{{width:1.2em;height:1.2em;vertical-align:middle}}
fieldset{{border:0;padding:.3em 0}} legend{{font-weight:bold}} .err{{color:#b00}}\
</style></head><body>
<p>{counts} &middot; <a href="/stats">stats</a> &middot; <a href="/export">export</a></p>\
{body}</body></html>"""


def render_page(store: Store, token: str, error: str | None = None, note: str | None = None) -> str:
    pending = store.pending()
    counts = f"{len(pending)} to rate, {len(store.items) - len(pending)} rated"
    said = ((f'<p class="err">{html.escape(error)}</p>' if error else "")
            + (f"<p>{html.escape(note)}</p>" if note else ""))
    if not pending:
        body = said + "<p>Nothing to rate yet: this page reloads every 2 seconds.</p>"
        wait = 15 if note or error else 2  # time to read it; the reload drops ?taken= from the URL
        return PAGE.format(title="", refresh=f'<meta http-equiv="refresh" content="{wait}; url=/">',
                           counts=counts, body=body)
    group = store.next_group()
    lo, hi = group[0]["scale"]

    def choices(it: dict) -> str:
        return "".join(f'<fieldset><legend>{html.escape(c)}</legend>' + " ".join(
            f'<label><input type="radio" name="{html.escape(it["id"])}.{html.escape(c)}" '
            f'value="{v}" required> {v}</label>'
            for v in range(lo, hi + 1)) + "</fieldset>" for c in it["criteria"])
    empty = "<em>(empty answer)</em>"
    answers = "".join(f"<h3>Answer {n}</h3><pre>\n"
                      f"{html.escape(it['completion']) if it['completion'].strip() else empty}"
                      f"</pre>{choices(it)}" for n, it in enumerate(group, 1))
    body = (said + f"<h3>Prompt</h3><pre>{html.escape(group[0]['prompt'])}</pre>"
            + f"<p>{len(group)} answer(s) to this prompt. {lo} = worst, {hi} = best; training "
            + "learns from how they compare, so rate them against each other.</p>"
            + '<form method="post" action="/rate">'
            + f'<input type="hidden" name="token" value="{token}"><input type="hidden" name="ids" '
            + f'value="{html.escape(",".join(it["id"] for it in group))}">{answers}'
            + '<p><button type="submit">Save and next</button></p></form>')
    return PAGE.format(title=f"({len(pending)}) ", refresh="", counts=counts, body=body)


def page_token(dir: str | Path) -> str:
    """The form token, kept in the folder (page_token, written atomically): a page still open in a
    browser when the server restarts (after a kill, say) saves its ratings, not a 403."""
    path = Path(dir) / "page_token"
    try:
        token = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):  # none yet, or unreadable: a new one
        token = ""
    if len(token) < 16 or not (token.isascii()
                               and token.replace("-", "").replace("_", "").isalnum()):
        token = secrets.token_urlsafe(16)
        jsonl.write_atomic(path, token + "\n")
        os.chmod(path, 0o600)  # the owner's: another user on the machine cannot post with it
    return token


def _printable(text: str) -> str:
    """A request line as the log shows it: control characters (terminal escape codes) as \\x.."""
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text)


def host_allowed(host_header: str | None, allow: tuple[str, ...] = ()) -> bool:
    """A Host header the page answers: an IP address (a rebinding attack needs a name it controls),
    localhost, or a name in `allow` (--allow-host).

    >>> (host_allowed("127.0.0.1:8000"), host_allowed("[::1]:8000"), host_allowed("evil.example"),
    ...  host_allowed("box", ("box",)))
    (True, True, False, True)
    """
    name = (host_header or "").strip()
    name = (name[1:].split("]")[0] if name.startswith("[")
            else name.rsplit(":", 1)[0] if name.count(":") == 1 else name)
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return name.lower() in ("localhost", *(a.lower() for a in allow))


NOT_SAVED = "nothing saved:"


def _rate(store, form: dict) -> int | str:
    """store.rate, with a write that failed (a full disk) as a message for the rater instead of a
    dropped connection."""
    try:
        return store.rate(form)
    except OSError as e:
        msg = (f"{NOT_SAVED} the ratings folder {store.dir} cannot be written ({e.strerror or e}); "
               "tell whoever runs the page")
        say(msg)
        return msg


def make_server(dir: str | Path, host: str = "127.0.0.1", port: int = 8000,
                allow_hosts: tuple[str, ...] = ()) -> ThreadingHTTPServer:
    """The rating page on (host, port); port 0 picks a free one (server.server_port).

    It has no login. Two guards against other web pages the rater has open: it answers only requests
    addressed to an IP address, localhost, the host it was given or an allow_hosts name (no DNS
    rebinding onto /export), and a form is saved only with the token of the page that showed it (no
    rating posted from another site); frames are refused (no clickjacking)."""
    store = store_for(dir)
    token = ""  # page_token(dir) once the address is bound: a bad --port or --host leaves no folder
    allow = (host, *allow_hosts)

    class Handler(BaseHTTPRequestHandler):
        timeout = 30  # a client that stops reading (or never sends) gives up its thread after this

        def _send(self, code: int, body: str | bytes, ctype: str = "text/html; charset=utf-8",
                  **headers) -> None:
            # a lone surrogate: ?, not a crash
            data = body if isinstance(body, bytes) else body.encode("utf-8", "replace")
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("X-Frame-Options", "DENY")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Content-Security-Policy", "default-src 'none'; style-src "
                             "'unsafe-inline'; form-action 'self'; frame-ancestors 'none'")
            for k, v in headers.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        def _refused(self) -> bool:
            if not host_allowed(self.headers.get("Host"), allow):
                self._send(403, "this page answers at an IP address, localhost or a name given "
                           "with python -m tools.ratings serve --allow-host", "text/plain")
                return True
            return False

        def do_GET(self) -> None:
            if self._refused():
                return
            path, _, query = self.path.partition("?")
            # the reply is built under the lock and sent after it: a slow reader holds only itself
            with store.lock:
                store.refresh()
                if path == "/":
                    taken = urllib.parse.parse_qs(query).get("taken", ["0"])[0]
                    note = (f"{taken} of the answers you rated had been rated by someone else "
                            "meanwhile; theirs was kept, yours was not saved"
                            if taken.isdigit() and taken != "0" else None)
                    reply = (200, render_page(store, token, note=note), "text/html; charset=utf-8")
                elif path == "/stats":
                    reply = (200, json.dumps(store.stats(), indent=1), "application/json")
                elif path == "/export" and (fmt := urllib.parse.parse_qs(query).get(
                        "format", ["jsonl"])[0].lower()) not in ("jsonl", "json", "parquet"):
                    reply = (400, f"format={fmt}: jsonl (the default) or parquet",
                             "text/plain; charset=utf-8")
                elif path == "/export" and fmt == "parquet":
                    try:
                        reply = (200, parquet_bytes(store.rated_items()),
                                 "application/vnd.apache.parquet",
                                 {"Content-Disposition": 'attachment; filename="rated.parquet"'})
                    except ValueError as e:
                        reply = (409, str(e), "text/plain; charset=utf-8")
                elif path == "/export":
                    reply = (200, "".join(json.dumps(r) + "\n" for r in store.rated_items()),
                             "application/jsonl; charset=utf-8",
                             {"Content-Disposition": 'attachment; filename="rated.jsonl"'})
                elif path == "/api/pending":
                    reply = (200, json.dumps({"pending": store.pending()}), "application/json")
                else:
                    reply = (404, "not found", "text/plain")
            self._send(*reply[:3], **(reply[3] if len(reply) > 3 else {}))

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
                return self._send(400, "a body with a Content-Length under 1 MB, in UTF-8",
                                  "text/plain")
            if self.path == "/api/rate":
                return self._api_rate(body)
            form = {k: v[0] for k, v in urllib.parse.parse_qs(body).items()}
            with store.lock:
                store.refresh()
                location = None
                if not hmac.compare_digest(form.get("token", "").encode(), token.encode()):
                    code, page = 403, render_page(store, token, "this form came from an older "
                                                  "page or another site: nothing saved; rate "
                                                  "the answers below")
                elif isinstance(saved := _rate(store, form), str):
                    code, page = (507 if saved.startswith(NOT_SAVED) else 400,
                                  render_page(store, token, saved))
                else:  # items someone else rated meanwhile were skipped: the next page says so
                    asked = len(set(filter(None, form.get("ids", "").split(","))))
                    code, page, location = (303, "",
                                            f"/?taken={asked - saved}" if saved < asked else "/")
            self._send(code, page, **({"Location": location} if location else {}))

        def _api_rate(self, body: str) -> None:
            """POST /api/rate: JSON only (a cross-site page cannot send it unasked), checked as the
            form is."""
            def reply(code: int, obj: dict) -> None:
                self._send(code, json.dumps(obj), "application/json")
            if ((self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
                    != "application/json"):
                return reply(415, {"error": "send the ratings as Content-Type: application/json"})
            try:
                given = json.loads(body)["ratings"]
                form = {"ids": ",".join(r["id"] for r in given)}
                for r in given:
                    form |= {f"{r['id']}.{c}": json.dumps(v) for c, v in r["scores"].items()}
            except (ValueError, KeyError, TypeError, AttributeError,
                    RecursionError):  # RecursionError: [[[[...
                return reply(400, {"error": 'expected {"ratings": [{"id": ..., "scores": '
                                            '{criterion: N}}, ...]}'})
            if len({r["id"] for r in given}) < len(given):
                return reply(400, {"error": "an item is rated twice in this request; "
                                            "send one rating per item"})
            with store.lock:
                store.refresh()
                extra = next(((r["id"], item["criteria"], bad[0]) for r in given
                              if (item := store.items.get(r["id"]))
                              and (bad := sorted(set(r["scores"]) - set(item["criteria"])))), None)
                # a criterion not rated on: a typo, not dropped
                saved = _rate(store, form) if extra is None else None
            if extra is not None:
                return reply(400, {"error": f"item {extra[0]!r} is rated on {extra[1]}, "
                                            f"not {extra[2]!r}"})
            if isinstance(saved, str):
                return reply(507 if saved.startswith(NOT_SAVED) else 400, {"error": saved})
            return reply(200, {"saved": saved})

        def log_message(self, fmt, *args) -> None:  # one line per rating, not one per page view
            if self.command == "POST":
                say(f"{self.address_string()} {_printable(fmt % args)}")

    server = ThreadingHTTPServer((host, port), Handler)
    token = page_token(dir)
    return server
