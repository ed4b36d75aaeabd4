"""Rendering with the model's own chat template, and the label masks.

The trainable character spans of a conversation come from one of two places:

- the template's `{% generation %}` markers, where it has them;
- otherwise (most stock templates), rendering prefixes: assistant turn i spans
  from the end of `render(messages[:i], add_generation_prompt=True)` to the
  end of `render(messages[:i+1])`, so it holds the reply and the template's
  end-of-turn token, and none of the header the prompt already contains. The
  whitespace a template puts after the end-of-turn token is not trained on (a
  model never generates it: generation stops at that token).

Rendering every prefix costs time quadratic in the number of turns (a 10,000-turn
conversation took 50 s). Conversations of more than `PREFIX_RENDER_MAX_MESSAGES`
messages are therefore rendered once and cut at the same places from the
template's layout (`_Layout`): what it writes before, between and after
messages and after a prefix, learned once from probe conversations whose
contents are placeholders. The layout must reproduce the rendered text exactly
(each content verbatim or stripped, each piece of template text in its place),
else that conversation falls back to the search below. Same spans, linear time.

A plain-text record (data.format=text, `formats.is_text`) is no conversation: it is written as it is, after
the beginning-of-sequence token where the tokenizer adds one and before its end-of-sequence token (as TRL
writes language-modelling text), with no chat template, and every token is trainable.

Texts are then tokenized in batches by the fast tokenizer with offsets, and a
token is trainable when it starts inside a trainable span. Both routes give
the same labels for the same conversation (tested).
"""

from __future__ import annotations

import bisect
import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from finetune.core.errors import DataError
from finetune.data.formats import Messages, is_text

IGNORE_INDEX = -100
_MARKERS = re.compile(r"\{%-?\s*generation\s*-?%\}")
# Up to this many messages the spans come from rendering prefixes; beyond, from the template's layout.
PREFIX_RENDER_MAX_MESSAGES = 32
# Probe conversations (contents are placeholders of private-use characters) the layout is learned from.
_PROBES = (
    ("system", "user", "assistant", "user", "assistant", "user", "assistant"),
    ("user", "assistant", "user", "assistant", "user", "assistant"),
)


@dataclass
class _Layout:
    """The text a template writes around message contents, learned from probe conversations.

    Keys are roles; `first` marks the conversation's first message, whose surroundings may differ.
    """

    head: dict[str, str] = field(default_factory=dict)  # first role -> text before its content
    sep: dict[tuple[str, str, bool], str] = field(default_factory=dict)  # (role, next role, first) -> between
    tail: dict[str, str] = field(default_factory=dict)  # last role -> text after the last content
    # (role, first) -> text after the content of a prefix's last message, and the generation prompt after it
    last: dict[tuple[str, bool], str] = field(default_factory=dict)
    gen: dict[tuple[str, bool], str] = field(default_factory=dict)

    def texts(self) -> list[str]:
        return [
            *self.head.values(),
            *self.sep.values(),
            *self.tail.values(),
            *self.last.values(),
            *self.gen.values(),
        ]


def _put(table: dict, key: Any, value: str) -> bool:
    """Record `value` under `key`; False when the template wrote something else there before."""
    return table.setdefault(key, value) == value


@functools.lru_cache(maxsize=1)
def _helpers() -> tuple[Any, Any]:
    """transformers' private helpers (compiling a template, rendering it with the markers' spans), imported
    when first needed; (None, None) if they move, and the public path is taken."""
    try:
        from transformers.utils.chat_template_utils import (
            _compile_jinja_template,
            _render_with_assistant_indices,
        )
    except ImportError:
        return None, None
    return _compile_jinja_template, _render_with_assistant_indices


def _compiled(template: str) -> Any:
    """The template compiled as transformers compiles it (cached there), or None without its helper."""
    compile_template = _helpers()[0]
    return None if compile_template is None else compile_template(template)


def has_generation_markers(template: str) -> bool:
    return bool(_MARKERS.search(template))


class Renderer:
    """Turns conversations into `input_ids` and `labels` with one tokenizer's chat template."""

    def __init__(self, tokenizer: Any, train_on: str = "assistant"):
        if not getattr(tokenizer, "is_fast", False):
            raise DataError(
                "the tokenizer is not a fast tokenizer (offsets are needed to place the label masks)"
            )
        template = tokenizer.chat_template
        if isinstance(template, dict):
            template = template.get("default")
        self.tokenizer = tokenizer
        # A base model may have none: only conversations need it (`_render` says so), plain text does not.
        self.template: str = template or ""
        self.train_on = train_on
        self.markers = has_generation_markers(self.template)
        self.template_kwargs = dict(tokenizer.special_tokens_map)
        self.prefix_fallbacks = 0  # conversations whose prefixes did not render as prefixes
        self._layout_learned = False
        self._layout: Optional[_Layout] = None
        self._compiled: Any = _compiled(template) if template else None
        self._text_bos = _adds_bos(tokenizer)

    def __getstate__(self) -> dict:  # compiled templates do not pickle (data.num_proc worker processes)
        return {**self.__dict__, "_compiled": None, "_recompile": True}

    def __setstate__(self, state: dict) -> None:
        recompile = state.pop("_recompile", False)
        self.__dict__.update(state)
        if recompile:
            self._compiled = _compiled(self.template)

    def _render(self, convs: list[Messages], add_generation_prompt: bool = False, markers: bool = False):
        if not self.template:
            raise DataError(
                "the tokenizer has no chat template: set one (tokenizer.chat_template) for this model, or train "
                "on plain text (data.format=text)"
            )
        if self._compiled is not None:
            # The same compiled template and variables transformers uses, without its per-call copying of
            # every message into plain data (ours are plain: {"role": str, "content": str}, from
            # formats.to_messages); with the markers, through its own helper that tracks their spans. That
            # copying is a third of the rendering's time on tiny records (BENCHMARKS.md, "Data preparation (CPU)").
            if not markers:
                return [
                    self._compiled.render(
                        messages=c, add_generation_prompt=add_generation_prompt, **self.template_kwargs
                    )
                    for c in convs
                ], []
            with_indices = _helpers()[1]
            if with_indices is not None:
                texts, indices = [], []
                for c in convs:
                    text, spans = with_indices(
                        self._compiled, c, None, None, add_generation_prompt, **self.template_kwargs
                    )
                    texts.append(text)
                    indices.append(spans)
                return texts, indices
        from transformers.utils.chat_template_utils import render_jinja_template

        return render_jinja_template(
            conversations=convs,
            chat_template=self.template,
            add_generation_prompt=add_generation_prompt,
            return_assistant_tokens_mask=markers,
            **self.template_kwargs,
        )

    def text(self, msgs: Messages, add_generation_prompt: bool = False) -> str:
        """The conversation rendered with the chat template (a prompt: with the assistant's opening)."""
        (out,), _ = self._render([msgs], add_generation_prompt=add_generation_prompt)
        return out

    def render(self, msgs: Messages) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and its trainable character spans."""
        if is_text(msgs):
            text = f"{self._text_bos}{msgs[0]['content']}{self.tokenizer.eos_token or ''}"
            return text, [(0, len(text))]
        if self.train_on == "all":
            (text,), _ = self._render([msgs])
            return text, [(0, len(text))]
        if self.markers:
            (text,), (indices,) = self._render([msgs], markers=True)
            spans = [(int(s), int(e)) for s, e in indices]
        else:
            text, spans = self._render_by_prefixes(msgs)
        spans = [(s, e) for s, e in (self._trim(text, s, e) for s, e in spans) if e > s]
        if self.train_on == "last":
            spans = spans[-1:]
        return text, spans

    @staticmethod
    def _trim(text: str, start: int, end: int) -> tuple[int, int]:
        while end > start and text[end - 1].isspace():
            end -= 1
        return start, end

    def layout(self) -> Optional[_Layout]:
        """The template's layout (learned on first use), or None when the probes do not reveal one."""
        if not self._layout_learned:
            self._layout, self._layout_learned = self._learn_layout(), True
        return self._layout

    def template_texts(self) -> list[str]:
        """The text the template writes around contents (for `finetune.data.control`); [] if unknown."""
        layout = self.layout()
        return layout.texts() if layout is not None else []

    def _learn_layout(self) -> Optional[_Layout]:
        layout = _Layout()
        for roles in _PROBES:
            probe = [{"role": r, "content": f"\ue000{k}\ue001"} for k, r in enumerate(roles)]
            prefixes = [probe[:k] for k in range(1, len(probe) + 1)]
            try:
                (full,), _ = self._render([probe])
                plain, _ = self._render(prefixes)
                prompted, _ = self._render(prefixes, add_generation_prompt=True)
            except Exception:  # a template that refuses this shape (no system role, ...): try the other
                continue
            starts = [full.find(m["content"]) for m in probe]
            if min(starts) < 0 or starts != sorted(starts):
                return None
            ends = [a + len(m["content"]) for a, m in zip(starts, probe)]
            ok = _put(layout.head, roles[0], full[: starts[0]]) and _put(
                layout.tail, roles[-1], full[ends[-1] :]
            )
            for j in range(len(probe) - 1):
                ok = ok and _put(layout.sep, (roles[j], roles[j + 1], j == 0), full[ends[j] : starts[j + 1]])
            for k, (pre, gen) in enumerate(zip(plain, prompted), start=1):
                end = ends[k - 1]
                ok = ok and pre[:end] == full[:end] and gen.startswith(pre)
                ok = ok and _put(layout.last, (roles[k - 1], k == 1), pre[end:])
                ok = ok and _put(layout.gen, (roles[k - 1], k == 1), gen[len(pre) :])
            if not ok:
                return None
        return layout if layout.head else None

    def _spans_by_layout(
        self, text: str, msgs: Messages, turns: list[int]
    ) -> Union[list[tuple[int, int]], str, None]:
        """The prefix route's spans from one rendering: None when the layout does not reproduce `text`,
        "search" where the prefix route itself would fall back to the search."""
        layout = self.layout()
        if layout is None or turns[0] == 0:
            return None
        roles = [m["role"] for m in msgs]
        head = layout.head.get(roles[0])
        if head is None or not text.startswith(head):
            return None
        pos, ends = len(head), []
        for j, m in enumerate(msgs):
            last = j == len(msgs) - 1
            after = layout.tail.get(roles[j]) if last else layout.sep.get((roles[j], roles[j + 1], j == 0))
            if after is None:
                return None
            for content in (m["content"], m["content"].strip()):  # verbatim, or trimmed by the template
                end = pos + len(content)
                if (
                    text.startswith(content, pos)
                    and text.startswith(after, end)
                    and (not last or end + len(after) == len(text))
                ):
                    break
            else:
                return None
            ends.append(end)
            pos = end + len(after)
        spans = []
        for i in turns:
            before = (roles[i - 1], i - 1 == 0)
            trailer, prompt, own = (
                layout.last.get(before),
                layout.gen.get(before),
                layout.last.get((roles[i], False)),
            )
            if trailer is None or prompt is None or own is None:
                return None
            p, q = ends[i - 1] + len(trailer) + len(prompt), ends[i] + len(own)
            if not (
                text.startswith(trailer + prompt, ends[i - 1]) and text.startswith(own, ends[i]) and q > p
            ):
                return "search"
            spans.append((p, q))
        return spans

    def _render_by_prefixes(self, msgs: Messages) -> tuple[str, list[tuple[int, int]]]:
        turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        (text,), _ = self._render([msgs])
        if not turns:
            return text, []
        if len(msgs) > PREFIX_RENDER_MAX_MESSAGES:  # linear: one rendering and the template's layout
            spans = self._spans_by_layout(text, msgs, turns)
            if isinstance(spans, list):
                return text, spans
            return text, self._spans_by_search(text, msgs, turns)
        prompts, _ = self._render([msgs[:i] for i in turns], add_generation_prompt=True)
        # A conversation that ends on its last reply: that turn ends where the text does (one render saved).
        last_is_end = turns[-1] == len(msgs) - 1
        ends, _ = self._render([msgs[: i + 1] for i in (turns[:-1] if last_is_end else turns)])
        if last_is_end:
            ends.append(text)
        spans = []
        for p, q in zip(prompts, ends):
            if len(q) > len(p) and text.startswith(q) and q.startswith(p):
                spans.append((len(p), len(q)))
            else:
                return text, self._spans_by_search(text, msgs, turns)
        return text, spans

    def _spans_by_search(self, text: str, msgs: Messages, turns: list[int]) -> list[tuple[int, int]]:
        """Fallback for templates that rewrite earlier turns: find each reply in order, plus a following EOS."""
        self.prefix_fallbacks += 1
        eos = self.tokenizer.eos_token or ""
        spans, cursor = [], 0
        for i in turns:
            content = msgs[i]["content"]
            start = text.find(content, cursor)
            if start < 0 or not content:
                continue
            end = start + len(content)
            if eos and text.startswith(eos, end):
                end += len(eos)
            spans.append((start, end))
            cursor = end
        return spans

    def encode(self, convs: list[Messages]) -> tuple[list[list[int]], list[list[int]]]:
        """Render, tokenize (one batched call) and mask a batch of conversations."""
        rendered = [self.render(m) for m in convs]
        all_ids, all_offsets = self._tokenize([t for t, _ in rendered])
        all_labels = []
        for ids, offsets, (_, spans) in zip(all_ids, all_offsets, rendered):
            labels = [IGNORE_INDEX] * len(ids)
            for ta, tb in _token_spans(offsets, spans):
                labels[ta:tb] = ids[ta:tb]
            all_labels.append(labels)
        return all_ids, all_labels

    def _tokenize(self, texts: list[str]) -> tuple[list[list[int]], list[list[tuple[int, int]]]]:
        """Each text's token ids and character offsets, without special tokens: the Rust tokenizer's batch
        call read directly where the transformers tokenizer has one, since turning each of its encodings
        into a dict of lists (`_convert_encoding`) takes as long as tokenizing (BENCHMARKS.md, "Data preparation (CPU)"). The
        first text goes through the transformers call too, which sets the backend's truncation, padding
        and special-token handling as it would for the whole batch, and must agree."""
        tok = self.tokenizer
        kwargs = dict(add_special_tokens=False, return_offsets_mapping=True, return_attention_mask=False)
        backend = getattr(tok, "backend_tokenizer", None)
        if backend is not None and texts:
            first = tok(texts[:1], **kwargs)
            encodings = backend.encode_batch(texts, add_special_tokens=False)
            if (
                encodings[0].ids == first["input_ids"][0]
                and encodings[0].offsets == first["offset_mapping"][0]
            ):
                return [e.ids for e in encodings], [e.offsets for e in encodings]
        enc = tok(texts, **kwargs)
        return list(enc["input_ids"]), list(enc["offset_mapping"])


def _adds_bos(tokenizer: Any) -> str:
    """The beginning-of-sequence token the tokenizer puts before a text of its own accord (Llama's), else ""."""
    bos = getattr(tokenizer, "bos_token", None)
    if not bos:
        return ""
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    return bos if len(with_special) > len(plain) and with_special[0] == tokenizer.bos_token_id else ""


def _token_spans(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> Iterator[tuple[int, int]]:
    """The tokens starting inside each character span [a, b), as [ta, tb): found by bisection."""
    for a, b in spans:
        ta = bisect.bisect_left(offsets, a, key=_start)
        yield ta, bisect.bisect_left(offsets, b, lo=ta, key=_start)


def _start(offset: tuple[int, int]) -> int:
    return offset[0]
