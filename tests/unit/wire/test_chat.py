"""Chat prompt rendering: the GGUF template when there is one, else a fallback."""

from __future__ import annotations

import pytest

from trioserve import InvalidRequestError
from trioserve._wire._chat import ChatMLFormat, GemmaFormat, JinjaFormat, chat_format_for
from trioserve._wire._openai import ChatMessage


def _messages(*pairs: tuple[str, str]) -> list[ChatMessage]:
    return [ChatMessage(role=role, content=content) for role, content in pairs]  # type: ignore[arg-type]


def test_gemma_fallback_merges_system_into_first_user_turn() -> None:
    prompt = GemmaFormat().render(
        _messages(("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello!"), ("user", "Bye"))
    )
    assert prompt.text == (
        "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    assert "<end_of_turn>" in prompt.stops


def test_chatml_fallback() -> None:
    prompt = ChatMLFormat().render(_messages(("user", "Hi")))
    assert prompt.text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_format_choice() -> None:
    assert chat_format_for(template=None, architecture="gemma3").name == "gemma"
    assert chat_format_for(template=None, architecture="llama").name == "chatml"
    assert chat_format_for(template="{{ bos_token }}", architecture="gemma3").name == "gguf-template"


def test_jinja_template_from_gguf() -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    prompt = JinjaFormat(template, bos_token="<s>", eos_token="</s>").render(_messages(("user", "Hi")))
    assert prompt.text == "<s>[user]Hi[assistant]"
    assert prompt.has_bos
    assert prompt.stops == ("</s>",)


def test_template_raise_exception_becomes_a_400() -> None:
    fmt = JinjaFormat("{{ raise_exception('roles must alternate') }}", bos_token="", eos_token="")
    with pytest.raises(InvalidRequestError, match="roles must alternate"):
        fmt.render(_messages(("user", "Hi")))


def test_a_user_message_is_required() -> None:
    with pytest.raises(InvalidRequestError, match="at least one user message"):
        GemmaFormat().render(_messages(("system", "x")))


def test_templates_get_hugging_face_s_environment() -> None:
    """What real templates use: {% break %} (loopcontrols), tojson without HTML escaping,
    strftime_now, the {% generation %} tag."""
    template = (
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% generation %}{{ m['content'] | tojson }}{% endgeneration %};{% endfor %}"
        "{{ strftime_now('%Y') | length }}"
    )
    fmt = JinjaFormat(template, bos_token="", eos_token="")
    prompt = fmt.render(_messages(("user", "<b>a & b's</b>"), ("assistant", "é"), ("user", "dropped")))
    # json.dumps: no &lt; / &#39; escapes, non-ASCII kept (ensure_ascii=False, as HF)
    assert prompt.text == '"<b>a & b\'s</b>";"é";4'


def test_a_template_that_does_not_compile_falls_back_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    fmt = chat_format_for(template="{% for m in messages %}", architecture="gemma3")
    assert isinstance(fmt, GemmaFormat)
    assert any("does not compile" in r.getMessage() and r.levelname == "ERROR" for r in caplog.records)


def test_a_template_that_fails_on_the_messages_is_a_500_with_a_body() -> None:
    from trioserve._core._exceptions import ChatTemplateError

    fmt = JinjaFormat("{{ messages[0]['content'] + 1 }}", bos_token="", eos_token="")
    with pytest.raises(ChatTemplateError) as info:
        fmt.render(_messages(("user", "hi")))
    assert info.value.status == 500
    assert info.value.code == "chat_template_error"
    assert info.value.should_retry is False
    assert "TypeError" in info.value.message
