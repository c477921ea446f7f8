"""POST /v1/embeddings: OpenAI's embeddings route, served by the sentence encoder span queries
retrieve with (all-MiniLM-L6-v2, spans/retrieval.py), on a helper thread.

Inputs are never truncated: one longer than the encoder's window (256 tokens with [CLS] and
[SEP]) is a 400 that says so, as OpenAI answers an input over its limit. `dimensions` may only
name the model's own size (384): it has no shorter form.
"""

import asyncio
import base64

import numpy as np
from fastapi import FastAPI

from spanserve.engine import text_bound
from spanserve.errors import InputTooLongError, TokenIdError, UnknownModelError
from spanserve.kernels.threads import helper_thread
from spanserve.server.protocol import EmbeddingRequest, EmbeddingResponse
from spanserve.spans.retrieval import MODEL_NAME, get_embedder

NAMES = (MODEL_NAME, MODEL_NAME.rsplit("/", 1)[-1])  # what a client may call the model


def add_embedding_routes(app: FastAPI, *, errors: dict) -> None:
    @app.post("/v1/embeddings", responses=errors)
    async def embeddings(body: EmbeddingRequest) -> EmbeddingResponse:
        if body.model is not None and body.model not in NAMES:
            raise UnknownModelError(f"The model `{body.model}` does not exist for embeddings; this server embeds "
                                    f"with `{MODEL_NAME}`.")
        vectors, tokens = await asyncio.to_thread(_embed, body)
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode()
                 if body.encoding_format == "base64" else v.tolist()} for i, v in enumerate(vectors)]
        return EmbeddingResponse.model_validate({"data": data, "model": NAMES[0],
                                                 "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def _embed(body: EmbeddingRequest) -> tuple[np.ndarray, int]:
    """The vectors and the tokens they took; a 400 for an input the encoder cannot take whole."""
    with helper_thread():  # the encoder runs beside the engine: one thread, no second team
        encoder = get_embedder()
        room = encoder.max_length - 2  # [CLS] and [SEP]
        items = [body.input] if isinstance(body.input, str) or isinstance(body.input[0], int) else body.input
        if isinstance(items[0], str):
            if any(text_bound.fewest_tokens(len(text), encoder.tokenizer) > room for text in items):  # untokenized
                raise InputTooLongError(f"an input is longer than {MODEL_NAME}'s {room} tokens (inputs are never "
                                        f"truncated)")
            counts = encoder.count_tokens(items)
        else:
            if any(t >= encoder.tokenizer.vocab_size for ids in items for t in ids):
                raise TokenIdError(f"token ids must be below {MODEL_NAME}'s vocabulary size "
                                   f"{encoder.tokenizer.vocab_size}")
            counts = [len(ids) for ids in items]
        if (longest := max(counts)) > room:
            raise InputTooLongError(f"an input has {longest} tokens; {MODEL_NAME} takes at most {room} "
                                    f"(inputs are never truncated)")
        vectors = encoder.encode(items) if isinstance(items[0], str) else encoder.encode_ids(items)
        return vectors, sum(counts)
