"""Token ids -> text deltas as a sequence grows, one token at a time.

Decoding one token alone is wrong in two ways: a character's UTF-8 bytes can be split across
tokens (byte-level BPE, byte fallback), and some decoders depend on context (SentencePiece drops
the space of the first piece only). So each new token is decoded together with the ids of the
delta before it, and the text that decode adds is the new delta:

    ids:  ... | context           | held ...        | new |
                text emitted last   nothing emitted yet    -> delta = the decode's new text

`tokenizers`' DecodeStream runs that in Rust, one call a token (two Python-side decodes a token
cost ~4x as much, and every running sequence pays it every step). The first context is the
prompt's tail, so the first output token decodes with its left context: " Paris", not
"Paris". While the text ends in U+FFFD the last character is still incomplete: nothing is
emitted, the token is held, and a later one completes it (or `flush` gives up at the end).

Invariant: after `flush`, the deltas joined equal decode(prompt_tail + output) minus
decode(prompt_tail); for concatenating decoders (byte-level BPE) that is decode(output).
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers.decoders import DecodeStream

from engine.text.tokenizer import Tokenizer

# How many prompt tokens give the first output tokens their left context.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_ids[-_PROMPT_CONTEXT_TOKENS:])
        if skip_special_tokens:
            context = [i for i in context if i not in tokenizer.all_special_ids]
        # A prompt ending inside a character gives the stream no settled text to go on from
        # (it would emit the context itself): end the context before that character, and the
        # output's own bytes decode as they would alone.
        while context and self._decode(context).endswith(_REPLACEMENT_CHAR):
            context.pop()
        self._restart(context)

    def add(self, token_id: int) -> str:
        """The text `token_id` adds, or "" while the text ends in an incomplete character."""
        try:
            delta = self._stream.step(self.tokenizer.backend, token_id)
        except Exception:  # DecodeStreamError: the decode rewrote text already emitted
            # (a byte-fallback run that ended invalid): emit what the decode adds beyond
            # the emitted text's length, as a whole-window decode would, and go on from there.
            delta = self._new_text(self._held + [token_id])
            self._restart(self._held + [token_id])
            return delta
        self._held.append(token_id)
        if delta is None:
            return ""
        # What the stream now holds as its context (kept here for flush, which it lacks).
        self._context, self._held = self._held, []
        return delta

    def flush(self) -> str:
        """Whatever was held back; an invalid byte sequence comes out as U+FFFD, as in decode."""
        if not self._held:
            return ""
        delta = self._new_text(self._held)
        self._restart(self._held)
        return delta

    def _restart(self, context: list[int]) -> None:
        """Continue from `context`: the ids whose text was emitted last."""
        self._context = context
        self._held: list[int] = []
        self._stream = DecodeStream(context, self.skip_special_tokens)

    def _new_text(self, ids: list[int]) -> str:
        emitted = self._decode(self._context)
        return self._decode(self._context + ids)[len(emitted) :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
