"""A tokenizer rebuilt from a GGUF file's `tokenizer.ggml.*` metadata.

A GGUF carries no tokenizer.json, so the `tokenizers` pipeline is rebuilt the way
transformers converts GGUF tokenizers: byte-level BPE for `gpt2` vocabularies (with the
pre-tokenizer splits llama.cpp names in `tokenizer.ggml.pre`), SentencePiece-style BPE with
byte fallback for `llama` ones. The header is read with a small mmap reader of our own:
the gguf package's reader parses every field into numpy views and takes seconds on a
49k-token vocabulary.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from engine.errors import ModelLoadError

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


@dataclass(frozen=True)
class GgufTokenizer:
    """What a GGUF file holds of its tokenizer: the rebuilt pipeline and its special tokens,
    as engine/text/tokenizer.py's Tokenizer takes them."""

    backend: BackendTokenizer
    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: list[int]
    add_bos: bool
    special_tokens: dict[str, str]
    chat_template: str | None


def read_gguf_tokenizer(path: Path) -> GgufTokenizer:
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
    return GgufTokenizer(
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
