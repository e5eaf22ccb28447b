"""Tensor parallelism over `mx.distributed`: one process per rank, each holding 1/N of every
block's projections, driven step by step by rank 0.

The split (Megatron's): q/k/v and gate/up are split by output rows (whole heads, whole MLP
columns), o and down by input columns, so each rank computes its heads' attention and its
share of the MLP, and one `all_sum` after o and one after down give every rank the full
residual stream. Norms, the embedding and the lm_head are replicated. Each rank's KV pool
holds its own kv heads for the same page ids, so one page table addresses all of them.

Only collectives are used (`all_sum`): MLX's NCCL backend has no send/recv. Rank 0 runs the
whole engine (Batcher, actors, sampling); its model is a `Driver`, which before each forward
sends the step to the other ranks as bytes summed with their zeros (`_broadcast`): the
tokens, each part's page ids, start and length, the logit rows, the row floor, and the KV
copies (`KVPool.copy_positions`) rank 0 made since the last step, in order. The other ranks
(`serve_worker`) run the same forward on the same inputs and evaluate the same arrays, so
the collectives pair up one for one.

Invariance: a rank's share is the same kernels on the same rows whatever the batch (the
invariance rules), and with two ranks `all_sum` is one addition of two shares, the same bits
in any order, so a row's result still does not depend on its batch. With more ranks that
holds only where the backend's reduction order does not depend on the message size (NCCL
picks its algorithm and chunks by size: untested here beyond two ranks). It is not the
single-process result bit for bit: a split matmul rounds its halves before adding them (the
tests compare tokens, greedy and seeded).

Runs the families with plain pre-norm blocks (llama, qwen2, qwen3, qwen3_moe); heads, kv
heads and the MLP and expert widths must divide by N. Each expert is split like the MLP
(its gate/up rows, its down columns): every rank routes every row alike (the router is
replicated) and runs its part of the chosen experts, and the weighted sum of the parts is
the all_sum of the ranks' weighted sums.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import structlog

from slotserve.kernels.quantized import QuantizedWeight
from slotserve.model import layers, loader
from slotserve.model.config import ModelConfig
from slotserve.model.decoder import Decoder, PreNormBlock
from slotserve.model.errors import UnsupportedModelError
from slotserve.model.kv import KVPool, SlotKV
from slotserve.model.layers import Batch, GatedMLP
from slotserve.model.moe import SparseMoE
from slotserve.model.weights import Tensor

log = structlog.get_logger("slotserve.parallel")

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe")
ROWS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # split by output rows
COLUMNS = ("o_proj", "down_proj")  # split by input columns
STEP, STOP = 1, 2


# ---- the group -------------------------------------------------------------------------------


def rank_from_env() -> int:
    """This process's rank as the launcher set it (MLX_RANK; 0 when unset)."""
    return int(os.environ.get("MLX_RANK", "0") or 0)


def init_group(size: int, device: str) -> Any:
    """The global group of `size` ranks: NCCL on a GPU, the ring (TCP) backend on the CPU."""
    backend = "nccl" if device == "gpu" else "ring"
    group = mx.distributed.init(strict=True, backend=backend)
    if group.size() != size:
        raise RuntimeError(f"--tensor-parallel {size} but the {backend} group has "
                           f"{group.size()} ranks (MLX_HOSTFILE / MLX_WORLD_SIZE)")
    return group


# ---- the split -------------------------------------------------------------------------------


def shard_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The config one rank's model is built from: 1/size of the heads and MLP columns."""
    if cfg.family not in FAMILIES:
        raise UnsupportedModelError(
            f"tensor parallel runs the {', '.join(FAMILIES)} families, not {cfg.family}")
    for name, n in (("attention heads", cfg.num_heads), ("kv heads", cfg.num_kv_heads),
                    ("MLP columns", cfg.intermediate_size)):
        if n % size:
            raise UnsupportedModelError(
                f"--tensor-parallel {size}: the model's {n} {name} do not split evenly")
    split = dict(num_heads=cfg.num_heads // size, num_kv_heads=cfg.num_kv_heads // size,
                 intermediate_size=cfg.intermediate_size // size)
    expert_width = getattr(cfg, "moe_intermediate_size", 0)
    if expert_width:
        if expert_width % size:
            raise UnsupportedModelError(f"--tensor-parallel {size}: the experts' "
                                        f"{expert_width} columns do not split evenly")
        split["moe_intermediate_size"] = expert_width // size
    return dataclasses.replace(cfg, **split)


def _take(t: Tensor, axis: int, start: int, stop: int) -> Tensor:
    """t[start:stop] along `axis` of the logical matrix ([.., out, in]; a quantized one's
    packed words and groups along `in`)."""
    if not isinstance(t, QuantizedWeight):
        return t[(slice(None),) * axis + (slice(start, stop),)]
    ndim = t.weight.ndim
    if axis == ndim - 2:
        cut = (slice(None),) * axis + (slice(start, stop),)
        return QuantizedWeight(t.weight[cut], t.scales[cut], t.biases[cut], t.group_size,
                               t.bits)
    if start % t.group_size or (start * t.bits) % 32 or (stop - start) % t.group_size:
        raise UnsupportedModelError(
            f"a matrix quantized in groups of {t.group_size} does not split at column {start}")
    lead = (slice(None),) * (ndim - 1)
    words = lead + (slice(start * t.bits // 32, stop * t.bits // 32),)
    groups = lead + (slice(start // t.group_size, stop // t.group_size),)
    return QuantizedWeight(t.weight[words], t.scales[groups], t.biases[groups], t.group_size,
                           t.bits)


def _dims(t: Tensor) -> tuple[int, int, int]:
    """(ndim, out, in) of a [.., out, in] matrix, quantized or not."""
    if isinstance(t, QuantizedWeight):
        return t.weight.ndim, t.weight.shape[-2], t.scales.shape[-1] * t.group_size
    return t.ndim, t.shape[-2] if t.ndim > 1 else t.shape[0], t.shape[-1]


def _rows(t: Tensor, rank: int, size: int) -> Tensor:
    ndim, out, _ = _dims(t)
    n = out // size
    return _take(t, max(ndim - 2, 0), rank * n, (rank + 1) * n)


def _columns(t: Tensor, rank: int, size: int) -> Tensor:
    ndim, _, cols = _dims(t)
    n = cols // size
    return _take(t, ndim - 1, rank * n, (rank + 1) * n)


def _gate_up_rows(t: Tensor, rank: int, size: int) -> Tensor:
    """Fused [E, 2I, H] gate+up experts (gate rows, then up rows): this rank's gate rows
    then its up rows."""
    ndim, out, _ = _dims(t)
    half = out // 2
    gate, up = _take(t, ndim - 2, 0, half), _take(t, ndim - 2, half, out)
    parts = [_rows(gate, rank, size), _rows(up, rank, size)]
    if isinstance(t, QuantizedWeight):
        a, b = parts
        assert isinstance(a, QuantizedWeight) and isinstance(b, QuantizedWeight)
        return QuantizedWeight(*(mx.concatenate([x, y], axis=ndim - 2) for x, y in (
            (a.weight, b.weight), (a.scales, b.scales), (a.biases, b.biases))),
            t.group_size, t.bits)
    return mx.concatenate(parts, axis=ndim - 2)  # type: ignore[arg-type]


def shard_weights(weights: dict[str, Tensor], rank: int, size: int) -> dict[str, Tensor]:
    """Rank `rank`'s part of each block's projections and experts (HF names: `*.q_proj.weight`,
    stacked `*.experts.gate_proj.weight` [E, out, in], fused `*.experts.gate_up_proj`); the
    rest (norms, embedding, lm_head, the experts' router) is replicated."""
    out: dict[str, Tensor] = {}
    for name, t in weights.items():
        parts = name.split(".")
        last = parts[-1]
        proj = parts[-2] if last in ("weight", "bias") and len(parts) >= 2 else last
        if proj in COLUMNS and last == "bias":
            raise UnsupportedModelError(f"{name}: a bias after a column split would be added "
                                        "once per rank; tensor parallel runs unbiased o/down")
        if proj == "gate_up_proj":
            out[name] = _gate_up_rows(t, rank, size)
        elif proj in ROWS:
            out[name] = _rows(t, rank, size)
        elif proj in COLUMNS:
            out[name] = _columns(t, rank, size)
        else:
            out[name] = t
    return out


class ParallelBlock(PreNormBlock):
    """A pre-norm block whose attention and MLP give this rank's partial sums: the full
    residual stream is x + all_sum(attn) then h + all_sum(mlp)."""

    group: Any = None

    def __call__(self, x: mx.array, batch: Batch) -> mx.array:
        h = x + mx.distributed.all_sum(self.attn(x, batch, norm=self.in_norm), group=self.group)
        m = self.mlp(h, norm=self.post_norm, rows=batch.rows)
        return h + mx.distributed.all_sum(m, group=self.group)


def parallelize(model: Decoder, group: Any) -> Decoder:
    """Make each block of a rank's model sum its partial results over `group`."""
    for i, block in enumerate(model.layers):
        if (not isinstance(block, PreNormBlock)
                or type(block).__call__ is not PreNormBlock.__call__):
            raise UnsupportedModelError(f"tensor parallel needs plain pre-norm blocks, not "
                                        f"{type(block).__name__}")
        mlp = block.mlp
        if isinstance(mlp, SparseMoE):
            if any(b is not None for b in (mlp.router.bias, mlp.gate_up.bias, mlp.down.bias)):
                raise UnsupportedModelError("tensor parallel runs experts without biases")
        elif not isinstance(mlp, GatedMLP):
            raise UnsupportedModelError(f"tensor parallel does not split {type(mlp).__name__}")
        split = ParallelBlock(block.attn, block.mlp, block.in_norm, block.post_norm)
        split.group = group
        model.layers[i] = split
    return model


def load_rank(path: Any, device: str, size: int, rank: int, group: Any,
              probe_rows: int | None, progress: Any = None) -> Any:
    """This rank's part of the model (`loader.LoadedModel`), its blocks summing over `group`;
    the config it reports is the full model's (context, vocabulary, family)."""
    t0 = time.perf_counter()
    p = Path(path) if path else loader.default_model_path()
    dev = loader.pick_device(device)
    cfg, weights, meta = loader.read_checkpoint(p)
    part = shard_config(cfg, size)
    model = loader.build_model(part, shard_weights(weights, rank, size), dev, p)
    del weights
    parallelize(model, group)
    loader.eval_model(model)
    mx.clear_cache()
    report = None
    if probe_rows:
        from slotserve.model.probe import probe_model

        report = probe_model(model, probe_rows)
    tok = None
    if rank == 0:
        from slotserve.model.tokenizer import Tokenizer

        tok = Tokenizer.from_gguf_metadata(meta, str(p)) if meta else Tokenizer.from_hf_dir(p)
    log.info("model part loaded", rank=rank, of=size, path=str(p), heads=part.num_heads,
             kv_heads=part.num_kv_heads)
    return loader.LoadedModel(model, cfg, tok, p, dev, time.perf_counter() - t0, report)


# ---- the step broadcast ----------------------------------------------------------------------


def _broadcast(group: Any, kind: int, payload: bytes) -> None:
    """Rank 0's side: the header (kind, length), then the bytes, each summed with zeros."""
    mx.eval(mx.distributed.all_sum(mx.array([kind, len(payload)], dtype=mx.int32),
                                   group=group))
    if payload:
        data = np.frombuffer(payload, dtype=np.uint8).astype(np.int32)
        mx.eval(mx.distributed.all_sum(mx.array(data), group=group))


def _receive(group: Any) -> tuple[int, bytes]:
    """A worker's side of `_broadcast`."""
    head = mx.distributed.all_sum(mx.zeros((2,), dtype=mx.int32), group=group)
    kind, n = (int(v) for v in np.array(head))
    if not n:
        return kind, b""
    data = mx.distributed.all_sum(mx.zeros((n,), dtype=mx.int32), group=group)
    return kind, np.array(data).astype(np.uint8).tobytes()


class MirroredPool(KVPool):
    """Rank 0's KV pool: the copies it makes are logged, for the other ranks to repeat."""

    log: list[tuple[int, int, int, int]]

    def copy_positions(self, src: int, dst: int, n: int) -> None:
        self.log.append((self.ids, src, dst, n))
        super().copy_positions(src, dst, n)


class Driver:
    """Rank 0's model: each forward is first sent to the other ranks, then run here.

    Everything else (new_kv, config, layers, linears, ...) is the model's own."""

    def __init__(self, model: Decoder, group: Any) -> None:
        self._model, self._group = model, group
        self._pools: dict[int, int] = {}  # id(pool) -> index the workers know it by
        self._stopped = False
        c = model.config
        pool = MirroredPool(c.num_layers, c.num_kv_heads, c.head_dim, model.dtype)
        pool.log = []
        model.kv_pool = pool

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, tokens: mx.array, batch: Batch, logit_rows: list[int]) -> mx.array | None:
        assert not self._stopped, "the other ranks have stopped"
        plan: dict[str, Any] = {"tokens": np.array(tokens).tolist(), "logit_rows": logit_rows,
                                "floor": layers.LINEAR_ROW_FLOOR, "parts": [], "pools": {}}
        for seg in batch.segments:
            pool = seg.kv.pool
            index = self._pools.setdefault(id(pool), len(self._pools))
            ops = getattr(pool, "log", None)
            plan["pools"][index] = {"shape": [pool.num_layers, pool.num_kv_heads,
                                              pool.head_dim, str(pool.dtype)],
                                    "ids": pool.ids, "ops": list(ops or [])}
            if ops:
                ops.clear()
            plan["parts"].append([index, list(seg.kv.pages), seg.start, seg.length])
        _broadcast(self._group, STEP, json.dumps(plan).encode())
        return self._model(tokens, batch, logit_rows)

    def close(self) -> None:
        """Tell the other ranks to stop (engine shutdown, on the MLX thread)."""
        if not self._stopped:
            self._stopped = True
            _broadcast(self._group, STOP, b"")


def _dtype(name: str) -> mx.Dtype:
    return getattr(mx, name.removeprefix("mlx.core."))


def serve_worker(model: Decoder, group: Any,
                 on_step: Callable[[int], None] | None = None) -> int:
    """A rank other than 0: run every step rank 0 sends until it says stop; returns the
    number of steps run."""
    pools: dict[int, KVPool] = {}
    steps = 0
    while True:
        kind, payload = _receive(group)
        if kind == STOP:
            log.info("worker stopping", rank=group.rank(), steps=steps)
            return steps
        plan = json.loads(payload)
        layers.LINEAR_ROW_FLOOR = plan["floor"]
        for key, spec in plan["pools"].items():
            pool = pools.get(int(key))
            if pool is None:
                n_layers, kv_heads, head_dim, dtype = spec["shape"]
                pool = pools[int(key)] = KVPool(n_layers, kv_heads, head_dim, _dtype(dtype))
            for ids, src, dst, n in spec["ops"]:
                _cover(pool, ids)
                pool.copy_positions(src, dst, n)
            _cover(pool, spec["ids"])
        parts = []
        for index, pages, start, length in plan["parts"]:
            kv = SlotKV(pools[index])
            kv.set_pages(pages)
            kv.managed = True
            parts.append((kv, start, length))
        batch = Batch.build(parts)
        logits = model(mx.array(plan["tokens"], dtype=mx.int32), batch, plan["logit_rows"])
        mx.eval(([] if logits is None else [logits]) + batch.written())
        steps += 1
        if on_step is not None:
            on_step(steps)


def _cover(pool: KVPool, ids: int) -> None:
    """Make the worker's pool hand out as many page ids as rank 0's had (so it grows alike)."""
    if pool.ids < ids:
        pool.refs.extend([0] * (ids - pool.ids))


# ---- launching -------------------------------------------------------------------------------


def launched_size() -> int:
    """The ranks the launcher started (`mlx.launch`, or `launch` below): MLX_WORLD_SIZE
    (NCCL) or the hostfile's entries (ring); 1 when neither is set."""
    if os.environ.get("MLX_WORLD_SIZE"):
        return int(os.environ["MLX_WORLD_SIZE"])
    hostfile = os.environ.get("MLX_HOSTFILE")
    if hostfile:
        return len(json.loads(Path(hostfile).read_text()))
    return 1


def load_driver(path: Any, device: str, size: int, probe_rows: int | None,
                progress: Any = None) -> Any:
    """Rank 0's model (on the MLX thread): the group, this rank's part, and the `Driver`
    that sends every step to the others."""
    dev = loader.pick_device(device)
    group = init_group(size, dev)
    if group.rank() != 0:
        raise RuntimeError(f"the engine runs on rank 0, not {group.rank()}")
    lm = load_rank(path, dev, size, 0, group, probe_rows, progress)
    lm.model = Driver(lm.model, group)
    return lm


def worker_main(path: Any, device: str, size: int) -> int:
    """A rank other than 0 (`slotserve serve --tensor-parallel N` with MLX_RANK set): load
    its part and run rank 0's steps until rank 0 stops."""
    dev = loader.pick_device(device)
    group = init_group(size, dev)
    lm = load_rank(path, dev, size, group.rank(), group, probe_rows=None)
    serve_worker(lm.model, group)
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(size: int, device: str, argv: list[str]) -> list[subprocess.Popen[bytes]]:
    """Start ranks 1..size-1 of this host as copies of this command (`argv`), and set this
    process up as rank 0: NCCL over 127.0.0.1 with one GPU a rank (CUDA_VISIBLE_DEVICES),
    or the ring backend over 127.0.0.1 ports (a hostfile)."""
    gpu = device == "gpu" or (device == "auto" and mx.is_available(mx.gpu))
    env = dict(os.environ)
    if gpu:
        env.update(NCCL_HOST_IP="127.0.0.1", NCCL_PORT=str(_free_port()),
                   MLX_WORLD_SIZE=str(size))
    else:
        fd, hostfile = tempfile.mkstemp(prefix="slotserve-ring-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump([[f"127.0.0.1:{_free_port()}"] for _ in range(size)], f)
        env["MLX_HOSTFILE"] = hostfile
    procs = []
    for rank in range(1, size):
        child = dict(env, MLX_RANK=str(rank))
        if gpu and "CUDA_VISIBLE_DEVICES" not in os.environ:
            child["CUDA_VISIBLE_DEVICES"] = str(rank)
        procs.append(subprocess.Popen([sys.executable, "-m", "slotserve.cli", *argv],
                                      env=child))
    os.environ.update({k: v for k, v in env.items() if k.startswith(("MLX_", "NCCL_"))},
                      MLX_RANK="0")
    threading.Thread(target=_watch, args=(procs,), name="slotserve-ranks", daemon=True).start()
    return procs


def _watch(procs: list[subprocess.Popen[bytes]]) -> None:
    """Exit this process (rank 0) when another rank dies: its next collective would wait
    for that rank for ever, and a supervisor should restart the whole group."""
    while True:
        for rank, p in enumerate(procs, start=1):
            code = p.poll()
            if code is not None and code != 0:
                log.error("a tensor-parallel rank died: stopping", rank=rank, code=code)
                os._exit(1)
        if all(p.poll() == 0 for p in procs):
            return
        time.sleep(0.5)


def reap(procs: list[subprocess.Popen[bytes]], timeout: float = 30.0) -> None:
    """Wait for the other ranks (they stop when rank 0's engine closes); kill what is left."""
    hostfile = os.environ.get("MLX_HOSTFILE", "")
    if procs and Path(hostfile).name.startswith("slotserve-ring-"):
        Path(hostfile).unlink(missing_ok=True)  # ours (launch); read at start-up only
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
