"""Expert parallelism: teams of ranks and their symmetric buffers (``team``; several ranks on one GPU
under MPS, ``mps``; the NVSHMEM device-API transport, ``nvshmem_transport``), and the exchange-based
layer with autograd (``ep_exchange``) over gloo (``ep_gloo``), over an NVSHMEM team's peer memory
(``ep_peer``) and across nodes by relays (``ep_hierarchy``, the CPU reference of the hierarchical
exchange).
"""
