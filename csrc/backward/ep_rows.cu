// Host side of the backward's row exchange: argument checks, the sync layout and the cooperative launch.
#include <cstring>
#include <stdexcept>
#include <string>
#include "backward/ep_rows.cuh"
#include "backward/expert_grad.h"
#include "common/host_launch.h"
#include "generated/ep_rows_policy.h"  // written by the builder: EpStores, or EpPuts in the NVSHMEM build

namespace flashdmoe {
namespace {

// The sync bytes: the status block (error word, phase clock, traffic) first, as every launch's.
constexpr size_t kEpBarrierCounter = kStatusBytes;
constexpr size_t kEpExitCounter = kStatusBytes + 128;
constexpr size_t kEpSyncBytes = kStatusBytes + 256;

}  // namespace

size_t ep_rows_sync_bytes() { return kEpSyncBytes; }

int64_t ep_signal_words(int world, int local_experts, int stream_rows) {
  return EpSignalLayout{world, local_experts, stream_rows}.total_words();
}

int64_t ep_stage_bytes(int world, int stream_rows, int stage_rows, int64_t row_bytes) {
  return static_cast<int64_t>(EpStage{nullptr, stage_rows, world, stream_rows, static_cast<int>(row_bytes)}.bytes());
}

bool ep_rows_puts() { return EpRowsPolicy::kPuts; }

int64_t ep_signal_offset(const char* what, int world, int local_experts, int stream_rows, int a, int b) {
  const EpSignalLayout l{world, local_experts, stream_rows};
  if (!std::strcmp(what, "free")) return l.free_flag(static_cast<EpDirection>(a), b);
  if (!std::strcmp(what, "ready")) return l.ready_flag(static_cast<EpDirection>(a), b);
  if (!std::strcmp(what, "abort")) return l.abort_word(a);
  if (!std::strcmp(what, "sequence")) return l.sequence_word();
  if (!std::strcmp(what, "place")) return l.place(a, b);
  if (!std::strcmp(what, "row_word")) return l.row_word(a, b);
  throw std::invalid_argument(std::string("ep_signal_offset: unknown word '") + what + "'");
}

namespace {

// One rank's arguments checked and laid out as the kernel's parameters (all but its blocks).
void fill_params(const EpRowsArgs& a, EpRowsParams& p) {
  if (a.direction < 0 || a.direction >= kEpDirections) throw std::invalid_argument("ep_rows: direction must be 0, 1 or 2");
  if (a.world_size < 1 || a.world_size > kMaxRanks || a.rank < 0 || a.rank >= a.world_size)
    throw std::invalid_argument("ep_rows: rank " + std::to_string(a.rank) + " of " + std::to_string(a.world_size));
  if (static_cast<int>(a.peer_recv.size()) != a.world_size || static_cast<int>(a.peer_comb.size()) != a.world_size ||
      static_cast<int>(a.peer_signals.size()) != a.world_size)
    throw std::invalid_argument("ep_rows: expected one recv, comb and signals address per rank");
  const int64_t row_bytes = static_cast<int64_t>(a.hidden) * a.element_bytes;
  if (a.hidden <= 0 || row_bytes % 16) throw std::invalid_argument("ep_rows: H * element size must be a positive multiple of 16");
  if (a.local_experts < 1 || a.stream_rows < 0) throw std::invalid_argument("ep_rows: bad local_experts or stream_rows");
  if (a.sync == nullptr) throw std::invalid_argument("ep_rows: no sync words");
  if (a.direction == 0 && a.tokens > 0 &&
      (a.x == nullptr || a.dy == nullptr || a.expert == nullptr || a.row == nullptr || a.weight == nullptr ||
       a.top_k < 1 || a.top_k > 32))
    throw std::invalid_argument("ep_rows: the rows to the owners need x, dy, the routing and 1 <= k <= 32");
  if (a.direction == 0 && a.place == nullptr)
    throw std::invalid_argument("ep_rows: the rows to the owners need the owner's place table [P, L]");
  if (a.direction == 1 && a.rows > 0 && (a.received == nullptr || a.dweight_row == nullptr))
    throw std::invalid_argument("ep_rows: the gradients back need the received-row table and dweight");
  if (a.direction == 2 &&
      (a.n < 0 || a.n % 4 || (a.n > 0 && (a.share == nullptr || a.sum == nullptr)) ||
       a.n * 4 > static_cast<int64_t>(a.stream_rows) * row_bytes))
    throw std::invalid_argument("ep_rows: the sum takes n floats, a multiple of 4 that fits one comb region (n * 4 <= " +
                                std::to_string(static_cast<int64_t>(a.stream_rows) * row_bytes) + " bytes), got n=" +
                                std::to_string(a.n));

  p = EpRowsParams{};
  p.direction = static_cast<EpDirection>(a.direction);
  p.rank = a.rank, p.world_size = a.world_size, p.local_experts = a.local_experts, p.stream_rows = a.stream_rows;
  p.row_bytes = static_cast<int>(row_bytes);
  p.silent = a.silent;
  bool any_put = false;
  for (int q = 0; q < a.world_size; ++q) {
    if (a.peer_recv[q] == 0 || a.peer_comb[q] == 0 || a.peer_signals[q] == 0)
      throw std::invalid_argument("ep_rows: rank " + std::to_string(q) + " has no address in the peer table");
    const bool put = q != a.rank && a.peer_signals[q] == a.peer_signals[a.rank];
    if (put && !EpRowsPolicy::kPuts)
      throw std::invalid_argument("ep_rows: rank " + std::to_string(q) + " is reached by NVSHMEM puts, which this "
                                  "build cannot do (the NVSHMEM build's module can)");
    any_put |= put;
    p.peers[q] = {reinterpret_cast<void*>(a.peer_recv[q]), reinterpret_cast<void*>(a.peer_comb[q]),
                  reinterpret_cast<uint32_t*>(a.peer_signals[q])};
  }
  if (any_put) {
    if (a.stage == nullptr || a.stage_rows < 0)
      throw std::invalid_argument("ep_rows: a peer reached by NVSHMEM puts needs the stage buffer");
    if (a.direction == 0 && a.sent == nullptr)
      throw std::invalid_argument("ep_rows: the rows to an NVSHMEM owner need the sent table [2, P, L]");
    if (a.direction == 1 && a.from_rows == nullptr)
      throw std::invalid_argument("ep_rows: the gradients back to an NVSHMEM source need from_rows [P]");
  }
  p.stage = static_cast<char*>(a.stage);
  p.stage_rows = a.stage_rows;
  p.sent = a.sent;
  p.from_rows = a.from_rows;
  p.tokens = a.direction == 0 ? a.tokens : 0;
  p.top_k = a.top_k;
  p.x = a.x, p.dy = a.dy, p.topk_expert = a.expert, p.topk_row = a.row, p.topk_weight = a.weight;
  p.place = a.place;
  p.rows = a.direction == 1 ? a.rows : 0;
  p.received = a.received, p.dx_rows = a.dx_rows, p.dweight_row = a.dweight_row;
  p.n = a.direction == 2 ? a.n : 0;
  p.share = a.share, p.sum = a.sum;
  char* w = static_cast<char*>(a.sync);
  p.error_word = reinterpret_cast<unsigned long long*>(w + kStatusErrorWord);
  p.traffic = reinterpret_cast<unsigned long long*>(w + kStatusTraffic);
  p.barrier_counter = reinterpret_cast<uint32_t*>(w + kEpBarrierCounter);
  p.exit_counter = reinterpret_cast<uint32_t*>(w + kEpExitCounter);
  p.sync_words = reinterpret_cast<uint32_t*>(w);
  p.sync_words_count = static_cast<int>(kEpSyncBytes / 4);
  p.status_host = a.status_host;
  p.team_words = static_cast<TeamRankWords*>(a.team_words);
  p.timeout_ns = a.timeout_ns;
  p.debug_withhold_phase = a.debug_withhold_phase;
}

// Blocks a rank's work wants: no more than its items (a warp each), so that small batches do not wake the
// whole GPU.
int64_t wanted_blocks(const EpRowsArgs& a) {
  return a.direction == 2 ? std::max<int64_t>(1, (a.n / 4 + kEpRowsThreads - 1) / kEpRowsThreads)
                          : std::max<int64_t>(1, ((a.direction == 0 ? a.tokens : a.rows) + kEpRowsThreads / 32 - 1) /
                                                     (kEpRowsThreads / 32));
}

template <int kRankCapacity>
LaunchInfo launch_ranks(const std::vector<EpRowsArgs>& ranks, cudaStream_t stream) {
  const int count = static_cast<int>(ranks.size());
  EpRowsLaunch<kRankCapacity> launch{};
  int64_t wanted = 1;
  for (int i = 0; i < count; ++i) {
    fill_params(ranks[i], launch.rank[i]);
    wanted = std::max(wanted, wanted_blocks(ranks[i]));
  }
  const auto kernel = ep_rows_kernel<EpRowsPolicy, kRankCapacity>;
  int device = 0;
  throw_on_cuda_error(cudaGetDevice(&device), "cudaGetDevice");
  const ResidentGrid resident = resident_grid(reinterpret_cast<const void*>(kernel), device, 0, kEpRowsThreads);
  int grid = resident.blocks_per_sm * resident.sms;
  const int percent = ranks[0].grid_percent;
  if (percent > 0 && percent < 100) grid = std::max(1, grid * percent / 100);
  // Each rank an equal share of the resident grid, all of them resident at once (their flags are waited
  // for within the launch).
  int per_rank = std::max(1, grid / count);
  if (wanted < per_rank) per_rank = static_cast<int>(wanted);
  for (int i = 0; i < count; ++i) {
    launch.rank[i].first_block = i * per_rank;
    launch.rank[i].blocks = per_rank;
  }
  launch_cooperative(kernel, per_rank * count, kEpRowsThreads, 0, stream, launch, "launching ep_rows_kernel");
  return {per_rank * count, resident.blocks_per_sm, 0};
}

}  // namespace

LaunchInfo launch_ep_rows(const std::vector<EpRowsArgs>& ranks, cudaStream_t stream) {
  const int count = static_cast<int>(ranks.size());
  if (count < 1 || count > kMaxRanks)
    throw std::invalid_argument("ep_rows: expected 1.." + std::to_string(kMaxRanks) + " ranks per launch, got " +
                                std::to_string(count));
  if (count > 1) {
    // Every rank of one team in one launch (an emulated team): the same direction and team,
    // ranks in order, every peer a load/store pointer (the ranks wait for each other inside the launch).
    for (int i = 0; i < count; ++i) {
      const EpRowsArgs& a = ranks[i];
      if (a.rank != i || a.world_size != count || a.direction != ranks[0].direction)
        throw std::invalid_argument("ep_rows: a launch of several ranks takes every rank of the team in order, one "
                                    "direction (rank " + std::to_string(i) + " is rank " +
                                    std::to_string(a.rank) + " of " + std::to_string(a.world_size) + ")");
      if (a.stage != nullptr)
        throw std::invalid_argument("ep_rows: a launch of several ranks has no NVSHMEM peers (no stage buffer)");
    }
    return launch_ranks<kMaxRanks>(ranks, stream);
  }
  return launch_ranks<1>(ranks, stream);
}

}  // namespace flashdmoe
