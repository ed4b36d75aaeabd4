"""Data stage building blocks: formats, reading bad input, cleaning, masks, packing, statistics."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest

from finetune.core.config.data import DataConfig
from finetune.core.errors import ConfigError
from finetune.data import clean, pack, sources, stats, synthetic
from finetune.data.formats import RecordError, to_messages, turn_order_problem
from finetune.data.render import IGNORE_INDEX, Renderer

CONVS = synthetic.conversations(40, seed=3, median_words=12)


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return synthetic.corpus_of(CONVS)


def _tok(corpus, template):
    return synthetic.build_tokenizer(corpus, template, vocab_size=400)


# --- masks ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "plain,marked",
    [(synthetic.LLAMA3, synthetic.LLAMA3_MARKERS), (synthetic.CHATML, synthetic.CHATML_MARKERS)],
)
@pytest.mark.parametrize("train_on", ["assistant", "last", "all"])
def test_masks_same_with_and_without_generation_markers(corpus, plain, marked, train_on):
    a, b = Renderer(_tok(corpus, plain), train_on), Renderer(_tok(corpus, marked), train_on)
    assert not a.markers and b.markers
    ids_a, lab_a = a.encode(CONVS)
    ids_b, lab_b = b.encode(CONVS)
    assert ids_a == ids_b
    assert lab_a == lab_b
    assert a.prefix_fallbacks == 0


@pytest.mark.parametrize("template", [synthetic.LLAMA3, synthetic.CHATML])
def test_assistant_labels_are_exactly_the_replies_and_end_of_turn(corpus, template):
    tok = _tok(corpus, template)
    r = Renderer(tok, "assistant")
    conv = next(c for c in CONVS if sum(m["role"] == "assistant" for m in c) >= 2)
    (ids,), (labels,) = r.encode([conv])
    trained = tok.decode([t for t, lab in zip(ids, labels) if lab != IGNORE_INDEX], skip_special_tokens=False)
    expected = "".join(m["content"].strip() + tok.eos_token for m in conv if m["role"] == "assistant")
    assert trained == expected
    # last: only the final reply
    (ids,), (labels,) = Renderer(tok, "last").encode([conv])
    trained = tok.decode([t for t, lab in zip(ids, labels) if lab != IGNORE_INDEX], skip_special_tokens=False)
    assert trained == conv[-1]["content"].strip() + tok.eos_token
    # all: every token
    (ids,), (labels,) = Renderer(tok, "all").encode([conv])
    assert labels == ids


def test_template_that_rewrites_earlier_turns_falls_back_to_search(corpus):
    # Drops every assistant reply but the last (as reasoning templates do with their thinking).
    template = (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
        "{% if message['role'] != 'assistant' or loop.last %}{{ message['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tok = _tok(corpus, template)
    r = Renderer(tok)
    conv = [
        {"role": "user", "content": "ka lo"},
        {"role": "assistant", "content": "mi ne"},
        {"role": "user", "content": "ru sa"},
        {"role": "assistant", "content": "to vi"},
    ]
    (ids,), (labels,) = r.encode([conv])
    assert r.prefix_fallbacks == 1
    assert tok.decode([t for t, lab in zip(ids, labels) if lab != IGNORE_INDEX]) == "to vi<|im_end|>"


def _long_conversation(turns: int, seed: int, system: bool) -> list[dict]:
    rng = random.Random(seed)
    words = ["ka", "lo", "mi ne", " ru", "sa\n", "to vi ", "el"]
    msgs = [{"role": "system", "content": " be brief "}] if system else []
    for t in range(turns):
        msgs.append({"role": "user", "content": f"{rng.choice(words)} q{t}{rng.choice(words)}"})
        msgs.append({"role": "assistant", "content": f"{rng.choice(words)}a{t} {rng.choice(words)}"})
    return msgs


def _plain_tiny() -> str:
    from finetune.modeling import tiny

    return tiny.CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")


@pytest.mark.parametrize("template", ["llama3", "chatml", "tiny"])
@pytest.mark.parametrize("system", [False, True])
def test_long_conversations_get_the_prefix_routes_spans_from_one_rendering(
    corpus, template, system, monkeypatch
):
    """Beyond PREFIX_RENDER_MAX_MESSAGES the spans come from the template's layout: the same spans (and
    labels) as rendering every prefix, which is what the short conversations still do."""
    from finetune.data import render

    text_template = {"llama3": synthetic.LLAMA3, "chatml": synthetic.CHATML, "tiny": _plain_tiny()}[template]
    r = Renderer(_tok(corpus, text_template))
    convs = [_long_conversation(40, seed, system) for seed in range(3)]
    fast = [r.render(c) for c in convs]
    monkeypatch.setattr(render, "PREFIX_RENDER_MAX_MESSAGES", 10**9)
    assert [r.render(c) for c in convs] == fast
    assert r.prefix_fallbacks == 0
    assert [len(spans) for _, spans in fast] == [40, 40, 40]


def test_a_layout_that_does_not_hold_falls_back_to_the_search(corpus):
    template = (  # every 50th message marked: position-dependent text the probes cannot see
        "{% for message in messages %}<|im_start|>{{ message['role'] }}{% if loop.index % 50 == 0 %}*{% endif %}\n"
        "{{ message['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tok = _tok(corpus, template)
    r = Renderer(tok)
    conv = _long_conversation(40, 0, False)
    (ids,), (labels,) = r.encode([conv])
    assert r.prefix_fallbacks == 1
    trained = tok.decode([t for t, lab in zip(ids, labels) if lab != IGNORE_INDEX])
    assert trained == "".join(m["content"] + "<|im_end|>" for m in conv if m["role"] == "assistant")


def test_a_10000_turn_conversation_masks_in_linear_time(corpus):
    """10,000 turns under a template without {% generation %} mask in linear time (rendering every prefix would be
    quadratic: about 50 s)."""
    import time

    r = Renderer(_tok(corpus, synthetic.CHATML))
    conv = _long_conversation(10_000, 1, True)
    t0 = time.perf_counter()
    text, spans = r.render(conv)
    assert time.perf_counter() - t0 < 5  # about 0.05 s here; the bound is loose (speed lives in benchmarks)
    assert len(spans) == 10_000 and r.prefix_fallbacks == 0
    assert all(text[a:b].endswith("<|im_end|>") for a, b in spans)


def test_renderer_needs_a_template(corpus):
    from finetune.core.errors import DataError

    tok = _tok(corpus, synthetic.LLAMA3)
    tok.chat_template = None
    with pytest.raises(DataError, match="chat template"):  # a conversation needs one; plain text does not
        Renderer(tok).encode([[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]])


# --- formats -------------------------------------------------------------------------------------------------


def test_formats_map_to_messages():
    cfg = DataConfig()
    assert to_messages({"prompt": "p", "completion": "c"}, cfg) == [
        {"role": "user", "content": "p"},
        {"role": "assistant", "content": "c"},
    ]
    assert (
        to_messages({"instruction": "do", "input": "this", "output": "done"}, cfg)[0]["content"]
        == "do\n\nthis"
    )
    assert to_messages({"instruction": "do", "input": "", "output": "done"}, cfg)[0]["content"] == "do"
    sharegpt = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
    assert [m["role"] for m in to_messages(sharegpt, cfg)] == ["user", "assistant"]
    conv_pc = {
        "prompt": [{"role": "user", "content": "a"}],
        "completion": [{"role": "assistant", "content": "b"}],
    }
    assert len(to_messages(conv_pc, cfg)) == 2
    as_csv_cell = {
        "messages": json.dumps([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    }
    assert len(to_messages(as_csv_cell, cfg)) == 2
    with_system = to_messages({"prompt": "p", "completion": "c"}, DataConfig(system_prompt="be brief"))
    assert with_system[0] == {"role": "system", "content": "be brief"}


@pytest.mark.parametrize(
    "record,reason",
    [
        ({"body": "x"}, "missing_field"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "unknown_role"),
        ({"messages": [{"role": "user"}]}, "missing_field"),
        ({"messages": [{"role": "user", "content": 3}]}, "bad_content"),
        ({"messages": "not json"}, "bad_messages"),
    ],
)
def test_bad_records_name_a_reason(record, reason):
    with pytest.raises(RecordError) as exc:
        to_messages(record, DataConfig())
    assert exc.value.reason == reason


def test_explicit_format_names_the_missing_field():
    with pytest.raises(RecordError, match="'answer'"):
        to_messages({"prompt": "p"}, DataConfig(format="prompt_completion", completion_field="answer"))


def test_turn_order():
    u, a, s = ({"role": r, "content": "x"} for r in ("user", "assistant", "system"))
    assert turn_order_problem([s, u, a, u, a]) is None
    assert turn_order_problem([a, u]) is not None
    assert turn_order_problem([u, u, a]) is not None
    assert turn_order_problem([u, a, u]) is not None
    assert turn_order_problem([u, s, a]) is not None


def test_data_config_validation_names_the_key():
    with pytest.raises(ConfigError, match="data.too_long"):
        DataConfig(too_long="chop")
    with pytest.raises(ConfigError, match="data.eval_fraction"):
        DataConfig(eval_fraction=1.5)


# --- reading -------------------------------------------------------------------------------------------------


def _read(path):
    """Every record the input at `path` holds, read as the stage reads it: (good records, what reading counted)."""
    loaded = sources.Loaded()
    inp, _ = sources.open_input(str(path))
    return list(sources.records(inp, loaded)), loaded


def test_jsonl_bad_lines_are_located(tmp_path):
    p = tmp_path / "d.jsonl"
    good = json.dumps({"prompt": "a", "completion": "b"})
    p.write_bytes(
        b"\n".join([good.encode(), b"{not json", good.encode(), b"", b'{"prompt": "\xff\xfe"}', b"[1, 2]"])
    )
    records, loaded = _read(p)
    assert [r.line for r in records] == [1, 3]
    assert [(b.line, b.reason) for b in loaded.first_bad] == [
        (2, "malformed_json"),
        (5, "invalid_utf8"),
        (6, "not_an_object"),
    ]
    assert loaded.num_input == 5


def test_json_csv_parquet_and_empty(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.json").write_text(
        '[\n  {"prompt": "a", "completion": "b"},\n  {"prompt": "c",\n "completion": "d"}\n]\n'
    )
    (tmp_path / "b.csv").write_text('prompt,completion\n"multi\nline",x\ny,z\n')
    pq.write_table(pa.table({"prompt": ["p"], "completion": ["q"]}), tmp_path / "c.parquet")
    (tmp_path / "d.jsonl").write_text("")
    records, loaded = _read(tmp_path)
    lines = {(r.source.rsplit("/", 1)[-1], r.line) for r in records}
    assert lines == {("a.json", 2), ("a.json", 3), ("b.csv", 2), ("b.csv", 4), ("c.parquet", 1)}
    assert loaded.empty_files == [str(tmp_path / "d.jsonl")]


def test_json_malformed_reports_line(tmp_path):
    p = tmp_path / "a.json"
    p.write_text('[\n {"prompt": "a", "completion": "b"},\n {"prompt": oops}\n]')
    records, loaded = _read(p)
    assert loaded.first_bad[0].line == 3 and loaded.first_bad[0].reason == "malformed_json"
    assert [r.line for r in records] == [2]  # the item before it is read


# --- cleaning ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,tag",
    [
        ("write to jane.doe+x@example.co.uk today", "EMAIL"),
        ("call +1 415 555 0100 now", "PHONE"),
        ("call (415) 555-0100", "PHONE"),
        ("server at 192.168.10.254 is down", "IP"),
        ("v6 fe80:0:0:0:202:b3ff:fe1e:8329 ok", "IP"),
        ("card 4111 1111 1111 1111 exp", "CARD"),
        ("card 4111-1111-1111-1111", "CARD"),
        ("key sk-abcdefghijklmnopqrstuvwx1234 leaked", "API_KEY"),
        ("aws AKIAIOSFODNN7EXAMPLE key", "API_KEY"),
        ("token ghp_aBcDeFgHiJkLmNoPqRsTuVwXyZ0123456789 here", "API_KEY"),
    ],
)
def test_pii_scrubbed_to_placeholders(text, tag):
    counts: Counter = Counter()
    out = clean.scrub_pii(text, counts)
    assert f"<{tag}>" in out and counts[tag] == 1, out


@pytest.mark.parametrize(
    "text",
    [
        "What is 776 plus one? 777",
        "Is the number 19262 odd or even?",
        "from 1999-2005",
        "on 2024-01-15",
        "version 1.2.3",
        "pi is 3.14159",
        "1234567890123",
        "total 4111 1111 1111 1112",
    ],
)
def test_pii_leaves_ordinary_numbers(text):
    counts: Counter = Counter()
    assert clean.scrub_pii(text, counts) == text and not counts


def test_exact_key_normalizes_text():
    a = [{"role": "user", "content": "Hello   World"}, {"role": "assistant", "content": "ＯＫ"}]
    b = [{"role": "user", "content": "hello world "}, {"role": "assistant", "content": "ok"}]
    assert clean.conversation_key(a) == clean.conversation_key(b)


def test_near_duplicates_found_and_distinct_kept():
    rng = random.Random(0)
    words = [f"w{i}" for i in range(500)]
    base = [" ".join(rng.choices(words, k=80)) for _ in range(30)]
    near = [b.replace(b.split()[10], "changed", 1) for b in base[:10]]
    keys = base + near
    dup = clean.near_duplicates(clean.Signatures.of(clean.signatures(keys), 0.8)).tolist()
    assert dup[:30] == [False] * 30
    assert sum(dup[30:]) >= 9


# --- packing and statistics ----------------------------------------------------------------------------------


def test_bfd_respects_capacity_and_places_everything():
    rng = random.Random(1)
    lengths = [min(512, int(rng.lognormvariate(4, 1)) + 1) for _ in range(3000)]
    bins = pack.best_fit_decreasing(lengths, 512)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 512 for b in bins)
    assert pack.efficiency(lengths, bins, 512) > 0.98
    ordered = pack.order_bins(bins, lengths, seed=0)
    assert max(lengths) in [lengths[i] for i in ordered[0]]


def test_bfd_best_fit_choice():
    # 6 and 4 fill one bin, 5+5 another: best fit finds the 2-bin answer
    assert sorted(map(sorted, pack.best_fit_decreasing([6, 5, 5, 4], 10))) == [[0, 3], [1, 2]]
    with pytest.raises(ValueError):
        pack.best_fit_decreasing([11], 10)


def test_position_ids_restart():
    assert pack.position_ids([3, 2]) == [0, 1, 2, 0, 1]


def test_percentiles():
    s = stats.summary(list(range(1, 101)))
    assert (s["min"], s["p50"], s["p95"], s["p99"], s["max"], s["total"]) == (1, 50, 95, 99, 100, 5050)
    assert stats.summary([])["count"] == 0
