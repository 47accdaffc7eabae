"""``with_zero``: the ZeRO twin of any ``Trainer`` or ``TrainingArguments`` subclass.

TRL's trainers (``SFTTrainer``, ``DPOTrainer``, ``GRPOTrainer``, ...), ``Seq2SeqTrainer`` and a user's own
``Trainer`` subclass get ZeRO stage 1/2 the way ``Trainer`` does; their configs get the ``zero_*``
fields, which ``HfArgumentParser``/``TrlParser`` turn into ``--zero_stage 2`` and friends.

Example::

    from trl import SFTConfig, SFTTrainer
    from hf_lowzero import with_zero

    ZeroSFTConfig, ZeroSFTTrainer = with_zero(SFTConfig), with_zero(SFTTrainer)
    args = ZeroSFTConfig(output_dir="out", zero_stage=2, bf16=True)
    ZeroSFTTrainer(model=model, args=args, train_dataset=ds).train()

# [Note: twin classes]
A trainer twin is ``class ZeroX(LowZeroTrainer, X)``: LowZeroTrainer's overrides come first in the
MRO and call ``super()``, which reaches X's own overrides (TRL's ``compute_loss``, ``_save``, ...)
before ``Trainer``'s. An arguments twin is a dataclass ``ZeroC(ZeroArguments, C)`` whose own fields
are only the ``zero_*`` fields: C's defaults (TRL's ``learning_rate``, ``logging_steps``, ...)
stay C's, which subclassing ``LowZeroTrainingArguments`` would reset to ``TrainingArguments``'.
Twins are made once per class and named in this module (``ZeroSFTTrainer`` under a name that also
encodes X's module), so pickle finds them again in another process: Trainer saves its arguments
with ``torch.save``, and Ray pickles a trainer for ``hyperparameter_search``.
"""

from __future__ import annotations

import dataclasses
import importlib
import typing

from transformers import Trainer, TrainingArguments

from hf_lowzero.trainer.arguments import LowZeroTrainingArguments, ZeroArguments
from hf_lowzero.trainer.signature import expected_arguments_class, given_arguments, replace_arguments
from hf_lowzero.trainer.trainer import LowZeroTrainer

_PREFIX = "ZeroTwin__"
_DOT = "__dot__"
_TWINS: dict[type, type] = {Trainer: LowZeroTrainer, TrainingArguments: LowZeroTrainingArguments}

T = typing.TypeVar("T", bound=type)


def with_zero(cls: T) -> T:
    """The ZeRO twin of ``cls`` (see [Note: twin classes]).

    - a ``transformers.Trainer`` subclass: a subclass that runs ZeRO stage 1/2 when its arguments
      say ``zero_stage`` > 0, exactly as ``LowZeroTrainer`` (``with_zero(Trainer)`` is LowZeroTrainer);
    - a ``TrainingArguments`` subclass: a dataclass subclass with the ``zero_*`` fields
      (``with_zero(TrainingArguments)`` is LowZeroTrainingArguments).

    A class that already is a twin is returned as is.

    Example::

        ZeroSeq2SeqTrainer = with_zero(Seq2SeqTrainer)
        parser = HfArgumentParser(with_zero(Seq2SeqTrainingArguments))
        (args,) = parser.parse_args_into_dataclasses(["--output_dir", "out", "--zero_stage", "2"])

    Args:
        cls: A ``transformers.Trainer`` or ``TrainingArguments`` subclass (or one of those two).

    Returns:
        The twin class: made once per class, the same object on every later call.

    Raises:
        TypeError: ``cls`` is not a class, or neither a ``Trainer`` nor a ``TrainingArguments`` subclass.
    """
    if not isinstance(cls, type):
        raise TypeError(f"with_zero expects a Trainer or TrainingArguments subclass, got {cls!r}")
    if cls in _TWINS:
        return _TWINS[cls]
    if issubclass(cls, (LowZeroTrainer, ZeroArguments)):
        return cls
    name = _twin_name(cls)
    if issubclass(cls, Trainer):
        doc = f"{cls.__name__} with ZeRO stage 1/2 (with_zero)."
        twin = type(name, (_AcceptsAnyZeroArguments, LowZeroTrainer, cls), {"__doc__": doc})
    elif issubclass(cls, TrainingArguments):
        twin = _arguments_twin(name, cls)
    else:
        raise TypeError(
            f"with_zero expects a transformers.Trainer or TrainingArguments subclass, got {cls.__qualname__}; "
            "for a plain torch training loop wrap the optimizer instead: LowLevelZeroOptimizer(model, optimizer)"
        )
    # A readable name for people; the qualified name is the one pickle looks up.
    twin.__module__, twin.__name__, twin.__qualname__ = __name__, f"Zero{cls.__name__}", name
    _TWINS[cls] = twin
    return twin


def _arguments_twin(name: str, cls: type[TrainingArguments]) -> type:
    hints = typing.get_type_hints(LowZeroTrainingArguments)
    zero_fields = [
        (f.name, hints[f.name], dataclasses.field(default=f.default, metadata=f.metadata))
        for f in dataclasses.fields(LowZeroTrainingArguments)
        if f.name.startswith("zero_")
    ]
    doc = f"{cls.__name__} with the zero_* fields of LowZeroTrainingArguments (with_zero)."
    return dataclasses.make_dataclass(name, zero_fields, bases=(ZeroArguments, cls), namespace={"__doc__": doc})


def _twin_name(cls: type) -> str:
    """A name that says which class this is the twin of, from which ``__getattr__`` rebuilds it."""
    return f"{_PREFIX}{cls.__module__.replace('.', _DOT)}{_DOT}{cls.__qualname__.replace('.', _DOT)}"


def __getattr__(name: str) -> type:
    # Unpickling a twin in a process that has not made it yet (see [Note: twin classes]).
    if not name.startswith(_PREFIX):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    path = name[len(_PREFIX) :].split(_DOT)
    for split in range(len(path) - 1, 0, -1):  # the longest importable module prefix
        try:
            obj = importlib.import_module(".".join(path[:split]))
        except ImportError:
            continue
        for part in path[split:]:
            obj = getattr(obj, part)
        return with_zero(obj)
    raise AttributeError(f"module {__name__!r} cannot rebuild {name!r}: no module of that name imports")


class _AcceptsAnyZeroArguments:
    """First in a trainer twin's MRO: arguments of another ZeRO class (``LowZeroTrainingArguments``
    given to ``with_zero(SFTTrainer)``) become the twin of the class the trainer expects, every value
    kept, the way TRL converts plain ``TrainingArguments``; TRL would otherwise rebuild them as its
    own config and fail on the ``zero_*`` fields.
    """

    def __init__(self, *args, **kwargs) -> None:
        given = given_arguments(type(self), args, kwargs)
        expected = expected_arguments_class(type(self))
        if isinstance(given, ZeroArguments) and not isinstance(given, expected):
            values = given.to_dict()
            values["hub_token"] = given.hub_token  # to_dict hides it
            args, kwargs = replace_arguments(type(self), args, kwargs, with_zero(expected)(**values))
        super().__init__(*args, **kwargs)
