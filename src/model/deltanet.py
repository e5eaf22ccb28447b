"""The Gated DeltaNet layer (Qwen3.5 / Qwen3.6 / Qwen3-Next's linear attention) over a row
batch, and the recurrent state each sequence carries for it.

Per layer and sequence the state is a causal-convolution window (the last K-1 inputs of
the depthwise conv over the fused q/k/v rows) and a matrix per value head, S [dv, dk],
updated by the gated delta rule at every position t:

    S = exp(g_t) S;  S += beta_t (v_t - S k_t) k_t^T;  o_t = S q_t

(q, k L2-normed per head, q scaled by dk^-1/2; transformers' `torch_recurrent_gated_delta_rule`
with S stored transposed, so every reduction runs over the last, contiguous axis).

How a position is computed is fixed by its absolute position alone, never by its batch:

- Positions inside a full *sub-chunk* [c*CHUNK, (c+1)*CHUNK) that one segment (one slot's
  rows of a step) covers whole run the chunked form of the rule (transformers'
  `torch_chunk_gated_delta_rule`: intra-chunk products, the UT transform, one state update
  per sub-chunk), always on tensors of CHUNK positions;
- every other position (decode rows, a prompt's last partial sub-chunk) runs the recurrent
  update, one position at a time, as elementwise products and sums over the last axis.

The Batcher cuts prefill chunks only at multiples of CHUNK (`prefill_align`), so a prompt is
always split into the same sub-chunks whatever else runs beside it: a row's result does not
depend on its batch, and a prompt resumed from a state snapshot at a page boundary
(a multiple of CHUNK) computes every later position as the cold prompt does. The conv and
all per-row parts (norms, gates, the projections through `layers.Linear`) are row-wise.

The state lives beside the paged K/V of the attention layers: `HybridKV` is a `SlotKV` that
also holds a `RecurrentState`. MLX arrays are values, so a state version is a reference:
each layer keeps the last STATE_VERSIONS positions it reached (a step may be rerun from the
same start: a speculated decode step the plan does not take, the model tests' solo rows),
and the states reached at page boundaries by chunked prefill alone (`canonical`: the bits a
cold prefill of those tokens gives) are kept as `marks` for the prefix cache to publish.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from slotserve.kernels.attention import BLOCK
from slotserve.model.kv import KVPool, SlotKV
from slotserve.model.layers import Backend, Batch, Layer, Linear, Norm, Segment
from slotserve.model.weights import Tensor

CHUNK = 32  # positions per sub-chunk of the chunked form (divides BLOCK)
STATE_VERSIONS = 2  # state versions kept per layer (the newest and the one before)
L2_EPS = 1e-6  # transformers' l2norm eps (FLA's)

assert BLOCK % CHUNK == 0


# ---- the recurrent state ----------------------------------------------------------------

@dataclass(frozen=True)
class LayerState:
    """One DeltaNet layer's state of one sequence after some position.

    A decode step's new states are rows of its batched arrays, and are held so (`row`, the
    arrays [N, ...] as `conv_` and `ssm_`): the next step of the same sequences in the same
    order then takes those arrays as they are (`stacked`), where slicing each row out and
    stacking the rows again cost several graph ops a row and layer (on a GPU, kernels)."""

    conv_: mx.array  # [K-1, conv_dim] the last K-1 conv inputs (compute dtype); [N, ..] at row
    ssm_: mx.array  # [Hv, dv, dk] float32; [N, ..] at row
    canonical: bool  # reached by chunked prefill of whole sub-chunks alone (see module doc)
    row: int | None = None  # this state's row of batched conv_ / ssm_ (None: its own arrays)

    @property
    def conv(self) -> mx.array:
        return self.conv_ if self.row is None else self.conv_[self.row]

    @property
    def ssm(self) -> mx.array:
        return self.ssm_ if self.row is None else self.ssm_[self.row]


def stacked(states: list[LayerState]) -> tuple[mx.array, mx.array]:
    """The conv windows [N, K-1, conv_dim] and states [N, Hv, dv, dk] of N sequences: the
    batched arrays themselves where the states are their rows 0..N-1 in order (the last
    decode step's, of the same sequences), else the rows stacked."""
    first = states[0]
    if first.row == 0 and first.conv_.shape[0] == len(states) and all(
            st.conv_ is first.conv_ and st.row == i for i, st in enumerate(states)):
        return first.conv_, first.ssm_
    return mx.stack([st.conv for st in states]), mx.stack([st.ssm for st in states])


@dataclass
class StateShape:
    """The sizes of a model's recurrent state (what a slot's floor in the budget is)."""

    layers: int  # DeltaNet layers
    conv_dim: int
    kernel: int
    heads: int  # value heads
    dk: int
    dv: int
    dtype: mx.Dtype  # the conv window's (the compute dtype); S is float32

    @property
    def nbytes(self) -> int:
        """Bytes of one state version of every DeltaNet layer."""
        conv = (self.kernel - 1) * self.conv_dim * self.dtype.size
        return self.layers * (conv + self.heads * self.dv * self.dk * 4)

    def zeros(self) -> LayerState:
        return LayerState(mx.zeros((self.kernel - 1, self.conv_dim), self.dtype),
                          mx.zeros((self.heads, self.dv, self.dk), mx.float32), True)


@dataclass
class RecurrentState:
    """A sequence's DeltaNet states, per layer and position (see the module doc)."""

    shape: StateShape
    versions: list[dict[int, LayerState]] = field(default_factory=list)
    # position (a page boundary, or the last one chunked prefill reached) -> every layer's
    # canonical state there; kept only where a prefix cache takes them (`keep_marks`), which
    # drops each once the page past it is published
    marks: dict[int, list[LayerState | None]] = field(default_factory=dict)
    keep_marks: bool = False
    resumed_at: int = 0  # the position `restore` started from (a snapshot's: canonical)
    # positions from here on run the recurrent form even inside whole sub-chunks: a
    # preempted request that resumes computes its decoded positions as its decode steps
    # did (None: the usual rule; see `chunked_before`)
    recurrent_from: int | None = None

    def __post_init__(self) -> None:
        if not self.versions:
            self.versions = [{} for _ in range(self.shape.layers)]

    def at(self, layer: int, pos: int) -> LayerState:
        """The layer's state after positions 0..pos-1."""
        if pos == 0:
            return self.shape.zeros()
        found = self.versions[layer].get(pos)
        if found is None:
            have = sorted(self.versions[layer])
            raise RuntimeError(f"no recurrent state of DeltaNet layer {layer} at position "
                               f"{pos} (this sequence has {have or 'none'})")
        return found

    def put(self, layer: int, pos: int, state: LayerState) -> None:
        versions = self.versions[layer]
        versions[pos] = state
        while len(versions) > STATE_VERSIONS:
            del versions[min(versions)]

    def mark(self, layer: int, pos: int, state: LayerState) -> None:
        """A canonical state at a page boundary (kept until the prefix cache takes it)."""
        if not self.keep_marks:
            return
        self.marks.setdefault(pos, [None] * self.shape.layers)[layer] = state

    def snapshot(self, pos: int) -> list[LayerState] | None:
        """Every layer's canonical state at `pos`, if the sequence reached it so."""
        got = self.marks.get(pos)
        if got is None or any(s is None for s in got):
            return None
        return got  # type: ignore[return-value]

    def deepest(self) -> int:
        """The deepest position this sequence itself reached canonically (0: none)."""
        return max((p for p in self.marks if self.snapshot(p) is not None), default=0)

    @property
    def canonical_end(self) -> int:
        """Positions below this hold the bits a cold prefill gives them (their K/V too):
        the snapshot the sequence resumed from, or the deepest canonical state since."""
        return max(self.resumed_at, self.deepest())

    def chunked_before(self, last: int) -> int:
        """The end of the whole sub-chunks a segment may run in the chunked form, given
        the usual one (`last`, a multiple of CHUNK): cut back to `recurrent_from`."""
        if self.recurrent_from is None:
            return last
        return min(last, self.recurrent_from // CHUNK * CHUNK)

    def restore(self, pos: int, states: list[LayerState] | None) -> None:
        """Start over from a snapshot at `pos` (or empty: position 0)."""
        self.versions = [{} for _ in range(self.shape.layers)]
        self.marks = {}
        self.recurrent_from = None
        self.resumed_at = pos if states is not None else 0
        if states is not None and pos > 0:
            for i, s in enumerate(states):
                self.versions[i][pos] = s

    def arrays(self) -> list[mx.array]:
        return [a for v in self.versions for s in v.values() for a in (s.conv, s.ssm)]


class HybridKV(SlotKV):
    """A sequence's paged K/V (attention layers) and its DeltaNet recurrent state."""

    def __init__(self, pool: KVPool, shape: StateShape) -> None:
        super().__init__(pool)
        self.recurrent = RecurrentState(shape)

    @property
    def state_bytes(self) -> int:
        """What the recurrent state takes, whatever the sequence's length (every version)."""
        return STATE_VERSIONS * self.recurrent.shape.nbytes

    def release(self) -> None:
        super().release()
        self.recurrent.restore(0, None)


# ---- the math, plain MLX ops ---------------------------------------------------------------

def causal_conv(window: mx.array, x: mx.array, weight: mx.array) -> tuple[mx.array, mx.array]:
    """Depthwise causal conv + SiLU over rows x [N, L, D] after each row group's window
    [N, K-1, D] (weight [D, K], float32): per position the same K products, added in tap
    order. Returns (out [N, L, D] float32, the new windows [N, K-1, D])."""
    k = weight.shape[1]
    ext = mx.concatenate([window, x], axis=1).astype(mx.float32)
    n = x.shape[1]
    out = ext[:, 0:n] * weight[:, 0]
    for j in range(1, k):
        out = out + ext[:, j : j + n] * weight[:, j]
    new_window = mx.concatenate([window, x], axis=1)[:, n:]
    return out * mx.sigmoid(out), new_window


def l2norm(x: mx.array) -> mx.array:
    return x * mx.rsqrt((x * x).sum(axis=-1, keepdims=True) + L2_EPS)


def recurrent_step(s: mx.array, q: mx.array, k: mx.array, v: mx.array, g: mx.array,
                   beta: mx.array) -> tuple[mx.array, mx.array]:
    """One position of N rows: s [N, H, dv, dk], q/k [N, H, dk], v [N, H, dv], g/beta [N, H]
    (float32) -> (o [N, H, dv], s')."""
    s = s * mx.exp(g)[..., None, None]
    kk = k[:, :, None, :]
    kv_mem = (s * kk).sum(axis=-1)
    delta = (v - kv_mem) * beta[..., None]
    s = s + delta[..., None] * kk
    return (s * q[:, :, None, :]).sum(axis=-1), s


def _unit_lower_inverse(lower: mx.array) -> mx.array:
    """(I + L)^-1 for strictly lower-triangular L [..., C, C], as the product
    (I - L)(I + L^2)(I + L^4)...: L is nilpotent (L^C = 0), so a fixed number of matmuls
    of fixed shape, the same on every device."""
    c = lower.shape[-1]
    eye = mx.eye(c, dtype=lower.dtype)
    inv = eye - lower
    power = lower @ lower
    span = 2
    while span < c:
        inv = inv @ (eye + power)
        span *= 2
        if span < c:
            power = power @ power
    return inv


_MASKS: dict[int, tuple[mx.array, mx.array]] = {}


def _masks(c: int) -> tuple[mx.array, mx.array]:
    """(lower incl. the diagonal, strictly lower) [C, C] boolean masks."""
    if c not in _MASKS:
        i = mx.arange(c)
        _MASKS[c] = (i[:, None] >= i[None, :], i[:, None] > i[None, :])
    return _MASKS[c]


def chunked(s: mx.array, q: mx.array, k: mx.array, v: mx.array, g: mx.array,
            beta: mx.array) -> tuple[mx.array, list[mx.array]]:
    """Whole sub-chunks of one sequence: s [H, dv, dk], q/k [T, H, dk], v [T, H, dv],
    g/beta [T, H] with T a multiple of CHUNK (float32). Returns (o [T, H, dv], the state after
    each sub-chunk)."""
    t, h, dk = k.shape
    dv, n, c = v.shape[-1], t // CHUNK, CHUNK

    def split(x: mx.array) -> mx.array:  # [T, H, d] -> [H, n, C, d]
        return x.transpose(1, 0, 2).reshape(h, n, c, x.shape[-1])

    q, k, v = split(q), split(k), split(v)
    g, beta = g.T.reshape(h, n, c), beta.T.reshape(h, n, c)
    lower, strict = _masks(c)
    cum = mx.cumsum(g, axis=-1)
    diff = cum[..., :, None] - cum[..., None, :]
    decay = mx.where(lower, mx.exp(mx.where(lower, diff, 0.0)), 0.0)  # [H, n, C, C]
    kb, vb = k * beta[..., None], v * beta[..., None]
    kt = k.swapaxes(-1, -2)
    inv = _unit_lower_inverse(mx.where(strict, (kb @ kt) * decay, 0.0))
    new_values = inv @ vb  # [H, n, C, dv]
    k_cum = inv @ (kb * mx.exp(cum)[..., None])  # [H, n, C, dk]
    attn = (q @ kt) * decay
    q_dec = q * mx.exp(cum)[..., None]
    k_dec = k * mx.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = mx.exp(cum[..., -1])  # [H, n]
    outs, states = [], []
    for i in range(n):
        st = s.swapaxes(-1, -2)  # [H, dk, dv]
        v_new = new_values[:, i] - k_cum[:, i] @ st
        outs.append(q_dec[:, i] @ st + attn[:, i] @ v_new)
        s = s * chunk_decay[:, i, None, None] + v_new.swapaxes(-1, -2) @ k_dec[:, i]
        states.append(s)
    out = mx.stack(outs, axis=1).reshape(h, t, dv).transpose(1, 0, 2)
    return out, states


# ---- the layer -------------------------------------------------------------------------------

def softplus(x: mx.array) -> mx.array:
    """torch's softplus (threshold 20)."""
    return mx.where(x > 20.0, x, mx.log1p(mx.exp(mx.minimum(x, 20.0))))


class GatedDeltaNet(Layer):
    """One Gated DeltaNet layer: fused in-projection (q/k/v, z, b, a), causal conv + SiLU,
    the gated delta rule against each row's own sequence state, a gated RMS norm per value
    head, the out-projection. Called like `layers.Attention` (x, batch, residual, norm)."""

    backend = Backend.MLX  # no native block kernel (decoder.PreNormBlock checks this)

    def __init__(self, w: dict[str, Tensor], p: str, *, index: int, key_heads: int,
                 value_heads: int, dk: int, dv: int, eps: float, dtype: mx.Dtype,
                 quant: bool, tiled_value_heads: bool = False) -> None:
        """Tensors under prefix p in the layout of transformers' Qwen3_5GatedDeltaNet;
        index: this layer's place among the model's DeltaNet layers (its state);
        tiled_value_heads: the value heads in llama.cpp's order (value head j served by key
        head j % key_heads; its Qwen3.5 GGUF files reorder them so), not HF's (j // r)."""
        self.index, self.hk, self.hv, self.dk, self.dv = index, key_heads, value_heads, dk, dv
        self.tiled = tiled_value_heads
        self.key_dim, self.value_dim = key_heads * dk, value_heads * dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj = Linear.fused(
            [w[f"{p}.in_proj_qkv.weight"], w[f"{p}.in_proj_z.weight"],
             w[f"{p}.in_proj_b.weight"], w[f"{p}.in_proj_a.weight"]], dtype, quant)
        conv = w[f"{p}.conv1d.weight"]
        assert isinstance(conv, mx.array)
        self.conv_w = conv.reshape(self.conv_dim, -1).astype(mx.float32)  # [D, K]
        self.kernel = self.conv_w.shape[1]
        a_log, dt_bias, norm_w = (w[f"{p}.{n}"] for n in ("A_log", "dt_bias", "norm.weight"))
        assert isinstance(a_log, mx.array) and isinstance(dt_bias, mx.array)
        assert isinstance(norm_w, mx.array)
        self.neg_a = -mx.exp(a_log.astype(mx.float32))
        self.dt_bias = dt_bias.astype(mx.float32)
        self.norm_w = norm_w.astype(mx.float32)
        self.eps = eps
        self.out = Linear(w[f"{p}.out_proj.weight"], dtype, quant)
        self.dtype = dtype

    def parts(self) -> list[Layer]:
        return [self.in_proj, self.out]

    def arrays(self) -> list[mx.array]:
        return [*super().arrays(), self.conv_w, self.neg_a, self.dt_bias, self.norm_w]

    def state_shape(self, layers: int) -> StateShape:
        return StateShape(layers, self.conv_dim, self.kernel, self.hv, self.dk, self.dv,
                          self.dtype)

    def __call__(self, x: mx.array, batch: Batch, residual: mx.array | None = None,
                 norm: Norm | None = None) -> mx.array:
        y = self.in_proj(x, norm=norm)
        cd, vd, hv = self.conv_dim, self.value_dim, self.hv
        mixed, z = y[:, :cd], y[:, cd : cd + vd]
        b, a = y[:, cd + vd : cd + vd + hv], y[:, cd + vd + hv :]
        core = self._rule(mixed, b, a, batch)  # [rows, Hv, dv] float32
        core = core.astype(self.dtype).astype(mx.float32)  # HF rounds the rule's output
        r = x.shape[0]
        zh = z[: core.shape[0]].reshape(-1, hv, self.dv).astype(mx.float32)
        gated = mx.fast.rms_norm(core, self.norm_w, self.eps) * (zh * mx.sigmoid(zh))
        out = gated.reshape(core.shape[0], vd).astype(self.dtype)
        if out.shape[0] < r:  # padding rows (LINEAR_ROW_FLOOR): zeros
            out = mx.concatenate([out, mx.zeros((r - out.shape[0], vd), self.dtype)])
        return self.out(out, residual)

    # ---- per segment ------------------------------------------------------------------

    def _prep(self, conv_out: mx.array, b: mx.array, a: mx.array) -> tuple[mx.array, ...]:
        """Rows [L, conv_dim] after the conv -> q, k [L, Hv, dk] (normed, q scaled; each
        key head serving its Hv/Hk value heads), v [L, Hv, dv], g, beta [L, Hv]."""
        n, kd = conv_out.shape[0], self.key_dim
        conv_out = conv_out.astype(self.dtype).astype(mx.float32)  # rounded as HF's conv is
        q = conv_out[:, :kd].reshape(n, self.hk, self.dk)
        k = conv_out[:, kd : 2 * kd].reshape(n, self.hk, self.dk)
        v = conv_out[:, 2 * kd :].reshape(n, self.hv, self.dv)
        q, k = l2norm(q) * (self.dk ** -0.5), l2norm(k)
        if self.hv != self.hk:
            rep = self.hv // self.hk
            if self.tiled:
                q, k = mx.tile(q, (1, rep, 1)), mx.tile(k, (1, rep, 1))
            else:
                q, k = mx.repeat(q, rep, axis=1), mx.repeat(k, rep, axis=1)
        beta = mx.sigmoid(b.astype(mx.float32))
        g = self.neg_a * softplus(a.astype(mx.float32) + self.dt_bias)
        return q, k, v, g, beta

    def _conv_rows(self, rows: mx.array) -> mx.array:
        """Conv inputs rounded as the model's activations are (the compute dtype)."""
        return rows.astype(self.dtype)

    def _rule(self, mixed: mx.array, b: mx.array, a: mx.array, batch: Batch) -> mx.array:
        """Every segment's rows through the conv and the delta rule, in row order (pieces
        of consecutive rows, concatenated by their first row)."""
        outs: list[tuple[int, mx.array]] = []
        decode = [s for s in batch.segments if s.length == 1]
        if decode:
            outs.extend(self._decode(decode, mixed, b, a, batch))
        for seg in batch.segments:
            if seg.length > 1:
                outs.append((seg.row, self._segment(seg, mixed, b, a, batch)))
        outs.sort(key=lambda o: o[0])
        parts = [o for _, o in outs]
        return parts[0] if len(parts) == 1 else mx.concatenate(parts)

    def _decode(self, segs: list[Segment], mixed: mx.array, b: mx.array, a: mx.array,
                batch: Batch) -> list[tuple[int, mx.array]]:
        """All one-row segments in one recurrent update (each row its own state; the new
        states held as rows of the update's arrays, see LayerState)."""
        windows, ssm = stacked([_state(s).at(self.index, s.start) for s in segs])
        rows = mx.array([s.row for s in segs], dtype=mx.int32)
        x = self._conv_rows(mixed[rows])[:, None, :]
        conv, windows = causal_conv(windows, x, self.conv_w)
        q, k, v, g, beta = self._prep(conv[:, 0], b[rows], a[rows])
        o, s = recurrent_step(ssm, q, k, v, g, beta)
        for i, seg in enumerate(segs):
            _state(seg).put(self.index, seg.start + 1, LayerState(windows, s, False, i))
        batch.effects.extend([windows, s])
        if all(seg.row == segs[0].row + i for i, seg in enumerate(segs)):
            return [(segs[0].row, o)]  # consecutive rows (a decode step's): one piece
        return [(seg.row, o[i : i + 1]) for i, seg in enumerate(segs)]

    def _segment(self, seg: Segment, mixed: mx.array, b: mx.array, a: mx.array,
                 batch: Batch) -> mx.array:
        """One slot's rows: whole sub-chunks chunked, the rest recurrent (module doc)."""
        rec = _state(seg)
        st = rec.at(self.index, seg.start)
        rows = slice(seg.row, seg.row + seg.length)
        x = self._conv_rows(mixed[rows])
        conv, _ = causal_conv(st.conv[None], x[None], self.conv_w)
        ext = mx.concatenate([st.conv, x])  # window source: positions start-K+1 ..
        q, k, v, g, beta = self._prep(conv[0], b[rows], a[rows])
        start, end = seg.start, seg.start + seg.length
        first = -(-start // CHUNK) * CHUNK
        last = rec.chunked_before((end // CHUNK) * CHUNK)
        if first >= last:
            first = last = end  # no whole sub-chunk: every row recurrent
        ssm, canonical = st.ssm, st.canonical and start == first
        outs: list[mx.array] = []

        def window(pos: int) -> mx.array:  # the conv window after positions ..pos-1
            return ext[pos - start : pos - start + self.kernel - 1]

        def recur(lo: int, hi: int, ssm: mx.array) -> mx.array:
            for t in range(lo - start, hi - start):
                o, s1 = recurrent_step(ssm[None], q[t : t + 1], k[t : t + 1], v[t : t + 1],
                                       g[t : t + 1], beta[t : t + 1])
                outs.append(o)
                ssm = s1[0]
            return ssm

        ssm = recur(start, first, ssm)
        if last > first:
            lo, hi = first - start, last - start
            o, states = chunked(ssm, q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi])
            outs.append(o)
            ssm = states[-1]
            if canonical:  # page boundaries, and where the chunked form stops short of end
                for i, s in enumerate(states):
                    pos = first + (i + 1) * CHUNK
                    if pos < end and (pos % BLOCK == 0 or pos == last):
                        mark = LayerState(window(pos), s, True)
                        rec.mark(self.index, pos, mark)
                        batch.effects.extend([mark.conv, mark.ssm])
        ssm = recur(last, end, ssm)
        new = LayerState(window(end), ssm, canonical and last == end)
        rec.put(self.index, end, new)
        if new.canonical:
            rec.mark(self.index, end, new)
        batch.effects.extend([new.conv, new.ssm])
        return outs[0] if len(outs) == 1 else mx.concatenate(outs)


def _state(seg: Segment) -> RecurrentState:
    kv = seg.kv
    if not isinstance(kv, HybridKV):
        raise TypeError("a DeltaNet layer needs the sequence's recurrent state (HybridKV)")
    return kv.recurrent
