"""The package's shape, read from its source (docs/architecture.md): imports flow one way, from the commands down
to the records, with no circles; every package says what it owns and may import, and keeps to it; no module imports
its own package or a path that does not exist; no command module imports another; the trainer's hook table in
docs/architecture.md is true; tool results are found through the sampler's records, never by a regex over
`<result>`; no block of code is copied inside the package."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "arpo_trl"
MIN_COPIED_LINES = 6

# Layers, lowest first: a module may import its own layer or lower ones. `arpo_trl` itself (the public API) and
# `arpo_trl.cli` (the dispatcher, above every command) sit on top. A package sits in one layer, but for the vertical
# slices of a vLLM mode (`server/`, `colocate/`) and `data/`, whose offline assets the tools read (their `__init__`
# docstrings say so).
LAYERS: dict[str, list[str]] = {
    "records": ["preflight", "markdown", "data.assets", "data.corpora", "data.models", "data.arithmetic",
                "data.arithmetic_chains"],
    "engines/tools": ["entropy", "entropy.*", "generation", "generation.*", "tools", "tools.*",
                      "server", "server.client", "server.responses", "server.segments", "server.engine",
                      "server.server_check", "colocate", "colocate.outputs", "colocate.engine", "colocate.engine_args",
                      "colocate.memory_plan"],
    "rollout": ["rollout", "rollout.*", "rewards", "rewards.*", "trees", "trees.*",
                "data", "data.prompts", "data.offline_sets", "data.hub_sets", "data.named"],
    "runtime": ["runtime", "runtime.*"],
    "trainer": ["config", "config_checks", "trainer", "trl_state", "training", "training.*", "dropin", "dropin.*",
                "server.trainer_mode", "server.weight_sync", "server.launcher",
                "colocate.trainer_mode", "colocate.weight_sync"],
    "commands": ["commands", "commands.*", "server.serve_config", "server.serve_command"],
    "top": ["__init__", "cli", "server.__main__"],
}
# Where a regex or a search for the tag format's result text may stand: the tag format itself.
TAG_FORMAT_MODULES = {"tools.tags", "tools.base"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _layer(module: str) -> int:
    for rank, names in enumerate(LAYERS.values()):
        for name in names:
            if module == name or (name.endswith(".*") and module.startswith(name[:-1])):
                return rank
    raise AssertionError(f"arpo_trl.{module} is in no layer of tests/test_architecture.py; add it to LAYERS")


def _resolve(name: str) -> str | None:
    """The arpo_trl module an imported name refers to (a module, or a package's attribute), or None."""
    if name != "arpo_trl" and not name.startswith("arpo_trl."):
        return None
    name = name[len("arpo_trl."):] if name != "arpo_trl" else "__init__"
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> set[str]:
    """Every arpo_trl module `module` imports, at module level, inside functions or under TYPE_CHECKING alike."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {target for target in map(_resolve, names) if target and target != module}
    return found


GRAPH = {module: _imports(module) for module in MODULES}


def _is_within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_every_module_has_a_layer_and_imports_only_its_layer_or_lower():
    upward = [f"arpo_trl.{a} ({list(LAYERS)[_layer(a)]}) imports arpo_trl.{b} ({list(LAYERS)[_layer(b)]})"
              for a, targets in GRAPH.items() for b in sorted(targets)
              if _layer(b) > _layer(a) and not _is_within(a, b)]  # a package's __init__ re-exports its modules
    assert not upward, "imports that go up a layer:\n" + "\n".join(upward)


def test_no_import_circles():
    """Strongly connected components of the import graph (Tarjan), a package's own __init__ edges excepted."""
    graph = {a: {b for b in targets if not _is_within(a, b) and not _is_within(b, a)} for a, targets in GRAPH.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    assert not circles, f"import circles: {circles}"


def test_the_rule_knows_nothing_of_its_runtime():
    """`rollout/` is ARPO's rule: of `generation/` it imports the engine contract only, nothing of the runtime that
    runs it (`runtime/`), and `rollout/arpo.py` never names speculation, prefetching or scheduling."""
    rule = [m for m in MODULES if _is_within(m, "rollout")]
    reach = [f"arpo_trl.{a} imports arpo_trl.{b}" for a in rule for b in sorted(GRAPH[a])
             if (_is_within(b, "generation") and b != "generation.engine") or _is_within(b, "runtime")]
    assert not reach, reach
    words = re.findall(r"speculat\w*|prefetch\w*|schedul\w*|shadow\w*", MODULES["rollout.arpo"].read_text().lower())
    assert not words, f"rollout/arpo.py names its runtime: {sorted(set(words))}"


def test_no_engine_is_probed():
    """What an engine can do is declared (`EngineTraits`, `GenerationEngine`'s attributes), never probed: no
    `getattr`/`hasattr` on an engine anywhere in the package."""
    probes = [f"arpo_trl.{m}:{node.lineno}" for m, p in MODULES.items()
              for node in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
              if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr")
              and node.args and "engine" in ast.unparse(node.args[0]).lower()]
    assert not probes, f"engines probed with getattr/hasattr: {probes}"


def test_backends_see_the_trainer_through_their_view():
    """A generation backend gets `TrainerView` (`generation/backend.py`), built by the trainer: no module of the
    engines' layer reaches into the trainer's private state (`_trl`, `_sampling`) or its sampler, and no module
    imports another package's private name."""
    layer = [m for m in MODULES if _layer(m) == list(LAYERS).index("engines/tools") or m.endswith("trainer_mode")]
    reach = [f"arpo_trl.{m}:{node.lineno} .{node.attr}" for m in layer
             for node in ast.walk(ast.parse(MODULES[m].read_text(encoding="utf-8")))
             if isinstance(node, ast.Attribute) and node.attr in ("_trl", "_sampling", "sampler")]
    assert not reach, reach
    private = [f"arpo_trl.{m} imports {node.module}.{alias.name}" for m, p in MODULES.items()
               for node in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
               if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("arpo_trl.")
               and node.module.rpartition(".")[0] != f"arpo_trl.{m}".rpartition(".")[0]
               for alias in node.names if alias.name.startswith("_") and not alias.name.startswith("__")]
    assert not private, private


# The subcommands `arpo_trl.cli` dispatches to; any other `commands.*` module is what they share.
COMMANDS = {"commands.train", "commands.sft", "commands.evaluate", "commands.trees"}


def test_no_command_imports_another():
    assert COMMANDS <= GRAPH["cli"], f"arpo_trl.cli no longer dispatches to {sorted(COMMANDS - GRAPH['cli'])}"
    crossing = [f"arpo_trl.{a} imports arpo_trl.{b}" for a in COMMANDS for b in GRAPH[a] if b in COMMANDS]
    assert not crossing, crossing


def _top_level_names(tree: ast.Module) -> set[str]:
    """Names a module binds at top level (also under `if` / `try`): what `from arpo_trl.X import name` may take."""
    names: set[str] = set()
    statements = list(tree.body)
    while statements:
        node = statements.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).partition(".")[0] for alias in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.If, ast.Try)):
            statements += [*node.body, *node.orelse, *getattr(node, "finalbody", []),
                           *(s for handler in getattr(node, "handlers", []) for s in handler.body)]
    return names


def test_every_arpo_trl_import_resolves():
    """Inside the package, every `arpo_trl.…` import names a module, or a name its module binds at top level (a
    module with a lazy `__getattr__` binds any). `_resolve` above walks up to the nearest module, so without this a
    stale path (or an old path that `arpo_trl/__init__.py` keeps only for users) would go unnoticed."""
    bound = {m: _top_level_names(ast.parse(p.read_text(encoding="utf-8"))) for m, p in MODULES.items()}
    stale = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                stale += [f"arpo_trl.{module}:{node.lineno} imports {a.name}" for a in node.names
                          if a.name.startswith("arpo_trl.") and a.name[len("arpo_trl."):] not in MODULES]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and (
                    node.module == "arpo_trl" or node.module.startswith("arpo_trl.")):
                source = node.module[len("arpo_trl."):] if node.module != "arpo_trl" else "__init__"
                if source not in MODULES:
                    stale.append(f"arpo_trl.{module}:{node.lineno} imports from {node.module}")
                    continue
                prefix = "" if source == "__init__" else source + "."
                stale += [f"arpo_trl.{module}:{node.lineno} imports {a.name} from {node.module}" for a in node.names
                          if prefix + a.name not in MODULES and a.name not in bound[source]
                          and "__getattr__" not in bound[source]]
    assert not stale, "imports of paths that do not exist in the package:\n" + "\n".join(stale)


def test_no_module_imports_its_own_package():
    """A module of package P imports P's other modules by their own paths, never `arpo_trl.P` itself: P's
    `__init__` may re-export that module, and would then import a half-initialised package."""
    own = [f"arpo_trl.{a} imports arpo_trl.{b}" for a, targets in GRAPH.items() for b in targets
           if MODULES[b].name == "__init__.py" and a.startswith(b + ".")]
    assert not own, own


DATASET_BUILDERS = {"data", "data.prompts", "data.offline_sets", "data.hub_sets", "data.named"}


def test_tools_do_not_import_the_dataset_layer():
    """The tools read the offline assets of `data/` (a corpus for search and browse), never its dataset builders."""
    assert DATASET_BUILDERS <= set(MODULES), sorted(DATASET_BUILDERS - set(MODULES))
    tools = [m for m in MODULES if _is_within(m, "tools")]
    assert not [(a, b) for a in tools for b in GRAPH[a] if b in DATASET_BUILDERS or _is_within(b, "commands")]


_MAY_IMPORT = re.compile(r"^May import: (.+?)(?:\n\n|\Z)", re.M | re.S)


def _may_import(package: str) -> set[str] | None:
    """What a package's `__init__` docstring says it may import ("May import: a, b (detail), c" or "nothing
    outside <package>"), or None without such a line."""
    doc = ast.get_docstring(ast.parse(MODULES[package].read_text(encoding="utf-8"))) or ""
    found = _MAY_IMPORT.search(doc)
    if found is None:
        return None
    text = re.sub(r"\([^)]*\)", "", " ".join(found.group(1).split())).rstrip(".")
    return set() if text.startswith("nothing") else {name.strip() for name in text.split(",")}


def test_every_package_says_what_it_owns_and_may_import():
    """Each package's `__init__.py` opens with a docstring ending in a "May import:" line, and the package imports
    nothing outside itself that the line leaves out (the line is kept true here)."""
    packages = [m for m, p in MODULES.items() if p.name == "__init__.py" and m != "__init__"]
    silent = [f"arpo_trl.{m}" for m in packages if _may_import(m) is None]
    assert not silent, f"packages whose __init__ docstring has no 'May import:' line: {silent}"
    names = {m.partition(".")[0] for m in MODULES}
    unknown = {f"arpo_trl.{m}": sorted(_may_import(m) - names) for m in packages if _may_import(m) - names}
    assert not unknown, f"'May import:' names that are not arpo_trl modules or packages: {unknown}"
    undeclared = [f"arpo_trl.{a} imports arpo_trl.{b}" for package in packages for a in MODULES
                  if _is_within(a, package) for b in sorted(GRAPH[a])
                  if not _is_within(b, package) and b.partition(".")[0] not in _may_import(package)]
    assert not undeclared, "imports a package's 'May import:' line leaves out:\n" + "\n".join(undeclared)


def test_tool_results_are_never_found_in_the_text():
    """Outside the tag format, no module searches text for `<result>` (`in`, `find`, `count`, a regex, …): the
    sampler's `ToolCallRecord`s say where every call and result is, in any call format. Prompts and help texts that
    show the format are not searches."""
    offenders = [f"arpo_trl.{m}:{line}" for m, p in MODULES.items() if m not in TAG_FORMAT_MODULES
                 for line in _result_searches(p)]
    assert not offenders, f"`<result>` searched outside the tag format: {offenders}"


_SEARCHES = {"find", "rfind", "index", "rindex", "count", "split", "partition", "startswith", "endswith", "search",
             "match", "fullmatch", "findall", "finditer", "compile", "sub", "replace"}


def _result_searches(path: Path) -> list[int]:
    """Lines where a string holding `<result>` is compared (`in`, `==`) or passed to a search method or regex."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _SEARCHES:
            operands = [*node.args, node.func.value]
        else:
            continue
        if any("<result>" in _text(operand) for operand in operands):
            lines.append(node.lineno)
    return lines


def _text(node: ast.AST) -> str:
    """The literal text of a string constant or f-string (empty for anything else)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(_text(value) for value in node.values)
    return ""


_SKIP = re.compile(r"^(#|from |import |@|\)|\]|\}|else:|try:|finally:|return$|pass$|\"\"\"|'''|$)")


def _code_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text with white space folded) of the lines that carry code."""
    lines = []
    for n, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        text = " ".join(raw.split())
        if not _SKIP.match(text):
            lines.append((n, text))
    return lines


def test_no_copied_blocks():
    """No run of MIN_COPIED_LINES code lines appears twice in the package (lines compared with white space
    folded; blank lines, comments, imports and lone brackets skipped)."""
    seen: dict[tuple[str, ...], tuple[str, int, int]] = {}  # window -> (module, its index, its line)
    copies = defaultdict(set)
    for module, path in MODULES.items():
        lines = _code_lines(path)
        for i in range(len(lines) - MIN_COPIED_LINES + 1):
            window = tuple(text for _, text in lines[i : i + MIN_COPIED_LINES])
            first = seen.setdefault(window, (module, i, lines[i][0]))
            if first[0] != module or i - first[1] >= MIN_COPIED_LINES:  # elsewhere, or not overlapping itself
                copies[f"arpo_trl.{first[0]}:{first[2]}"].add(f"arpo_trl.{module}:{lines[i][0]}")
    assert not copies, f"blocks of {MIN_COPIED_LINES}+ lines copied: {dict(copies)}"


# ---- the trainer's hooks (docs/architecture.md#the-trainers-hooks) -------------------------------------------------
HOOK_TABLE = PACKAGE.parent / "docs" / "architecture.md"
TABLE_START, TABLE_END = "<!-- hook table: tests/test_architecture.py -->", "<!-- end hook table -->"


def _class(path: Path, name: str) -> ast.ClassDef:
    found = [n for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))) if isinstance(n, ast.ClassDef)
             and n.name == name]
    assert found, f"class {name} not found in {path}"
    return found[0]


def _methods(cls: ast.ClassDef) -> dict[str, bool]:
    """The methods a class defines, each with whether its body calls `super().<its own name>(...)`."""
    def calls_super(method: ast.FunctionDef) -> bool:
        return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == method.name
                   and isinstance(n.func.value, ast.Call) and getattr(n.func.value.func, "id", None) == "super"
                   for n in ast.walk(method))
    return {n.name: calls_super(n) for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _library_source(module: str) -> Path:
    """A library module's file, found without importing the library (`find_spec` of a top-level name)."""
    import importlib.util

    top, _, rest = module.partition(".")
    return Path(importlib.util.find_spec(top).origin).parent.joinpath(*rest.split(".")).with_suffix(".py")


def _trainer_mro() -> list[tuple[str, ast.ClassDef]]:
    """ARPOTrainer's MRO as (name, class) from the sources: its bases, each a mixin without bases of its own, then
    GRPOTrainer's chain through TRL and transformers."""
    trainer = _class(MODULES["trainer"], "ARPOTrainer")
    imported = {alias.asname or alias.name: node.module for node in ast.parse(MODULES["trainer"].read_text()).body
                if isinstance(node, ast.ImportFrom) for alias in node.names}
    mro = [("ARPOTrainer", trainer)]
    for base in (b.id for b in trainer.bases):
        if base == "GRPOTrainer":
            break
        mixin = _class(MODULES[_resolve(f"{imported[base]}.{base}")], base)
        assert not mixin.bases, f"{base} has bases of its own; the hook table assumes ARPOTrainer's MRO is its bases"
        mro.append((base, mixin))
    assert trainer.bases[-1].id == "GRPOTrainer", "GRPOTrainer is no longer ARPOTrainer's last base"
    chain = {"GRPOTrainer": "trl.trainer.grpo_trainer", "_BaseTrainer": "trl.trainer.base_trainer",
             "Trainer": "transformers.trainer"}
    name = "GRPOTrainer"
    while name in chain:
        cls = _class(_library_source(chain[name]), name)
        mro.append((name, cls))
        name = next((b.id for b in cls.bases if isinstance(b, ast.Name)), "")
    return mro


def _hook_table() -> tuple[list[str], dict[str, list[str]]]:
    """The table in docs/architecture.md: its hook columns, and per class (first cell) its cells."""
    text = HOOK_TABLE.read_text(encoding="utf-8")
    lines = text[text.index(TABLE_START) + len(TABLE_START):text.index(TABLE_END)].strip().splitlines()
    cells = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines]
    hooks = [re.sub(r"`", "", cell) for cell in cells[0][1:]]
    return hooks, {re.match(r"`(\w+)`", row[0]).group(1): row[1:] for row in cells[2:]}


def test_trainer_hooks_table_is_true():
    """docs/architecture.md's table of which class overrides which TRL hook: its rows are ARPOTrainer's MRO in order,
    its columns every TRL or transformers method an ARPO class overrides, and a cell is filled exactly where the
    class defines the hook ("super…" where the override calls `super()`, "replaces" where it does not; TRL's own
    rows: "defines")."""
    mro = _trainer_mro()
    library = {name for name, cls in mro if name in ("GRPOTrainer", "_BaseTrainer", "Trainer")}
    trl_methods = set().union(*(_methods(cls) for name, cls in mro if name in library))
    overrides = {name: {m: s for m, s in _methods(cls).items() if m in trl_methods} for name, cls in mro
                 if name not in library}
    hooks, rows = _hook_table()
    assert list(rows) == [name for name, _ in mro], f"the table's rows are not ARPOTrainer's MRO {[n for n, _ in mro]}"
    assert set(hooks) == set().union(*overrides.values()), (
        f"the table's hook columns {hooks} are not the hooks ARPO's classes override "
        f"{sorted(set().union(*overrides.values()))}")
    wrong = []
    for name, cls in mro:
        defined = set(_methods(cls)) if name in library else set(overrides[name])
        for hook, cell in zip(hooks, rows[name]):
            if bool(cell) != (hook in defined):
                wrong.append(f"{name}.{hook}: {'defined' if hook in defined else 'not defined'}, cell {cell!r}")
            elif cell and name not in library and ("super" in cell) != overrides[name][hook]:
                wrong.append(f"{name}.{hook}: calls super() {overrides[name][hook]}, cell {cell!r}")
            elif cell and name not in library and not overrides[name][hook] and "replaces" not in cell:
                wrong.append(f"{name}.{hook}: replaces TRL's, cell {cell!r}")
    assert not wrong, "docs/architecture.md's hook table is wrong:\n" + "\n".join(wrong)


def test_the_update_hooks_keep_their_order():
    """EntropyBalancedUpdate before TreePackedTraining, which comes right before GRPOTrainer: AEPO's update post-
    processes the whole (B, T) result of the loss's forward, which the packed forward computes without `super()`
    (reversed, packing would skip the update); and the packed forward's per-chunk `super()` calls must reach TRL's
    unpacked forward (docs/architecture.md#the-trainers-hooks)."""
    bases = [b.id for b in _class(MODULES["trainer"], "ARPOTrainer").bases]
    assert bases.index("EntropyBalancedUpdate") < bases.index("TreePackedTraining") == len(bases) - 2, bases


def test_the_cached_engine_hands_its_running_batch_to_parts_it_holds():
    """Composition, not mixins sharing private state: the cached engine's only base is the waves engine; its admission
    and KV accounting are objects it holds, each touching only its own private attributes (the running batch is
    handed to them, `generation/running_batch.py`)."""
    engine = _class(MODULES["generation.cached_engine"], "CachedTransformersEngine")
    assert [getattr(base, "id", None) for base in engine.bases] == ["TransformersEngine"]
    for module, name in (("generation.admission", "Admission"), ("generation.kv_budget", "KVAccounting")):
        cls = _class(MODULES[module], name)
        assert not cls.bases, f"{name} is a part the engine holds, not a base"
        assigned = {target.attr for node in ast.walk(cls) if isinstance(node, (ast.Assign, ast.AnnAssign))
                    for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
                    if isinstance(target, ast.Attribute)}
        own = set(_methods(cls)) | assigned
        private = {node.attr for node in ast.walk(cls) if isinstance(node, ast.Attribute)
                   and isinstance(node.value, ast.Name) and node.value.id == "self" and node.attr.startswith("_")}
        assert private <= own, f"{name} reads private state it does not own: {sorted(private - own)}"
