"""The reference pages of the documentation, generated from the code while `mkdocs build` runs.

mkdocs.yml names this module under `hooks:`. `on_files` adds five pages that exist only in the built
site, so nothing generated is committed and a renamed command, route, setting or error code shows in
the next build:

* reference/cli.md            every command of `cardiofl.cli:app`, walked from typer's click command
* reference/rest.md           every path and schema of the coordinator's OpenAPI document
* reference/configuration.md  the coordinator's and the site agent's settings, and the data sources
* reference/study-terms.md    every field of `shared.terms.StudyTerms`, from its JSON schema
* reference/errors.md         the API's error codes and the agent's exit codes

Descriptions come from the code: docstrings, help texts and the comment beside each field.
"""

from __future__ import annotations

import ast
import html
import inspect
import io
import json
import re
import textwrap
import tokenize
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

__all__ = [
    "GENERATED",
    "cli_page",
    "configuration_page",
    "errors_page",
    "on_config",
    "on_files",
    "openapi_document",
    "rest_page",
    "study_terms_page",
]

REPO = Path(__file__).resolve().parents[1]
NOTE = "*Generated from the code when the site is built (`docs/hooks.py`); do not edit.*\n"
_SPECIAL = re.compile(r"([\\*_\[\]|<>])")


# --- Markdown helpers -----------------------------------------------------------------------------------------


def md(text: str | None) -> str:
    """`text` safe in a Markdown table cell: one line, code spans kept, other Markdown characters escaped."""
    if not text:
        return ""
    parts = " ".join(text.split()).split("`")
    out = [part if i % 2 else _SPECIAL.sub(r"\\\1", html.unescape(part)) for i, part in enumerate(parts)]
    return "`".join(out) if len(parts) % 2 else "`".join(out) + "\\`"


def code(text: str) -> str:
    """`text` as a code span that survives a table cell."""
    text = " ".join(str(text).split())  # a `|` inside a code span does not split a table cell
    fence = "``" if "`" in text else "`"
    return f"{fence} {text} {fence}" if fence == "``" else f"`{text}`"


def table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table (an empty string for no rows)."""
    if not rows:
        return ""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell or " " for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def slug(text: str) -> str:
    """An HTML id from `text` (also used in the links to it)."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


# --- comments beside fields ----------------------------------------------------------------------------------


def _class_comments(cls: type) -> dict[str, str]:
    """Field name -> the comment on its line(s), or the comment lines right above it, in `cls`'s own source."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    comments: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
    lines = source.splitlines()
    found: dict[str, str] = {}
    body = ast.parse(source).body[0]
    for node in getattr(body, "body", []):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        text = [comments[n] for n in range(node.lineno, (node.end_lineno or node.lineno) + 1) if n in comments]
        above, line = [], node.lineno - 1
        while line >= 1 and lines[line - 1].strip().startswith("#"):
            above.insert(0, comments.get(line, ""))
            line -= 1
        found[node.target.id] = " ".join(above + text).strip()
    return found


def field_comments(cls: type) -> dict[str, str]:
    """The comments of `cls`'s fields, its bases' included (its own win)."""
    merged: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if isinstance(base, type) and issubclass(base, BaseModel) and base.__module__ != "pydantic.main":
            merged.update({k: v for k, v in _class_comments(base).items() if v})
    return merged


def field_default(field: Any) -> str:
    """A field's default as a code span; "required" when it has none."""
    if field.default_factory is not None:
        value = field.default_factory()
        return "(see below)" if isinstance(value, BaseModel) else code(repr(value))
    if field.default is PydanticUndefined:
        return "**required**"
    value = field.default
    if value is None:
        return "(unset)"
    if hasattr(value, "get_secret_value"):
        return code("(secret)")
    return code(json.dumps(value) if isinstance(value, bool | type(None)) else str(value) if value != "" else '""')


def type_name(annotation: Any) -> str:
    """A field's type, short: `int`, `Path | None`, `list[DataSourceConfig]`."""
    text = annotation.__name__ if isinstance(annotation, type) else str(annotation)
    text = re.sub(r"\b(?:typing|pathlib|pydantic\.types|pydantic\.networks|[a-z_]+(?:\.[a-z_]+)*)\.", "", text)
    return code(re.sub(r"Annotated\[([^,\]]+)[^\]]*\]", r"\1", text))


# --- the CLI -------------------------------------------------------------------------------------------------


def cli_commands() -> Iterator[tuple[list[str], Any]]:
    """(command path, click command) of every command of `cardiofl`, groups included, depth first."""
    import typer

    from cardiofl.cli import app

    def walk(command: Any, path: list[str]) -> Iterator[tuple[list[str], Any]]:
        yield path, command
        for name in sorted(getattr(command, "commands", {}) or {}):
            sub = command.commands[name]
            if not getattr(sub, "hidden", False):
                yield from walk(sub, [*path, name])

    yield from walk(typer.main.get_command(app), ["cardiofl"])


def _command_section(path: list[str], command: Any) -> str:
    """One command: its usage, help, subcommands and parameters."""
    context = type(command).context_class(command, info_name=" ".join(path))
    usage = command.get_usage(context).removeprefix("Usage: ")
    name = " ".join(path)
    parts = [f"## {name} {{#{slug(name)}}}\n", f"```text\n{usage}\n```\n"]
    help_text = inspect.cleandoc(command.help or "")
    if help_text:
        parts.append(md(help_text.replace("\b", "")) + "\n")
    subs = getattr(command, "commands", None)
    if subs:
        rows = [
            [f"[`{name} {sub}`](#{slug(f'{name} {sub}')})", md(subs[sub].get_short_help_str(limit=200))]
            for sub in sorted(subs)
            if not getattr(subs[sub], "hidden", False)
        ]
        parts.append(table(["command", "what it does"], rows))
    rows = []
    for param in command.get_params(context):
        record = param.get_help_record(context)
        kind = "option" if param.param_type_name == "option" else "argument"
        if record is None:
            record = (param.human_readable_name, "")
        flags = code(record[0])
        if getattr(param, "required", False):
            flags += " (required)"
        rows.append([flags, kind, md(record[1])])
    parts.append(table(["option or argument", "kind", "help"], rows))
    return "\n".join(part for part in parts if part)


def cli_page() -> str:
    """reference/cli.md: every command and option of `cardiofl`."""
    commands = list(cli_commands())
    index = [
        [f"[`{' '.join(path)}`](#{slug(' '.join(path))})", md(cmd.get_short_help_str(limit=120))]
        for path, cmd in commands
    ]
    sections = [_command_section(path, command) for path, command in commands]
    intro = (
        "# CLI reference\n\n" + NOTE + "\nEvery command of `cardiofl` (`cardiofl.cli:app`), with its usage, help and "
        "options, as `cardiofl ... --help` prints them. `--json` prints machine-readable output where a command "
        "offers it.\n\n"
    )
    return intro + table(["command", "what it does"], index) + "\n" + "\n".join(sections)


# --- the REST API --------------------------------------------------------------------------------------------


def openapi_document() -> dict[str, Any]:
    """The coordinator's OpenAPI document, from an app on an in-memory SQLite settings object (never started)."""
    from coordinator.config import CoordinatorSettings
    from coordinator.main import create_app

    settings = CoordinatorSettings(_env_file=None, database_url="sqlite://", admin_token=None, blob_dir=None)
    return create_app(settings).openapi()


def schema_type(schema: dict[str, Any]) -> str:
    """A JSON schema as a short type, components linked to their section."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#schema-{slug(name)})"
    if "anyOf" in schema or "oneOf" in schema:
        return " or ".join(schema_type(option) for option in schema.get("anyOf", schema.get("oneOf", [])))
    if "const" in schema:
        return code(json.dumps(schema["const"]))
    if "enum" in schema:
        return "one of " + ", ".join(code(json.dumps(value)) for value in schema["enum"])
    kind = schema.get("type", "any")
    if kind == "array":
        if "prefixItems" in schema:
            return "tuple of " + ", ".join(schema_type(item) for item in schema["prefixItems"])
        return "list of " + schema_type(schema.get("items", {}))
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        return "map of " + schema_type(schema["additionalProperties"])
    if isinstance(kind, list):
        return " or ".join(kind)
    return kind + (f" ({schema['format']})" if "format" in schema else "")


def constraints(schema: dict[str, Any]) -> str:
    """A JSON schema's bounds and patterns, as a short text."""
    names = {
        "minimum": "≥",
        "exclusiveMinimum": ">",
        "maximum": "≤",
        "exclusiveMaximum": "<",
        "minLength": "length ≥",
        "maxLength": "length ≤",
        "minItems": "items ≥",
        "maxItems": "items ≤",
    }
    found = [f"{sign} {schema[key]}" for key, sign in names.items() if key in schema]
    for option in schema.get("anyOf", []):
        found += [f"{sign} {option[key]}" for key, sign in names.items() if key in option]
    if "pattern" in schema:
        found.append("pattern " + code(schema["pattern"]))
    return ", ".join(found)


def _operation_section(method: str, path: str, operation: dict[str, Any]) -> str:
    """One operation: summary, description, parameters, body and responses."""
    parts = [f"### {method.upper()} {path} {{#{slug(method + ' ' + path)}}}\n"]
    if operation.get("summary"):
        parts.append(f"**{md(operation['summary'])}**\n")
    if operation.get("description"):
        parts.append(md(operation["description"]) + "\n")
    rows = [
        [
            code(p["name"]),
            p["in"],
            "yes" if p.get("required") else "no",
            schema_type(p.get("schema", {})),
            md(p.get("description")),
        ]
        for p in operation.get("parameters", [])
    ]
    parts.append(table(["parameter", "in", "required", "type", "description"], rows))
    body = operation.get("requestBody", {}).get("content", {})
    rows = [[code(media), schema_type(content.get("schema", {}))] for media, content in body.items()]
    if rows:
        parts.append("Request body:\n\n" + table(["content type", "schema"], rows))
    rows = []
    for status, response in operation.get("responses", {}).items():
        schemas = [schema_type(c.get("schema", {})) for c in response.get("content", {}).values()]
        media = [code(m) for m in response.get("content", {})]
        rows.append([status, md(response.get("description")), ", ".join(media), ", ".join(s for s in schemas if s)])
    parts.append("Responses:\n\n" + table(["status", "meaning", "content type", "schema"], rows))
    return "\n".join(part for part in parts if part)


def _schema_section(name: str, schema: dict[str, Any]) -> str:
    """One component schema: its description and properties."""
    parts = [f"### {name} {{#schema-{slug(name)}}}\n"]
    if schema.get("description"):
        parts.append(md(schema["description"]) + "\n")
    required = set(schema.get("required", []))
    rows = [
        [
            code(prop),
            schema_type(sub),
            "yes" if prop in required else "no",
            md(sub.get("description") or sub.get("title")),
        ]
        for prop, sub in schema.get("properties", {}).items()
    ]
    parts.append(table(["property", "type", "required", "description"], rows))
    if not rows:
        parts.append(f"Type: {schema_type(schema)}\n")
    return "\n".join(part for part in parts if part)


def rest_page(document: dict[str, Any] | None = None) -> str:
    """reference/rest.md: every path, method and schema of the coordinator's OpenAPI document."""
    document = document or openapi_document()
    info = document.get("info", {})
    index, sections = [], []
    for path, operations in sorted(document["paths"].items()):
        for method, operation in operations.items():
            index.append([f"[`{method.upper()} {path}`](#{slug(method + ' ' + path)})", md(operation.get("summary"))])
            sections.append(_operation_section(method, path, operation))
    schemas = document.get("components", {}).get("schemas", {})
    schema_sections = [_schema_section(name, schema) for name, schema in sorted(schemas.items())]
    intro = (
        f"# REST API reference\n\n{NOTE}\nThe OpenAPI {document.get('openapi', '')} document of "
        f"{md(info.get('title', 'the coordinator'))} {info.get('version', '')}, as a running coordinator serves it at "
        "`/openapi.json`. Tokens go in `Authorization: Bearer <token>`; every error body is "
        "[ErrorBody](#schema-errorbody) (codes: [Error codes](errors.md)). The guide to the API, with its roles "
        "and the agent's protocol, is [the protocol](../architecture/protocol.md).\n\n## Operations\n\n"
    )
    return (
        intro
        + table(["operation", "summary"], index)
        + "\n"
        + "\n".join(sections)
        + "\n## Schemas\n\n"
        + "\n".join(schema_sections)
    )


# --- settings ------------------------------------------------------------------------------------------------


def _settings_rows(cls: type[BaseModel], variable: Any) -> list[list[str]]:
    """One row per field of a settings or config class: name, variable, type, default, description."""
    comments = field_comments(cls)
    rows = []
    for name, field in cls.model_fields.items():
        row = [code(name)] + ([variable(name)] if variable else [])
        rows.append(
            [*row, type_name(field.annotation), field_default(field), md(field.description or comments.get(name))]
        )
    return rows


def configuration_page() -> str:
    """reference/configuration.md: every setting of the coordinator and the site agent, and the data sources."""
    from coordinator.config import CoordinatorSettings
    from site_agent.config import ENV_PREFIX, SHARED_VARIABLES, AgentSettings
    from site_agent.data.config import ChallengeSource, ManifestSource, PtbxlSource, SourceConfig, SphSource

    coordinator_prefix = CoordinatorSettings.model_config.get("env_prefix", "")

    def agent_variable(name: str) -> str:
        shared = f" (or {code(SHARED_VARIABLES[name])})" if name in SHARED_VARIABLES else ""
        return code(ENV_PREFIX + name.upper()) + shared

    parts = [
        "# Configuration reference\n",
        NOTE,
        "## Coordinator {#coordinator}\n",
        md(inspect.getdoc(CoordinatorSettings)) + f" Class `coordinator/config.py:{CoordinatorSettings.__name__}`: "
        f"each setting is the environment variable `{coordinator_prefix}<NAME>`, or a line of a `.env` file in the "
        "working directory; an empty variable counts as unset. `deploy/env.example` lists them with comments.\n",
        table(
            ["setting", "variable", "type", "default", "description"],
            _settings_rows(CoordinatorSettings, lambda name: code(coordinator_prefix + name.upper())),
        ),
        "## Site agent {#site-agent}\n",
        md(inspect.getdoc(AgentSettings))
        + f" Class `site_agent/config.py:{AgentSettings.__name__}`: each setting is a "
        f"key of the agent's TOML file (`cardiofl site run --config site.toml`) or the variable `{ENV_PREFIX}<NAME>`, "
        "which comes first (empty variables count as unset; nested values use `__`, a list such as `data` is one "
        "JSON value). `deploy/site.example.toml` documents each one with an example.\n",
        table(["setting", "variable", "type", "default", "description"], _settings_rows(AgentSettings, agent_variable)),
        "## Data sources {#data-sources}\n",
        "Each `[[data]]` table of the agent's file is one source; `kind` picks its layout. "
        + md(inspect.getdoc(SourceConfig))
        + "\n",
    ]
    for source in (ChallengeSource, PtbxlSource, ManifestSource, SphSource):
        kind = source.model_fields["kind"].default
        parts += [f'### kind = "{kind}" {{#source-{kind}}}\n', md(inspect.getdoc(source)) + "\n"]
        parts.append(table(["key", "type", "default", "description"], _settings_rows(source, None)))
    return "\n".join(parts)


# --- study terms ---------------------------------------------------------------------------------------------


def _terms_classes() -> dict[str, type[BaseModel]]:
    """The pydantic classes of shared/terms/study_terms.py by name (their comments describe the fields)."""
    import shared.terms as terms

    return {name: obj for name, obj in vars(terms).items() if isinstance(obj, type) and issubclass(obj, BaseModel)}


def _terms_section(title: str, schema: dict[str, Any], defs: dict[str, Any], classes: dict[str, Any]) -> str:
    """One table of the terms: the fields of `schema`, nested models linked to their own section."""
    cls = classes.get(schema.get("title", ""))
    comments = field_comments(cls) if cls else {}
    required = set(schema.get("required", []))
    rows = []
    for name, sub in schema.get("properties", {}).items():
        default = "**required**" if name in required else code(json.dumps(sub["default"])) if "default" in sub else ""
        refs = [s["$ref"] for s in [sub, *sub.get("anyOf", [])] if "$ref" in s]
        if refs and not default:
            default = "(see its table)"
        description = sub.get("description") or comments.get(name, "")
        rows.append([code(name), schema_type(sub), default, constraints(sub), md(description)])
    text = f"## {title} {{#schema-{slug(schema.get('title', title))}}}\n\n"
    if schema.get("description"):
        text += md(schema["description"]) + "\n\n"
    return text + table(["field", "type", "default", "bounds", "description"], rows)


def _rule_params() -> str:
    """The params of every registered algorithm, weighting and participation policy."""
    from shared.algorithms.participation import PARTICIPATIONS
    from shared.algorithms.registry import ALGORITHMS
    from shared.algorithms.weightings import WEIGHTINGS

    parts = []
    for key, registry in (("algorithm", ALGORITHMS), ("aggregation", WEIGHTINGS), ("participation", PARTICIPATIONS)):
        parts.append(f"### [{key}] params {{#params-{key}}}\n")
        rows = []
        for name, rule in sorted(registry.items()):
            params = rule.params
            comments = field_comments(params)
            for field_name, field in params.model_fields.items():
                rows.append(
                    [
                        code(name),
                        code(field_name),
                        type_name(field.annotation),
                        field_default(field),
                        md(field.description or comments.get(field_name)),
                    ]
                )
            if not params.model_fields:
                rows.append([code(name), "(none)", "", "", ""])
        parts.append(table([f"{key} name", "param", "type", "default", "description"], rows))
    return "\n".join(parts)


def study_terms_page() -> str:
    """reference/study-terms.md: every field of StudyTerms, from its JSON schema, and the rules' params."""
    from shared.terms import StudyTerms

    schema = StudyTerms.model_json_schema()
    defs = schema.get("$defs", {})
    classes = _terms_classes()
    sections = [_terms_section("StudyTerms: the top level", schema, defs, classes)]
    sections += [_terms_section(name, defs[name], defs, classes) for name in sorted(defs)]
    intro = (
        "# Study terms reference\n\n" + NOTE + "\nA study's terms are one frozen type, `shared.terms.StudyTerms`: "
        "what `cardiofl study create` validates a TOML file into, what the coordinator stores and every task embeds, "
        "and what a site's operator approves (see [Approving a study](../data-owner/approval.md)). A study TOML has "
        "`name` and these fields; nested models are TOML tables (`[training]`, `[privacy.dp]`). "
        "`deploy/study.example.toml` is a commented example. Unknown keys are refused.\n\n"
    )
    return (
        intro
        + "\n".join(sections)
        + "\n## Rule parameters {#rule-parameters}\n\n"
        + (
            "The `params` table of `[algorithm]`, `[aggregation]` and `[participation]`, per registered name (plug-ins "
            "installed where the site is built included); unknown names or parameters are refused when a study is "
            "created.\n\n"
        )
        + _rule_params()
    )


# --- error codes ---------------------------------------------------------------------------------------------


def _error_classes(base: type) -> Iterator[type]:
    """`base` and its subclasses, depth first."""
    yield base
    for sub in base.__subclasses__():
        yield from _error_classes(sub)


def _raised_codes(root: Path) -> list[tuple[str, str, str, str]]:
    """(code, error class, message, file) of every `SomeError(..., code="literal")` under `root`."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            literal = [k.value.value for k in node.keywords if k.arg == "code" and isinstance(k.value, ast.Constant)]
            if not literal:
                continue
            message = node.args[0] if node.args else None
            text = ""
            if isinstance(message, ast.Constant):
                text = str(message.value)
            elif isinstance(message, ast.JoinedStr):
                text = "".join(v.value if isinstance(v, ast.Constant) else "…" for v in message.values)
            found.append((literal[0], node.func.id, text, str(path.relative_to(REPO))))
    return found


def errors_page() -> str:
    """reference/errors.md: every error code of the API and what it means, the agent's exit codes."""
    import coordinator.errors as errors
    from shared.tensors.codec import PayloadError

    classes = {cls.__name__: cls for cls in _error_classes(errors.CoordinatorError)}
    rows = [
        [code(cls.code), str(cls.status_code), code(cls.__name__), md(inspect.getdoc(cls)), "class"]
        for cls in classes.values()
    ]
    for cls in sorted(_error_classes(PayloadError), key=lambda c: c.__name__):
        rows.append(
            [code(cls.code), "422", code("InvalidUpload"), md(inspect.getdoc(cls)), "`shared/tensors/codec.py`"]
        )
    seen = {row[0] for row in rows}
    for err_code, raised, message, path in sorted(_raised_codes(REPO / "coordinator")):
        status = str(classes[raised].status_code) if raised in classes else "?"
        if code(err_code) not in seen:
            seen.add(code(err_code))
            rows.append([code(err_code), status, code(raised), md(message), code(path)])
    tree = inspect.getdoc(errors) or ""
    agent = inspect.getdoc(__import__("site_agent.errors", fromlist=["AgentError"])) or ""
    return "\n".join(
        [
            "# Error codes\n",
            NOTE,
            'Every error the coordinator answers has the body `{"error": {"code": "...", "message": "..."}}` '
            "with a stable `code`; the HTTP status follows from the error's class (`coordinator/errors.py`). An "
            "error class may report a more specific code than its own: those are listed with the message they are "
            "raised with (`…` marks the parts filled in at run time). What to do about each is in "
            "[Troubleshooting](../hospital-it/troubleshooting.md).\n",
            "## API error codes {#api}\n",
            table(["code", "status", "class", "meaning", "where"], rows),
            "## The tree of error classes {#tree}\n",
            "```text\n" + tree + "\n```\n",
            "## The site agent's errors and exit codes {#agent}\n",
            "`cardiofl site run` stops with exit code 2 when a setting or data source is wrong (the line names it), 3 "
            "when its encrypted store cannot be opened or is an older copy (`site_agent/store.py`), and 4 when the "
            "coordinator and the agent speak protocols the other does not take; `cardiofl site check` exits 0 only "
            "when the site is ready. Inside the agent (`site_agent/errors.py`):\n",
            "```text\n" + agent + "\n```\n",
        ]
    )


# --- the hook ------------------------------------------------------------------------------------------------

GENERATED = {
    "reference/cli.md": cli_page,
    "reference/rest.md": rest_page,
    "reference/configuration.md": configuration_page,
    "reference/study-terms.md": study_terms_page,
    "reference/errors.md": errors_page,
}


def on_config(config: Any) -> Any:
    """Drop the script Material's offline plugin loads from a CDN (an iframe-worker shim for search on file://).

    Hooks run after plugins, so the shim is already in `extra.polyfills`. Without it every page reads offline;
    search needs the site served (`python -m http.server -d site`) in browsers that refuse workers on file://.
    """
    polyfills = config.extra.get("polyfills") or []
    config.extra["polyfills"] = [url for url in polyfills if not str(url).startswith(("http://", "https://"))]
    return config


def on_files(files: Any, config: Any) -> Any:
    """Add the generated reference pages to the site's files (MkDocs event)."""
    from mkdocs.structure.files import File

    for uri, build in GENERATED.items():
        files.append(File.generated(config, uri, content=build()))
    return files
