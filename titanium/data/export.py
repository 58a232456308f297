"""The run's tokenizer and chat template in every export folder (the Hugging Face model, a LoRA adapter, a reward
model), as transformers' ``AutoTokenizer`` loads them: a served model then tokenizes and formats chats as it was
trained."""

from __future__ import annotations

from pathlib import Path

from titanium.data.chat import trained_chat_template
from titanium.data.tokenizer import Tokenizer

CHAT_TEMPLATE_FILE = "chat_template.jinja"


def save_tokenizer(out: str | Path, tokenizer: Tokenizer, chat_template: str, family_format: str = "") -> list[str]:
    """Write ``tokenizer``'s files into ``out`` (a Hugging Face tokenizer's own, the tiktoken ranks converted) and,
    where the run's chat format (``--chat.chat_template``) is not the tokenizer's own template, that format as
    chat_template.jinja (which transformers reads before tokenizer_config.json's); ``family_format``: the model
    family's default format (``auto`` without the tokenizer's own). Returns the files written."""
    out = Path(out)
    save = getattr(tokenizer, "save_pretrained", None)
    written = list(save(out)) if save is not None else []
    source = trained_chat_template(chat_template, tokenizer, family_format)
    if source is not None and source != getattr(tokenizer, "chat_template", None):
        (out / CHAT_TEMPLATE_FILE).write_text(source)
        written.append(CHAT_TEMPLATE_FILE)
    return written
