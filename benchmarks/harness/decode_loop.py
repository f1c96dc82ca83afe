"""The ceiling: llama.cpp's bare decode loop through llama-cpp-python's low-level API, in
this process, no server, no HTTP, no scheduler (docs/benchmarks.md, "Method": decode-only).

One context per N: ``n_seq_max = N``, ``kv_unified = false``, ``n_ctx = N × ctx_size``,
``n_batch = n_ubatch = 512``, ``n_threads = n_threads_batch = threads``, the rest at
llama.cpp's defaults (as trioserve takes them). Each prompt is prefilled on its own
(sequence *i*) and its first token sampled; then ``max_tokens − 1`` ``llama_decode`` calls
with one token per sequence in sequence-id order (out of order, llama.cpp splits the batch
into several micro-batches), each followed by llama.cpp's greedy sampler for every
sequence. End-of-generation tokens do not end a sequence: the batch stays N wide.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .proc import cpu_seconds, system_busy_seconds

N_BATCH = 512
_LOG_CALLBACK: Any = None  # llama.cpp keeps the pointer: the ctypes object must stay alive


class DecodeLoop:
    """The model, loaded once, and one context per N (made and warmed up on first use)."""

    def __init__(self, model: Path, threads: int, ctx_size: int) -> None:
        global _LOG_CALLBACK
        import llama_cpp as lib

        if _LOG_CALLBACK is None:
            _LOG_CALLBACK = lib.llama_log_callback(lambda _level, _text, _data: None)
        lib.llama_log_set(_LOG_CALLBACK, None)
        lib.llama_backend_init()
        self.lib, self.threads, self.ctx_size, self.contexts = lib, threads, ctx_size, {}
        self.model = lib.llama_model_load_from_file(str(model).encode(), lib.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {model}")
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.batch = lib.llama_batch_init(N_BATCH, 0, 1)
        for i in range(N_BATCH):
            self.batch.n_seq_id[i] = 1

    def close(self) -> None:
        for ctx in self.contexts.values():
            self.lib.llama_free(ctx)
        self.contexts.clear()
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_model_free(self.model)

    def context(self, prompts: Sequence[str]) -> Any:
        """The context for ``len(prompts)`` sequences; on first use, 4 warm-up tokens each."""
        n = len(prompts)
        if n not in self.contexts:
            params = self.lib.llama_context_default_params()
            params.n_ctx, params.n_batch, params.n_ubatch = n * self.ctx_size, N_BATCH, N_BATCH
            params.n_seq_max, params.kv_unified = n, False
            params.n_threads = params.n_threads_batch = self.threads
            self.contexts[n] = ctx = self.lib.llama_init_from_model(self.model, params)
            if not ctx:
                raise RuntimeError(f"no context for {n} sequences of {self.ctx_size} tokens")
            self.generate(prompts, 4)
        return self.contexts[n]

    def tokenize(self, text: str) -> list[int]:
        """As trioserve does: BOS added, special tokens parsed."""
        data, lib = text.encode(), self.lib
        tokens = (lib.llama_token * (len(data) + 8))()
        n = lib.llama_tokenize(self.vocab, data, len(data), tokens, len(data) + 8, True, True)
        return list(tokens[:n])

    def text(self, tokens: Sequence[int]) -> str:
        buffer, pieces = ctypes.create_string_buffer(256), []
        for token in tokens:
            n = self.lib.llama_token_to_piece(self.vocab, token, buffer, 256, 0, False)
            pieces.append(buffer.raw[:n])
        return b"".join(pieces).decode(errors="replace")

    def first_eog(self, tokens: Sequence[int]) -> int | None:
        return next((i for i, t in enumerate(tokens) if self.lib.llama_vocab_is_eog(self.vocab, t)), None)

    def generate(self, prompts: Sequence[str], max_tokens: int) -> dict[str, Any]:
        """Prefill each prompt, then decode all together to ``max_tokens`` tokens each.
        Returns the times (``ttft_s`` per sequence from the start of the prefills,
        ``loop_s`` of the decode loop), the tokens, and CPU % (this process, everything
        else) over the loop."""
        lib, batch, n, ctx = self.lib, self.batch, len(prompts), self.context(prompts)
        lib.llama_memory_clear(lib.llama_get_memory(ctx), True)
        chains = [lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params()) for _ in prompts]
        for chain in chains:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_greedy())
        try:
            prompt_tokens = [self.tokenize(p) for p in prompts]
            outputs: list[list[int]] = []
            ttft, t_start = [], time.perf_counter()
            for seq, tokens in enumerate(prompt_tokens):
                for start in range(0, len(tokens), N_BATCH):
                    chunk = tokens[start : start + N_BATCH]
                    for i, token in enumerate(chunk):
                        batch.token[i], batch.pos[i] = token, start + i
                        batch.seq_id[i][0], batch.logits[i] = seq, 0
                    batch.n_tokens = len(chunk)
                    batch.logits[len(chunk) - 1] = start + len(chunk) == len(tokens)
                    self._decode(ctx)
                outputs.append([lib.llama_sampler_sample(chains[seq], ctx, len(chunk) - 1)])
                ttft.append(time.perf_counter() - t_start)
            positions = [len(t) for t in prompt_tokens]
            for i in range(n):
                batch.seq_id[i][0], batch.logits[i] = i, 1
            batch.n_tokens = n
            cpu_before, busy_before = cpu_seconds(os.getpid()), system_busy_seconds()
            t_loop = time.perf_counter()
            for _ in range(max_tokens - 1):
                for i in range(n):
                    batch.token[i], batch.pos[i] = outputs[i][-1], positions[i]
                    positions[i] += 1
                self._decode(ctx)
                for i in range(n):
                    outputs[i].append(lib.llama_sampler_sample(chains[i], ctx, i))
            t_end = time.perf_counter()
            own, busy = cpu_seconds(os.getpid()) - cpu_before, system_busy_seconds() - busy_before
        finally:
            for chain in chains:
                lib.llama_sampler_free(chain)
        loop_s = t_end - t_loop
        out = {"ttft_s": ttft, "loop_s": loop_s, "total_s": t_end - t_start, "tokens": outputs}
        return out | {"cpu_pct": 100 * own / loop_s, "other_cpu_pct": max(0.0, 100 * (busy - own) / loop_s)}

    def _decode(self, ctx: Any) -> None:
        if (result := self.lib.llama_decode(ctx, self.batch)) != 0:
            raise RuntimeError(f"llama_decode returned {result}")
