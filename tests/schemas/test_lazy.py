"""``ckptd_schemas.lazy``: a package's lazy names import their module on first use, once, and only then.

A throwaway package under ``tmp_path`` shows the mechanism (which module is imported when, what the
package holds afterwards, what an unknown name raises); a fresh interpreter shows the project's own
packages keep the promise their docstrings make (``import ckptd_schemas`` builds no HTTP body models
until one is named) and that every lazily exported name resolves.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from ckptd_schemas.lazy import lazy_exports

PKG_INIT = '''
from ckptd_schemas.lazy import lazy_exports
EAGER = "here from the start"
__getattr__ = lazy_exports(__name__, {"Heavy": ".heavy", "helper": ".heavy", "Other": ".other",
                                         "Ghost": ".other"}, globals())
'''


@pytest.fixture
def pkg(tmp_path, monkeypatch):
    """A package ``lazypkg_<n>`` whose ``Heavy``/``helper`` live in ``.heavy`` and ``Other`` in ``.other``;
    each module counts its imports in ``sys.lazy_imports``."""
    name = f"lazypkg_{tmp_path.name.replace('-', '_')}"
    d = tmp_path / name
    d.mkdir()
    (d / "__init__.py").write_text(PKG_INIT)
    for mod, body in {"heavy": "class Heavy: pass\ndef helper(): return 42\n", "other": "Other = object()\n"}.items():
        (d / f"{mod}.py").write_text(f"import sys\nsys.lazy_imports.append(__name__)\n{body}")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "lazy_imports", [], raising=False)
    yield name
    for m in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[m]


def test_nothing_is_imported_until_a_name_is_used(pkg):
    mod = __import__(pkg)
    assert mod.EAGER == "here from the start"
    assert sys.lazy_imports == [] and f"{pkg}.heavy" not in sys.modules
    heavy_cls = mod.Heavy
    assert sys.lazy_imports == [f"{pkg}.heavy"]
    assert heavy_cls is sys.modules[f"{pkg}.heavy"].Heavy
    assert f"{pkg}.other" not in sys.modules  # only the module of the name used


def test_the_first_use_stores_the_value_in_the_package(pkg):
    mod = __import__(pkg)
    assert "helper" not in vars(mod)
    first = mod.helper
    assert vars(mod)["helper"] is first  # later uses are plain attribute reads, not the hook again
    assert mod.helper() == 42 and mod.Heavy is sys.modules[f"{pkg}.heavy"].Heavy
    assert sys.lazy_imports == [f"{pkg}.heavy"]  # two names of one module: imported once


def test_from_import_of_a_lazy_name(pkg):
    ns: dict = {}
    exec(f"from {pkg} import Other", ns)
    assert ns["Other"] is sys.modules[f"{pkg}.other"].Other


def test_an_unknown_name_raises_attribute_error_naming_the_package_and_the_name(pkg):
    mod = __import__(pkg)
    with pytest.raises(AttributeError) as info:
        mod.Missing  # noqa: B018
    assert repr(pkg) in str(info.value) and "'Missing'" in str(info.value)
    assert not hasattr(mod, "heavy_thing")
    with pytest.raises(ImportError):
        exec(f"from {pkg} import Missing", {})
    assert sys.lazy_imports == []  # an unknown name imports nothing


def test_a_name_its_module_does_not_define_is_an_error_not_none(pkg):
    mod = __import__(pkg)
    with pytest.raises(AttributeError, match="Ghost"):
        mod.Ghost  # noqa: B018
    assert "Ghost" not in vars(mod)


def test_the_hook_alone():
    ns: dict = {}
    hook = lazy_exports("ckptd_schemas", {"RankIndex": ".api"}, ns)
    from ckptd_schemas.api import RankIndex

    assert hook("RankIndex") is RankIndex and ns == {"RankIndex": RankIndex}
    with pytest.raises(AttributeError, match="'ckptd_schemas' has no attribute 'Nope'"):
        hook("Nope")


def test_the_projects_packages_defer_their_modules_and_resolve_every_name():
    script = textwrap.dedent("""
        import sys
        import ckptd_schemas
        assert "ckptd_schemas.api" not in sys.modules and "ckptd_schemas.readplan" not in sys.modules, sorted(
            m for m in sys.modules if m.startswith("ckptd_schemas"))
        ckptd_schemas.RankIndex
        assert "ckptd_schemas.api" in sys.modules and "ckptd_schemas.readplan" not in sys.modules
        import ckptd_client, ckptd.store
        for pkg in (ckptd_schemas, ckptd_client, ckptd.store):
            missing = [n for n in pkg.__all__ if not hasattr(pkg, n)]
            assert not missing, (pkg.__name__, missing)
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout + out.stderr
