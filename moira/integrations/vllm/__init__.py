"""Moira as a vLLM 0.26 attention backend (a ``vllm.general_plugins`` entry point).

Turn it on with ``--attention-backend CUSTOM --block-size 64`` and configure it with
``--additional-config '{"moira": {"gamma": 0.98}}'`` or ``MOIRA_*`` environment variables (see
``settings.py``). ``register`` runs in every vLLM process; it only records a class path, so it
imports nothing heavy (no CUDA, no kernels).
"""

BACKEND_CLASS = "moira.integrations.vllm.backend.MoiraAttentionBackend"


def register() -> None:
    """Register Moira as vLLM's ``CUSTOM`` attention backend (idempotent)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_CLASS)
