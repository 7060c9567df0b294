// pybind11 entry point: raw device pointers, shapes and the stream handle in; no libtorch linkage, so
// the module works with any torch build. Tensor checks live in flashdmoe/cuda_backend.py.
//
// A forward is two calls: `prepare_forward` parses the launch's options once per (shapes, options,
// team) into a PreparedForward the Python side caches; `launch` then takes only the per-call addresses,
// the sequence number and the stream, so a forward parses no dicts.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <cstdint>
#include <memory>
#include <vector>
#include <cstring>
#include <stdexcept>
#include "backward/expert_grad.h"
#include "common/native_launch.h"
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

// Runs `launch` (returning LaunchInfo) without the GIL; nothing waits. The kernel's last block marks the
// pinned status slot complete (kStatusDone), so no event is recorded behind it. Returns (grid, blocks
// per SM, shared memory bytes per block).
template <typename Launch>
py::tuple launch_released(Launch&& launch) {
  LaunchInfo info;
  {
    py::gil_scoped_release release;
    info = launch();
  }
  return py::make_tuple(info.grid, info.blocks_per_sm, info.smem_bytes);
}

// A launch's options, checked and laid out once (moe/launch.h PreparedLaunch): a forward passes only
// the per-call addresses (CallAddress order after the router), the sequence number and the stream.
using PreparedForward = PreparedLaunch;

// shared: the launch's common options; ranks: one dict per rank in the launch (tokens, capacity, rank,
// silent, workspace_bytes, peer_recv / peer_comb / peer_signals, and a team rank's team_words).
std::unique_ptr<PreparedForward> prepare_forward(const py::dict& shared, const py::list& ranks) {
  auto prepared = std::make_unique<PreparedForward>();
  ForwardArgs& a = prepared->args;
  a.hidden = get<int>(shared, "hidden");
  a.ffn = get<int>(shared, "ffn");
  a.experts = get<int>(shared, "experts");
  a.top_k = get<int>(shared, "top_k");
  a.world_size = get<int>(shared, "world_size");
  a.stream_rows = get<int>(shared, "stream_rows");
  a.dtype = static_cast<DType>(get<int>(shared, "dtype"));
  a.activation = static_cast<Activation>(get<int>(shared, "activation"));
  a.normalize_topk = get<bool>(shared, "normalize_topk");
  a.timeout_ns = get<uint64_t>(shared, "timeout_ns");
  a.debug_withhold_phase = get<int>(shared, "debug_withhold_phase");
  a.expert_variant = get<int>(shared, "expert_variant");
  a.max_blocks = get<int>(shared, "max_blocks");
  a.gate_split = get<bool>(shared, "gate_split");
  a.small_tile_epilogue = shared.contains("small_tile_epilogue") ? get<bool>(shared, "small_tile_epilogue") : true;
  a.grid_percent = get<int>(shared, "grid_percent");
  a.num_ranks = static_cast<int>(py::len(ranks));
  if (a.num_ranks < 1 || a.num_ranks > kMaxRanks)
    throw std::invalid_argument("ranks: expected 1.." + std::to_string(kMaxRanks) + " rank dicts");
  for (int i = 0; i < a.num_ranks; ++i) {
    const py::dict d = ranks[i].cast<py::dict>();
    RankArgs& r = a.ranks[i];
    r.workspace_bytes = get<size_t>(d, "workspace_bytes");
    r.tokens = get<int>(d, "tokens");
    r.capacity = get<int>(d, "capacity");
    r.rank = get<int>(d, "rank");
    r.silent = get<bool>(d, "silent");
    r.team_words = d.contains("team_words") ? as_ptr<TeamRankWords>(get<uintptr_t>(d, "team_words")) : nullptr;
    r.relay = RelayParams{};
    if (d.contains("relay")) {  // the hierarchical exchange: {ranks_per_node, max_rows, batch_bytes, rows_offset, buffer}
      const py::dict relay = d["relay"].cast<py::dict>();
      r.relay.ranks_per_node = get<int>(relay, "ranks_per_node");
      r.relay.max_rows = get<int>(relay, "max_rows");
      r.relay.batch_bytes = get<size_t>(relay, "batch_bytes");
      r.relay.rows_offset = get<size_t>(relay, "rows_offset");
      r.relay.buffer = as_ptr<char>(get<uintptr_t>(relay, "buffer"));
    }
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
  prepare_launch(*prepared);
  return prepared;
}

// One forward: launch the kernel, which writes every rank's status block into `status_host` (pinned
// memory; 0: nowhere) and then its completion word as it exits; nothing waits. One CUDA call. Returns
// (grid, blocks per SM, shared memory bytes per block).
py::tuple launch(PreparedForward& prepared, const std::vector<uintptr_t>& addresses, uint32_t sequence,
                 uintptr_t stream, uintptr_t status_host) {
  const int num_ranks = prepared.args.num_ranks;
  if (addresses.size() != static_cast<size_t>(1 + kAddressesPerRank * num_ranks))
    throw std::invalid_argument("addresses: expected the router and " + std::to_string(kAddressesPerRank) +
                                " addresses per rank for " + std::to_string(num_ranks) + " ranks, got " +
                                std::to_string(addresses.size()));
  const auto cuda_stream = reinterpret_cast<cudaStream_t>(stream);
  return launch_released(
      [&] { return launch_prepared(prepared, addresses.data(), sequence, as_ptr<void>(status_host), cuda_stream); });
}

// The host launch queue's entry (common/native_launch.h): `launch` without pybind11 in between and
// with the GIL held (the queue's state is guarded by it); exceptions become a code and a message.
int native_forward(void* prepared, const uintptr_t* addresses, size_t address_count, uint32_t sequence,
                   uintptr_t stream, uintptr_t status_host, int* info, char* error, size_t error_bytes) {
  auto fail = [&](int code, const char* message) {
    std::strncpy(error, message, error_bytes - 1);
    error[error_bytes - 1] = '\0';
    return code;
  };
  try {
    auto& p = *static_cast<PreparedForward*>(prepared);
    if (address_count != static_cast<size_t>(1 + kAddressesPerRank * p.args.num_ranks))
      return fail(kNativeLaunchInvalidArgument, "addresses: wrong count for the prepared launch");
    const LaunchInfo launched = launch_prepared(p, addresses, sequence, as_ptr<void>(status_host),
                                                reinterpret_cast<cudaStream_t>(stream));
    info[0] = launched.grid;
    info[1] = launched.blocks_per_sm;
    info[2] = launched.smem_bytes;
    return kNativeLaunchOk;
  } catch (const std::invalid_argument& e) {
    return fail(kNativeLaunchInvalidArgument, e.what());
  } catch (const std::exception& e) {
    return fail(kNativeLaunchError, e.what());
  } catch (...) {  // nothing may cross the C boundary
    return fail(kNativeLaunchError, "the launch failed with an exception that is not a std::exception");
  }
}

int native_capturing(uintptr_t stream) {
  cudaStreamCaptureStatus status;
  if (cudaStreamIsCapturing(reinterpret_cast<cudaStream_t>(stream), &status) != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky: cleared so that the next CUDA call does not report it
    return -1;
  }
  return status == cudaStreamCaptureStatusNone ? 0 : 1;
}

const NativeForwardEntry kNativeForward{&native_forward, &native_capturing};

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

// Byte offsets inside one rank's status block (params.cuh).
py::dict status_layout() {
  py::dict out;
  out["bytes"] = kStatusBytes;
  out["error_word"] = kStatusErrorWord;
  out["phase_clock"] = kStatusPhaseClock;
  out["phase_clock_slots"] = kPhaseClockSlots;
  out["traffic"] = kStatusTraffic;
  out["nvshmem_traffic"] = kStatusNvshmemTraffic;
  out["status_flags"] = kStatusFlags;
  out["done_word"] = kStatusDone;
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

void activation_grad(int dtype, int activation, uintptr_t pre, uintptr_t g, uintptr_t weight, uintptr_t hw,
                     uintptr_t dpre, uintptr_t dweight, int64_t rows, int ffn, uintptr_t stream, uintptr_t live_rows) {
  launch_activation_grad(static_cast<DType>(dtype), static_cast<Activation>(activation), as_ptr<const void>(pre),
                         as_ptr<const void>(g), as_ptr<const float>(weight), as_ptr<void>(hw), as_ptr<void>(dpre),
                         as_ptr<float>(dweight), rows, ffn, as_ptr<const int>(live_rows),
                         reinterpret_cast<cudaStream_t>(stream));
}

void combine_grad(int dtype, uintptr_t dx_rows, uintptr_t row, uintptr_t extra, uintptr_t dx, int64_t tokens, int top_k,
                  int hidden, uintptr_t stream) {
  launch_combine_grad(static_cast<DType>(dtype), as_ptr<const void>(dx_rows), as_ptr<const int>(row),
                      as_ptr<const float>(extra), as_ptr<void>(dx), tokens, top_k, hidden,
                      reinterpret_cast<cudaStream_t>(stream));
}

void backward_rows(uintptr_t expert, uintptr_t row, uintptr_t weight, int64_t choices, int top_k, int experts,
                   uintptr_t token_of_row, uintptr_t w_row, uintptr_t row_of_choice, uintptr_t expert_end,
                   uintptr_t stream) {
  launch_backward_rows(as_ptr<const int>(expert), as_ptr<const int>(row), as_ptr<const float>(weight), choices, top_k,
                       experts, as_ptr<int64_t>(token_of_row), as_ptr<float>(w_row), as_ptr<int>(row_of_choice),
                       as_ptr<int>(expert_end), reinterpret_cast<cudaStream_t>(stream));
}

void router_grad(int dtype, uintptr_t logits, uintptr_t expert, uintptr_t row_of_choice, uintptr_t dweight_row,
                 uintptr_t dlogits, int64_t tokens, int top_k, int experts, bool normalize_topk, uintptr_t stream) {
  launch_router_grad(static_cast<DType>(dtype), as_ptr<const float>(logits), as_ptr<const int>(expert),
                     as_ptr<const int>(row_of_choice), as_ptr<const float>(dweight_row), as_ptr<void>(dlogits), tokens,
                     top_k, experts, normalize_topk, reinterpret_cast<cudaStream_t>(stream));
}

// The fused expert backward (backward/expert_grad.h FusedBackwardArgs): `args` names every field
// (pointers as integers, 0 for null); its status slot is `status_host`, like a forward's.
py::tuple fused_backward(const py::dict& args, uintptr_t stream) {
  FusedBackwardArgs a{};
  a.dtype = static_cast<DType>(get<int>(args, "dtype"));
  a.activation = static_cast<Activation>(get<int>(args, "activation"));
  a.tokens = get<int>(args, "tokens");
  a.hidden = get<int>(args, "hidden");
  a.ffn = get<int>(args, "ffn");
  a.experts = get<int>(args, "experts");
  a.top_k = get<int>(args, "top_k");
  a.need_dx = get<bool>(args, "need_dx");
  a.need_dw1 = get<bool>(args, "need_dw1");
  a.need_dw2 = get<bool>(args, "need_dw2");
  a.x = as_ptr<const void>(get<uintptr_t>(args, "x"));
  a.dy = as_ptr<const void>(get<uintptr_t>(args, "dy"));
  a.w1 = as_ptr<const void>(get<uintptr_t>(args, "w1"));
  a.w2 = as_ptr<const void>(get<uintptr_t>(args, "w2"));
  a.pre = as_ptr<const void>(get<uintptr_t>(args, "pre"));
  a.expert = as_ptr<const int>(get<uintptr_t>(args, "expert"));
  a.row = as_ptr<const int>(get<uintptr_t>(args, "row"));
  a.weight = as_ptr<const float>(get<uintptr_t>(args, "weight"));
  a.dw1 = as_ptr<void>(get<uintptr_t>(args, "dw1"));
  a.dw2 = as_ptr<void>(get<uintptr_t>(args, "dw2"));
  a.dx_rows = as_ptr<void>(get<uintptr_t>(args, "dx_rows"));
  a.dweight_row = as_ptr<float>(get<uintptr_t>(args, "dweight_row"));
  a.sync = as_ptr<void>(get<uintptr_t>(args, "sync"));
  a.scratch = as_ptr<void>(get<uintptr_t>(args, "scratch"));
  a.status_host = as_ptr<void>(get<uintptr_t>(args, "status_host"));
  a.timeout_ns = get<uint64_t>(args, "timeout_ns");
  a.debug_withhold_phase = get<int>(args, "debug_withhold_phase");
  a.max_blocks = get<int>(args, "max_blocks");
  const auto cuda_stream = reinterpret_cast<cudaStream_t>(stream);
  return launch_released([&] { return launch_fused_backward(a, cuda_stream); });
}

py::dict fused_backward_layout_dict(int tokens, int hidden, int ffn, int experts, int top_k, int activation) {
  const FusedBackwardLayout l =
      fused_backward_layout(tokens, hidden, ffn, experts, top_k, static_cast<Activation>(activation));
  py::dict out;
  out["sync_bytes"] = l.sync_bytes;
  out["scratch_bytes"] = l.scratch_bytes;
  out["row_of_choice_offset"] = l.row_of_choice_offset;
  out["padded_rows"] = l.padded_rows;
  return out;
}

// One rank's arguments of the backward's row exchange (backward/expert_grad.h EpRowsArgs), `args` naming
// every field (pointers as integers, 0 for null).
EpRowsArgs ep_rows_args(const py::dict& args) {
  EpRowsArgs a{};
  a.direction = get<int>(args, "direction");
  a.rank = get<int>(args, "rank");
  a.world_size = get<int>(args, "world_size");
  a.local_experts = get<int>(args, "local_experts");
  a.stream_rows = get<int>(args, "stream_rows");
  a.hidden = get<int>(args, "hidden");
  a.element_bytes = get<int>(args, "element_bytes");
  a.silent = get<bool>(args, "silent");
  a.peer_recv = get<std::vector<uintptr_t>>(args, "peer_recv");
  a.peer_comb = get<std::vector<uintptr_t>>(args, "peer_comb");
  a.peer_signals = get<std::vector<uintptr_t>>(args, "peer_signals");
  a.stage = as_ptr<void>(args.contains("stage") ? get<uintptr_t>(args, "stage") : 0);
  a.stage_rows = args.contains("stage_rows") ? get<int>(args, "stage_rows") : 0;
  a.sent = as_ptr<const int>(args.contains("sent") ? get<uintptr_t>(args, "sent") : 0);
  a.from_rows = as_ptr<const int>(args.contains("from_rows") ? get<uintptr_t>(args, "from_rows") : 0);
  a.tokens = get<int>(args, "tokens");
  a.top_k = get<int>(args, "top_k");
  a.x = as_ptr<const void>(get<uintptr_t>(args, "x"));
  a.dy = as_ptr<const void>(get<uintptr_t>(args, "dy"));
  a.expert = as_ptr<const int>(get<uintptr_t>(args, "expert"));
  a.row = as_ptr<const int>(get<uintptr_t>(args, "row"));
  a.weight = as_ptr<const float>(get<uintptr_t>(args, "weight"));
  a.place = as_ptr<const int>(get<uintptr_t>(args, "place"));
  a.rows = get<int>(args, "rows");
  a.received = as_ptr<const int>(get<uintptr_t>(args, "received"));
  a.dx_rows = as_ptr<const void>(get<uintptr_t>(args, "dx_rows"));
  a.dweight_row = as_ptr<const float>(get<uintptr_t>(args, "dweight_row"));
  a.n = args.contains("n") ? get<int64_t>(args, "n") : 0;
  a.share = as_ptr<const float>(args.contains("share") ? get<uintptr_t>(args, "share") : 0);
  a.sum = as_ptr<float>(args.contains("sum") ? get<uintptr_t>(args, "sum") : 0);
  a.sync = as_ptr<void>(get<uintptr_t>(args, "sync"));
  a.status_host = as_ptr<void>(get<uintptr_t>(args, "status_host"));
  a.team_words = as_ptr<void>(args.contains("team_words") ? get<uintptr_t>(args, "team_words") : 0);
  a.timeout_ns = get<uint64_t>(args, "timeout_ns");
  a.debug_withhold_phase = get<int>(args, "debug_withhold_phase");
  a.grid_percent = get<int>(args, "grid_percent");
  return a;
}

// The exchange for one rank (`args` a dict) or for every rank of an emulated team in one launch (a list of
// dicts, rank order); each rank's status slot is its `status_host`.
py::tuple ep_rows(const py::object& args, uintptr_t stream) {
  std::vector<EpRowsArgs> ranks;
  if (py::isinstance<py::dict>(args)) {
    ranks.push_back(ep_rows_args(args.cast<py::dict>()));
  } else {
    for (const py::handle item : args.cast<py::list>()) ranks.push_back(ep_rows_args(item.cast<py::dict>()));
  }
  const auto cuda_stream = reinterpret_cast<cudaStream_t>(stream);
  return launch_released([&] { return launch_ep_rows(ranks, cuda_stream); });
}

}  // namespace

PYBIND11_MODULE(flashdmoe_cuda, m) {
  m.doc() = "FlashDMoE fused persistent MoE kernel (raw-pointer bindings)";
  py::class_<PreparedForward>(m, "PreparedForward",
                              "A launch's options parsed once (shapes, dtype, knobs, peer tables); see launch().")
      .def_property_readonly("num_ranks", [](const PreparedForward& p) { return p.args.num_ranks; })
      .def_property_readonly("address", [](PreparedForward& p) { return reinterpret_cast<uintptr_t>(&p); },
                             "The object's address, for the native forward entry (alive while this object is).")
      .def_property_readonly(
          "splits",
          [](PreparedForward& p) {
            // What the first launch chose from the grid (moe/launch_template.cuh), per rank; empty before it.
            std::lock_guard<std::mutex> lock(p.mutex);
            py::list out;
            if (p.grid.kernel == nullptr) return out;
            for (int i = 0; i < p.args.num_ranks; ++i) {
              py::dict rank;
              rank["blocks"] = p.ranks[i].params.blocks;
              rank["gate_splits"] = p.ranks[i].params.gate_splits;
              out.append(rank);
            }
            return out;
          },
          "Per rank, the blocks and the gate's K ranges per tile the launches run with (empty before the first "
          "launch, which chooses them from the grid).");
  m.attr("native_forward") =
      py::capsule(static_cast<const void*>(&kNativeForward), kNativeForwardCapsule);
  m.def("prepare_forward", &prepare_forward,
        "Parse and check a launch's options once: shape rules, workspace layout, peer tables (no CUDA call).", py::arg("shared"),
        py::arg("ranks"));
  m.def("launch", &launch,
        "Launch the fused forward (the workspaces' sync words must be zero: zeroed once at allocation, then "
        "reset by each launch's exit), whose last block writes the status blocks into `status_host` (pinned; "
        "0: nowhere) and then each block's completion word, asynchronously on `stream`. Returns (grid, "
        "blocks_per_sm, smem_bytes).",
        py::arg("prepared"), py::arg("addresses"), py::arg("sequence"), py::arg("stream"), py::arg("status_host"));
  m.def("activation_grad", &activation_grad,
        "Backward between the row GEMMs (backward/expert_grad.h): per packed row dweight = <g, act(pre)>, "
        "hw = w act(pre), dpre = w g act'(pre); asynchronous on `stream`. live_rows: an int32 on the device, "
        "rows at or past it left alone (0: every row).",
        py::arg("dtype"), py::arg("activation"), py::arg("pre"), py::arg("g"), py::arg("weight"), py::arg("hw"),
        py::arg("dpre"), py::arg("dweight"), py::arg("rows"), py::arg("ffn"), py::arg("stream"),
        py::arg("live_rows") = 0);
  m.def("combine_grad", &combine_grad,
        "dx[t] = sum of the token's kept dx rows in choice order + extra[t] (float32, 0: none), rounded to dtype; "
        "asynchronous on `stream`.",
        py::arg("dtype"), py::arg("dx_rows"), py::arg("row"), py::arg("extra"), py::arg("dx"), py::arg("tokens"),
        py::arg("top_k"), py::arg("hidden"), py::arg("stream"));
  m.def("backward_rows", &backward_rows,
        "The backward's packed row table from the forward's routing (backward/expert_grad.h); asynchronous.",
        py::arg("expert"), py::arg("row"), py::arg("weight"), py::arg("choices"), py::arg("top_k"),
        py::arg("experts"), py::arg("token_of_row"), py::arg("w_row"), py::arg("row_of_choice"),
        py::arg("expert_end"), py::arg("stream"));
  m.def("router_grad", &router_grad,
        "The router's logit gradient through the top-k renormalisation and the softmax, one warp per token "
        "(backward/expert_grad.h); asynchronous.",
        py::arg("dtype"), py::arg("logits"), py::arg("expert"), py::arg("row_of_choice"), py::arg("dweight_row"),
        py::arg("dlogits"), py::arg("tokens"), py::arg("top_k"), py::arg("experts"), py::arg("normalize_topk"),
        py::arg("stream"));
  m.def("fused_backward", &fused_backward,
        "The fused expert backward of one rank (backward/expert_grad.h), one cooperative launch on `stream`. "
        "`args`: a dict of FusedBackwardArgs' fields. Returns (grid, blocks_per_sm, smem_bytes).",
        py::arg("args"), py::arg("stream"));
  m.def("ep_rows", &ep_rows,
        "The backward's row exchange: one rank (a dict) or every rank of an emulated team (a list of dicts, rank "
        "order) in one cooperative launch on `stream`; returns "
        "(grid, blocks_per_sm, smem_bytes).",
        py::arg("args"), py::arg("stream"));
  m.def("ep_rows_sync_bytes", &ep_rows_sync_bytes);
  m.def("ep_signal_words", &ep_signal_words, py::arg("world"), py::arg("local_experts"), py::arg("stream_rows"));
  m.def("ep_stage_bytes", &ep_stage_bytes, "Bytes of a rank's staging for NVSHMEM peers in the backward exchange.",
        py::arg("world"), py::arg("stream_rows"), py::arg("stage_rows"), py::arg("row_bytes"));
  m.def("ep_rows_puts", &ep_rows_puts, "Whether this build's backward exchange reaches peers by NVSHMEM puts.");
  m.def("ep_signal_offset", [](const std::string& what, int world, int local_experts, int stream_rows, int a, int b) {
    return ep_signal_offset(what.c_str(), world, local_experts, stream_rows, a, b);
  }, py::arg("what"), py::arg("world"), py::arg("local_experts"), py::arg("stream_rows"), py::arg("a"), py::arg("b"));
  m.def("fused_backward_layout", &fused_backward_layout_dict,
        "Sync and scratch bytes of a fused backward (sync_bytes, scratch_bytes, row_of_choice_offset, padded_rows); "
        "ValueError when the shapes are not supported.",
        py::arg("tokens"), py::arg("hidden"), py::arg("ffn"), py::arg("experts"), py::arg("top_k"),
        py::arg("activation"));
  m.def("fused_backward_unsupported", &fused_backward_unsupported,
        "Empty when the fused backward takes these shapes, else why not.", py::arg("tokens"), py::arg("hidden"),
        py::arg("ffn"), py::arg("experts"), py::arg("top_k"));
  m.attr("addresses_per_rank") = static_cast<int>(kAddressesPerRank);
  m.def("workspace_layout", &layout, py::arg("tokens"), py::arg("hidden"), py::arg("ffn"), py::arg("experts"),
        py::arg("top_k"), py::arg("dtype"), py::arg("world_size") = 1, py::arg("stream_rows") = 0);
  m.def("status_layout", &status_layout);
  m.def("check_shapes", &check_shapes, py::arg("tokens"), py::arg("hidden"), py::arg("ffn"), py::arg("experts"),
        py::arg("top_k"), py::arg("world_size") = 1);
  m.attr("max_ranks") = kMaxRanks;
  m.def("kernel_attributes", &attributes, py::arg("dtype"), py::arg("expert_variant") = 0);
  m.def("expert_variants", [] {
    py::list names;
    for (const std::string& name : expert_variant_names()) names.append(name);
    return names;
  }, "The expert variants' names in id order, as compiled (flashdmoe/kernel/expert_variants.py).");
}
