"""Container and deployment files, checked without a Docker engine or a cluster.

- ``Dockerfile``: parsed with BuildKit's own parser (the ``dockerfile`` package); the files its
  COPY lines take, filtered by ``.dockerignore``, build the package; its final entry command
  (ENTRYPOINT + CMD, with the image's ENV) runs here, outside a container, and answers
  ``/healthz``; so does its HEALTHCHECK command.
- ``deploy/compose.yaml``: valid against the Compose specification's JSON schema
  (check-jsonschema's bundled copy), and consistent: the bucket ckptd's root names is the one the
  creation step makes, credentials and endpoint point at the store, probes name real routes. With
  moto installed, the ckptd service's compose environment serves from a moto S3 server.
- ``deploy/k8s/``, ``deploy/k8s/tiered/`` and ``deploy/k8s/node-local/``: every manifest valid against the Kubernetes JSON
  schemas (kubernetes-validate, strict: unknown fields refused, schemas bundled, no network), names
  and ports consistent across the files; each ``kustomization.yaml`` renders (here, and with
  ``kubectl kustomize`` where it is installed) to valid manifests whose every image is the one its
  ``images:`` names; each PodDisruptionBudget covers its replicas, and only them; the Indexed Job's
  container arguments run here, one process per work unit, and the output checkpoint verifies.
- The tiered layout (fast tier on a node-local volume, durable tier in the bucket): its replicas'
  environment serves here as two processes with their own fast tiers, the reshard Job's workers
  read and commit on the durable tier only, and a replica with a new fast tier serves their output.
- The node-local layout (a replica per training node on one S3 root): its DaemonSet's environment
  serves here with the socket where the trainer pods of docs/deployment.md mount it, and a rank here
  hands its files over through it.
- The image's build behind a registry mirror: it pulls ``BASE_IMAGE`` alone and takes every package
  index from a build argument, the ones docs/deployment.md's mirror command passes.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from urllib.parse import urlsplit

import dockerfile
import httpx
import kubernetes_validate
import pytest
import yaml

from ckptd.service.settings import Settings, env_name
from support import REPO, free_port

DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
TIERED = K8S / "tiered"
NODE_LOCAL = K8S / "node-local"
KUSTOMIZATION = "kustomization.yaml"
#: Files of each folder that ``kubectl apply -k`` leaves out: templates filled in per use.
TEMPLATES = {K8S: {"secret.yaml", "reshard-job.yaml"}, TIERED: {"local-pv.yaml"}, NODE_LOCAL: set()}
MIRROR_IMAGE = "mirror.example.com/ml/ckptd"
VENV_BIN = Path(sys.executable).parent

# CKPTD_* variables the deployment files set before the setting exists (another change adds it).
PENDING_SETTINGS: set[str] = set()
# Oldest Kubernetes the manifests target (Indexed Job with backoffLimitPerIndex), and the newest schemas we have.
K8S_VERSIONS = ["1.29.0", kubernetes_validate.latest_version()]


# -- helpers --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def routes(tmp_path_factory) -> set[str]:
    from ckptd.service.app import create_app

    app = create_app(Settings(root=str(tmp_path_factory.mktemp("routes"))))
    return {getattr(r, "path", "") for r in app.routes}


def _settings_envs() -> set[str]:
    return {env_name(n) for n in Settings.model_fields}


def _check_env_from(ctr: dict, cm: dict, secrets: dict) -> None:
    """The container's config and secrets come from the manifests that define them."""
    for src in ctr["envFrom"]:
        if "configMapRef" in src:
            assert src["configMapRef"]["name"] == cm["metadata"]["name"]
        else:
            assert src["secretRef"]["name"] in secrets


def _check_server_container(ctr: dict, pod_spec: dict, kind: str, ports: set, routes: set, cm: dict,
                            secrets: dict) -> tuple[dict, dict, Path]:
    """What every ``ckptd serve`` container must hold: probes on the service's own routes and on one of
    ``ports``, config and secrets from their manifests, the CKPTD_ variables it sets, and the tokens
    Secret mounted read-only where CKPTD_TOKENS_FILE points. Returns its env, the Secret's volume and
    the tokens file's path."""
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz"), ("startupProbe", "/healthz")):
        get = ctr[probe]["httpGet"]
        assert get["path"] == path and path in routes and get["port"] in ports, (probe, get)
    _check_env_from(ctr, cm, secrets)
    env = {e["name"]: e.get("value") for e in ctr["env"]}
    _check_ckptd_vars(env, kind)
    tokens_file = Path(env["CKPTD_TOKENS_FILE"])
    vol = next(v for v in pod_spec["volumes"] if "secret" in v)
    mount = next(m for m in ctr["volumeMounts"] if m["name"] == vol["name"])
    assert mount["readOnly"] and Path(mount["mountPath"]) == tokens_file.parent
    return env, vol, tokens_file


def _check_ckptd_vars(names, where: str) -> None:
    unknown = {n for n in names if n.startswith("CKPTD_")} - _settings_envs() - PENDING_SETTINGS
    assert not unknown, f"{where} sets {sorted(unknown)}, which are not Settings fields"


class Stage:
    def __init__(self, base: str, name: str | None) -> None:
        self.base, self.name, self.cmds = base, name, []


def _stages() -> tuple[dict[str, str], list[Stage]]:
    """Global ARG defaults and the build stages of the Dockerfile (BuildKit's parser)."""
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for c in dockerfile.parse_file(str(REPO / "Dockerfile")):
        if c.cmd == "FROM":
            v = c.value
            stages.append(Stage(v[0], v[2] if len(v) >= 3 and v[1].upper() == "AS" else None))
        elif stages:
            stages[-1].cmds.append(c)
        elif c.cmd == "ARG":
            k, _, d = c.value[0].partition("=")
            args[k] = d
    return args, stages


def _chain(stages: list[Stage], stage: Stage) -> list[Stage]:
    """``stage`` and the stages it is built FROM, oldest first."""
    by_name = {s.name: s for s in stages if s.name}
    chain = [stage]
    while chain[0].base in by_name:
        chain.insert(0, by_name[chain[0].base])
    return chain


def _image_env(stages: list[Stage]) -> dict[str, str]:
    """The final image's ENV, ``${VAR}`` expanded against this machine's values where unset."""
    env: dict[str, str] = {}
    for s in _chain(stages, stages[-1]):
        for c in s.cmds:
            if c.cmd == "ENV":
                for k, v in zip(c.value[0::2], c.value[1::2]):
                    env[k] = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: env.get(m[1] or m[2], os.environ.get(
                        m[1] or m[2], "")), v)
    return env


def _last(stage: Stage, cmd: str):
    found = [c for c in stage.cmds if c.cmd == cmd]
    return found[-1] if found else None


def _exec_form(c) -> list[str]:
    return list(c.value) if c.json else ["/bin/sh", "-c", " ".join(c.value)]


def _entry_command(stages: list[Stage]) -> list[str]:
    final = _chain(stages, stages[-1])
    entry = next((_last(s, "ENTRYPOINT") for s in reversed(final) if _last(s, "ENTRYPOINT")), None)
    cmd = next((_last(s, "CMD") for s in reversed(final) if _last(s, "CMD")), None)
    return (_exec_form(entry) if entry else []) + (_exec_form(cmd) if cmd else [])


def _on_this_machine(argv: list[str]) -> list[str]:
    """The image's command as it runs here: its programs are this virtualenv's."""
    prog = argv[0]
    if prog in ("python", "python3"):
        return [sys.executable, *argv[1:]]
    local = VENV_BIN / prog
    return [str(local) if local.exists() else prog, *argv[1:]]


def _wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float = 60.0) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            return httpx.get(url, timeout=2.0)
        except httpx.HTTPError:
            time.sleep(0.1)
    raise AssertionError(f"{url} did not answer:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


def _start(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    logf = open(log, "ab")
    return subprocess.Popen(_on_this_machine(argv), env=env, stdout=logf, stderr=subprocess.STDOUT, cwd=log.parent)


# -- Dockerfile -------------------------------------------------------------------------------------

def test_dockerfile_parses_and_is_slim_non_root_cpu_by_default():
    args, stages = _stages()
    final = stages[-1]
    chain = _chain(stages, final)
    assert args["BASE_IMAGE"].startswith("python:3.11-slim"), args
    assert chain[0].base == "${BASE_IMAGE}", "the final image must derive from the BASE_IMAGE build argument"
    assert args["TORCH_INDEX"] == "https://download.pytorch.org/whl/cpu"

    user = _last(final, "USER")
    assert user is not None, "the final stage must switch to a non-root user"
    uid = user.value[0].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"USER {uid}: numeric (so runAsNonRoot can check it) and not root"

    # torch comes from TORCH_INDEX, pinned by constraints.txt; the rest is pinned by the same file.
    runs = [" ".join(c.value) for s in stages for c in s.cmds if c.cmd == "RUN"]
    torch_line = next(r for r in runs if re.search(r"pip install\b.*\btorch\b", r))
    assert '--index-url "${TORCH_INDEX}"' in torch_line and "-c constraints.txt" in torch_line, torch_line
    assert "torch==" in (REPO / "constraints.txt").read_text()
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    pkg_line = next(r for r in runs if re.search(r'pip install .*"\.\[', r))
    assert "-c constraints.txt" in pkg_line
    wanted = set(re.search(r'"\.\[([^\]]*)\]"', pkg_line)[1].split(","))
    assert wanted <= extras and {"server", "s3"} <= wanted, (wanted, extras)

    env = _image_env(stages)
    exposed = [c.value[0] for c in final.cmds if c.cmd == "EXPOSE"]
    assert exposed == [env["CKPTD_PORT"]] == [str(Settings().port)]
    assert env["CKPTD_HOST"] == "0.0.0.0"
    _check_ckptd_vars(env, "Dockerfile ENV")
    assert _entry_command(stages) == ["ckptd", "serve"]


def _doc_section(title: str) -> str:
    """The text of docs/deployment.md's section ``title`` (any level), up to the next heading."""
    out: list[str] | None = None
    fenced = False
    for line in (REPO / "docs" / "deployment.md").read_text().splitlines():
        fenced ^= line.startswith("```")
        heading = not fenced and re.match(r"#+ (.*)", line)
        if heading and out is not None:
            break
        if out is not None:
            out.append(line)
        elif heading and heading[1] == title:
            out = []
    assert out is not None, f"docs/deployment.md: no section {title!r}"
    return "\n".join(out)


def test_the_build_pulls_the_base_image_alone_and_takes_its_indexes_from_build_args():
    """Behind a registry mirror, everything the build fetches is the operator's to name: the one image it
    pulls (``BASE_IMAGE``; no ``# syntax=`` frontend image, no ``FROM`` or ``COPY --from`` of another
    image) and every package index (a build argument, declared in the stage that installs), and the
    mirror command of docs/deployment.md passes exactly those arguments."""
    text = (REPO / "Dockerfile").read_text()
    directives = []
    for line in text.splitlines():  # parser directives: comments before the first instruction
        if line.strip() and not line.startswith("#"):
            break
        directives += re.findall(r"^#\s*syntax\s*=\s*(\S+)", line, re.I)
    assert not directives, f"# syntax={directives[0]}: BuildKit would pull that frontend image"
    args, stages = _stages()
    names: set[str] = set()
    indexes: set[str] = set()
    for s in stages:
        assert s.base == "${BASE_IMAGE}" or s.base in names, f"FROM {s.base}: pulls an image BASE_IMAGE does not name"
        declared: set[str] = set()
        for c in s.cmds:
            if c.cmd == "ARG":
                declared.add(c.value[0].partition("=")[0])
            for flag in c.flags if c.cmd == "COPY" else ():
                if flag.startswith("--from="):
                    assert flag.split("=", 1)[1] in names, f"COPY {flag}: an image, not an earlier stage"
            line = " ".join(c.value)
            if c.cmd == "RUN" and re.search(r"\bpip install\b", line):
                m = re.search(r'--index-url "\$\{(\w+)\}"', line)
                assert m, f"pip install without --index-url from a build argument: {line}"
                assert m[1] in args and m[1] in declared, f"{m[1]}: not a build argument of stage {s.name}"
                indexes.add(m[1])
        if s.name:
            names.add(s.name)
    assert indexes == {"TORCH_INDEX", "PIP_INDEX_URL"}, indexes

    mirror = dict(re.findall(r"--build-arg (\w+)=(\S+)", _doc_section("From a registry mirror")))
    assert set(mirror) == {"BASE_IMAGE", *indexes} and set(mirror) <= set(args), mirror
    assert len({urlsplit(v if "://" in v else f"//{v}").hostname for v in mirror.values()}) == 1, mirror


def _dockerignore_allows(rel: str, rules: list[tuple[bool, str]]) -> bool:
    """Docker's rule: the last pattern that matches a path (or one of its parents) decides."""
    parts = rel.split("/")
    included = True
    for negate, pat in rules:
        for i in range(1, len(parts) + 1):
            prefix = "/".join(parts[:i])
            if fnmatch.fnmatchcase(prefix, pat) or (pat.startswith("**/") and (
                    fnmatch.fnmatchcase(prefix, pat[3:]) or fnmatch.fnmatchcase(prefix.rsplit("/", 1)[-1], pat[3:]))):
                included = negate
                break
    return included


def _build_context() -> list[str]:
    rules = []
    for line in (REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            neg = line.startswith("!")
            rules.append((neg, line.lstrip("!").strip("/")))
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split()
    return [f for f in files if (REPO / f).is_file() and _dockerignore_allows(f, rules)]


def test_build_context_and_copies_build_the_package(tmp_path):
    """What COPY takes from the context (after .dockerignore) is enough to build the wheel."""
    context = _build_context()
    assert context and not any(f.startswith(("tests/", ".venv/", "bench/", ".git/")) for f in context), context[:20]
    _, stages = _stages()
    build = next(s for s in stages if s.name == "build")
    workdir = Path(tmp_path / "src")
    workdir.mkdir()
    for c in build.cmds:
        if c.cmd != "COPY" or any(f.startswith("--from") for f in c.flags):
            continue
        *srcs, dest = c.value
        for src in srcs:
            src = src.rstrip("/")
            if src in context:  # a file: into the destination folder (dest ends with /) or as dest
                target = workdir / dest / Path(src).name if dest.endswith("/") else workdir / dest
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(REPO / src, target)
                continue
            inside = [f for f in context if f.startswith(src + "/")]  # a folder: its contents into dest
            assert inside, f"COPY {src}: not in the build context (check .dockerignore)"
            for f in inside:
                target = workdir / dest / f[len(src) + 1:]
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(REPO / f, target)
    import setuptools

    isolated = int(setuptools.__version__.split(".")[0]) < 68  # the build-system's floor
    out = tmp_path / "wheel"
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(workdir)]
    r = subprocess.run(cmd + ([] if isolated else ["--no-build-isolation"]), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = out.glob("ckptd-*.whl")
    names = set(zipfile.ZipFile(whl).namelist())
    for must in ("ckptd/cli/main.py", "ckptd/service/app.py", "ckptd_client/__init__.py",
                 "ckptd_schemas/manifest.schema.json"):
        assert must in names, f"{must} missing from the wheel built from the Docker context"


def test_entry_command_serves_healthz_outside_a_container(tmp_path, routes):
    args, stages = _stages()
    argv = _entry_command(stages)
    port = free_port()
    env = {**os.environ, **_image_env(stages)}
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    # The image listens on 0.0.0.0 inside its network namespace; here, loopback and a free port.
    env.update(CKPTD_ROOT=str(tmp_path / "data"), CKPTD_PORT=str(port), CKPTD_HOST="127.0.0.1",
               CKPTD_LOG_LEVEL="warning")
    log = tmp_path / "serve.log"
    proc = _start(argv, env, log)
    try:
        r = _wait_http(f"http://127.0.0.1:{port}/healthz", proc, log)
        assert r.status_code == 200 and r.json()["status"] == "ok", r.text
        assert httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).status_code == 200
        # The image's HEALTHCHECK command, run the same way.
        hc = _last(stages[-1], "HEALTHCHECK")
        assert hc is not None and hc.value[0] == "CMD"
        hc_argv = list(hc.value[1:]) if hc.json else ["/bin/sh", "-c", " ".join(hc.value[1:])]
        assert "/healthz" in " ".join(hc_argv) and "/healthz" in routes
        done = subprocess.run(_on_this_machine(hc_argv), env=env, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
    finally:
        rc = _stop(proc)
    assert rc in (0, -signal.SIGTERM), log.read_text()[-3000:]


# -- compose ----------------------------------------------------------------------------------------

def _compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def _env(svc: dict) -> dict[str, str]:
    env = svc.get("environment", {})
    if isinstance(env, list):
        env = dict(e.split("=", 1) for e in env)
    return {k: str(v) for k, v in env.items()}


def _argv(value) -> list[str]:
    return list(value) if isinstance(value, list) else shlex.split(value or "")


def test_compose_file_matches_the_compose_specification():
    r = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
                        str(DEPLOY / "compose.yaml")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def _bucket_made(compose: dict) -> tuple[str, str, dict]:
    """(bucket, mc alias, the mc service) of the one-shot creation step."""
    mk = compose["services"]["create-bucket"]
    argv = _argv(mk.get("entrypoint")) + _argv(mk.get("command"))
    assert argv[:2] == ["mc", "mb"], argv
    alias, bucket = argv[-1].split("/", 1)
    return bucket, alias, mk


def test_compose_services_agree(routes):
    c = _compose()
    svcs = c["services"]
    assert {"ckptd", "minio", "create-bucket"} <= set(svcs)
    ck, store = svcs["ckptd"], svcs["minio"]
    env, store_env = _env(ck), _env(store)
    _check_ckptd_vars(env, "compose ckptd")

    # The bucket: ckptd's root is inside the bucket the creation step makes.
    root = urlsplit(env["CKPTD_ROOT"])
    bucket, alias, mk = _bucket_made(c)
    assert root.scheme == "s3" and root.netloc == bucket and root.path.strip("/"), env["CKPTD_ROOT"]
    assert mk["depends_on"]["minio"]["condition"] == "service_healthy" and "healthcheck" in store
    assert ck["depends_on"]["create-bucket"]["condition"] == "service_completed_successfully"
    assert str(mk.get("restart", "no")) == "no"

    # The store's address and credentials, as ckptd and mc use them.
    store_argv = _argv(store["command"])
    api_port = int(store_argv[store_argv.index("--address") + 1].rsplit(":", 1)[1])
    endpoint = urlsplit(env.get("AWS_ENDPOINT_URL_S3") or env["AWS_ENDPOINT_URL"])
    assert (endpoint.hostname, endpoint.port) == ("minio", api_port)
    assert env["AWS_ACCESS_KEY_ID"] == store_env["MINIO_ROOT_USER"]
    assert env["AWS_SECRET_ACCESS_KEY"] == store_env["MINIO_ROOT_PASSWORD"]
    mc = urlsplit(_env(mk)[f"MC_HOST_{alias}"])
    assert (mc.hostname, mc.port, mc.username, mc.password) == (
        "minio", api_port, store_env["MINIO_ROOT_USER"], store_env["MINIO_ROOT_PASSWORD"])

    # ckptd's port, probe, image and build.
    port = int(env["CKPTD_PORT"])
    published = [str(p).rsplit(":", 1) for p in ck["ports"]]
    assert [int(target) for _, target in published] == [port]
    assert all(host.startswith("127.0.0.1:") for host, _ in published), "quickstart ports stay on loopback"
    probe = " ".join(ck["healthcheck"]["test"])
    url = urlsplit(re.search(r"https?://[^'\" ]+", probe)[0])
    assert url.port == port and url.path in routes, probe
    assert (DEPLOY / ck["build"]["context"] / ck["build"].get("dockerfile", "Dockerfile")).resolve() == (
        REPO / "Dockerfile")
    assert env["CKPTD_HOST"] == "0.0.0.0"


def test_compose_ckptd_environment_serves_from_s3(tmp_path, routes):
    """ckptd with its compose environment, the store swapped for a moto S3 server on loopback."""
    pytest.importorskip("moto.server")
    import boto3
    from moto.server import ThreadedMotoServer

    c = _compose()
    env_c = _env(c["services"]["ckptd"])
    bucket, _, _ = _bucket_made(c)
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    try:
        host, mport = moto.get_host_and_port()
        endpoint = f"http://{host}:{mport}"
        env_c["AWS_ENDPOINT_URL_S3"] = endpoint
        boto3.client("s3", endpoint_url=endpoint, region_name=env_c["AWS_DEFAULT_REGION"],
                     aws_access_key_id=env_c["AWS_ACCESS_KEY_ID"],
                     aws_secret_access_key=env_c["AWS_SECRET_ACCESS_KEY"]).create_bucket(Bucket=bucket)
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "CKPTD_"))}
        env.update(env_c, CKPTD_HOST="127.0.0.1", CKPTD_PORT=str(port), CKPTD_LOG_LEVEL="warning")
        env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
        _, stages = _stages()
        log = tmp_path / "serve.log"
        proc = _start(_entry_command(stages), env, log)
        try:
            _wait_http(f"http://127.0.0.1:{port}/healthz", proc, log)
            r = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=10)
            assert r.status_code == 200 and r.json()["storage"] == env_c["CKPTD_ROOT"], r.text
            import torch
            from ckptd_client import CheckpointClient

            CheckpointClient(f"http://127.0.0.1:{port}").save({"w": torch.arange(64.0)}, "quick/1").wait()
            ls = subprocess.run([str(VENV_BIN / "ckptd"), "ls", "quick"], env=env, capture_output=True, text=True,
                                timeout=120)
            assert ls.returncode == 0 and "quick/1" in ls.stdout, ls.stdout + ls.stderr
        finally:
            _stop(proc)
    finally:
        moto.stop()


# -- Kubernetes -------------------------------------------------------------------------------------

def _load(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _manifests(folder: Path = K8S) -> list[tuple[str, dict]]:
    """(file name, document) of every manifest in ``folder`` (its kustomization is not one)."""
    return [(f.name, d) for f in sorted(folder.glob("*.yaml")) if f.name != KUSTOMIZATION for d in _load(f)]


def _one(kind: str, name: str | None = None, folder: Path = K8S) -> dict:
    found = [d for _, d in _manifests(folder) if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"{folder.name}: {kind} {name or ''}: {len(found)} found"
    return found[0]


def _validate(where: str, doc: dict) -> None:
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{where}: {doc['kind']}/{doc['metadata']['name']} against Kubernetes {version}: "
                        f"{'.'.join(map(str, e.path))}: {e.message}")


@pytest.mark.parametrize("folder, kinds", [
    (K8S, ["ConfigMap", "Deployment", "Job", "PodDisruptionBudget", "Secret", "Service"]),
    (TIERED, ["ConfigMap", "PersistentVolume", "PodDisruptionBudget", "Service", "StatefulSet", "StorageClass"]),
    (NODE_LOCAL, ["ConfigMap", "DaemonSet", "Service"]),
], ids=["plain", "tiered", "node-local"])
def test_k8s_manifests_validate_against_the_kubernetes_schemas(folder, kinds):
    docs = _manifests(folder)
    assert sorted({d["kind"] for _, d in docs}) == kinds
    for name, doc in docs:
        _validate(f"{folder.relative_to(REPO)}/{name}", doc)


# -- kustomize: what `kubectl apply -k` applies ----------------------------------------------------

def _pod_specs(doc: dict) -> list[dict]:
    """The pod specs a workload manifest carries (none for other kinds)."""
    spec = doc.get("spec") or {}
    if doc["kind"] == "Pod":
        return [spec]
    if doc["kind"] == "CronJob":
        return [spec["jobTemplate"]["spec"]["template"]["spec"]]
    return [spec["template"]["spec"]] if isinstance(spec.get("template"), dict) else []


def _containers(doc: dict) -> list[dict]:
    return [c for p in _pod_specs(doc) for key in ("initContainers", "containers") for c in p.get(key, [])]


def _split_image(ref: str) -> tuple[str, str]:
    """(name, ":tag" or "@digest" or "") as kustomize splits an image reference."""
    if "@" in ref:
        name, digest = ref.split("@", 1)
        return name, f"@{digest}"
    slash = ref.rfind("/")
    colon = ref.rfind(":")
    return (ref[:colon], ref[colon:]) if colon > slash else (ref, "")


def _set_image(ref: str, rules: list[dict]) -> str:
    """kustomize's image transformer: the rule whose ``name`` is the image's name sets its name, tag or digest."""
    name, suffix = _split_image(ref)
    for r in rules:
        if r["name"] == name:
            suffix = f"@{r['digest']}" if "digest" in r else f":{r['newTag']}" if "newTag" in r else suffix
            return r.get("newName", name) + suffix
    return ref


def _kustomize(folder: Path, images: list[dict] | None = None) -> list[dict]:
    """What ``kubectl apply -k FOLDER`` applies: the listed resources, each container's image set by the
    kustomization's ``images:`` (or by ``images``, an operator's edit of it). Only the fields these
    kustomizations use are understood here; another one is refused, so that it gets rendered here first."""
    k = yaml.safe_load((folder / KUSTOMIZATION).read_text())
    assert (k["apiVersion"], k["kind"]) == ("kustomize.config.k8s.io/v1beta1", "Kustomization")
    assert set(k) <= {"apiVersion", "kind", "resources", "images"}, f"{folder}: {sorted(k)}: render those here too"
    docs = [d for r in k["resources"] for d in _load(folder / r)]
    for d in docs:
        for c in _containers(d):
            c["image"] = _set_image(c["image"], k.get("images", []) if images is None else images)
    return docs


def _by_kind_and_name(docs: list[dict]) -> dict[tuple[str, str], dict]:
    out = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    assert len(out) == len(docs), "two resources of one kind and name"
    return out


@pytest.mark.parametrize("folder", [K8S, TIERED, NODE_LOCAL], ids=["plain", "tiered", "node-local"])
def test_k8s_kustomization_renders_and_every_image_is_the_operators(folder, tmp_path):
    """``kubectl apply -k`` applies every manifest of the folder but its templates, valid; the image the
    operator names in ``images:`` (a registry mirror's path) is the image of every container, so no pull
    escapes the mirror; ``kubectl kustomize``, where it is installed, renders the same."""
    k = yaml.safe_load((folder / KUSTOMIZATION).read_text())
    files = {f.name for f in folder.glob("*.yaml")} - {KUSTOMIZATION}
    assert set(k["resources"]) == files - TEMPLATES[folder], "a manifest neither applied by -k nor a template"
    assert all((folder / t).is_file() for t in TEMPLATES[folder])
    (rule,) = k["images"]
    rendered = _kustomize(folder)
    for d in rendered:
        _validate(f"{folder.relative_to(REPO)}/{KUSTOMIZATION}", d)
    assert {c["image"] for d in rendered for c in _containers(d)} == {f"{rule['newName']}:{rule['newTag']}"}

    mirror = [{**rule, "newName": MIRROR_IMAGE}]
    mirrored = _kustomize(folder, mirror)
    images = {c["image"] for d in mirrored for c in _containers(d)}
    assert images == {f"{MIRROR_IMAGE}:{rule['newTag']}"}, images
    # The templates applied apart carry the same image name, which the documented sed rewrites.
    for t in TEMPLATES[folder]:
        for d in _load(folder / t):
            assert all(_split_image(c["image"])[0] == rule["name"] for c in _containers(d)), t

    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return  # the rendering above is the one checked; kubectl's own is compared where it is installed
    copy = tmp_path / folder.name
    shutil.copytree(folder, copy)
    for imgs, want in ((None, rendered), (mirror, mirrored)):
        if imgs is not None:
            (copy / KUSTOMIZATION).write_text(yaml.safe_dump({**k, "images": imgs}))
        r = subprocess.run([kubectl, "kustomize", str(copy)], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert _by_kind_and_name(list(yaml.safe_load_all(r.stdout))) == _by_kind_and_name(want)


# -- disruption budgets ------------------------------------------------------------------------------

def _selects(selector: dict, labels: dict) -> bool:
    assert set(selector) == {"matchLabels"}, selector  # matchExpressions would need evaluating here
    return selector["matchLabels"].items() <= labels.items()


def _workloads() -> list[tuple[Path, dict]]:
    return [(f, d) for f in (K8S, TIERED, NODE_LOCAL) for _, d in _manifests(f) if _pod_specs(d)]


@pytest.mark.parametrize("folder, kind", [(K8S, "Deployment"), (TIERED, "StatefulSet")], ids=["plain", "tiered"])
def test_k8s_disruption_budget_covers_the_replicas_and_only_them(folder, kind):
    """The budget's selector picks the replicas' pods and no other pod of either layout (not the reshard
    Job's: evicting a worker pod is harmless, and counting it would let a replica go); it keeps at least
    one replica up, and less than all of them, so a drain proceeds one replica at a time and never
    waits for good."""
    pdb, workload = _one("PodDisruptionBudget", folder=folder), _one(kind, folder=folder)
    sel = pdb["spec"]["selector"]
    assert _selects(sel, workload["spec"]["template"]["metadata"]["labels"])
    for where, other in _workloads():
        if (where, other["kind"], other["metadata"]["name"]) != (folder, kind, workload["metadata"]["name"]):
            assert not _selects(sel, other["spec"]["template"]["metadata"]["labels"]), (
                f"{pdb['metadata']['name']} also selects {where.name}/{other['kind']}/{other['metadata']['name']}")
    replicas, spec = workload["spec"]["replicas"], pdb["spec"]
    assert replicas >= 2
    assert ("minAvailable" in spec) != ("maxUnavailable" in spec)
    if "minAvailable" in spec:
        assert isinstance(spec["minAvailable"], int) and 1 <= spec["minAvailable"] < replicas, (spec, replicas)
    else:
        assert isinstance(spec["maxUnavailable"], int) and 1 <= spec["maxUnavailable"] < replicas, (spec, replicas)
    assert spec.get("unhealthyPodEvictionPolicy") == "AlwaysAllow"


def test_k8s_manifests_agree(routes):
    _, stages = _stages()
    image_uid = int(_last(stages[-1], "USER").value[0].split(":")[0])
    cm, dep, svc, job = _one("ConfigMap"), _one("Deployment"), _one("Service"), _one("Job")
    secrets = {d["metadata"]["name"]: d for _, d in _manifests() if d["kind"] == "Secret"}
    config = cm["data"]
    _check_ckptd_vars(config, "ConfigMap")
    assert urlsplit(config["CKPTD_ROOT"]).scheme == "s3"
    port = int(config["CKPTD_PORT"])

    pod = dep["spec"]["template"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (ctr,) = pod["spec"]["containers"]
    assert ctr["args"] == ["serve"]
    ports = {p["name"]: p["containerPort"] for p in ctr["ports"]}
    assert list(ports.values()) == [port]
    assert all(p["targetPort"] in ports or p["targetPort"] == port for p in svc["spec"]["ports"])
    # Probes on routes the service has; config and secrets from the manifests that define them; the
    # tokens Secret is the file CKPTD_TOKENS_FILE names.
    env, vol, tokens_file = _check_server_container(ctr, pod["spec"], "Deployment", set(ports), routes, cm, secrets)
    _check_env_from(job["spec"]["template"]["spec"]["containers"][0], cm, secrets)
    (item,) = vol["secret"]["items"]
    assert item["path"] == tokens_file.name and item["key"] in secrets[vol["secret"]["secretName"]]["stringData"]

    # Non-root as the image's own user, and the same image for the service and the workers.
    for pod_spec in (pod["spec"], job["spec"]["template"]["spec"]):
        sc = pod_spec["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] == image_uid
        assert pod_spec["containers"][0]["securityContext"]["allowPrivilegeEscalation"] is False
    assert job["spec"]["template"]["spec"]["containers"][0]["image"] == ctr["image"]


_QUANTITY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "": 1}


def _bytes(quantity: str) -> int:
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti|Pi|)", str(quantity))
    assert m, f"storage quantity {quantity!r}: binary suffixes only here"
    return int(m[1]) * _QUANTITY[m[2]]


def test_k8s_tiered_manifests_agree(routes):
    """The tiered layout: the fast tier is each replica's own node-local volume, mounted where CKPTD_ROOT
    points and claimed from the local StorageClass the PersistentVolume template feeds; the durable tier
    is the bucket (the plain layout's root); replicas are reached one by one (a headless Service, no
    Service balancing over them: a save spread over two fast tiers never commits) and spread over
    nodes; the reshard Job template and the Secrets of the plain layout serve this one too."""
    _, stages = _stages()
    image_uid = int(_last(stages[-1], "USER").value[0].split(":")[0])
    cm, sts, svc = _one("ConfigMap", folder=TIERED), _one("StatefulSet", folder=TIERED), _one("Service", folder=TIERED)
    sc, pv = _one("StorageClass", folder=TIERED), _one("PersistentVolume", folder=TIERED)
    plain_cm, dep, job = _one("ConfigMap"), _one("Deployment"), _one("Job")
    secrets = {d["metadata"]["name"]: d for _, d in _manifests() if d["kind"] == "Secret"}
    config = cm["data"]
    _check_ckptd_vars(config, "tiered ConfigMap")

    # Two tiers: a local fast root, the bucket behind it (where the plain layout keeps its checkpoints).
    root, durable = config["CKPTD_ROOT"], config["CKPTD_DURABLE"]
    assert root.startswith("/") and "://" not in root, root
    assert urlsplit(durable).scheme == "s3" and urlsplit(durable).path.strip("/"), durable
    assert durable == plain_cm["data"]["CKPTD_ROOT"]
    assert Settings(root=root, durable=durable).storage_url() == f"tiered:{root}|{durable}"
    # The shared Job template and the Secrets: the names this layout's pods take them by.
    assert cm["metadata"]["name"] == plain_cm["metadata"]["name"]
    (job_ctr,) = job["spec"]["template"]["spec"]["containers"]
    assert {s["configMapRef"]["name"] for s in job_ctr["envFrom"] if "configMapRef" in s} == {cm["metadata"]["name"]}

    pod = sts["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert _selects(sts["spec"]["selector"], labels) and svc["spec"]["selector"].items() <= labels.items()
    assert sts["spec"]["replicas"] >= 2
    (ctr,) = pod["spec"]["containers"]
    assert ctr["args"] == ["serve"] and ctr["image"] == dep["spec"]["template"]["spec"]["containers"][0]["image"]
    assert job_ctr["image"] == ctr["image"]
    ports = {p["name"]: p["containerPort"] for p in ctr["ports"]}
    assert list(ports.values()) == [int(config["CKPTD_PORT"])]
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz"), ("startupProbe", "/healthz")):
        get = ctr[probe]["httpGet"]
        assert get["path"] == path and path in routes and get["port"] in ports, (probe, get)
    for src in ctr["envFrom"]:
        if "configMapRef" in src:
            assert src["configMapRef"]["name"] == cm["metadata"]["name"]
        else:
            assert src["secretRef"]["name"] in secrets
    env = {e["name"]: e.get("value") for e in ctr["env"]}
    _check_ckptd_vars(env, "StatefulSet")
    assert not {"CKPTD_ROOT", "CKPTD_DURABLE"} & set(env), "the tiers are the ConfigMap's"
    tokens_file = Path(env["CKPTD_TOKENS_FILE"])
    vol = next(v for v in pod["spec"]["volumes"] if "secret" in v)
    mount = next(m for m in ctr["volumeMounts"] if m["name"] == vol["name"])
    assert mount["readOnly"] and Path(mount["mountPath"]) == tokens_file.parent
    assert vol["secret"]["secretName"] in secrets

    # The fast tier: a claim of its own per replica, mounted exactly where CKPTD_ROOT points.
    at_root = [m for m in ctr["volumeMounts"] if Path(m["mountPath"]) == Path(root)]
    assert len(at_root) == 1, f"CKPTD_ROOT={root}: the mounts are at {[m['mountPath'] for m in ctr['volumeMounts']]}"
    (fast,) = at_root
    assert not fast.get("readOnly")
    (claim,) = [c for c in sts["spec"]["volumeClaimTemplates"] if c["metadata"]["name"] == fast["name"]]
    assert fast["name"] not in {v["name"] for v in pod["spec"]["volumes"]}, "a pod volume would shadow the claim"
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert sts["spec"]["persistentVolumeClaimRetentionPolicy"] == {"whenDeleted": "Retain", "whenScaled": "Retain"}
    # ... from node-local disks, bound once the pod is placed, which the PersistentVolume template offers.
    assert claim["spec"]["storageClassName"] == sc["metadata"]["name"] == pv["spec"]["storageClassName"]
    assert sc["provisioner"] == "kubernetes.io/no-provisioner" and sc["volumeBindingMode"] == "WaitForFirstConsumer"
    assert pv["spec"]["local"]["path"].startswith("/")
    (term,) = pv["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"]
    assert [e["key"] for e in term["matchExpressions"]] == ["kubernetes.io/hostname"]
    assert set(claim["spec"]["accessModes"]) <= set(pv["spec"]["accessModes"])
    assert _bytes(claim["spec"]["resources"]["requests"]["storage"]) <= _bytes(pv["spec"]["capacity"]["storage"])
    assert pv["spec"]["persistentVolumeReclaimPolicy"] == "Retain"

    # Writable by the image's user without walking the disk at each start; one replica per node.
    sec = pod["spec"]["securityContext"]
    assert sec["runAsNonRoot"] is True and sec["runAsUser"] == image_uid
    assert sec["fsGroup"] == sec["runAsGroup"] and sec["fsGroupChangePolicy"] == "OnRootMismatch"
    assert ctr["securityContext"]["allowPrivilegeEscalation"] is False
    (anti,) = pod["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti["topologyKey"] == "kubernetes.io/hostname" and _selects(anti["labelSelector"], labels)

    # Reached one replica at a time: its Service is headless and names the StatefulSet's pods, and no
    # Service of either layout balances over them.
    assert svc["spec"].get("clusterIP") == "None" and sts["spec"]["serviceName"] == svc["metadata"]["name"]
    assert all(p["targetPort"] in ports for p in svc["spec"]["ports"])
    for folder in (K8S, TIERED, NODE_LOCAL):
        for _, other in _manifests(folder):
            if other["kind"] == "Service" and other["spec"].get("clusterIP") != "None":
                assert not other["spec"]["selector"].items() <= labels.items(), other["metadata"]["name"]


def _trainer_pod() -> dict:
    """The trainer pod of docs/deployment.md's "Node-local replicas": its one YAML block."""
    blocks = re.findall(r"^```yaml\n(.*?)^```", _doc_section("Node-local replicas"), re.M | re.S)
    assert len(blocks) == 1, "docs/deployment.md, Node-local replicas: one yaml block, the trainer pod"
    return yaml.safe_load(blocks[0])


def _expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` in an env value, from the variables defined before it."""
    return re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], value)


def test_k8s_node_local_manifests_agree(routes):
    """The node-local layout: a replica on every training node (a DaemonSet with placeholders for the
    nodes' label and taints) on the plain layout's bucket, direct uploads off so each node's ranks hand
    their bytes to their own node's replica; reached at the node's address (``hostPort``, the pod's own
    network namespace kept), with a Service over every replica as the trainers' second URL; the socket
    made where TMPDIR points, a node directory that only a CHOWN-only init step touches as root and that
    the trainer pod of docs/deployment.md mounts at the same path, read-only, and whose URLs it names."""
    _, stages = _stages()
    image_uid = int(_last(stages[-1], "USER").value[0].split(":")[0])
    cm, ds, svc = (_one(k, folder=NODE_LOCAL) for k in ("ConfigMap", "DaemonSet", "Service"))
    plain_cm, dep = _one("ConfigMap"), _one("Deployment")
    secrets = {d["metadata"]["name"]: d for _, d in _manifests() if d["kind"] == "Secret"}
    config = cm["data"]
    _check_ckptd_vars(config, "node-local ConfigMap")
    assert cm["metadata"]["name"] == plain_cm["metadata"]["name"]
    assert config["CKPTD_ROOT"] == plain_cm["data"]["CKPTD_ROOT"] and urlsplit(config["CKPTD_ROOT"]).scheme == "s3"
    settings = Settings(direct_uploads=config["CKPTD_DIRECT_UPLOADS"], local_uploads=config["CKPTD_LOCAL_UPLOADS"])
    assert settings.direct_uploads is False and settings.local_uploads is True
    port = int(config["CKPTD_PORT"])

    pod = ds["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert _selects(ds["spec"]["selector"], labels) and svc["spec"]["selector"].items() <= labels.items()
    spec = pod["spec"]
    assert spec["nodeSelector"] and spec["tolerations"], "the training nodes' label and taints, to fill in"
    assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC")
    (ctr,) = spec["containers"]
    assert ctr["args"] == ["serve"] and ctr["image"] == dep["spec"]["template"]["spec"]["containers"][0]["image"]
    (p,) = ctr["ports"]
    assert p["containerPort"] == p["hostPort"] == port
    env, vol, tokens_file = _check_server_container(ctr, spec, "DaemonSet", {p["name"]}, routes, cm, secrets)
    assert vol["secret"]["secretName"] in secrets
    assert svc["spec"].get("clusterIP") != "None" and all(pt["targetPort"] == p["name"] for pt in svc["spec"]["ports"])

    # The socket's directory: TMPDIR, the node's directory mounted there, at the same path.
    (sock_mount,) = [m for m in ctr["volumeMounts"] if Path(m["mountPath"]) == Path(env["TMPDIR"])]
    (sockets,) = [v for v in spec["volumes"] if v["name"] == sock_mount["name"]]
    assert "hostPath" in sockets, f"TMPDIR={env['TMPDIR']}: the volume there is not the node's directory"
    assert sockets["hostPath"]["path"] == sock_mount["mountPath"] and not sock_mount.get("readOnly")

    # Non-root as the image's user; the one root step changes the directory's owner, with CHOWN alone.
    sec = spec["securityContext"]
    assert sec["runAsNonRoot"] is True and sec["runAsUser"] == image_uid
    assert ctr["securityContext"]["allowPrivilegeEscalation"] is False
    assert ctr["securityContext"]["readOnlyRootFilesystem"] is True and ctr["securityContext"]["capabilities"]["drop"] == ["ALL"]
    (init,) = spec["initContainers"]
    assert init["image"] == ctr["image"]
    assert init["command"] == ["chown", f"{image_uid}:{sec['runAsGroup']}", sock_mount["mountPath"]]
    assert [m["mountPath"] for m in init["volumeMounts"]] == [sock_mount["mountPath"]]
    isec = init["securityContext"]
    assert isec["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]} and isec["allowPrivilegeEscalation"] is False

    # The trainer pod of docs/deployment.md: valid; its URLs are its node's replica, then the Service;
    # the node's socket directory at the replica's TMPDIR, read-only (it connects, it binds nothing).
    trainer = _trainer_pod()
    _validate("docs/deployment.md, Node-local replicas", trainer)
    (tctr,) = trainer["spec"]["containers"]
    tenv: dict[str, str] = {}
    for e in tctr["env"]:
        if e.get("valueFrom"):
            assert e["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP", e
            tenv[e["name"]] = "10.0.0.7"  # the node's address
        else:
            tenv[e["name"]] = _expand(e["value"], tenv)
    from ckptd_client.transport import split_urls

    own, other = split_urls(tenv["CKPTD_URL"])
    assert (urlsplit(own).hostname, urlsplit(own).port) == ("10.0.0.7", p["hostPort"])
    assert urlsplit(other).hostname.split(".")[0] == svc["metadata"]["name"]
    assert urlsplit(other).port == svc["spec"]["ports"][0]["port"]
    (tmount,) = tctr["volumeMounts"]
    (tvol,) = trainer["spec"]["volumes"]
    assert tmount["name"] == tvol["name"] and tmount["mountPath"] == env["TMPDIR"] and tmount["readOnly"] is True
    assert tvol["hostPath"]["path"] == sockets["hostPath"]["path"]


@pytest.mark.slow
def test_node_local_replica_serves_its_socket_where_the_trainers_mount_it(tmp_path):
    """The DaemonSet's container, with the node-local ConfigMap's environment, runs here (the bucket a
    directory, the node's socket directory one of this machine's): the socket is made in that
    directory, and a rank here, given only the replica's URL, hands every file over through it; the
    checkpoint loads bit for bit."""
    import torch
    from ckptd_client import CheckpointClient
    from support import assert_bits_equal, blank_like

    config = _one("ConfigMap", folder=NODE_LOCAL)["data"]
    (ctr,) = _one("DaemonSet", folder=NODE_LOCAL)["spec"]["template"]["spec"]["containers"]
    _, stages = _stages()
    entry = _exec_form(next(_last(s, "ENTRYPOINT") for s in reversed(_chain(stages, stages[-1]))
                            if _last(s, "ENTRYPOINT")))
    # the node's directory (the pod's TMPDIR, the trainers' mount): short, as /run/ckptd is, since a
    # socket's path must fit in 107 bytes (pytest's temporary paths can be longer)
    sockets = Path(tempfile.mkdtemp(prefix="ckptd-s-", dir="/tmp"))
    env = _pod_env(config, CKPTD_ROOT=str(tmp_path / "bucket"), TMPDIR=str(sockets))
    log = tmp_path / "replica.log"
    proc = _start(entry + ctr["args"], env, log)
    url = f"http://127.0.0.1:{env['CKPTD_PORT']}"
    try:
        _wait_http(f"{url}/healthz", proc, log)
        assert [p.suffix for p in sockets.iterdir()] == [".sock"], list(sockets.iterdir())
        g = torch.Generator().manual_seed(3)
        src = {"model": {"w": torch.randn(256, 64, generator=g), "b": torch.randn(256, generator=g)}}
        with CheckpointClient(url, incremental=False) as c:
            h = c.save(src, "node/1")
            h.wait()
            assert h.ways.files["socket"] > 0 and h.ways.files["http"] == 0, str(h.ways)
            got = blank_like(src)
            c.load(got, "node/1")
        assert_bits_equal(got, src)
    finally:
        stopped = _stop(proc)
        shutil.rmtree(sockets, ignore_errors=True)
        assert stopped in (0, -signal.SIGTERM), log.read_text()[-3000:]


PLAN_PLACEHOLDER = "s3://ckptd/plans/PLAN.json"


def _readme_sed() -> str:
    """docs/deployment.md's command that fills in the Job template (without its ``| kubectl apply``)."""
    readme = (REPO / "docs" / "deployment.md").read_text()
    m = re.search(r"^sed .*?deploy/k8s/reshard-job\.yaml", readme, re.M | re.S)
    assert m, "docs/deployment.md: no sed command filling in deploy/k8s/reshard-job.yaml"
    return m[0]


def _filled_job(tmp_path: Path, plan: str, workers: int, name: str, image: str = f"{MIRROR_IMAGE}:0.1.0") -> dict:
    """The Job template filled in by the command docs/deployment.md gives."""
    r = subprocess.run(["bash", "-c", _readme_sed()], cwd=REPO, capture_output=True, text=True, timeout=30,
                       env={**os.environ, "PLAN": plan, "WORKERS": str(workers), "JOB": name, "IMAGE": image})
    assert r.returncode == 0, r.stderr
    (job,) = [d for d in yaml.safe_load_all(r.stdout) if d]
    return job


def test_readme_fills_in_the_reshard_job_template(tmp_path):
    text = (K8S / "reshard-job.yaml").read_text()
    for pattern in (r"^  name: ckptd-reshard$", r"^  completions: ", r"^  parallelism: "):
        assert len(re.findall(pattern, text, re.M)) == 1, f"the sed of docs/deployment.md relies on one line matching {pattern}"
    assert text.count(PLAN_PLACEHOLDER) == 1 and text.count("image: ckptd:0.1.0") == 1  # the sed's image line
    job = _filled_job(tmp_path, "s3://ckptd/plans/gpt-1000-dp4.json", 12, "reshard-gpt-1000-dp4")
    assert job["metadata"]["name"] == "reshard-gpt-1000-dp4"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 12
    assert "s3://ckptd/plans/gpt-1000-dp4.json" in job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert job["spec"]["template"]["spec"]["containers"][0]["image"] == f"{MIRROR_IMAGE}:0.1.0"
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(job, version, strict=True)


def _job_args(job: dict, index: int) -> list[str]:
    """The worker container's arguments as Kubernetes expands them for completion ``index``."""
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["template"]["spec"]["restartPolicy"] == "Never"
    (ctr,) = spec["template"]["spec"]["containers"]
    env = {e["name"]: e for e in ctr["env"]}
    assert env["JOB_COMPLETION_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.annotations['batch.kubernetes.io/job-completion-index']")
    values = {"JOB_COMPLETION_INDEX": str(index)}
    return [re.sub(r"\$\((\w+)\)", lambda m: values[m[1]], a) for a in ctr["args"]]


def test_reshard_job_arguments_run_one_unit_per_index(tmp_path):
    """The Indexed Job's container arguments, run here once per completion index, commit the output."""
    import torch

    from ckptd.cli.main import build_parser
    from ckptd.storage import open_storage
    from ckptd.store import CheckpointReader, SessionStore
    from stored_tensors import read_tensor, write_tensors

    root = str(tmp_path / "root")
    g = torch.Generator().manual_seed(5)
    src = {"model.w": torch.randn(33, 17, generator=g), "model.b": torch.randn(33, generator=g)}
    write_tensors(SessionStore(open_storage(root)), "job/10", src, step=10)
    plan = str(tmp_path / "plans" / "job-10-dp2.json")
    (tmp_path / "plans").mkdir()
    ckptd = str(VENV_BIN / "ckptd")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CKPTD_", "AWS_"))}
    env["CKPTD_ROOT"] = root
    w = subprocess.run([ckptd, "reshard", "job/10", "--to", "fsdp2:dp=2", "--write-plan", plan], env=env,
                       capture_output=True, text=True, timeout=180)
    assert w.returncode == 0, w.stderr
    info = json.loads(w.stdout)
    assert info["workers"] == info["units"] >= 2
    job = _filled_job(tmp_path, plan, info["workers"], "reshard-job-10")
    assert job["spec"]["completions"] == info["workers"]
    for i in range(job["spec"]["completions"]):  # one pod per completion index
        argv = _job_args(job, i)
        assert build_parser().parse_args(argv).index == i
        wenv = {**env, "JOB_COMPLETION_INDEX": str(i)}
        r = subprocess.run([ckptd, *argv], env=wenv, capture_output=True, text=True, timeout=180)
        assert r.returncode == 0, r.stderr
    assert "committed" in json.loads(r.stdout), r.stdout
    v = subprocess.run([ckptd, "verify", info["out"]], env=env, capture_output=True, text=True, timeout=180)
    assert v.returncode == 0, v.stdout + v.stderr
    reader = CheckpointReader(open_storage(root))
    for name, t in src.items():
        assert torch.equal(read_tensor(reader, info["out"], name), t), name


# -- the tiered layout, run here -------------------------------------------------------------------

def test_docs_fill_in_the_local_volume_template_per_node():
    """docs/deployment.md's loop makes one valid PersistentVolume per node, named after it and tied to it."""
    text = (TIERED / "local-pv.yaml").read_text()
    assert text.count("ckptd-fast-NODE") == 1 and text.count('"NODE"') == 1
    m = re.search(r"^\s*(sed .*?deploy/k8s/tiered/local-pv\.yaml)", _doc_section("Fast local tier, durable S3"), re.M)
    assert m, "docs/deployment.md: no sed filling in deploy/k8s/tiered/local-pv.yaml"
    r = subprocess.run(["bash", "-c", m[1]], cwd=REPO, capture_output=True, text=True, timeout=30,
                       env={**os.environ, "NODE": "gpu-node-7"})
    assert r.returncode == 0, r.stderr
    (pv,) = [d for d in yaml.safe_load_all(r.stdout) if d]
    _validate("local-pv.yaml, filled in", pv)
    assert pv["metadata"]["name"] == "ckptd-fast-gpu-node-7"
    (term,) = pv["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"]
    assert term["matchExpressions"] == [{"key": "kubernetes.io/hostname", "operator": "In", "values": ["gpu-node-7"]}]


def _pod_env(config: dict[str, str], **over: str) -> dict[str, str]:
    """A pod's environment from the tiered ConfigMap, run here: loopback and a free port instead of
    0.0.0.0:8470, ``over`` for the paths a pod sees through its volumes; no AWS variables (the bucket
    is a directory here)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "CKPTD_"))}
    env.update({k: v for k, v in config.items() if not k.startswith("AWS_")})
    env.update(CKPTD_HOST="127.0.0.1", CKPTD_PORT=str(free_port()), CKPTD_LOG_LEVEL="warning", **over)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


def _doc_command(section: str, pattern: str) -> str:
    m = re.search(pattern, _doc_section(section), re.M)
    assert m, f"docs/deployment.md, {section}: no command matching {pattern}"
    return m[1]


def test_tiered_replicas_and_the_reshard_job_run_here(tmp_path):
    """The StatefulSet's container, with the tiered ConfigMap's environment, runs here as replicas with
    their own fast tiers (each a directory where CKPTD_ROOT points, as the pod's own volume) in front
    of one durable tier (a directory standing for the bucket). A save through replica 0 becomes durable;
    the reshard job is written as docs/deployment.md says (``--root`` the durable tier) and the shared Job
    template's workers, in pods without a fast tier, read and commit on the durable tier only; a replica
    started afterwards on a new fast tier lists both checkpoints and loads the output bit for bit."""
    import torch
    from ckptd_client import CheckpointClient
    from support import assert_bits_equal, blank_like

    config = _one("ConfigMap", folder=TIERED)["data"]
    (ctr,) = _one("StatefulSet", folder=TIERED)["spec"]["template"]["spec"]["containers"]
    _, stages = _stages()
    entry = _exec_form(next(_last(s, "ENTRYPOINT") for s in reversed(_chain(stages, stages[-1]))
                            if _last(s, "ENTRYPOINT")))
    argv = entry + ctr["args"]  # the pod's command: the image's ENTRYPOINT with the container's args
    bucket = tmp_path / "bucket"
    ckptd = str(VENV_BIN / "ckptd")

    def replica(i: int) -> tuple[subprocess.Popen, str, dict[str, str]]:
        env = _pod_env(config, CKPTD_ROOT=str(tmp_path / f"node{i}" / "data"), CKPTD_DURABLE=str(bucket))
        log = tmp_path / f"replica{i}.log"
        proc = _start(argv, env, log)
        url = f"http://127.0.0.1:{env['CKPTD_PORT']}"
        _wait_http(f"{url}/healthz", proc, log)
        return proc, url, env

    g = torch.Generator().manual_seed(11)
    src = {"model": {"w": torch.randn(64, 16, generator=g), "b": torch.randn(64, generator=g)}}
    proc0, url0, env0 = replica(0)
    try:
        with CheckpointClient(url0, incremental=False) as c:
            st = c.save(src, "gpt/1000").wait(durable=True)
        assert st.durable is True

        # The job, written from replica 0's pod against the durable tier (docs/deployment.md's command).
        write = _doc_command("Fast local tier, durable S3",
                             r"^kubectl exec ckptd-tiered-0 -- (ckptd reshard .*?--root \"\$DURABLE\".*?) \| tee")
        plan = tmp_path / "plans" / "gpt-1000-dp4.json"
        plan.parent.mkdir()
        w = subprocess.run(["bash", "-c", write], env={**env0, "DURABLE": str(bucket), "PLAN": str(plan)},
                           capture_output=True, text=True, timeout=180)
        assert w.returncode == 0, w.stdout + w.stderr
        info = json.loads(w.stdout)
        # The workers' root is the plan's: the durable tier, which every node reaches (here every path is
        # reachable; on a cluster a node-local fast tier is not).
        assert Path(json.loads(plan.read_text())["root"]).resolve() == bucket.resolve()
    finally:
        assert _stop(proc0) in (0, -signal.SIGTERM), (tmp_path / "replica0.log").read_text()[-3000:]

    # The Job's pods: the same ConfigMap, no volume where CKPTD_ROOT points.
    job = _filled_job(tmp_path, str(plan), info["workers"], "reshard-gpt-1000-dp4")
    no_fast = tmp_path / "worker" / "data"
    wenv = _pod_env(config, CKPTD_ROOT=str(no_fast), CKPTD_DURABLE=str(bucket))
    for i in range(job["spec"]["completions"]):
        r = subprocess.run([ckptd, *_job_args(job, i)], env={**wenv, "JOB_COMPLETION_INDEX": str(i)},
                           capture_output=True, text=True, timeout=180)
        assert r.returncode == 0, r.stdout + r.stderr
    assert "committed" in json.loads(r.stdout), r.stdout
    assert not no_fast.exists(), "a reshard worker wrote where a pod has no volume"
    out = info["out"]
    assert (bucket / "runs" / "gpt" / out.split("/", 1)[1] / "COMMITTED").is_file()
    verify = _doc_command("Fast local tier, durable S3",
                          r"^kubectl exec ckptd-tiered-0 -- (ckptd verify \S+ --root \"\$DURABLE\")")
    assert f" {out} " in f" {verify} "
    v = subprocess.run(["bash", "-c", verify], env={**wenv, "DURABLE": str(bucket)}, capture_output=True,
                       text=True, timeout=180)
    assert v.returncode == 0, v.stdout + v.stderr

    # A replica on a new fast tier (another node's volume) serves what the durable tier holds.
    proc1, url1, _ = replica(1)
    try:
        names = {c["name"] for c in httpx.get(f"{url1}/v1/runs/gpt/checkpoints", timeout=30).json()}
        assert {"1000", out.split("/", 1)[1]} <= names, names
        got = blank_like(src)
        with CheckpointClient(url1) as c:
            c.load(got, out)
        assert_bits_equal(got, src)
    finally:
        assert _stop(proc1) in (0, -signal.SIGTERM), (tmp_path / "replica1.log").read_text()[-3000:]
