"""``python -m pipeline.docs``: write docs/CONFIG.md from the schema's field docstrings (a test keeps it current)."""

from __future__ import annotations

import ast
import dataclasses
import sys
from pathlib import Path

from pipeline.schema import config, graph, search, sections, stage_sections
from pipeline.schema.domains import domain_of

SCHEMA_MODULES = (sections, stage_sections, search, config)
"""The modules that define config sections (their field docstrings are read from the source)."""

SEE = {
    "ParallelConfig": "<stage>.parallel",
    "MonitorConfig": "<train stage>.monitor",
    "HealthConfig": "cluster.health",
}
"""A field whose type is a section of its own: its row points there (no default shown)."""

SECTIONS = (
    ("run", "RunConfig"),
    ("model", "ModelConfig"),
    ("cluster", "ClusterConfig"),
    ("cluster.health", "HealthConfig"),
    ("data", "DataConfig"),
    ("data.sources[i]", "DataSource"),
    ("data_prep", "DataPrepStage"),
    (" / ".join(graph.TRAIN_STAGES), "TrainStage"),
    ("rlhf (besides the TrainStage keys)", "RLHFStage"),
    ("<stage>.parallel", "ParallelConfig"),
    ("<train stage>.monitor", "MonitorConfig"),
    ("<train stage>.peft", "PeftConfig"),
    ("eval", "EvalStage"),
    ("export", "ExportStage"),
    ("planner", "PlannerConfig"),
    ("search", "SearchConfig"),
)


def field_docs() -> dict[str, list[tuple[str, str, str, str]]]:
    """Per dataclass of SCHEMA_MODULES: (field, type, default, docstring) in source order."""
    out: dict[str, list[tuple[str, str, str, str]]] = {}
    for module in SCHEMA_MODULES:
        out |= _module_field_docs(ast.parse(Path(str(module.__file__)).read_text()))
    return out


def _module_field_docs(tree: ast.Module) -> dict[str, list[tuple[str, str, str, str]]]:
    """(field, type, default, docstring) of each dataclass defined at the top of one module."""
    out: dict[str, list[tuple[str, str, str, str]]] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        rows = []
        body = node.body
        for i, stmt in enumerate(body):
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                doc = ""
                nxt = body[i + 1] if i + 1 < len(body) else None
                if (
                    isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)
                ):
                    doc = nxt.value.value.strip()
                value = stmt.value
                if isinstance(value, ast.Call) and ast.unparse(value.func) == "num" and value.args:
                    value = value.args[0]  # num(default, <domain>): the domain has its own column
                default = ast.unparse(value) if value is not None else ""
                if "default_factory" in default:
                    default = default.split("default_factory=", 1)[1][:-1].removeprefix("lambda: ")
                rows.append((stmt.target.id, ast.unparse(stmt.annotation), default, doc))
        out[node.name] = rows
    return out


def render() -> str:
    docs = field_docs()
    classes = {name: getattr(m, name) for m in SCHEMA_MODULES for name in vars(m) if name in docs}
    lines = [
        "# Configuration reference",
        "",
        "Generated from the schema in `pipeline/schema/` (sections.py, stage_sections.py, config.py) by `python -m pipeline.docs`; do not edit by hand.",
        "Override any key on the command line (`python -m pipeline pretrain.lr=3e-4`); YAML under `conf/` picks",
        "values per group (`model=llama3.2-1b`, `cluster=slurm`, `parallel@pretrain.parallel=dp2`, `experiment=tiny`).",
        "`allowed` is a numeric key's domain (null stays allowed where the type says `| None`); every key is checked",
        "before any job starts, and a mistake prints `config error: <key>=<value>: <what is allowed>` (exit code 2).",
        "",
    ]
    for prefix, cls in SECTIONS:
        domains = {f.name: domain_of(f) for f in dataclasses.fields(classes[cls])}
        lines += [
            f"## `{prefix}` ({cls})",
            "",
            "| key | type | default | allowed | meaning |",
            "|---|---|---|---|---|",
        ]
        for name, typ, default, doc in docs[cls]:
            dom = domains.get(name)
            allowed = dom.describe() if dom else ""
            if typ in SEE:
                doc, default = doc + f" See `{SEE[typ]}`.", ""
            typ, default = typ.replace("|", "\\|"), default.replace("|", "\\|")
            lines.append(f"| `{name}` | `{typ}` | `{default}` | {allowed} | {doc.replace('|', '/')} |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    target = Path(__file__).resolve().parents[2] / "docs" / "CONFIG.md"
    target.write_text(render())
    print(f"wrote {target}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
