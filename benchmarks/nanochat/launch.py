"""torchrun's entry point: nanochat's ``scripts/base_train.py`` as ``__main__``.

    torchrun --standalone --nproc-per-node 2 launch.py --depth=2 ...   (cwd: nanochat tree)

Exactly ``python -m scripts.base_train ...``, plus two things the harness needs:

* ``wandb`` is stubbed: base_train imports it unconditionally, but with ``--run dummy``
  it only ever uses nanochat's own ``DummyWandb``, so an empty module is enough and
  nobody has to install wandb.
* ``GR_RECORD=1`` (the guarded runs) runs the script under ``@guardrails.record``, as a
  user would decorate their ``main()``: a ``GuardrailsError`` then ends the rank with
  its class's exit code (81 for ``NonFiniteError``...) and one summary on stderr.
  base_train.py is a flat script with no ``main()`` to decorate, so it happens here.
"""

from __future__ import annotations

import os
import runpy
import sys
import types

sys.modules.setdefault("wandb", types.ModuleType("wandb"))
sys.path.insert(0, os.getcwd())  # the nanochat tree, as `python -m` would


def main() -> None:
    runpy.run_module("scripts.base_train", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    if os.environ.get("GR_RECORD") == "1":
        import guardrails

        main = guardrails.record(main)
    main()
