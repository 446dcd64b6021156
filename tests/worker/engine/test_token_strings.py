"""Which tokens the output text leaves out, as the logprobs entries mark them (`special`)."""

from __future__ import annotations

from collections.abc import Callable

from tokenizers import AddedToken
from transformers import AutoTokenizer

from worker.engine.token_strings import TokenStrings


def test_an_added_token_marked_special_is_special_though_not_named_as_one(tiny_model: Callable[..., str]) -> None:
    """Decoding with skip_special_tokens leaves out every added token marked special (a Llama 3 header or
    reserved token), not only the named ones (BOS, EOS, ...): each of those is marked, an ordinary token not."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model())
    tokenizer.add_tokens([AddedToken("<|reserved_0|>", special=True)], special_tokens=False)
    reserved = tokenizer.convert_tokens_to_ids("<|reserved_0|>")
    assert reserved not in tokenizer.all_special_ids
    assert tokenizer.decode([65, reserved, 66], skip_special_tokens=True) == "AB"
    names = TokenStrings(tokenizer)
    assert names.is_special(reserved) and names.is_special(tokenizer.bos_token_id)
    assert not names.is_special(65)
