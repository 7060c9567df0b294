"""The layer's gradients on the GPU from what the forward saved: one rank and an emulated team's ranks
(``expert_backward``, with the expert GEMMs as grouped GEMMs or one persistent launch, ``fused_backward``),
and a team's backward with the rows moved between ranks by the device (``ep_backward``).
"""
