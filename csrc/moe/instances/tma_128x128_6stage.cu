// Kernel instances of the tma-128x128-6stage expert variant (bf16 and fp16).
#include "moe/launch_template.cuh"

FLASHDMOE_INSTANTIATE_VARIANT(Tma128SixStages)
