// fp16 instantiation (one file per dtype so they compile in parallel).
#include "moe/launch_template.cuh"

namespace flashdmoe {
template LaunchInfo launch_forward_typed<__half>(const ForwardArgs&, cudaStream_t);
template KernelAttributes kernel_attributes_typed<__half>(int);
}  // namespace flashdmoe
