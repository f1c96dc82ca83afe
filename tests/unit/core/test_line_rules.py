"""Code completion's line rules (``n_indent``, ``t_max_predict_ms``) against a
transliteration of llama-server's ``process_token`` (tools/server/server-context.cpp):
the same end, the same text cut, for any tokens; and what is streamed is always a
prefix of what the body holds (no sent text is ever taken back)."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given, settings

from trioserve._core._text import LineRules, TextAssembler


def llama_server(
    tokens: list[str], n_indent: int, t_max: float | None, times: list[float]
) -> tuple[str, bool]:
    """llama-server's loop over the tokens' texts: (generated text, stopped by a rule)."""
    generated, last_nl_pos, has_new_line = "", 0, False
    for text, now in zip(tokens, times, strict=True):
        generated += text
        if has_new_line and n_indent > 0:
            if last_nl_pos > 0:
                pos = last_nl_pos
                indent = 0
                while pos < len(generated) and generated[pos] in " \t":
                    indent += 1
                    pos += 1
                if pos < len(generated) and indent < n_indent:
                    return generated[:pos], True
            found = generated.find("\n", last_nl_pos)
            if found != -1:
                last_nl_pos = found + 1
        if "\n" in text:
            has_new_line = True
            if t_max is not None and now > t_max:
                return generated, True
    return generated, False


def run(
    tokens: list[str], n_indent: int, t_max: float | None = None, times: list[float] | None = None
) -> tuple[list[str], str, bool]:
    """LineRules fed token by token: (what each token released, the whole text, ended)."""
    now = [0.0]

    def clock() -> float:
        return now[0]

    rules = LineRules(n_indent, t_max, clock=clock)
    released = []
    for text, at in zip(tokens, times or [0.0] * len(tokens), strict=True):
        now[0] = at
        released.append(rules.feed(text))
        if rules.ended:
            break
    released.append(rules.flush())
    return released, "".join(released), rules.ended


def test_a_line_less_indented_ends_it_a_token_late_and_is_cut_after_its_indentation() -> None:
    tokens = ["    return x\n", "    y = 1\n", "print(y)", "\n", "more"]
    released, text, ended = run(tokens, 4)
    assert ended
    assert text == llama_server(tokens, 4, None, [0.0] * 5)[0] == "    return x\n    y = 1\n"
    # each line went out once it had passed its check; "print(y)" was held back,
    # never sent, then cut
    assert released[:3] == ["    return x\n", "", "    y = 1\n"]
    assert "print" not in "".join(released)


def test_a_new_line_after_the_time_limit_ends_it_with_that_line() -> None:
    tokens = ["a", "\n", "b", "c\n", "d"]
    times = [0.0, 0.5, 1.0, 2.0, 3.0]
    _released, text, ended = run(tokens, 0, 1.5, times)
    assert ended
    assert text == "a\nbc\n"


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.text(alphabet=" \tab\n", min_size=1, max_size=6), min_size=1, max_size=25),
    st.integers(min_value=0, max_value=4),
)
def test_the_rules_end_and_cut_as_llama_server_does(tokens: list[str], n_indent: int) -> None:
    times = [float(i) for i in range(len(tokens))]
    expected, stopped = llama_server(tokens, n_indent, 7.5, times)
    _released, text, ended = run(tokens, n_indent, 7.5, times)
    assert (text, ended) == (expected, stopped)


def test_the_assembler_reports_a_rule_end_as_limited() -> None:
    assembler = TextAssembler((), LineRules(4))
    out = "".join(assembler.feed(piece) for piece in (b"    a\n", b"    b\n", b"c", b"\n"))
    assert assembler.stopped
    assert assembler.limited
    assert out == "    a\n    b\n"
