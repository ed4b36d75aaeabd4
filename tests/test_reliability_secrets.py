"""A secret given in an override as a list or mapping, where a string goes, is refused without echoing it; and
`scrub` redacts such values whole wherever they are written."""

from __future__ import annotations

import pytest

from finetune.core import secrets
from finetune.pipeline.cli import main

SECRET = "hf_abcdefgh12345678"


@pytest.mark.parametrize(
    "override,kind",
    [
        (f"+launch.env.HF_TOKEN=[{SECRET},x]", "list"),
        (f"+launch.env.MY_SECRET={{a:{SECRET}}}", "dict"),
        (f"+launch.env.DB_PASSWORD=[[{SECRET}]]", "list"),
    ],
)
def test_a_secret_of_the_wrong_type_is_not_echoed(tmp_path, capsys, override, kind):
    code = main(["mode=plan", f"run_dir={tmp_path / 'run'}", override])
    err = capsys.readouterr().err
    name = override.split("=", 1)[0].rsplit(".", 1)[-1]
    assert code == 2 and SECRET not in err and "hf_" not in err
    assert err.strip() == (
        f"finetune: error: launch.env.{name}: Cannot convert '{kind}' to string: <redacted:{name}>"
    )
    assert not (tmp_path / "run").exists()


def test_scrub_redacts_lists_and_mappings_under_secret_names():
    doc = {"HF_TOKEN": [SECRET], "api_key": {"a": SECRET}, "plain": [1, 2], "empty_TOKEN": []}
    assert secrets.scrub(doc) == {
        "HF_TOKEN": "<redacted:HF_TOKEN>",
        "api_key": "<redacted:api_key>",
        "plain": [1, 2],
        "empty_TOKEN": [],
    }
    # other keys' lines are only scrubbed of known secret values
    assert secrets.redact_echo("train.seq_len", "train.seq_len: Value 'abc' is not an int") == (
        "train.seq_len: Value 'abc' is not an int"
    )
