"""`spanserve demo` (`make demo`, spanserve/demo.py): every step's answer is right, on the default
model (SmolLM2, in CI) and on Qwen2.5-Coder-0.5B where `make models` installed it."""

from types import SimpleNamespace

import pytest
from helpers import assert_engine_idle

from spanserve import demo
from spanserve.cli import build_parser, engine_config, main

QWEN = "qwen2.5-coder-0.5b-instruct"


def _installed(name: str) -> bool:
    from spanserve.models.catalog import CATALOG

    return CATALOG[name].installed()


@pytest.fixture(scope="module", params=[None, QWEN], ids=["smollm2", "qwen0.5b"])
def demo_llm(request):
    """One engine per model, set up as `spanserve demo [--model M]` sets it up; the steps share it."""
    if request.param is not None and not _installed(request.param):
        pytest.skip("needs `make models`")
    argv = ["demo"] + (["--model", request.param] if request.param else [])
    return demo.LLM(**vars(engine_config(build_parser().parse_args(argv))))


@pytest.mark.slow
@pytest.mark.parametrize("step", [fn for _, fn in demo.STEPS], ids=[fn.__name__ for _, fn in demo.STEPS])
def test_each_demo_step_answers_right_and_leaves_the_engine_idle(demo_llm, step):
    result = step(demo_llm)
    assert result.ok, "\n".join(result.lines)
    assert result.lines and all(isinstance(line, str) for line in result.lines)
    assert_engine_idle(demo_llm)


def test_the_demo_exits_nonzero_when_a_check_fails(monkeypatch, capsys):
    engine = SimpleNamespace(model_path=SimpleNamespace(name="m"), dtype="float32", device="cpu")
    monkeypatch.setattr(demo, "LLM", lambda **kwargs: SimpleNamespace(engine=engine))
    monkeypatch.setattr(demo, "STEPS", [("Right", lambda llm: demo.StepResult(True, ["a line"])),
                                        ("Wrong", lambda llm: demo.StepResult(False, ["the answer"]))])
    with pytest.raises(SystemExit) as exit_info:
        main(["demo"])
    assert exit_info.value.code == 1
    out = capsys.readouterr().out
    assert "1. Right" in out and "✓" in out and "2. Wrong" in out and "✗" in out and "   the answer" in out

    monkeypatch.setattr(demo, "STEPS", [("Right", lambda llm: demo.StepResult(True))])
    main(["demo"])  # all right: returns, exit status 0
    assert "all checks passed" in capsys.readouterr().out
