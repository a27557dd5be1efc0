"""State of a stored trace's capture, readable without importing Dynamo (``aot_cache`` sets it)."""

from __future__ import annotations

import contextvars

#: True while ``vattn.compile`` captures or saves a trace: objects that pickle as something else
#: for ``torch.save`` (a class swapped at run time) pickle as themselves, so that the stored
#: guards name their real classes.
saving_trace: contextvars.ContextVar[bool] = contextvars.ContextVar("vattn_saving_trace", default=False)
