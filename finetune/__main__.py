"""python -m finetune [+recipe=NAME] [mode=plan|data|train|eval|export|all] [key=value ...]"""

import sys

from finetune.pipeline.cli import main

sys.exit(main())
