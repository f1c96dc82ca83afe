"""Probe (issue 24): is a verify row of a speculative call computed as the plain decode
step computes it, bit for bit?

For a prompt, the reference is plain greedy decoding: one ``llama_decode`` of one row per
token, the logits row of every step kept. Then the same prompt is evaluated again (same
pieces) and decoded by verify calls: the current token plus ``k`` drafts — the
reference's own next tokens (all accepted), or with the last ``wrong`` of them replaced
(the rows after them are rejected and their cells removed) — and every accepted row's
logits are compared with the reference step's, bit for bit.

Also tried: a plain step of two rows (the token and one draft that is always wrong), the
"pad" reference: if verify rows of every width equal *it*, a server that always decodes
at least two rows is exact.

    .venv/bin/python scripts/probes/spec_exact.py [--repack on|off] [--tokens 96]
"""

from __future__ import annotations

import argparse
import sys

import numpy

from trioserve import LlamaBackend, LlamaSettings, default_model_path

SHORT = "The three laws of robotics are"
EDIT = (
    "def parse_config(path):\n"
    + "".join(
        f"    value_{i} = read_field(path, 'field_{i}')  # the {i}th field of the config\n" for i in range(30)
    )
    + "    return value_0\n\nRewrite this function with read_field renamed to load_field:\n\n"
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repack", choices=("on", "off", "auto"), default="auto")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--flash-attn", choices=("auto", "on", "off"), default="auto")
    parser.add_argument("--widths", default="1,2,3,4,6,7,8")
    parser.add_argument("--timing", action="store_true", help="time decode calls of each width instead")
    parser.add_argument("--type-k", type=int, default=None, help="ggml type of the K cache (0 f32, 1 f16, 30 bf16)")
    parser.add_argument("--type-v", type=int, default=None, help="ggml type of the V cache")
    args = parser.parse_args()
    repack = {"on": True, "off": False, "auto": None}[args.repack]
    if args.flash_attn != "auto" or args.type_k is not None or args.type_v is not None:
        import llama_cpp

        default_params = llama_cpp.llama_context_default_params

        def params():  # type: ignore[no-untyped-def]
            p = default_params()
            if args.flash_attn != "auto":
                p.flash_attn_type = 1 if args.flash_attn == "on" else 0
            if args.type_k is not None:
                p.type_k = args.type_k
            if args.type_v is not None:
                p.type_v = args.type_v
            return p

        llama_cpp.llama_context_default_params = params
    backend = LlamaBackend.load(
        LlamaSettings(default_model_path(), slots=2, repack=repack, n_threads=args.threads, warm_up=False)
    )
    s = backend._scheduler
    lib, ctx, batch, memory = backend.lib, s.context.ctx, s.context.batch, s.context.memory
    n_vocab = backend.n_vocab

    def logits(i: int) -> numpy.ndarray:
        return numpy.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, i), (n_vocab,)).copy()

    def decode(rows: list[tuple[int, int]], seq: int = 0) -> list[numpy.ndarray]:
        for i, (tok, pos) in enumerate(rows):
            batch.token[i] = tok
            batch.pos[i] = pos
            batch.seq_id[i][0] = seq
            batch.logits[i] = 1
        batch.n_tokens = len(rows)
        assert lib.llama_decode(ctx, batch) == 0
        return [logits(i) for i in range(len(rows))]

    def prefill(prompt: list[int]) -> numpy.ndarray:
        lib.llama_memory_seq_rm(memory, 0, -1, -1)
        cuts = backend.piece_rule.cuts(prompt)
        start = 0
        last = None
        for end in [*cuts, len(prompt)]:
            if end <= start:
                continue
            for i in range(start, end):
                batch.token[i - start] = prompt[i]
                batch.pos[i - start] = i
                batch.seq_id[i - start][0] = 0
                batch.logits[i - start] = 0
            batch.logits[end - start - 1] = 1
            batch.n_tokens = end - start
            assert lib.llama_decode(ctx, batch) == 0
            last = logits(end - start - 1)
            start = end
        return last

    def reference(prompt: list[int], pad: bool) -> tuple[list[int], list[numpy.ndarray]]:
        row = prefill(prompt)
        tokens = [int(row.argmax())]
        rows = [row]
        pos = len(prompt)
        for _ in range(args.tokens):
            step = [(tokens[-1], pos)]
            if pad:
                step.append((tokens[-1], pos + 1))  # a draft that is thrown away
            out = decode(step)
            if pad:
                lib.llama_memory_seq_rm(memory, 0, pos + 1, -1)
            rows.append(out[0])
            tokens.append(int(out[0].argmax()))
            pos += 1
        return tokens, rows

    def verify(prompt: list[int], ref: list[int], ref_rows: list[numpy.ndarray], k: int, wrong: int) -> tuple[int, int]:
        """(rows compared, rows differing) decoding by verify calls of k drafts."""
        prefill(prompt)
        pos = len(prompt)
        i = 0  # ref[i] is the current token (sampled, not yet in the cache)
        compared = differ = 0
        while i < args.tokens:
            drafts = ref[i + 1 : i + 1 + k]
            good = len(drafts)
            if wrong and len(drafts) > wrong:
                good = len(drafts) - wrong
                drafts = drafts[:good] + [(t + 7) % n_vocab for t in drafts[good:]]
            rows = [(ref[i], pos)] + [(t, pos + 1 + j) for j, t in enumerate(drafts)]
            out = decode(rows)
            # accepted: the current token and the good drafts; the row after the last
            # good draft gives the next token
            used = min(good + 1, args.tokens - i)
            for j in range(used):
                compared += 1
                if not numpy.array_equal(out[j], ref_rows[i + 1 + j]):
                    differ += 1
            lib.llama_memory_seq_rm(memory, 0, pos + used, -1)
            pos += used
            i += used
        return compared, differ

    print(backend.system_info)
    if args.timing:
        import time

        for name, text in (("short", SHORT), ("edit", EDIT)):
            prompt = backend.tokenize(text)
            for width in [int(w) for w in args.widths.split(",")]:
                prefill(prompt)
                times = []
                for r in range(40):
                    rows = [(prompt[-1], len(prompt) + j) for j in range(width)]
                    started = time.perf_counter()
                    decode(rows)
                    times.append(time.perf_counter() - started)
                    lib.llama_memory_seq_rm(memory, 0, len(prompt), -1)
                times.sort()
                print(f"{name} ctx {len(prompt)} width {width}: median {times[20] * 1000:.2f} ms, min {times[0] * 1000:.2f}")
        backend._free()
        return
    print(f"flash attention {args.flash_attn}, repack: {backend.repack.to_dict() if backend.repack else None}, threads {backend.settings.n_threads}")
    for name, text in (("short", SHORT), ("edit", EDIT)):
        prompt = backend.tokenize(text)
        ref, rows = reference(prompt, pad=False)
        pad_ref, pad_rows = reference(prompt, pad=True)
        same_pad = sum(numpy.array_equal(a, b) for a, b in zip(rows, pad_rows))
        print(
            f"{name}: prompt {len(prompt)} tokens, {args.tokens} decoded; "
            f"pad-2 reference rows equal to plain: {same_pad}/{len(rows)}; texts equal: {ref == pad_ref}"
        )
        for k in [int(w) - 1 for w in args.widths.split(",") if int(w) > 1]:
            for wrong in (0, 1):
                c, d = verify(prompt, ref, rows, k, wrong)
                c2, d2 = verify(prompt, pad_ref, pad_rows, k, wrong)
                print(f"   k={k:2d} wrong={wrong}: vs plain {d:3d}/{c} rows differ; vs pad-2 {d2:3d}/{c2}")
        sys.stdout.flush()
    backend._free()


if __name__ == "__main__":
    main()
