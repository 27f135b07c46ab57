"""The package's layout keeps its modules' privates private: no module of sequin_provider (or of the
code around it that ships or runs it: spark_apps/, devtools/, dags/) imports a ``_private`` name of
another module, neither by ``from m import _name`` nor as ``m._name``. A package's private
submodule (``sequin_provider._pgoutput_c``, the compiled hot path) may be imported by the modules
of that package. And no test module is imported by another module of tests/: what tests share lives in
``tests.support`` (fixtures in the conftest.py files). Parses the sources with ``ast``; imports nothing."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "sequin_provider"
SCANNED = ("sequin_provider", "spark_apps", "devtools", "dags")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_path(module: str) -> Path | None:
    """The folder (package) or file of a module of the package, None when it is not one."""
    base = ROOT.joinpath(*module.split("."))
    if base.is_dir():
        return base
    file = base.with_suffix(".py")
    return file if file.is_file() else None


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_private_submodule(package: str, name: str) -> bool:
    """``package.name`` is a private module of ``package`` (a source file, a folder or a built extension)."""
    folder = _module_path(package)
    return folder is not None and folder.is_dir() and (any(folder.glob(f"{name}.*")) or (folder / name).is_dir())


def _absolute(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def private_uses(source: str, importer: str, is_package: bool = False) -> list[str]:
    """Where the module ``importer`` (its ``source``) uses a private name of another module of the
    package: ``line: what``."""
    tree = ast.parse(source, importer)
    found: list[str] = []
    modules: dict[str, str] = {}  # local name -> a module of the package bound to it
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == PACKAGE:
                    if alias.asname:
                        modules[alias.asname] = alias.name
                    if any(_is_private(part) for part in alias.name.split(".")[1:]):
                        found.append(f"{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(node, importer, is_package)
            if source.split(".")[0] != PACKAGE:
                continue
            for alias in node.names:
                if _module_path(f"{source}.{alias.name}") is not None:
                    modules[alias.asname or alias.name] = f"{source}.{alias.name}"
                if not _is_private(alias.name):
                    continue
                own_private_module = _is_private_submodule(source, alias.name) and (
                    importer.rpartition(".")[0] == source or importer == source
                )
                if not own_private_module:
                    found.append(f"{node.lineno}: from {source} import {alias.name}")
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
            and _is_private(node.attr)
            and modules[node.value.id] != importer
        ):
            found.append(f"{node.lineno}: {modules[node.value.id]}.{node.attr}")
    return sorted(found, key=lambda hit: int(hit.split(":")[0]))


def test_no_module_imports_a_private_name_of_another() -> None:
    files = [p for top in SCANNED for p in sorted((ROOT / top).rglob("*.py"))]
    assert len(files) > 50
    offences = {
        str(p.relative_to(ROOT)): hits
        for p in files
        if (hits := private_uses(p.read_text(), _module_name(p), p.name == "__init__.py"))
    }
    assert offences == {}


def test_the_check_sees_each_kind_of_private_use() -> None:
    source = (
        "from sequin_provider.replication import _Hidden, Public\n"
        "from sequin_provider import store, _pgoutput_c\n"
        "from . import backoff\n"
        "import sequin_provider.pgoutput as pg\n"
        "store._secret(1)\n"
        "pg._render\n"
        "backoff.__name__\n"
    )
    # a module of the package may import the package's private extension; one of a subpackage may not
    assert private_uses(source, "sequin_provider.probe") == [
        "1: from sequin_provider.replication import _Hidden",
        "5: sequin_provider.store._secret",
        "6: sequin_provider.pgoutput._render",
    ]
    assert private_uses(source, "sequin_provider.spark.probe")[1] == "2: from sequin_provider import _pgoutput_c"
    assert private_uses("from ..store import _ident\n", "sequin_provider.spark.probe") == [
        "1: from sequin_provider.store import _ident"
    ]


def _is_test_module(module: str) -> bool:
    return module.split(".")[0] == "tests" and module.rpartition(".")[2].startswith("test_")


def imported_test_modules(source: str, importer: str, is_package: bool = False) -> list[str]:
    """Where the module ``importer`` of tests/ (its ``source``) imports a test module (``tests.….test_*``),
    as a module or a name from it: ``line: what``."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source, importer)):
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names if _is_test_module(a.name)]
        elif isinstance(node, ast.ImportFrom):
            source_module = _absolute(node, importer, is_package)
            if _is_test_module(source_module):
                found.append(f"{node.lineno}: from {source_module} import {', '.join(a.name for a in node.names)}")
            else:
                found += [
                    f"{node.lineno}: from {source_module} import {a.name}"
                    for a in node.names
                    if _is_test_module(f"{source_module}.{a.name}")
                ]
    return found


def test_no_test_module_imports_another() -> None:
    files = sorted((ROOT / "tests").rglob("*.py"))
    assert len([p for p in files if p.name.startswith("test_")]) > 50
    offences = {
        str(p.relative_to(ROOT)): hits
        for p in files
        if (hits := imported_test_modules(p.read_text(), _module_name(p), p.name == "__init__.py"))
    }
    assert offences == {}


def test_the_test_import_check_sees_each_form() -> None:
    source = (
        "import tests.integration.sinks.test_webhook\n"
        "from tests.integration.airflow.test_operators import sequin_connection\n"
        "from tests.unit import test_docs\n"
        "from .test_stream_api import ApiServer\n"
        "from tests.support.airflow import Webhook\n"
        "import tests.support.receiver\n"
    )
    assert imported_test_modules(source, "tests.integration.sinks.probe") == [
        "1: import tests.integration.sinks.test_webhook",
        "2: from tests.integration.airflow.test_operators import sequin_connection",
        "3: from tests.unit import test_docs",
        "4: from tests.integration.sinks.test_stream_api import ApiServer",
    ]
