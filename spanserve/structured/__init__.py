"""Constrained decoding: a request's output held to a JSON schema, any JSON object, a regex, a
choice among strings or a Lark grammar (params.py), through llguidance (grammars.py).

llguidance rather than xgrammar: it has no dependencies (xgrammar 0.2.8 pulls in triton and
apache-tvm-ffi, even on a CPU machine), it needs no compile step to cache (a matcher over a
cached grammar takes about 2 ms), and its masks, once built for a grammar's states, cost about
0.04 ms a token to fill on SmolLM2's 49k vocabulary (xgrammar: 0.003 ms, plus 0.17 ms for its
CPU apply). Its first pass over a new grammar's states builds them lazily: about 3 ms a token,
once per grammar (a /tmp script, a 50-property schema, AMD Zen 4)."""

from spanserve.structured.params import InvalidGrammarError, StructuredOutputs

__all__ = ["InvalidGrammarError", "StructuredOutputs"]
