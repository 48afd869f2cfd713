"""The layers hold: dependencies point one way, and only through public names.

``ckptd_schemas`` (the format and the error types) imports neither other package;
``ckptd_client`` (what a trainer imports) never imports the service; ``ckptd`` (service,
store, reshard, CLI) uses ``ckptd_client`` only through its public modules, never a
``ckptd_client._private`` one, and of those only the catalog client (``CatalogClient``, for the
``--server`` commands): the byte format both sides read (``ckptd_schemas.format``: codecs, frame
checks, the copy kernel, safe objects) lives below both and imports neither; nothing below the CLI
imports the CLI; no module of the three packages takes part in an import cycle. Inside ``ckptd``
the layers stand in one order, storage, store, then reshard and interop side by side, the
service, the CLI, and a module imports only its own layer or those below; the storage backends
know keys, not where a checkpoint's files lie; the service observes the store through its events,
never by subclassing it; the product carries no fault injection (the tests wrap it around the
service). Every import counts, those inside functions and under ``TYPE_CHECKING``
too. Each rule is also run over the imports that broke it once, and must flag exactly those.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

from support import REPO
PACKAGES = {"ckptd": REPO / "ckptd", "ckptd_client": REPO / "client", "ckptd_schemas": REPO / "schemas"}


def _module_name(package: str, path: Path) -> str:
    rel = path.relative_to(PACKAGES[package]).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join([package, *parts])


def _imports(package: str, path: Path) -> list[tuple[int, str]]:
    """Every module ``path`` imports (absolute names; ``from x import y`` also yields ``x.y``)."""
    me = _module_name(package, path)
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = me.split(".")
                base = base[:len(base) - node.level + (1 if is_pkg else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((node.lineno, mod))
            out += [(node.lineno, f"{mod}.{a.name}") for a in node.names]
    return out


@functools.cache
def _all_imports() -> dict[str, list[tuple[Path, int, str]]]:
    found: dict[str, list[tuple[Path, int, str]]] = {}
    for package, root in PACKAGES.items():
        for path in sorted(root.rglob("*.py")):
            for line, mod in _imports(package, path):
                found.setdefault(_module_name(package, path), []).append((path, line, mod))
    return found


def _private(mod: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in mod.split(".")[1:])


def test_the_service_uses_only_public_client_modules():
    bad = [f"{p.relative_to(REPO)}:{line} imports {mod}" for me, rows in _all_imports().items()
           if me.split(".")[0] == "ckptd" for p, line, mod in rows
           if mod.split(".")[0] == "ckptd_client" and _private(mod)]
    assert not bad, "ckptd imports private ckptd_client modules:\n" + "\n".join(bad)


CATALOG = {"ckptd_client", "ckptd_client.CatalogClient", "ckptd_client.catalog"}
"""What the service may import from ``ckptd_client``: the catalog client (``ckptd_client.catalog``
and what it defines)."""


def _beyond_the_catalog(mod: str) -> bool:
    """True for an import of ``ckptd_client`` other than the catalog client."""
    return mod.split(".")[0] == "ckptd_client" and not (mod in CATALOG or mod.startswith("ckptd_client.catalog."))


def _service_beyond_the_catalog(rows: dict[str, list[tuple[Path, int, str]]]) -> list[str]:
    return [f"{p.relative_to(REPO)}:{line} imports {mod}" for me, found in rows.items()
            if me.split(".")[0] == "ckptd" for p, line, mod in found if _beyond_the_catalog(mod)]


def _format_reaching_up(rows: dict[str, list[tuple[Path, int, str]]]) -> list[str]:
    return [f"{p.relative_to(REPO)}:{line} imports {mod}" for me, found in rows.items()
            if me == "ckptd_schemas.format" or me.startswith("ckptd_schemas.format.") for p, line, mod in found
            if mod.split(".")[0] in ("ckptd", "ckptd_client")]


def test_the_service_uses_only_the_catalog_client():
    """The service judges stored bytes with ``ckptd_schemas.format``, never with trainer code: of
    ``ckptd_client`` it uses only ``CatalogClient`` (the ``--server`` commands' HTTP client)."""
    bad = _service_beyond_the_catalog(_all_imports())
    assert not bad, "ckptd imports ckptd_client beyond CatalogClient:\n" + "\n".join(bad)


def test_the_byte_format_imports_neither_client_nor_service():
    rows = _all_imports()
    assert {"ckptd_schemas.format.encoding", "ckptd_schemas.format.frames", "ckptd_schemas.format.assemble",
            "ckptd_schemas.format.objects"} <= set(rows)
    bad = _format_reaching_up(rows)
    assert not bad, "ckptd_schemas.format imports a package above it:\n" + "\n".join(bad)


def test_dependencies_point_one_way():
    forbidden = {"ckptd_schemas": {"ckptd", "ckptd_client"}, "ckptd_client": {"ckptd"}}
    bad = [f"{p.relative_to(REPO)}:{line} imports {mod}" for me, rows in _all_imports().items()
           for p, line, mod in rows if mod.split(".")[0] in forbidden.get(me.split(".")[0], ())]
    assert not bad, "\n".join(bad)


def test_nothing_below_the_cli_imports_it():
    bad = [f"{p.relative_to(REPO)}:{line} imports {mod}" for me, rows in _all_imports().items()
           if me.startswith("ckptd.") and not me.startswith("ckptd.cli") for p, line, mod in rows
           if mod == "ckptd.cli" or mod.startswith("ckptd.cli.")]
    assert not bad, "\n".join(bad)


def _cycles(rows: dict[str, list[tuple[Path, int, str]]]) -> list[str]:
    """Every import cycle among the modules of ``rows``, as ``a -> b -> a``."""
    mods = set(rows)
    graph = {m: {mod for _, _, mod in rows[m] if mod in mods and mod != m} for m in mods}
    state: dict[str, int] = {}
    found: list[str] = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                found.append(" -> ".join(path[path.index(n):] + [n]))
            elif n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(mods):
        if m not in state:
            visit(m, [m])
    return found


def test_no_module_takes_part_in_an_import_cycle():
    cycles = _cycles(_all_imports())
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


#: The layers of ``ckptd``, bottom up: a module imports only its own layer or those below.
LAYERS = {"storage": 0, "store": 1, "reshard": 2, "interop": 2, "service": 3, "cli": 4}


def _layer(mod: str) -> tuple[int, str] | None:
    parts = mod.split(".")
    if parts[0] != "ckptd" or len(parts) < 2 or parts[1] not in LAYERS:
        return None
    return LAYERS[parts[1]], parts[1]


def _against_the_layers(rows: dict[str, list[tuple[Path, int, str]]]) -> list[str]:
    bad = []
    for me, found in rows.items():
        mine = _layer(me)
        for p, line, mod in found:
            theirs = _layer(mod)
            if mine is not None and theirs is not None and (theirs[0] > mine[0] or
                                                            (theirs[0] == mine[0] and theirs[1] != mine[1])):
                bad.append(f"{p.relative_to(REPO)}:{line} imports {mod}")
    return bad


def test_each_layer_imports_only_itself_and_those_below():
    bad = _against_the_layers(_all_imports())
    assert not bad, "imports against the layers (storage < store < reshard, interop < service < cli):\n" + \
        "\n".join(bad)


def _checkpoint_paths_in(path: Path) -> list[int]:
    """Lines of ``path`` whose string literals spell a checkpoint's place: ``runs/...`` or ``COMMITTED``."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                node.value.startswith("runs/") or "/COMMITTED" in node.value or node.value == "COMMITTED"):
            lines.append(node.lineno)
    return sorted(set(lines))


def test_the_storage_backends_know_keys_not_checkpoints():
    """Where a checkpoint's marker and files lie is the store's (``store/paths.py``); a backend that
    spelled it would decide visibility on its own."""
    bad = [f"{p.relative_to(REPO)}:{line}" for p in sorted((REPO / "ckptd" / "storage").rglob("*.py"))
           for line in _checkpoint_paths_in(p)]
    assert not bad, "storage modules spelling checkpoint paths:\n" + "\n".join(bad)


def _store_subclasses(path: Path) -> list[tuple[int, str]]:
    """(line, class name) of each class in ``path`` that subclasses ``SessionStore``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.ClassDef) and any(
                (b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else "")
                == "SessionStore" for b in node.bases):
            out.append((node.lineno, node.name))
    return out


def test_the_service_observes_the_store_through_its_events():
    bad = [f"{p.relative_to(REPO)}:{line} class {name}(SessionStore)" for p in sorted((REPO / "ckptd").rglob("*.py"))
           if "store" not in p.relative_to(REPO / "ckptd").parts for line, name in _store_subclasses(p)]
    assert not bad, "subclasses of SessionStore outside the store (use store.events.SessionEvents):\n" + "\n".join(bad)


def _self_kills(path: Path) -> list[int]:
    """Lines of ``path`` that kill their own process (``os.kill(os.getpid(), ...)``, ``signal.raise_signal``,
    ``os.abort``) or read the fault setting ``CKPTD_FAULTS``: fault injection, which the tests wrap around
    the service (tests/fault_server.py) and the product never carries."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Constant) and node.value == "CKPTD_FAULTS":
            lines.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name, args = node.func.attr, node.args
            owner = node.func.value.id if isinstance(node.func.value, ast.Name) else ""
            if (owner, name) in (("signal", "raise_signal"), ("os", "abort")) or name == "kill" and args \
                    and isinstance(args[0], ast.Call) and getattr(args[0].func, "attr", "") == "getpid":
                lines.append(node.lineno)
    return sorted(set(lines))


def test_the_product_carries_no_fault_injection():
    bad = [f"{p.relative_to(REPO)}:{line}" for root in PACKAGES.values() for p in sorted(root.rglob("*.py"))
           for line in _self_kills(p)]
    assert not bad, "fault injection in the product (wrap it around the service in the tests):\n" + "\n".join(bad)


def test_the_structural_rules_flag_what_broke_them_once(tmp_path):
    """The cycle, layer, storage and subclass rules, run over imports and code the tree once had (the
    verification record read by the visibility rule it imported, the reshard CLI and its remote half
    importing each other, the store lowering a worker's priority through the reshard package, a
    storage backend that built marker keys, a metrics subclass of the session store, the fault injection
    the store once carried), flag each."""
    verification, visibility = REPO / "ckptd" / "store" / "verification.py", REPO / "ckptd" / "store" / "visibility.py"
    reshard, remote = REPO / "ckptd" / "cli" / "reshard.py", REPO / "ckptd" / "cli" / "reshard_remote.py"
    old = {
        "ckptd.store.verification": [(verification, 44, "ckptd.store.visibility"),
                                     (verification, 197, "ckptd.reshard.priority")],
        "ckptd.store.visibility": [(visibility, 400, "ckptd.store.verification")],
        "ckptd.cli.reshard": [(reshard, 53, "ckptd.cli.reshard_remote")],
        "ckptd.cli.reshard_remote": [(remote, 38, "ckptd.cli.reshard")],
        "ckptd.reshard.priority": [],
    }
    assert _cycles(old) == ["ckptd.cli.reshard -> ckptd.cli.reshard_remote -> ckptd.cli.reshard",
                            "ckptd.store.verification -> ckptd.store.visibility -> ckptd.store.verification"]
    assert _against_the_layers(old) == ["ckptd/store/verification.py:197 imports ckptd.reshard.priority"]
    tiered = tmp_path / "tiered.py"
    tiered.write_text('def behind(fast, parts):\n    return fast.exists(f"runs/{parts[1]}/{parts[2]}/COMMITTED")\n'
                      'ADOPTED = "runs/.adopted"\nOK = "a key"\n')
    assert _checkpoint_paths_in(tiered) == [2, 3]
    metered = tmp_path / "metrics.py"
    metered.write_text("from ..store import SessionStore\n\n\nclass MeteredSessionStore(SessionStore):\n    pass\n\n\n"
                       "class Metrics:\n    pass\n")
    assert _store_subclasses(metered) == [(4, "MeteredSessionStore")]
    faults = tmp_path / "faults.py"
    faults.write_text('import os, signal\n\n\ndef configure(environ=os.environ):\n    return environ.get("CKPTD_FAULTS")\n\n\n'
                      'def _kill(point):\n    os.kill(os.getpid(), signal.SIGKILL)\n\n\ndef stop(pid, writer):\n    os.kill(pid, 9)\n'
                      '    writer.abort()\n    signal.raise_signal(9)\n')
    assert _self_kills(faults) == [5, 9, 15]


def test_the_checks_see_what_they_look_for():
    """The scanner resolves relative imports and function-level ones (a check that finds nothing
    because it parses nothing would pass forever)."""
    rows = _all_imports()
    assert ("ckptd_client.transport" in {mod for _, _, mod in rows["ckptd_client.catalog"]})
    assert any(mod == "ckptd_schemas.format.encoding.source_bytes" for _, _, mod in rows["ckptd_schemas.format.engines"])
    assert any(mod == "ckptd_schemas.format.assemble.copy_into"  # imported in a method
               for _, _, mod in rows["ckptd_schemas.format.engines"])
    assert "ckptd_schemas.format.frames" in {mod for _, _, mod in rows["ckptd_schemas.format.encoding"]}  # relative
    assert any(mod.startswith("ckptd.store") for _, _, mod in rows["ckptd.cli.root_backend"])  # imported in a method
    assert any(mod == "ckptd_client.CatalogClient" for _, _, mod in rows["ckptd.cli.http_backend"])
    assert _private("ckptd_client._load") and not _private("ckptd_client.codec")


def test_the_layer_rules_flag_what_they_forbid():
    """The catalog-only and format rules, run over the imports the service and the frame check once had
    (the service decoding with the trainer's codec and copy kernel), flag each of them and nothing else."""
    store, frames = REPO / "ckptd" / "store" / "engines.py", REPO / "schemas" / "format" / "frames.py"
    backends, dcp = REPO / "ckptd" / "cli" / "backends.py", REPO / "ckptd" / "interop" / "dcp_import.py"
    old = {
        "ckptd.store.engines": [(store, 33, "ckptd_client.codec"), (store, 33, "ckptd_client.codec.source_bytes"),
                                (store, 145, "ckptd_client.assemble.Destination")],
        "ckptd.interop.dcp_import": [(dcp, 266, "ckptd_client.transport"), (dcp, 99, "ckptd_client.objects"),
                                     (dcp, 20, "ckptd_client.catalog.Upload")],
        "ckptd.cli.backends": [(backends, 70, "ckptd_client"), (backends, 70, "ckptd_client.CatalogClient"),
                               (backends, 71, "ckptd_client.CheckpointClient")],
        "ckptd_schemas.format.frames": [(frames, 182, "ckptd_client.codec"), (frames, 25, "ckptd_schemas.format.encoding"),
                                        (frames, 26, "ckptd.store.verify")],
    }
    assert _service_beyond_the_catalog(old) == [
        "ckptd/store/engines.py:33 imports ckptd_client.codec",
        "ckptd/store/engines.py:33 imports ckptd_client.codec.source_bytes",
        "ckptd/store/engines.py:145 imports ckptd_client.assemble.Destination",
        "ckptd/interop/dcp_import.py:266 imports ckptd_client.transport",
        "ckptd/interop/dcp_import.py:99 imports ckptd_client.objects",
        "ckptd/cli/backends.py:71 imports ckptd_client.CheckpointClient",
    ]
    assert _format_reaching_up(old) == ["schemas/format/frames.py:182 imports ckptd_client.codec",
                                        "schemas/format/frames.py:26 imports ckptd.store.verify"]
