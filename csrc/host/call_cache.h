// flashdmoe.moe's remembered calls (flashdmoe/api.py): a call whose tensors and options match one that
// passed every check goes straight to its prepared launch. What is compared is what a check or the
// launch plan reads: x's shape, dtype, device and contiguity; each weight's address, shape, strides, dtype
// and version counter (an in-place update is a new version: its values are scanned again); the six
// options by type and value. A weight's address also fixes its device (CUDA's unified address space).
//
// `launch` also runs a remembered call's eager launch, for the common case, through the launch queue
// (launch_queue.h) in the same Python call: the whole of flashdmoe.moe's steady state in C++.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/Storage.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <cstdint>
#include <functional>
#include <optional>
#include <unordered_map>
#include <vector>
#include "host/launch_queue.h"

namespace flashdmoe {

namespace py = pybind11;

class CallCache {
 public:
  static constexpr int kOptions = 6;  // top_k, activation, normalize_topk, capacity_factor, backend, return_aux

  // `epoch`: flashdmoe.weight_checks' epoch object (its `value`); `status`: the module
  // flashdmoe.kernel.status_checks (its `_state` and `native_launches`); `validation`: the module
  // flashdmoe.validation (its `check_finite_input`). Without them `launch` only looks up.
  explicit CallCache(size_t limit, py::object epoch = py::none(), py::object status = py::none(),
                     py::object validation = py::none())
      : limit_(limit), epoch_(std::move(epoch)), status_(std::move(status)), validation_(std::move(validation)) {}

  // flashdmoe.moe's steady state: the remembered call for these arguments launched here, returning `y`,
  // when the Python path would do no more than launch it from C++ (api.moe's checks on a remembered call,
  // then status_checks.launch_native's): the same weight objects' storages alive, the weight checks'
  // epoch and the debug knobs the call's, no autograd, no aux, and nothing for the Python queue to
  // check first. A CPU input (the stand-in's) is scanned as the Python path scans it (which raises). Otherwise returns the remembered call (or None) for the
  // Python path, with nothing done.
  py::object launch(py::handle x, py::handle router, py::handle w1, py::handle w2, const py::args& options) {
    const at::Tensor* t[4];
    if (!tensors({x, router, w1, w2}, t) || options.size() != kOptions) return py::none();
    std::pair<int, py::object> found;
    Fast fast;
    try {
      found = lookup(t, options, /*with_versions=*/true);
      if (found.first < 0) return py::none();
      // Copied out before any Python code runs (which may change entries_).
      fast = entries_.find(hash(t))->second[found.first].fast;
      for (int i = 0; i < 3; ++i) {
        const c10::StorageImpl* now = t[i + 1]->storage().unsafeGetStorageImpl();
        if (!fast.storages[i] || fast.storages[i]->expired() || fast.storages[i]->_unsafe_get_target() != now)
          return found.second;
      }
    } catch (const c10::Error&) {
      return py::none();
    }
    py::object call = std::move(found.second);
    if (!fast.usable || options[kOptions - 1].ptr() != Py_False) return call;  // return_aux: built in Python
    const at::Tensor& xt = *t[0];
    if (at::GradMode::is_enabled() &&
        (xt.requires_grad() || t[1]->requires_grad() || t[2]->requires_grad() || t[3]->requires_grad()))
      return call;
    if (!same(fast.epoch, epoch_.attr("value")) || !same(fast.generation, fast.debug.attr("generation"))) return call;
    if (fast.scan_input) validation_.attr("check_finite_input")(x);
    // status_checks.launch_native's conditions, read from the same state (keep the two in step).
    if (!truthy(status_.attr("native_launches"))) return call;
    py::object state = status_.attr("_state");
    if (truthy(state.attr("sync_checks")) || truthy(state.attr("graph_low")) || truthy(state.attr("pending")))
      return call;
    py::object queue = state.attr("queue");
    py::object serial = py::getattr(state.attr("local"), "serial", py::none());  // set by the thread's first launch
    if (queue.is_none() || serial.is_none()) return call;
    py::object launched = queue.cast<LaunchQueue&>().launch(fast.native.cast<const NativePlan&>(), fast.plan, xt,
                                                           *t[1], *t[2], *t[3], std::nullopt, serial.cast<uint64_t>());
    if (launched.is_none()) return call;
    return launched.cast<py::tuple>()[0];
  }

  // The remembered call for these arguments, or None (also for arguments that are not tensors).
  py::object find(py::handle x, py::handle router, py::handle w1, py::handle w2, const py::args& options) const {
    const at::Tensor* t[4];
    if (!tensors({x, router, w1, w2}, t) || options.size() != kOptions) return py::none();
    try {
      return lookup(t, options, /*with_versions=*/true).second;
    } catch (const c10::Error&) {  // a tensor without storage or strides: the checks say what is wrong
      return py::none();
    }
  }

  // Remember `call` for the arguments that follow it (a call that passed every check); false if they
  // cannot be remembered (not tensors, no storage). An entry for the same call with other weight
  // versions is replaced (a weight updated in place: the old versions do not come back). Past `limit`
  // entries, everything is forgotten first.
  bool remember(py::object call, py::handle x, py::handle router, py::handle w1, py::handle w2,
                const py::args& options) {
    const at::Tensor* t[4];
    if (!tensors({x, router, w1, w2}, t) || options.size() != kOptions) return false;
    Entry e;
    size_t hash_value;
    std::pair<int, py::object> old;
    try {
      e.fast = fast_path(call, t);  // first: it reads Python attributes, and the lookup below must be the last
      e.x_sizes.assign(t[0]->sizes().begin(), t[0]->sizes().end());
      e.x_dtype = t[0]->scalar_type();
      e.x_device = t[0]->device();
      e.x_contiguous = t[0]->is_contiguous();
      for (int i = 0; i < 3; ++i) {
        const at::Tensor& w = *t[i + 1];
        Weight& k = e.weights[i];
        k.address = w.data_ptr();
        k.sizes.assign(w.sizes().begin(), w.sizes().end());
        k.strides.assign(w.strides().begin(), w.strides().end());
        k.dtype = w.scalar_type();
        k.version = version(w);
      }
      hash_value = hash(t);
      if (size_ >= limit_) clear();
      old = lookup(t, options, /*with_versions=*/false);
    } catch (const c10::Error&) {  // a tensor without storage or strides
      return false;
    }
    for (int i = 0; i < kOptions; ++i) e.options[i] = py::reinterpret_borrow<py::object>(options[i]);
    e.call = std::move(call);
    auto& bucket = entries_[hash_value];
    ++generation_;
    if (old.first >= 0) {
      std::swap(bucket[old.first], e);  // the replaced entry is released below, after the map is consistent
      return true;
    }
    bucket.push_back(std::move(e));
    ++size_;
    return true;
  }

  void clear() {
    std::unordered_map<size_t, std::vector<Entry>> gone;  // released after the map is consistent
    gone.swap(entries_);
    size_ = 0;
    ++generation_;
  }
  size_t size() const { return size_; }

 private:
  struct Weight {
    const void* address = nullptr;
    std::vector<int64_t> sizes, strides;
    at::ScalarType dtype = at::ScalarType::Undefined;
    int64_t version = 0;
  };
  // What `launch` reads of a remembered call (flashdmoe.api._Call), read once when it is remembered: the
  // call's fields do not change. `usable` false: the call is not one `launch` can run (the Python path will).
  struct Fast {
    bool usable = false;
    py::object plan, native, debug, epoch, generation;
    bool scan_input = false;
    // The weights' storages (alive: the addresses compared on a hit are not recycled ones).
    std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>> storages[3];
  };
  struct Entry {
    std::vector<int64_t> x_sizes;
    at::ScalarType x_dtype = at::ScalarType::Undefined;
    c10::Device x_device{c10::kCPU};
    bool x_contiguous = false;
    Weight weights[3];
    py::object options[kOptions];
    py::object call;
    Fast fast;
  };

  Fast fast_path(const py::object& call, const at::Tensor* const* t) const {
    Fast f;
    for (int i = 0; i < 3; ++i) f.storages[i] = t[i + 1]->storage().getWeakStorageImpl();
    if (epoch_.is_none() || status_.is_none() || validation_.is_none()) return f;
    try {
      f.plan = call.attr("plan");
      f.native = f.plan.attr("native");
      f.debug = call.attr("backend").attr("debug");
      f.epoch = call.attr("epoch");
      f.generation = f.plan.attr("generation");
      f.scan_input = truthy(call.attr("scan_input"));
      f.usable = !f.native.is_none() && py::isinstance<NativePlan>(f.native);
    } catch (py::error_already_set&) {  // not a call `launch` can run: the Python path takes it
      f.usable = false;
    }
    return f;
  }

  static bool tensors(std::initializer_list<py::handle> objects, const at::Tensor** out) {
    int i = 0;
    for (py::handle o : objects) {
      if (!THPVariable_Check(o.ptr())) return false;
      out[i++] = &THPVariable_Unpack(o.ptr());
    }
    return true;
  }
  // Inference tensors have no version counter (flashdmoe.weight_checks keys them as -1).
  static int64_t version(const at::Tensor& w) { return w.is_inference() ? -1 : w._version(); }

  static size_t hash(const at::Tensor* const* t) {
    size_t h = std::hash<int64_t>{}(t[0]->dim());
    auto mix = [&h](size_t v) { h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2); };
    for (int64_t s : t[0]->sizes()) mix(std::hash<int64_t>{}(s));
    for (int i = 1; i < 4; ++i) mix(std::hash<const void*>{}(t[i]->data_ptr()));
    return h;
  }

  static bool truthy(const py::object& o) {
    const int value = PyObject_IsTrue(o.ptr());
    if (value < 0) throw py::error_already_set();
    return value == 1;
  }
  static bool same(const py::object& a, const py::object& b) {
    const int equal = PyObject_RichCompareBool(a.ptr(), b.ptr(), Py_EQ);
    if (equal < 0) throw py::error_already_set();
    return equal == 1;
  }

  static bool same_option(py::handle mine, py::handle given) {
    if (Py_TYPE(mine.ptr()) != Py_TYPE(given.ptr())) return false;
    const int equal = PyObject_RichCompareBool(mine.ptr(), given.ptr(), Py_EQ);
    if (equal < 0) {
      PyErr_Clear();
      return false;
    }
    return equal == 1;
  }

  static bool same_tensors(const Entry& e, const at::Tensor* const* t, bool with_versions) {
    const at::Tensor& x = *t[0];
    if (x.sizes() != at::IntArrayRef(e.x_sizes) || x.scalar_type() != e.x_dtype || x.device() != e.x_device ||
        x.is_contiguous() != e.x_contiguous)
      return false;
    for (int i = 0; i < 3; ++i) {
      const at::Tensor& w = *t[i + 1];
      const Weight& k = e.weights[i];
      if (w.data_ptr() != k.address || w.sizes() != at::IntArrayRef(k.sizes) ||
          w.strides() != at::IntArrayRef(k.strides) || w.scalar_type() != k.dtype ||
          (with_versions && version(w) != k.version))
        return false;
    }
    return true;
  }

  // (index in its bucket, call) of the entry for these arguments, or (-1, None). Comparing an option
  // may run Python code (and another thread's remember or clear): the options are compared on copies,
  // and the search starts again if the map changed meanwhile.
  std::pair<int, py::object> lookup(const at::Tensor* const* t, const py::args& options, bool with_versions) const {
    for (;;) {
      auto bucket = entries_.find(hash(t));
      if (bucket == entries_.end()) return {-1, py::none()};
      const uint64_t seen = generation_;
      bool changed = false;
      for (size_t i = 0; !changed && i < bucket->second.size(); ++i) {  // not a look at bucket once changed
        const Entry& e = bucket->second[i];
        if (!same_tensors(e, t, with_versions)) continue;
        py::object mine[kOptions];
        for (int j = 0; j < kOptions; ++j) mine[j] = e.options[j];
        py::object call = e.call;
        bool same = true;
        for (int j = 0; j < kOptions && same; ++j) same = same_option(mine[j], options[j]);
        if (generation_ != seen) {
          changed = true;
        } else if (same) {
          return {static_cast<int>(i), call};
        }
      }
      if (!changed) return {-1, py::none()};
    }
  }

  size_t limit_;
  py::object epoch_, status_, validation_;
  size_t size_ = 0;
  uint64_t generation_ = 0;  // bumped by every change of entries_
  std::unordered_map<size_t, std::vector<Entry>> entries_;
};

}  // namespace flashdmoe
