"""Our decoder + paged attention against transformers, in float32.

Tiny random models cover every architecture switch (qkv bias, q/k norm, tied head, rope
scaling, sharded files); SmolLM2 from its GGUF covers real weights and dequantization.
Every path through the paged cache is checked: whole prefill, chunked prefill, one token
at a time, greedy generation, and several sequences mixed in one flat step.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import transformers

from engine.attention.base import AttentionMetadata
from engine.attention.torch_backend import TorchPagedAttention
from engine.model.config import ModelConfig
from engine.model.llama import LlamaForCausalLM, linear
from engine.model.loader import load_model, read_hf_config
from tests.tiny_models import write_tiny_gguf, write_tiny_model

BLOCK_SIZE = 16
TOLERANCE = 1e-4


@pytest.fixture(autouse=True, scope="module")
def one_intra_op_thread():
    """These models are small: extra intra-op threads only add synchronisation, and on a
    shared 2-core runner they make each forward up to 10x slower. Restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

# name -> (arch, write_tiny_model keyword arguments)
TINY_MODELS = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True, "num_hidden_layers": 3}),
    "llama-gqa4": ("llama", {"num_attention_heads": 8, "num_key_value_heads": 2}),
    "llama-llama3-rope": ("llama", {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0}),
    "llama-linear-rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "llama-sharded": ("llama", {"shards": 2, "num_hidden_layers": 4}),
    "mistral": ("mistral", {"sliding_window": 4096}),
    "qwen2": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", {}),
    "qwen3-untied-mha": ("qwen3", {"num_key_value_heads": 4}),
}


def rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).norm() / ref.norm()).item()


class PagedRunner:
    """A minimal test-local driver: our model over a KV pool of fixed-size blocks.

    Blocks are handed out from the top of the pool down, and sequences in a step take
    them in turn, so no sequence's blocks are contiguous or ascending: the attention
    must follow the block table to get anything right.
    """

    def __init__(self, model: LlamaForCausalLM, config: ModelConfig, num_blocks: int = 64):
        self.model = model
        # The KV heads the model holds: all of them, or a tensor-parallel rank's share.
        shape = (num_blocks, 2, BLOCK_SIZE, model.shard.num_kv_heads, config.head_dim)
        self.kv_caches = [torch.zeros(shape) for _ in range(config.num_layers)]
        self.free_blocks = list(range(num_blocks))  # pop() takes the highest id
        self.block_tables: dict[int, list[int]] = {}
        self.seq_lens: dict[int, int] = {}

    @torch.inference_mode()
    def step(self, chunks: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """Run one flat step of (seq id, new token ids) chunks; logits [len(chunk), vocab] each."""
        input_ids, positions, slots, query_lens, seq_lens = [], [], [], [], []
        for seq_id, tokens in chunks:
            start = self.seq_lens.get(seq_id, 0)
            table = self.block_tables.setdefault(seq_id, [])
            end = start + len(tokens)
            while len(table) * BLOCK_SIZE < end:
                table.append(self.free_blocks.pop())
            for pos in range(start, end):
                slots.append(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
            input_ids.extend(tokens)
            positions.extend(range(start, end))
            query_lens.append(len(tokens))
            seq_lens.append(end)
            self.seq_lens[seq_id] = end
        tables = [self.block_tables[seq_id] for seq_id, _ in chunks]
        meta = AttentionMetadata.from_block_tables(
            query_lens, seq_lens, tables, torch.tensor(slots, dtype=torch.int64), BLOCK_SIZE
        )
        hidden = self.model(torch.tensor(input_ids), torch.tensor(positions), self.kv_caches, meta)
        logits = self.model.compute_logits(hidden)
        return list(logits.split(query_lens))

    def greedy(
        self, seq_id: int, prompt: list[int], max_tokens: int, eos_ids: tuple[int, ...]
    ) -> list[int]:
        logits = self.step([(seq_id, prompt)])[0]
        out: list[int] = []
        while len(out) < max_tokens:
            token = int(logits[-1].argmax())
            out.append(token)
            if token in eos_ids:
                break
            logits = self.step([(seq_id, [token])])[0]
        return out


@pytest.fixture(scope="module", params=list(TINY_MODELS))
def tiny(request, tmp_path_factory):
    """(our model, its config, the transformers model) for one tiny checkpoint."""
    arch, overrides = TINY_MODELS[request.param]
    directory = write_tiny_model(tmp_path_factory.mktemp(request.param), arch, **overrides)
    model, config = load_model(directory, torch.float32, "cpu", TorchPagedAttention())
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return model, config, reference.eval()


def prompt_ids(vocab_size: int, length: int, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (length,), generator=generator).tolist()


@torch.inference_mode()
def reference_logits(reference, ids: list[int]) -> torch.Tensor:
    return reference(torch.tensor([ids])).logits[0].float()


def test_full_prefill_matches(tiny):
    model, config, reference = tiny
    ids = prompt_ids(config.vocab_size, 45)
    ours = PagedRunner(model, config).step([(0, ids)])[0]
    expected = reference_logits(reference, ids)
    assert rel_error(ours[-1], expected[-1]) < TOLERANCE
    assert rel_error(ours, expected) < TOLERANCE


def test_chunked_prefill_matches(tiny):
    model, config, reference = tiny
    ids = prompt_ids(config.vocab_size, 45, seed=1)
    runner = PagedRunner(model, config)
    # Chunk edges fall inside blocks and on a block edge (16 + 16).
    chunks = [ids[:16], ids[16:32], ids[32:39], ids[39:]]
    ours = torch.cat([runner.step([(0, chunk)])[0] for chunk in chunks])
    expected = reference_logits(reference, ids)
    assert rel_error(ours[-1], expected[-1]) < TOLERANCE
    assert rel_error(ours, expected) < TOLERANCE


def test_token_by_token_decode_matches(tiny):
    model, config, reference = tiny
    ids = prompt_ids(config.vocab_size, 40, seed=2)
    runner = PagedRunner(model, config)
    rows = [runner.step([(0, ids[:3])])[0]]
    rows += [runner.step([(0, [token])])[0] for token in ids[3:]]
    ours = torch.cat(rows)
    expected = reference_logits(reference, ids)
    assert rel_error(ours[-1], expected[-1]) < TOLERANCE
    assert rel_error(ours, expected) < TOLERANCE


def hf_greedy(reference, prompt: list[int], max_new_tokens: int, eos_ids, pad_token_id: int):
    """transformers' greedy continuation of one prompt (new token ids only)."""
    with torch.inference_mode():
        generated = reference.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=list(eos_ids),
            pad_token_id=pad_token_id,
        )
    return generated[0, len(prompt) :].tolist()


def test_greedy_generation_matches_transformers(tiny):
    model, config, reference = tiny
    prompt = prompt_ids(config.vocab_size, 20, seed=3)
    ours = PagedRunner(model, config).greedy(0, prompt, 32, config.eos_token_ids)
    assert ours == hf_greedy(reference, prompt, 32, config.eos_token_ids, pad_token_id=0)
    assert len(ours) > 1


def test_mixed_varlen_step_equals_each_alone(tiny):
    model, config, reference = tiny
    a, b, c = (prompt_ids(config.vocab_size, n, seed=10 + n) for n in (21, 34, 17))
    mixed = PagedRunner(model, config)
    # History: b is decoding (33 cached), c is mid chunked prefill (10 cached), a is new.
    mixed.step([(1, b[:33]), (2, c[:10])])
    logits_b, logits_a, logits_c = mixed.step([(1, b[33:]), (0, a), (2, c[10:])])
    assert logits_b.shape[0] == 1 and logits_a.shape[0] == 21 and logits_c.shape[0] == 7

    for seq_id, ids, got, new in ((1, b, logits_b, 1), (0, a, logits_a, 21), (2, c, logits_c, 7)):
        alone = PagedRunner(model, config).step([(seq_id, ids)])[0][-new:]
        assert rel_error(got, alone) < TOLERANCE
        assert rel_error(got, reference_logits(reference, ids)[-new:]) < TOLERANCE


def test_batched_decodes_of_different_lengths(tiny):
    model, config, reference = tiny
    seqs = [prompt_ids(config.vocab_size, n, seed=n) for n in (5, 18, 40)]
    runner = PagedRunner(model, config)
    runner.step([(i, ids[:-1]) for i, ids in enumerate(seqs)])
    decoded = runner.step([(i, ids[-1:]) for i, ids in reversed(list(enumerate(seqs)))])
    for ids, got in zip(reversed(seqs), decoded, strict=True):
        assert rel_error(got[0], reference_logits(reference, ids)[-1]) < TOLERANCE


# --- tiny models converted to GGUF the way llama.cpp does -------------------------------

TINY_GGUF_MODELS = {
    "llama": ("llama", {}),  # q/k rows permuted by the converter, untied output.weight
    "llama-linear-rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "mistral": ("mistral", {"tie_word_embeddings": True}),
    "qwen2": ("qwen2", {}),  # qkv bias, not permuted
    "qwen3": ("qwen3", {"tie_word_embeddings": True}),  # q/k norm, not permuted
}


@pytest.mark.parametrize("name", list(TINY_GGUF_MODELS))
def test_tiny_gguf_matches_transformers(name, tmp_path):
    arch, overrides = TINY_GGUF_MODELS[name]
    hf_dir = write_tiny_model(tmp_path / "hf", arch, **overrides)
    gguf_path = write_tiny_gguf(hf_dir, tmp_path / "model.gguf")
    model, config = load_model(gguf_path, torch.float32, "cpu", TorchPagedAttention())
    hf_config = read_hf_config(hf_dir)
    assert config.rms_norm_eps == pytest.approx(hf_config.rms_norm_eps)  # GGUF stores float32
    # llama.cpp names Mistral "llama": same network.
    same = dataclasses.replace(
        hf_config, rms_norm_eps=config.rms_norm_eps, architecture=config.architecture
    )
    assert config == same

    reference = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    ids = prompt_ids(config.vocab_size, 37, seed=4)
    runner = PagedRunner(model, config)
    ours = torch.cat([runner.step([(0, ids[:20])])[0], runner.step([(0, ids[20:])])[0]])
    assert rel_error(ours, reference_logits(reference.eval(), ids)) < TOLERANCE


# --- SmolLM2-135M-Instruct from its Q4_1 GGUF ------------------------------------------

SMOLLM2_PROMPTS = [
    # "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198],
    # "The quick brown fox"
    [504, 2365, 6354, 16438],
    # "def fibonacci(n):"
    [1604, 3987, 46477, 24, 94, 727],
]


@pytest.fixture(scope="module")
def smollm2_ours(smollm2_gguf: Path):
    return load_model(smollm2_gguf, torch.float32, "cpu", TorchPagedAttention())


@pytest.fixture(scope="module")
def smollm2_reference_from_raw_gguf(smollm2_gguf: Path):
    """transformers' Llama with the GGUF's tensors converted by transformers' and gguf's own
    code (dequantize, llama.cpp's q/k row order undone, names mapped), none of ours.
    Built directly because transformers' from_pretrained(gguf_file=) takes ~30 s."""
    from gguf import MODEL_ARCH, GGUFReader, get_tensor_name_map
    from gguf.quants import dequantize
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    # SmolLM2-135M's published shape; test_smollm2_config_from_gguf checks we read the same.
    config = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):  # skips 4 s of random init; weights are assigned below
        reference = transformers.LlamaForCausalLM(config)
    gguf_to_hf = {}
    name_map = get_tensor_name_map(MODEL_ARCH.LLAMA, config.num_hidden_layers)
    for hf_name in reference.state_dict():
        base, suffix = hf_name.rsplit(".", 1)
        if (gguf_base := name_map.get_name(base)) is not None:
            gguf_to_hf[f"{gguf_base}.{suffix}"] = hf_name
    processor = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    state = {}
    for tensor in GGUFReader(smollm2_gguf).tensors:
        weights = dequantize(tensor.data, tensor.tensor_type)
        weights = processor.process(weights=weights, name=tensor.name).weights
        state[gguf_to_hf[tensor.name]] = torch.from_numpy(weights.copy())
    result = reference.load_state_dict(state, strict=False, assign=True)
    assert set(result.missing_keys) <= {"lm_head.weight"} and not result.unexpected_keys
    reference.tie_weights()
    assert reference.lm_head.weight is reference.model.embed_tokens.weight
    # Its rope buffers are not weights: build them for real.
    reference.model.rotary_emb = type(reference.model.rotary_emb)(config)
    return reference.eval()


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_gguf: Path):
    """transformers' own GGUF loader end to end."""
    # Needs the `accelerate` package, which transformers requires to read GGUF files.
    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    )
    return model.eval()


def test_smollm2_config_from_gguf(smollm2_ours):
    _, config = smollm2_ours
    assert config.architecture == "LlamaForCausalLM"
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert config.vocab_size == 49152 and config.tie_word_embeddings
    assert config.rope_theta == 100000.0 and config.max_position_embeddings == 8192
    assert config.rms_norm_eps == pytest.approx(1e-5)
    assert config.eos_token_ids == (2,) and config.bos_token_id == 1


def test_smollm2_logits_match_transformers(smollm2_ours, smollm2_reference_from_raw_gguf):
    model, config = smollm2_ours
    for ids in SMOLLM2_PROMPTS:
        ours = PagedRunner(model, config, num_blocks=16).step([(0, ids)])[0]
        expected = reference_logits(smollm2_reference_from_raw_gguf, ids)
        assert rel_error(ours[-1], expected[-1]) < TOLERANCE
        assert rel_error(ours, expected) < TOLERANCE


@pytest.mark.slow
def test_smollm2_matches_transformers_gguf_loading(smollm2_ours, smollm2_reference):
    """Logits and 32 greedy tokens per prompt against AutoModelForCausalLM(gguf_file=...)."""
    model, config = smollm2_ours
    runner = PagedRunner(model, config, num_blocks=32)
    for seq_id, prompt in enumerate(SMOLLM2_PROMPTS):
        expected = reference_logits(smollm2_reference, prompt)[-1]
        ours = PagedRunner(model, config, num_blocks=16).step([(0, prompt)])[0][-1]
        assert rel_error(ours, expected) < TOLERANCE

        generated = runner.greedy(seq_id, prompt, 32, config.eos_token_ids)
        expected_ids = hf_greedy(
            smollm2_reference, prompt, 32, config.eos_token_ids, pad_token_id=2
        )
        assert generated == expected_ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 8, 33])
def test_cpu_linear_is_x_times_weight_transposed(dtype: torch.dtype, rows: int) -> None:
    """Whichever library the CPU's linear() takes for the dtype and row count (oneDNN, or
    MKL), with and without a bias, on a contiguous and on a transposed input."""
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(48, 40, generator=generator).to(dtype)
    bias = torch.randn(48, generator=generator).to(dtype)
    x = torch.randn(40, rows, generator=generator).to(dtype).T  # strided, as a layer gets it
    tolerance = (
        {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.2, "rtol": 0.02}
    )
    for b in (None, bias):
        expected = x.double() @ weight.double().T + (0 if b is None else b.double())
        for given in (x, x.contiguous()):
            got = linear(given, weight, b)
            assert got.dtype == dtype and got.shape == (rows, 48)
            torch.testing.assert_close(got.double(), expected, **tolerance)
