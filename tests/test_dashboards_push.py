"""`dreamgym dashboards push` against a recorded stand-in for Grafana's HTTP API.

No Grafana server can run here (not in Debian, PyPI or npm), so a tiny local HTTP server
keeps datasources, folders and dashboards in memory the way Grafana's documented HTTP API
does (https://grafana.com/docs/grafana/latest/developers/http_api/: data_source,
folder, dashboard) and records every call. The test checks the paths, methods,
authentication and payloads grafana-client sends for us against that documentation, that
a second push changes nothing, and that a drifted datasource is put back with one PUT.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from infra import dashboards
from infra.cli import main


class FakeGrafana:
    """Grafana's state and the calls made to it."""

    def __init__(self) -> None:
        self.datasources: dict[str, dict] = {}
        self.folders: dict[str, dict] = {}
        self.dashboards: dict[str, dict] = {}
        self.calls: list[tuple[str, str, str, dict | None]] = []  # method, path, Authorization, body

    def handle(self, method: str, path: str, body: dict | None) -> tuple[int, dict]:
        parts = path.split("?")[0].strip("/").split("/")
        if parts[:3] == ["api", "datasources", "uid"] and len(parts) == 4:
            uid = parts[3]
            if method == "GET":
                return (200, self.datasources[uid]) if uid in self.datasources else (404, {"message": "Data source not found"})
            if method == "PUT":
                self.datasources[uid] = {**self.datasources[uid], **body}
                return 200, {"message": "Datasource updated", "datasource": self.datasources[uid]}
        if parts == ["api", "datasources"] and method == "POST":
            if any(d["name"] == body["name"] for d in self.datasources.values()):
                return 409, {"message": "data source with the same name already exists"}
            ds = {"id": len(self.datasources) + 1, "orgId": 1, "basicAuth": False, "readOnly": False, **body}
            self.datasources[body["uid"]] = ds
            return 200, {"datasource": ds, "id": ds["id"], "message": "Datasource added", "name": ds["name"]}
        if parts[:2] == ["api", "folders"]:
            if method == "GET" and len(parts) == 3:
                uid = parts[2]
                return (200, self.folders[uid]) if uid in self.folders else (404, {"message": "folder not found"})
            if method == "POST" and len(parts) == 2:
                f = {"id": len(self.folders) + 1, "uid": body.get("uid"), "title": body["title"], "version": 1}
                self.folders[f["uid"]] = f
                return 200, f
        if parts[:3] == ["api", "dashboards", "uid"] and method == "GET":
            uid = parts[3]
            if uid not in self.dashboards:
                return 404, {"message": "Dashboard not found"}
            d = self.dashboards[uid]
            return 200, {"dashboard": d["dashboard"], "meta": {"folderUid": d["folderUid"], "slug": uid}}
        if parts == ["api", "dashboards", "db"] and method == "POST":
            dash = dict(body["dashboard"])
            old = self.dashboards.get(dash["uid"])
            if old is not None and not body.get("overwrite"):
                return 412, {"message": "The dashboard has been changed by someone else", "status": "version-mismatch"}
            dash["id"] = old["dashboard"]["id"] if old else len(self.dashboards) + 1
            dash["version"] = old["dashboard"]["version"] + 1 if old else 1
            self.dashboards[dash["uid"]] = {"dashboard": dash, "folderUid": body.get("folderUid")}
            return 200, {"id": dash["id"], "uid": dash["uid"], "url": f"/d/{dash['uid']}", "status": "success",
                         "version": dash["version"]}
        return 404, {"message": f"no route {method} {path}"}

    def writes(self) -> list[tuple[str, str]]:
        return [(m, p) for m, p, _a, _b in self.calls if m != "GET"]


@pytest.fixture
def grafana():
    state = FakeGrafana()

    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(n)) if n else None
            state.calls.append((self.command, self.path, self.headers.get("Authorization", ""), body))
            status, out = state.handle(self.command, self.path, body)
            data = json.dumps(out).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PUT = do_DELETE = _serve

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_push_creates_datasource_folder_and_every_dashboard_then_changes_nothing(grafana, capsys):
    state, url = grafana
    argv = ["dashboards", "push", "--url", url, "--token", "glsa_test", "--folder", "RL runs",
            "--prometheus-url", "http://prom:9090"]
    assert main(argv) == 0

    # Every call is authenticated with the service-account token as a Bearer token.
    assert {auth for _m, _p, auth, _b in state.calls} == {"Bearer glsa_test"}
    posts = {(m, p.split("?")[0]): b for m, p, _a, b in state.calls if m != "GET"}

    # POST /api/datasources: name, type, url and access are what the data source API requires.
    ds = posts[("POST", "/api/datasources")]
    assert ds["type"] == "prometheus" and ds["access"] == "proxy" and ds["url"] == "http://prom:9090"
    assert ds["name"] == dashboards.DATASOURCE_NAME and ds["uid"] == dashboards.DATASOURCE_UID

    # POST /api/folders: title (required) and the uid we look it up by.
    assert posts[("POST", "/api/folders")] == {"title": "RL runs", "uid": dashboards.FOLDER_UID}

    # POST /api/dashboards/db, once per concern: {dashboard: {uid, title, panels}, folderUid, overwrite}.
    db_posts = [b for m, p, _a, b in state.calls if (m, p) == ("POST", "/api/dashboards/db")]
    assert sorted(b["dashboard"]["uid"] for b in db_posts) == sorted(f"dreamgym-{c}" for c in dashboards.DASHBOARDS)
    for b in db_posts:
        assert b["folderUid"] == dashboards.FOLDER_UID and b["overwrite"] is True
        assert b["dashboard"].get("id") is None  # a new dashboard has no id; Grafana assigns one
        assert b["dashboard"]["title"] and b["dashboard"]["panels"]
        for panel in b["dashboard"]["panels"]:
            assert panel["targets"][0]["expr"] and panel["datasource"]["type"] == "prometheus"
    # Lookups go through the documented by-uid routes.
    gets = {p for m, p, _a, _b in state.calls if m == "GET"}
    assert f"/api/datasources/uid/{dashboards.DATASOURCE_UID}" in gets
    assert f"/api/folders/{dashboards.FOLDER_UID}" in gets
    assert {f"/api/dashboards/uid/dreamgym-{c}" for c in dashboards.DASHBOARDS} <= gets
    out = capsys.readouterr().out
    assert "created:" in out

    # A second push reads everything and writes nothing.
    state.calls.clear()
    assert main(argv) == 0
    assert state.writes() == []
    assert "unchanged: datasource" in capsys.readouterr().out
    versions = {uid: d["dashboard"]["version"] for uid, d in state.dashboards.items()}
    assert set(versions.values()) == {1}

    # Someone edits the datasource in Grafana: the next push puts it back with one PUT, nothing else.
    state.datasources[dashboards.DATASOURCE_UID]["url"] = "http://elsewhere:9090"
    state.calls.clear()
    assert main(argv) == 0
    assert state.writes() == [("PUT", f"/api/datasources/uid/{dashboards.DATASOURCE_UID}")]
    assert state.datasources[dashboards.DATASOURCE_UID]["url"] == "http://prom:9090"


def test_push_needs_a_url(capsys):
    assert main(["dashboards", "push"]) == 2
