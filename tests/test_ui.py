"""mode=ui without a browser: the plan page shows the command line's plan.json for every recipe, a bad input is
one message, the runs pages read run directories and refuse paths outside the runs folder, the server serves
loopback names only.

    python -m pytest -n 0 tests/test_ui.py
"""

from __future__ import annotations

import html
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from html.parser import HTMLParser
from typing import Any
from urllib.parse import urlencode

import pytest
from helpers import HOSTILE, REPO, command_line_plan, fake_run_dir

from finetune.core.composition import compose, recipe_names
from finetune.core.config import UiConfig
from finetune.core.errors import ConfigError
from finetune.ui import server
from finetune.ui.calculator import PlanForm
from finetune.ui.pages import TERMS

# ---------------------------------------------------------------- reading a page back


class Element:
    def __init__(self, tag: str, attrs: dict[str, str], parent: Element | None) -> None:
        self.tag, self.attrs, self.parent, self.parts = tag, attrs, parent, []

    @property
    def text(self) -> str:
        return "".join(self.parts).strip()

    def within(self, other: Element) -> bool:
        node = self.parent
        while node is not None and node is not other:
            node = node.parent
        return node is other


class Page(HTMLParser):
    """Every element of a page with its attributes, its parent and its text (descendants' included)."""

    VOID = {"meta", "link", "input", "br", "img", "hr"}

    def __init__(self, source: str) -> None:
        super().__init__()
        self.open: list[Element] = []
        self.elements: list[Element] = []
        self.feed(source)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, Any]]) -> None:
        element = Element(tag, {k: v or "" for k, v in attrs}, self.open[-1] if self.open else None)
        self.elements.append(element)
        if tag not in self.VOID:
            self.open.append(element)

    def handle_endtag(self, tag: str) -> None:
        while self.open and self.open.pop().tag != tag:
            pass

    def handle_data(self, data: str) -> None:
        for element in self.open:
            element.parts.append(data)

    def all(self, tag: str = "", within: Element | None = None, **attrs: str) -> list[Element]:
        return [
            e
            for e in self.elements
            if (not tag or e.tag == tag)
            and (within is None or e.within(within))
            and all(e.attrs.get(k.replace("_", "-")) == v for k, v in attrs.items())
        ]

    def one(self, tag: str = "", within: Element | None = None, **attrs: str) -> Element:
        found = self.all(tag, within, **attrs)
        assert len(found) == 1, (tag, attrs, len(found))
        return found[0]

    def cells(self, row: Element) -> list[str]:
        return [e.text for e in self.all("td", within=row)]


def number(text: str) -> float:
    return float(text.replace(",", ""))


def assert_shows(source: str, payload: dict) -> None:
    """The plan page shows plan.json's verdict, memory terms, strategy, reasons and alternatives."""
    page = Page(source)
    assert page.one(id="verdict").attrs["data-fits"] == str(payload["fits"]).lower()
    assert page.one(id="hardware").text == payload["hardware"]["name"]
    assert number(page.one(id="total").text) == payload["gpu_memory_gb"]["total"]
    assert number(page.one(id="usable").text) == payload["usable_gpu_memory_gb"]
    assert int(page.one(id="seq-len").text) == payload["seq_len"]
    assert int(number(page.one(id="trainable").text)) == payload["params"]["trainable"]
    terms = page.one(id="terms")
    held = {  # the encoder's term is shown where the model has one
        k: v
        for k, v in payload["gpu_memory_gb"].items()
        if k != "total" and not (k == "vision_activations" and v == 0)
    }  # companions' terms too
    assert {t for t, _ in TERMS if t != "vision_activations"} <= set(held)
    for term, value in held.items():
        shown = page.cells(page.one("tr", within=terms, data_term=term))[-1]
        assert number(shown) == value, term
    strategy = page.one(id="strategy")
    for key, value in payload["strategy"].items():
        assert page.cells(page.one("tr", within=strategy, data_key=key)) == [key, str(value)]
    assert [e.text for e in page.all("li", within=page.one(id="reasons"))] == payload["reasons"]
    shown = [page.cells(row)[:3] for row in page.all("tr", within=page.one(id="alternatives"))[1:]]
    assert [[hw, fits, number(gb)] for hw, fits, gb in shown] == [
        [a["hardware"], "yes" if a["fits"] else "no", a["total_gb"]] for a in payload["alternatives"]
    ]


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> server.App:
    return server.App(UiConfig(port=0, runs_dir=str(tmp_path_factory.mktemp("runs"))))


# ---------------------------------------------------------------- the plan page


@pytest.mark.parametrize("recipe", recipe_names())
def test_every_recipe_page_shows_the_command_lines_plan(app, tmp_path, recipe):
    """For each recipe, the page and its plan.json download are `python -m finetune +recipe=R mode=plan`'s plan."""
    expected = command_line_plan(tmp_path, f"+recipe={recipe}")
    status, source = app.plan(f"recipe={recipe}")
    assert status == 200
    assert_shows(source, expected)
    status, body = app.plan_json(f"recipe={recipe}")
    assert status == 200 and json.loads(body) == expected
    command = Page(source).one(id="command").text
    assert command == f"python -m finetune +recipe={recipe} mode=plan plan.out=plan.json"


def test_every_setting_is_an_override_of_the_command_line(app, tmp_path):
    """Model, method, objective, seq_len, micro-batch, hardware and run length reach the plan as the command
    line's overrides; each priced alternative's run cost is the same job planned there."""
    query = {
        "recipe": "llama8b_lora",
        "model": "qwen3_8b",
        "method": "qlora",
        "objective": "dpo",
        "seq_len": "2048",
        "micro_batch": "2",
        "hardware": "auto",
        "dataset_tokens": "50000000",
    }
    overrides = PlanForm(**query).overrides()
    assert overrides == [
        "+recipe=llama8b_lora",
        "model=qwen3_8b",
        "method=qlora",
        "objective=dpo",
        "hardware=auto",
        "train.seq_len=2048",
        "train.micro_batch_size=2",
        "train.dataset_tokens=50000000",
    ]
    expected = command_line_plan(tmp_path, *overrides)
    status, source = app.plan(urlencode(query))
    assert status == 200
    assert_shows(source, expected)
    assert expected["strategy"]["micro_batch_size"] == 2 and expected["seq_len"] == 2048
    page = Page(source)
    assert (
        page.one(id="command").text
        == "python -m finetune " + " ".join(overrides) + " mode=plan plan.out=plan.json"
    )
    # the chosen profile's run cost is plan.json's; another priced one's is that profile's own plan
    chosen = expected["hardware"]["name"]
    row = page.cells(page.one("tr", data_hardware=chosen))
    assert row[-1] == f"{expected['estimate']['usd']:,.2f}"
    other = next(
        a["hardware"] for a in expected["alternatives"] if a["usd_per_month"] and a["hardware"] != chosen
    )
    there = command_line_plan(tmp_path / "there", *overrides[:-4], f"hardware={other}", *overrides[-3:])
    row = page.cells(page.one("tr", data_hardware=other))
    assert row[-1] == f"{there['estimate']['usd']:,.2f}"
    assert number(row[-3]) == pytest.approx(there["hardware"]["usd_per_month"] / 730, abs=0.005)


def test_a_hub_id_is_the_command_lines_model():
    form = PlanForm(recipe="llama8b_lora", hub_id="Qwen/Qwen2.5-0.5B", method="lora")
    assert form.overrides() == ["+recipe=llama8b_lora", "model=Qwen/Qwen2.5-0.5B", "method=lora"]
    assert form.query() == "recipe=llama8b_lora&hub_id=Qwen%2FQwen2.5-0.5B&method=lora"


SMALL_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
}


def test_a_pasted_config_is_planned_as_the_command_line_plans_its_file(app, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(SMALL_LLAMA))
    expected = command_line_plan(tmp_path, f"model.config_path={path}", "hardware=l4")
    query = urlencode({"model": "config.json", "config": json.dumps(SMALL_LLAMA), "hardware": "l4"})
    status, source = app.plan(query)
    assert status == 200
    assert_shows(source, expected)
    assert Page(source).one(id="command").text == (
        "python -m finetune model.config_path=config.json hardware=l4 mode=plan plan.out=plan.json"
    )


BAD_INPUTS = {
    "malformed config.json": (
        {"model": "config.json", "config": '{"model_type": "llama",}'},
        "config.json: not valid JSON (Expecting property name enclosed in double quotes at line 1, column 24)",
    ),
    "config with its own code": (
        {"model": "config.json", "config": json.dumps({**SMALL_LLAMA, "auto_map": {"AutoConfig": "x.Y"}})},
        "config.json: its auto_map names the model's own Python code",
    ),
    "architecture transformers lacks": (
        {"model": "config.json", "config": json.dumps({**SMALL_LLAMA, "model_type": "acme_lm"})},
        "model.config_path=config.json: transformers cannot read it",
    ),
    "seq_len 0": ({"recipe": "llama8b_lora", "seq_len": "0"}, "train.seq_len=0 must be > 0"),
    "seq_len not a number": ({"seq_len": "4k"}, "seq_len='4k': write a whole number (train.seq_len)"),
    "an override smuggled in": (
        {"seq_len": "1 hardware=h100"},
        "seq_len='1 hardware=h100': write a whole number",
    ),
    "a path for a hub id": ({"hub_id": "../../etc/x"}, "hub_id='../../etc/x': write a hub id as ORG/NAME"),
    "a hub id and a preset": (
        {"hub_id": "Qwen/Qwen2.5-0.5B", "model": "qwen3_8b"},
        "hub_id='Qwen/Qwen2.5-0.5B' and model='qwen3_8b': choose one of them",
    ),
    "unknown method": ({"method": "dora"}, "method='dora' is not one of full, lora, qlora"),
    "this machine's hardware": ({"hardware": "local"}, "hardware='local' is not one of"),
    "a recipe with more": ({"recipe": "tiny mode=train"}, "recipe='tiny mode=train' is not one of"),
}


@pytest.mark.parametrize("query,message", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_input_is_one_message(app, query, message):
    status, source = app.plan(urlencode(query))
    assert status == 400
    page = Page(source)
    errors = page.all(role="alert")
    assert len(errors) == 1 and errors[0].text.startswith(message), errors[0].text
    assert "\n" not in errors[0].text and "Traceback" not in source and "/tmp" not in errors[0].text
    assert not page.all(id="verdict")
    status, body = app.plan_json(urlencode(query))
    assert status == 400 and json.loads(body) == {"error": errors[0].text}


def test_user_text_is_escaped(app):
    """A model named by its pasted config, and a choice the page does not know, show as text."""
    named = {**SMALL_LLAMA, "_name_or_path": HOSTILE}
    status, source = app.plan(
        urlencode({"model": "config.json", "config": json.dumps(named), "hardware": "l4"})
    )
    assert status == 200
    assert HOSTILE not in source and html.escape(HOSTILE) in source
    status, source = app.plan(urlencode({"method": HOSTILE}))
    assert status == 400 and HOSTILE not in source and html.escape(HOSTILE[:60]) in source


def test_the_memory_bar_stacks_the_teacher_on_the_policy_s_terms(app, tmp_path):
    """A distillation plan's teacher (`companion:teacher`: its weights and forward, 70B sharded for the 8B student)
    is a segment of the bar and a row of the table, as plan.json holds it; the bar's segments add up to the
    total."""
    expected = command_line_plan(tmp_path, "+recipe=llama8b_distill")
    teacher = expected["gpu_memory_gb"]["companion:teacher"]
    assert teacher > 1.0
    status, source = app.plan("recipe=llama8b_distill")
    assert status == 200
    page = Page(source)
    assert number(
        page.cells(page.one("tr", within=page.one(id="terms"), data_term="companion:teacher"))[-1]
    ) == (teacher)
    bars = page.one(id="bars")
    segments = [e for e in page.all("rect", within=bars) if "term" in e.attrs.get("class", "")]
    assert [e.attrs["data-term"] for e in segments][-1] == "companion:teacher"
    assert segments[-1].text == f"companion:teacher: {teacher:,.3f} GB"
    width = {e.attrs["data-term"]: float(e.attrs["width"]) for e in segments}
    scale = width["companion:teacher"] / teacher  # SVG units a GB, the same for every segment
    assert sum(width.values()) / scale == pytest.approx(expected["gpu_memory_gb"]["total"], abs=0.01)
    assert float(segments[-1].attrs["x"]) == pytest.approx(sum(list(width.values())[:-1]), abs=0.05)


# ---------------------------------------------------------------- the runs pages


@pytest.fixture(scope="module")
def tiny_plan(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return command_line_plan(tmp_path_factory.mktemp("tiny-plan"), "+recipe=tiny")


def test_a_run_page_shows_its_plan_peak_loss_evaluation_and_samples(app, tiny_plan):
    fake_run_dir(app.runs_root, "tiny-run", tiny_plan, steps=6)
    (app.runs_root / "not-a-run").mkdir()
    listing = Page(app.runs())
    assert [e.attrs["data-run"] for e in listing.all("tr") if "data-run" in e.attrs] == ["tiny-run"]
    cells = listing.cells(listing.one("tr", data_run="tiny-run"))
    assert cells[:4] == ["tiny-run", "tiny", "lora", tiny_plan["hardware"]["name"]]
    assert number(cells[4]) == tiny_plan["gpu_memory_gb"]["total"] and cells[5:] == ["0.432", "1.2500"]

    status, source = app.run("tiny-run")
    assert status == 200
    page = Page(source)
    table = page.one(id="plan-vs-peak")
    rows = {
        e.attrs["data-term"]: page.cells(e) for e in page.all("tr", within=table) if "data-term" in e.attrs
    }
    assert number(rows["total"][1]) == tiny_plan["gpu_memory_gb"]["total"]
    assert rows["peak"] == ["measured peak (process_peak_rss)", "0.432"]
    assert number(rows["compared"][1]) == 0.211
    assert page.one("rect", data_term="peak").text == "measured peak: 0.432 GB"
    train = page.one(data_series="train").attrs["points"].split()
    assert len(train) == 6 and len(page.one(data_series="eval").attrs["points"].split()) == 1
    # the loss falls: the polyline climbs down the SVG's y axis (y grows downwards)
    ys = [float(p.split(",")[1]) for p in train]
    assert ys == sorted(ys) and ys[0] < ys[-1]
    cells = {
        (e.attrs["data-variant"], row.attrs["data-metric"]): e.text
        for row in page.all("tr", within=page.one(id="evaluation"))
        if "data-metric" in row.attrs
        for e in page.all("td", within=row)
        if "data-variant" in e.attrs
    }
    assert cells[("base", "loss")] == "3.5000" and cells[("trained", "exact_match")] == "0.7500"
    assert cells[("merged", "loss")] == "1.5000"
    assert HOSTILE not in source and html.escape(HOSTILE) in source
    assert "user: 2+2?" in page.one(id="samples").text


@pytest.mark.parametrize(
    "name", ["..", "../tiny-run", "/etc", "tiny-run/../..", "outside-link", "no-files", ""]
)
def test_paths_outside_the_runs_folder_are_refused(app, tiny_plan, tmp_path, name):
    outside = fake_run_dir(tmp_path, "elsewhere", tiny_plan)
    link = app.runs_root / "outside-link"
    if not link.is_symlink():
        link.symlink_to(outside, target_is_directory=True)
    (app.runs_root / "no-files").mkdir(exist_ok=True)
    status, source = app.run(name)
    assert status == 404
    assert Page(source).one(role="alert").text.endswith(f"is not a run directory under {app.runs_root}")
    assert "elsewhere" not in app.runs()


# ---------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    httpd = server.make_server(UiConfig(port=0, runs_dir=str(tmp_path_factory.mktemp("served-runs"))))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd.server_address[0], httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()


def request(address: tuple[str, int], method: str, path: str, host: str = "") -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection(*address, timeout=120)
    conn.request(method, path, headers={"Host": host or f"127.0.0.1:{address[1]}"})
    response = conn.getresponse()
    response.read()
    conn.close()
    return response


def test_the_server_answers_loopback_names_only_and_serves_nothing_else(served):
    first = request(served, "GET", "/")
    assert first.status == 303 and first.getheader("Location") == "/?recipe=llama8b_lora"
    assert "script-src 'self'" in first.getheader("Content-Security-Policy", "")
    assert request(served, "GET", "/runs", host=f"localhost:{served[1]}").status == 200
    # a page elsewhere reaching this port through a name of its own (DNS rebinding) is refused
    assert request(served, "GET", "/runs", host="attacker.example").status == 421
    assert request(served, "POST", "/runs").status == 501
    assert request(served, "GET", "/static/../server.py").status == 404
    assert request(served, "GET", "/runs/..%2F..%2Fetc").status == 404
    static = request(served, "GET", "/static/ui.js")
    assert static.status == 200 and static.getheader("Content-Type").startswith("text/javascript")


def test_ui_settings_are_checked():
    assert compose(["mode=ui"]).ui == UiConfig()
    with pytest.raises(ConfigError, match=r"ui.port=70000 must be in \[0, 65535\]"):
        compose(["mode=ui", "ui.port=70000"])
    assert server.address_warning(UiConfig()) is None
    said = server.address_warning(UiConfig(host="0.0.0.0"))
    assert said is not None and "every machine that can reach this one" in said


def test_a_port_in_use_is_one_line(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        with pytest.raises(
            ConfigError,
            match=rf"^ui.host=127.0.0.1 ui.port={port}: cannot listen \(Address already in use\)$",
        ):
            server.serve(UiConfig(port=port, runs_dir=str(tmp_path)))
    finally:
        taken.close()


def test_mode_ui_serves_until_interrupted(tmp_path):
    """`python -m finetune mode=ui ui.port=0`: prints its address, serves the runs page, exits 0 on Ctrl-C."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "finetune", "mode=ui", "ui.port=0", f"ui.runs_dir={tmp_path}"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        m = re.match(r"finetune ui: http://127\.0\.0\.1:(\d+)/ ", line)
        assert m, line + (proc.stderr.read() if proc.poll() is not None and proc.stderr else "")
        response = request(("127.0.0.1", int(m.group(1))), "GET", "/runs")
        assert response.status == 200
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert out.strip().endswith("finetune ui: stopped") and "Traceback" not in err
