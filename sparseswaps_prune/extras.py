"""Optional dependencies: a clear error naming the extra to install when one is missing.

The base install (``pip install sparseswaps-prune``) covers ``core/``, :mod:`sparseswaps_prune.modules` and
:mod:`sparseswaps_prune.prune`. The extras (see ``pyproject.toml``) add: ``llm`` (Hugging Face models, data,
reports), ``lightning`` (the callback), ``finetune`` (peft), ``eval`` (lm-eval), ``all`` (everything).
"""

from __future__ import annotations

import importlib.util

__all__ = ["require"]


def require(extra: str, *modules: str) -> None:
    """Check that optional top-level modules are installed, before the code that imports them.

    Args:
        extra: the extra of ``sparseswaps-prune`` that installs them, e.g. ``"llm"``.
        *modules: top-level module names, e.g. ``"transformers"``, ``"datasets"``.

    Raises:
        ImportError: one of ``modules`` is not installed; the message names them and the command
            ``pip install 'sparseswaps-prune[<extra>]'``.

    Example:
        >>> require("llm", "transformers")  # before `from transformers import AutoModelForCausalLM`
    """
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed; this needs the "
            f"'{extra}' extra: pip install 'sparseswaps-prune[{extra}]'",
            name=missing[0],
        )
