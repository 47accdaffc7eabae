"""Where a ``Trainer`` subclass takes its arguments, and which arguments class it expects.

Trainers differ: ``Trainer(model, args, ...)``, ``GRPOTrainer(model, reward_funcs, args, ...)``;
``SFTTrainer`` expects ``SFTConfig``, ``Seq2SeqTrainer`` ``Seq2SeqTrainingArguments``. Both are read
from the signature of the first ``__init__`` in the class's MRO that names an ``args`` parameter.

Example::

    given_arguments(GRPOTrainer, (model, reward), {"args": config})   # config
    expected_arguments_class(SFTTrainer)                            # SFTConfig
"""

from __future__ import annotations

import inspect
import sys
import typing
from collections.abc import Callable

from transformers import TrainingArguments


def _args_parameter(trainer_cls: type) -> tuple[int, inspect.Parameter, Callable] | None:
    """(position after ``self``, the parameter, the ``__init__``) of ``args``, or None."""
    for klass in trainer_cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = list(inspect.signature(init).parameters.values())[1:]
        for position, param in enumerate(params):
            if param.name == "args" and param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
                return position, param, init
    return None


def given_arguments(trainer_cls: type, args: tuple, kwargs: dict):
    """The ``args`` a call ``trainer_cls(*args, **kwargs)`` passes, or None."""
    found = _args_parameter(trainer_cls)
    if found is None:
        return kwargs.get("args")
    position = found[0]
    return kwargs["args"] if "args" in kwargs else args[position] if len(args) > position else None


def replace_arguments(trainer_cls: type, args: tuple, kwargs: dict, value) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of the same call with ``value`` as its ``args``."""
    found = _args_parameter(trainer_cls)
    if "args" in kwargs or found is None or len(args) <= found[0]:
        return args, {**kwargs, "args": value}
    position = found[0]
    return (*args[:position], value, *args[position + 1 :]), kwargs


def expected_arguments_class(trainer_cls: type) -> type[TrainingArguments]:
    """The most derived ``TrainingArguments`` subclass the ``args`` annotation names
    (``TrainingArguments`` when it names none)."""
    found = _args_parameter(trainer_cls)
    if found is None:
        return TrainingArguments
    _, param, init = found
    annotation = param.annotation
    if isinstance(annotation, str):  # postponed evaluation: look the names up in the defining module
        scope = vars(sys.modules[init.__module__])
        named = [scope.get(part.strip().strip("'\"")) for part in annotation.split("|")]
    else:
        named = list(typing.get_args(annotation)) or [annotation]
    configs = [c for c in named if isinstance(c, type) and issubclass(c, TrainingArguments)]
    return max(configs, key=lambda c: len(c.__mro__)) if configs else TrainingArguments
