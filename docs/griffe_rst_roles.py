"""A griffe extension for the reference site: Sphinx roles in docstrings become code.

kvspec's docstrings use Sphinx cross-reference roles (``:class:`Capabilities```,
``:meth:`~KVCacheLayout.view```) that mkdocstrings would print as they are. This extension,
loaded from mkdocs.yml, rewrites each role to inline code, keeping the last component for
``~`` targets as Sphinx does. The docstrings themselves stay unchanged.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|meth|func|data|mod|attr|exc|obj|const):`(~?)([^`]+)`")


def _code(match: re.Match[str]) -> str:
    target = match.group(2)
    return f"`{target.rsplit('.', 1)[-1] if match.group(1) else target}`"


class RstRoles(griffe.Extension):
    """Rewrite Sphinx roles in every docstring griffe loads."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_code, obj.docstring.value)
