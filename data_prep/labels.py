"""Greedy distilled labels and hidden states from the frozen base model.

* :func:`forward_features` — one batched teacher-forced forward pass: hidden states of the
  requested layers (HF convention, design.md: ``hs[L]`` is the final post-norm state) and the
  greedy label ``argmax_v z_t`` at every position (the base's prediction of token t+1).
  The LM head is applied in chunks so the [B, T, V] logits tensor is never materialised.
* :func:`regenerate` — ``labels=regenerate`` (METHODS.md §0 Rec.): every assistant turn is
  rewritten by the base model's own greedy decoding, given the conversation so far, up to
  ``data.max_length`` tokens per turn by default: continuous batching over a slot KV cache
  (each conversation keeps its slot across its turns; a finished conversation's slot takes the
  next one at once).  Each later turn's context is rendered from the regenerated replies by the
  evaluation's rule (:func:`core.follow_up.follow_up`).  Features then come from a teacher-forced
  pass over the regenerated conversation, so labels equal what the base really emits.
"""
from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Sequence

import torch

from core.follow_up import follow_up
from data_prep.sharegpt import trained_turn
from data_prep.template import pad_token_id


def _pad_right(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.as_tensor(list(s), dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids, mask


@torch.inference_mode()
def forward_features(model, seqs: Sequence[Sequence[int]], pad_id: int, layers: Sequence[int],
                     head_chunk: int = 2048) -> list[dict]:
    """Teacher-forced features for a batch of token sequences (:func:`data_prep.features.teacher_forced`).

    Args:
        model: a frozen HF causal LM (``model.base_model`` returns ``hidden_states``;
            ``model.get_output_embeddings()`` is the LM head W).
        seqs: B token-id lists (right-padded internally with ``pad_id``).
        pad_id: the tokenizer's pad id.
        layers: hidden-state indices to return (0..L; L = final post-norm).
        head_chunk: tokens per LM-head matmul when computing the argmax.

    Returns:
        one dict per sequence (length T_i): ``labels`` LongTensor [T_i] (argmax of the logits at
        each position), ``hidden`` ``{l: FloatTensor [T_i, H]}`` in the model's dtype (the compute
        dtype, ``model.dtype``) and ``logits_finite`` BoolTensor [T_i] (False where a logit is NaN /
        ±inf: the label is undefined).
    """
    from data_prep.features import teacher_forced

    ids, attn = _pad_right(seqs, pad_id)
    device = next(model.parameters()).device
    labels, hs, finite = teacher_forced(model, ids.to(device), attn.to(device), head_chunk)
    lengths = [len(s) for s in seqs]
    return [{"labels": labels[i, :n].cpu(), "logits_finite": finite[i, :n].cpu(),
             "hidden": {l: hs[l][i, :n].cpu() for l in layers}} for i, n in enumerate(lengths)]


# ---------------------------------------------------------------------------------------------
# labels=regenerate: continuous batching over a slot KV cache
# ---------------------------------------------------------------------------------------------

class _Plan:
    """Where the next forward's tokens go in a :func:`_slot_cache` (shared by all its layers).

    ``rows`` None: a decode step over slots ``0..A-1``, one token each, ``cols`` [A] its column;
    the layers return views ``[:A, :, :hi]`` (no copy).  ``rows`` LongTensor [J]: a prefill of
    those slots, ``cols`` [J, N] the column of every fed token (the dump column ``width`` for left
    padding); the layers return ``[rows, :, :hi]`` (a gather).
    """

    def __init__(self, slots: int):
        self.rows: torch.Tensor | None = None
        self.cols = torch.zeros(0, dtype=torch.long)
        self.hi = 0
        self.arange = torch.arange(slots)
        self.heads = torch.arange(1024)


_SLOT_LAYER = None


def _slot_layer_class():
    """The transformers cache layer over slots (defined on first use: importing transformers is slow)."""
    global _SLOT_LAYER
    if _SLOT_LAYER is None:
        from transformers.cache_utils import CacheLayerMixin

        class SlotLayer(CacheLayerMixin):
            """One layer's keys and values [S, H_kv, width + 1, D]: slot s holds its row's token at
            position p in column p (left-aligned, so a row's next turn appends in place); column
            ``width`` takes the padding's keys and is never attended to."""

            is_sliding = False

            def __init__(self, plan: _Plan, slots: int, width: int):
                super().__init__()
                self.plan, self.slots, self.width = plan, slots, width

            def lazy_initialization(self, key_states, value_states):
                shape = (self.slots, key_states.shape[1], self.width + 1)
                self.keys = key_states.new_zeros((*shape, key_states.shape[-1]))
                self.values = value_states.new_zeros((*shape, value_states.shape[-1]))
                self.device = key_states.device
                self.is_initialized = True

            def update(self, key_states, value_states, *args, **kwargs):
                if not self.is_initialized:
                    self.lazy_initialization(key_states, value_states)
                p = self.plan
                H, C = self.keys.shape[1], self.keys.shape[2]
                # flat row index of (slot, head, column) in the [S * H * C, D] view: one index_copy_ per tensor
                if p.rows is None:
                    A = key_states.shape[0]
                    flat = ((p.arange[:A, None] * H + p.heads[None, :H]) * C + p.cols[:, None]).reshape(-1)
                else:
                    flat = ((p.rows[:, None, None] * H + p.heads[None, :H, None]) * C + p.cols[:, None, :]).reshape(-1)
                self.keys.view(-1, self.keys.shape[-1]).index_copy_(0, flat, key_states.reshape(-1, key_states.shape[-1]))
                self.values.view(-1, self.values.shape[-1]).index_copy_(
                    0, flat, value_states.reshape(-1, value_states.shape[-1]))
                if p.rows is None:
                    return self.keys[:A, :, : p.hi], self.values[:A, :, : p.hi]
                return self.keys[p.rows, :, : p.hi], self.values[p.rows, :, : p.hi]

            def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
                return self.plan.hi, 0

            def get_seq_length(self) -> int:
                return self.plan.hi

            def get_max_length(self) -> int:
                return self.width

            def move(self, dst: int, src: int, n: int) -> None:
                if self.is_initialized and n:
                    self.keys[dst, :, :n] = self.keys[src, :, :n]
                    self.values[dst, :, :n] = self.values[src, :, :n]

        _SLOT_LAYER = SlotLayer
    return _SLOT_LAYER


def _slot_cache(plan: _Plan, slots: int, width: int):
    """A transformers ``Cache`` of :func:`_slot_layer_class` layers (allocated on the first forward)."""
    from functools import partial

    from transformers.cache_utils import Cache

    return Cache(layer_class_to_replicate=partial(_slot_layer_class(), plan, slots, width))


def _check_full_attention(model, max_length: int) -> None:
    """The slot cache implements full causal attention; refuse a window shorter than ``max_length``."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    types = getattr(cfg, "layer_types", None) or []
    window = getattr(cfg, "sliding_window", None)
    uses_window = any(t != "full_attention" for t in types) or (
        window is not None and bool(getattr(cfg, "use_sliding_window", True)) and not types)
    if uses_window and (window is None or int(window) < max_length):
        raise ValueError(f"labels=regenerate: {type(model).__name__} has attention layers other than full causal "
                         f"attention (layer_types={sorted(set(types)) or None}, sliding_window={window}) shorter than "
                         f"data.max_length={max_length}; regeneration supports full-attention decoders only")


@dataclass(frozen=True)
class RegenSource:
    """One conversation to regenerate (:func:`regen_sources`).

    Attributes:
        id: the conversation id (its records are ``id``, ``id#1``, ...).
        messages: normalised ``[{"role", "content"}]`` messages (read only).
        turns: indices in ``messages`` of the assistant turns to write, in order: consecutive
            assistant turns (a turn that templating dropped ends the list, since every later
            context holds its reply).
        prompt: the token ids of ``turns[0]``'s generation prompt, as templating rendered them (the
            segments before it in its record, then its header); empty when ``turns`` is.
    """

    id: str
    messages: list[dict]
    turns: list[int]
    prompt: list[int]


def conversation_groups(records) -> list[list]:
    """Templated records (:class:`data_prep.front.TemplatedConversation`) grouped by conversation: the
    adjacent records that share one messages list, as :func:`data_prep.front.template_conversations`
    yields a conversation's records (two conversations that repeat an id stay apart).

    Raises:
        ValueError: a record carries no ``messages``.
    """
    groups: list[list] = []
    for rec in records:
        if rec.messages is None:
            raise ValueError(f"record {rec.id!r} carries no messages: regeneration renders later turns from them")
        if groups and groups[-1][-1].messages is rec.messages:
            groups[-1].append(rec)
        else:
            groups.append([rec])
    return groups


def regen_sources(records, stats: Counter | None = None) -> list[RegenSource]:
    """One :class:`RegenSource` per conversation of the templated records (:func:`conversation_groups`):
    the trained assistant turns templating kept, from the first kept one (earlier turns stay as the dataset
    wrote them) up to the first it dropped.

    Args:
        records: templated records carrying their ``messages``.
        stats: optional counter; ``turns_after_a_dropped_turn`` counts kept turns left out because an
            earlier turn was dropped (their context would hold a reply no regeneration wrote).

    Raises:
        ValueError: a record carries no ``messages``.
    """
    out: list[RegenSource] = []
    for group in conversation_groups(records):
        messages = group[0].messages
        turns = [seg.turn for rec in group for seg in rec.segments if seg.body]
        assistant = [i for i, m in enumerate(messages) if trained_turn(m)]
        start = assistant.index(turns[0]) if turns and turns[0] in assistant else len(assistant)
        n = 0
        while n < len(turns) and start + n < len(assistant) and turns[n] == assistant[start + n]:
            n += 1
        if stats is not None and n < len(turns):
            stats["turns_after_a_dropped_turn"] += len(turns) - n
        out.append(RegenSource(group[0].conversation_id, messages, turns[:n],
                               _generation_prompt(group, turns[0]) if n else []))
    return out


def _generation_prompt(group, turn: int) -> list[int]:
    """The token ids before ``turn``'s body in the record that holds it: the record's earlier
    segments (a segment without a body included) followed by that segment's header."""
    for rec in group:
        ids: list[int] = []
        for seg in rec.segments:
            if seg.turn == turn:
                return ids + list(seg.ids[: seg.header])
            ids.extend(seg.ids)
    raise AssertionError(f"conversation {group[0].conversation_id!r}: no segment holds turn {turn}")


@dataclass
class _Conv:
    """One conversation being regenerated: its current record (``ids`` / ``mask``) grows as turns are
    written; a record closed by a template that rewrites history moves to ``records``."""

    source: RegenSource
    messages: list[dict]         # the source's messages, each written reply's content replaced
    k: int = 0                   # the turn being written: source.turns[k]
    prompt_len: int = 0          # ids[:prompt_len] is the turn's context (its generation prompt)
    ids: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    records: list[tuple[list[int], list[bool]]] = field(default_factory=list)
    fed: int = 0                 # tokens of ``ids`` whose keys/values are in the slot
    pending: list[int] = field(default_factory=list)  # tokens to feed next (ids[fed:])
    budget: int = 0              # tokens this turn may still generate
    slot: int = -1


class _Regenerator:
    """Continuous batching over ``slots`` KV-cache slots (:func:`regenerate` describes the schedule)."""

    def __init__(self, model, tokenizer, convs: list[_Conv], eos_ids: set[int], max_new_tokens: int | None,
                 max_length: int, slots: int, pad_id: int, on_generated, on_done, stats: Counter):
        self.model, self.tokenizer, self.convs, self.eos = model, tokenizer, convs, set(int(e) for e in eos_ids)
        self.max_new, self.max_length, self.pad_id = max_new_tokens, max_length, pad_id
        self.on_generated, self.on_done, self.stats = on_generated, on_done, stats
        self.errors: dict[str, str] = {}  # the first message per counted fault
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.plan = _Plan(slots)
        self.plan.arange, self.plan.heads = self.plan.arange.to(self.device), self.plan.heads.to(self.device)
        self.cache = _slot_cache(self.plan, slots, max_length)
        self.columns = torch.arange(max_length + 1, device=self.device)
        self.neg = torch.finfo(self.dtype).min
        self.slots = slots
        self.active: list[int] = []  # slot -> conversation index, slots 0..A-1

    # -- turns ----------------------------------------------------------------------------
    def _begin(self, c: _Conv) -> bool:
        """Queue ``c``'s first turn (its generation prompt); False when it has none within ``max_length``."""
        if not c.source.turns:
            return False
        c.ids, c.mask, c.fed = list(c.source.prompt), [False] * len(c.source.prompt), 0
        return self._open_turn(c)

    def _open_turn(self, c: _Conv) -> bool:
        """``c.ids`` ends with turn ``c.k``'s generation prompt: queue its unfed tokens; False when
        the prompt leaves no room for a reply (the record is kept, the conversation ends)."""
        if len(c.ids) >= self.max_length:
            return self._finish(c)
        c.prompt_len = len(c.ids)
        room = self.max_length - len(c.ids)
        c.budget = room if self.max_new is None else min(self.max_new, room)
        c.pending = c.ids[c.fed:]
        return True

    def _finish(self, c: _Conv) -> bool:
        """Close the current record (if it holds a reply) and end ``c``; returns False."""
        if any(c.mask):
            c.records.append((c.ids[: self.max_length], c.mask[: self.max_length]))
        c.ids, c.mask, c.pending = [], [], []
        return False

    def _close(self, c: _Conv, tail: list[int]) -> None:
        """Append the template's tokens after the reply; its first takes the generated end-of-turn's
        place (another eos of the base, e.g. <|endoftext|> where the template closes with <|im_end|>:
        at inference the reply stops there and the template writes its own token)."""
        if not tail:
            return
        if tail[0] != c.ids[-1]:
            c.ids[-1] = tail[0]
            self.stats["closed_by_template"] += 1
        c.ids.extend(tail[1:])
        c.mask.extend([False] * (len(tail) - 1))

    def _next_turn(self, c: _Conv) -> bool:
        """The reply of turn ``c.k`` ended with an end-of-turn token: render what follows it as
        inference does (:func:`core.follow_up.follow_up`) and queue the next turn; False when ``c`` ends."""
        turns, t = c.source.turns, c.source.turns[c.k]
        prompt, answer = c.ids[: c.prompt_len], c.ids[c.prompt_len:]
        last = c.k + 1 >= len(turns)
        following = [] if last else c.messages[t + 1: turns[c.k + 1]]
        try:
            nxt = follow_up(self.tokenizer, c.messages[:t], prompt, answer, following, self.eos)
            closing = nxt if (last or nxt.extended) else follow_up(self.tokenizer, c.messages[:t], prompt, answer,
                                                                   [], self.eos)
        except Exception as exc:  # noqa: BLE001 — jinja's TemplateError, raise_exception, a filter's TypeError, ...
            # the template cannot render the regenerated reply: keep what is written, count it, name the first
            self.stats["template_errors"] += 1
            self.errors.setdefault("template_errors", f"conversation {c.source.id!r}, turn {t}: "
                                                      f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            return self._finish(c)
        c.messages[t] = {**c.messages[t], "content": nxt.answer_text}
        if closing.extended:
            self._close(c, closing.tail)
        if last:
            return self._finish(c)
        c.k += 1
        if not nxt.extended:  # the template rewrote an earlier turn: the next turn starts a new record
            self.stats["rerendered_turns"] += 1
            self._finish(c)
            c.ids, c.mask, c.fed = list(nxt.ids), [False] * len(nxt.ids), 0  # the slot is refilled from column 0
        return self._open_turn(c)

    def _emit(self, c: _Conv, tok: int) -> bool:
        """Append a generated token; return False when ``c`` has no further turn."""
        c.ids.append(tok)
        c.mask.append(True)
        c.budget -= 1
        self.stats["generated_tokens"] += 1
        if tok in self.eos:
            self.stats["turns"] += 1
            return self._next_turn(c)
        if c.budget <= 0:  # cut by prep.max_new_tokens / data.max_length: no end-of-turn, conversation ends
            self.stats["turns"] += 1
            self.stats["truncated_turns"] += 1
            return self._finish(c)
        c.pending = [tok]
        return True

    # -- forwards -------------------------------------------------------------------------
    def _forward(self, slots: list[int] | None) -> torch.Tensor:
        """Feed the pending tokens of ``slots`` (None = every active slot, one token each).

        Returns the logits after each row's last fed token, [rows, V] in the model's dtype."""
        dev = self.device
        if slots is None:
            convs = [self.convs[k] for k in self.active]
            fed = torch.tensor([c.fed for c in convs], dtype=torch.long)
            ids = torch.tensor([c.pending[0] for c in convs], dtype=torch.long)[:, None]
            pos = fed[:, None]
            self.plan.rows, self.plan.cols = None, fed.to(dev)
        else:
            convs = [self.convs[self.active[s]] for s in slots]
            N = max(len(c.pending) for c in convs)
            ids = torch.full((len(convs), N), self.pad_id, dtype=torch.long)
            pos = torch.zeros((len(convs), N), dtype=torch.long)
            cols = torch.full((len(convs), N), self.max_length, dtype=torch.long)
            for j, c in enumerate(convs):
                n = len(c.pending)
                ids[j, N - n:] = torch.as_tensor(c.pending, dtype=torch.long)
                pos[j, N - n:] = torch.arange(c.fed, c.fed + n)
                cols[j, N - n:] = pos[j, N - n:]
            self.plan.rows, self.plan.cols = torch.as_tensor(slots, dtype=torch.long, device=dev), cols.to(dev)
        hi = max(c.fed + len(c.pending) for c in convs)
        self.plan.hi = hi
        pos = pos.to(dev)
        # query at position q sees columns 0..q (its row's own past, left-aligned); padding queries see column 0
        allowed = self.columns[None, None, :hi] <= pos[:, :, None]
        if getattr(self.model.config, "_attn_implementation", None) == "sdpa":
            mask = allowed[:, None]  # boolean: True = attend
        else:  # additive, as eager attention expects
            mask = torch.zeros(allowed.shape, dtype=self.dtype, device=dev).masked_fill_(~allowed, self.neg)[:, None]
        out = self.model(input_ids=ids.to(dev), attention_mask=mask, position_ids=pos, cache=self.cache,
                         use_cache=True, logits_to_keep=1)
        for c in convs:
            c.fed += len(c.pending)
            c.pending = []
        return out.logits[:, -1]

    def _done(self, n: int) -> None:
        if self.on_done is not None:
            self.on_done(n)

    # -- schedule -------------------------------------------------------------------------
    def run(self, order: Sequence[int]) -> None:
        queue = list(reversed(order))  # pop() takes the next conversation

        def admit() -> int | None:
            while queue:
                k = queue.pop()
                if self._begin(self.convs[k]):
                    return k
                self._done(1)  # no turn fits within max_length
            return None

        while len(self.active) < self.slots:
            k = admit()
            if k is None:
                break
            self.active.append(k)
        while self.active:
            while True:  # prefill every slot with more than one pending token (new turns, new conversations)
                multi = [s for s, k in enumerate(self.active) if len(self.convs[k].pending) > 1]
                if not multi:
                    break
                self._step(multi, self._forward(multi).argmax(-1).tolist(), admit)
            if self.active:
                self._step(list(range(len(self.active))), self._forward(None).argmax(-1).tolist(), admit)

    def _step(self, slots: list[int], tokens: list[int], admit) -> None:
        free = []
        for s, tok in zip(slots, tokens):
            if not self._emit(self.convs[self.active[s]], tok):
                free.append(s)
        if self.on_generated is not None:
            self.on_generated(len(tokens))
        if free:
            self._done(len(free))
        for s in free:  # a finished conversation's slot takes the next one from the queue (from column 0)
            k = admit()
            if k is not None:
                self.active[s] = k
            else:
                self.active[s] = -1
        if any(k < 0 for k in self.active):  # nothing left to admit: keep the busy slots at 0..A-1
            layers = self.cache.layers
            busy = [k for k in self.active if k >= 0]
            for s in range(len(busy)):
                if self.active[s] < 0:
                    src = max(i for i, k in enumerate(self.active) if k >= 0)
                    k = self.active[src]
                    for layer in layers:
                        layer.move(s, src, self.convs[k].fed)
                    self.active[s], self.active[src] = k, -1
            self.active = self.active[: len(busy)]


@contextmanager
def _fast_attention(model):
    """Run regeneration on ``sdpa`` when the base was loaded with ``eager`` (restored after).

    Eager attention copies each key/value head per query group (``repeat_kv``) at every step;
    ``sdpa``'s single-query path groups the queries instead (docs/data_prep.md).  Any other
    implementation is kept."""
    old = getattr(model.config, "_attn_implementation", None)
    switch = old == "eager" and getattr(model, "_supports_sdpa", False) and hasattr(model, "set_attn_implementation")
    if switch:
        model.set_attn_implementation("sdpa")
        switch = model.config._attn_implementation == "sdpa"
    try:
        yield
    finally:
        if switch:
            model.set_attn_implementation(old)


@contextmanager
def packed_for_generation(model, mode: str = "auto"):
    """``prep.prepack_weights`` (``auto`` | ``true`` | ``false``) for the duration of a regeneration: the
    base's linear weights packed for oneDNN as the evaluation packs them
    (:func:`decoding.prepacked.pack_for_decoding`), then restored, so features are always computed by the
    plain products that online training and a fresh forward use.

    ``auto`` packs a bf16 / fp16 base where packed bf16 was measured the fastest (AMX, AMD
    ``avx512_bf16``: 123 against 92 regenerated tokens/s at batch 8 on a Zen 4, ``benchmarks/bench_regen.py``),
    never an fp32 one (not measured for regeneration; its packed products round differently from batch-1
    decoding).  A base its caller packed already is left as it is.  Yields the packed layers' names.

    Raises:
        ValueError: ``true`` where packing cannot apply (names ``prep.prepack_weights``).
    """
    from decoding.prepacked import pack_for_decoding, packed_layers, restore_linear_weights

    if packed_layers(model) or mode == "false" or (mode == "auto" and model.dtype == torch.float32):
        yield []
        return
    names = pack_for_decoding(model, mode, "prep.prepack_weights")
    try:
        yield names
    finally:
        if names:
            restore_linear_weights(model)


@torch.inference_mode()
def regenerate(model, tokenizer, conversations: Sequence[RegenSource], eos_ids: set[int], max_new_tokens: int | None,
               max_length: int, batch_size: int = 16, on_generated=None, stats: Counter | None = None,
               on_done=None, errors: dict[str, str] | None = None) -> list[list[tuple[list[int], list[bool]]]]:
    """Greedily regenerate every assistant turn with the base model (``labels=regenerate``).

    Each conversation's turns (``RegenSource.turns``) are written in order, each from the context
    inference gives it: the first turn's generation prompt, then after each reply what
    :func:`core.follow_up.follow_up` renders from the regenerated replies so far (the evaluation's
    multi-turn rule).  A prefix-stable template (ChatML) extends the record by the template's tokens
    (the reply's end-of-turn, the next user turn, the generation prompt); one that rewrites earlier
    turns (Qwen3 stripping reasoning, DeepSeek-R1's think-block prompt, window templates) closes the
    record and starts the next turn's record with its own rendering of the regenerated conversation.
    The reply's end-of-turn takes the template's closing token (another eos of the base, e.g.
    ``<|endoftext|>``, is replaced and counted).  Each row's tokens equal batch-1 greedy decoding of
    its context (argmax of the logits, first maximum on ties) up to floating-point rounding: exact
    in float32 on the tests' model; in bfloat16 a near-tie may differ from batch 1
    (``benchmarks/bench_regen.py --agree-turns`` measures the share that agrees).

    Schedule (continuous batching): ``batch_size`` KV-cache slots, each holding one
    conversation's keys/values left-aligned (a row's token at position p in column p, its own
    positions, every other column masked out), so a conversation's next turn appends its new
    tokens in place, with no copy (a re-rendered record refills its slot from column 0).  A slot
    whose conversation ends takes the next one from the queue at once, so the batch stays full
    until the queue is empty; then the remaining rows are packed into the first slots (one row
    copy each) so every decode step reads plain views.  New tokens are prefilled in one
    left-padded forward of the slots that need it; every other step is one token per slot.  The
    queue holds the conversations longest original replies (in characters) first (ties by index),
    so the long ones do not run alone at the end.  Attention spans the longest active row, so rows
    of very different lengths share a step's attention width only.

    Budget: a turn may generate up to ``max_new_tokens`` tokens (``None`` = full length: up to
    ``max_length`` minus its context).  A turn cut by the budget keeps its tokens without an
    end-of-turn it did not generate and ends its conversation (later turns would follow a cut
    response); so does a context that reaches ``max_length`` tokens, and a regenerated reply the
    template cannot render (counted).

    Attention runs on ``sdpa`` for the duration when the base was loaded with ``eager``
    (:func:`_fast_attention`).

    Memory: the slot cache holds ``2 × layers × batch_size × H_kv × (max_length + 1) × D``
    values in the model's dtype (SmolLM2-135M, fp32, 64 slots, 512 tokens: 1.5 GB).

    Args:
        model, tokenizer: the frozen base (any dtype; a full-attention HF decoder whose attention
            calls ``cache.update``) and its tokenizer with its chat template.
        conversations: what to regenerate (:func:`regen_sources`).
        eos_ids: end-of-turn ids (generation stops at any of them).
        max_new_tokens: generation budget per assistant turn, or ``None`` (full length).
        max_length: token budget per record.
        batch_size: KV-cache slots (rows per decode step).
        on_generated: optional callback ``f(n_tokens)`` after every forward (tokens emitted by it).
        on_done: optional callback ``f(n_conversations)`` when conversations end (all of them, in
            schedule order); an exception raised by either callback stops the regeneration.
        stats: optional counter; ``generated_tokens``, ``turns`` (regenerated replies),
            ``truncated_turns`` (replies cut by the budget), ``closed_by_template``,
            ``rerendered_turns`` (turns whose context the template re-rendered: a new record) and
            ``template_errors`` (conversations ended because the template raised on a regenerated
            reply) are added.
        errors: optional dict; receives the first message per counted fault (``template_errors``:
            the conversation, the turn and the template's exception).

    Returns:
        per conversation its records, each ``(input_ids, loss_mask)`` of at most ``max_length``
        tokens with the mask True on generated tokens (one record under a prefix-stable template;
        none when no reply fits).

    Raises:
        ValueError: the model has sliding-window layers narrower than ``max_length``.
    """
    _check_full_attention(model, max_length)
    pad_id = pad_token_id(tokenizer, eos_ids)
    stats = stats if stats is not None else Counter()
    convs = [_Conv(src, [dict(m) for m in src.messages]) for src in conversations]
    if convs:
        def original(k: int) -> int:
            src = convs[k].source
            return sum(len(str(src.messages[t]["content"])) for t in src.turns)

        order = sorted(range(len(convs)), key=lambda k: (-original(k), k))
        engine = _Regenerator(model, tokenizer, convs, eos_ids, max_new_tokens, max_length,
                              max(1, min(batch_size, len(convs))), pad_id, on_generated, on_done, stats)
        with _fast_attention(model):
            engine.run(order)
        if errors is not None:
            for key, message in engine.errors.items():
                errors.setdefault(key, message)
    return [c.records for c in convs]
