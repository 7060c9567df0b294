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

template <typename T>
T get(const py::dict& d, const char* key) {
  if (!d.contains(key)) throw std::invalid_argument(std::string("missing launch argument '") + key + "'");
  return d[key].cast<T>();
}

// shared: the launch's common arguments; ranks: one dict per rank in the launch (see RankArgs).
py::dict forward(const py::dict& shared, const py::list& ranks, uintptr_t stream) {
  ForwardArgs a{};
  a.router = as_ptr<const void>(get<uintptr_t>(shared, "router"));
  a.hidden = get<int>(shared, "hidden");
  a.ffn = get<int>(shared, "ffn");
  a.experts = get<int>(shared, "experts");
  a.top_k = get<int>(shared, "top_k");
  a.world_size = get<int>(shared, "world_size");
  a.stream_rows = get<int>(shared, "stream_rows");
  a.dtype = static_cast<DType>(get<int>(shared, "dtype"));
  a.activation = static_cast<Activation>(get<int>(shared, "activation"));
  a.normalize_topk = get<bool>(shared, "normalize_topk");
  a.sequence = get<uint32_t>(shared, "sequence");
  a.timeout_ns = get<uint64_t>(shared, "timeout_ns");
  a.debug_withhold_phase = get<int>(shared, "debug_withhold_phase");
  a.expert_variant = get<int>(shared, "expert_variant");
  a.max_blocks = get<int>(shared, "max_blocks");
  a.gate_split = get<bool>(shared, "gate_split");
  a.grid_percent = get<int>(shared, "grid_percent");
  a.num_ranks = static_cast<int>(py::len(ranks));
  if (a.num_ranks < 1 || a.num_ranks > kMaxRanks)
    throw std::invalid_argument("ranks: expected 1.." + std::to_string(kMaxRanks) + " rank dicts");
  for (int i = 0; i < a.num_ranks; ++i) {
    const py::dict d = ranks[i].cast<py::dict>();
    RankArgs& r = a.ranks[i];
    r.x = as_ptr<const void>(get<uintptr_t>(d, "x"));
    r.w1 = as_ptr<const void>(get<uintptr_t>(d, "w1"));
    r.w2 = as_ptr<const void>(get<uintptr_t>(d, "w2"));
    r.y = as_ptr<void>(get<uintptr_t>(d, "y"));
    r.topk_expert = as_ptr<int>(get<uintptr_t>(d, "topk_expert"));
    r.topk_weight = as_ptr<float>(get<uintptr_t>(d, "topk_weight"));
    r.topk_row = as_ptr<int>(get<uintptr_t>(d, "topk_row"));
    r.expert_counts = as_ptr<int>(get<uintptr_t>(d, "expert_counts"));
    r.workspace = as_ptr<void>(get<uintptr_t>(d, "workspace"));
    r.workspace_bytes = get<size_t>(d, "workspace_bytes");
    r.tokens = get<int>(d, "tokens");
    r.capacity = get<int>(d, "capacity");
    r.rank = get<int>(d, "rank");
    r.silent = get<bool>(d, "silent");
    const py::list recv = get<py::list>(d, "peer_recv"), comb = get<py::list>(d, "peer_comb"),
                   signals = get<py::list>(d, "peer_signals");
    const int peers = static_cast<int>(py::len(recv));
    if (peers > kMaxRanks || py::len(comb) != recv.size() || py::len(signals) != recv.size())
      throw std::invalid_argument("peer_recv/peer_comb/peer_signals: expected equal lists of at most 8 addresses");
    for (int q = 0; q < peers; ++q) {
      r.peer_recv[q] = as_ptr<void>(recv[q].cast<uintptr_t>());
      r.peer_comb[q] = as_ptr<void>(comb[q].cast<uintptr_t>());
      r.peer_signals[q] = as_ptr<uint32_t>(signals[q].cast<uintptr_t>());
    }
  }
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

py::dict layout(int tokens, int hidden, int ffn, int experts, int top_k, int dtype, int world_size, int stream_rows) {
  const WorkspaceLayout l =
      workspace_layout(tokens, hidden, ffn, experts, top_k, static_cast<DType>(dtype), world_size, stream_rows);
  py::dict out;
  out["error_word"] = l.error_word;
  out["status_flags"] = l.status_flags;
  out["phase_clock"] = l.phase_clock;
  out["phase_clock_slots"] = kPhaseClockSlots;
  out["traffic"] = l.traffic;
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
  m.def("forward", &forward,
        "Launch the fused MoE forward for the ranks in `ranks` (memset of sync words + one kernel).",
        py::arg("shared"), py::arg("ranks"), py::arg("stream"));
  m.def("workspace_layout", &layout, py::arg("tokens"), py::arg("hidden"), py::arg("ffn"), py::arg("experts"),
        py::arg("top_k"), py::arg("dtype"), py::arg("world_size") = 1, py::arg("stream_rows") = 0);
  m.def("check_shapes", &check_shapes, py::arg("tokens"), py::arg("hidden"), py::arg("ffn"), py::arg("experts"),
        py::arg("top_k"), py::arg("world_size") = 1);
  m.attr("max_ranks") = kMaxRanks;
  m.def("kernel_attributes", &attributes, py::arg("dtype"), py::arg("expert_variant") = 0);
  m.def("expert_variants", [] {
    py::list names;
    for (const std::string& name : expert_variant_names()) names.append(name);
    return names;
  }, "The expert variants' names in id order, as compiled (flashdmoe/expert_variants.py).");
}
