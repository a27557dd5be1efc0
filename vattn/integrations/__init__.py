"""Adapters that put ``vattn.Attention`` under models from other libraries.

| module | what |
| --- | --- |
| ``vattn.integrations.transformers`` | ``attn_implementation="vattn"`` for Hugging Face ``transformers`` causal LMs, and a model adapter for vattn's flattened step (``wrap``, ``from_pretrained``) |

Each adapter imports its library only when it is imported itself: ``import vattn`` never does.
"""
