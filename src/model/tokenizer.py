"""Tokenizer over HF `tokenizers`, built from GGUF metadata or an HF model directory.

GGUF files carry the vocabulary as plain metadata, so the HF tokenizer is rebuilt here (byte-level
BPE for ``gpt2``, SentencePiece-style BPE with byte fallback for ``llama``); HF directories load
``tokenizer.json`` directly. Either way the rest of the server sees one small API.
"""

from __future__ import annotations

import bisect
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import structlog
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from slotserve.model.errors import ModelLoadError, UnsupportedModelError

log = structlog.get_logger(__name__)

GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3_SPLIT = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
# o200k's split (gpt-oss's tokenizer.json, quoted by llama.cpp for its "gpt-4o" pre type):
# a word takes its leading capitals and a contraction of either case, digits go 1-3 at a time
_CASED_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    + _CASED_CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    + _CASED_CONTRACTIONS
    + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> split regexes applied in order before the byte-level mapping.
_PRE_SPLITS: dict[str, list[str]] = {
    "gpt2": [GPT2_SPLIT],
    "default": [GPT2_SPLIT],
    **{n: [r"\p{N}", GPT2_SPLIT] for n in ("smollm", "starcoder", "refact", "command-r",
                                          "codeshell", "exaone", "minerva")},
    **{n: [_LLAMA3_SPLIT] for n in ("llama-bpe", "llama3", "dbrx", "smaug-bpe")},
    **{n: [_QWEN2_SPLIT] for n in ("qwen2", "deepseek-r1-qwen")},
    "gpt-4o": [_GPT4O_SPLIT],
}
_IGNORE_MERGES = {"llama-bpe", "llama3"}  # Llama 3 looks whole words up before merging
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>",
                      "<|endoftext|>", "<|eom_id|>", "<|END_OF_TURN_TOKEN|>",
                      "<|end▁of▁sentence|>", "<eos>", "</s>",
                      "<turn|>", "<|tool_response>",  # Gemma 4: a turn's end; its tool calls' end
                      "<|return|>", "<|call|>")  # gpt-oss (harmony): the answer's end; a call's end
# Special tokens that are part of what a model writes, not control to hide: the API's parsers
# read them (harmony's message headers and channels, where the vocabulary has <|channel|>;
# Gemma 4's tool calls). Generated text keeps them; every other special token is dropped.
HARMONY_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>")
SHOWN_TOKENS = ("<|tool_call>", "<tool_call|>", '<|"|>')
CONTROL, USER_DEFINED, UNUSED, BYTE = 3, 4, 5, 6  # tokenizer.ggml.token_type values
# Gemma 4's markers that llama.cpp's converter stores as USER_DEFINED (conversion/gemma.py,
# so that its own detokenizer renders them for its chat parser): control tokens of the model's
# tokenizer all the same, read back as such (user text never spells them; a tool call's end,
# <|tool_response>, stops generation; the API's parsers see them, SHOWN_TOKENS)
GEMMA4_RENDERED = ("<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>",
                   "<|tool_response>", "<tool_response|>", '<|"|>')
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_HOLE = "\ue000"  # stands for a stretch of user text while control tokens are found


@cache
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's byte->printable-char table (printable bytes map to themselves)."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in keep}
    shifted = (b for b in range(256) if b not in set(keep))
    table.update({chr(256 + n): b for n, b in enumerate(shifted)})
    return table


def _py(v: Any) -> Any:
    """GGUF metadata values may be mx.array scalars/vectors; make them plain Python."""
    return v.tolist() if hasattr(v, "tolist") else v


def _vocab(tokens: Sequence[str], source: str) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    if len(vocab) != len(tokens):
        log.warning("duplicate tokens in vocab", source=source, dupes=len(tokens) - len(vocab))
    return vocab


def _split_merges(merges: Iterable[str]) -> list[tuple[str, str]]:
    return [tuple(m.split(" ", 1)) for m in merges]  # type: ignore[misc]


def _merges_from_scores(tokens: Sequence[str], scores: Sequence[float],
                        types: Sequence[int]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges the pair whose result scores highest, so rank merges by score."""
    normal = {t: i for i, t in enumerate(tokens) if types[i] == 1}
    ranked = sorted(normal.items(), key=lambda kv: (-scores[kv[1]], kv[1]))
    return [(p[:k], p[k:]) for p, _ in ranked for k in range(1, len(p))
            if p[:k] in normal and p[k:] in normal]


def _byte_level_bpe(tokens: Sequence[str], merges: list[str], pre: str, source: str) -> HFTokenizer:
    if not merges:
        raise UnsupportedModelError(f"{source}: byte-level BPE tokenizer has no merges")
    splits = _PRE_SPLITS.get(pre)
    if splits is None:
        log.warning("unknown tokenizer.ggml.pre, using GPT-2 split", source=source, pre=pre)
        splits = [GPT2_SPLIT]
    tk = HFTokenizer(models.BPE(_vocab(tokens, source), _split_merges(merges),
                                ignore_merges=pre in _IGNORE_MERGES))
    if pre.startswith("qwen2"):
        tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    return tk


def _sentencepiece_bpe(tokens: Sequence[str], types: Sequence[int], meta: Mapping[str, Any],
                       source: str) -> HFTokenizer:
    merges = _py(meta.get("tokenizer.ggml.merges")) or []
    scores = _py(meta.get("tokenizer.ggml.scores"))
    if merges:
        pairs = _split_merges(merges)
    elif scores:
        pairs = _merges_from_scores(tokens, scores, types)
    else:
        raise UnsupportedModelError(
            f"{source}: 'llama' tokenizer has neither tokenizer.ggml.merges nor scores")
    unk_id = _py(meta.get("tokenizer.ggml.unknown_token_id"))
    unk = tokens[unk_id] if unk_id is not None and unk_id < len(tokens) else None
    tk = HFTokenizer(models.BPE(_vocab(tokens, source), pairs, unk_token=unk, fuse_unk=True,
                                byte_fallback=True))
    # Spaces become "▁" before user-defined tokens (e.g. "▁▁") are matched, as in SentencePiece.
    tk.normalizer = normalizers.Replace(" ", "▁")
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if bool(_py(meta.get("tokenizer.ggml.add_space_prefix", True))):
        # SentencePiece's dummy "▁" prefix, at the very start only (HF Metaspace "first" rules:
        # not after special tokens, and not when the text already starts with a space).
        tk.pre_tokenizer = pre_tokenizers.Metaspace("▁", prepend_scheme="first", split=False)
        steps.append(decoders.Strip(" ", 1, 0))
    tk.decoder = decoders.Sequence(steps)
    return tk


def _token_text(value: Any) -> str | None:
    """tokenizer_config stores special tokens as a string or an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}



def _encode(tk: Any, text: str) -> Any:
    """tk.encode(text) without special tokens added, with the GIL released: `encode_batch`
    gives the same Encoding but lets other threads run (the event loop and the step:
    `encode` holds the GIL, ~0.3 s for a 700k-character prompt)."""
    return tk.encode_batch([text], add_special_tokens=False)[0]


class Tokenizer:
    """The one tokenizer API the engine, API layer, exporter and grammar code rely on."""

    def __init__(self, hf: HFTokenizer, *, bos_id: int | None, eos_id: int | None,
                 extra_eos: Iterable[int | None] = (), add_bos: bool = False,
                 chat_template: str | None = None, byte_level: bool = True,
                 pad_id: int | None = None, unk_id: int | None = None) -> None:
        self._tk = hf
        self.bos_id, self.eos_id, self.pad_id, self.unk_id = bos_id, eos_id, pad_id, unk_id
        self.add_bos = add_bos and bos_id is not None
        self.chat_template = chat_template
        self.byte_level = byte_level
        added = hf.get_added_tokens_decoder()
        self._added_ids = frozenset(added)
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        self.special_tokens: dict[str, int] = {
            t.content: i for i, t in added.items() if t.special}
        eot = (self.special_tokens.get(t) for t in END_OF_TURN_TOKENS)
        stops = {i for i in (eos_id, *extra_eos, *eot) if i is not None}
        self.stop_ids: frozenset[int] = frozenset(stops)
        shown = SHOWN_TOKENS + (HARMONY_TOKENS if "<|channel|>" in self.special_tokens else ())
        self.shown_ids: frozenset[int] = frozenset(
            self.special_tokens[t] for t in shown if t in self.special_tokens)
        self._bytes_cache: dict[int, bytes] = {}
        # User text is text: copies of `hf` that encode special-token strings as the plain text
        # they spell. `_plain_first` for text at the very start of a prompt, `_plain_inner` for
        # text that follows a control token (SentencePiece's dummy "▁" prefix only comes first).
        # Never reconfigured after this, so worker threads may share them.
        self._plain_first, self._plain_inner = _plain_copies(hf)

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], source: str) -> Tokenizer:
        """Rebuild the tokenizer a GGUF file describes in its ``tokenizer.ggml.*`` keys."""
        def get(key: str, default: Any = None) -> Any:
            return _py(meta.get(f"tokenizer.ggml.{key}", default))

        kind, tokens = get("model"), get("tokens")
        if not tokens:
            raise ModelLoadError(f"{source}: GGUF metadata has no tokenizer.ggml.tokens")
        types = get("token_type") or [1] * len(tokens)
        if len(types) != len(tokens):
            raise ModelLoadError(f"{source}: tokenizer.ggml.token_type has {len(types)} entries "
                                 f"for {len(tokens)} tokens")
        if kind == "gemma4":
            types = [CONTROL if ty == USER_DEFINED and t in GEMMA4_RENDERED else ty
                     for t, ty in zip(tokens, types, strict=True)]
        if kind == "gpt2":
            hf = _byte_level_bpe(tokens, get("merges") or [], get("pre") or "default", source)
        elif kind in ("llama", "gemma4"):  # gemma4: SentencePiece-style BPE with merges
            hf = _sentencepiece_bpe(tokens, types, meta, source)
        else:
            raise UnsupportedModelError(
                f"{source}: tokenizer model {kind!r} (tokenizer.ggml.model) is not supported; "
                "only 'gpt2', 'llama' and 'gemma4' are")
        hf.add_special_tokens([AddedToken(t, special=True, normalized=False)
                               for t, ty in zip(tokens, types, strict=True) if ty == CONTROL])
        hf.add_tokens([AddedToken(t, special=False, normalized=kind != "gpt2")
                       for t, ty in zip(tokens, types, strict=True) if ty == USER_DEFINED])
        bos = get("bos_token_id")
        add_bos = bool(get("add_bos_token", kind == "llama")) and bos is not None
        if add_bos:
            hf.post_processor = processors.TemplateProcessing(
                single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B",
                special_tokens=[(tokens[bos], bos)])
        return cls(hf, bos_id=bos, eos_id=get("eos_token_id"), add_bos=add_bos,
                   extra_eos=(get("eot_token_id"), get("eom_token_id")),
                   chat_template=_py(meta.get("tokenizer.chat_template")),
                   byte_level=kind == "gpt2", pad_id=get("padding_token_id"),
                   unk_id=get("unknown_token_id"))

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` plus the config files that say which tokens are BOS/EOS."""
        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise ModelLoadError(f"{tj}: missing tokenizer.json (only fast tokenizers supported)")
        hf = HFTokenizer.from_file(str(tj))
        cfg = _read_json(path / "tokenizer_config.json")
        gen = _read_json(path / "generation_config.json")
        model_cfg = _read_json(path / "config.json")

        def tid(key: str) -> int | None:
            text = _token_text(cfg.get(key))
            return hf.token_to_id(text) if text else None

        def ids(value: Any) -> list[int]:
            return [v for v in (value if isinstance(value, list) else [value]) if v is not None]

        eos_extra = ids(gen.get("eos_token_id")) + ids(model_cfg.get("eos_token_id"))
        eos = tid("eos_token")
        if eos is None:
            eos = next(iter(eos_extra), None)
        pp_ids = hf.encode("", add_special_tokens=True).ids  # what the post-processor adds
        bos = tid("bos_token")
        if bos is None:
            pp_bos = [i for i in pp_ids[:1] if i != eos]
            bos_ids = ids(gen.get("bos_token_id")) + ids(model_cfg.get("bos_token_id")) + pp_bos
            bos = next(iter(bos_ids), None)
        add_bos = bool(cfg.get("add_bos_token", pp_ids[:1] == [bos]))
        decoder = json.loads(hf.to_str()).get("decoder") or {}
        return cls(hf, bos_id=bos, eos_id=eos, extra_eos=eos_extra, add_bos=add_bos,
                   chat_template=_hf_chat_template(path, cfg),
                   byte_level="ByteLevel" in json.dumps(decoder),
                   pad_id=tid("pad_token"), unk_id=tid("unk_token"))

    @property
    def vocab_size(self) -> int:
        return self._tk.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special: bool = True, *,
               parse_special: bool = False) -> list[int]:
        """Token ids of ``text``, BOS first if ``add_special`` and the model wants one.

        User text is text: a special token's string written in ``text`` (``"<|im_end|>"``)
        encodes as the plain text it spells. Only ``parse_special`` (for trusted text that the
        server wrote itself) makes such strings the control tokens; token ids are the one way a
        client sends those.
        """
        tk = self._tk if parse_special else self._plain_first
        ids = _encode(tk, text).ids
        if add_special and self.add_bos:
            ids.insert(0, self.bos_id)  # type: ignore[arg-type]
        return ids

    def encode_template(self, text: str, holes: Sequence[tuple[int, int, str]] = (),
                        add_special: bool = True) -> list[int]:
        """Ids of a rendered chat template: special tokens in ``text`` parse as control tokens,
        and each hole ``(start, end, plain)`` (a span of ``text``) stands for the user text
        ``plain``, which encodes as text however it is spelled.

        ``text`` must spell no special token of user origin: the template put user text in with
        every special-token string swapped for a placeholder, and the holes are those
        placeholders (`ChatTemplate.render_guarded`). Without holes this is exactly
        ``encode(text, parse_special=True)``; with them, the ids of the same text with the
        user's markers made harmless. A template that writes the BOS itself (Gemma's
        `{{ bos_token }}`) gets no second one: what transformers' apply_chat_template gives.
        """
        if holes:
            ids = self._fill_holes(text, sorted(holes))
        else:
            ids = _encode(self._tk, text).ids
        if add_special and self.add_bos and ids[:1] != [self.bos_id]:
            ids.insert(0, self.bos_id)  # type: ignore[arg-type]
        return ids

    def _fill_holes(self, text: str, holes: list[tuple[int, int, str]]) -> list[int]:
        # Each hole becomes one private-use character; HF finds the control tokens in that
        # text (only the template's: no hole spells one) and cuts it at them into stretches it
        # encodes independently (a token's offsets cover any whitespace its lstrip/rstrip
        # swallows). A stretch with holes is encoded again as text, holes filled; the others
        # keep their ids, which is just what HF would give for the whole text.
        parts, marks, pos, n = [], [], 0, 0  # marks: (position in `compact`, plain text)
        for start, end, plain in holes:
            parts += [text[pos:start], _HOLE]
            n += start - pos
            marks.append((n, plain))
            n, pos = n + 1, end
        parts.append(text[pos:])
        compact = "".join(parts)
        at = [m[0] for m in marks]
        enc = _encode(self._tk, compact)
        ids, special = enc.ids, self.special_ids
        out: list[int] = []
        h, seg_start, seg_ids = 0, 0, 0  # next mark; current stretch's first char and id
        for i in [*(i for i, t in enumerate(ids) if t in special), len(ids)]:
            if i < len(ids):
                a, b = enc.token_to_chars(i)
                k = bisect.bisect_left(at, a)
                if k < len(at) and at[k] < b:  # a token over a hole is no control token
                    continue
            else:
                a = b = len(compact)
            if h < len(marks) and marks[h][0] < a:
                pieces, p = [], seg_start
                while h < len(marks) and marks[h][0] < a:
                    m, plain = marks[h]
                    pieces += [compact[p:m], plain]
                    p, h = m + 1, h + 1
                pieces.append(compact[p:a])
                tk = self._plain_first if seg_start == 0 else self._plain_inner
                out += _encode(tk, "".join(pieces)).ids
            else:
                out += ids[seg_ids:i]
            if i < len(ids):
                out.append(ids[i])
            seg_start, seg_ids = b, i + 1
        return out

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        return self._tk.decode(list(ids), skip_special_tokens=skip_special)

    def id_to_token(self, i: int) -> str | None:
        return self._tk.id_to_token(i)

    def token_to_id(self, token: str) -> int | None:
        return self._tk.token_to_id(token)

    def token_bytes(self, i: int) -> bytes:
        """Raw bytes token ``i`` stands for; grammar matching and streaming work on these."""
        cached = self._bytes_cache.get(i)
        if cached is not None:
            return cached
        tok = self._tk.id_to_token(i) or ""
        if i in self._added_ids:
            out = tok.encode()
        elif self.byte_level:
            table = _unicode_to_byte()
            out = b"".join(bytes([table[c]]) if c in table else c.encode() for c in tok)
        elif m := _BYTE_TOKEN.fullmatch(tok):
            out = bytes([int(m.group(1), 16)])
        else:
            out = tok.replace("▁", " ").encode()
        self._bytes_cache[i] = out
        return out

    def all_token_bytes(self) -> list[bytes]:
        return [self.token_bytes(i) for i in range(self.vocab_size)]

    def to_hf_tokenizer_json(self) -> str:
        """Serialized ``tokenizer.json``: what exported models ship for transformers, and what
        llguidance builds its grammar vocabulary from (`runtime.grammar.ll_tokenizer`)."""
        return self._tk.to_str()


def _plain_copies(hf: HFTokenizer) -> tuple[HFTokenizer, HFTokenizer]:
    """Two copies of ``hf`` that encode special tokens' strings as text: as ``hf`` does at the
    start of a text, and as it does after a control token (no Metaspace "first" prefix)."""
    source = hf.to_str()
    first = HFTokenizer.from_str(source)
    first.encode_special_tokens = True
    if '"prepend_scheme":"first"' not in source:
        return first, first
    config = json.loads(source)

    def no_first(node: Any) -> bool:
        changed = False
        if isinstance(node, dict):
            if node.get("type") == "Metaspace" and node.get("prepend_scheme") == "first":
                node["prepend_scheme"] = "never"
                changed = True
            for v in node.values():
                changed = no_first(v) or changed
        elif isinstance(node, list):
            for v in node:
                changed = no_first(v) or changed
        return changed

    if not no_first(config.get("pre_tokenizer")):
        return first, first
    inner = HFTokenizer.from_str(json.dumps(config))
    inner.encode_special_tokens = True
    return first, inner


def _hf_chat_template(path: Path, cfg: Mapping[str, Any]) -> str | None:
    """Templates live in tokenizer_config.json (str or named list) or chat_template.jinja."""
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    tpl = cfg.get("chat_template") or _read_json(path / "chat_template.json").get("chat_template")
    if isinstance(tpl, list):
        named = {t.get("name"): t.get("template") for t in tpl}
        tpl = named.get("default") or next(iter(named.values()), None)
    return tpl
