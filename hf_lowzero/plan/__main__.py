"""``python -m hf_lowzero.plan``: the plan's command by its first name (it is
``python -m hf_lowzero.trainer.plan_cli``, which parses the Trainer's flags and so sits above ``trainer/``).

This entry point is the top of its process, not a module anything imports: it runs that command by name,
so no module of ``plan/`` imports the Trainer (``tests/test_layers.py``), and every script that runs
``python -m hf_lowzero.plan`` keeps working.
"""

import runpy

runpy.run_module("hf_lowzero.trainer.plan_cli", run_name="__main__", alter_sys=True)
