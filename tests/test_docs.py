"""The documents tell the truth: every command the README shows (and the docs pages' blocks marked
`<!-- test: commands -->`) composes, plans or runs as written; the output a block quotes is what the
command prints; the example data lines are the formats they claim; links resolve; the configuration
reference is what the schemas say.

Cheap for CI: `python -m finetune` commands run in this process in `mode=plan` (a command that would
train is planned instead; a `launch.dry_run=true` one writes its launch.sh), so nothing trains or
downloads. The demo's training itself is covered by tests/test_train.py's slow test.
"""

from __future__ import annotations

import csv
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = REPO / "docs"
MARKER = "<!-- test: commands -->"
# Pages the index links to that are not written yet: remove each name as its page lands.
PAGES_TO_COME: set[str] = set()


# ---------------------------------------------------------------- reading the documents


def fenced_blocks(text: str, language: str) -> list[tuple[str, str]]:
    """(the line before the fence, the block's text) of each ```LANGUAGE block."""
    blocks = []
    for m in re.finditer(rf"(?ms)^([^\n]*)\n```{language}\n(.*?)^```", text):
        blocks.append((m.group(1), m.group(2)))
    return blocks


def commands(block: str) -> list[tuple[str, list[str]]]:
    """Each command of a bash block (continuation lines joined, its trailing comment cut), with the comment
    lines right under it that quote its output (`# text`)."""
    out: list[tuple[str, list[str]]] = []
    pending = ""
    for raw in block.splitlines():
        line = raw.rstrip()
        if not line.strip():
            continue
        if line.lstrip().startswith("#"):
            if out and not pending:
                out[-1][1].append(line.lstrip()[1:].strip())
            continue
        code = _without_comment(line)
        if code.endswith("\\"):
            pending += code[:-1] + " "
            continue
        out.append(((pending + code).strip(), []))
        pending = ""
    return out


def _without_comment(line: str) -> str:
    """The line up to a `#` that starts a comment (outside quotes)."""
    quote = None
    for i, ch in enumerate(line):
        if quote is None and ch in "'\"":
            quote = ch
        elif quote == ch:
            quote = None
        elif quote is None and ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def pages_with_commands() -> list[Path]:
    return [README] + sorted(p for p in DOCS.rglob("*.md") if MARKER in p.read_text())


def shown_commands() -> list[tuple[str, str, list[str]]]:
    """(page, command, quoted output) for the README's bash blocks and the marked blocks of docs pages."""
    found = []
    for page in pages_with_commands():
        for before, block in fenced_blocks(page.read_text(), "bash"):
            if page != README and before.strip() != MARKER:
                continue
            for command, quoted in commands(block):
                found.append((str(page.relative_to(REPO)), command, quoted))
    return found


SHOWN = shown_commands()


# ---------------------------------------------------------------- what a command needs to exist


TINY_CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 172,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
}


def example_lines() -> list[dict]:
    """The README's example data lines (its ```json block)."""
    (block,) = [b for _, b in fenced_blocks(README.read_text(), "json")]
    return [json.loads(line) for line in block.splitlines() if line.strip()]


def example_records(argv: list[str]) -> list[dict]:
    """The README's example lines a command reads: the preference pair for DPO, the text line under
    `data.format=text`, else the SFT lines; a CSV file holds the conversations as the columns it names."""
    lines = example_lines()
    if "objective=dpo" in argv:
        return [r for r in lines if "chosen" in r]
    if "data.format=text" in argv:
        return [r for r in lines if "text" in r]
    records = [r for r in lines if "chosen" not in r]
    if not any(a.startswith("data.path=") and a.endswith(".csv") for a in argv):
        return records
    from finetune.core.config import DataConfig
    from finetune.data.formats import to_messages

    fields = dict(
        a.split("=", 1) for a in argv if a.startswith(("data.prompt_field=", "data.completion_field="))
    )
    prompt, completion = (
        fields.get("data.prompt_field", "prompt"),
        fields.get("data.completion_field", "completion"),
    )
    turns = [to_messages(r, DataConfig()) for r in records if "text" not in r]
    return [{prompt: m[0]["content"], completion: m[-1]["content"]} for m in turns]


def duplicates_among(records: list[dict]) -> int:
    """How many of the records repeat an earlier one's conversation (the data stage keeps one)."""
    from finetune.core.config import DataConfig
    from finetune.data.formats import to_messages

    if any("chosen" in r for r in records):
        return 0
    fields = {k for r in records for k in r}
    cfg = DataConfig()
    if fields == {"question", "answer"}:
        cfg = DataConfig(prompt_field="question", completion_field="answer")
    seen = [json.dumps(to_messages(r, cfg)) for r in records]
    return len(seen) - len(set(seen))


def stage_inputs(cwd: Path, argv: list[str]) -> None:
    """The files and folders a shown command names, made in `cwd` as a user would have them: the data
    file from the README's example lines, a model folder's config.json, an earlier run's directory, a
    config file as `init` writes it."""
    if argv and argv[0].endswith((".yaml", ".yml")) and not (cwd / argv[0]).exists():
        from finetune.pipeline import starter

        assert starter.write([argv[0]]) == 0
    for arg in argv:
        key, _, value = arg.partition("=")
        if key == "data.path" and value.endswith(".csv") and not (cwd / value).exists():
            records = example_records(argv)
            with open(cwd / value, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=list(records[0]))
                writer.writeheader()
                writer.writerows(records)
        elif key == "data.path" and not (cwd / value).exists():
            (cwd / value).write_text("".join(json.dumps(r) + "\n" for r in example_records(argv)))
        elif key == "model.config_path" or (key == "model" and value.startswith(("./", "/", "../"))):
            config = cwd / value if key == "model.config_path" else cwd / value / "config.json"
            config.parent.mkdir(parents=True, exist_ok=True)
            config.write_text(json.dumps(TINY_CONFIG))
        elif key == "init_from":
            (cwd / value).mkdir(parents=True, exist_ok=True)


def as_planned(argv: list[str]) -> list[str]:
    """The command as this test runs it: plan-only and dry-run commands, and the data stage on the tiny
    model's tokenizer (built locally), and `init FILE`, run as they are; a command that would train, download or start
    ranks is planned instead (without `train.seq_len=auto`, which needs the data stage)."""
    if argv[:1] == ["init"]:
        return argv
    modes = [a.split("=", 1)[1] for a in argv if a.startswith("mode=")]
    local_data = modes == ["data"] and not any(a.startswith(("model=", "model.", "+recipe=")) for a in argv)
    if modes == ["plan"] or "launch.dry_run=true" in argv or local_data:
        return argv
    keep = [a for a in argv if not a.startswith("mode=") and a not in ("smoke=true", "train.seq_len=auto")]
    return keep + ["mode=plan"]


def _normalized(text: str) -> str:
    return " ".join(text.split())


# ---------------------------------------------------------------- the tests


def test_readme_is_short_and_its_first_screen_runs_your_own_model_on_your_own_data():
    lines = README.read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; reference material belongs in docs/"
    first_screen = "\n".join(lines[:30])
    assert "data.path=" in first_screen and ("model=" in first_screen or "model.config_path=" in first_screen)
    assert "pip install" in "\n".join(lines[:60])


def test_every_command_shown_is_one_this_test_knows():
    known = ("python -m finetune", "python -m pytest", "bash scripts/", "pip install", "python scripts/")
    unknown = [(page, c) for page, c, _ in SHOWN if not c.startswith(known)]
    assert not unknown, f"commands this test cannot check (add a rule for them): {unknown}"
    assert sum(c.startswith("python -m finetune") for _, c, _ in SHOWN) >= 10


@pytest.mark.parametrize(
    "page, command, quoted",
    [s for s in SHOWN if s[1].startswith("python -m finetune")],
    ids=[
        f"{s[0]}:{s[1][len('python -m finetune') :].strip() or 'default'}"
        for s in SHOWN
        if s[1].startswith("python -m finetune")
    ],
)
def test_finetune_command_composes_and_plans(
    page, command, quoted, tmp_path, monkeypatch, capsys, tiny_cache
):
    """Each `python -m finetune ...` the documents show: composed, validated and planned (or dry-run
    launched, or its data prepared) in a fresh folder, exit code 0; each output line quoted under it
    appears in what it prints."""
    from finetune.pipeline import cli

    argv = shlex.split(command)[3:]
    if argv[:1] == ["--help"]:
        assert cli.main(argv) == 0
        assert "recipes:" in capsys.readouterr().out
        return
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "200")
    stage_inputs(tmp_path, argv)
    run = as_planned(argv)
    code = cli.main(run)
    out, err = capsys.readouterr()
    assert code == 0, f"{page}: {shlex.join(['python -m finetune', *run])} exited {code}: {err[-2000:]}"
    printed = _normalized(out + err)
    for line in quoted:
        assert _normalized(line) in printed, f"{page}: {command!r} no longer prints {line!r}"
    if "mode=data" in run and any(a.startswith("data.path=") for a in run):
        # The README's example lines, all read; a repeated conversation is kept once.
        (stats,) = tmp_path.glob("runs/*/data_stats.json")
        counts = json.loads(stats.read_text())
        written = example_records(argv)
        records = len(written)
        duplicates = {"duplicate": n} if (n := duplicates_among(written)) else {}
        kept = records - sum(duplicates.values())
        assert (counts["num_input"], counts["dropped"], counts["num_train"] + counts["num_eval"]) == (
            records,
            duplicates,
            kept,
        )


def test_example_data_lines_are_the_formats_they_claim():
    from finetune.core.config import DataConfig
    from finetune.data.formats import detect_format, to_messages
    from finetune.data.pairs import to_pair

    cfg = DataConfig()
    rows = example_lines()
    assert [detect_format(r, cfg) for r in rows[:4]] == ["messages", "prompt_completion", "alpaca", "text"]
    for row in rows[:3]:
        msgs = to_messages(row, cfg)
        assert [m["role"] for m in msgs] == ["user", "assistant"] and msgs[-1]["content"] == "odd"
    assert detect_format(rows[3], DataConfig(format="text")) == "text"
    pair = to_pair(rows[4], cfg)
    assert [m["role"] for m in pair.prompt] == ["user"]
    assert (pair.chosen[-1]["content"], pair.rejected[-1]["content"]) == ("odd", "even")


def test_the_test_command_is_what_ci_runs():
    ci = (REPO / ".ci" / "run").read_text()
    shown = [c for _, c, _ in SHOWN if c.startswith("python -m pytest")]
    assert "python -m pytest -n 2" in shown and re.search(r"(?m)^python -m pytest -n 2$", ci)
    markers = (REPO / "pyproject.toml").read_text()
    for command in shown:
        words = shlex.split(command)[3:]
        expressions = [words[i + 1] for i, w in enumerate(words[:-1]) if w == "-m"]
        for marker in {m for e in expressions for m in re.findall(r"\w+", e)} - {"and", "or", "not"}:
            assert f'"{marker}:' in markers, f"{command}: no pytest marker {marker!r} in pyproject.toml"


def test_scripts_and_extras_shown_exist():
    pyproject = (REPO / "pyproject.toml").read_text()
    for page, command, _ in SHOWN:
        for path in re.findall(r"(?:bash|python) (scripts/\S+)", command):
            assert (REPO / path).is_file(), f"{page}: {command!r} names a missing {path}"
        for extra in re.findall(r"\.\[(\w+)\]", command):
            assert re.search(rf"(?m)^{extra} = \[", pyproject), (
                f"{page}: no extra [{extra}] in pyproject.toml"
            )


def test_the_recipe_table_lists_every_recipe():
    table = set(
        re.findall(r"(?m)^\| `(\w+)`", README.read_text().split("## Recipes", 1)[1].split("\n## ", 1)[0])
    )
    assert table == {p.stem for p in (REPO / "recipes").glob("*.yaml")}


def _links(page: Path) -> list[str]:
    text = re.sub(r"(?s)```.*?```", "", page.read_text())
    return [m for m in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:", m)]


def test_links_between_documents_resolve():
    pages = [README, REPO / "BENCHMARKS.md", REPO / "ARCHITECTURE.md", *sorted(DOCS.rglob("*.md"))]
    broken = []
    for page in pages:
        for link in _links(page):
            target, _, anchor = link.partition("#")
            path = (page.parent / target).resolve() if target else page
            relative = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)
            if not path.exists():
                if relative not in PAGES_TO_COME:
                    broken.append(f"{page.relative_to(REPO)}: {link}")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                broken.append(f"{page.relative_to(REPO)}: {link} (no such heading)")
    assert not broken, broken


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings."""
    anchors = set()
    for heading in re.findall(r"(?m)^#+ (.+)$", re.sub(r"(?s)```.*?```", "", page.read_text())):
        anchors.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return anchors


def test_documents_speak_of_what_is_not_of_how_it_came_to_be():
    history = re.compile(
        r"\bissue \d+|\b(first|second|third|fourth|fifth|sixth) round\b|\brel\d+\b|\bthis session\b",
        re.IGNORECASE,
    )
    pages = [README, REPO / "BENCHMARKS.md", REPO / "ARCHITECTURE.md", *sorted(DOCS.rglob("*.md"))]
    found = [
        f"{page.relative_to(REPO)}:{n}: {line.strip()[:80]}"
        for page in pages
        for n, line in enumerate(page.read_text().splitlines(), 1)
        if history.search(line)
    ]
    assert not found, found


def test_configuration_reference_is_generated_from_the_schemas():
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gen_config_reference.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    page = (DOCS / "configuration.md").read_text()
    from finetune.core.config import Config

    assert "| `train.seq_len` | int or str | `2048` |" in page
    for section in Config.__dataclass_fields__:
        assert f"`{section}" in page


def test_readme_quotes_the_default_job_as_benchmarks_records_it():
    """The README's figures for the demo are BENCHMARKS.md's table for it, rounded as the README shows them."""
    section = (REPO / "BENCHMARKS.md").read_text().split("## The default job", 1)[1].split("\n## ", 1)[0]
    rows = {
        m.group(1): [float(v) for v in m.group(2, 3)]
        for m in re.finditer(r"(?m)^\| ([\w ,-]+) \| ([\d.]+) \| ([\d.]+) \| [\d.]+ \|$", section)
    }
    loss, exact = rows["held-out loss"], rows["exact match"]
    readme = _normalized(README.read_text())
    assert (
        f"held-out loss {loss[0]:.2f} -> {loss[1]:.2f}, exact match {exact[0]:.2f} -> {exact[1]:.2f}"
        in readme
    )
    assert (
        f"falls from {loss[0]:.2f} to {loss[1]:.2f} and exact match rises from {exact[0]:.2f} to {exact[1]:.2f}"
        in readme
    )
