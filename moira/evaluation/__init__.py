"""Accuracy of sparse decoding against dense on real models.

``hf``: Moira's float32 reference as a transformers attention function; ``tasks``: prompts
built from long text; ``experiments``: token KL, pass-key retrieval, repeated-passage
perplexity. Needs ``transformers`` (``pip install moira-attn[eval]``); ``moira eval`` runs it.
"""
