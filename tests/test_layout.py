"""The repository's layout: the design card's six files at the top, support code in infra/ (which the concept
files may use) and harness/ (which only train.py, scripts/ and tests/ use), imports that only go down, the
three self-contained files importable alone, and documents that name only what exists."""
import ast
import importlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONCEPT = ["envs", "rollout", "rsipo", "shrinkage", "skills", "train"]
FOLDERS = ["infra", "harness"]
DOCS = ["README.md", "METHOD.md", "RESULTS.md", "results/archive.md", "recipes/README.md"]


def _project_imports(path: Path) -> set[str]:
    """The project modules a file imports, as dotted names (infra.distributed, rollout, ...)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    known = set(CONCEPT) | {f"{d}.{p.stem}" for d in FOLDERS for p in (ROOT / d).glob("*.py")}
    return {n for n in names if n in known}


def _modules() -> dict[str, Path]:
    out = {m: ROOT / f"{m}.py" for m in CONCEPT}
    out.update({f"{d}.{p.stem}": p for d in FOLDERS for p in (ROOT / d).glob("*.py") if p.stem != "__init__"})
    return out


def _size_capped() -> dict[str, Path]:
    """The files the size caps hold: the project's modules (`_modules`) and every scripts/*.py and tests/*.py."""
    out = _modules()
    out.update({f"{d}.{p.stem}": p for d in ("scripts", "tests") for p in sorted((ROOT / d).glob("*.py"))})
    return out


def test_the_top_level_holds_the_six_files_of_the_design_card():
    assert sorted(p.stem for p in ROOT.glob("*.py")) == CONCEPT


def test_imports_only_go_down():
    """harness/ is imported by nothing but train.py and itself; infra/ imports neither the concept files nor
    harness/; nothing imports train.py; and the import graph has no cycle."""
    graph = {m: _project_imports(p) for m, p in _modules().items()}
    for m, deps in graph.items():
        assert "train" not in deps, m
        if m.startswith("infra."):
            assert all(d.startswith("infra.") for d in deps), (m, deps)
        if m in CONCEPT and m != "train":
            assert not any(d.startswith("harness.") for d in deps), (m, deps)
    assert any(d.startswith("harness.") for d in graph["train"])   # the check does see harness imports
    state: dict[str, int] = {}

    def visit(m, path):
        state[m] = 1
        for d in graph.get(m, ()):
            assert state.get(d) != 1, f"import cycle: {' -> '.join(path + [d])}"
            if d not in state:
                visit(d, path + [d])
        state[m] = 2
    for m in graph:
        if m not in state:
            visit(m, [m])


def code_lines(source: str) -> int:
    """Lines that hold code: docstrings, comments and blank lines are not counted (a file may grow by
    explaining itself, or by un-joining a line, without coming nearer its limit)."""
    import io
    import tokenize
    doc = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                doc |= set(range(first.lineno, first.end_lineno + 1))
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING,
            tokenize.ENDMARKER}
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in skip:
            lines |= set(range(tok.start[0], tok.end[0] + 1))
    return len(lines - doc)


def test_code_lines_count_code_only():
    src = '"""doc\nstring"""\n\n# a comment\nx = (1,\n     2)  # trailing\n\ndef f():\n    """doc"""\n    return x\n'
    assert code_lines(src) == 4        # x = (1, / 2) / def f(): / return x


def test_the_six_files_hold_at_most_2400_lines_of_code():
    """Code lines only (`code_lines`): a file may grow by explaining itself or by un-joining a line."""
    lines = {m: code_lines((ROOT / f"{m}.py").read_text()) for m in CONCEPT}
    assert sum(lines.values()) <= 2400, lines


def test_no_line_runs_past_120_characters():
    """In the six files, infra/, harness/, scripts/ and tests/."""
    long = [f"{p.relative_to(ROOT)}:{i}: {len(line)}" for p in _size_capped().values()
            for i, line in enumerate(p.read_text().splitlines(), 1) if len(line) > 120]
    assert not long, long


def test_no_function_but_main_runs_past_80_lines():
    """In the six files, infra/, harness/, scripts/ and tests/; a function named `main` may run longer."""
    long = [f"{m}.{node.name}: {node.end_lineno - node.lineno + 1}" for m, p in _size_capped().items()
            for node in ast.walk(ast.parse(p.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name != "main"
            and node.end_lineno - node.lineno + 1 > 80]
    assert not long, long


@pytest.mark.parametrize("name", ["rsipo", "shrinkage", "skills"])
def test_each_self_contained_file_imports_alone(tmp_path, name):
    """rsipo.py, shrinkage.py and skills.py import nothing from the project: copied alone into an empty
    folder, each imports and runs there."""
    shutil.copy(ROOT / f"{name}.py", tmp_path / f"{name}.py")
    code = (f"import sys; sys.path = [p for p in sys.path if p not in ('', {str(ROOT)!r})]; "
            f"import {name}; print({name}.__file__)")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == str(tmp_path / f"{name}.py")


def _short_names() -> dict[str, str]:
    """A module's name in the documents → its import name: `rollout`, `distributed` / `infra.distributed`
    / `infra/distributed`, ..."""
    out = {m: m for m in CONCEPT}
    for full in _modules():
        if "." in full:
            out[full] = full
            out[full.replace(".", "/")] = full
            out.setdefault(full.split(".")[1], full)
    return out


REF = re.compile(r"`((?:infra|harness)[./]\w+|[A-Za-z_]\w*)(?:\.py)?\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)")


FILE_TYPES = ("py", "json", "jsonl", "md", "png", "html")   # `config.json` names a file, not harness.config's json


def doc_references(text: str) -> list[tuple[str, str]]:
    """(module, attribute) for each `module.attr` (or `module.Class.method`) at the start of a code span."""
    names = _short_names()
    return [(names[m], attr) for m, attr in REF.findall(text) if m in names and attr not in FILE_TYPES]


def test_doc_references_finds_the_forms_the_documents_use():
    text = ("`rollout.evaluate`, `infra/distributed.save_checkpoint`, `harness.run.Preemption` and `train.py` and `x.y`"
            " and `config.json`")
    assert doc_references(text) == [("rollout", "evaluate"), ("infra.distributed", "save_checkpoint"),
                                    ("harness.run", "Preemption")]


@pytest.mark.parametrize("doc", DOCS + ["*.py docstrings"])
def test_every_module_function_the_documents_name_exists(doc):
    if doc.endswith("docstrings"):
        texts = {str(p): ast.get_docstring(ast.parse(p.read_text())) or "" for p in _modules().values()}
    else:
        texts = {doc: (ROOT / doc).read_text()}
    missing = []
    for where, text in texts.items():
        refs = doc_references(text)
        for mod, attr in refs:
            obj = importlib.import_module(mod)
            for part in attr.split("."):
                if not hasattr(obj, part):
                    missing.append(f"{where}: {mod}.{attr}")
                    break
                obj = getattr(obj, part)
    assert not missing, missing


@pytest.mark.parametrize("doc", DOCS)
def test_every_project_path_the_documents_name_exists(doc):
    text = (ROOT / doc).read_text()
    paths = set(re.findall(r"(?<![\w/.~-])((?:infra|harness|scripts|tests|recipes)/[\w./-]*\w)", text))
    paths |= {p for p in re.findall(r"`([\w]+\.py)`", text)}
    where = ["", "infra", "harness", "scripts", "tests"]   # a bare file name is one of these folders' files
    missing = [p for p in sorted(paths) if not any((ROOT / d / p).exists() or (ROOT / d / p).with_suffix(".py").exists()
                                                   for d in (where if "/" not in p else [""]))]
    assert not missing, missing


def current_chains() -> list[list[str]]:
    """The commands of RESULTS.md's current-results chains: continuation lines joined, comments dropped, a
    `for S in ...; do CMD; done` loop as its CMD with S = its first value."""
    import shlex
    text = (ROOT / "RESULTS.md").read_text()
    block = text.split("## Current results", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    cmds = []
    for line in block.replace("\\\n", "").splitlines():
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        loop = re.fullmatch(r"for (\w+) in (\S+)[^;]*; do (.*); done", line)
        if loop:
            line = loop.group(3).replace("$" + loop.group(1), loop.group(2))
        cmds.append(shlex.split(line))
    return cmds


class Parsed(Exception):
    """Raised where a script has parsed its command line: the rest (the runs) is not what is checked."""


def test_every_current_results_chain_parses_as_written(monkeypatch):
    """Each command of the chains names an existing script, and its flags parse: train.py's with every check
    of a config (harness.config.parse_args), a script's own with its parser, and flags passed on to train.py
    after `--` with train.py's."""
    import argparse
    from harness import config
    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    real_parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        real_parse(self, args, namespace)
        raise Parsed()
    cmds = current_chains()
    assert len(cmds) >= 8 and {c[1] for c in cmds} >= {"train.py", "scripts/compare.py"}
    for cmd in cmds:
        assert cmd[0] == "python" and (ROOT / cmd[1]).is_file(), cmd
        if cmd[1] == "train.py":
            config.parse_args(cmd[2:])
            continue
        extra = cmd[cmd.index("--") + 1:] if "--" in cmd else []
        algos = cmd[cmd.index("--algos") + 1].split(",") if "--algos" in cmd else ["rsipo"]
        for algo in algos if extra else []:   # what each run of scripts/compare.py passes on to train.py
            config.parse_args(["--algo", algo, *extra])
        module = importlib.import_module(Path(cmd[1]).stem)
        with monkeypatch.context() as m:
            m.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
            with pytest.raises(Parsed):
                module.main(cmd[2:])


def test_method_s_step_table_names_every_function_rl_step_calls():
    """METHOD.md §2's table of the step is the reader's map of `train.rl_step`: every function of the step it
    calls (train.py's own, or one it imports) has its row."""
    import inspect
    import train as T
    tree = next(n for n in ast.walk(ast.parse((ROOT / "train.py").read_text()))
                if isinstance(n, ast.FunctionDef) and n.name == "rl_step")
    called = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and inspect.isfunction(getattr(T, n.id, None))}
    text = (ROOT / "METHOD.md").read_text()
    step = text[text.index("## 2. One training step"):text.index("### 2.1 ")]
    rows = set(re.findall(r"^\| `(\w+)`", step, flags=re.M))
    assert {"rollout_and_advantages", "score_teacher", "update", "calibrate", "follow_policy"} <= called
    assert called <= rows, sorted(called - rows)
