// pybind11 entry point: raw device pointers, shapes and the stream handle in; no libtorch linkage, so
// the module works with any torch build. Tensor checks live in flashdmoe/cuda_backend.py.
#include <pybind11/pybind11.h>
#include <cstdint>
#include "moe/launch.h"

namespace py = pybind11;
using namespace flashdmoe;

namespace {

template <typename T>
T* as_ptr(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

py::dict forward(uintptr_t x, uintptr_t router, uintptr_t w1, uintptr_t w2, uintptr_t y, uintptr_t topk_expert,
                 uintptr_t topk_weight, uintptr_t topk_row, uintptr_t expert_counts, uintptr_t workspace,
                 size_t workspace_bytes, int tokens, int hidden, int ffn, int experts, int top_k, int dtype,
                 int activation, bool normalize_topk, int capacity, uint64_t timeout_ns, int debug_withhold_phase,
                 int expert_variant, uintptr_t stream) {
  ForwardArgs a{};
  a.x = as_ptr<const void>(x);
  a.router = as_ptr<const void>(router);
  a.w1 = as_ptr<const void>(w1);
  a.w2 = as_ptr<const void>(w2);
  a.y = as_ptr<void>(y);
  a.topk_expert = as_ptr<int>(topk_expert);
  a.topk_weight = as_ptr<float>(topk_weight);
  a.topk_row = as_ptr<int>(topk_row);
  a.expert_counts = as_ptr<int>(expert_counts);
  a.workspace = as_ptr<void>(workspace);
  a.workspace_bytes = workspace_bytes;
  a.tokens = tokens; a.hidden = hidden; a.ffn = ffn; a.experts = experts; a.top_k = top_k;
  a.dtype = static_cast<DType>(dtype);
  a.activation = static_cast<Activation>(activation);
  a.normalize_topk = normalize_topk;
  a.capacity = capacity;
  a.timeout_ns = timeout_ns;
  a.debug_withhold_phase = debug_withhold_phase;
  a.expert_variant = expert_variant;
  LaunchInfo info;
  {
    py::gil_scoped_release release;
    info = launch_forward(a, reinterpret_cast<cudaStream_t>(stream));
  }
  py::dict out;
  out["grid"] = info.grid;
  out["blocks_per_sm"] = info.blocks_per_sm;
  out["smem_bytes"] = info.smem_bytes;
  return out;
}

py::dict layout(int tokens, int hidden, int ffn, int experts, int top_k, int dtype) {
  const WorkspaceLayout l = workspace_layout(tokens, hidden, ffn, experts, top_k, static_cast<DType>(dtype));
  py::dict out;
  out["error_word"] = l.error_word;
  out["status_flags"] = l.status_flags;
  out["phase_clock"] = l.phase_clock;
  out["phase_clock_slots"] = kPhaseClockSlots;
  out["sync_bytes"] = l.sync_bytes;
  out["total_bytes"] = l.total_bytes;
  out["gate_tiles"] = l.gate_tiles;
  out["max_row_tiles"] = l.max_row_tiles;
  return out;
}

py::dict attributes(int dtype, int expert_variant) {
  const KernelAttributes k = kernel_attributes(static_cast<DType>(dtype), expert_variant);
  py::dict out;
  out["registers"] = k.registers;
  out["local_bytes"] = k.local_bytes;
  out["max_threads_per_block"] = k.max_threads_per_block;
  out["static_smem_bytes"] = k.static_smem_bytes;
  return out;
}

}  // namespace

PYBIND11_MODULE(flashdmoe_cuda, m) {
  m.doc() = "FlashDMoE fused persistent MoE kernel (raw-pointer bindings)";
  m.def("forward", &forward, "Launch the fused MoE forward (memset of sync words + one kernel).", py::arg("x"),
        py::arg("router"), py::arg("w1"), py::arg("w2"), py::arg("y"), py::arg("topk_expert"),
        py::arg("topk_weight"), py::arg("topk_row"), py::arg("expert_counts"), py::arg("workspace"),
        py::arg("workspace_bytes"), py::arg("tokens"), py::arg("hidden"), py::arg("ffn"), py::arg("experts"),
        py::arg("top_k"), py::arg("dtype"), py::arg("activation"), py::arg("normalize_topk"), py::arg("capacity"),
        py::arg("timeout_ns"), py::arg("debug_withhold_phase"), py::arg("expert_variant"), py::arg("stream"));
  m.def("workspace_layout", &layout, py::arg("tokens"), py::arg("hidden"), py::arg("ffn"), py::arg("experts"),
        py::arg("top_k"), py::arg("dtype"));
  m.def("check_shapes", &check_shapes, py::arg("tokens"), py::arg("hidden"), py::arg("ffn"), py::arg("experts"),
        py::arg("top_k"));
  m.def("kernel_attributes", &attributes, py::arg("dtype"), py::arg("expert_variant") = 0);
}
