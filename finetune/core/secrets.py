"""Secrets never reach the run directory or the logs.

A secret is the value of an environment variable named HF_TOKEN,
WANDB_API_KEY, or anything ending in _TOKEN, _KEY or _SECRET, or containing
PASSWORD (case-insensitive), when it is at least 8 characters long (shorter
values such as "1" would redact every digit). `scrub` replaces such values
wherever they appear in text or nested data, and the value of any mapping key
named like a secret (`+launch.env.HF_TOKEN=...`), with `<redacted:NAME>` (in shell
scripts with `${NAME}`, so launch.sh and slurm.sbatch read the secret from the
environment they run in and stay valid scripts).
`rundir` scrubs every file it writes; `install_log_filter` scrubs log records.

A variable forwarded with `+launch.env.KEY=${oc.env:NAME}` counts as a secret
whatever its name (`register`, done by the entry point): its value is redacted
the same way, and scripts reference it as `${NAME}` (`shell_word`).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from typing import Any, Optional

SECRET_NAME = re.compile(r"(^HF_TOKEN$|^WANDB_API_KEY$|_TOKEN$|_KEY$|_SECRET$|PASSWORD)", re.IGNORECASE)
MIN_LENGTH = 8


def is_secret_name(name: str) -> bool:
    return bool(SECRET_NAME.search(name))


# Values forwarded from the environment by ${oc.env:NAME} in launch.env: value -> NAME.
_registered: dict[str, str] = {}


def register(value: str, name: str) -> None:
    """Treat `value` (read from the environment variable `name`) as a secret in everything written from now on."""
    if len(value) >= MIN_LENGTH:
        _registered[value] = name


def secret_values(environ: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """{value: NAME} for every secret-named variable in the environment (longest value first).

    With the process environment (`environ` None), also the values registered by `register`.
    """
    env = os.environ if environ is None else environ
    found = {v: k for k, v in env.items() if is_secret_name(k) and len(v) >= MIN_LENGTH}
    if environ is None:
        found = {**_registered, **found}
    return dict(sorted(found.items(), key=lambda kv: -len(kv[0])))


def shell_reference(key: str, value: str) -> Optional[str]:
    """The variable a script must read `key`'s value from, or None when the value may be written as is:
    the variable that holds it when it is a secret's value, else `key` itself when `key` is named like a
    secret (`+launch.env.HF_TOKEN=hf_...`: the value given on the command line is never written)."""
    name = secret_values().get(value)
    if name is not None:
        return name
    return key if is_secret_name(key) and value else None


def shell_word(value: str) -> str:
    """`value` as one shell word: literal (shlex.quote), except that secret values inside it become
    `${NAME}` references inside double quotes, read from the environment the script runs in."""
    import shlex

    found = [(v, n) for v, n in secret_values().items() if v in value]
    if not found:
        return shlex.quote(value)
    pattern = re.compile("|".join(re.escape(v) for v, _ in found))
    names = dict(found)
    out, pos = [], 0
    for m in pattern.finditer(value):
        out.append(_double_quoted(value[pos : m.start()]) + f"${{{names[m.group(0)]}}}")
        pos = m.end()
    out.append(_double_quoted(value[pos:]))
    return '"' + "".join(out) + '"'


def _double_quoted(text: str) -> str:
    """Escape what is special inside double quotes: backslash, double quote, dollar, backtick."""
    return re.sub(r'([\\"$`])', r"\\\1", text)


def scrub_text(text: str, environ: Optional[Mapping[str, str]] = None, shell: bool = False) -> str:
    """Each secret value replaced by `<redacted:NAME>`, or in a shell script by `${NAME}` (read at run time)."""
    for value, name in secret_values(environ).items():
        if value in text:
            text = text.replace(value, f"${{{name}}}" if shell else f"<redacted:{name}>")
    return text


def redact_echo(key: str, line: str) -> str:
    """An error line about setting `key` with the value it quotes left out where `key` is named like a secret
    (`+launch.env.HF_TOKEN=[hf_...]`: "Cannot convert 'list' to string: '[...]'"), and secret values scrubbed
    from it in any case."""
    name = key.rsplit(".", 1)[-1]
    if is_secret_name(name):
        # the libraries quote the offending value after the last ": '"
        line = re.sub(r": '.*$", f": <redacted:{name}>", line, flags=re.DOTALL)
    return scrub_text(line)


def scrub(obj: Any, environ: Optional[Mapping[str, str]] = None) -> Any:
    """A copy of `obj` (dicts, lists, strings) with secret values and secret-named keys' values redacted (a
    list or mapping given under such a key whole)."""
    if isinstance(obj, str):
        return scrub_text(obj, environ)
    if isinstance(obj, Mapping):
        return {
            k: (
                f"<redacted:{k}>"
                if isinstance(k, str)
                and is_secret_name(k)
                and isinstance(v, (str, list, tuple, Mapping))
                and v
                else scrub(v, environ)
            )
            for k, v in obj.items()
        }
    if isinstance(obj, (list, tuple)):
        return type(obj)(scrub(v, environ) for v in obj)
    return obj


_installed = False


def install_log_filter() -> None:
    """Scrub every log record this process creates, whatever logger or handler it goes to (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    make = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is logging's to report, not ours
            return record
        clean = scrub_text(message)
        if clean != message:
            record.msg, record.args = clean, None
        return record

    logging.setLogRecordFactory(factory)
