"""The rating page of ratings.py: its HTML and form, and a JSON API for your own rating tools.

    python -m tools.ratings serve --dir runs/qgen_human/ratings  # then open http://127.0.0.1:8000

Each route is a function of the ratings Store returning a Reply (status, body, type, headers), in
the standard library alone; rating_server.py serves them with Starlette under uvicorn (the
`ratings` extra), calling each under the store's lock, and adds what every request gets: the Host
check, the size limit, timeouts and security headers. The seed's queue API is rating_queue.py.

The page shows one prompt's pending completions together, newest batch first (ratings.Store's
order), each with a choice per criterion. Its form posts to /rate: `token` (the hidden field of the
page, which refuses forms from other sites), `ids` (the comma-separated item ids shown) and
`<id>.<criterion>=N` for each; a script can rate through it with curl. A rating tool of your own
talks JSON:

    GET  /api/pending    {"pending": [{"id", "batch", "prompt", "completion", "criteria", "scale"},
                         ...]}, newest batch first, a prompt's completions together (page order)
    POST /api/rate       {"ratings": [{"id": ..., "scores": {criterion: N}}, ...]}, Content-Type
                         application/json (which another site's page cannot send without asking):
                         all saved, {"saved": n}, or none, 400 {"error": why} (507 when the ratings
                         folder cannot be written); as the form, a rating of an item rated meanwhile
                         is skipped, not counted twice
    GET  /stats, /export the counts (JSON) and the rated items (JSON Lines; /export?format=parquet:
                         Parquet; ?format=json: one JSON list), as ratings.py's commands
    GET  /api/export     the seed UI's route: ?format=json (the default: one JSON list) or
                         ?format=parquet, or jsonl
"""
from __future__ import annotations

import hmac
import html
import ipaddress
import json
import os
import secrets
import urllib.parse
from pathlib import Path

from files import jsonl
from graders.ratings import Store, parquet_bytes, say

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


def printable(text: str) -> str:
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


# --- the routes: each (store, ...) -> Reply, called under store.lock after store.refresh() -----
Reply = tuple  # (status, body: str | bytes, content type, extra headers: dict)
HTML, TEXT, JSON = "text/html; charset=utf-8", "text/plain; charset=utf-8", "application/json"
NOT_SAVED = "nothing saved:"


def json_reply(code: int, obj: dict) -> Reply:
    """A JSON reply, ASCII-escaped: a lone surrogate in model output cannot break its encoding."""
    return code, json.dumps(obj), JSON, {}


def _rate(store: Store, form: dict) -> int | str:
    """store.rate, with a write that failed (a full disk) as a message for the rater instead of a
    dropped connection."""
    try:
        return store.rate(form)
    except OSError as e:
        msg = (f"{NOT_SAVED} the ratings folder {store.dir} cannot be written ({e.strerror or e}); "
               "tell whoever runs the page")
        say(msg)
        return msg


def page(store: Store, token: str, taken: str = "0") -> Reply:
    """GET /: the next group; ?taken=N (the redirect after a form) says N of the answers rated had
    been rated by someone else meanwhile."""
    note = (f"{taken} of the answers you rated had been rated by someone else meanwhile; theirs "
            "was kept, yours was not saved" if taken.isdigit() and taken != "0" else None)
    return 200, render_page(store, token, note=note), HTML, {}


def stats(store: Store) -> Reply:
    """GET /stats: the counts and mean scores, as `tools.ratings stats` prints them."""
    return 200, json.dumps(store.stats(), indent=1), JSON, {}


EXPORTS = {"jsonl": "application/jsonl; charset=utf-8", "json": JSON,
           "parquet": "application/vnd.apache.parquet"}  # ?format= -> its Content-Type


def export(store: Store, fmt: str = "jsonl") -> Reply:
    """GET /export (format jsonl by default) and /api/export (json by default, the seed UI's route):
    the rated items as JSON Lines, one JSON list (?format=json) or Parquet (?format=parquet); a
    download named rated.<format>."""
    fmt = fmt.lower()
    if fmt not in EXPORTS:
        return 400, f"format={fmt}: one of {', '.join(EXPORTS)}", TEXT, {}
    rows = store.rated_items()
    try:
        body = (parquet_bytes(rows) if fmt == "parquet" else json.dumps(rows) if fmt == "json"
                else jsonl.lines(rows))
    except ValueError as e:  # parquet_bytes: rows it cannot put in one table
        return 409, str(e), TEXT, {}
    return 200, body, EXPORTS[fmt], {"Content-Disposition":
                                     f'attachment; filename="rated.{fmt}"'}


def rate_form(store: Store, token: str, body: str) -> Reply:
    """POST /rate: the page's form, saved only with the page's token; then a redirect to the next
    group (303), saying how many answers someone else had rated meanwhile."""
    form = {k: v[0] for k, v in urllib.parse.parse_qs(body).items()}
    if not hmac.compare_digest(form.get("token", "").encode(), token.encode()):
        return 403, render_page(store, token, "this form came from an older page or another "
                                "site: nothing saved; rate the answers below"), HTML, {}
    saved = _rate(store, form)
    if isinstance(saved, str):
        return (507 if saved.startswith(NOT_SAVED) else 400), render_page(store, token, saved), \
            HTML, {}
    asked = len(set(filter(None, form.get("ids", "").split(","))))
    return 303, "", HTML, {"Location": f"/?taken={asked - saved}" if saved < asked else "/"}


def api_pending(store: Store) -> Reply:
    """GET /api/pending: the items waiting, in the page's order."""
    return json_reply(200, {"pending": store.pending()})


def api_rate(store: Store, body: str) -> Reply:
    """POST /api/rate: {"ratings": [{"id", "scores"}, ...]}, checked as the form is, all or none."""
    try:
        given = json.loads(body)["ratings"]
        form = {"ids": ",".join(r["id"] for r in given)}
        for r in given:
            form |= {f"{r['id']}.{c}": json.dumps(v) for c, v in r["scores"].items()}
    except (ValueError, KeyError, TypeError, AttributeError,
            RecursionError):  # RecursionError: [[[[...
        return json_reply(400, {"error": 'expected {"ratings": [{"id": ..., "scores": '
                                         '{criterion: N}}, ...]}'})
    if len({r["id"] for r in given}) < len(given):
        return json_reply(400, {"error": "an item is rated twice in this request; "
                                         "send one rating per item"})
    for r in given:  # a criterion the item is not rated on: a typo, not dropped
        item = store.items.get(r["id"])
        if item and (bad := sorted(set(r["scores"]) - set(item["criteria"]))):
            return json_reply(400, {"error": f"item {r['id']!r} is rated on {item['criteria']}, "
                                             f"not {bad[0]!r}"})
    saved = _rate(store, form)
    if isinstance(saved, str):
        return json_reply(507 if saved.startswith(NOT_SAVED) else 400, {"error": saved})
    return json_reply(200, {"saved": saved})
