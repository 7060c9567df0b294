// The eager one-rank forward's host path in C++ (flashdmoe/kernel/host_queue.py).
//
// A forward that has nothing to report (no unchecked launch with an error, a status slot free, its
// workspace ready) is launched here from one Python call: finished launches are retired oldest first,
// the outputs allocated, the kernel launched and the launch queued, with no Python object made per
// launch. Anything else (an error to raise, a wait, a workspace to grow or zero, teams, captures, debug
// modes) is left to the Python path (flashdmoe/kernel/status_checks.py), which first takes over the
// launches queued here (`take`) so that one queue, oldest first, decides when an error surfaces.
//
// Links libtorch (it allocates the outputs) but not CUDA: the launch goes through the kernel module's
// C entry (common/native_launch.h) or, for the CPU stand-in, a Python callable. Every method runs with
// the GIL held, which guards this module's state as it guards status_checks' (the C entry's launch alone
// runs without it, on a slot the launch already owns).
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/utils/pybind.h>  // Python.h first: pythread.h and pybind11 after it
#include <pybind11/stl.h>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <deque>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>
#include "common/native_launch.h"

namespace flashdmoe {

namespace py = pybind11;

// Addresses of a one-rank launch, in the order `launch` takes them (csrc/moe/launch.h CallAddress).
inline constexpr int kOneRankAddresses = 12;

// WorkspaceTable::claim's answers.
enum Need : int { kReady = 0, kGrow = 1, kZero = 2 };

// What the pooled workspaces hold (flashdmoe/kernel/workspace_pool.py keeps the buffers): per (device,
// stream) the buffer's address and size and which sync words are known zero: all of them (a new
// buffer) or those of the last launch's (stride, sync bytes, ranks), which its exit reset.
class WorkspaceTable {
 public:
  struct Entry {
    int64_t device;
    uintptr_t stream;
    uintptr_t address;
    int64_t bytes;
    bool all_zero;
    int64_t stride, sync_bytes, ranks;
  };

  void set(int64_t device, uintptr_t stream, uintptr_t address, int64_t bytes) {
    Entry* e = find(device, stream);
    if (e == nullptr) {
      entries_.push_back({device, stream, 0, 0, true, 0, 0, 0});
      e = &entries_.back();
    }
    *e = {device, stream, address, bytes, true, 0, 0, 0};
  }

  // (address, need): kGrow leaves the entry as it is; kReady and kZero record this launch's sync words
  // as what its exit leaves zero (kZero: once the caller has zeroed them). `commit_zero` false: a kZero
  // answer records nothing either (the caller will not zero them).
  std::pair<uintptr_t, int> claim(int64_t device, uintptr_t stream, int64_t stride, int64_t sync_bytes, int64_t ranks,
                                  bool commit_zero = true) {
    Entry* e = find(device, stream);
    if (e == nullptr || e->bytes < stride * ranks) return {0, kGrow};
    // One rank's sync words start the buffer whatever the stride: any earlier launch's first share covers them.
    const bool zero = e->all_zero || ((ranks == 1 || e->stride == stride) && e->sync_bytes >= sync_bytes &&
                                      e->ranks >= ranks);
    if (!zero && !commit_zero) return {e->address, kZero};
    e->all_zero = false;
    e->stride = stride;
    e->sync_bytes = sync_bytes;
    e->ranks = ranks;
    return {e->address, zero ? kReady : kZero};
  }

  void clear() { entries_.clear(); }

 private:
  Entry* find(int64_t device, uintptr_t stream) {
    for (Entry& e : entries_)
      if (e.device == device && e.stream == stream) return &e;
    return nullptr;
  }
  std::vector<Entry> entries_;  // a few (device, stream) pairs: a scan beats hashing
};

// One prepared one-rank launch (a cuda_backend._Plan's): how to launch it and what it needs per call.
struct NativePlan {
  const NativeForwardEntry* entry = nullptr;  // the kernel module's, or null: call `python_launch`
  void* prepared = nullptr;                   // the PreparedForward (kept alive by `prepared_object`)
  py::object prepared_object;
  py::object python_launch;
  py::object python_stream;  // with python_launch: the current stream, or None while a graph is captured
  py::object workspace_owner;  // keeps `workspaces` alive
  WorkspaceTable* workspaces = nullptr;
  int64_t routing_words = 0, routing_stride = 0, stride = 0, sync_bytes = 0;
};

// The status block's byte offsets (csrc/moe/params.cuh) and slot geometry.
struct Layout {
  int64_t block_bytes, done_word, error_word, status_flags, slot_bytes;
};

struct Pending {
  uint64_t id;
  int64_t device;
  int slot;
  py::object plan;  // the Python plan (its shape and routing factory make the report)
  at::Tensor block;
  int info[3];
  uint64_t thread;  // the launching thread's serial (status_checks._thread_serial; idents are reused)
};

// A thread's latest launch made here, kept until the Python side asks for it (last_report), takes it,
// or forgets the thread (when its thread-local state is released).
struct Last {
  uint64_t id = 0;
  bool retired = false;  // checked clean here; `raw` holds its status block
  std::string raw;
  int64_t device = 0;
  py::object plan;
  at::Tensor block;
  int info[3] = {0, 0, 0};
};

// Methods that make or release Python objects may run Python code (a destructor, an allocation's
// garbage collection), and so let another thread in: none holds a reference into a container across
// such a point, and a launch holds the slot it claimed, not a pointer to its device's entry.
class LaunchQueue {
 public:
  LaunchQueue(int64_t block_bytes, int64_t done_word, int64_t error_word, int64_t status_flags, int64_t slot_ranks)
      : layout_{block_bytes, done_word, error_word, status_flags, block_bytes * slot_ranks} {}

  // A device's eager status slots: `count` slots of slot_bytes at `base` (pinned), all free. Replaces
  // an earlier registration of the device (whose memory is gone).
  void add_device(int64_t device, uintptr_t base, int count) {
    Slots slots{device, reinterpret_cast<uint8_t*>(base), {}};
    for (int i = count - 1; i >= 0; --i) slots.free.push_back(i);  // back(): the lowest address first
    for (Slots& s : devices_)
      if (s.device == device) {
        s = std::move(slots);
        return;
      }
    devices_.push_back(std::move(slots));
  }

  // A free slot's index, or -1.
  int claim(int64_t device) {
    Slots& s = slots(device);
    if (s.free.empty()) return -1;
    const int index = s.free.back();
    s.free.pop_back();
    return index;
  }

  // Hand a slot back: clear its completion words (nothing writes them until its next launch).
  void release(int64_t device, int index) {
    Slots& s = slots(device);
    uint8_t* slot = s.base + index * layout_.slot_bytes;
    for (int64_t at = layout_.done_word; at < layout_.slot_bytes; at += layout_.block_bytes)
      reinterpret_cast<std::atomic<uint32_t>*>(slot + at)->store(0, std::memory_order_relaxed);
    s.free.push_back(index);
  }

  int free_slots(int64_t device) { return static_cast<int>(slots(device).free.size()); }
  int next_free(int64_t device) {
    Slots& s = slots(device);
    return s.free.empty() ? -1 : s.free.back();
  }

  uint64_t next_id() { return next_id_++; }
  size_t kept_threads() const { return last_.size(); }
  size_t outstanding() const { return pending_.size(); }

  // Retire finished clean launches, oldest first, up to the first still running. True when it stopped
  // at a finished launch with an error (the Python path takes the queue over and raises it).
  bool retire_finished() {
    while (!pending_.empty()) {
      const uint8_t* status = slot_address(pending_.front());
      if (!done(status)) return false;
      if (!clean(status)) return true;
      retire(pending_.front());
      // Moved out before the pop: releasing its plan may run Python code.
      const Pending finished = std::move(pending_.front());
      pending_.pop_front();
    }
    return false;
  }

  // The eager one-rank forward on x's device, which must be the current one, and that device's current
  // stream, or None where the Python path must run it (see the file comment; also another current
  // device, or a stream capturing a graph). `thread`: the calling thread's serial.
  py::object launch(const NativePlan& p, py::object plan, const at::Tensor& x, const at::Tensor& router,
                    const at::Tensor& w1, const at::Tensor& w2, const std::optional<at::Tensor>& saved_pre,
                    uint64_t thread) {
    int64_t device;
    uintptr_t stream;
    if (!current_stream(p, x, device, stream)) return py::none();
    if (retire_finished()) return py::none();  // its error is raised by the Python path
    Slots* s = find_slots(device);
    if (s == nullptr || s->free.empty()) return py::none();
    const auto [workspace, need] = p.workspaces->claim(device, stream, p.stride, p.sync_bytes, 1, false);
    if (need != kReady) return py::none();
    const int slot = s->free.back();
    s->free.pop_back();
    const auto status = reinterpret_cast<uintptr_t>(s->base + slot * layout_.slot_bytes);
    s = nullptr;  // what follows may let another thread in
    at::Tensor y, block;
    int info[3] = {0, 0, 0};
    try {
      y = at::empty(x.sizes(), x.options());  // x is contiguous (checked by the caller)
      block = at::empty({p.routing_words}, x.options().dtype(at::kInt));
      const auto base = reinterpret_cast<uintptr_t>(block.data_ptr());
      const uintptr_t addresses[kOneRankAddresses] = {
          reinterpret_cast<uintptr_t>(router.data_ptr()), reinterpret_cast<uintptr_t>(x.data_ptr()),
          reinterpret_cast<uintptr_t>(w1.data_ptr()), reinterpret_cast<uintptr_t>(w2.data_ptr()),
          reinterpret_cast<uintptr_t>(y.data_ptr()), base, base + p.routing_stride, base + 2 * p.routing_stride,
          base + 3 * p.routing_stride, saved_pre ? reinterpret_cast<uintptr_t>(saved_pre->data_ptr()) : 0, workspace,
          0 /* the sync words lead the workspace */};
      run(p, addresses, stream, status, info);
    } catch (...) {
      slots(device).free.push_back(slot);  // nothing was launched on it
      throw;
    }
    const uint64_t id = next_id_++;
    pending_.push_back({id, device, slot, plan, block, {info[0], info[1], info[2]}, thread});
    Last latest;
    latest.id = id;
    latest.device = device;
    latest.plan = std::move(plan);
    latest.block = block;
    std::memcpy(latest.info, info, sizeof(info));
    std::swap(last_[thread], latest);  // the previous one is released after, holding no reference into last_
    return py::make_tuple(std::move(y), std::move(block));
  }

  // Whether `launch` could run on x's device and stream now (its other conditions aside).
  static bool launchable(const NativePlan& p, const at::Tensor& x) {
    int64_t device;
    uintptr_t stream;
    return current_stream(p, x, device, stream);
  }

  // Every launch queued here, oldest first, handed to the Python queue: (launch id, device, slot, plan,
  // routing block, (grid, blocks per SM, smem bytes), thread serial, whether it is its thread's latest).
  py::list take() {
    // Emptied first, then turned into Python objects.
    std::deque<Pending> taken;
    taken.swap(pending_);
    std::vector<bool> latest(taken.size());
    std::vector<Last> handed;  // released after the map is consistent
    for (size_t i = 0; i < taken.size(); ++i) {
      auto last = last_.find(taken[i].thread);
      latest[i] = last != last_.end() && last->second.id == taken[i].id;
      if (latest[i]) {  // the Python side holds its report from now on
        handed.push_back(std::move(last->second));
        last_.erase(last);
      }
    }
    py::list out;
    for (size_t i = 0; i < taken.size(); ++i) {
      const Pending& e = taken[i];
      out.append(py::make_tuple(e.id, e.device, e.slot, e.plan, e.block, py::make_tuple(e.info[0], e.info[1], e.info[2]),
                                e.thread, static_cast<bool>(latest[i])));
    }
    return out;
  }

  // Thread `thread`'s latest launch made here if it was retired here (checked clean), else None:
  // (launch id, device, plan, routing block, info, status bytes). Forgotten once returned.
  py::object take_retired_last(uint64_t thread) {
    auto it = last_.find(thread);
    if (it == last_.end() || !it->second.retired) return py::none();
    const Last l = std::move(it->second);
    last_.erase(it);  // before any Python object is made
    return py::make_tuple(l.id, l.device, l.plan, l.block, py::make_tuple(l.info[0], l.info[1], l.info[2]),
                          py::bytes(l.raw));
  }

  // A thread that ended: its latest launch is nobody's to ask for.
  void forget_thread(uint64_t thread) {
    auto it = last_.find(thread);
    if (it == last_.end()) return;
    const Last gone = std::move(it->second);
    last_.erase(it);
  }

 private:
  struct Slots {
    int64_t device;
    uint8_t* base;
    std::vector<int> free;
  };

  Slots* find_slots(int64_t device) {
    for (Slots& s : devices_)
      if (s.device == device) return &s;
    return nullptr;
  }
  Slots& slots(int64_t device) {
    Slots* s = find_slots(device);
    if (s == nullptr) throw std::invalid_argument("device " + std::to_string(device) + ": no status slots added");
    return *s;
  }

  const uint8_t* slot_address(const Pending& e) {
    return slots(e.device).base + e.slot * layout_.slot_bytes;
  }
  // The kernel stores the completion word last (st.release.sys); reading it with acquire orders the
  // status block's reads after it.
  bool done(const uint8_t* status) const {
    return reinterpret_cast<const std::atomic<uint32_t>*>(status + layout_.done_word)->load(std::memory_order_acquire) != 0;
  }
  bool clean(const uint8_t* status) const {
    uint64_t error;
    uint32_t flags;
    std::memcpy(&error, status + layout_.error_word, sizeof(error));
    std::memcpy(&flags, status + layout_.status_flags, sizeof(flags));
    return error == 0 && flags == 0;
  }

  void retire(Pending& e) {
    auto last = last_.find(e.thread);
    if (last != last_.end() && last->second.id == e.id) {  // last_report() may still ask for its status
      last->second.retired = true;
      last->second.raw.assign(reinterpret_cast<const char*>(slot_address(e)), layout_.block_bytes);
    }
    release(e.device, e.slot);
  }

  // x's device (-1: the CPU stand-in's) and the stream a launch there goes to, as torch has them current:
  // asked per call (the user may switch either between calls), through torch's device guard for CUDA
  // (libtorch_cuda registers it) and the kernel module for the capture state.
  static bool current_stream(const NativePlan& p, const at::Tensor& x, int64_t& device, uintptr_t& stream) {
    if (p.entry == nullptr) {  // the CPU stand-in (tests/fake_cuda.py) answers from Python
      const py::object current = p.python_stream();
      if (current.is_none()) return false;
      device = x.is_cpu() ? -1 : x.device().index();
      stream = current.cast<uintptr_t>();
      return true;
    }
    if (!x.is_cuda()) return false;
    const c10::impl::DeviceGuardImplInterface* guard = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
    const c10::Device here = guard->getDevice();
    if (here.index() != x.device().index()) return false;
    stream = native_stream(guard, here);
    if (p.entry->capturing(stream) != 0) return false;
    device = here.index();
    return true;
  }

  // The current stream's cudaStream_t: from c10::Stream::native_handle where this torch has it (newer
  // than some torch versions this module builds against), else from torch's own Python binding.
  template <typename Stream = c10::Stream>
  static uintptr_t native_stream(const c10::impl::DeviceGuardImplInterface* guard, c10::Device device) {
    if constexpr (HasNativeHandle<Stream>::value) {
      return reinterpret_cast<uintptr_t>(static_cast<const Stream&>(guard->getStream(device)).native_handle());
    } else {
      static py::object raw = py::module_::import("torch._C").attr("_cuda_getCurrentRawStream");
      return raw(device.index()).template cast<uintptr_t>();
    }
  }
  template <typename S, typename = void>
  struct HasNativeHandle : std::false_type {};
  template <typename S>
  struct HasNativeHandle<S, std::void_t<decltype(std::declval<const S&>().native_handle())>> : std::true_type {};

  static void run(const NativePlan& p, const uintptr_t* addresses, uintptr_t stream, uintptr_t status, int* info) {
    if (p.entry != nullptr) {
      char error[512];
      int code;
      {
        // As the kernel module's own binding does: a first launch of a kernel loads it, and a full
        // launch queue blocks; other threads (a stream callback's among them) go on meanwhile.
        py::gil_scoped_release released;
        code = p.entry->launch(p.prepared, addresses, kOneRankAddresses, 1, stream, status, info, error, sizeof(error));
      }
      if (code == kNativeLaunchInvalidArgument) throw std::invalid_argument(error);
      if (code != kNativeLaunchOk) throw std::runtime_error(error);
      return;
    }
    py::list list(kOneRankAddresses);
    for (int i = 0; i < kOneRankAddresses; ++i) list[i] = py::int_(addresses[i]);
    const py::tuple got = p.python_launch(p.prepared_object, list, 1, stream, status);
    for (int i = 0; i < 3; ++i) info[i] = got[i].cast<int>();
  }

  Layout layout_;
  std::vector<Slots> devices_;
  std::deque<Pending> pending_;
  std::unordered_map<uint64_t, Last> last_;
  uint64_t next_id_ = 1;
};

// `stream`: with a Python `launcher` (the CPU stand-in), a callable giving the current stream, or None
// while a graph is captured; unused with the kernel module's capsule.
inline NativePlan make_plan(py::object launcher, py::object prepared, py::object workspaces, int64_t routing_words,
                            int64_t routing_stride, int64_t stride, int64_t sync_bytes, py::object stream) {
  NativePlan p;
  if (PyCapsule_CheckExact(launcher.ptr())) {
    p.entry = static_cast<const NativeForwardEntry*>(PyCapsule_GetPointer(launcher.ptr(), kNativeForwardCapsule));
    if (p.entry == nullptr) throw py::error_already_set();
    p.prepared = reinterpret_cast<void*>(prepared.attr("address").cast<uintptr_t>());
  } else if (PyCallable_Check(launcher.ptr())) {
    if (!PyCallable_Check(stream.ptr()))
      throw std::invalid_argument("stream: expected a callable giving the current stream with a Python launcher");
    p.python_launch = launcher;
    p.python_stream = std::move(stream);
  } else {
    throw std::invalid_argument("launcher: expected the kernel module's native_forward capsule or a callable");
  }
  p.prepared_object = std::move(prepared);
  p.workspaces = workspaces.cast<WorkspaceTable*>();
  p.workspace_owner = std::move(workspaces);
  p.routing_words = routing_words;
  p.routing_stride = routing_stride;
  p.stride = stride;
  p.sync_bytes = sync_bytes;
  return p;
}

}  // namespace flashdmoe

