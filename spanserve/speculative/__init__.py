"""Speculative decoding: draft a few tokens a request is likely to write next, and let the target
model check them all in one step (config.py the settings as vLLM spells them, ngram.py drafts by
prompt lookup, speculator.py the drafts of the running requests and how many each gets)."""
