"""The fused CUDA kernel as Python sees it: building and loading the extension (``extension``), the expert
GEMM variants compiled into it (``expert_variants``), the codes and knobs a launch passes (``kernel_codes``,
``launch_knobs``), its scratch memory (``workspace_pool``), and what a launch reports and when its errors
surface without a host synchronisation (``launch_report``, ``status_checks``).

Nothing here builds the MoE layer itself: :mod:`flashdmoe.cuda_backend` launches the forward on these
pieces, :mod:`flashdmoe.backward` the backward. Importing the package imports none of its modules.
"""
