"""Adapters that put flashdmoe inside other libraries' models.

``flashdmoe.integrations.transformers``: :func:`~flashdmoe.integrations.transformers.patch_moe` swaps the
sparse MoE blocks of a Hugging Face transformers model for flashdmoe (needs ``pip install flashdmoe[hf]``).
Nothing here is imported by ``import flashdmoe``.
"""
