"""Digests of the references: what a case's distances to float64 and to torch are measured against.

A case's direction (closer to or farther from float64) compares two runs' distances to their
references. Those are the same reference only if nothing under them changed: torch upgraded (its
ops, so the float64 trajectory itself), torch.optim's step rewritten, or our own reference code
(this folder) edited. So each reference is digested where it runs, and a run records the digest of
each case's references; a verdict whose baseline recorded another digest for a case says
"reference changed" for it and does not judge its direction (service.core.verdicts).

`reference_digests()` runs in the kernel host (it imports torch) and digests, per optimizer, what
its references are made of as the host has them loaded:
* torch's version (its ops: every reference's arithmetic runs through them);
* the source of this folder's modules (the wrappers, the paper references);
* for the optimizers torch.optim provides: the code of every function and class method of the
  modules the torch.optim class and its bases come from (torch.optim.adam for AdamW, ...), as
  loaded: an edited torch.optim file and a function replaced at run time both change it.
`case_reference_digests()` (standard library only: the Celery parent calls it) gives each case its
digest from those: its optimizer's, at its parameter dtype (the same-precision reference runs
there, the float64 reference in float64).
"""

from __future__ import annotations

import hashlib
import inspect
import sys
import types
from collections.abc import Iterable, Mapping
from pathlib import Path

from service.core.results import CaseSpec

# The torch.optim class each optimizer's references use (worker.references.optimizers builds them;
# tests/worker/references/test_reference_digest.py keeps the two in step). The others are written
# from their papers in this folder.
TORCH_OPTIM_CLASSES = {"adam": "AdamW", "momentum": "SGD", "rmsprop": "RMSprop", "adagrad": "Adagrad"}
PAPER_OPTIMIZERS = ("lion", "ademamix")


def _own_sources() -> bytes:
    folder = Path(__file__).resolve().parent
    return b"".join(f"{path.name}\n".encode() + path.read_bytes() for path in sorted(folder.glob("*.py")))


def _constant(value: object) -> bytes:
    if isinstance(value, types.CodeType):
        return _code_bytes(value)
    if isinstance(value, (tuple, frozenset)):
        items = [_constant(item) for item in value]
        return b"(" + b",".join(sorted(items) if isinstance(value, frozenset) else items) + b")"
    return repr(value).encode()


def _code_bytes(code: types.CodeType) -> bytes:
    # The bytecode, the names it reads and its constants, nested code included. Not marshal: its
    # output depends on reference counts, so it can differ between two processes for one function.
    return b"|".join([code.co_code, " ".join(code.co_names).encode(), _constant(code.co_consts)])


def _code_of(function: types.FunctionType) -> bytes:
    """What a call of `function` runs: its compiled code and its defaults."""
    return function.__qualname__.encode() + _code_bytes(function.__code__) + _constant(function.__defaults__ or ())


def _unwrapped(member: object) -> object:
    return inspect.unwrap(getattr(member, "__func__", member))  # staticmethod / classmethod: the function


def _module_code(module: types.ModuleType) -> bytes:
    """Every function and class method bound in the module's namespace now, in name order."""
    parts = [module.__name__.encode()]
    for name, value in sorted(vars(module).items()):
        if isinstance(value, types.FunctionType):
            parts.append(name.encode() + _code_of(inspect.unwrap(value)))
        elif isinstance(value, type) and value.__module__ == module.__name__:
            for attribute, member in sorted(vars(value).items()):
                member = _unwrapped(member)
                # torch.optim.Optimizer's first instance of a class binds the inherited step, wrapped,
                # on that class: what it runs is its base's, digested there.
                inherited = any(attribute in vars(base) and _unwrapped(vars(base)[attribute]) is member
                                for base in value.__mro__[1:])
                if isinstance(member, types.FunctionType) and not inherited:
                    parts.append(f"{name}.{attribute}".encode() + _code_of(member))
    return b"\n".join(parts)


def reference_digests() -> dict[str, str]:
    """{optimizer: digest of its references as this process has them loaded}. In the kernel host."""
    import torch
    import torch.optim

    common = hashlib.sha256(f"optdrift references 1\ntorch {torch.__version__}\n".encode())
    common.update(_own_sources())
    digests = {}
    for optimizer in PAPER_OPTIMIZERS:
        digest = common.copy()
        digest.update(f"paper {optimizer}".encode())
        digests[optimizer] = digest.hexdigest()[:32]
    for optimizer, class_name in TORCH_OPTIM_CLASSES.items():
        digest = common.copy()
        cls = getattr(torch.optim, class_name)
        digest.update(f"torch.optim.{class_name}".encode())
        modules = dict.fromkeys(klass.__module__ for klass in cls.__mro__ if klass.__module__.startswith("torch."))
        for name in modules:
            digest.update(_module_code(sys.modules[name]))
        digests[optimizer] = digest.hexdigest()[:32]
    return digests


def case_reference_digests(cases: Iterable[CaseSpec], references: Mapping[str, str] | None) -> dict[str, str]:
    """{case id: digest of the case's references}; {} when the host said nothing of its references
    (an older worker): nothing is then known to have changed."""
    if not references:
        return {}
    return {case.case_id: hashlib.sha256(f"{references[case.optimizer]}\n{case.param_dtype}".encode()).hexdigest()[:32]
            for case in cases if case.optimizer in references}
