"""Weight syncs to a generation engine see current params ([Note: params are current] in ``zero/update/allgather.py``).

TRL's online trainers push the trained weights to vLLM before they generate, reading them with
``named_parameters()`` outside the forward. With ``overlap_allgather`` the step returns with the
all-gathers of the updated params in flight, so such a push would send the previous step's weights:
generation one step off-policy, without a word. ``gate_weight_syncs`` makes each known sync method
wait for the params first. It looks methods up by name, so TRL is never imported; a trainer without
them is left as it is.

The methods (TRL 1.16; the names of earlier releases too):

- ``vllm_generation.sync_weights``: ``trl.generation.VLLMGeneration``, which GRPO, RLOO, distillation
  and the experimental GOLD, SDPO, SDFT and IW-OPD trainers keep as ``self.vllm_generation``. It walks
  ``named_parameters()`` into the server (``VLLMClient.update_named_params``) or the colocated engine
  (``load_weights``); the trainers call it before generating after a step, and its own ``generate()``
  after vLLM slept.
- ``_move_model_to_vllm``: the trainer's own push in the experimental online DPO trainer (and in
  GRPO and RLOO before ``VLLMGeneration``), over ``named_parameters()`` as well.

Example::

    gate_weight_syncs(trainer, trainer.zero_optimizer.wait_for_params)   # LowZeroTrainer.__init__ does it
"""

from __future__ import annotations

import functools
from collections.abc import Callable

# (the trainer's attribute holding the engine, or None for the trainer itself; the sync method)
WEIGHT_SYNCS = (
    ("vllm_generation", "sync_weights"),
    (None, "_move_model_to_vllm"),
)


def gate_weight_syncs(trainer, wait: Callable[[], None]) -> None:
    """Make every known weight sync of ``trainer`` (``WEIGHT_SYNCS``, see the module docstring) call
    ``wait`` first. Call it once the trainer is built: engines are made in its constructor.

    Args:
        trainer: The trainer (a ``with_zero`` twin of a TRL trainer, or any ``LowZeroTrainer``).
        wait: What makes the params current (``LowLevelZeroOptimizer.wait_for_params``).
    """
    for holder_name, method_name in WEIGHT_SYNCS:
        holder = trainer if holder_name is None else getattr(trainer, holder_name, None)
        sync = getattr(holder, method_name, None)
        if callable(sync):
            setattr(holder, method_name, _after(wait, sync))


def _after(wait: Callable[[], None], sync: Callable) -> Callable:
    @functools.wraps(sync)
    def waited(*args, **kwargs):
        wait()
        return sync(*args, **kwargs)

    return waited
