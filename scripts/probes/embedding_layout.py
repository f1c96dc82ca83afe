"""Which embedding-call layouts give every input the bits of its lone call
(docs/embeddings.md, "Batched, and still exact").

For flash attention on and off and each (tile, floor) layout: N random inputs (1 to
~130 tokens: ASCII, accents, CJK, emoji) embedded alone, then 16 to a call, then
shuffled and 16 to a call; prints how many vectors differ from the lone ones (bit for
bit) and the batched inputs/s.

    python scripts/probes/embedding_layout.py [--inputs 96]
"""

from __future__ import annotations

import argparse
import random
import time

from trioserve import LlamaBackend, LlamaSettings, default_model_path
from trioserve._backends._retrieval import _embeddings as E

WORDS = "the a river stone light market violin engine garden , . ! ? 1 22 333 Paris über naïve 東京 😀".split()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--inputs", type=int, default=96)
    args = p.parse_args()
    backend = LlamaBackend.load(LlamaSettings(default_model_path(), n_threads=2, slots=1, warm_up=False))
    model = backend.llama_model
    rng = random.Random(7)
    texts = [
        " ".join(rng.choice(WORDS) for _ in range(rng.choice([1, 2, 3, 5, 8, 13, 21, 34, 55, 89])))
        for _ in range(args.inputs)
    ]
    inputs = [model.tokenize(text) for text in texts]
    original = E.EmbeddingContext._create
    for flash in (1, 0):

        def create(self, model, pooling, sequences=1, flash=flash):  # type: ignore[no-untyped-def]
            ctx = original(self, model, pooling, sequences)
            self.lib.llama_free(ctx)
            params = self.lib.llama_context_default_params()
            params.n_ctx = params.n_batch = params.n_ubatch = self.n_batch
            params.n_seq_max = sequences
            params.n_threads = params.n_threads_batch = model.settings.n_threads
            params.embeddings, params.pooling_type, params.kv_unified = True, pooling, True
            params.flash_attn_type = flash
            return self.lib.llama_init_from_model(model.model, params)

        E.EmbeddingContext._create = create  # type: ignore[method-assign]
        saved, E.LAYOUTS = E.LAYOUTS, ()
        context = E.EmbeddingContext(model, turns=backend.embedder.turns)
        E.LAYOUTS = saved
        for tile, floor in ((0, 0), (8, 0), (16, 0), (32, 0), (16, 64), (64, 0)):
            context.tile, context.floor, context.width = tile, floor, 1
            alone = context.embed(inputs)
            context.width = E.MAX_SEQUENCES
            started = time.perf_counter()
            together = context.embed(inputs)
            rate = len(inputs) / (time.perf_counter() - started)
            order = list(range(len(inputs)))
            rng.shuffle(order)
            shuffled = context.embed([inputs[i] for i in order])
            bad = sum(a != b for a, b in zip(alone, together, strict=True))
            bad_shuffled = sum(shuffled[k] != alone[i] for k, i in enumerate(order))
            print(
                f"flash attention {'on ' if flash else 'off'} tile {tile:2d} floor {floor:2d}: "
                f"{bad:3d} and {bad_shuffled:3d} of {len(inputs)} differ (together, shuffled); "
                f"{rate:.1f} inputs/s batched",
                flush=True,
            )
        context.free()
    backend.close()


if __name__ == "__main__":
    main()
