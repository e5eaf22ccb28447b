"""The model layers' structure and the family facts, on any machine.

- A gated MLP stores its gate+up rows in the order its own `split` reads them: tile pairs
  for the CUDA 4-bit SwiGLU epilogue, halves otherwise (issue #19: gemma3's MLP inherited
  the pairing and sliced plain halves, wrong outputs on CUDA with 4-bit weights). Built here
  as for the CUDA kernel (cuda.enabled() patched on; q4_pack is plain MLX), no GPU needed.
- On the CUDA path, a family's per-head q/k norms are applied to the fused QKV rows the
  attention kernel reads (the kernel itself is replaced by a recorder).
- Built as for the GPU's MLX ops (bfloat16, weights kept quantized), a checkpoint with float32
  4-bit scales still hands only bfloat16 operands to MLX's matmuls (float32 ones took MLX
  0.32.4's CUDA gather_mm past its shared-memory limit: the gpt-oss GPU test).
- Where weights stay quantized (the GPU), a matrix of one quantization group a row is held
  dense (MLX 0.32.4's CUDA quantized_matmul gave NaN rows for tiny-gemma4's 256 x 64).
- Models declare their matmuls (`linears`) and arrays; the family objects map checkpoint
  names (GGUF conventions, config keys) both ways.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from slotserve.kernels import cuda
from slotserve.model import families, layers
from slotserve.model.config import ModelConfig, config_from_hf
from slotserve.model.errors import UnsupportedModelError
from slotserve.model.families import gemma3, llama, qwen3, qwen3_moe
from slotserve.model.kv import KVPool, SlotKV
from slotserve.model.weights import QuantizedWeight, read_gguf
from slotserve.tools.export import hf_config

HIDDEN, INTER = 128, 64


def _q4(rows: int, cols: int, seed: int) -> QuantizedWeight:
    w = mx.random.normal((rows, cols), key=mx.random.key(seed))
    return QuantizedWeight(*mx.quantize(w, group_size=64, bits=4), 64, 4)


@pytest.fixture
def as_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Layers built as on a CUDA GPU (their kernels are not run here)."""
    monkeypatch.setattr(cuda, "enabled", lambda: True)


@pytest.mark.usefixtures("as_on_cuda")
@pytest.mark.parametrize("family", [llama, gemma3])
def test_gate_up_rows_come_back_through_the_mlps_own_split(family: Any) -> None:
    w = {"mlp.gate_proj.weight": _q4(INTER, HIDDEN, 1), "mlp.up_proj.weight": _q4(INTER, HIDDEN, 2),
         "mlp.down_proj.weight": _q4(HIDDEN, INTER, 3)}
    mlp = family.MLP(w, "mlp", mx.bfloat16, True)
    assert mlp.gate_up.q4 is not None, "gate+up runs on the CUDA 4-bit kernel"
    # only the SwiGLU epilogue reads tile pairs: llama's MLP pairs its rows, gemma's does not
    assert mlp.paired == (family is llama)
    assert mlp.backend is (layers.Backend.CUDA if family is llama else layers.Backend.MLX)
    stored = mlp.gate_up.q.dequantize(mx.float32)  # [2 * INTER, HIDDEN] as the layer keeps it
    gate, up = mlp.split(stored.T)  # the rows as output columns: what a product puts there
    assert mx.array_equal(gate, w["mlp.gate_proj.weight"].dequantize(mx.float32).T).item()
    assert mx.array_equal(up, w["mlp.up_proj.weight"].dequantize(mx.float32).T).item()


def test_split_undoes_paired_rows_for_any_product() -> None:
    """The pairing is a permutation of the product's columns that split inverts exactly."""
    mlp = llama.MLP({"mlp.gate_proj.weight": mx.zeros((INTER, HIDDEN)),
                     "mlp.up_proj.weight": mx.zeros((INTER, HIDDEN)),
                     "mlp.down_proj.weight": mx.zeros((HIDDEN, INTER))}, "mlp", mx.float32, False)
    gu = mx.random.normal((5, 2 * INTER), key=mx.random.key(4))
    assert not mlp.paired
    halves = mlp.split(gu)
    mlp.paired = True
    paired = mlp.split(gu[:, cuda.paired_rows(INTER)])
    assert all(mx.array_equal(a, b).item() for a, b in zip(halves, paired, strict=True))


@pytest.mark.usefixtures("as_on_cuda")
def test_cuda_attention_gets_the_qkv_rows_with_normed_heads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = ModelConfig("qwen3", hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                      head_dim=16, intermediate_size=128, vocab_size=32, rms_norm_eps=1e-6)
    p, d = "self_attn", 16
    rng = np.random.default_rng(0)
    w = {f"{p}.{n}.weight": mx.array(rng.standard_normal(shape).astype(np.float32) * 0.1)
         for n, shape in [("q_proj", (64, 64)), ("k_proj", (32, 64)), ("v_proj", (32, 64)),
                          ("o_proj", (64, 64)), ("q_norm", (d,)), ("k_norm", (d,))]}
    rope = layers.Rope(d, 10000.0, None, mx.bfloat16)
    attn = qwen3.Attention(cfg, w, p, 0, rope, mx.bfloat16, True)
    assert attn.backend is layers.Backend.CUDA
    seen: dict[str, Any] = {}

    def recorder(qkv: mx.array, cos: mx.array, sin: mx.array, *args: Any,
                 sinks: mx.array | None = None, tiles: mx.array | None = None,
                 merge: bool = False) -> mx.array:
        seen.update(qkv=qkv, cos=cos, window=args[-1], one_row=args[-2], sinks=sinks,
                    tiles=tiles, merge=merge)
        return mx.zeros((qkv.shape[0], 64), mx.bfloat16)

    monkeypatch.setattr(cuda, "rope_attention", recorder)
    pool = KVPool(1, 2, d, mx.bfloat16)
    batch = layers.Batch.build([(SlotKV(pool), 0, 3)])
    assert batch.cuda is not None
    x = mx.array(rng.standard_normal((3, 64)).astype(np.float32)).astype(mx.bfloat16)
    attn(x, batch)
    qkv = x @ attn.qkv.w.T
    q, k, v = qkv[:, :64].reshape(3, 4, d), qkv[:, 64:96].reshape(3, 2, d), qkv[:, 96:]
    want = mx.concatenate([attn.q_norm(q).reshape(3, -1), attn.k_norm(k).reshape(3, -1), v],
                          axis=1)
    assert mx.array_equal(seen["qkv"], want).item()
    assert seen["cos"] is rope.cos and rope.size > 3 and seen["window"] is None
    assert seen["sinks"] is None  # qwen3 has no attention sinks
    assert seen["tiles"].tolist() == [0]  # the 3-row prompt is one tile
    assert seen["merge"] is False  # within one attention split: nothing to fold
    assert not seen["one_row"] and len(batch.effects) == 1  # its K/V writes are evaluated


def test_mlx_ops_on_the_gpu_keep_bfloat16_activations(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """gpt-oss's GPU test file (4-bit projections quantized from float32 weights, so float32
    scales) built as the GPU builds it for MLX ops (bfloat16, weights kept quantized): every
    matmul of a prefill gets bfloat16 operands. MLX's affine matmul returns the promotion of x's
    and the scales' dtypes; float32 activations took MLX 0.32.4's CUDA gather_mm past its
    shared-memory limit (cuGraphAddKernelNode: invalid argument) in the GPU test. Only the
    graph is built: MLX's CPU gather_mm has no bfloat16 form."""
    from test_gpu_families import LAYERS, V, write_checkpoint

    from slotserve.model import loader

    path = write_checkpoint("gpt-oss", tmp_path / "gpt-oss")
    cfg, weights, _ = loader.read_checkpoint(path)
    model = loader.build_model(cfg, weights, "gpu", path)
    assert {b.attn.backend for b in model.layers} == {layers.Backend.MLX}
    seen: list[tuple[str, set[mx.Dtype]]] = []

    def spy(name: str) -> Any:
        real = getattr(mx, name)

        def op(*args: Any, **kwargs: Any) -> mx.array:
            seen.append((name, {a.dtype for a in args if isinstance(a, mx.array)
                                and mx.issubdtype(a.dtype, mx.floating)}))
            return real(*args, **kwargs)

        return op

    for name in ("gather_mm", "gather_qmm", "quantized_matmul"):
        monkeypatch.setattr(mx, name, spy(name))
    n = 88  # the GPU test's prefill: 176 query rows per kv head in attention
    tokens = mx.arange(n, dtype=mx.int32) * 7 % V
    model(tokens, layers.Batch.build([(model.new_kv(), 0, n)]), [n - 1])
    # per layer: QKV, o, two score/value products, two expert products; and the lm_head
    assert sorted({name for name, _ in seen}) == ["gather_mm", "gather_qmm", "quantized_matmul"]
    assert len(seen) == 6 * LAYERS + 1
    wider = [(name, dtypes) for name, dtypes in seen if dtypes != {mx.bfloat16}]
    assert not wider, wider


@pytest.mark.parametrize("in_dim, dense", [(64, True), (128, False)])
def test_one_group_rows_are_held_dense_where_weights_stay_quantized(in_dim: int,
                                                                   dense: bool) -> None:
    """Built as for the GPU (bfloat16, weights kept quantized), a 4-bit matrix whose rows are
    one 64-wide group (tiny-gemma4's per-layer projection, 256 x 64) is held dense: MLX 0.32's
    CUDA quantized_matmul sends exactly such matrices to its qmm_sm90 kernel, whose rows came
    back NaN on the H200 (tests/test_gpu_gemma4.py); a wider one stays quantized. Either way
    the product is the dequantized codes' (bfloat16 rounding)."""
    q = _q4(256, in_dim, 3)
    lin = layers.Linear(q, mx.bfloat16, keep_quantized=True)
    assert (lin.q is None, lin.w is not None) == (dense, dense)
    assert lin.w is None or lin.w.dtype == mx.bfloat16
    x = mx.random.normal((5, in_dim), key=mx.random.key(4)).astype(mx.bfloat16)
    got = lin(x)
    want = x.astype(mx.float32) @ q.dequantize(mx.float32).T
    assert got.dtype == mx.bfloat16 and got.shape == (5, 256)
    assert float(mx.abs(got.astype(mx.float32) - want).max()) < 0.05 * float(mx.abs(want).max())


def _tiny_llama(tied: bool) -> tuple[Any, ModelConfig]:
    cfg = ModelConfig("llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=16, intermediate_size=128, vocab_size=96, tie_embeddings=tied)
    rng = np.random.default_rng(1)
    shapes = {"model.embed_tokens": (96, 64), "model.norm": (64,)}
    if not tied:
        shapes["lm_head"] = (96, 64)
    for i in range(2):
        p = f"model.layers.{i}"
        shapes.update({f"{p}.self_attn.q_proj": (64, 64), f"{p}.self_attn.k_proj": (32, 64),
                       f"{p}.self_attn.v_proj": (32, 64), f"{p}.self_attn.o_proj": (64, 64),
                       f"{p}.mlp.gate_proj": (128, 64), f"{p}.mlp.up_proj": (128, 64),
                       f"{p}.mlp.down_proj": (64, 128), f"{p}.input_layernorm": (64,),
                       f"{p}.post_attention_layernorm": (64,)})
    w = {f"{n}.weight": mx.array(rng.standard_normal(s).astype(np.float32))
         for n, s in shapes.items()}
    return llama.Model(cfg, w, mx.float32, False), cfg


@pytest.mark.parametrize("tied", [True, False])
def test_linears_are_the_models_declared_matmuls(tied: bool) -> None:
    model, _ = _tiny_llama(tied)
    want = [lin for b in model.layers
            for lin in (b.attn.qkv, b.attn.o, b.mlp.gate_up, b.mlp.down)] + [model.lm_head]
    assert [id(lin) for lin in model.linears()] == [id(lin) for lin in want]
    assert (model.lm_head is model.embed.linear) == tied  # a lookup is not a matmul
    held = {id(a) for a in model.arrays()}
    assert {id(a) for b in model.layers for a in (b.in_norm.weight, b.post_norm.weight)} <= held
    assert id(model.rope.inv_freq) in held and id(model.norm.weight) in held


def test_families_found_by_their_checkpoint_names() -> None:
    assert families.for_hf({"architectures": ["MistralForCausalLM"]}, "x") is llama.FAMILY
    assert families.for_hf({"model_type": "gemma3_text"}, "x") is gemma3.FAMILY
    assert families.for_gguf({"general.architecture": "qwen3moe"}, "x") is qwen3_moe.FAMILY
    with pytest.raises(UnsupportedModelError, match=r"m/: unsupported architecture.*Qwen3"):
        families.for_hf({"architectures": ["BertModel"]}, "m/")
    with pytest.raises(UnsupportedModelError, match=r"f.gguf: unsupported GGUF.*'qwen3moe'"):
        families.for_gguf({"general.architecture": "bert"}, "f.gguf")


def _gguf_cfg(family: str) -> ModelConfig:
    return ModelConfig(family, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
                       head_dim=4, intermediate_size=8, vocab_size=4)


def test_gguf_names_and_layouts_are_each_familys() -> None:
    rows = mx.arange(8 * 8, dtype=mx.float32).reshape(8, 8)
    raw = {"blk.0.attn_q.weight": rows, "blk.0.attn_k.weight": rows[:4],
           "blk.0.ffn_norm.weight": mx.ones((8,)), "output_norm.weight": mx.ones((8,))}
    # llama: llama.cpp interleaved the Q/K rows of each head (undone), ffn_norm is the
    # post-attention norm, norms as stored
    got = read_gguf(Path("l.gguf"), llama.FAMILY, _gguf_cfg("llama"), raw)
    assert got["model.layers.0.self_attn.q_proj.weight"][:, 0].tolist() == [
        0, 16, 8, 24, 32, 48, 40, 56]
    assert got["model.layers.0.self_attn.k_proj.weight"][:, 0].tolist() == [0, 16, 8, 24]
    assert "model.layers.0.post_attention_layernorm.weight" in got
    # gemma3: rows as stored, ffn_norm is the norm before the MLP, norms stored +1
    extra = {"blk.0.post_ffw_norm.weight": mx.ones((8,)), "blk.0.attn_q_norm.weight": mx.ones((4,))}
    got = read_gguf(Path("g.gguf"), gemma3.FAMILY, _gguf_cfg("gemma3"), {**raw, **extra})
    assert mx.array_equal(got["model.layers.0.self_attn.q_proj.weight"], rows).item()
    for name in ("model.layers.0.pre_feedforward_layernorm", "model.norm",
                 "model.layers.0.post_feedforward_layernorm", "model.layers.0.self_attn.q_norm"):
        assert not mx.any(got[f"{name}.weight"]).item(), name
    # a tensor name the family does not have
    with pytest.raises(UnsupportedModelError, match="blk.0.attn_q_norm"):
        read_gguf(Path("l.gguf"), llama.FAMILY, _gguf_cfg("llama"), {**raw, **extra})
    head_norm = {"blk.0.attn_q_norm.weight": mx.ones((4,))}
    got = read_gguf(Path("q.gguf"), qwen3.FAMILY, _gguf_cfg("qwen3"), {**raw, **head_norm})
    assert "model.layers.0.self_attn.q_norm.weight" in got


@pytest.mark.parametrize(("family", "extra"), [
    ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 2.0})),
    ("gemma3", dict(sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                    rope_local_theta=500.0, query_pre_attn_scalar=24.0,
                    final_logit_softcapping=30.0, tie_embeddings=True)),
    ("qwen3_moe", dict(num_experts=8, experts_per_token=2, moe_intermediate_size=32,
                       norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[1])),
])
def test_config_round_trips_through_export(family: str, extra: dict[str, Any]) -> None:
    spec = families.family(family)
    cfg = spec.config(family, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=16, intermediate_size=128, vocab_size=96, rms_norm_eps=1e-6,
                      rope_theta=1e6, max_position=512, **extra)
    tok = SimpleNamespace(bos_id=1, eos_id=2, pad_id=None)
    written = hf_config(cfg, tok, "float32")  # type: ignore[arg-type]
    assert written["architectures"] == [spec.hf_architectures[0]]
    assert config_from_hf(written, families.for_hf(written, "x"), "x") == cfg
