"""DeepSeek-V4 against Hugging Face transformers on a tiny random checkpoint.

Four layers: one sliding-only, two compressed sparse (CSA, m = 4, the indexer keeping 4 of
the entries) and one heavily compressed (HCA, m = 16 here so that a 70-token prompt closes
several of its windows; the released rates, 4 and 128, in a test of their own);
hash-routed MoE on the first layer, top-k on the others; four hyper-connection streams.
The sliding window (8) is far shorter than the prompt, so the compressed entries carry the
long-range context. Every parameter is drawn away from its
init (sinks, position biases, correction biases, hyper-connection bases and scales, the
hash table), so a skipped term diverges at once.
"""

from __future__ import annotations  # noqa: I001  (slotserve preloads OpenBLAS before MLX)

import json
from pathlib import Path
from typing import Any

import slotserve  # noqa: F401
import mlx.core as mx
import numpy as np
import pytest

from slotserve.model import layers
from slotserve.model.families import deepseek_v4
from slotserve.model.layers import Batch
from slotserve.model.loader import load
from slotserve.runtime.plain import greedy_tokens

from converted import _cached, _digest
from model_checks import assert_mixed_decode_matches_solo, hf_greedy

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPT = [int(t) for t in np.random.RandomState(7).randint(0, 320, 70)]
NEW_TOKENS = 32

CONFIG = dict(
    vocab_size=320, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=1, head_dim=32, q_lora_rank=32,
    partial_rotary_factor=0.5, num_experts_per_tok=2, n_routed_experts=8, n_shared_experts=1,
    layer_types=["sliding_attention", "compressed_sparse_attention",
                 "heavily_compressed_attention", "compressed_sparse_attention"],
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    hc_mult=4, sliding_window=8, o_groups=2, o_lora_rank=16, index_n_heads=16,
    index_head_dim=16, index_topk=4, max_position_embeddings=4096, rms_norm_eps=1e-6,
    tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
)


def randomize(hf: Any, seed: int, std: float = 0.1) -> Any:
    """Weights of a trained model's scale, every bias, sink and table off its init."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith(("hc.scale", "hc_scale")):
                p.copy_(1.0 + 0.5 * torch.randn_like(p))
            elif name.endswith(("hc.base", "hc_base", "sinks", "position_bias")):
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, std)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
            elif name.endswith("tid2eid"):
                n = hf.config.n_routed_experts
                b.copy_(torch.stack([torch.randperm(n)[: b.shape[1]] for _ in range(b.shape[0])]))
    return hf.to(torch.float32).eval()


def make_checkpoint(path: Path, seed: int = 0, **overrides: Any) -> tuple[Path, Any]:
    hf = randomize(transformers.DeepseekV4ForCausalLM(
        transformers.DeepseekV4Config(**{**CONFIG, **overrides})), seed)
    hf.save_pretrained(path, safe_serialization=True)
    return path, hf


def _hf_logits(hf: Any, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float().numpy()


@pytest.fixture(scope="module")
def checkpoint() -> Path:
    """The tiny checkpoint with transformers' answers for it (the prompt's logits, 32 greedy
    tokens), built once into the content-keyed cache of tests/converted.py."""
    key = _digest("deepseek_v4-oracle", CONFIG, PROMPT, NEW_TOKENS, transformers.__version__,
                  torch.__version__)

    def make(tmp: Path) -> None:
        _, hf = make_checkpoint(tmp)
        np.save(tmp / "hf_logits.npy", _hf_logits(hf, PROMPT))
        (tmp / "hf_greedy.json").write_text(json.dumps(hf_greedy(hf, PROMPT, NEW_TOKENS)))

    return _cached("deepseek_v4-oracle", key, make)


@pytest.fixture(scope="module")
def model(checkpoint: Path) -> Any:
    return load(checkpoint, device="cpu", with_tokenizer=False).model


def test_config_and_prefill_logits_match_hf(checkpoint: Path) -> None:
    loaded = load(checkpoint, device="cpu", with_tokenizer=False)
    cfg = loaded.config
    assert isinstance(cfg, deepseek_v4.Config) and cfg.family == "deepseek_v4"
    assert cfg.rope_dim == 16 and cfg.compress_rates[deepseek_v4.HCA] == 16
    model = loaded.model
    kv = model.new_kv()
    assert isinstance(kv, deepseek_v4.CompressedKV)
    n = len(PROMPT)
    ours = model(mx.array(PROMPT), Batch.build([(kv, 0, n)]), logit_rows=list(range(n)))
    diff = np.abs(np.array(ours) - np.load(checkpoint / "hf_logits.npy")).max()
    assert diff <= 1e-3, f"max |logit diff| = {diff}"


def test_greedy_decode_matches_hf_generate(checkpoint: Path, model: Any) -> None:
    want = json.loads((checkpoint / "hf_greedy.json").read_text())
    assert len(want) == NEW_TOKENS
    assert greedy_tokens(model, PROMPT, NEW_TOKENS) == want


def test_mixed_decode_is_batch_invariant(model: Any) -> None:
    assert_mixed_decode_matches_solo(model, PROMPT, [5, 77, 190])


def test_released_compress_rates_match_hf() -> None:
    """The released models' rates (CSA 4, HCA 128: one entry a page) over a 400-token prompt
    (three HCA windows close), prefilled whole and in chunks of 77 (cut inside windows)."""
    rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    tokens = [int(t) for t in np.random.RandomState(9).randint(0, 320, 400)]
    overrides = dict(compress_rates=rates, sliding_window=32, index_topk=16)
    key = _digest("deepseek_v4-rates", CONFIG, overrides, tokens, transformers.__version__,
                  torch.__version__)

    def make(tmp: Path) -> None:
        _, hf = make_checkpoint(tmp, **overrides)
        np.save(tmp / "hf_logits.npy", _hf_logits(hf, tokens))

    path = _cached("deepseek_v4-rates", key, make)
    model = load(path, device="cpu", with_tokenizer=False).model
    want = np.load(path / "hf_logits.npy")
    for chunk in (len(tokens), 77):
        kv, out = model.new_kv(), []
        for s in range(0, len(tokens), chunk):
            n = min(chunk, len(tokens) - s)
            out.append(np.array(model(mx.array(tokens[s : s + n]), Batch.build([(kv, s, n)]),
                                      list(range(n)))))
        assert np.abs(np.concatenate(out) - want).max() <= 1e-3, chunk


def test_attention_products_have_one_shape(model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """MLX's GPU matmuls (cuBLAS) pick their algorithm, and so their rounding, by the whole
    product's shape and batch count: the H200 gave a prompt's last logits other bits
    prefilled whole than cut at 64 while the CPU did not. So attention and the indexer's
    scores take a segment's rows in tiles of ROW_TILE and the entries a block (an index
    group) a product: a whole prefill, cut ones and a decode step issue products of the
    same few shapes, whatever the lengths (recorded here on the CPU, where the bits happen
    to agree either way)."""
    shapes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    product = deepseek_v4.product

    def spy(a: mx.array, b: mx.array) -> mx.array:
        shapes.append((a.shape, b.shape))
        return product(a, b)

    monkeypatch.setattr(deepseek_v4, "product", spy)
    n, runs = len(PROMPT), []
    for cuts in ([], [33], [5, 6, 41]):  # whole; cut inside CSA and HCA windows; 1 row
        kv, start = model.new_kv(), 0
        for end in [*cuts, n]:
            mx.eval(model(mx.array(PROMPT[start:end]), Batch.build([(kv, start, end - start)]),
                          [end - start - 1]))
            start = end
        mx.eval(model(mx.array(PROMPT[:1]), Batch.build([(kv, n, 1)]), [0]))  # a decode step
        runs.append(set(shapes))
        shapes.clear()
    cfg, tile = model.config, deepseek_v4.ROW_TILE
    hd, w, c = cfg.head_dim, cfg.sliding_window, min(cfg.index_topk, deepseek_v4.ENTRY_BLOCK)
    heads, hi, di = cfg.num_heads, cfg.index_n_heads, cfg.index_head_dim
    assert runs[0] == runs[1] == runs[2] == {
        ((tile, heads, hd), (tile, hd, w)), ((tile, heads, w), (tile, w, hd)),  # window
        ((tile, heads, hd), (hd, deepseek_v4.ENTRY_BLOCK)),  # an HCA block
        ((tile, heads, deepseek_v4.ENTRY_BLOCK), (deepseek_v4.ENTRY_BLOCK, hd)),
        ((tile, heads, hd), (tile, hd, c)), ((tile, heads, c), (tile, c, hd)),  # CSA's
        ((tile, hi, di), (di, deepseek_v4.INDEX_GROUP)),  # an index group's scores
    }, runs


def test_bf16_policy_follows_transformers(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU's compute policy (bfloat16, quantized weights kept) run on the CPU against
    transformers in float32: bf16 rounding only, within 5 % of the logits' scale, as
    tests/test_gpu_deepseek_v4.py asks of the GPU, on the same checkpoint (hash routing and
    an indexer keeping every entry: no discrete choice for bf16 noise to flip). Catches a
    value computed in bf16 where transformers keeps float32 without a GPU. MLX's CPU
    gather_mm takes float32 only; the GPU's bf16 one accumulates in float32 and rounds its
    result to bf16, which the wrapper does."""
    from slotserve.model.loader import read_checkpoint

    path, hf = make_checkpoint(tmp_path, mlp_layer_types=["hash_moe"] * 4, index_topk=32)
    gather_mm = mx.gather_mm

    def bf16_gather_mm(a: mx.array, b: mx.array, *args: Any, **kw: Any) -> mx.array:
        return gather_mm(a.astype(mx.float32), b.astype(mx.float32), *args, **kw).astype(a.dtype)

    monkeypatch.setattr(mx, "gather_mm", bf16_gather_mm)
    cfg, weights, _ = read_checkpoint(path)
    model = deepseek_v4.Model(cfg, weights, mx.bfloat16, True)  # type: ignore[arg-type]
    n = len(PROMPT)
    out = model(mx.array(PROMPT), Batch.build([(model.new_kv(), 0, n)]), list(range(n)))
    assert out is not None and model.dtype == mx.bfloat16
    ours, ref = np.array(out.astype(mx.float32)), _hf_logits(hf, PROMPT)
    scale = np.abs(ref).max()
    assert np.abs(ours - ref).max() <= 0.05 * scale, (np.abs(ours - ref).max(), scale)
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


def test_every_matmul_sees_the_row_floor(model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The start-up probe pads every row batch to the row count from which the device's
    matmuls round a row alike however many there are (8 on the H200; 1 on this CPU, where
    so a short one cannot show): a prefill and a decode step of two sequences, every Linear
    of it (the hyper-head's over the logit rows too) takes at least that many rows."""
    floor = 8
    monkeypatch.setattr(layers, "LINEAR_ROW_FLOOR", floor)
    rows: list[tuple[int, tuple[int, ...]]] = []
    call = layers.Linear.__call__

    def spy(self: layers.Linear, x: mx.array, *args: Any, **kw: Any) -> mx.array:
        rows.append((x.shape[0], tuple(self.w.shape) if self.w is not None else ()))
        return call(self, x, *args, **kw)

    monkeypatch.setattr(layers.Linear, "__call__", spy)
    a, b = model.new_kv(), model.new_kv()
    mx.eval(model(mx.array(PROMPT[:3]), Batch.build([(a, 0, 3)]), [2]))
    mx.eval(model(mx.array(PROMPT[:2]), Batch.build([(a, 3, 1), (b, 0, 1)]), [0, 1]))
    short = sorted({(r, w) for r, w in rows if r < floor})  # (rows, weight shape)
    assert rows and not short, short
