"""Run llama.cpp's convert_hf_to_gguf.py from its folder, with that folder's own gguf-py and conversion package.

    python finetune/export/llama_convert.py CONVERTER_DIR PRE_TOKENIZER MODEL_DIR --outfile F --outtype T

Started as a script by `finetune.export.gguf.convert` (a process of its own: llama.cpp's gguf-py must not meet
the installed gguf package that transformers uses). PRE_TOKENIZER ("" for none) is llama.cpp's name for the
model's pre-tokenizer, used only when the converter does not recognise the tokenizer by its hash.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any


def main(argv: list[str]) -> None:
    converter, pre = Path(argv[0]), argv[1]
    sys.path[:0] = [str(converter), str(converter / "gguf-py")]
    import convert_hf_to_gguf  # llama.cpp's
    from conversion import base

    if pre:
        detect = base.TextModel.get_vocab_base_pre

        def get_vocab_base_pre(self: Any, tokenizer: Any) -> str:
            try:
                return str(detect(self, tokenizer))
            except NotImplementedError:  # a vocabulary it does not know, with a pre-tokenizer it has
                return pre

        base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    sys.argv = [str(converter / "convert_hf_to_gguf.py"), *argv[2:]]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main(sys.argv[1:])
