"""`python -m finetune mode=ui`: the planner and the runs as a local web page (the standard library's HTTP server).

    python -m finetune mode=ui                      # http://127.0.0.1:8765/
    python -m finetune mode=ui ui.port=0 ui.runs_dir=/scratch/runs

Serves on loopback unless `ui.host` names another address (a warning says the network can then reach
it). Read-only: GET and HEAD only; a plan is computed in this process and written nowhere; a run page reads
its run directory and starts nothing. Requests naming another host than the one served are refused
(a web page elsewhere cannot reach the server through a name that resolves to this machine). Pages carry
a Content-Security-Policy that allows only the package's own script and style.
"""

from __future__ import annotations

import json
import logging
import socket
import sys
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Optional
from urllib.parse import parse_qs, quote, unquote, urlsplit

from finetune.core.composition import load_profiles
from finetune.core.config import UiConfig
from finetune.core.errors import ConfigError, FinetuneError
from finetune.core.markup import terminal_line
from finetune.ui import pages, runs
from finetune.ui.calculator import PlanForm, make

log = logging.getLogger(__name__)

STATIC = Path(__file__).resolve().parent / "static"
_STATIC_TYPES = {".css": "text/css; charset=utf-8", ".js": "text/javascript; charset=utf-8"}
_SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "form-action 'self'; base-uri 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
_LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")


class App:
    """What the handler serves: the settings, the hardware profiles (read once), the runs folder."""

    def __init__(self, cfg: UiConfig) -> None:
        self.cfg = cfg
        self.profiles = load_profiles()
        self.runs_root = Path(cfg.runs_dir)

    def plan(self, query: str) -> tuple[int, str]:
        form = PlanForm.from_query(parse_qs(query))
        try:
            return HTTPStatus.OK, pages.plan_page(form, make(form, self.profiles), None)
        except FinetuneError as exc:
            return HTTPStatus.BAD_REQUEST, pages.plan_page(form, None, terminal_line(exc))

    def plan_json(self, query: str) -> tuple[int, str]:
        try:
            payload = make(PlanForm.from_query(parse_qs(query)), self.profiles).payload
        except FinetuneError as exc:
            return HTTPStatus.BAD_REQUEST, json.dumps({"error": terminal_line(exc)}) + "\n"
        return HTTPStatus.OK, json.dumps(payload, indent=2) + "\n"

    def runs(self) -> str:
        views = [runs.summary(self.runs_root, name) for name in runs.names(self.runs_root)]
        return pages.runs_page(views, self.cfg.runs_dir)

    def run(self, name: str) -> tuple[int, str]:
        try:
            return HTTPStatus.OK, pages.run_page(runs.detail(self.runs_root, name))
        except FinetuneError as exc:
            return HTTPStatus.NOT_FOUND, pages.not_found(terminal_line(exc))


class Handler(BaseHTTPRequestHandler):
    server_version = "finetune-ui"
    app: App

    def do_HEAD(self) -> None:  # noqa: N802 (the standard library's name)
        self._respond(head=True)

    def do_GET(self) -> None:  # noqa: N802
        self._respond(head=False)

    def _respond(self, head: bool) -> None:
        url = urlsplit(self.path)
        if not self._host_allowed():
            return self._send(HTTPStatus.MISDIRECTED_REQUEST, "text/plain", "unknown host\n", head)
        path = url.path
        try:
            if path == "/" and not url.query:
                return self._redirect(f"/?recipe={quote(self.app.cfg.recipe)}")
            if path == "/":
                status, body = self.app.plan(url.query)
                return self._send(status, "text/html; charset=utf-8", body, head)
            if path == "/plan.json":
                status, body = self.app.plan_json(url.query)
                extra = {"Content-Disposition": 'attachment; filename="plan.json"'} if status == 200 else {}
                return self._send(status, "application/json", body, head, extra)
            if path == "/runs":
                return self._send(HTTPStatus.OK, "text/html; charset=utf-8", self.app.runs(), head)
            if path.startswith("/runs/"):
                status, body = self.app.run(unquote(path[len("/runs/") :]))
                return self._send(status, "text/html; charset=utf-8", body, head)
            if path == "/favicon.ico":
                return self._send(HTTPStatus.NO_CONTENT, "text/plain", "", head)
            if path.startswith("/static/"):
                return self._static(path[len("/static/") :], head)
        except Exception:  # a bug, not bad input: the page says so in one line, the console has the rest
            log.exception("finetune ui: %s failed", path)
            body = pages.page(
                "error", pages.error_block("internal error; the server's console has the details"), ""
            )
            return self._send(HTTPStatus.INTERNAL_SERVER_ERROR, "text/html; charset=utf-8", body, head)
        return self._send(
            HTTPStatus.NOT_FOUND, "text/html; charset=utf-8", pages.not_found("no such page"), head
        )

    def _host_allowed(self) -> bool:
        if not self.app.cfg.loopback:
            return True
        host = (self.headers.get("Host") or "").lower()
        name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
        return name in _LOOPBACK_NAMES

    def _static(self, name: str, head: bool) -> None:
        path = STATIC / name
        kind = _STATIC_TYPES.get(path.suffix)
        if "/" in name or kind is None or not path.is_file():
            return self._send(HTTPStatus.NOT_FOUND, "text/plain", "no such file\n", head)
        self._send(HTTPStatus.OK, kind, path.read_text(), head)

    def _redirect(self, location: str) -> None:
        self.send_response(HTTPStatus.SEE_OTHER)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        for key, value in _SECURITY_HEADERS.items():
            self.send_header(key, value)
        self.end_headers()

    def _send(
        self, status: int, kind: str, body: str, head: bool, extra: Optional[dict[str, str]] = None
    ) -> None:
        data = body.encode("utf-8")
        try:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            for key, value in {**_SECURITY_HEADERS, **(extra or {})}.items():
                self.send_header(key, value)
            self.end_headers()
            if not head:
                self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the browser left the page before it came (another setting changed meanwhile)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the standard library's name)
        log.debug("%s " + format, self.address_string(), *args)


def make_server(cfg: UiConfig) -> ThreadingHTTPServer:
    """The server bound to `cfg.host`:`cfg.port` (0: a free port), not yet serving."""
    handler = type("BoundHandler", (Handler,), {"app": App(cfg)})
    family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
    server_class = type("Server", (ThreadingHTTPServer,), {"address_family": family, "daemon_threads": True})
    return server_class((cfg.host, cfg.port), handler)


def url(server: ThreadingHTTPServer) -> str:
    address, port = server.server_address[:2]
    host = address.decode() if isinstance(address, bytes) else str(address)
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/"


def address_warning(cfg: UiConfig) -> Optional[str]:
    """What binding `cfg.host` exposes, when it is not loopback; None on loopback."""
    if cfg.loopback:
        return None
    return (
        f"ui.host={terminal_line(cfg.host)} serves the plan page and the runs under {terminal_line(cfg.runs_dir)} "
        "to every machine that can reach this one; 127.0.0.1 keeps them on this machine"
    )


def serve(cfg: UiConfig) -> int:
    """Serve until interrupted (Ctrl-C, SIGTERM); 0 then."""
    warning = address_warning(cfg)
    if warning:
        print(f"finetune: warning: {warning}", file=sys.stderr)
    try:
        server = make_server(cfg)
    except OSError as exc:
        raise ConfigError(f"ui.host={cfg.host} ui.port={cfg.port}: cannot listen ({exc.strerror})") from None
    print(f"finetune ui: {url(server)}  (plan and runs under {terminal_line(cfg.runs_dir)}; Ctrl-C stops it)")
    sys.stdout.flush()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("finetune ui: stopped")
    finally:
        server.server_close()
    return 0
