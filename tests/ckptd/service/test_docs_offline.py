"""The service's own API docs work with no internet access, and describe the whole API.

A real ``ckptd serve`` (tokens on) and a real headless Chromium from the distribution's packages
(``.ci/run`` installs it): ``/docs`` renders Swagger UI from assets the service itself serves (this
machine reaches no CDN, so a page that needed one would stay blank); ``/openapi.json`` names the
bearer-token scheme, requires it on every operation that is not open, and lists the error
responses of every operation in the one error body; ``/metrics`` labels requests of these pages by
their own route names.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ckptd.service.auth import ROUTE_RULES, hash_token
from support import ServerProcess

TOKEN = "docs-reader-token-0123456789"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("docs")
    s = ServerProcess(tmp / "root", env={"CKPTD_TOKENS": f"reader sha256:{hash_token(TOKEN)} read:*"}).start()
    yield s
    s.stop()


def test_the_openapi_document_describes_errors_and_the_bearer_scheme(srv):
    doc = httpx.get(f"{srv.url}/openapi.json", timeout=10).json()
    assert doc["components"]["securitySchemes"]["bearer"] == {
        "type": "http", "scheme": "bearer", "description": doc["components"]["securitySchemes"]["bearer"]["description"]}
    assert "ErrorBody" in doc["components"]["schemas"]
    seen = 0
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            seen += 1
            statuses = set(op["responses"])
            assert {"500", "503"} <= statuses, (method, path)
            for status in statuses - {"200", "201", "202", "204", "206"}:
                body = op["responses"][status]["content"]["application/json"]["schema"]
                assert body == {"$ref": "#/components/schemas/ErrorBody"}, (method, path, status)
            if path in ("/", "/healthz", "/readyz", "/metrics"):
                assert "security" not in op, path
            else:
                assert op["security"] == [{"bearer": []}], (method, path)
                assert {"401", "403", "404", "422"} <= statuses, (method, path)
    assert seen >= len([n for n, r in ROUTE_RULES.items() if r.access != "open"]) - 2  # every API operation


def test_docs_use_no_outside_asset_and_label_their_metrics(srv):
    html = httpx.get(f"{srv.url}/docs", timeout=10).text
    urls = re.findall(r"""(?:src|href)=['"]([^'"]+)['"]""", html) + re.findall(r"""url: ?['"]([^'"]+)['"]""", html)
    assert urls and all(u.startswith("/") for u in urls), urls
    for u in urls:
        r = httpx.get(f"{srv.url}{u}", timeout=10)
        assert r.status_code == 200 and r.content, u
    assert "SwaggerUIBundle" in httpx.get(f"{srv.url}/docs/assets/swagger-ui-bundle.js", timeout=10).text
    text = httpx.get(f"{srv.url}/metrics", timeout=10).text
    routes = {s.labels.get("route") for fam in text_string_to_metric_families(text)
              if fam.name == "ckptd_http_requests" for s in fam.samples}
    assert {"swagger_ui_html", "openapi", "docs_asset"} <= routes, routes
    assert "unmatched" not in routes
    assert httpx.get(f"{srv.url}/docs/assets/redoc.standalone.js", timeout=10).status_code == 401  # no other file


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (.ci/run installs it)")
def test_docs_render_in_a_browser_without_internet(srv, tmp_path):
    r = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                        "--disable-background-networking", "--disable-component-update", "--disable-sync",
                        f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=15000", "--dump-dom",
                        f"{srv.url}/docs"], capture_output=True, text=True, timeout=120)
    dom = r.stdout
    assert r.returncode == 0 and "swagger-ui" in dom, r.stderr[-2000:]
    # rendered from /openapi.json: operations with their paths, the Authorize button of the bearer scheme
    assert dom.count("opblock-summary-path") >= 10, dom[:2000]
    assert "/v1/runs/{run}/checkpoints" in dom.replace("\u200b", "")
    assert "authorize" in dom.lower()
