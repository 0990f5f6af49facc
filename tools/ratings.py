"""The ratings folder's command: serve the rating page, or read the folder's counts and ratings.

    python -m tools.ratings serve --dir runs/qgen_human/ratings    # then open http://127.0.0.1:8000
    python -m tools.ratings stats --dir runs/qgen_human/ratings    # counts and mean scores (JSON)
    # rated items (prompt, completion, scores, reward) to standard output, or a .parquet/.jsonl
    python -m tools.ratings export --dir runs/qgen_human/ratings > rated.jsonl
    python -m tools.ratings export --dir runs/qgen_human/ratings --out rated.parquet

The folder, its files and the `human` reward that waits on it are described in graders/ratings.py;
the page and its JSON API in graders/rating_page.py, the seed's queue API in
graders/rating_queue.py, their server in graders/rating_server.py. `serve` needs the `ratings`
extra (Starlette and uvicorn; `make setup` installs it); without it, it says what to install.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import ipaddress
import json
import sys
from pathlib import Path

from files import command, jsonl
from graders.ratings import QUEUE, RATINGS, export, page_missing, store_for


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.ratings",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=["serve", "stats", "export"])
    p.add_argument("--dir", required=True,
                   help="the ratings folder named by the human reward's args.dir")
    p.add_argument("--host", default="127.0.0.1", help="serve: address to listen on (the page has "
                   "no login: keep it 127.0.0.1 and let raters in through an SSH tunnel)")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME", help="serve: a "
                   "host name the page may be addressed by besides IP addresses, localhost and the "
                   "--host name (repeatable), e.g. the machine's name on a trusted network")
    p.add_argument("--port", type=int, default=8000, help="serve: port")
    p.add_argument("--out", help="export: write to this .jsonl or .parquet file (atomically; never "
                   "over an existing one) instead of standard output")
    return p.parse_args(argv)


def read_folder(args: argparse.Namespace) -> int:
    """`stats` (counts and mean scores, JSON) or `export` (the rated items, to --out or standard
    output) -> 0; a folder that is not a ratings folder, or an --out that cannot be written: one
    line, exit 2."""
    folder = Path(args.dir)
    if not folder.is_dir():
        return command.error(f"{args.dir} is not a folder; give the human reward's args.dir")
    if not any((folder / n).is_file() for n in (QUEUE, RATINGS)) and any(
            f.name not in ("page_token", "page_token.tmp", "serve.lock") for f in folder.iterdir()):
        # an empty folder is one `serve` made before anything was queued: zero counts
        return command.error(f"{args.dir} holds no {QUEUE} or {RATINGS}: is it the human "
                             "reward's args.dir?")
    store = store_for(args.dir)
    store.refresh()
    if args.command == "stats":
        print(json.dumps(store.stats(), indent=1))
    elif args.out:
        rated = store.rated_items()
        try:
            export(rated, args.out)
        except (ValueError, OSError) as e:
            return command.error(e)
        print(f"[ratings] {args.out}: {len(rated)} rated items", file=sys.stderr)
    else:
        sys.stdout.write(jsonl.lines(store.rated_items()))
    return 0


def warn_if_open(sock, host: str) -> None:
    """A warning when the address bound (--host "", or a host name) reaches beyond loopback."""
    address = sock.getsockname()[0]
    with contextlib.suppress(ValueError):
        if not ipaddress.ip_address(address.split("%")[0] or "0.0.0.0").is_loopback:
            print(f"warning: --host {host} lets anyone who can reach this machine rate (the "
                  "page has no login); 127.0.0.1 with an SSH tunnel keeps it to the raters you let "
                  "in", file=sys.stderr)


def serve(args: argparse.Namespace) -> int:
    """The rating page on --host:--port until Ctrl-C -> 0, holding the folder's serve.lock (a
    second server would count ratings twice); a folder or port it cannot use: one line, exit 2,
    nothing left behind."""
    if not 0 <= args.port <= 65535:
        return command.error(f"--port {args.port} is not a port (0-65535)")
    if missing := page_missing():
        return command.error(missing)
    from graders import rating_server  # the `ratings` extra: loaded to serve only
    # the folders mkdir will make, deepest first
    created = [d for d in [Path(args.dir), *Path(args.dir).parents] if not d.exists()]
    try:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
        lock = open(Path(args.dir) / "serve.lock", "a")  # held while serving
    except OSError as e:
        return command.error(f"cannot use {args.dir} as the ratings folder ({e.strerror})")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return command.error(f"another `python -m tools.ratings serve` is using {args.dir}; rate "
                             "on its page (two servers on one folder can count one item's "
                             "ratings twice)")
    try:
        sock = rating_server.listen(args.host, args.port)
    except OSError as e:
        lock.close()
        (Path(args.dir) / "serve.lock").unlink(missing_ok=True)
        for d in created:
            d.rmdir()  # nothing is left behind by a start that failed
        why = ("the port is taken: pick another --port" if e.errno == errno.EADDRINUSE
               else "check --host and --port")
        return command.error(f"cannot listen on {args.host}:{args.port} ({e.strerror or e}); "
                             f"{why}")
    warn_if_open(sock, args.host)
    # the page's token is written now that the address is had
    server = rating_server.uvicorn_server(args.dir, args.host, tuple(args.allow_host))
    print(f"rating page: http://{args.host}:{sock.getsockname()[1]}/  "
          f"(folder {store_for(args.dir).dir}; Ctrl-C stops)")
    try:
        server.run(sockets=[sock])  # uvicorn stops first on a stop, then raises it again
    except command.Terminated as e:  # a scheduler's SIGTERM: 143, as when it killed the server
        return command.interrupted(e)[1]
    except KeyboardInterrupt:  # Ctrl-C: the way to stop serving asked for, exit 0
        pass
    finally:
        sock.close()
    return 0


@command.one_line()  # each error is said where it is met; a stop is one line too
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.out and args.command != "export":
        return command.error(f"--out is for export, not {args.command}")
    return serve(args) if args.command == "serve" else read_folder(args)


if __name__ == "__main__":
    sys.exit(main())
