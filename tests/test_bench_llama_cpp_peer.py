"""The llama.cpp peer of the benchmarks runs in its own process and times itself there."""

import pytest

from benchmarks.llama_cpp_peer import LlamaCppPeer
from spanserve.models.loader import gguf_file

pytest.importorskip("llama_cpp")


def test_the_peer_prefills_decodes_and_reports_errors():
    peer = LlamaCppPeer(gguf_file(None), n_ctx=256, threads=1)
    try:
        ids = list(range(1000, 1040))
        assert peer.vocab_size > 1000 and peer.prefill(ids) > 0
        times = peer.token_times(ids, 4)
        assert len(times) == 5 and times == sorted(times) and times[0] == 0
        assert peer.first_token(ids + [1040]) > 0  # reuses the cached prefix
        with pytest.raises(RuntimeError, match="llama.cpp peer"):
            peer.prefill(list(range(1000, 1400)))  # longer than its context
    finally:
        peer.close()
    assert peer.proc.returncode == 0
