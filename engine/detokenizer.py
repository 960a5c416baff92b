"""Token ids -> text deltas as a sequence grows, one token at a time.

Decoding one token alone is wrong in two ways: a character's UTF-8 bytes can be split across
tokens (byte-level BPE, byte fallback), and some decoders depend on context (SentencePiece drops
the space of the first piece only). So we decode a short window of recent ids twice, with and
without the unread tail, and emit the difference:

    ids:  ... | prefix_offset ... read_offset | unread ... |
                 text already emitted          text to emit now

The window starts a few tokens before the output (the prompt's tail), so the first output
token decodes with its left context: " Paris", not "Paris". When the window's text ends in
U+FFFD the last character is still incomplete; nothing is emitted and the window grows until a
later token completes it (or `flush` gives up at the end of the sequence).

Invariant: after `flush`, the deltas joined equal decode(prompt_tail + output) minus
decode(prompt_tail); for concatenating decoders (byte-level BPE) that is decode(output).
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.tokenizer import Tokenizer

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
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)

    def add(self, token_id: int) -> str:
        """The text `token_id` adds, or "" while the text ends in an incomplete character."""
        if self.skip_special_tokens and token_id in self.tokenizer.all_special_ids:
            return ""  # decode drops it entirely, so it changes nothing
        self._ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        """Whatever was held back; an invalid byte sequence comes out as U+FFFD, as in decode."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        emitted_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window_text = self._decode(self._ids[self._prefix_offset :])
        if not final and (
            len(window_text) <= len(emitted_text) or window_text.endswith(_REPLACEMENT_CHAR)
        ):
            return ""
        # The window's emitted part is complete text, so it is a prefix of the longer decode.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        # Keep the window short: drop ids left of prefix_offset, they are context no longer.
        del self._ids[: self._prefix_offset]
        self._read_offset -= self._prefix_offset
        self._prefix_offset = 0
        return window_text[len(emitted_text) :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
