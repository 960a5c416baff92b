"""Text <-> token ids for one model, and the model's own chat template.

Two sources, one `Tokenizer`:
  - an HF directory: tokenizer.json, plus tokenizer_config.json / special_tokens_map.json /
    generation_config.json for the special tokens and chat_template(.jinja|.json) for chat;
  - a GGUF file: the pipeline is rebuilt from its metadata (engine/text/gguf_tokenizer.py).

Chat templates render with the model's own jinja2 template (engine/text/chat_template.py).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import Tokenizer as BackendTokenizer

from engine.errors import ModelLoadError, ValidationError
from engine.text.chat_template import compile_chat_template
from engine.text.gguf_tokenizer import read_gguf_tokenizer

_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    """A `tokenizers.Tokenizer` plus what serving needs around it: special ids, BOS policy, chat."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        vocab_size: int,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        add_bos: bool,
        special_tokens: dict[str, str],
        chat_template: str | None,
    ):
        self.backend = backend
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(dict.fromkeys(eos_token_ids))
        self.add_bos = add_bos
        # bos_token / eos_token / ... as strings: chat templates read them by these names.
        self.special_tokens = special_tokens
        self.all_special_ids = frozenset(
            token_id
            for token_id, token in backend.get_added_tokens_decoder().items()
            if token.special
        )
        self.chat_template = chat_template
        self._compiled_chat_template, self.chat_template_variables = (
            compile_chat_template(chat_template)
            if chat_template is not None
            else (None, frozenset())
        )

    @classmethod
    def from_path(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        if path.is_dir():
            return _tokenizer_from_hf_dir(path)
        if path.is_file() and path.suffix == ".gguf":
            gguf = read_gguf_tokenizer(path)
            return cls(
                gguf.backend,
                vocab_size=gguf.vocab_size,
                bos_token_id=gguf.bos_token_id,
                eos_token_ids=gguf.eos_token_ids,
                add_bos=gguf.add_bos,
                special_tokens=gguf.special_tokens,
                chat_template=gguf.chat_template,
            )
        raise ModelLoadError(
            f"cannot load a tokenizer from {path}: expected an HF model directory or a .gguf file"
        )

    def encode(
        self,
        text: str,
        add_special_tokens: bool = True,
        *,
        max_tokens: int | None = None,
        field: str = "prompt",
    ) -> list[int]:
        """Token ids of `text`. Special tokens written in the text become their ids.

        With max_tokens (a context length), text longer than max_tokens times the longest
        vocabulary entry is refused (ValidationError on `field`) before it is encoded: it
        cannot fit, and encoding megabytes holds the caller's thread for seconds."""
        if max_tokens is not None and len(text) > max_tokens * self.max_token_chars:
            raise ValidationError(
                field,
                f"{len(text)} characters cannot fit in the context of {max_tokens} tokens "
                f"(no token covers more than {self.max_token_chars} characters)",
            )
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for: the longest vocabulary entry (a
        byte-level entry spells each byte as one character, so it bounds the text too)."""
        return max(map(len, self.backend.get_vocab(with_added_tokens=True)), default=1)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry (not its text: byte-level entries are spelled in the byte alphabet)."""
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @property
    def has_chat_template(self) -> bool:
        return self._compiled_chat_template is not None

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Render `messages` with the model's template. `extra` reaches the template as variables."""
        if self._compiled_chat_template is None:
            raise ValidationError(
                "messages", "this model has no chat template; send a plain text prompt instead"
            )
        if not isinstance(messages, list) or not messages:
            raise ValidationError("messages", "must be a non-empty list of messages")
        for index, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise ValidationError("messages", f"message {index} must be a dict with a 'role'")
        # Like transformers: a key set to None is dropped, since templates test for presence.
        plain_messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        variables = {
            **self.special_tokens,
            "tools": None,
            "documents": None,
            **extra,
            "messages": plain_messages,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._compiled_chat_template.render(**variables)
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as exc:
            raise ValidationError("messages", f"the chat template rejected them: {exc}") from exc


# --- HF directory --------------------------------------------------------------------------


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template_from_hf_dir(directory: Path, tokenizer_config: dict) -> str | None:
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _read_json(directory / "chat_template.json").get("chat_template")
    if template is None:
        template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {entry.get("name"): entry.get("template") for entry in template}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _tokenizer_from_hf_dir(directory: Path) -> Tokenizer:
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ModelLoadError(
            f"{directory} has no tokenizer.json (a slow-only tokenizer such as a bare "
            "tokenizer.model is not supported)"
        )
    try:
        backend = BackendTokenizer.from_file(str(tokenizer_file))
    except Exception as exc:  # the Rust side raises a plain Exception on bad JSON
        raise ModelLoadError(f"cannot parse {tokenizer_file}: {exc}") from exc

    tokenizer_config = _read_json(directory / "tokenizer_config.json")
    special_tokens_map = _read_json(directory / "special_tokens_map.json")
    generation_config = _read_json(directory / "generation_config.json")

    special_tokens = {}
    for name in _SPECIAL_TOKEN_NAMES:
        content = _token_content(tokenizer_config.get(name)) or _token_content(
            special_tokens_map.get(name)
        )
        if content is not None:
            special_tokens[name] = content

    bos_token_id = _token_id(backend, special_tokens.get("bos_token"))
    if bos_token_id is None and isinstance(generation_config.get("bos_token_id"), int):
        bos_token_id = generation_config["bos_token_id"]

    # generation_config.json lists every id that ends a turn; the tokenizer's eos is one of them.
    eos_token_ids = []
    generation_eos = generation_config.get("eos_token_id")
    if isinstance(generation_eos, int):
        eos_token_ids.append(generation_eos)
    elif isinstance(generation_eos, list):
        eos_token_ids.extend(i for i in generation_eos if isinstance(i, int))
    tokenizer_eos = _token_id(backend, special_tokens.get("eos_token"))
    if tokenizer_eos is not None:
        eos_token_ids.append(tokenizer_eos)

    # Whether BOS gets added is decided by tokenizer.json's post-processor; ask it.
    add_bos = bos_token_id is not None and backend.encode("").ids[:1] == [bos_token_id]

    return Tokenizer(
        backend,
        vocab_size=backend.get_vocab_size(with_added_tokens=True),
        bos_token_id=bos_token_id,
        eos_token_ids=eos_token_ids,
        add_bos=add_bos,
        special_tokens=special_tokens,
        chat_template=_chat_template_from_hf_dir(directory, tokenizer_config),
    )


def _token_id(backend: BackendTokenizer, token: str | None) -> int | None:
    return backend.token_to_id(token) if token is not None else None
