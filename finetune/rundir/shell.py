"""Lines of the scripts a run directory holds (launch.sh, slurm.sbatch, serve.sh) and of the commands
printed for the user to paste: comments that cannot end early, exports that name secrets instead of
writing them, and every word of a shown command quoted (`command_line`), so a run directory named
`$(...)` is a name when the line is pasted, not a command."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Union

from finetune.core.secrets import shell_reference, shell_word


def shell_comment(text: str) -> str:
    """`text` as one `# ...` line of a script: a newline or other control character in a name or path
    would otherwise end the comment and start a command."""
    return "# " + re.sub(r"[\x00-\x1f\x7f]", "?", str(text))


def export_line(key: str, value: str) -> str:
    """`export KEY=VALUE` for a script: a secret as a `${NAME}` reference (`secrets.shell_reference`), never
    its value; anything else quoted as one literal word."""
    ref = shell_reference(key, value)
    return f"export {key}=${{{ref}}}" if ref else f"export {key}={shell_word(value)}"


def references_secrets(env: dict[str, str]) -> bool:
    """Whether `export_line` writes a secret reference for any of `env` (the script is then mode 0700)."""
    return any(shell_reference(k, v) or shell_word(v).startswith('"') for k, v in env.items())


def command_line(*words: Union[str, Path]) -> str:
    """A command to print or write into a comment, each word quoted for the shell (`shlex.quote`): pasted
    as it is, it runs that command and nothing else."""
    return " ".join(shlex.quote(str(w)) for w in words)
