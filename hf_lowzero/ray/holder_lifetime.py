"""The lifetime of a run's snapshot holders: their names, finding them, and ending them.

A run's holders (``holder.py``) are detached actors named ``<run_id>:<node_id>`` in the
``hf_lowzero_snapshots`` namespace, so two runs, e.g. the trials of a Tune sweep, never see each
other's pieces; nothing but the ways below ends them ([Note: holder lifetime]).

Example::

    TorchTrainer(train_func, run_config=RunConfig(callbacks=[ReleaseSnapshots()]), ...).fit()
    run_holders(current_run().run_id)     # inside a worker: {name: handle} of the run's live holders

# [Note: holder lifetime]
# A holder is detached: it must outlive the worker group that created it, through every restart.
# Three things end it, and its memory with it:
# - the run finishing, successfully or failed for good, or being aborted (Ctrl-C, a Tune stop):
#   ``ReleaseSnapshots``, a callback of the run's Ray Train controller (the Ray job's recipe adds
#   it; add it to your own ``RunConfig(callbacks=[...])``), ends every holder of the run;
# - training ending normally: the first rank ends them (``MemorySnapshots.on_train_end``);
# - the run's controller going away (the driver exited or was killed, a Tune trial died): each
#   holder watches it in the GCS by id, never through a handle (a handle would keep it alive), and
#   exits within seconds. A finished controller may live on while its driver does (Ray Train's
#   SIGINT handler holds it), which is why the callback, not the watch, is the first line.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import ray
from ray.train.v2._internal.execution.callback import ControllerCallback  # Ray Train V2's; no public name

from hf_lowzero.snapshot import segments

NAMESPACE = "hf_lowzero_snapshots"
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunIdentity:
    """The fit a worker belongs to: Ray Train's run id (new for every ``fit()``, the same across its
    restarts) and its controller actor's id.
    """

    run_id: str
    controller_id: str | None

    def holder_name(self, node_id: str) -> str:
        """The name of this run's holder on node ``node_id``."""
        return f"{self.run_id}:{node_id}"


def current_run() -> RunIdentity:
    """The run of this Ray Train worker (Ray Train 2.5x, V2)."""
    # Ray Train V2 keeps both in its internal train context; no public API names them.
    from ray.train.v2._internal.execution.context import get_train_context

    context = get_train_context()
    controller = getattr(context, "controller_actor", None)
    controller_id = controller._actor_id.hex() if controller is not None else None
    return RunIdentity(context.train_run_context.run_id, controller_id)


def run_holders(run_id: str) -> dict[str, Any]:
    """The live holders of run ``run_id``: ``{name: handle}``."""
    names = [
        entry["name"]
        for entry in ray.util.list_named_actors(all_namespaces=True)
        if entry["namespace"] == NAMESPACE and entry["name"].startswith(f"{run_id}:")
    ]
    holders = {}
    for name in names:
        try:
            holders[name] = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:  # gone since it was listed
            continue
    return holders


def all_holder_names() -> list[str]:
    """Every live holder of every run (what a test checks is gone after a run)."""
    return [e["name"] for e in ray.util.list_named_actors(all_namespaces=True) if e["namespace"] == NAMESPACE]


def release_run(run_id: str) -> None:
    """End every holder of run ``run_id`` now (their memory is freed)."""
    handles = list(run_holders(run_id).values())
    for handle, ref in [(h, h.close.remote()) for h in handles]:
        with contextlib.suppress(ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            ray.get(ref, timeout=30)  # its files first: killed, a holder would leave them behind
        ray.kill(handle)


class ReleaseSnapshots(ControllerCallback):
    """A Ray Train controller callback that ends the run's snapshot holders when the run finishes
    (successfully or failed for good) or is aborted ([Note: holder lifetime]).

    Example::

        TorchTrainer(train_func, run_config=RunConfig(callbacks=[ReleaseSnapshots()]), ...).fit()
    """

    def after_controller_start(self, train_run_context) -> None:
        """Remember the run's id."""
        self.run_id = train_run_context.run_id

    def after_controller_finish(self, result) -> None:
        """The run finished (successfully or failed for good): end its holders."""
        release_run(self.run_id)

    def before_controller_abort(self) -> None:
        """The run is aborted (Ctrl-C, a Tune stop): end its holders."""
        release_run(self.run_id)


def sweep_left_over_runs() -> None:
    """Remove this machine's snapshot folders of runs that no holder in this cluster serves.

    Only folders untouched for ``segments.STALE_S`` go ([Note: snapshot folder] in ``segments.py``).
    """
    with contextlib.suppress(Exception):  # housekeeping: never the holder's failure
        live = {entry["name"].split(":", 1)[0] for entry in ray.util.list_named_actors(all_namespaces=True)
                if entry["namespace"] == NAMESPACE}  # fmt: skip
        for folder in segments.sweep(live):
            logger.warning("[hf_lowzero] removed the memory snapshots a finished run left in %s", folder)


def actor_alive(actor_id: str) -> bool:
    """Whether actor ``actor_id`` is alive (False too when the GCS cannot be reached)."""
    # The GCS actor table, read without the dashboard's state API (which a cluster may not run).
    from ray._private import state

    try:
        info = state.actors(actor_id=actor_id)
    except Exception:  # the GCS is unreachable: the cluster is going away
        return False
    return bool(info) and info.get("State") not in ("DEAD", None)
