"""mode=ui in a real browser: headless Chromium (Debian's `chromium`) driven by Playwright.

    apt-get install -y chromium && pip install -e ".[ui-test]"
    python -m pytest -n 0 tests/test_ui_browser.py

A changed form plans again; the page's numbers are plan.json as the command the page shows writes it; the
page's address reproduces the plan and its download is that plan.json; a bad input shows one message; a run
page shows its metrics and its samples as text. One browser for the module; the server runs in this process
on a free loopback port. Without Chromium or Playwright the module is skipped, except in CI (CI=true), where
.ci/run installs both and their absence fails.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import HOSTILE, REPO, command_line_plan, fake_run_dir

from finetune.core.config import UiConfig
from finetune.ui import server

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]

if not CHROMIUM.is_file() or importlib.util.find_spec("playwright") is None:
    why = "needs Debian's chromium (apt-get install -y chromium) and playwright (pip install -e '.[ui-test]')"
    if os.environ.get("CI"):
        pytest.fail(f"the browser tests {why}; .ci/run installs both", pytrace=False)
    pytest.skip(why, allow_module_level=True)

from playwright.sync_api import Browser, Page, sync_playwright  # noqa: E402 (after the skip above)

# What the page shows, read from the DOM: the same facts tests/test_ui.py reads from the HTML.
SHOWN = """() => {
  const text = (id) => document.getElementById(id).textContent.trim();
  const cells = (tr) => [...tr.querySelectorAll("td")].map((td) => td.textContent.trim());
  const rows = (css, key) => Object.fromEntries([...document.querySelectorAll(css)].map((tr) => [tr.dataset[key], cells(tr)[1]]));
  return {
    fits: document.getElementById("verdict").dataset.fits,
    hardware: text("hardware"), total: text("total"), usable: text("usable"), seq_len: text("seq-len"),
    terms: rows("#terms tr[data-term]", "term"),
    strategy: rows("#strategy tr[data-key]", "key"),
    reasons: [...document.querySelectorAll("#reasons li")].map((li) => li.textContent),
    alternatives: [...document.querySelectorAll("#alternatives tbody tr")].map((tr) => cells(tr).slice(0, 3)),
    command: text("command"),
    alerts: document.querySelectorAll("[role=alert]").length,
  };
}"""


def number(text: str) -> float:
    return float(text.replace(",", ""))


def assert_shows(shown: dict[str, Any], payload: dict[str, Any]) -> None:
    assert shown["alerts"] == 0
    assert shown["fits"] == str(payload["fits"]).lower() and shown["hardware"] == payload["hardware"]["name"]
    memory = payload["gpu_memory_gb"]
    assert (
        number(shown["total"]) == memory["total"]
        and number(shown["usable"]) == payload["usable_gpu_memory_gb"]
    )
    assert int(shown["seq_len"]) == payload["seq_len"]
    assert {k: number(v) for k, v in shown["terms"].items()} == {
        # the six terms, the encoder's where the model has one, the companions' (companion:ROLE), the total
        **{k: v for k, v in memory.items() if not (k == "vision_activations" and v == 0)},
        "usable": payload["usable_gpu_memory_gb"],
    }
    assert {k: v for k, v in shown["strategy"].items() if k != "layout"} == {
        k: str(v) for k, v in payload["strategy"].items()
    }
    assert shown["reasons"] == payload["reasons"]
    assert [[hw, fits, number(gb)] for hw, fits, gb in shown["alternatives"]] == [
        [a["hardware"], "yes" if a["fits"] else "no", a["total_gb"]] for a in payload["alternatives"]
    ]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """The server on a free loopback port: (its address, its runs folder)."""
    runs = tmp_path_factory.mktemp("runs")
    httpd = server.make_server(UiConfig(port=0, runs_dir=str(runs)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield server.url(httpd).rstrip("/"), runs
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    """A fresh tab that fails the test on a script error."""
    context = browser.new_context(accept_downloads=True, viewport={"width": 1280, "height": 900})
    tab = context.new_page()
    tab.set_default_timeout(120_000)
    errors: list[str] = []
    tab.on("pageerror", lambda exc: errors.append(str(exc)))
    yield tab
    context.close()
    assert not errors, errors


def test_the_form_plans_what_the_shown_command_plans(site, page, tmp_path):
    base, _ = site
    page.goto(base + "/")
    assert page.url == base + "/?recipe=llama8b_lora"
    with page.expect_navigation():
        page.select_option("#f-hardware", "h200")
    with page.expect_navigation():
        page.select_option("#f-method", "qlora")
    page.fill("#f-seq_len", "8192")
    with page.expect_navigation():
        page.press("#f-seq_len", "Enter")
    assert page.url == base + "/?recipe=llama8b_lora&method=qlora&seq_len=8192&hardware=h200"
    shown = page.evaluate(SHOWN)
    assert shown["command"] == (
        "python -m finetune +recipe=llama8b_lora method=qlora hardware=h200 train.seq_len=8192 mode=plan "
        "plan.out=plan.json"
    )
    # the command as shown, run for real in a fresh folder
    words = shlex.split(shown["command"])
    proc = subprocess.run(
        [sys.executable, *words[1:]],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        },
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    expected = json.loads((tmp_path / "plan.json").read_text())
    assert_shows(shown, expected)
    with page.expect_download() as download:
        page.click("#download")
    assert download.value.suggested_filename == "plan.json"
    assert json.loads(Path(download.value.path()).read_text()) == expected
    # the address alone, in another tab, shows the same plan
    shared = page.context.new_page()
    shared.goto(page.url)
    assert shared.evaluate(SHOWN) == shown


def test_the_teacher_is_a_segment_of_the_bar_and_a_row_of_the_terms(site, page, tmp_path):
    """A distillation plan's teacher (`companion:teacher`) as the browser draws it: its row holds plan.json's figure,
    its bar segment is drawn last, as wide for its GB as the other segments are for theirs."""
    base, _ = site
    page.goto(base + "/?recipe=llama8b_distill")
    expected = command_line_plan(tmp_path, "+recipe=llama8b_distill")
    shown = page.evaluate(SHOWN)
    assert_shows(shown, expected)
    teacher = expected["gpu_memory_gb"]["companion:teacher"]
    assert number(shown["terms"]["companion:teacher"]) == teacher > 1.0
    segments = page.evaluate(
        """() => [...document.querySelectorAll("#bars rect.term")].map((r) => [r.dataset.term, r.getBBox().width])"""
    )
    assert segments[-1][0] == "companion:teacher" and segments[-1][1] > 0
    per_gb = segments[-1][1] / teacher
    total = sum(width for _, width in segments) / per_gb
    assert total == pytest.approx(expected["gpu_memory_gb"]["total"], abs=0.01)


def test_auto_hardware_picks_what_the_command_line_picks(site, page, tmp_path):
    base, _ = site
    page.goto(base + "/?recipe=llama70b_qlora&dataset_tokens=100000000")
    with page.expect_navigation():
        page.select_option("#f-hardware", "auto")
    assert_shows(
        page.evaluate(SHOWN),
        command_line_plan(
            tmp_path / "auto", "+recipe=llama70b_qlora", "hardware=auto", "train.dataset_tokens=100000000"
        ),
    )


def test_a_pasted_config_plans_like_its_file(site, page, tmp_path):
    base, _ = site
    config = {
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
    }
    page.goto(base + "/?hardware=l4")
    assert page.is_hidden("#f-config")
    with page.expect_navigation():
        page.select_option("#f-model", "config.json")
    page.fill("#f-config", json.dumps(config, indent=1))
    with page.expect_navigation():
        page.click("#submit")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert_shows(
        page.evaluate(SHOWN), command_line_plan(tmp_path, f"model.config_path={path}", "hardware=l4")
    )


def test_bad_input_shows_one_message(site, page):
    base, _ = site
    page.goto(base + "/?recipe=llama8b_lora")
    page.fill("#f-seq_len", "0")
    with page.expect_navigation():
        page.click("#submit")
    assert page.locator("[role=alert]").all_inner_texts() == ["train.seq_len=0 must be > 0"]
    assert page.locator("#verdict").count() == 0
    page.fill("#f-seq_len", "")
    with page.expect_navigation():
        page.select_option("#f-model", "config.json")
    page.fill("#f-config", '{"model_type": "llama", "hidden_size": 4096,,}')
    with page.expect_navigation():
        page.click("#submit")
    assert page.locator("[role=alert]").all_inner_texts() == [
        "config.json: not valid JSON (Expecting property name enclosed in double quotes at line 1, column 45)"
    ]
    assert "Traceback" not in page.content()


def test_a_run_page_shows_its_metrics(site, page, tmp_path):
    base, runs = site
    plan = command_line_plan(tmp_path, "+recipe=tiny")
    fake_run_dir(runs, "tiny-run", plan, steps=5)
    page.goto(base + "/runs")
    page.click("text=tiny-run")
    assert page.url == base + "/runs/tiny-run"
    peak = page.locator("#plan-vs-peak tr[data-term=peak] td").all_inner_texts()
    assert peak == ["measured peak (process_peak_rss)", "0.432"]
    planned = page.locator("#plan-vs-peak tr[data-term=total] td").all_inner_texts()
    assert number(planned[1]) == plan["gpu_memory_gb"]["total"]
    assert len(page.get_attribute("polyline[data-series=train]", "points").split()) == 5
    table = page.locator("#evaluation tr[data-metric=exact_match] td").all_inner_texts()
    assert table == ["exact_match", "0.1000", "0.7500", "0.7500"]
    answer = page.locator("#samples td[data-variant=trained]").first
    assert answer.inner_text() == HOSTILE
    assert page.evaluate("window.__injected") is None
    assert "&lt;script&gt;window.__injected = 1&lt;/script&gt;" in page.content()
