"""Text in and out: the tokenizer (HF or GGUF) and chat template, prompts as token ids,
and output text as it streams (incremental detokenizing, stop strings)."""
