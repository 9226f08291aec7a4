"""No import cycles between tinyloop's modules, imports inside functions and under TYPE_CHECKING included.

pyproject's import-linter contracts (`lint-imports`) check the layering between packages; this checks files.
"""

from __future__ import annotations

import grimp

# Cycles the engine redesign removes (issue 29 leaves them to it); delete an entry when its cycle goes.
KNOWN_CYCLES: set[frozenset[str]] = set()


def import_cycles(package: str) -> set[frozenset[str]]:
    """The strongly connected groups of modules (each imports itself back through the others)."""
    graph = grimp.build_graph(package, cache_dir=None)
    group = {m: {m} for m in graph.modules}
    for importer in graph.modules:
        for imported in graph.find_modules_directly_imported_by(importer):
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back is None:
                continue
            merged = set().union(*(group[m] for m in (importer, *back)))
            for m in merged:
                group[m] = merged
    return {frozenset(g) for g in group.values() if len(g) > 1}


def test_no_import_cycles_between_modules() -> None:
    cycles = import_cycles("tinyloop")
    new = sorted(sorted(c) for c in cycles - KNOWN_CYCLES)
    assert not new, f"import cycles: {new}; move what both sides need into a lower module"
    gone = sorted(sorted(c) for c in KNOWN_CYCLES - cycles)
    assert not gone, f"these cycles are gone: remove them from KNOWN_CYCLES in {__file__}: {gone}"


def test_a_cycle_through_a_function_level_import_is_found(tmp_path, monkeypatch) -> None:
    package = tmp_path / "cyclepkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from cyclepkg import b\n")
    (package / "b.py").write_text("def f():\n    from cyclepkg import c\n")
    (package / "c.py").write_text("from cyclepkg.a import b\n")
    (package / "d.py").write_text("from cyclepkg import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_cycles("cyclepkg") == {frozenset({"cyclepkg.a", "cyclepkg.b", "cyclepkg.c"})}
