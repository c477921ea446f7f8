"""Streaming sessions (spanserve/sessions/): ingest, questions, eviction, flash, save/restore."""

import pytest
import torch
from helpers import assert_engine_idle, greedy, random_prompt

from spanserve import LLM, SamplingParams
from spanserve.engine.request import Priority
from spanserve.engine.scheduler import BackgroundPace
from spanserve.errors import (
    CacheFullError,
    InvalidRequestError,
    SessionClosedError,
    SessionFullError,
    SessionNotFoundError,
)
from spanserve.sparse.decode import NARROW_FROM

ROWS = [f"t={i:03d}, sensor={'ABC'[i % 3]}, value={(37 * i) % 101}\n" for i in range(200)]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def llm(tiny_llama_path):
    return LLM(model=str(tiny_llama_path), dtype="float32", num_blocks=256)


def _feed(session, rows):
    for row in rows:
        session.append(row)
    session.wait()


def _visible_prompt(llm, session, question):
    return session._session.prompt(llm.engine.sessions.format.question(question))


def _close_all(llm):
    for sid in list(llm.engine.sessions.sessions):
        llm.engine.sessions.close(sid)


def test_question_equals_the_same_prompt_run_stateless(llm):
    """A question over ingested data (ingest in background chunks, the question header computed
    after the data) gives the tokens and logprobs of the whole prompt run as one request."""
    s = llm.create_session(system="Answer from the log.")
    _feed(s, ROWS[:20])
    assert s.version == 20 and s.info()["pending_tokens"] == 0 and s.info()["evicted_tokens"] == 0
    answer = s.query("Which sensor reported 74?", GREEDY)
    assert answer.version == 20 and not answer.flash_hit
    ref = llm.generate({"prompt_token_ids": _visible_prompt(llm, s, "Which sensor reported 74?")}, GREEDY)[0]
    assert answer.output.outputs[0].token_ids == ref.outputs[0].token_ids
    for got, want in zip(answer.output.outputs[0].logprobs, ref.outputs[0].logprobs):
        for token, lp in want.items():
            assert got[token] == pytest.approx(lp, abs=1e-4)
    # it computed only the question
    header = llm.engine.sessions.format.question_header
    assert answer.output.num_cached_tokens == len(s._session.state.tokens) + len(header)
    assert len(s._session.blocks) == s._session.num_blocks_held()
    s.close()
    assert_engine_idle(llm)


def test_a_sparse_question_attends_to_the_blocks_its_flow_picks(llm):
    """sparse_prefill: the question itself, not only its answer, reads the data's blocks a flow picks
    (what keeps a question's cost flat as the data grows); a budget covering the data is exact."""
    s = llm.create_session(system="Answer from the log.", retention_tokens=448)
    _feed(s, ROWS[:100])  # about 420 tokens: over NARROW_FROM budgets of 96, within max_model_len 512
    question = "Which sensor reported 74?"
    dense = s.query(question, GREEDY).output.outputs[0]
    covering = s.query(question, SamplingParams(**{**GREEDY.__dict__, "sparse": "quest", "sparse_budget": 4096,
                                                   "sparse_prefill": True})).output.outputs[0]
    assert covering.token_ids == dense.token_ids and covering.logprobs == dense.logprobs
    narrow = s.query(question, SamplingParams(**{**GREEDY.__dict__, "sparse": "quest", "sparse_budget": 96,
                                                 "sparse_prefill": True})).output.outputs[0]
    assert max(narrow.logprobs[0].values()) != pytest.approx(max(dense.logprobs[0].values()), abs=1e-4)
    assert len(s._session.blocks) == s._session.num_blocks_held() > NARROW_FROM * 96 // 16  # narrowed
    s.close()
    assert_engine_idle(llm)


def test_session_blocks_stay_out_of_the_prefix_cache(llm):
    s = llm.create_session(system="x")
    _feed(s, ROWS[:10])
    s.query("Which sensor?", GREEDY)
    assert all(b.block_hash is None for b in s._session.blocks)
    s.close()
    assert_engine_idle(llm)


def _rotate(keys: torch.Tensor, delta: int, theta: float = 10000.0) -> torch.Tensor:
    """RoPE by `delta` positions, written from the formula (rotate-half layout)."""
    dim = keys.shape[-1]
    angles = delta / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    cos, sin = torch.cat([angles.cos()] * 2), torch.cat([angles.sin()] * 2)
    half = torch.cat([-keys[..., dim // 2:], keys[..., :dim // 2]], -1)
    return (keys.double() * cos + half.double() * sin).to(keys.dtype)


def test_eviction_drops_whole_blocks_and_moves_the_rest_exactly(llm):
    """Past retention, the oldest data blocks go and the kept ones move back: their keys equal
    the unevicted session's keys rotated by the distance, their values are untouched."""
    kept_session = llm.create_session(system="Log.", retention_tokens=240)
    full_session = llm.create_session(system="Log.", retention_tokens=480)
    for session in (kept_session, full_session):  # one ingest each, then one eviction
        _feed(session, ["".join(ROWS[:14])])
    before = list(kept_session._session.state.tokens)
    assert kept_session.info()["evicted_tokens"] == 0
    for session in (kept_session, full_session):
        _feed(session, ["".join(ROWS[14:24])])
    st, full = kept_session._session.state, full_session._session.state
    assert st.evicted > 0 and st.evicted % 16 == 0 and len(st.tokens) <= 240 and full.evicted == 0
    assert st.tokens[:st.num_frozen] == full.tokens[:st.num_frozen]
    assert st.tokens[st.num_frozen:] == full.tokens[st.num_frozen + st.evicted:]
    cache, bs = llm.engine.runner.kv_cache, 16
    first, moved = st.num_frozen // bs, len(before) // bs - st.num_frozen // bs - st.evicted // bs
    assert moved > 0  # whole blocks computed before the eviction, kept
    ours = cache[:, :, [b.block_id for b in kept_session._session.blocks[first:first + moved]]]
    shift = st.evicted // bs
    theirs = cache[:, :, [b.block_id for b in full_session._session.blocks[first + shift:first + shift + moved]]]
    torch.testing.assert_close(ours[:, 1], theirs[:, 1], rtol=0, atol=1e-6)  # batches differ: float32 rounding
    torch.testing.assert_close(ours[:, 0], _rotate(theirs[:, 0], -st.evicted), rtol=1e-5, atol=1e-5)
    region0 = [b.block_id for b in kept_session._session.blocks[:first]]
    assert torch.equal(cache[:, :, region0], cache[:, :, [b.block_id for b in full_session._session.blocks[:first]]])
    kept_session.query("Which sensor?", GREEDY)  # positions continue after the kept tokens
    _close_all(llm)
    assert_engine_idle(llm)


def test_eviction_while_a_question_reads_copies_the_blocks_it_reads(llm):
    """A question still running when its session drops data keeps reading the old blocks; the
    session moves copies; every block comes back once both are done."""
    s = llm.create_session(system="Log.", retention_tokens=300)
    _feed(s, ROWS[:14])
    session = s._session
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    group = session.query("Which sensor reported 74?", params).group
    held = {b.block_id for b in group.children[0].held.blocks}
    s.append("".join(ROWS[14:30]))  # makes room for itself at once: the question has not run yet
    assert session.state.evicted > 0 and not group.finished
    data_blocks = {b.block_id for b in session.blocks[session.state.num_frozen // 16:]}
    assert data_blocks.isdisjoint(held)  # it moved copies
    outputs = llm._run([group])
    # the question read the old KV, unchanged: as if its prompt ran alone
    ref = llm.generate({"prompt_token_ids": group.children[0].prompt_token_ids}, params)[0]
    assert outputs[0].outputs[0].token_ids == ref.outputs[0].token_ids
    s.close()
    assert_engine_idle(llm)


def test_flash_questions_are_answered_after_ingest_and_kept(llm):
    events = []
    s = llm.create_session(system="Log.", flash=["Which sensor is last?"], flash_max_tokens=4)
    s._session.subscribe(events.append)
    _feed(s, ROWS[:8])
    while s._session.flash["Which sensor is last?"].running is not None:
        llm.engine.step()
    version, text = s.flash_answers()["Which sensor is last?"]
    assert version == s.version == 8 and text is not None
    assert events[-1] == {"question": "Which sensor is last?", "version": 8, "answer": text}
    steps_before = len(llm.engine.groups)
    hit = s.query("Which sensor is last?", GREEDY)
    assert hit.flash_hit and hit.text == text and hit.version == 8 and len(llm.engine.groups) == steps_before
    # the kept answer is what the question gives at that version
    prompt = _visible_prompt(llm, s, "Which sensor is last?")
    ref = llm.generate({"prompt_token_ids": prompt}, s._session.flash_params)[0]
    assert ref.outputs[0].text == text
    s.append("x")
    while s.version < 9:  # ingested; the flash question is being answered again
        llm.engine.step()
    assert s._session.flash["Which sensor is last?"].running is not None
    answer = s.query("Which sensor is last?", SamplingParams(temperature=0, max_tokens=4))
    assert not answer.flash_hit and answer.version == 9
    s.close()
    assert_engine_idle(llm)


def test_save_and_restore_are_byte_exact(llm, tmp_path):
    s = llm.create_session(system="Log.", retention_tokens=400, flash=["Which sensor?"], flash_max_tokens=3)
    _feed(s, ROWS[:30])
    s.append("t=999, sensor=")  # a pending partial block is saved too
    path = tmp_path / "s.safetensors"
    s.save(str(path))
    before = s.query("Which sensor reported 74?", GREEDY)
    kv = llm.engine.runner.kv_cache[:, :, [b.block_id for b in s._session.blocks]].clone()
    state = s._session.state
    s.close()
    restored = llm.restore_session(str(path))
    assert restored.id == s.id and restored._session.state == state
    assert torch.equal(llm.engine.runner.kv_cache[:, :, [b.block_id for b in restored._session.blocks]], kv)
    after = restored.query("Which sensor reported 74?", GREEDY)
    assert after.output.outputs[0].token_ids == before.output.outputs[0].token_ids
    assert after.output.outputs[0].logprobs == before.output.outputs[0].logprobs
    with pytest.raises(InvalidRequestError, match="already open"):
        llm.restore_session(str(path))
    restored.close()
    assert_engine_idle(llm)


def test_restore_refuses_corrupt_files_and_other_models(llm, tiny_qwen2_path, tmp_path):
    s = llm.create_session(system="Log.")
    _feed(s, ROWS[:4])
    path = tmp_path / "s.safetensors"
    s.save(str(path))
    s.close()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(path.read_bytes()[:100])
    with pytest.raises(InvalidRequestError, match="not a session file"):
        llm.restore_session(str(bad))
    with pytest.raises(InvalidRequestError, match="no saved session"):
        llm.restore_session(str(tmp_path / "missing"))
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(path), "pt") as f:
        meta = json.loads(f.metadata()["session"])
    crafted = tmp_path / "crafted.safetensors"  # an id that would name a file elsewhere when saved
    save_file(load_file(str(path)), str(crafted), metadata={"session": json.dumps({**meta, "id": "../../evil"})})
    with pytest.raises(InvalidRequestError, match="its session id"):
        llm.restore_session(str(crafted))
    other = LLM(model=str(tiny_qwen2_path), dtype="float32", num_blocks=64)
    with pytest.raises(InvalidRequestError, match="another model"):
        other.restore_session(str(path))
    assert_engine_idle(other)
    assert_engine_idle(llm)


def test_bad_input_changes_no_other_session(llm):
    other = llm.create_session(system="Other.")
    _feed(other, ROWS[:5])
    state = repr(other._session.state)
    with pytest.raises(InvalidRequestError, match="must exceed the session's instructions"):
        llm.create_session(system="A long system prompt. " * 10, retention_tokens=20)
    with pytest.raises(InvalidRequestError, match="no room for a question"):
        llm.create_session(retention_tokens=510)
    s = llm.create_session(system="Log.")
    with pytest.raises(SessionFullError):
        s.query("x " * 600, GREEDY)
    with pytest.raises(InvalidRequestError):
        s.append("")
    s.close()
    with pytest.raises(SessionClosedError):
        s.append("more")
    with pytest.raises(SessionNotFoundError):
        llm.engine.sessions.get(s.id)
    with pytest.raises(SessionNotFoundError):  # another tenant's session does not exist for you
        llm.engine.sessions.get(other.id, tenant="someone-else")
    assert repr(other._session.state) == state
    other.close()
    assert_engine_idle(llm)


def test_sessions_must_fit_in_the_pool_together(tiny_llama_path):
    """Sessions share the pool less the room of one request of the model's whole length (512
    tokens: 32 blocks here), which stays for stateless work however full the sessions are."""
    small = LLM(model=str(tiny_llama_path), dtype="float32", num_blocks=70)
    first = small.create_session(retention_tokens=480)  # 30 of the 38 blocks sessions may hold
    with pytest.raises(CacheFullError, match="your sessions may hold 8 more"):
        small.create_session(retention_tokens=480)
    longest = small.generate({"prompt_token_ids": random_prompt(500, seed=1)}, greedy(12))[0]
    assert len(longest.outputs[0].token_ids) == 12  # a whole-length request still fits beside them
    first.close()
    small.create_session(retention_tokens=480).close()
    assert_engine_idle(small)
    tight = LLM(model=str(tiny_llama_path), dtype="float32", num_blocks=40)
    with pytest.raises(CacheFullError, match="keeps 32 for one request of the model's whole length"):
        tight.create_session(retention_tokens=480)


def test_one_tenant_cannot_take_the_room_of_the_others_sessions(tiny_llama_path):
    small = LLM(model=str(tiny_llama_path), dtype="float32", num_blocks=92, session_tenant_share=0.5)
    store = small.engine.sessions
    a = [store.create(retention_tokens=320, tenant="a") for _ in range(2)]  # 40 of tenant a's 46 blocks
    with pytest.raises(CacheFullError, match="your sessions may hold 6 more"):
        store.create(retention_tokens=320, tenant="a")
    b = store.create(retention_tokens=320, tenant="b")  # another tenant still has its share
    with pytest.raises(CacheFullError, match="the sessions' share of the KV pool") as full:
        store.create(retention_tokens=320, tenant="c")  # 60 + 20 blocks > the 60 of all sessions
    assert "40" not in str(full.value)  # nothing of the other tenants' use is told
    for session in [*a, b]:
        store.close(session.id, tenant=session.tenant)
    assert_engine_idle(small)


def test_questions_come_before_ingest(llm, monkeypatch):
    """Background ingest runs only in steps no other request needs, a chunk at a time: a question
    arriving during an ingest is scheduled at the next step, alone."""
    engine, batches = llm.engine, []
    execute = engine.runner.execute
    monkeypatch.setattr(engine.runner, "execute",
                        lambda batch, stop=None: batches.append(batch) or execute(batch, stop))
    s = llm.create_session(system="Log.", retention_tokens=480)
    s.append("".join(ROWS[:30]))
    engine.step()  # the instructions
    engine.step()
    assert [item.request.priority for item in batches[-1]] == [Priority.INGEST]
    group = s._session.query("Which sensor?", GREEDY).group
    while not group.finished:
        engine.step()
        assert [item.request.priority for item in batches[-1]] == [Priority.SESSION]
    s.wait()
    assert [item.request.priority for item in batches[-1]] == [Priority.INGEST]
    chunks = [item.num_tokens for batch in batches for item in batch if item.request.priority == Priority.INGEST]
    assert max(chunks) == engine.config.background_chunk_tokens and len(chunks) > 2
    s.close()
    assert_engine_idle(llm)


def test_an_arrival_stops_a_background_step_between_layers(llm):
    """A step of ingest alone stops between two layers once `interrupt()` is true (another thread's
    request has arrived), changing nothing: the chunk is computed again later, and the session ends
    as one fed without stops. A chunk stopped MAX_STOPS_IN_A_ROW times runs to its end at the next
    try, and a step with other work never stops."""
    engine, question = llm.engine, "Which sensor reported 74?"
    pace = engine.scheduler.background
    reference = llm.create_session(system="Answer from the log.")
    _feed(reference, ROWS[:12])
    want = reference.query(question, GREEDY).output.outputs[0]
    reference.close()

    s = llm.create_session(system="Answer from the log.")
    s.append("".join(ROWS[:12]))
    ingest, asked, stops = s._session._ingest.children[0], [], pace.num_stopped
    after_one_layer = lambda: asked.append(1) or len(asked) > 1  # noqa: E731
    for tries in range(pace.MAX_STOPS_IN_A_ROW):
        computed, asked[:] = ingest.num_computed_tokens, []
        assert engine.step(interrupt=after_one_layer) == [] and len(asked) == 2  # after one layer
        assert ingest.num_computed_tokens == computed and pace.num_stopped == stops + tries + 1
    engine.step(interrupt=lambda: True)  # the third try runs to its end
    assert ingest.num_computed_tokens > computed and pace.num_stopped == stops + pace.MAX_STOPS_IN_A_ROW
    while not s._session.caught_up():
        engine.step(interrupt=lambda: True)  # each chunk stopped twice, then run
    assert pace.num_stopped > stops + pace.MAX_STOPS_IN_A_ROW

    group = s._session.query(question, GREEDY).group
    while not group.finished:  # a question's steps never stop
        engine.step(interrupt=lambda: True)
    got = group.to_output().outputs[0]
    assert got.token_ids == want.token_ids
    for lp_got, lp_want in zip(got.logprobs, want.logprobs):
        assert lp_got == pytest.approx(lp_want, abs=1e-5)
    s.close()
    assert_engine_idle(llm)


def test_background_chunks_shrink_when_stopped_and_grow_back_when_run():
    """Chunks halve at each stop, down to one block, to fit between arrivals; double at each chunk
    run to its end, up to the configured size; after MAX_STOPS_IN_A_ROW stops, one runs regardless."""
    pace = BackgroundPace(max_tokens=64, min_tokens=16)
    assert (pace.tokens, pace.stoppable) == (64, True)
    pace.stopped()
    assert (pace.tokens, pace.stoppable) == (32, True)
    pace.stopped()
    assert (pace.tokens, pace.stoppable) == (16, False)
    pace.ran()
    assert (pace.tokens, pace.stoppable, pace.num_stopped) == (32, True, 2)
    pace.ran(), pace.ran()
    assert pace.tokens == 64
    assert BackgroundPace(max_tokens=8, min_tokens=16).tokens == 8  # a chunk below one block stays as set
    for _ in range(5):
        pace.stopped()
    assert pace.tokens == 16


def test_cli_streams_a_csv_into_a_session(tiny_llama_path, tmp_path, capsys):
    from spanserve.cli import main

    table = tmp_path / "feed.csv"
    table.write_text("time,sensor,value\n" + "".join(f"{i},{'ABC'[i % 3]},{i * 7 % 13}\n" for i in range(30)))
    main(["session", str(table), "--model", str(tiny_llama_path), "--dtype", "float32", "--num-blocks", "128",
          "--question", "Which sensor is last?", "--flash", "What is the last value?", "--every", "10",
          "--rows-per-append", "4", "--max-tokens", "3", "--temperature", "0", "--exit-answers", "UP,DOWN"])
    out = capsys.readouterr().out
    assert out.count("Which sensor is last?") == 4  # after 10, 20 and 30 rows, and at the end (31 lines)
    assert "[10 rows, v3]" in out and "[flash v" in out and "31 rows:" in out


def test_an_append_past_the_backlog_is_refused(llm, monkeypatch):
    """Data that can never fit the backlog (4 x retention_tokens) says so; data that fits once the
    backlog is computed says to retry; data too long by its length alone is refused untokenized."""
    s = llm.create_session(system="Log.", retention_tokens=200)
    before = s.info()
    with pytest.raises(CacheFullError, match="can never fit .* backlog of 800 tokens"):
        s._session.append_tokens(list(range(100, 100 + 801)))
    assert s.info() == before  # nothing queued
    s._session.append_tokens(list(range(100, 600)))
    with pytest.raises(CacheFullError, match="retry once they are computed"):
        s._session.append_tokens(list(range(100, 500)))
    monkeypatch.setattr(llm.engine.sessions.format, "data", lambda text: pytest.fail("tokenized"))
    with pytest.raises(CacheFullError, match="data of at least .* can never fit"):
        s.append("x" * 10_000_000)
    s.close()
    assert_engine_idle(llm)


# ---- ready-position speculative exit (sessions/ready.py) ------------------------------------


def _assessment(llm, session):
    """The stateless reference of the ready position: the data, then the answer opened, one greedy
    token with its two best logprobs."""
    st = session._session.state
    prompt = st.tokens + llm.engine.sessions.format.answer_opening
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1, logprobs=2))[0]
    top = sorted(out.outputs[0].logprobs[0].values(), reverse=True)
    return out.outputs[0].text.strip(), top[0] - top[1]


def test_ready_exit_answers_from_the_data_alone_when_confident(llm):
    """After each ingest the session assesses its data with no question (as a stateless run of the
    same tokens does); a question is then answered with that token, with no forward pass, when it is
    one of the fast answers and leads by more than the threshold; otherwise it is computed."""
    probe = llm.create_session(system="Log.")
    _feed(probe, ROWS[:12])
    token, gap = _assessment(llm, probe)
    probe.close()
    assert token and gap > 0  # (the tiny model's top token here is a word, not spaces)
    for threshold, answers, exits in [(gap - 1e-3, [token, "OK"], True), (gap + 1e-3, [token], False),
                                      (0.0, ["not-" + token], False)]:
        s = llm.create_session(system="Log.", exit_answers=answers, exit_threshold=threshold)
        _feed(s, ROWS[:12])
        ready = s._session.ready_exit
        assert (ready.version, ready.token) == (s.version, token) and ready.gap == pytest.approx(gap, abs=1e-4)
        answer = s.query("Any alert?", GREEDY)
        assert answer.speculative == exits and answer.version == s.version
        if exits:
            assert answer.text == token and answer.output is None and not llm.engine.has_unfinished_requests()
        else:
            assert answer.output is not None and not answer.flash_hit
        s.append(ROWS[12])  # a new version: assessed again before a question may exit on it
        while s.version < s._session.state.version:  # until questions see it
            llm.engine.step()
        assert s.query("Any alert?", GREEDY).speculative is False  # (the new version's assessment is running)
        s.wait()
        assert s._session.ready_exit.version == s.version
        s.close()
    assert_engine_idle(llm)


def test_ready_exit_survives_save_and_restore(llm, tmp_path):
    s = llm.create_session(system="Log.", exit_answers=["A", "B"], exit_threshold=0.5)
    _feed(s, ROWS[:6])
    kept = s.info()["ready_exit"]
    path = tmp_path / "ready.safetensors"
    s.save(str(path))
    s.close()
    restored = llm.restore_session(str(path))
    assert restored.info()["ready_exit"] == kept and kept["version"] == restored.version
    restored.close()
    assert_engine_idle(llm)


@pytest.mark.parametrize("answers, threshold", [("Yes", 2.0), ([""], 2.0), (["Yes", 3], 2.0), (["Yes"], -1.0),
                                                (["Yes"], "2"), (["Yes"], True), (["Yes"], float("nan"))])
def test_bad_ready_exit_settings_are_refused(llm, answers, threshold):
    with pytest.raises(InvalidRequestError, match="exit_"):
        llm.create_session(system="Log.", exit_answers=answers, exit_threshold=threshold)
    assert not llm.engine.sessions.sessions


def test_a_full_pool_delays_the_sessions_own_questions(llm, monkeypatch):
    """A flash question or ready position the pool has no room for is asked again after the next
    step, rather than failing the step that found the pool full."""
    s = llm.create_session(system="Log.", flash=["Which sensor?"], flash_max_tokens=2, exit_answers=["UP"])
    refused, ask = [], s._session._ask

    def full_at_first(suffix, params, priority, request_id=None, after_header=True):
        if len(refused) < 2:
            refused.append(after_header)
            raise CacheFullError("the KV pool is full")
        return ask(suffix, params, priority, request_id, after_header)

    monkeypatch.setattr(s._session, "_ask", full_at_first)
    _feed(s, ROWS[:4])
    # refused twice, the ready position at least (the flash question may be running since the start)
    assert len(refused) == 2 and False in refused
    assert s.flash_answers()["Which sensor?"][0] == s.version == s._session.ready_exit.version
    s.close()
    assert_engine_idle(llm)
