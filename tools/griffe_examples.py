"""A griffe extension for the API reference: ``Example:`` sections are examples.

The docstrings head their doctests ``Example:`` (Google style); griffe reads only
``Examples:`` as an examples section and renders ``Example:`` as an admonition, whose
``>>>`` lines would be plain text. mkdocs.yml loads this file.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.M)


class ExampleSections(griffe.Extension):
  """Renames each docstring's ``Example:`` heading to ``Examples:``."""

  def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
    if obj.docstring is not None:
      obj.docstring.value = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
