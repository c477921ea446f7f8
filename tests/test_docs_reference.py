"""The docs against the code: docs/server.md names every route, request field, status code and
`spanserve serve` flag, and no page, source file or result file is labelled by a numbered round of work."""

import inspect
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi.routing import APIRoute
from pydantic import BaseModel

from spanserve import errors
from spanserve.cli import build_parser
from spanserve.server import app as server_app
from spanserve.server import protocol
from spanserve.server.app import create_app

ROOT = Path(__file__).resolve().parent.parent
SERVER_DOC = ROOT / "docs" / "server.md"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# The code's comments and docstrings, the kernels' C and the benchmarks: measurements cited there too
CODE = sorted({*(ROOT / "spanserve").rglob("*.py"), *(ROOT / "spanserve" / "kernels" / "csrc").glob("*.[ch]"),
               *(ROOT / "benchmarks").glob("*.py"), ROOT / "Makefile"})
RESULTS = ROOT / "benchmarks" / "results"


@pytest.fixture(scope="module")
def server_doc() -> str:
    return SERVER_DOC.read_text()


def _routes() -> list[tuple[str, str]]:
    """(method, path) of every API route, from an app built over a stand-in engine (no model loads:
    create_app only reads these attributes while it assembles the routes)."""
    engine = SimpleNamespace(model_config=SimpleNamespace(vocab_size=2), sessions=None, max_model_len=2,
                             end_watchers=[])
    app = create_app(SimpleNamespace(tokenizer=None, engine=engine), "model")
    return sorted((method, route.path) for route in app.routes if isinstance(route, APIRoute)
                  for method in route.methods)


def test_server_doc_names_every_route(server_doc):
    routes = _routes()
    assert ("POST", "/v1/chat/completions") in routes  # the stand-in app has the real routes
    missing = [f"{method} {path}" for method, path in routes if f"`{method} {path}`" not in server_doc]
    assert not missing, f"docs/server.md does not document these routes: {missing}"


def _request_models() -> list[type[BaseModel]]:
    """Every request body model of protocol.py (and the parts they are made of)."""
    return [cls for _, cls in inspect.getmembers(protocol, inspect.isclass)
            if issubclass(cls, protocol._Body) and cls.__module__ == protocol.__name__]


def test_server_doc_names_every_request_field(server_doc):
    models = _request_models()
    assert protocol.ChatCompletionRequest in models and protocol.SessionCreateRequest in models
    missing = [f"{cls.__name__}.{field.alias or name}" for cls in models
               for name, field in cls.model_fields.items() if f"`{field.alias or name}`" not in server_doc]
    assert not missing, f"docs/server.md does not document these request fields: {missing}"


def _statuses() -> set[int]:
    """Every HTTP status the server answers on purpose: the error classes', and those app.py raises."""
    found = {cls.status for _, cls in inspect.getmembers(errors, inspect.isclass) if isinstance(
        getattr(cls, "status", None), int)}
    source = inspect.getsource(server_app)
    found |= {int(s) for s in re.findall(r"\b(?:APIError|error_response)\((\d{3})\b", source)}
    found |= set(server_app._ERRORS)
    return found | {400, 405, 500}


def test_server_doc_names_every_status_code(server_doc):
    table = server_doc.split("## Status codes", 1)[1].split("\n## ", 1)[0]
    missing = sorted(s for s in _statuses() if f"| {s} |" not in table)
    assert not missing, f"the status table of docs/server.md lacks {missing}"


def test_server_doc_names_every_serve_flag(server_doc):
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command")
    flags = sorted(option for action in commands.choices["serve"]._actions
                   for option in action.option_strings if option.startswith("--"))
    assert "--queue-timeout" in flags and "--model" in flags
    missing = [flag for flag in flags if not re.search(rf"`{re.escape(flag)}[` ]", server_doc)]
    assert not missing, f"docs/server.md does not document these `spanserve serve` flags: {missing}"


# "session" or "round" and a number ("Session N:", "round N"): a measurement labelled by the
# numbered work that made it. Not a streaming session's number-free mentions ("a session's regions").
WORK_LABEL = re.compile(r"\b[Ss]ession \d+\b|\b[Rr]ound \d+\b")


def _work_labels(files: list[Path]) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{number}: {match.group()}" for path in files
            for number, line in enumerate(path.read_text().splitlines(), 1)
            for match in WORK_LABEL.finditer(line)]


def test_docs_carry_no_numbered_rounds_of_work():
    assert len(PAGES) > 5
    found = _work_labels(PAGES)
    assert not found, f"numbered rounds of work in the docs (history lives in git): {found}"


def test_code_carries_no_numbered_rounds_of_work():
    assert len(CODE) > 50 and ROOT / "Makefile" in CODE
    assert any(path.suffix == ".c" for path in CODE) and any(path.suffix == ".h" for path in CODE)
    found = _work_labels(CODE)
    assert not found, f"numbered rounds of work in the code's comments (history lives in git): {found}"


# s12, session12, r3, round3 as a part of a name: a result labelled by the round that made it
ROUND_IN_NAME = re.compile(r"(?:^|[-_.])(?:s|session|r|round)\d+(?=[-_.]|$)", re.IGNORECASE)


def test_result_files_are_named_by_what_they_measure():
    names = sorted(p.name for p in RESULTS.iterdir())
    assert names
    labelled = [name for name in names if ROUND_IN_NAME.search(name)]
    assert not labelled, f"result files named by a round of work: {labelled}"


def test_every_result_file_is_cited_by_the_docs():
    text = "\n".join(page.read_text() for page in PAGES)
    uncited = [p.name for p in sorted(RESULTS.iterdir()) if p.name not in text]
    assert not uncited, f"result files no page cites (remove them: git keeps them): {uncited}"


def test_links_between_pages_resolve():
    broken = [f"{page.relative_to(ROOT)} -> {target}" for page in PAGES
              for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text())
              if "://" not in target and not (page.parent / target).exists()]
    assert not broken, f"links to files that do not exist: {broken}"
