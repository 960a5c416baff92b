"""Text <-> token ids for one model, and the model's own chat template.

Two sources, one `Tokenizer`:
  - an HF directory: tokenizer.json, plus tokenizer_config.json / special_tokens_map.json /
    generation_config.json for the special tokens and chat_template(.jinja|.json) for chat;
  - a GGUF file: no tokenizer.json inside, so the `tokenizers` pipeline is rebuilt from the
    `tokenizer.ggml.*` metadata the way transformers converts GGUF tokenizers (byte-level BPE for
    `gpt2`, SentencePiece-style BPE with byte fallback for `llama`).

Chat templates are jinja2, rendered in a sandbox with the globals and filters HF templates expect.
"""

from __future__ import annotations

import json
import mmap
import struct
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from engine.errors import ModelLoadError, ValidationError

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
        self._compiled_chat_template = (
            _compile_chat_template(chat_template) if chat_template is not None else None
        )

    @classmethod
    def from_path(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        if path.is_dir():
            return _tokenizer_from_hf_dir(path)
        if path.is_file() and path.suffix == ".gguf":
            return _tokenizer_from_gguf(path)
        raise ModelLoadError(
            f"cannot load a tokenizer from {path}: expected an HF model directory or a .gguf file"
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Special tokens written in the text become their ids."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

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


# --- chat templates ------------------------------------------------------------------------


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in
    transformers; for serving it only renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson HTML-escapes; templates expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _compile_chat_template(source: str) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationBlock],
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    try:
        return environment.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ModelLoadError(f"the model's chat template does not parse: {exc}") from exc


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


# --- GGUF ----------------------------------------------------------------------------------

# GGUF metadata value types (gguf spec): fixed-width scalars by struct format, then string/array.
_GGUF_SCALAR_FORMATS = {
    0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d",
}  # fmt: skip
_GGUF_STRING, _GGUF_ARRAY = 8, 9

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
_TOKEN_TYPE_UNKNOWN, _TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED = 2, 3, 4

# GPT-2's split, which the ByteLevel pre-tokenizer applies when use_regex=True.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DIGIT = r"\p{N}"

# tokenizer.ggml.pre -> the regex splits applied in order before byte-level BPE (llama.cpp's
# table). Names not listed get GPT-2's split alone, as transformers does.
_GGUF_PRE_SPLITS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
        (_DIGIT, _GPT2_SPLIT),
    ),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "dbrx", "smaug-bpe"),
        (_LLAMA3_SPLIT,),
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"), (_QWEN2_SPLIT,)),
}


class _GgufHeaderReader:
    """Reads GGUF key/values in place from a memory map (the tensors are never touched)."""

    def __init__(self, buffer: mmap.mmap):
        self.buffer = buffer
        self.offset = 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buffer, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("Q")
        raw = self.buffer[self.offset : self.offset + length]
        self.offset += length
        return raw.decode("utf-8", errors="replace")

    def value(self, value_type: int) -> Any:
        if value_type == _GGUF_STRING:
            return self.string()
        if value_type == _GGUF_ARRAY:
            item_type, count = self.scalar("I"), self.scalar("Q")
            if item_type in _GGUF_SCALAR_FORMATS:
                fmt = f"<{count}{_GGUF_SCALAR_FORMATS[item_type]}"
                items = list(struct.unpack_from(fmt, self.buffer, self.offset))
                self.offset += struct.calcsize(fmt)
                return items
            return [self.value(item_type) for _ in range(count)]
        if value_type in _GGUF_SCALAR_FORMATS:
            return self.scalar(_GGUF_SCALAR_FORMATS[value_type])
        raise ValueError(f"unknown GGUF value type {value_type}")


def read_gguf_metadata(path: Path) -> dict[str, Any]:
    """Every key/value of a GGUF file's header."""
    try:
        with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            if buf[:4] != b"GGUF":
                raise ModelLoadError(f"{path} is not a GGUF file (bad magic)")
            reader = _GgufHeaderReader(buf)
            reader.offset = 4
            version = reader.scalar("I")
            if version not in (2, 3):
                raise ModelLoadError(f"{path}: unsupported GGUF version {version} (need 2 or 3)")
            reader.scalar("Q")  # tensor count
            kv_count = reader.scalar("Q")
            metadata = {}
            for _ in range(kv_count):
                key = reader.string()
                metadata[key] = reader.value(reader.scalar("I"))
            return metadata
    except (OSError, ValueError, struct.error) as exc:
        raise ModelLoadError(f"cannot read GGUF metadata from {path}: {exc}") from exc


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of every byte: printable Latin-1 bytes stand for themselves,
    the rest are shifted to code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    alphabet = {byte: chr(byte) for byte in printable}
    shifted = (byte for byte in range(256) if byte not in alphabet)
    alphabet.update({byte: chr(256 + n) for n, byte in enumerate(shifted)})
    return alphabet


def _byte_level_bpe(metadata: dict[str, Any]) -> tuple[BackendTokenizer, list[str]]:
    """`tokenizer.ggml.model == "gpt2"`. Returns the backend and the vocabulary as spelled in it."""
    alphabet = _byte_alphabet()
    alphabet_chars = set(alphabet.values())
    # A few converters store a token as its raw text; the BPE model needs it in the byte alphabet.
    spelled = [
        token
        if set(token) <= alphabet_chars
        else "".join(alphabet[byte] for byte in token.encode("utf-8"))
        for token in metadata["tokenizer.ggml.tokens"]
    ]
    if "tokenizer.ggml.merges" not in metadata:
        raise ModelLoadError("GGUF byte-level BPE tokenizer has no tokenizer.ggml.merges")
    merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]
    vocab = {token: token_id for token_id, token in enumerate(spelled)}
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges))

    pre = metadata.get("tokenizer.ggml.pre", "default")
    splits = _GGUF_PRE_SPLITS.get(pre)
    if splits is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in splits]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    backend.decoder = decoders.ByteLevel()
    return backend, spelled


def _sentencepiece_bpe(metadata: dict[str, Any]) -> tuple[BackendTokenizer, list[str]]:
    """`tokenizer.ggml.model == "llama"`: SentencePiece-style BPE over "▁"-for-space text, with
    <0xNN> byte tokens for anything outside the vocabulary."""
    tokens = metadata["tokenizer.ggml.tokens"]
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    if "tokenizer.ggml.merges" in metadata:
        merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]
    elif "tokenizer.ggml.scores" in metadata:
        merges = _merges_from_scores(tokens, metadata["tokenizer.ggml.scores"], vocab)
    else:
        raise ModelLoadError("GGUF SentencePiece tokenizer has neither merges nor scores")
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    unk_token = tokens[unk_id] if unk_id is not None and unk_id < len(tokens) else None
    backend = BackendTokenizer(
        models.BPE(
            vocab=vocab, merges=merges, unk_token=unk_token, fuse_unk=True, byte_fallback=True
        )
    )
    add_space_prefix = metadata.get("tokenizer.ggml.add_space_prefix", True)
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_space_prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend, list(tokens)


def _merges_from_scores(
    tokens: Sequence[str], scores: Sequence[float], vocab: dict[str, int]
) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece vocabulary: every split of a token into two tokens,
    best merged-token score first (SentencePiece merges the highest-scoring pair first)."""
    if len(scores) != len(tokens):
        raise ModelLoadError(f"GGUF has {len(tokens)} tokens but {len(scores)} scores")
    candidates = []
    for token, score in zip(tokens, scores, strict=True):
        pairs = [
            (token[:cut], token[cut:])
            for cut in range(1, len(token))
            if token[:cut] in vocab and token[cut:] in vocab
        ]
        pairs.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        candidates.extend((left, right, score) for left, right in pairs)
    candidates.sort(key=lambda c: (c[2], len(c[0]), len(c[1])), reverse=True)
    return [(left, right) for left, right, _ in candidates]


_GGUF_BUILDERS = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe}


def _tokenizer_from_gguf(path: Path) -> Tokenizer:
    metadata = read_gguf_metadata(path)
    tokenizer_model = metadata.get("tokenizer.ggml.model")
    if tokenizer_model not in _GGUF_BUILDERS:
        raise ModelLoadError(
            f"{path}: GGUF tokenizer model {tokenizer_model!r} is not supported "
            f"(supported: {', '.join(sorted(_GGUF_BUILDERS))})"
        )
    if "tokenizer.ggml.tokens" not in metadata:
        raise ModelLoadError(f"{path}: GGUF file has no tokenizer.ggml.tokens")
    backend, vocab_spelling = _GGUF_BUILDERS[tokenizer_model](metadata)
    raw_tokens = metadata["tokenizer.ggml.tokens"]
    _add_gguf_added_tokens(backend, raw_tokens, vocab_spelling, metadata)

    def token_at(key: str) -> int | None:
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        return token_id if token_id is not None and 0 <= token_id < len(raw_tokens) else None

    bos_token_id = token_at("bos_token_id")
    eos_token_id = token_at("eos_token_id")
    special_ids = {
        "bos_token": bos_token_id,
        "eos_token": eos_token_id,
        "unk_token": token_at("unknown_token_id"),
        "pad_token": token_at("padding_token_id"),
    }
    special_tokens = {
        name: raw_tokens[token_id] for name, token_id in special_ids.items() if token_id is not None
    }
    # llama.cpp adds BOS for SentencePiece vocabularies unless the file says otherwise.
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", tokenizer_model == "llama"))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    _set_bos_eos_post_processor(
        backend,
        bos_token_id if add_bos else None,
        eos_token_id if add_eos else None,
    )
    # End-of-turn / end-of-message ids also end generation (llama-3 style <|eot_id|>).
    eos_token_ids = (eos_token_id, token_at("eot_token_id"), token_at("eom_token_id"))
    return Tokenizer(
        backend,
        vocab_size=len(raw_tokens),
        bos_token_id=bos_token_id,
        eos_token_ids=[i for i in eos_token_ids if i is not None],
        add_bos=add_bos and bos_token_id is not None,
        special_tokens=special_tokens,
        chat_template=metadata.get("tokenizer.chat_template"),
    )


def _add_gguf_added_tokens(
    backend: BackendTokenizer,
    raw_tokens: Sequence[str],
    vocab_spelling: Sequence[str],
    metadata: dict[str, Any],
) -> None:
    """Control tokens become special added tokens and user-defined ones plain added tokens, so
    both are matched whole in text instead of being cut into pieces by BPE.

    In a byte-level vocabulary, a token marked control but spelled outside the byte alphabet
    (vocab_spelling differs from the raw text) is a converter mislabel; adding it would grow the
    vocabulary past the model's, so it is skipped, as transformers does."""
    token_types = metadata.get("tokenizer.ggml.token_type") or ()
    special, plain = [], []
    # strict=False: old files may carry no token types at all (then nothing is added).
    for token, spelled, token_type in zip(raw_tokens, vocab_spelling, token_types, strict=False):
        if token != spelled:
            continue
        if token_type in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_UNKNOWN):
            special.append(AddedToken(token, normalized=False, special=True))
        elif token_type == _TOKEN_TYPE_USER_DEFINED:
            plain.append(AddedToken(token, normalized=False, special=False))
    backend.add_special_tokens(special)
    backend.add_tokens(plain)


def _set_bos_eos_post_processor(
    backend: BackendTokenizer, bos_token_id: int | None, eos_token_id: int | None
) -> None:
    if bos_token_id is None and eos_token_id is None:
        return
    # Template pieces are named by key, not token text (a token may contain the ':' separator).
    bos = [("BOS", bos_token_id)] if bos_token_id is not None else []
    eos = [("EOS", eos_token_id)] if eos_token_id is not None else []
    single = [f"{key}:0" for key, _ in bos] + ["$A:0"] + [f"{key}:0" for key, _ in eos]
    pair = single + [f"{key}:1" for key, _ in bos] + ["$B:1"] + [f"{key}:1" for key, _ in eos]
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=bos + eos
    )
