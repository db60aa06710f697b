"""Which prompt the router asks an engine to tokenize, so its block hashes are the engine's."""

from __future__ import annotations

from pdconnector.router.tokens import given_token_ids, tokenize_body
from pdconnector.router.validation import ClientRequest, Endpoint


def test_token_prompts_need_no_tokenizing():
    request = ClientRequest(Endpoint.COMPLETIONS, {"model": "m", "prompt": [5, 6, 7]}, stream=False)
    assert given_token_ids(request) == [5, 6, 7]
    assert tokenize_body(request) is None


def test_a_text_prompt_is_tokenized_with_the_same_special_tokens_the_completion_uses():
    body = {"model": "m", "prompt": "hi", "add_special_tokens": False, "max_tokens": 3}
    request = ClientRequest(Endpoint.COMPLETIONS, body, stream=False)
    assert given_token_ids(request) is None
    assert tokenize_body(request) == {"model": "m", "prompt": "hi", "add_special_tokens": False}


def test_a_chat_is_rendered_with_every_field_that_changes_its_template():
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "chat_template_kwargs": {"enable_thinking": False},
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "temperature": 0.3,
    }
    assert tokenize_body(ClientRequest(Endpoint.CHAT, body, stream=True)) == {
        "model": "m",
        "messages": body["messages"],
        "chat_template_kwargs": {"enable_thinking": False},
        "tools": body["tools"],
    }
