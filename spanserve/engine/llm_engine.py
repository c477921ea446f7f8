"""LLMEngine: the synchronous core. add_request() -> step() ... -> RequestOutputs."""

import gc
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from spanserve.attention import get_backend
from spanserve.comb.plugin import find_plugin
from spanserve.config import EngineConfig
from spanserve.engine import text_bound
from spanserve.engine.detokenizer import IncrementalDetokenizer
from spanserve.engine.request import HeldContext, Priority, Request, RequestOwner
from spanserve.engine.runner import ModelRunner
from spanserve.engine.sampler import Sample
from spanserve.engine.scheduler import ScheduledRequest, Scheduler
from spanserve.engine.step_times import ModelClock, StepTimes, step_kind
from spanserve.errors import (
    AdmissionTimeoutError,
    CacheFullError,
    EmptyPromptError,
    InvalidRequestError,
    InvalidSpanError,
    InvalidSparseError,
    PluginNotLoadedError,
    PromptTooLongError,
    RequestFailedError,
)
from spanserve.kv.hashing import extend_block_hashes
from spanserve.kv.manager import KVCacheManager
from spanserve.models import gguf_blocks, layout, quant
from spanserve.models.config import ModelConfig
from spanserve.models.fused_layers import FusedLayers
from spanserve.models.loader import load_model, load_tokenizer, resolve_model
from spanserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from spanserve.pic.layout import Anchor, PromptLayout, validate_spans
from spanserve.pic.link import AUTO_FOCUS_TOKENS, FOCUSABLE, LinkPolicy
from spanserve.pic.prompt import chat_parts, is_parts_prompt, tokenize_parts
from spanserve.pic.span_tokens import SpanTokens
from spanserve.sampling import SamplingParams
from spanserve.sessions.store import SessionStore
from spanserve.sparse.decode import SparseDecode, load_flows
from spanserve.speculative.config import SpeculativeConfig
from spanserve.speculative.draft_model import DraftModel, check_room, weight_bytes
from spanserve.speculative.speculator import Speculator
from spanserve.structured.grammars import Grammars

log = logging.getLogger(__name__)

# A string, a list of str / Span parts, or a dict: {"prompt": str or parts} or
# {"prompt_token_ids": [...], "spans": [[start, end], ...]}, either with an optional "cache_salt".
PromptInput = str | list | dict


SPAN_COPY_FREE_FRACTION = 0.1  # span key copies only while they leave this much of the pool free

_NO_COMB = ("link_policy 'comb' needs a COMB encoder plug-in trained for this model: none ships for it and "
            "none was given (train one with `spanserve train comb --model M`, load it with --comb-plugin FILE)")


@dataclass
class TokenizedPrompt:
    text: str | None
    token_ids: list[int]
    spans: list[tuple[int, int]] = field(default_factory=list)
    cache_salt: str | None = None


@dataclass
class RequestGroup:
    """The n sequences one user request asked for (n > 1 shares the prompt's blocks)."""

    request_id: str
    prompt: str | None
    children: list[Request]
    detokenizers: list[IncrementalDetokenizer]
    arrival_time: float = field(default_factory=time.monotonic)

    @property
    def finished(self) -> bool:
        return all(r.is_finished for r in self.children)

    def to_output(self) -> RequestOutput:
        first = self.children[0]
        outputs = [_completion(i, r, d) for i, (r, d) in enumerate(zip(self.children, self.detokenizers))]
        first_times = [r.first_token_time for r in self.children if r.first_token_time]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=outputs,
            finished=self.finished,
            num_cached_tokens=first.num_cached_tokens or 0,
            metrics=RequestMetrics(
                arrival_time=self.arrival_time,
                first_token_time=min(first_times) if first_times else None,
                finish_time=max(r.finish_time for r in self.children) if self.finished else None,
            ),
        )


def _token_ids_in(token_ids, vocab: int) -> bool:
    """Every id a Python int (not a bool) in [0, vocab), checked in C passes rather than a
    Python loop: a RAG prompt holds ~100k of them."""
    return not token_ids or (set(map(type, token_ids)) == {int} and min(token_ids) >= 0 and max(token_ids) < vocab)


def _completion(index: int, req: Request, detok: IncrementalDetokenizer) -> CompletionOutput:
    logprobs = None
    if req.params.logprobs is not None:
        logprobs = req.logprobs
    return CompletionOutput(
        index=index, text=detok.text, token_ids=req.output_token_ids,
        cumulative_logprob=sum(lp[t] for lp, t in zip(req.logprobs, req.output_token_ids)) if logprobs else None,
        logprobs=logprobs, finish_reason=req.finish_reason, stop_reason=req.stop_reason,
    )


def _freeze_heap() -> None:
    """Move what lives now (imports, model, tokenizer) out of the garbage collector's passes,
    which otherwise walk it all: a full pass over SmolLM2's engine took 124 ms, and such passes
    come between steps. Engines dropped since the last build are collected first (the engine's
    objects form cycles: frozen, a dropped one would stay); one dropped later is freed at the next
    build or at exit."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.sparse_flows = load_flows(config.sparse_flows)  # by name, built-ins and the user's: before the model
        torch.manual_seed(config.seed)
        path = resolve_model(config.model, weights=config.load_format != "dummy")
        self.model_path = path
        self.model_config = cfg = ModelConfig.from_dir(path)
        self.max_model_len = self._max_model_len(cfg)
        self.device, self.dtype = config.torch_device(), config.torch_dtype()
        self.kv_dtype = config.torch_kv_cache_dtype()
        if config.quantization:
            quant.check(config.quantization, self.device, self.dtype)
        self.tokenizer = load_tokenizer(path)
        self.span_tokens = SpanTokens(self.tokenizer)  # documents come again: tokenized once
        self.grammars = Grammars(self.tokenizer, cfg.vocab_size)  # structured outputs: compiled as asked
        model = load_model(path, self.dtype, self.device, get_backend(config.attention_backend, self.device),
                           max_positions=self.max_model_len, random_weights=config.load_format == "dummy")
        self.gguf_block_projections = 0  # projections computed from a GGUF's own blocks
        if config.quantization:
            quant.quantize(model, config.quantization)
        elif config.gguf_blocks and self.device.type == "cpu" and config.load_format != "dummy":
            int8 = config.gguf_block_activations == "int8"
            self.gguf_block_projections = gguf_blocks.keep_blocks(model, path, int8_activations=int8)
            model.fused_layers = FusedLayers.of(model)  # a step's layers in one C call
        if layout.wants_input_major(self.dtype, self.device):
            layout.store_weights(model, input_major=True)  # after quantize, which leaves no float32 Linear
        # bf16 on CPU: the most rows a projection runs in the C GEMM (calibrated), None otherwise
        self.bf16_gemm_rows = layout.pack_projections(model) if layout.wants_packing(self.dtype, self.device) else None
        num_blocks = config.num_blocks or self._blocks_for_budget(cfg)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.background_chunk_tokens)
        self.failed: dict[str, Exception] = {}  # request id -> why the engine ended it (take_failed)
        self.step_times = StepTimes()  # per kind of step: steps, tokens, seconds, the model's part
        clock = ModelClock()  # the target's forward passes and a draft model's
        spec = SpeculativeConfig.of(config.speculative_config)
        self.speculator = Speculator(spec, self._draft_model(spec, model, clock)) if spec else None  # drafts
        graph_batch = 0 if config.enforce_eager or self.device.type != "cuda" else config.max_num_seqs
        self.runner = ModelRunner(model, num_blocks, config.block_size, self.kv_dtype, self.device,
                                  graph_batch=graph_batch, max_model_len=self.max_model_len,
                                  block_generation=self.kv.pool.generation,
                                  graph_query=1 + (spec.num_speculative_tokens if spec is not None else 0),
                                  model_clock=clock)
        self.comb = find_plugin(model, config.comb_plugin)  # span encoder for link_policy="comb"
        if self.comb:
            self.runner.use_encoder(self.comb)
            # Hashed here, on the thread that steps the model: a request's first use on a server's
            # event loop would start a second OpenMP team there (async_engine.py).
            _ = self.comb.signature
        elif config.link_policy == "comb":
            raise PluginNotLoadedError(_NO_COMB)
        auto = "comb" if self.comb else "none"
        self.default_link = auto if config.link_policy == "auto" else config.link_policy
        configured = config.focus_spans or config.focus_tokens
        self.auto_focus = AUTO_FOCUS_TOKENS if config.link_policy == "auto" and not configured else 0
        self.eos_token_ids = sorted(set(cfg.eos_token_ids) | {self.tokenizer.eos_token_id} - {None})
        self.pad_token_id = self._span_pad_token()
        self.anchor = self._make_anchor() if config.span_anchor else None
        if self.anchor and self.kv.pool.num_blocks >= 64:  # small pools pin it only when needed
            self._materialize_anchor()
        self.derived: dict = {}  # what front ends build once from the tokenizer (a chat format)
        self.sessions = SessionStore(self)  # streaming sessions (sessions/), served between steps
        self.groups: dict[str, RequestGroup] = {}
        # Told of each request as it ends, its blocks still held (on the engine's thread): an
        # observer such as the server's cache inspector. One that raises is logged, never fatal.
        self.end_watchers: list[Callable[[Request], None]] = []
        self._ids = itertools.count()
        _freeze_heap()
        log.info("engine ready: %s, %s on %s, %d KV blocks of %d tokens, max_model_len %d, span link policy %s",
                 path.name, self.dtype, self.device, num_blocks, config.block_size, self.max_model_len,
                 self.default_link + (f"+focus{self.auto_focus}t" if self.auto_focus else ""))

    def _make_anchor(self) -> Anchor | None:
        """The span anchor: a short system message as the chat template renders it (or the
        BOS), padded to whole blocks. Its KV is computed when a request first needs it."""
        tok = self.tokenizer
        if tok.chat_template:
            text = tok.apply_chat_template([{"role": "system", "content": "You are a helpful assistant."}],
                                           tokenize=False)
            tokens = tok.encode(text, add_special_tokens=False)
        else:
            tokens = tok.encode("", add_special_tokens=True)
        bs = self.config.block_size
        tokens += [self.pad_token_id] * (-len(tokens) % bs)
        if not tokens or len(tokens) // bs * 4 > self.kv.pool.num_blocks:  # a pool too small to spare it
            return None
        self.anchor_tokens, self._anchor_hashes = tokens, []
        extend_block_hashes(self._anchor_hashes, tokens, bs, None)
        return Anchor(len(tokens), self._anchor_hashes[-1])

    def _materialize_anchor(self) -> None:
        """Pin the anchor's blocks and compute its KV, once, before the first request needing it."""
        if self.kv.anchor_blocks:
            return
        needed = self.anchor.num_tokens // self.config.block_size
        if needed > self.kv.pool.num_free:
            raise CacheFullError("the KV pool is full: no room yet for the span anchor; retry shortly")
        blocks = self.kv.pin(needed)
        self.runner.prefill_pinned(self.anchor_tokens, [b.block_id for b in blocks])
        # Published too: a prompt that starts with the anchor (an inner call of a span query) hits it.
        for block, block_hash in zip(blocks, self._anchor_hashes):
            self.kv.pool.cache(block, block_hash)

    def _span_pad_token(self) -> int:
        """Pads spans to whole blocks: a newline where it is one token (it reads as a blank
        line between documents), else the tokenizer's pad token, else EOS."""
        newline = self.tokenizer.encode("\n", add_special_tokens=False)
        if len(newline) == 1:
            return newline[0]
        return self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_token_ids[0]

    def _draft_model(self, spec: SpeculativeConfig, target, clock: ModelClock) -> DraftModel | None:
        """The draft model's engine (method draft_model): the target's device, dtype and length."""
        if spec.method != "draft_model":
            return None
        path = resolve_model(spec.model)
        check_room(path, torch.finfo(self.dtype).bits // 8, self.device.type)
        c = self.config
        engine = LLMEngine(EngineConfig(model=str(path), dtype=str(self.dtype)[6:], device=self.device.type,
                                        max_model_len=self.max_model_len, kv_cache_memory_gb=c.kv_cache_memory_gb / 2,
                                        max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens,
                                        link_policy="none", span_anchor=False, quantization=c.quantization))
        engine.runner.model_clock = clock  # its passes are model time of the target's steps
        return DraftModel(engine, self.tokenizer, weight_bytes(engine.runner.model) / weight_bytes(target))

    def _max_model_len(self, cfg: ModelConfig) -> int:
        limit = cfg.max_position_embeddings
        if self.config.max_model_len and self.config.max_model_len > limit:
            raise InvalidRequestError(f"max_model_len {self.config.max_model_len} exceeds the model's {limit}")
        return self.config.max_model_len or limit

    def _blocks_for_budget(self, cfg: ModelConfig) -> int:
        bytes_per_block = (2 * cfg.num_layers * self.config.block_size * cfg.num_kv_heads
                           * cfg.head_dim * torch.finfo(self.kv_dtype).bits // 8)
        return max(1, int(self.config.kv_cache_memory_gb * (1 << 30)) // bytes_per_block)

    # ---- requests in -------------------------------------------------------------------

    def tokenize(self, prompt: PromptInput) -> TokenizedPrompt:
        """Token ids, span intervals and cache salt of a prompt in any accepted form."""
        if isinstance(prompt, str):
            text_bound.refuse_beyond(len(prompt), self.max_model_len - 1, self.tokenizer)
            return TokenizedPrompt(prompt, self.tokenizer.encode(prompt))
        if is_parts_prompt(prompt):
            return TokenizedPrompt(None, *self._tokenize_parts(prompt))
        if isinstance(prompt, dict) and ("prompt" in prompt) != ("prompt_token_ids" in prompt):
            salt = prompt.get("cache_salt")
            if salt is not None and not isinstance(salt, str):
                raise InvalidRequestError("cache_salt must be a string")
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)):
                    raise InvalidRequestError("prompt_token_ids must be a list of integers")
                spans = validate_spans(prompt.get("spans") or [], len(ids), self.config.block_size)
                return TokenizedPrompt(None, list(ids), spans, salt)
            if "spans" in prompt:
                raise InvalidSpanError("spans go with prompt_token_ids; mark text spans with Span parts")
            inner = self.tokenize(prompt["prompt"])
            return TokenizedPrompt(inner.text, inner.token_ids, inner.spans, salt)
        raise InvalidRequestError(
            "a prompt is a string, a list of str/Span parts, {'prompt': ...} or {'prompt_token_ids': [int, ...]}")

    def _tokenize_parts(self, parts, add_special_tokens: bool = True) -> tuple[list[int], list[tuple[int, int]]]:
        chars = sum(len(getattr(part, "text", part)) for part in parts if isinstance(getattr(part, "text", part), str))
        text_bound.refuse_beyond(chars, self.max_model_len - 1, self.tokenizer)
        return tokenize_parts(self.tokenizer, parts, self.config.block_size, self.pad_token_id, add_special_tokens,
                              self.span_tokens)

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> dict:
        """A conversation as a token prompt; message contents may hold spans (pic/prompt.py).
        `tools`: for a chat template that renders them (spanserve/tools/ decides)."""
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise InvalidRequestError("each chat message must be a dict with 'role' and 'content'")
        text_bound.refuse_beyond(sum(map(_content_chars, messages)), self.max_model_len - 1, self.tokenizer)
        ids, spans = self._tokenize_parts(chat_parts(self.tokenizer, messages, tools), add_special_tokens=False)
        return {"prompt_token_ids": ids, "spans": spans}

    def link_policy(self, params: SamplingParams) -> LinkPolicy:
        """The request's link policy, each unset field taken from the engine's defaults."""
        gap = params.gap_length if params.gap_length is not None else self.config.gap_length
        ratio = params.blend_ratio if params.blend_ratio is not None else self.config.blend_ratio
        name = params.link_policy or self.default_link
        if name == "comb" and self.comb is None:
            raise PluginNotLoadedError(_NO_COMB)
        rest = {f: getattr(params, f) if getattr(params, f) is not None else getattr(self.config, f)
                for f in ("blend_layers", "ape_temperature", "ape_scale")}
        sizes = ("focus_spans", "focus_tokens")
        if any(getattr(params, f) is not None for f in sizes):  # a request's own sizes the pick (checked)
            focus = {f: getattr(params, f) or 0 for f in sizes}
        elif params.link_policy is None and self.auto_focus:  # the auto default: comb or none, with focus
            focus = {"focus_spans": 0, "focus_tokens": self.auto_focus}
        else:  # the engine's default goes to the policies it applies to
            focus = {f: getattr(self.config, f) if name in FOCUSABLE else 0 for f in sizes}
        return LinkPolicy(name, gap, ratio, plugin=self.comb.signature if name == "comb" else "",
                          **focus, **rest)

    def make_group(self, prompt: PromptInput, params: SamplingParams, request_id: str | None = None, *,
                   priority: Priority = Priority.STATELESS, held: HeldContext | None = None,
                   prefill_only: bool = False, owner: RequestOwner | None = None,
                   tenant: str | None = None) -> RequestGroup:
        """Validate and tokenize a request without touching engine state (any thread). `tenant`:
        whose work it is (a server's API key), for the scheduler's shares; the other keywords are
        for extensions that run their own requests (sessions/): see Request."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("sampling_params must be a SamplingParams")
        tp = self.tokenize(prompt)
        token_ids = tp.token_ids
        link = self.link_policy(params)
        anchored = self.anchor is not None and link.uses_spans and any(start > 0 for start, _ in tp.spans)
        # a layout each: a selecting link policy changes it
        layouts = [PromptLayout(len(token_ids), tp.spans, link, self.config.block_size, self.anchor)
                   for _ in range(params.n)]
        anchor_blocks = self.anchor.num_tokens // self.config.block_size if anchored else 0
        self._validate_tokens(token_ids, params, anchor_blocks, layouts[0].probe_blocks(),
                              checked=held.num_tokens if held else 0)
        request_id = request_id or f"req-{next(self._ids)}"
        flow = self._sparse_flow(params)
        children = []
        for i in range(params.n):
            child_params = params
            if params.n > 1 and params.seed is not None:  # distinct yet reproducible samples
                child_params = SamplingParams(**{**params.__dict__, "seed": params.seed + i})
            children.append(Request(
                request_id=f"{request_id}-{i}" if params.n > 1 else request_id,
                group_id=request_id, index=i, layout=layouts[i],
                prompt_token_ids=token_ids, params=child_params, eos_token_ids=self.eos_token_ids,
                cache_salt=tp.cache_salt, max_total_tokens=self.max_model_len,
                wait_for=children[0] if children and self.config.enable_prefix_caching else None,
                priority=priority, held=held, prefill_only=prefill_only, owner=owner, tenant=tenant,
                sparse=SparseDecode(flow, params.sparse_budget, self.config.block_size, params.sparse_prefill)
                if flow else None,
                constraint=self.grammars.constraint(params.structured_outputs) if params.structured_outputs else None,
            ))
        detoks = [IncrementalDetokenizer(self.tokenizer, token_ids, r.params) for r in children]
        return RequestGroup(request_id, tp.text, children, detoks)

    def _sparse_flow(self, params: SamplingParams):
        if params.sparse is None:
            return None
        flow = self.sparse_flows.get(params.sparse)
        if flow is None:
            raise InvalidSparseError(f"unknown sparse flow {params.sparse!r}; available: "
                                      f"{', '.join(sorted(self.sparse_flows))}")
        flow.check_budget(params.sparse_budget, self.config.block_size)
        return flow

    def _validate_tokens(self, token_ids: list[int], params: SamplingParams, reserved_blocks: int = 0,
                         probe_blocks: int = 0, checked: int = 0) -> None:
        """A clear error now for a request that could never run; `reserved_blocks` are pinned for
        good, `probe_blocks` the request holds beside its own until its link probe (pic/layout.py).
        The first `checked` tokens are known good (a session's data, held: a question costs what
        its own tokens do, not a pass over the data)."""
        if not token_ids:
            raise EmptyPromptError()
        vocab = self.model_config.vocab_size
        if not _token_ids_in(token_ids[checked:], vocab):
            raise InvalidRequestError(f"prompt_token_ids must be integers in [0, {vocab})")
        if not _token_ids_in(params.stop_token_ids, vocab):
            raise InvalidRequestError(f"stop_token_ids must be integers in [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise PromptTooLongError(len(token_ids), self.max_model_len)
        needed = self.kv.blocks_needed(min(len(token_ids) + params.max_tokens, self.max_model_len)) + probe_blocks
        usable = self.kv.pool.num_blocks - reserved_blocks
        if needed > usable:
            probe = f" (of which {probe_blocks} for its link policy's probe)" if probe_blocks else ""
            raise CacheFullError(
                f"request needs {needed} KV blocks{probe} but the pool has {usable}; "
                f"lower max_tokens or raise num_blocks / kv_cache_memory_gb")

    def add_group(self, group: RequestGroup) -> None:
        if group.request_id in self.groups:
            raise InvalidRequestError(f"request id {group.request_id!r} is already running")
        if any(s.offset for s in group.children[0].layout.spans):
            self._materialize_anchor()
        self.groups[group.request_id] = group
        for req in group.children:
            self.scheduler.add(req)

    def add_request(self, prompt: PromptInput, params: SamplingParams,
                    request_id: str | None = None) -> str:
        group = self.make_group(prompt, params, request_id)
        self.add_group(group)
        return group.request_id

    def abort_request(self, request_id: str) -> None:
        group = self.groups.pop(request_id, None)
        failures = []
        for req in group.children if group else []:
            if not req.is_finished:
                req.finish("abort")
                try:
                    self._release(req)
                except Exception as exc:  # noqa: BLE001 - an owner's hook: release the others, then raise
                    failures.append(exc)
        if failures:
            raise failures[0]

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    # ---- one step ----------------------------------------------------------------------

    def step(self, interrupt: Callable[[], bool] | None = None) -> list[RequestOutput]:
        """Schedule, run the model once, and return the outputs of requests that advanced.

        `interrupt()`: whether work has arrived that this step cannot see (another thread's new
        requests). A step of background work alone then stops between two layers and changes
        nothing, so that the newcomer waits for one layer rather than a whole chunk; the chunk
        runs again later (scheduler.BackgroundPace paces the chunks and bounds the stops)."""
        start, model_start = time.perf_counter(), self.runner.model_clock.seconds
        self._expire_waiting()
        self._select_links()
        if self.speculator is not None:
            self.speculator.draft(self.scheduler.running)
        batch = self.scheduler.schedule()
        if self.speculator is not None:
            self.speculator.fit(batch)
        if not batch:
            return []
        prefilling = [item.request for item in batch if item.request.is_prefilling]
        try:
            return self._run(batch, prefilling, interrupt)
        finally:
            kind = step_kind(len(batch) - len(prefilling), len(prefilling))
            self.step_times.add(kind, sum(item.num_tokens for item in batch), time.perf_counter() - start,
                                self.runner.model_clock.seconds - model_start)

    def _run(self, batch: list[ScheduledRequest], prefilling: list[Request], interrupt: Callable[[], bool] | None
             ) -> list[RequestOutput]:
        """Run a scheduled batch and take in its tokens (step)."""
        sampled = [item for item in batch if item.samples]
        pace = self.scheduler.background
        background = all(item.request.priority == Priority.INGEST for item in batch)
        samples = self.runner.execute(batch, interrupt if background and pace.stoppable else None)
        if samples is None:
            pace.stopped()
            return []
        if background:
            pace.ran()
        if self.speculator is not None:
            self.speculator.withdraw(batch)
        self.scheduler.after_step(batch)
        touched: dict[str, RequestGroup] = {}
        for item, tokens in zip(sampled, samples):
            req = item.request
            if (group := self.groups.get(req.group_id)) is not None and self._isolated(
                    req, self._append_all, req, tokens, group.detokenizers[req.index], item.drafts):
                touched[group.request_id] = group
        for req in prefilling:
            if req.is_prefilling or req.is_finished or req.group_id not in self.groups:
                continue
            if req.prefill_only:  # its KV was the point (an ingest): done
                req.finish("length")
                if self._isolated(req, self._release, req):
                    touched[req.group_id] = self.groups[req.group_id]
            else:  # it decodes from the next step on
                self._isolated(req, self._settle_span_keys, req)
        outputs = []
        for group in touched.values():
            if group.request_id not in self.groups:  # ended by a failure of its own meanwhile
                continue
            outputs.append(group.to_output())
            if group.finished:
                del self.groups[group.request_id]
        self.sessions.service()
        return outputs

    def _isolated(self, req: Request, work: Callable, *args) -> bool:
        """Run one request's own part of a step (its sampled token, its stop check, its owner's
        hook). If that raises, the request ends with the error for its caller (take_failed) and
        the step goes on for the others; False then."""
        try:
            work(*args)
            return True
        except Exception as exc:  # noqa: BLE001 - its failure is its own, whatever it is
            log.exception("request %s failed in its step; it is ended, the others go on", req.group_id)
            self.failed[req.group_id] = RequestFailedError(f"request {req.group_id} failed: {type(exc).__name__}: "
                                                           f"{exc}")
            self._end(req.group_id)
            return False

    def _end(self, request_id: str) -> None:
        """Abort a request the engine ends itself; an owner's hook that raises meanwhile is logged
        (the blocks are freed all the same), never the step's failure."""
        try:
            self.abort_request(request_id)
        except Exception:  # noqa: BLE001
            log.exception("request %s: its owner's hook failed as it was ended", request_id)
            self.groups.pop(request_id, None)

    def _expire_waiting(self) -> None:
        """End the requests that found no room to start within admission_timeout_s (the pool held
        by others), with AdmissionTimeoutError for their callers (take_failed)."""
        timeout = self.config.admission_timeout_s
        if timeout is None:
            return
        for req in self.scheduler.never_admitted(time.monotonic() - timeout):
            group = self.groups.get(req.group_id)
            if group is None or req.group_id in self.failed:
                continue
            blocks = self.kv.blocks_needed(req.num_tokens)
            self.failed[req.group_id] = AdmissionTimeoutError(
                f"no room to start this request within {timeout:g} s: it needs {blocks} KV blocks, and running "
                f"requests and sessions hold {self.kv.pool.num_blocks - self.kv.pool.num_free} of "
                f"{self.kv.pool.num_blocks}; retry later")
            self._end(req.group_id)

    def take_failed(self) -> dict[str, Exception]:
        """The requests the engine ended since the last call, by id, with the error for their caller."""
        failed, self.failed = self.failed, {}
        return failed

    def _settle_span_keys(self, req: Request) -> None:
        """A request whose prompt is computed decodes over its moved span keys at every step: give it
        private copies of the blocks holding them, rotated once (counted in the pool like any block).
        If the pool is short, the keys stay shared and are rotated at each step as before."""
        layout = req.layout
        deltas = layout.key_deltas()
        if not self.config.span_key_copies or deltas is None or layout.first_shifted_key() >= len(deltas):
            return
        bs = self.config.block_size
        indices = list(range(layout.first_shifted_key() // bs, -(-len(deltas) // bs)))
        if self.kv.pool.num_free - len(indices) < SPAN_COPY_FREE_FRACTION * self.kv.pool.num_blocks:
            return  # memory is short: sharing the blocks matters more than the rotation saved
        copies = self.kv.privatize(req, indices)
        if copies is not None:
            self.runner.settle_keys(layout, [b.block_id for b in req.block_table], copies)

    def _select_links(self) -> None:
        """CacheBlend (link_policy="blend") or a focus probe (focus_spans, focus_tokens): once a request's spans
        and the text before them are in the cache, probe which span tokens to recompute in
        context, and relink its blocks."""
        for req in self.scheduler.running:
            layout = req.layout
            if not (layout.awaiting_selection and req.num_computed_tokens >= layout.spans[0].start
                    and all(d >= s.sub_end for d, s in zip(req.span_done, layout.spans))):
                continue
            if layout.link.focuses:
                chosen = self.runner.focus_select(req, layout.link)
            else:
                counts = layout.link.blend_counts(int(layout.independent.sum()), self.runner.max_blend_checks)
                chosen = self.runner.blend_select(req, counts)
            self.runner.copy_blocks(self.kv.relink(req, chosen))

    def _append_all(self, req: Request, samples: list[Sample], detok: IncrementalDetokenizer, drafted: int) -> None:
        """Append a step's tokens to a request (more than one where the target accepted drafts)
        until one ends it."""
        for sample in samples:
            if req.is_finished:
                break
            self._append(req, sample, detok)
        if drafted:
            self.speculator.accepted(req, drafted, len(samples) - 1, self.kv)
            if req.sparse is not None:
                req.sparse.verified(len(samples))

    def _append(self, req: Request, sample: Sample, detok: IncrementalDetokenizer) -> None:
        req.append_token(sample.token_id)
        if req.constraint is not None:
            req.constraint.accept(sample.token_id)
        if sample.top_logprobs is not None:
            req.logprobs.append({**sample.top_logprobs, sample.token_id: sample.logprob})
        reason = self._stop_reason(req, sample.token_id, detok)
        if reason:
            req.finish(*reason)
            self._release(req)

    def _release(self, req: Request) -> None:
        """Free a request that ended, telling its owner first (it may keep some of its blocks);
        its blocks are freed even if the owner's hook raises."""
        for watch in self.end_watchers:
            try:
                watch(req)
            except Exception:  # noqa: BLE001 - an observer's failure is not the request's
                log.exception("an end watcher failed on request %s", req.request_id)
        try:
            if req.owner is not None:
                req.owner.request_finished(req)
        finally:
            self.scheduler.finish(req)
            if self.speculator is not None:
                self.speculator.forget(req)

    def _stop_reason(self, req: Request, token_id: int, detok: IncrementalDetokenizer):
        p = req.params
        if req.sparse is not None and req.sparse.error:  # its flow failed: it ends, the batch goes on
            return ("error", req.sparse.error)
        if token_id in req.eos_token_ids and not p.ignore_eos:
            return ("stop", None)
        if token_id in p.stop_token_ids:
            return ("stop", token_id)
        stop_string = detok.add(token_id)
        if stop_string is not None:
            return ("stop", stop_string)
        if req.constraint is not None and req.constraint.done:  # the grammar is complete: nothing may follow
            return ("stop", None)
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= req.max_total_tokens:
            return ("length", None)
        return None


def _content_chars(message: dict) -> int:
    """Characters of a chat message's content: a string, or parts (str, Span, {"text": ...})."""
    content = message.get("content")
    if isinstance(content, str):
        return len(content)
    if not isinstance(content, list):
        return 0
    texts = (getattr(part, "text", part.get("text") if isinstance(part, dict) else part) for part in content)
    return sum(len(text) for text in texts if isinstance(text, str))
