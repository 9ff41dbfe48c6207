"""Loading a connector factory from its spec, the way engines and the suite receive it.

A connector is named by a *spec*: an import path ``"pkg.module:Name"`` (the part after the
colon may be a dotted attribute path, ``"pkg.module:Outer.Factory"``), a class with a
no-argument constructor, or a factory instance. ``load_factory`` accepts all three;
``factory_spec`` goes back from an instance to an import path so that worker processes
(the suite's, an engine's) can re-create the factory.

A spec may also name a connector of another engine through a *scheme*: ``"vllm:Name"``
or ``"vllm:pkg.module:ClassName"`` is a vLLM ``KVConnectorBase_V1`` run by
``kvspec.vllm.certify``. The scheme's module is imported by name only when a spec uses it,
so this module still imports nothing else of kvspec.

The connector's own configuration reaches every engine a factory builds, worker processes
included, as ``$KVSPEC_CONNECTOR_EXTRA`` (``connector_extra``): ``kvspec conform --extra``
sets it, the harness merges it into ``EngineConfigView.extra``, and the vLLM wrapper reads
it when it resolves the engine state a connector's class methods need.
"""

from __future__ import annotations

import importlib
import json
import os
from typing import Any

from .capabilities import Capabilities
from .connector import ConnectorFactory
from .errors import InvalidArgumentError
from .wire import resolve_type_path, type_path

__all__ = ["EXTRA_ENV", "connector_extra", "factory_spec", "load_factory"]

EXTRA_ENV = "KVSPEC_CONNECTOR_EXTRA"
"""Environment variable: a JSON object of the connector's own configuration (vLLM's
``kv_connector_extra_config``), merged into every engine's ``EngineConfigView.extra``.
``kvspec conform --extra KEY=VALUE`` and ``--extra-file`` set it."""


def connector_extra() -> dict[str, Any]:
    """The user's connector configuration from ``$KVSPEC_CONNECTOR_EXTRA`` ({} when unset).

    Raises:
        InvalidArgumentError: it is not a JSON object with string keys, or names a
            ``kvspec.`` key (those are the harness's own).
    """
    raw = os.environ.get(EXTRA_ENV, "")
    if not raw.strip():
        return {}
    try:
        value = json.loads(raw)
    except ValueError as e:
        raise InvalidArgumentError(f"${EXTRA_ENV} is not JSON ({e}); expected a JSON object "
                                   "of the connector's configuration") from None
    if not isinstance(value, dict):
        raise InvalidArgumentError(f"${EXTRA_ENV} is a JSON {type(value).__name__}; expected "
                                   "an object of the connector's configuration")
    bad = sorted(k for k in value if k.startswith("kvspec."))
    if bad:
        raise InvalidArgumentError(f"${EXTRA_ENV} sets {bad}: 'kvspec.' keys are the "
                                   "harness's own")
    return value


_SCHEMES = {"vllm": ("kvspec.vllm.certify", "factory_from_spec",
                     "needs vLLM installed (pip install kvspec[vllm], or on a CPU-only "
                     "machine scripts/vllm_env.sh)")}
"""Spec prefix -> (module, function taking the rest of the spec, what the scheme needs)."""

SPEC_ATTRIBUTE = "__kvspec_spec__"
"""A factory whose ``__kvspec_spec__`` is a string is re-created from that spec."""

_FACTORY_MEMBERS = ("name", "capabilities", "create_scheduler", "create_worker", "create_executor")


def _import_attribute(spec: str) -> object:
    return resolve_type_path(spec, what="connector spec", error=InvalidArgumentError,
                             clause=None)


def _from_scheme(spec: str) -> object | None:
    scheme, sep, rest = spec.partition(":")
    if not sep or scheme not in _SCHEMES:
        return None
    module_name, function, needs = _SCHEMES[scheme]
    if not rest:
        raise InvalidArgumentError(f"bad connector spec {spec!r}: nothing after '{scheme}:'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise InvalidArgumentError(
            f"connector spec {spec!r} {needs}; importing {module_name} failed: {e}") from e
    built: object = getattr(module, function)(rest)
    return built


def load_factory(spec: str | ConnectorFactory | type) -> ConnectorFactory:
    """Return the validated connector factory a spec names.

    Args:
        spec: ``"pkg.module:Name"`` (``Name`` may be a dotted attribute path; the attribute
            may itself be a class or an instance), a scheme spec such as
            ``"vllm:ExampleConnector"`` (see the module docstring), a class (instantiated
            with no arguments), or a factory instance (used as is).

    Returns:
        An object that satisfies ``ConnectorFactory``, whose
        ``capabilities`` is a ``Capabilities`` and whose ``name`` is a
        non-empty string.

    Raises:
        InvalidArgumentError: The spec is malformed, its module cannot be imported, the
            attribute is missing, the class cannot be instantiated without arguments, or the
            object is not a connector factory; the message says which.
    """
    where = repr(spec) if isinstance(spec, str) else f"{spec!r}"
    obj: object = spec
    if isinstance(spec, str):
        obj = _from_scheme(spec) or _import_attribute(spec)
    if isinstance(obj, type):
        cls = obj
        try:
            obj = cls()
        except Exception as e:
            raise InvalidArgumentError(
                f"connector {where}: could not instantiate {cls.__qualname__} with no arguments: "
                f"{type(e).__name__}: {e}"
            ) from e
    missing = [m for m in _FACTORY_MEMBERS if not _has_member(obj, m)]
    if missing:
        raise InvalidArgumentError(
            f"connector {where} is not a ConnectorFactory: {type(obj).__name__} lacks "
            + ", ".join(missing)
        )
    try:
        if not isinstance(obj, ConnectorFactory):  # pragma: no cover - same test as above
            raise InvalidArgumentError(f"connector {where} is not a ConnectorFactory")
        capabilities = obj.capabilities
        name = obj.name
    except InvalidArgumentError:
        raise
    except Exception as e:
        raise InvalidArgumentError(
            f"connector {where}: reading its name or capabilities raised "
            f"{type(e).__name__}: {e}"
        ) from e
    if not isinstance(capabilities, Capabilities):
        raise InvalidArgumentError(
            f"connector {where}: capabilities must be a kvspec.protocols.Capabilities, got "
            f"{type(capabilities).__name__}"
        )
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError(f"connector {where}: name must be a non-empty str, got {name!r}")
    return obj


def _has_member(obj: object, member: str) -> bool:
    # Look the member up on the class first so that a property raising is reported as such
    # (by the caller) rather than as a missing member.
    return hasattr(type(obj), member) or member in getattr(obj, "__dict__", {})


def factory_spec(factory: ConnectorFactory | type) -> str:
    """Return the ``"module:QualName"`` import path of a factory's class, or the spec an
    instance declares in ``__kvspec_spec__`` (scheme factories such as ``vllm:Name``).

    Worker subprocesses re-create the factory from it with ``load_factory``, so the class
    must be importable: defined at module level (or nested in module-level classes) in a
    module other than ``__main__``, with a no-argument constructor.

    Raises:
        InvalidArgumentError: The class is not importable by name.
    """
    declared = getattr(factory, SPEC_ATTRIBUTE, None)
    if not isinstance(factory, type) and isinstance(declared, str):
        return declared
    cls = factory if isinstance(factory, type) else type(factory)
    module, qualname = cls.__module__, cls.__qualname__
    if "<locals>" in qualname or module == "__main__":
        raise InvalidArgumentError(
            f"factory class {module}.{qualname} is not importable by name: define it at module "
            "level in an importable module"
        )
    return type_path(cls)
