"""Inert stand-ins for the classes Megatron-LM pickles into its checkpoints.

Besides tensors, Megatron-LM's rank files (``model_optim_rng.pt``) and ``common.pt`` hold values
of Megatron's own classes: enums in ``args`` (``attention_backend``, ``model_type``,
``cuda_graph_scope``), the rerun state machine's enums, an ``OptimizerConfig``, generators in
the RNG state (``megatron/core/safe_globals.py`` registers exactly these). A reader must not
need megatron-core installed for them, nor import or call what a file names, so each name
below unpickles into a :class:`MegatronValue`: the class's name and what the pickle passed to
rebuild it, nothing run, wherever they are: Megatron-LM's torch_dist and torch_dcp
checkpoints hold them in DCP bytes items (``common_state``, ``rerun_state_machine_state``,
``args``). A generator becomes one only in Megatron's own files: elsewhere a
``torch.Generator`` is the user's, and a stand-in would silently replace it. A class the user
registered with ``torch.serialization.add_safe_globals`` under the same name is used instead.
"""

from __future__ import annotations

import reprlib
from typing import Any

# ``module.Class`` as pickles name them (a class's defining module, not where megatron re-exports it)
MEGATRON_CLASS_NAMES = (
    "megatron.core.enums.ModelType",
    "megatron.core.transformer.enums.ModelType",  # megatron-core before 0.13, and still defined there
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.CudaGraphModule",
    "megatron.core.transformer.enums.CudaGraphScope",
    "megatron.core.transformer.enums.InferenceCudaGraphScope",
    "megatron.core.optimizer.optimizer_config.OptimizerConfig",
    "megatron.core.rerun_state_machine.RerunDiagnostic",
    "megatron.core.rerun_state_machine.RerunMode",
    "megatron.core.rerun_state_machine.RerunState",
)
GENERATOR_NAME = "torch._C.Generator"  # in Megatron's RNG state: a CUDA one cannot be built without a GPU


class MegatronValue:
    """A value of a Megatron class this reader does not import: ``type_name`` (``module.Class``),
    ``args`` (an enum member's value: ``Class(value)``) and ``state`` (a dataclass's fields)."""

    type_name = ""  # each stand-in class names its own; a rebuilt value holds it itself
    args: tuple[Any, ...] = ()
    state: Any = None

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __reduce__(self) -> tuple[Any, ...]:
        # saved again (a converted checkpoint's ``args``): as a call our loader allows, not as the
        # Megatron class it stands in for, which need not exist where it is loaded
        return megatron_value, (self.type_name, self.args, self.state)

    def _fields(self) -> tuple[Any, ...]:
        return self.type_name, self.args, self.state

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MegatronValue) and self._fields() == other._fields()

    def __hash__(self) -> int:  # enum members are dict keys at times
        return hash((self.type_name, self.args))

    @reprlib.recursive_repr()  # a hostile state may hold the value itself
    def __repr__(self) -> str:
        inside = ", ".join(map(repr, self.args)) if self.args else ("" if self.state is None else repr(self.state))
        return f"{self.type_name}({inside})"


def megatron_value(type_name: str, args: tuple[Any, ...], state: Any) -> MegatronValue:
    """Rebuild a saved :class:`MegatronValue` (its ``__reduce__``); holds data, runs nothing."""
    if not isinstance(type_name, str) or not isinstance(args, tuple):
        raise TypeError(f"megatron_value takes a class name and an argument tuple, not {type(type_name).__name__}, "
                        f"{type(args).__name__}")
    value = MegatronValue(*args)
    value.type_name = type_name
    value.state = state
    return value


def _stand_in(name: str) -> type[MegatronValue]:
    return type(name.rsplit(".", 1)[1], (MegatronValue,), {"type_name": name, "__module__": __name__})


_STAND_INS = [(_stand_in(name), name) for name in MEGATRON_CLASS_NAMES]
_GENERATOR = (_stand_in(GENERATOR_NAME), GENERATOR_NAME)


def megatron_stand_ins(taken: set[str], megatron_file: bool) -> list[tuple[type[MegatronValue], str]]:
    """``(class, name)`` pairs for ``torch.serialization.safe_globals``: Megatron's classes, and
    in a Megatron file (``megatron_file``) its generators, except the names in ``taken``
    (registered by the user with their real classes)."""
    pairs = [*_STAND_INS, _GENERATOR] if megatron_file else _STAND_INS
    return [(cls, name) for cls, name in pairs if name not in taken]
