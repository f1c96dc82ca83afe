"""The fill-in-the-middle layout (``_backends/_infill.py``) against llama-server's
``format_prompt_infill``, rule by rule, with a tokenizer that makes each token visible
(one token per character; special-token text read as itself only when asked). The
same layout on real files beside llama-server: tests/e2e/test_infill.py."""

from __future__ import annotations

from trioserve._backends._infill import SNIPPET, FimTokens, InfillParts, infill_tokens

PRE, SUF, MID, REP, SEP, BOS = -1, -2, -3, -4, -5, -6
REPO_LEVEL = FimTokens(PRE, SUF, MID, repo=REP, separator=SEP)
PLAIN = FimTokens(PRE, SUF, MID)


def tokenize(text: str, parse_special: bool) -> list[int]:
    # "<mid>" written in a text is the special token only when parsed as special
    if parse_special and text == "<mid>":
        return [MID]
    return [ord(c) for c in text]


def chars(tokens: list[int]) -> str:
    names = {PRE: "<PRE>", SUF: "<SUF>", MID: "<MID>", REP: "<REP>", SEP: "<SEP>", BOS: "<BOS>"}
    return "".join(names[t] if t < 0 else chr(t) for t in tokens)


def test_the_repo_level_layout_puts_the_extra_context_first() -> None:
    parts = InfillParts(
        "def f(x):\n    ", "\nprint(f(1))\n", "ret", (("a.py", "A = 1\n"), ("b.py", "B = 2\n"))
    )
    tokens = infill_tokens(parts, REPO_LEVEL, tokenize, n_ctx=4096, bos=BOS)
    assert chars(tokens) == (
        "<REP>myproject\n<SEP>a.py\nA = 1\n<SEP>b.py\nB = 2\n<SEP>filename\n"
        "<BOS><PRE>def f(x):\n    ret<SUF>\nprint(f(1))\n<MID>"
    )


def test_a_model_without_separators_gets_snippet_lines_and_no_repo_header() -> None:
    parts = InfillParts("p", "s", "", (("a.py", "A"),))
    tokens = infill_tokens(parts, PLAIN, tokenize, n_ctx=4096, bos=None)
    assert chars(tokens) == SNIPPET + "A<PRE>p<SUF>s<MID>"


def test_special_token_text_is_plain_in_the_prefix_and_special_in_the_prompt() -> None:
    parts = InfillParts("<mid>", "", "<mid>")
    tokens = infill_tokens(parts, PLAIN, tokenize, n_ctx=4096, bos=None)
    assert tokens == [PRE, *map(ord, "<mid>"), MID, SUF, MID]


def test_mixed_prefixes_keep_token_ids() -> None:
    parts = InfillParts(["a", 7, "b"], [9])
    assert infill_tokens(parts, PLAIN, tokenize, n_ctx=4096, bos=None) == [
        PRE,
        ord("a"),
        7,
        ord("b"),
        SUF,
        9,
        MID,
    ]


def test_the_limits_are_llama_servers_at_its_defaults() -> None:
    # prefix: its last 1,536 tokens; suffix: its first 512 − 2 − prompt; extra: its
    # last n_ctx − 2048 + 2
    prompt = "xy"
    parts = InfillParts("P" * 2000 + "p", "s" + "S" * 2000, prompt, (("f", "E" * 5000 + "e"),))
    tokens = infill_tokens(parts, PLAIN, tokenize, n_ctx=3000, bos=None)
    pre, suf = tokens.index(PRE), tokens.index(SUF)
    assert pre == 3000 - 2048 + 2  # the extra context's tail
    assert chars(tokens[:pre]).endswith("e")
    assert tokens[pre + 1 : suf] == [ord("P")] * 1535 + [ord("p"), ord("x"), ord("y")]
    assert tokens[suf + 1 : -1] == [ord("s")] + [ord("S")] * (512 - 2 - len(prompt) - 1)
    assert tokens[-1] == MID
    # a context of a batch or less holds (almost) no extra context
    assert infill_tokens(parts, PLAIN, tokenize, n_ctx=2046, bos=None)[0] == PRE
