"""Link policies: which tokens of each independently computed span to recompute in context.

A span computed alone never saw the text before it, so its tokens carry no link to it. The
policies, per request:
- none: reuse every span block as cached;
- gap: recompute the first `gap_length` tokens of each span with full attention (EPIC /
  Legolink), rounded up to whole 16-token blocks: the KV cache's unit of sharing;
- blend: recompute the `blend_ratio` fraction of span tokens whose KV would change most in
  context (CacheBlend): a probe of the first layers picks them by gradual filtering, each of
  `blend_layers` check layers keeping the most deviating of the previous one's picks
  (blend_counts; the tensor work is engine/runner.py);
- full: recompute everything, i.e. ignore the spans (the accuracy reference);
- comb: span KV written by a trained encoder plug-in (spanserve/comb/), read by the frozen
  decoder as it is: nothing recomputed;
- ape: nothing recomputed; in-context queries read span keys at a lower attention temperature
  and scale the spans' share of the softmax (APE, arXiv 2502.05431; the span anchor is its
  shared prefix). See span_weighting.
With none or comb, `focus_spans` k > 0 adds a query-aware relink: a probe runs the text after
the first span (the question) over the cached spans and recomputes in context the k spans its
last tokens attend to most (engine/runner.py focus_select). Recomputing a random span brings
nothing back; recomputing the one holding the answer brings back most of what reuse lost.
`focus_tokens` t > 0 sizes the pick in tokens instead: ceil(t / 16) span blocks around the ones
the question attends to most (pic/focus.py), so that long documents cost no more than short ones.
Recomputed tokens land in blocks private to the request; the shared span blocks are never
written.
"""

import functools
import math
from dataclasses import dataclass

from spanserve.errors import InvalidLinkPolicyError, InvalidRequestError

POLICIES = ("none", "gap", "blend", "full", "comb", "ape")
# blend: check layers of the probe. The released CacheBlend code checks once (the second layer);
# the paper filters over the first layers. Three checks cost the probe about 1.8 layers of span
# tokens at ratio 0.15 (1 + 0.53 + 0.28) instead of 1, on layers whose deviations the paper
# finds well rank-correlated with the next ones.
BLEND_LAYERS = 3
# ape: the defaults of the authors' code (demo_ape.py), kept over 90% of sequential accuracy there.
APE_TEMPERATURE = 0.9
APE_SCALE = 0.9
FOCUSABLE = ("none", "comb")  # policies that reuse span KV unchanged, which a focus probe reads as is
# link_policy "auto": comb (with an encoder plug-in) or none, and the blocks around the question's
# peak recomputed in context (README, "focus_tokens"; the most accurate policy at a 10x warm TTFT)
AUTO_FOCUS_TOKENS = 48


@dataclass(frozen=True)
class LinkPolicy:
    name: str = "none"
    gap_length: int = 0
    blend_ratio: float = 0.0
    plugin: str = ""  # comb: the signature of the encoder plug-in that computes span KV
    blend_layers: int = BLEND_LAYERS  # blend: check layers of the probe (at most the model's layers - 1)
    ape_temperature: float = APE_TEMPERATURE  # ape: T in (0, 1]
    ape_scale: float = APE_SCALE  # ape: S in (0, 1]
    focus_spans: int = 0  # none, comb: spans the question's attention picks for recompute in context
    focus_tokens: int = 0  # none, comb: or a budget of span tokens it picks, in blocks

    def __post_init__(self):
        if self.name not in POLICIES:
            raise InvalidRequestError(f"link_policy must be one of {', '.join(POLICIES)}, got {self.name!r}")
        if not isinstance(self.gap_length, int) or self.gap_length < 0:
            raise InvalidRequestError(f"gap_length must be an integer >= 0, got {self.gap_length!r}")
        if not isinstance(self.blend_ratio, (int, float)) or not 0 <= self.blend_ratio <= 1:
            raise InvalidRequestError(f"blend_ratio must be in [0, 1], got {self.blend_ratio!r}")
        if not isinstance(self.blend_layers, int) or self.blend_layers < 1:
            raise InvalidRequestError(f"blend_layers must be an integer >= 1, got {self.blend_layers!r}")
        for field in ("focus_spans", "focus_tokens"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidRequestError(f"{field} must be an integer >= 0, got {value!r}")
            if value and self.name not in FOCUSABLE:
                raise InvalidLinkPolicyError(f"{field} applies to link policies {' and '.join(FOCUSABLE)}, "
                                             f"not {self.name!r}")
        if self.focus_spans and self.focus_tokens:
            raise InvalidLinkPolicyError("focus_spans and focus_tokens are two ways to size one probe's pick: "
                                         "set one of them")
        for field, value in (("ape_temperature", self.ape_temperature), ("ape_scale", self.ape_scale)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise InvalidRequestError(f"{field} must be in (0, 1], got {value!r}")

    @property
    def uses_spans(self) -> bool:
        return self.name != "full"

    @property
    def encodes_spans(self) -> bool:
        """True if span tokens are computed by the encoder plug-in rather than the decoder."""
        return self.name == "comb"

    @property
    def selects(self) -> bool:
        """True if the linked tokens are chosen by a probe of the request's own KV."""
        return (self.name == "blend" and self.blend_ratio > 0) or self.focuses

    @property
    def focuses(self) -> bool:
        """True if a focus probe picks what to recompute (focus_spans or focus_tokens)."""
        return self.focus_spans > 0 or self.focus_tokens > 0

    @functools.cached_property  # read for every block of a spanned prompt (its hash key)
    def signature(self) -> tuple:
        """What decides the linked tokens, given the same context (part of cache keys)."""
        focus = ("focus", self.focus_spans, self.focus_tokens) if self.focuses else ()
        return {"none": ("none",), "gap": ("gap", self.gap_length),
                "blend": ("blend", self.blend_ratio, self.blend_layers), "full": ("full",),
                "comb": ("comb", self.plugin), "ape": ("ape", self.ape_temperature, self.ape_scale)}[self.name] + focus

    @property
    def span_key(self) -> tuple:
        """What changes a span's own KV (part of its span-local hashes): the encoder, if any."""
        return ("comb", self.plugin) if self.name == "comb" else ()

    @property
    def span_weighting(self) -> tuple[float, float] | None:
        """APE: (factor on span keys, power of their summed weight), else None. For a query with
        scores s (q.k/sqrt(d)) the span keys C get weights exp(s_j / T) within their share, and
        their summed weight Z = sum_C exp(s_j / T) enters the softmax as Z^(S*T) beside the
        plain exp(s_i) of the other keys (as the authors' code does: lse_context * scale *
        temperature). T = S = 1 is plain attention."""
        if self.name != "ape":
            return None
        return 1 / self.ape_temperature, self.ape_scale * self.ape_temperature

    def blend_counts(self, num_tokens: int, max_layers: int) -> list[int]:
        """CacheBlend's gradual filtering: how many of `num_tokens` span tokens stay picked
        after each check layer (the second model layer, the third, ...). Every span token is a
        candidate at the first check; each check keeps the most deviating of the previous
        one's picks, and the last keeps ceil(blend_ratio * num_tokens). The kept fraction
        shrinks by the same factor at each check: blend_ratio ** (l / L) after check l of L."""
        layers = max(1, min(self.blend_layers, max_layers))
        final = min(num_tokens, math.ceil(self.blend_ratio * num_tokens))
        return [max(final, min(num_tokens, math.ceil(self.blend_ratio ** (check / layers) * num_tokens)))
                for check in range(1, layers + 1)]

    def linked(self, start: int, end: int, block_size: int) -> int:
        """How many tokens at the head of span [start, end) are recomputed in context."""
        if self.name != "gap":
            return 0
        return min(-(-self.gap_length // block_size) * block_size, end - start)
