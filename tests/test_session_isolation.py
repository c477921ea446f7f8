"""One session can never take the engine down for anyone else: its limits are checked before it
exists, a failure in its background work ends that session alone, and a saved file of any kind
is a clear error that changes nothing (issue: one tenant's session at its limits turned every
request of every tenant into a 500)."""

import json

import pytest
from helpers import assert_engine_idle, greedy, random_prompt
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from spanserve import LLM
from spanserve.errors import InvalidSessionError, SessionFailedError, SessionFullError, SessionNotFoundError

ROWS = [f"t={i:03d}, value={(37 * i) % 101}\n" for i in range(40)]


@pytest.fixture(scope="module")
def llm(tiny_llama_path):
    return LLM(model=str(tiny_llama_path), dtype="float32", num_blocks=256)


def _others_still_served(llm) -> None:
    """Another tenant's stateless request runs to its end."""
    out = llm.generate({"prompt_token_ids": random_prompt(20, seed=3)}, greedy(4))[0]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"


def _nothing_left(llm) -> None:
    assert not llm.engine.sessions.sessions
    assert_engine_idle(llm)


def test_a_flash_question_that_cannot_fit_when_full_is_refused_before_the_session_exists(llm):
    """The reproducer: retention close to the model's length with a flash question whose
    max_tokens cannot fit beside it, given at creation; and the ordinary case, the default 64."""
    max_len = llm.engine.max_model_len
    for flash_max_tokens in (4096, 64):
        with pytest.raises(SessionFullError, match="when full"):
            llm.create_session(system="word " * 100, retention_tokens=max_len - 16,
                               flash=["What is the last value?"], flash_max_tokens=flash_max_tokens)
        _nothing_left(llm)
        _others_still_served(llm)



def test_a_ready_position_that_cannot_fit_when_full_is_refused(tiny_llama_path):
    small_blocks = LLM(model=str(tiny_llama_path), dtype="float32", num_blocks=512, block_size=4)
    opening = len(small_blocks.engine.sessions.format.answer_opening)
    with pytest.raises(SessionFullError, match="ready position"):
        small_blocks.create_session(retention_tokens=small_blocks.engine.max_model_len - opening,
                                    exit_answers=["yes", "no"])
    _nothing_left(small_blocks)


def test_a_session_filled_to_its_retention_keeps_answering_its_flash_question(llm):
    """What does fit at creation keeps fitting: data well past the retention, the flash question
    answered after every ingest, other requests served between the appends."""
    session = llm.create_session(system="Log.", retention_tokens=llm.engine.max_model_len - 40,
                                 flash=["Last value?"], flash_max_tokens=20)
    for row in ROWS * 4:
        session.append(row)
    session.wait()
    _others_still_served(llm)
    assert session.info()["evicted_tokens"] > 0 and session.info()["failed"] is None
    version, answer = session.flash_answers()["Last value?"]
    assert version == session.version and answer is not None
    session.close()
    _nothing_left(llm)


def test_a_failure_in_one_sessions_background_work_ends_that_session_alone(llm, monkeypatch):
    healthy = llm.create_session(system="Other tenant.")
    broken = llm.create_session(system="Log.", flash=["Last value?"])
    events = []
    broken._session.subscribe(events.append)

    def fault():
        raise RuntimeError("a bug in this session's ingest")

    while broken._session._ingest is not None:  # its instructions computed: the next step starts an ingest
        llm.engine.step()
    monkeypatch.setattr(broken._session, "_start_ingest", fault)  # it is called after every step
    _others_still_served(llm)  # the step that services the sessions runs, and serves this request
    assert broken.info()["failed"] == "RuntimeError: a bug in this session's ingest"
    assert broken._session.blocks == []  # its memory is back
    assert events[-1] is None and "failed" in events[-2]["error"]["message"]
    for call in (lambda: broken.append("more"), lambda: broken.query("Last value?"),
                 lambda: broken._session.subscribe(events.append)):
        with pytest.raises(SessionFailedError, match="delete it"):
            call()
    healthy.append(ROWS[1])
    healthy.wait()
    assert healthy.query("Which value?", greedy(3)).output.outputs[0].finish_reason == "length"
    broken.close()  # the owner deletes it
    healthy.close()
    _nothing_left(llm)


def _saved(llm, tmp_path):
    session = llm.create_session(system="Log.")
    for row in ROWS[:6]:
        session.append(row)
    session.wait()
    path = tmp_path / f"{session.id}.safetensors"
    session.save(str(path))
    session.close()
    with safe_open(str(path), "pt") as f:
        meta = json.loads(f.metadata()["session"])
    return path, meta


@pytest.mark.parametrize("change, message", [
    (lambda m: m["state"].update(tokens="not a list"), "tokens must be a list"),
    (lambda m: m["state"].update(pending=[1, 2, 10**9]), "pending must be a list of token ids"),
    (lambda m: m["state"].update(retention_tokens=-5), "retention_tokens must be a non-negative"),
    (lambda m: m["state"].update(version="3"), "version must be"),
    (lambda m: m.update(flash=[["q", "x", None]]), "not a valid session file"),
    (lambda m: m.update(flash=[["What is the answer to everything, in detail? " * 20, -1, None]]), "when full"),
    (lambda m: m.update(state=None), "not a valid session file"),
])
def test_a_corrupt_saved_session_is_a_clear_error_and_changes_nothing(llm, tmp_path, change, message):
    path, meta = _saved(llm, tmp_path)
    change(meta)
    crafted = tmp_path / path.name
    save_file(load_file(str(path)), str(crafted), metadata={"session": json.dumps(meta)})
    with pytest.raises((InvalidSessionError, SessionFullError), match=message) as caught:
        llm.restore_session(str(crafted))
    assert str(tmp_path) not in str(caught.value)  # the file's name, never the server's folders
    _nothing_left(llm)
    _others_still_served(llm)


def test_another_tenants_saved_session_reads_like_one_that_is_not_there(llm, tmp_path):
    path, _ = _saved(llm, tmp_path)
    store = llm.engine.sessions
    with pytest.raises(SessionNotFoundError) as foreign:
        store.restore(path, tenant="someone-else")
    with pytest.raises(SessionNotFoundError) as missing:
        store.restore(tmp_path / "sess-0123456789abcdef0123456789abcdef.safetensors", tenant="someone-else")
    assert str(foreign.value).replace(path.stem, "ID") == str(missing.value).replace(
        "sess-0123456789abcdef0123456789abcdef", "ID")
    assert str(tmp_path) not in str(foreign.value)
    _nothing_left(llm)


def test_a_request_whose_own_step_work_raises_ends_alone(llm, monkeypatch):
    """Its sampled token's handling (here its detokenizer) raises: it ends with the error for its
    caller, and the request beside it in the same steps runs to its end."""
    engine = llm.engine
    engine.add_request({"prompt_token_ids": random_prompt(20, seed=1)}, greedy(6), "broken")
    engine.add_request({"prompt_token_ids": random_prompt(20, seed=2)}, greedy(6), "healthy")

    def fault(token_id):
        raise RuntimeError("a bug in this request's detokenizer")

    monkeypatch.setattr(engine.groups["broken"].detokenizers[0], "add", fault)
    finished = {}
    while engine.has_unfinished_requests():
        finished |= {out.request_id: out for out in engine.step() if out.finished}
    failed = engine.take_failed()
    assert set(failed) == {"broken"} and "detokenizer" in str(failed["broken"])
    assert set(finished) == {"healthy"} and len(finished["healthy"].outputs[0].token_ids) == 6
    _nothing_left(llm)


def test_the_offline_llm_raises_a_request_failure_instead_of_waiting_forever(llm, monkeypatch):
    from spanserve.engine import detokenizer
    from spanserve.errors import RequestFailedError

    def fault(self, token_id):
        raise RuntimeError("a bug")

    monkeypatch.setattr(detokenizer.IncrementalDetokenizer, "add", fault)
    with pytest.raises(RequestFailedError, match="a bug"):
        llm.generate({"prompt_token_ids": random_prompt(10, seed=4)}, greedy(3))
    monkeypatch.undo()
    _nothing_left(llm)
    _others_still_served(llm)
