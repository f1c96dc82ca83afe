"""Constrained-decoding engines on the default model's vocabulary: compile time, per-token
cost while forcing a valid document, JSON Schema coverage by random walk, worst masks.

    flock /tmp/trioserve-cpu.lock .venv/bin/python scripts/probes/grammar_engines.py \
        --engines llama,llguidance,xgrammar --xgrammar-venv /tmp/xg-venv

xgrammar runs in its own venv (it declares torch/transformers/triton; its core does not
use them, so the worker stubs those imports). See docs/grammar-engines.md.
"""

import argparse
import json
import os
import pickle
import random
import subprocess
import sys
import tempfile
import time

import numpy as np

NEG = np.float32(-np.inf)


def obj(s):
    return {"type": "object", "properties": {"v": s}, "required": ["v"], "additionalProperties": False}


# schemas and the documents forced through them; in "coverage", {"V": s} stands for obj(s)
DATA = json.loads(
    """
{
"flat": [{"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
  "ok": {"type": "boolean"}}, "required": ["name", "age", "ok"], "additionalProperties": false},
  {"name": "Grace Hopper", "age": 85, "ok": true}],
"nested": [{"$defs": {"item": {"type": "object", "properties": {"sku": {"type": "string",
  "maxLength": 12}, "qty": {"type": "integer", "minimum": 1, "maximum": 99}, "kind": {"enum": ["book",
  "tool", "food"]}, "note": {"type": "string"}}, "required": ["sku", "qty", "kind"],
  "additionalProperties": false}}, "type": "object", "properties": {"order": {"type": "object",
  "properties": {"id": {"type": "integer", "minimum": 0}, "items": {"type": "array",
  "items": {"$ref": "#/$defs/item"}, "minItems": 1}, "gift": {"type": "boolean"}}, "required": ["id",
  "items"], "additionalProperties": false}, "status": {"enum": ["new", "paid", "shipped"]},
  "comment": {"type": "string", "maxLength": 80}}, "required": ["order", "status"],
  "additionalProperties": false}, {"order": {"id": 40213, "items": [{"sku": "BK-1001", "qty": 2,
  "kind": "book", "note": "hardcover, please"}, {"sku": "TL-77", "qty": 1, "kind": "tool"},
  {"sku": "FD-3", "qty": 12, "kind": "food", "note": "keep cold"}], "gift": true}, "status": "paid",
  "comment": "Leave at the front desk if nobody answers."}],
"json_object": [{"type": "object"}, {"title": "Quarterly report", "pages": 12, "tags": ["q3", "finance"],
  "draft": false, "meta": {"author": "Ana", "score": 4.5, "refs": null}}],
"coverage": {
 "nested objects": {"V": {"type": "object", "properties": {"v": {"type": "integer"}}, "required": ["v"],
    "additionalProperties": false}},
 "required/optional": {"type": "object", "properties": {"a": {"type": "integer"},
    "b": {"type": "integer"}}, "required": ["a"], "additionalProperties": false},
 "additionalProperties false": {"type": "object", "properties": {"a": {"type": "integer"}},
    "additionalProperties": false},
 "additionalProperties schema": {"type": "object", "additionalProperties": {"type": "integer"}},
 "enum": {"V": {"enum": ["red", "green", "blue"]}},
 "const": {"V": {"const": "fixed-value"}},
 "anyOf": {"V": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}]}},
 "oneOf (disjoint)": {"V": {"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}]}},
 "oneOf (overlapping)": {"V": {"oneOf": [{"type": "integer"}, {"type": "number"}]}},
 "allOf": {"V": {"allOf": [{"type": "integer", "minimum": 0}, {"maximum": 50}]}},
 "$ref/$defs": {"$defs": {"p": {"type": "object", "properties": {"v": {"type": "integer"}},
    "required": ["v"], "additionalProperties": false}}, "type": "object",
    "properties": {"v": {"$ref": "#/$defs/p"}}, "required": ["v"], "additionalProperties": false},
 "$ref recursive": {"$defs": {"node": {"type": "object", "additionalProperties": false, "required": ["n"],
    "properties": {"n": {"type": "integer"}, "kids": {"type": "array", "maxItems": 2,
    "items": {"$ref": "#/$defs/node"}}}}}, "type": "object",
    "properties": {"v": {"$ref": "#/$defs/node"}}, "required": ["v"], "additionalProperties": false},
 "pattern": {"V": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}},
 "format date-time": {"V": {"type": "string", "format": "date-time"}},
 "format date": {"V": {"type": "string", "format": "date"}},
 "format email": {"V": {"type": "string", "format": "email"}},
 "format uuid": {"V": {"type": "string", "format": "uuid"}},
 "minLength/maxLength": {"V": {"type": "string", "minLength": 2, "maxLength": 5}},
 "minimum/maximum": {"V": {"type": "integer", "minimum": 10, "maximum": 20}},
 "exclusiveMin/Max": {"V": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}},
 "multipleOf": {"V": {"type": "integer", "multipleOf": 7}},
 "minItems/maxItems": {"V": {"type": "array", "items": {"type": "integer"}, "minItems": 2,
    "maxItems": 3}},
 "uniqueItems": {"V": {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 3,
    "uniqueItems": true}},
 "prefixItems": {"V": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "boolean"}],
    "items": false}},
 "patternProperties": {"type": "object", "patternProperties": {"^x_": {"type": "integer"}},
    "additionalProperties": false},
 "if/then/else": {"type": "object", "properties": {"v": {"type": "integer"}}, "required": ["v"],
    "additionalProperties": false, "if": {"properties": {"v": {"minimum": 0}}},
    "then": {"properties": {"v": {"multipleOf": 2}}}, "else": {"properties": {"v": {"maximum": -10}}}},
 "not": {"V": {"type": ["integer", "string"], "not": {"type": "string"}}},
  "type [string, null]": {"V": {"type": ["string", "null"], "maxLength": 4}}
}}
"""
)
DOCS = {k: tuple(DATA[k]) for k in ("flat", "nested", "json_object")}
NESTED = DOCS["nested"][0]
COVERAGE = {k: obj(v["V"]) if "V" in v else v for k, v in DATA["coverage"].items()}


_rng = random.Random(7)
WORDS = sorted(
    {
        "".join(_rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(_rng.randint(5, 12)))
        for _ in range(2100)
    }
)[:2000]
DEEP = {"type": "integer"}
for _i in range(25):
    DEEP = obj(DEEP)
DEEP_DOC = 7
for _i in range(25):
    DEEP_DOC = {"v": DEEP_DOC}
PATHO = {
    "enum 2000 strings": (obj({"enum": WORDS}), {"v": WORDS[-1]}),
    "long pattern": (
        obj({"type": "string", "pattern": "^([a-z]{2,8}[0-9]{1,3}-){10,20}[A-Z]{1,40}$"}),
        {"v": "ab12-" * 12 + "XYZ"},
    ),
    "nesting depth 25": (DEEP, DEEP_DOC),
    "60 optional props": (
        {
            "type": "object",
            "properties": {f"p{i}": {"type": "integer"} for i in range(60)},
            "additionalProperties": False,
        },
        {"p3": 1, "p30": 2, "p59": 3},
    ),
}


def dump(doc):
    return json.dumps(doc, separators=(",", ":"))


class Vocab:
    """Pieces (control tokens as b""), EOS, single-byte token ids, tokenized documents."""

    def __init__(self, path):
        import ctypes

        import llama_cpp as L

        self.L, cb = L, L.llama_log_callback(lambda *a: None)
        L.llama_log_set(cb, None)
        self._cb = cb
        L.llama_backend_init()
        p = L.llama_model_default_params()
        p.vocab_only = True
        self.model = L.llama_model_load_from_file(path.encode(), p)
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n, self.eos = L.llama_vocab_n_tokens(self.vocab), L.llama_vocab_eos(self.vocab)
        buf, self.pieces = ctypes.create_string_buffer(256), []
        for t in range(self.n):
            k = L.llama_token_to_piece(self.vocab, t, buf, 256, 0, False)
            self.pieces.append(b"" if L.llama_vocab_is_control(self.vocab, t) else buf.raw[:k])
        self.single = [t for t, p in enumerate(self.pieces) if len(p) == 1]
        docs = {**{k: d for k, (_, d) in DOCS.items()}, **{k: d for k, (_, d) in PATHO.items()}}
        self.docs = {k: self.tokenize(dump(d)) for k, d in docs.items()}

    def tokenize(self, text):
        b = text.encode()
        out = (self.L.llama_token * (len(b) + 8))()
        k = self.L.llama_tokenize(self.vocab, b, len(b), out, len(b) + 8, False, False)
        return list(out[:k])

    def state(self):
        return {k: getattr(self, k) for k in ("n", "eos", "pieces", "single", "docs")}


def allowed_from_bitmask(bm, n):
    return np.unpackbits(bm.view(np.uint8), count=n, bitorder="little").view(bool)


class BitmaskEngine:
    """Shared step for llguidance and xgrammar: fill mask, apply to logits, accept."""

    def step(self, m, logits, template, tok):
        self.fill(m)
        np.copyto(logits, template)
        np.copyto(logits, NEG, where=~allowed_from_bitmask(self.bm, self.n))
        return logits[tok] > NEG and self.accept(m, tok)

    def allowed(self, m, _rng):
        self.fill(m)
        return np.flatnonzero(allowed_from_bitmask(self.bm, self.n))


class Llguidance(BitmaskEngine):
    name = "llguidance"

    def __init__(self, v, vocab_ptr):
        import llguidance
        import llguidance.llamacpp
        import llguidance.numpy

        self.llg, self.n = llguidance, v.n
        self.tok = llguidance.llamacpp.lltokenizer_from_vocab(vocab_ptr)
        self.bm = llguidance.numpy.allocate_token_bitmask(1, v.n)

    def compile(self, schema):
        M = self.llg.LLMatcher
        g = M.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        m = M(self.tok, g, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return (g, m.get_grammar_warnings())

    def matcher(self, g):
        return self.llg.LLMatcher(self.tok, g[0], log_level=0)

    def fill(self, m):
        self.llg.numpy.fill_next_token_bitmask(m, self.bm)

    def accept(self, m, tok):
        return m.consume_token(tok)


class Xgrammar(BitmaskEngine):
    name = "xgrammar"

    def __init__(self, v):
        import xgrammar

        self.xg, self.n = xgrammar, v.n
        info = xgrammar.TokenizerInfo(
            v.pieces, vocab_type=xgrammar.VocabType.RAW, vocab_size=v.n, stop_token_ids=[v.eos]
        )
        self.cc = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self.bm = np.full((1, (v.n + 31) // 32), -1, dtype=np.int32)

    def compile(self, schema):
        return self.cc.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(",", ":")
        ), []

    def matcher(self, g):
        return self.xg.GrammarMatcher(g[0])

    def fill(self, m):
        m.fill_next_token_bitmask(self.bm)

    def accept(self, m, tok):
        return m.accept_token(tok)


class Llama:
    """llama.cpp grammar sampler on a full llama_token_data_array; logits refilled per token."""

    name = "llama"

    def __init__(self, v, vocab_ptr):
        import llama_cpp as L
        from llama_cpp.llama_grammar import json_schema_to_gbnf

        self.L, self.v, self.vp, self.conv = L, v, vocab_ptr, json_schema_to_gbnf
        self.full = self._array(np.arange(v.n, dtype=np.int32))

    def _array(self, ids):
        L = self.L
        data = (L.llama_token_data * len(ids))()
        rec = np.ctypeslib.as_array(data)
        rec["id"] = ids
        return data, rec, L.llama_token_data_array(data=data, size=len(ids), selected=-1, sorted=False)

    def _apply(self, m, arr, logits):
        _data, rec, cur = arr
        rec["logit"] = logits
        cur.size, cur.selected, cur.sorted = len(rec), -1, False
        self.L.llama_sampler_apply(m, self.L.byref(cur))
        return rec

    def compile(self, schema):
        gbnf = self.conv(json.dumps(schema))
        s = self.L.llama_sampler_init_grammar(self.vp, gbnf.encode(), b"root")
        if not s:
            raise ValueError("llama_sampler_init_grammar returned NULL")
        return (s, [])

    def matcher(self, g):
        self.L.llama_sampler_reset(g[0])
        return g[0]

    def step(self, m, logits, template, tok):
        rec = self._apply(m, self.full, template)
        if not rec["logit"][tok] > NEG:
            return False
        self.L.llama_sampler_accept(m, tok)
        return True

    def allowed(self, m, rng):
        ids = np.unique(
            np.concatenate([self.v.single, [self.v.eos], rng.sample(range(self.v.n), 2048)])
        ).astype(np.int32)
        for arr in (self._array(ids), self.full):
            rec = self._apply(m, arr, np.zeros(len(arr[1]), np.float32))
            ok = rec["id"][rec["logit"] > NEG]
            if len(ok):
                return ok
        return ok

    def accept(self, m, tok):
        self.L.llama_sampler_accept(m, tok)
        return True


class LlamaOne(Llama):
    """llama.cpp's common-sampler fast path: check only the sampled token (1-entry array).
    Best case; a rejected token costs a full apply on top (the `llama` row)."""

    name = "llama-1cand"

    def step(self, m, logits, template, tok):
        _data, rec, cur = self.one
        rec["id"], rec["logit"] = tok, 0.0
        cur.size, cur.selected, cur.sorted = 1, -1, False
        self.L.llama_sampler_apply(m, self.L.byref(cur))
        if not rec["logit"][0] > NEG:
            return False
        self.L.llama_sampler_accept(m, tok)
        return True

    def __init__(self, v, vocab_ptr):
        super().__init__(v, vocab_ptr)
        self.one = self._array(np.zeros(1, np.int32))


def timed(f, *a):
    t = time.perf_counter()
    r = f(*a)
    return r, time.perf_counter() - t


def force(eng, g, toks, eos, reps):
    """Per-token µs while forcing toks+EOS; (times, cold first step, error)."""
    template = np.random.default_rng(0).standard_normal(eng_n(eng)).astype(np.float32)
    logits, times, cold = np.empty_like(template), [], None
    for _r in range(reps):
        m = eng.matcher(g)
        for i, t in enumerate([*toks, eos]):
            t0 = time.perf_counter_ns()
            ok = eng.step(m, logits, template, t)
            dt = (time.perf_counter_ns() - t0) / 1e3
            if not ok:
                return times, cold, f"token {i} rejected"
            cold = dt if cold is None else cold
            times.append(dt)
    return times, cold, None


def eng_n(eng):
    return eng.n if hasattr(eng, "n") else eng.v.n


def walk(eng, g, v, rng, max_len=200, soft=40):
    """Random walk over allowed tokens; after `soft` steps prefer EOS and closers."""
    m, out, pri = eng.matcher(g), [], [v.eos] + [v.pieces.index(c) for c in (b"}", b"]", b'"')]
    byte_set = set(v.single)
    for i in range(max_len):
        ok = eng.allowed(m, rng)
        if not len(ok):
            return None, "dead end"
        oks = set(ok.tolist())
        pick = next((t for t in pri if t in oks), None) if i >= soft else None
        if pick is None:
            short = [t for t in ok.tolist() if t in byte_set] if rng.random() < 0.6 else []
            pick = rng.choice(short) if short else int(ok[rng.randrange(len(ok))])
        if pick == v.eos:
            return b"".join(v.pieces[t] for t in out), None
        if not eng.accept(m, pick):
            return None, "accept failed"
        out.append(pick)
    return None, "unfinished"


def checker():
    import datetime
    import re

    import jsonschema

    fc = jsonschema.Draft202012Validator.FORMAT_CHECKER
    rfc = re.compile(r"^(\d{4}-\d\d-\d\d)T(\d\d):(\d\d):(\d\d)(\.\d+)?(Z|[+-](\d\d):(\d\d))$", re.I)

    @fc.checks("date-time", raises=ValueError)
    def _dt(s):  # RFC 3339 section 5.6, leap second allowed
        if not isinstance(s, str):
            return True
        m = rfc.match(s)
        if not m:
            return False
        datetime.date.fromisoformat(m[1])
        h, mi, sec, oh, om = (int(x or 0) for x in m.group(2, 3, 4, 7, 8))
        return h < 24 and mi < 60 and sec < 61 and oh < 24 and om < 60

    return lambda schema, doc: list(
        jsonschema.Draft202012Validator(schema, format_checker=fc).iter_errors(doc)
    )


def run_engine(eng, v, setup_s, reps, samples):
    res = {"setup_s": setup_s, "pertoken": {}, "coverage": {}, "patho": {}}
    for name, (schema, _) in DOCS.items():
        g, cs = timed(eng.compile, schema)
        times, cold, err = force(eng, g, v.docs[name], v.eos, reps)
        res["pertoken"][name] = {
            "compile_ms": cs * 1e3,
            "tokens": len(v.docs[name]) + 1,
            "err": err,
            "cold_us": cold,
            "median_us": float(np.median(times)),
            "p99_us": float(np.percentile(times, 99)),
        }
    validate, rng = checker(), random.Random(1)
    for feat, schema in COVERAGE.items() if eng.name != "llama-1cand" else ():
        try:
            g, cs = timed(eng.compile, schema)
        except Exception as e:
            res["coverage"][feat] = {"refused": str(e).splitlines()[0][:100]}
            continue
        bad, fin, ex, whys = 0, 0, None, []
        for _ in range(samples):
            text, why = walk(eng, g, v, rng)
            if text is None:
                whys.append(why)
                continue
            fin += 1
            try:
                errs = validate(schema, json.loads(text.decode()))
            except UnicodeDecodeError:
                errs, text = ["bad UTF-8"], repr(text)
            except ValueError:
                errs, text = ["not JSON"], repr(text)
            if errs:
                bad, ex = bad + 1, str(text)[:60]
        res["coverage"][feat] = {
            "valid": fin - bad,
            "done": fin,
            "ex": ex,
            "warn": [w[:100] for w in g[1]],
            "why": sorted(set(whys)),
        }
    for name, (schema, _) in PATHO.items():
        try:
            g, cs = timed(eng.compile, schema)
        except Exception as e:
            res["patho"][name] = {"err": str(e)[:80]}
            continue
        times, cold, err = force(eng, g, v.docs[name], v.eos, 1)
        res["patho"][name] = {
            "compile_ms": cs * 1e3,
            "max_us": max(times, default=0),
            "cold_us": cold,
            "err": err,
            "median_us": float(np.median(times)) if times else 0,
        }
    return res


def reject_rate(v, eng, path, gens, max_tokens=100):
    """Real model, temperature 1, nested schema: how often the unconstrained sample is not allowed
    (llama.cpp's fast path then pays a full apply). The llguidance mask is the oracle."""
    import llama_cpp as L

    llm = L.Llama(model_path=path, n_ctx=1024, n_threads=2, verbose=False)
    prompt = (
        "<start_of_turn>user\nReply with only a JSON object: a shop order with an id, items (sku, qty, "
        "kind book/tool/food, note) and a status.<end_of_turn>\n<start_of_turn>model\n"
    )
    toks, g, rng = (
        llm.tokenize(prompt.encode(), add_bos=True, special=True),
        eng.compile(NESTED),
        np.random.default_rng(0),
    )
    steps = rejects = 0
    for _ in range(gens):
        llm.reset()
        llm.eval(toks)
        m = eng.matcher(g)
        for _ in range(max_tokens):
            z = np.ctypeslib.as_array(L.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(v.n,)).astype(
                np.float64
            )
            p = np.exp(z - z.max())
            t = rng.choice(v.n, p=p / p.sum())
            eng.fill(m)
            ok = allowed_from_bitmask(eng.bm, v.n)
            steps += 1
            if not ok[t]:
                rejects += 1
                p[~ok] = 0
                t = rng.choice(v.n, p=p / p.sum())
            if t == v.eos:
                break
            m.consume_token(int(t))
            llm.eval([int(t)])
    return steps, rejects


def xgrammar_worker(path, reps, samples):
    import types

    import tvm_ffi  # noqa: F401 - import before the stubs so it does not probe for torch

    class Any_:
        def __init__(self, *a, **k):
            pass

        def __call__(self, *a, **k):
            return Any_()

    for mod in (
        "torch",
        "torch.utils",
        "torch.utils.cpp_extension",
        "transformers",
        "triton",
        "triton.language",
    ):
        sys.modules[mod] = types.ModuleType(mod)
        sys.modules[mod].__getattr__ = lambda name: Any_
    with open(path, "rb") as f:
        v = types.SimpleNamespace(**pickle.load(f))
    eng, s = timed(Xgrammar, v)
    print(json.dumps(run_engine(eng, v, s, reps, samples)))


def table(title, head, rows):
    print(f"\n### {title}\n\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(str(c) for c in r) + " |")


def cov_cell(c):
    if "refused" in c:
        return f"refused: {c['refused'][:60]}"
    s = f"{c['valid']}/{c['done']} valid" + (f" (e.g. `{c['ex']}`)" if c["ex"] else "")
    s += f" [{', '.join(c['why'])}]" if c["why"] else ""
    return s + (f"; warn: {c['warn'][0][:60]}" if c["warn"] else "")


def collect(a):
    from trioserve._backends._models import default_model_path

    path = str(default_model_path())
    v, vs = timed(Vocab, path)
    print(f"vocab: {v.n} tokens, loaded in {vs:.2f}s; doc tokens: { {k: len(t) for k, t in v.docs.items()} }")
    results = {}
    for name in a.engines.split(","):
        t0 = time.perf_counter()
        if name == "xgrammar":
            with tempfile.NamedTemporaryFile(suffix=".pkl", delete=False) as f:
                pickle.dump(v.state(), f)
            py = os.path.join(a.xgrammar_venv, "bin", "python")
            cmd = [
                py,
                __file__,
                "--xgrammar-worker",
                f.name,
                "--reps",
                str(a.reps),
                "--samples",
                str(a.samples),
            ]
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            os.unlink(f.name)
            if p.returncode:
                print(f"xgrammar failed: {p.stderr[-2000:]}")
                continue
            results[name] = json.loads(p.stdout.strip().splitlines()[-1])
        else:
            cls = {"llama": Llama, "llama-1cand": LlamaOne, "llguidance": Llguidance}[name]
            eng, s = timed(cls, v, v.vocab)
            results[name] = run_engine(eng, v, s, a.reps, a.samples)
            if name == "llguidance" and a.gens:
                st, rj = results[name]["reject"] = reject_rate(v, eng, path, a.gens)
                print(f"real model, nested schema, T=1: {rj}/{st} sampled tokens not allowed ({rj / st:.1%})")
        print(f"{name}: done in {time.perf_counter() - t0:.0f}s", flush=True)
    return results, v.n


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="llama,llguidance,xgrammar")
    ap.add_argument("--xgrammar-venv", default="/tmp/xg-venv")
    ap.add_argument("--reps", type=int, default=3, help="forced-document passes per schema")
    ap.add_argument("--samples", type=int, default=6, help="random walks per coverage schema")
    ap.add_argument(
        "--gens", type=int, default=4, help="real-model generations for the reject rate (0: skip)"
    )
    ap.add_argument("--xgrammar-worker", help=argparse.SUPPRESS)
    ap.add_argument("--json", help="also write raw results here")
    ap.add_argument("--tables-from", help="print the tables from a --json file instead of measuring")
    a = ap.parse_args()
    if a.xgrammar_worker:
        return xgrammar_worker(a.xgrammar_worker, a.reps, a.samples)
    if a.tables_from:
        with open(a.tables_from) as f:
            results, n = json.load(f), 262144
    else:
        results, n = collect(a)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    bm, x = np.full((1, (n + 31) // 32), 0x55555555, np.int32), np.zeros(n, np.float32)
    t = [timed(lambda: np.copyto(x, NEG, where=~allowed_from_bitmask(bm, n)))[1] * 1e6 for _ in range(200)]
    print(f"\nnumpy bitmask apply alone (included in the bitmask engines' rows): {np.median(t):.0f} µs")
    engs = list(results)
    table(
        "setup (tokenizer/vocab, once)", ["engine", "s"], [(e, f"{results[e]['setup_s']:.2f}") for e in engs]
    )
    rows = []
    for e in engs:
        for d, r in results[e]["pertoken"].items():
            rows.append(
                (
                    e,
                    d,
                    r["tokens"],
                    f"{r['compile_ms']:.1f}",
                    f"{r['cold_us']:.0f}" if r["cold_us"] else "-",
                    f"{r['median_us']:.0f}",
                    f"{r['p99_us']:.0f}",
                    r["err"] or "ok",
                )
            )
    table(
        "compile + per-token (mask + apply to 262,144 logits + accept)",
        ["engine", "schema", "tokens", "compile ms", "first µs", "median µs", "p99 µs", "forced doc"],
        rows,
    )
    table(
        "coverage (random walks, validated with jsonschema)",
        ["feature", *(ce := [e for e in engs if results[e]["coverage"]])],
        [(f, *(cov_cell(results[e]["coverage"][f]) for e in ce)) for f in COVERAGE],
    )
    rows = [
        (
            e,
            n,
            f"{r.get('compile_ms', 0):.0f}",
            f"{r.get('median_us', 0):.0f}",
            f"{r.get('max_us', 0):.0f}",
            r.get("err") or "ok",
        )
        for e in engs
        for n, r in results[e]["patho"].items()
    ]
    table(
        "pathological schemas", ["engine", "schema", "compile ms", "median µs", "max µs", "forced doc"], rows
    )


if __name__ == "__main__":
    main()
